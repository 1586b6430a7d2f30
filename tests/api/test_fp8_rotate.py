"""flexjit.fp8.hadamard_rotate on the CPU: it is Sylvester's normalised Hadamard matrix (times the
signs), orthogonal, leaves q·k and hence attention unchanged, and spreads outlier channels so that
e4m3 attention of rotated q, k errs less. Sizes: head dims 1-128 (powers of two, the supported
set, up to flexjit's largest common D); attention at B 1, 4 query heads on 2 kv heads, 64 queries
against 96 keys, D 64: quick, yet enough scores for the error norms to be stable.
"""
import math

import pytest
import torch

from flexjit import create_block_mask, flex_attention
from flexjit.fp8 import hadamard_rotate
from oracle import dense_attention, fp8_reference, quantize_e4m3


def _sylvester(D: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(D)


@pytest.mark.parametrize("D", [1, 2, 8, 64, 128])
def test_it_is_the_normalised_sylvester_matrix(D):
    g = torch.Generator().manual_seed(D)
    x = torch.randn(3, 5, D, dtype=torch.float64, generator=g)
    signs = torch.where(torch.rand(D, generator=g) < 0.5, -1.0, 1.0)
    eps = 8 * D * torch.finfo(torch.float64).eps  # log2(D) adds, well inside this
    assert torch.allclose(hadamard_rotate(x), x @ _sylvester(D), rtol=0, atol=eps * x.abs().max())
    want = (x * signs) @ _sylvester(D)
    assert torch.allclose(hadamard_rotate(x, signs), want, rtol=0, atol=eps * x.abs().max())


@pytest.mark.parametrize("D", [16, 128])
def test_orthogonal_and_dot_products_unchanged(D):
    eye = torch.eye(D, dtype=torch.float64)
    r = hadamard_rotate(eye)  # the matrix itself
    tol = 8 * D * torch.finfo(torch.float64).eps
    assert (r @ r.T - eye).abs().max() <= tol
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 3, 40, D, generator=g) for _ in range(2))
    exact = q.double() @ k.double().transpose(-1, -2)
    got = hadamard_rotate(q) @ hadamard_rotate(k).transpose(-1, -2)  # float32 in, float32 out
    assert got.dtype == torch.float32
    # float32 rounding: log2(D) butterflies and a D-term dot, each a few ulps of |q||k|
    norms = q.double().norm(dim=-1, keepdim=True) * k.double().norm(dim=-1).unsqueeze(-2)
    bound = 4 * (math.log2(D) + D) * torch.finfo(torch.float32).eps * norms
    assert ((got.double() - exact).abs() <= bound).all()


def test_attention_of_rotated_q_and_k_is_unchanged():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 64, 64, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, 2, 96, 64, dtype=torch.float64, generator=g) for _ in range(2))
    signs = torch.where(torch.rand(64, generator=g) < 0.5, -1.0, 1.0)

    def causal(b, h, q_idx, kv_idx):
        return q_idx + 32 >= kv_idx
    true, _ = dense_attention(q, k, v, None, causal)
    bm = create_block_mask(causal, None, None, 64, 96, device="cpu", BLOCK_SIZE=32)
    got = flex_attention(hadamard_rotate(q, signs), hadamard_rotate(k, signs), v, block_mask=bm,
                         enable_gqa=True)
    # float64 throughout: the rotation's rounding (~1e-15 of |q||k| per score) is all that differs
    assert (got - true).abs().max() <= 1e-12


def test_rotation_lowers_the_fp8_error_on_outlier_channels():
    """Four channels of q and k ×30: e4m3 attention of the rotated q, k errs less (FA3's claim;
    about 6× less in the L2 norm on this data, asserted at 2×)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 64, 64, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, 2, 96, 64, dtype=torch.float64, generator=g) for _ in range(2))
    q[..., [3, 17, 40, 60]] *= 30
    k[..., [3, 17, 40, 60]] *= 30
    true, _ = dense_attention(q, k, v)

    def fp8_error(qq, kk):
        (q8, qd), (k8, kd), (v8, vd) = quantize_e4m3(qq, 2), quantize_e4m3(kk), quantize_e4m3(v)
        out, _ = fp8_reference(q8, k8, v8, (qd, kd, vd))
        return float((out.double() - true).norm() / true.norm())
    plain = fp8_error(q, k)
    rotated = fp8_error(hadamard_rotate(q).double(), hadamard_rotate(k).double())
    assert rotated < 0.5 * plain, (rotated, plain)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="power-of-two last dimension, got 96; pad .* to 128"):
        hadamard_rotate(torch.ones(2, 96))
    with pytest.raises(ValueError, match=r"signs must be a \(8,\) tensor of \+1 and -1"):
        hadamard_rotate(torch.ones(2, 8), signs=torch.full((8,), 0.5))
    with pytest.raises(ValueError, match="signs must be"):
        hadamard_rotate(torch.ones(2, 8), signs=torch.ones(4))
