"""flex_attention under torch.autocast, with SDPA's policy, on the CPU.

Under autocast, RoPE hands attention float32 q/k and a bfloat16 v. flex_attention casts every
float16/bfloat16/float32 input to the autocast dtype, returns that dtype, and gradients reach
the original tensors in their own dtypes. Outside autocast, mixed dtypes raise ValueError
(test_api_errors). Sizes: L = S = 200 over 64-blocks (ragged, several blocks), GQA 4/2.
"""
import pytest
import torch

from flexjit import create_block_mask
from flexjit.api.attention import flex_attention
from flexjit import mods
from oracle import FLOOR, assert_close_to_oracle, dense_attention

B, HQ, HKV, L, S, E = 2, 4, 2, 200, 200, 32
SLOPES = mods.alibi_slopes(HQ)


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _inputs(seed, dtypes):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, HQ, L, E), (B, HKV, S, E), (B, HKV, S, E)]
    return [torch.randn(s, generator=g).to(dt).requires_grad_(True) for s, dt in zip(shapes, dtypes)]


def _loss_grads(out, inputs, g_out):
    return torch.autograd.grad((out.double() * g_out).sum(), inputs)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32, torch.bfloat16),
                                    (torch.float32, torch.float32, torch.float32)])
def test_autocast_casts_mixed_inputs_and_returns_the_autocast_dtype(dtypes):
    q, k, v = _inputs(1, dtypes)
    bm = create_block_mask(causal, None, None, L, S, device="cpu", BLOCK_SIZE=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flex_attention(q, k, v, score_mod=alibi, block_mask=bm, enable_gqa=True)
    assert out.dtype == torch.bfloat16 and out.shape == (B, HQ, L, E)

    # The oracle sees exactly what autocast hands attention: the inputs rounded to bfloat16.
    cast = [t.detach().bfloat16() for t in (q, k, v)]
    leaves64 = [t.double().requires_grad_(True) for t in cast]
    leaves16 = [t.clone().requires_grad_(True) for t in cast]
    ref = dense_attention(*leaves64, alibi, causal, dtype=torch.float64)[0]
    low = dense_attention(*leaves16, alibi, causal, dtype=torch.bfloat16)[0]
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.bfloat16])

    g_out = torch.randn(out.shape, dtype=torch.float64)
    got = _loss_grads(out, [q, k, v], g_out)
    want = _loss_grads(ref, leaves64, g_out)
    lowg = _loss_grads(low, leaves16, g_out)
    for label, t, a, b_, c in zip(("dq", "dk", "dv"), (q, k, v), got, want, lowg):
        assert a.dtype == t.dtype, f"{label} arrives in {a.dtype}, its tensor is {t.dtype}"
        assert_close_to_oracle(label, a, b_, c, FLOOR[torch.bfloat16] * max(1.0, b_.abs().max().item()))


def test_backends_run_outside_autocast():
    # The reference computes in float32 internally; were autocast left on inside it, its matmuls
    # would run in bfloat16. On inputs already in the autocast dtype the result must therefore be
    # bit-identical with and without autocast.
    q, k, v = [t.detach() for t in _inputs(2, (torch.bfloat16,) * 3)]
    plain = flex_attention(q, k, v, score_mod=alibi, enable_gqa=True, return_lse=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = flex_attention(q, k, v, score_mod=alibi, enable_gqa=True, return_lse=True)
    for a, b_ in zip(plain, cast):
        assert torch.equal(a, b_)


def test_float64_is_left_alone_and_mixes_are_refused():
    # autocast never casts float64 (SDPA's policy), so float64 with a float32 tensor stays mixed.
    q, k, v = [t.detach() for t in _inputs(3, (torch.float64,) * 3)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flex_attention(q, k, v, enable_gqa=True)
        assert out.dtype == torch.float64
        with pytest.raises(ValueError, match="share a dtype"):
            flex_attention(q, k, v.float(), enable_gqa=True)
    ref = dense_attention(q, k, v)[0]
    assert (out - ref).abs().max().item() < 1e-12
