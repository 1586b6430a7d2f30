"""The reference backend against the float64 oracle: every core mod, output, LSE and
every gradient, over GQA, Q_LEN != KV_LEN, ragged lengths and several block sizes."""
import math

import pytest
import torch

from flexjit import create_block_mask
from flexjit.api.attention import flex_attention
from oracle import FLOOR, assert_close_to_oracle, dense_attention, random_qkv
from mods_catalog import CORE, POINTWISE, case_and_oracle, make_case




def _grads(out, lse, inputs, g_out, g_lse):
    finite = torch.isfinite(lse)
    loss = (out.double() * g_out).sum() + (torch.where(finite, lse.double(), 0) * g_lse).sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def check_against_oracle(name, B, Hq, Hkv, L, S, E, Ev, dtype, block_size, backend="reference", seed=0):
    torch.manual_seed(seed)
    case = make_case(name, B, Hq, L, S, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    q, k, v = random_qkv(B, Hq, Hkv, L, S, E, Ev, dtype, seed)
    bm = None
    if case.mask_mod is not None:
        bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cpu", BLOCK_SIZE=block_size)
    out, lse = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=Hq != Hkv,
                              return_lse=True, backend=backend)
    assert out.dtype == dtype and out.shape == (B, Hq, L, Ev)
    ref, ref_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=torch.float64)
    low, low_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=dtype)
    floor = FLOOR[dtype]
    assert_close_to_oracle(f"{name} out", out, ref, low, floor)
    assert_close_to_oracle(f"{name} lse", lse, ref_lse, low_lse, floor)
    # gradients of a random linear function of out and lse
    g_out = torch.randn(out.shape, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, dtype=torch.float64)
    inputs = [q, k, v, *case.learnable]
    got = _grads(out, lse, inputs, g_out, g_lse)
    want = _grads(ref, ref_lse, inputs, g_out, g_lse)
    lowg = _grads(low, low_lse, inputs, g_out, g_lse)
    for label, a, b_, c in zip(["dq", "dk", "dv"] + [f"d_captured{i}" for i in range(len(case.learnable))],
                               got, want, lowg):
        assert a is not None, f"{name}: no gradient for {label}"
        scale = max(1.0, b_.abs().max().item())
        assert_close_to_oracle(f"{name} {label}", a, b_, c, floor * scale)


@pytest.mark.parametrize("name", CORE)
def test_core_mods_float64(name):
    # float64 end to end: the reference must match the oracle to rounding.
    # L=200, S=328 with 64-blocks: Q_LEN != KV_LEN, ragged in both, several blocks each way.
    check_against_oracle(name, B=2, Hq=4, Hkv=2, L=200, S=328, E=32, Ev=24, dtype=torch.float64,
                         block_size=64)


@pytest.mark.parametrize("name", ["causal", "document", "alibi", "softcap", "learnable_bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision(name, dtype):
    check_against_oracle(name, B=1, Hq=4, Hkv=4, L=300, S=300, E=64, Ev=64, dtype=dtype, block_size=128)


@pytest.mark.parametrize("block_size", [128, 256, (256, 128)])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "natten_2d"])
def test_block_sizes(name, block_size):
    # 600 tokens: ragged for every block size, more than two blocks of 256.
    check_against_oracle(name, B=1, Hq=2, Hkv=1, L=600, S=600, E=16, Ev=16, dtype=torch.float64,
                         block_size=block_size)


def test_fully_masked_rows_give_zero_and_no_nan():
    B, H, L, S, E = 1, 2, 96, 96, 16
    q, k, v = random_qkv(B, H, H, L, S, E, E, torch.float32, 3)

    def only_even_rows(b, h, q_idx, kv_idx):
        return (q_idx % 2 == 0) & (kv_idx <= q_idx)
    bm = create_block_mask(only_even_rows, B, H, L, S, device="cpu", BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    odd = torch.arange(L) % 2 == 1
    assert torch.equal(out[:, :, odd], torch.zeros_like(out[:, :, odd]))
    assert torch.isneginf(lse[:, :, odd]).all() and torch.isfinite(lse[:, :, ~odd]).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, odd], torch.zeros_like(q.grad[:, :, odd]))


def test_lse_merge_of_disjoint_masks_equals_union():
    # Property: attention over A ∪ B equals the LSE-weighted merge of attention over A and over B.
    B, H, L, S, E = 1, 2, 128, 160, 16
    q, k, v = [t.detach() for t in random_qkv(B, H, H, L, S, E, E, torch.float64, 4)]

    def left(b, h, q_idx, kv_idx):
        return kv_idx < 70

    def right(b, h, q_idx, kv_idx):
        return kv_idx >= 70
    outs = [flex_attention(q, k, v, block_mask=create_block_mask(m, B, H, L, S, device="cpu", BLOCK_SIZE=32),
                           return_lse=True) for m in (left, right)]
    (oa, la), (ob, lb) = outs
    lse = torch.logaddexp(la, lb)
    merged = oa * torch.exp(la - lse).unsqueeze(-1) + ob * torch.exp(lb - lse).unsqueeze(-1)
    full, full_lse = flex_attention(q, k, v, return_lse=True)
    assert torch.allclose(merged, full, atol=1e-12) and torch.allclose(lse, full_lse, atol=1e-12)


def test_long_sequence_runs_in_bounded_memory():
    # S = 16k on the CPU: the dense (L, S) score matrix of one head alone would be 1 GiB in fp32
    # for L = S = 16k; chunking over query rows keeps the peak far below that. We check values on
    # a slice of rows against the oracle run on the same slice.
    L = S = 16384
    E = 16
    q, k, v = [t.detach() for t in random_qkv(1, 1, 1, L, S, E, E, torch.float32, 5)]
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, L, S, device="cpu")
    out = flex_attention(q, k, v, block_mask=bm)
    rows = slice(L - 64, L)
    ref, _ = dense_attention(q[:, :, rows], k, v, mask_mod=lambda b, h, qi, ki: (qi + L - 64) >= ki)
    assert (out[:, :, rows].double() - ref).abs().max().item() < 1e-5


def test_scale_and_default_scale():
    q, k, v = [t.detach() for t in random_qkv(1, 2, 2, 64, 64, 32, 32, torch.float64, 6)]
    for scale in (None, 0.37):
        out = flex_attention(q, k, v, scale=scale)
        ref, _ = dense_attention(q, k, v, scale=scale)
        assert (out - ref).abs().max().item() < 1e-12
    default = flex_attention(q, k, v)
    explicit = flex_attention(q, k, v, scale=1 / math.sqrt(32))
    assert torch.equal(default, explicit)


@pytest.mark.parametrize("name", sorted(POINTWISE))
def test_pointwise_ops_float64(name):
    # The pointwise ops on the reference backend, float64 end to end: rounding only.
    mod = POINTWISE[name]
    q, k, v = random_qkv(1, 2, 2, 70, 50, 16, 16, torch.float64, 3)
    out, lse = flex_attention(q, k, v, score_mod=mod, return_lse=True, backend="reference")
    ref, ref_lse = dense_attention(q, k, v, mod, None, dtype=torch.float64)
    assert_close_to_oracle("out", out, ref, ref, FLOOR[torch.float64])
    assert_close_to_oracle("lse", lse, ref_lse, ref_lse, FLOOR[torch.float64])
    g = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad((out * g).sum(), [q, k, v])
    want = torch.autograd.grad((ref * g).sum(), [q, k, v])
    for label, a, b in zip(("dq", "dk", "dv"), got, want):
        assert_close_to_oracle(label, a, b, b, FLOOR[torch.float64] * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("scale", [0.0, -0.0, -0.3])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "learnable_alibi", "softcap"])
def test_nonpositive_scales(name, scale):
    """The reference takes any scale as torch defines it (the CuTe forwards refuse one <= 0
    without a score_mod, and Triton runs it): at 0 every score is score_mod(0) and no gradient
    reaches q or k; below 0 the largest q·k is the smallest score. Out, lse and every gradient
    against the float64 oracle."""
    B, Hq, Hkv, L, S, E = 2, 4, 2, 40, 56, 16
    case, oracle = case_and_oracle(name, B, Hq, L, S)
    q, k, v = random_qkv(B, Hq, Hkv, L, S, E, E, torch.float32, seed=1)
    bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cpu") if case.mask_mod else None
    out, lse = flex_attention(q, k, v, case.score_mod, bm, scale=scale, enable_gqa=True,
                              return_lse=True, backend="reference")
    ref, ref_lse = dense_attention(q, k, v, oracle.score_mod, oracle.mask_mod, scale=scale)
    low, low_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, scale=scale,
                                   dtype=torch.float32)
    floor = FLOOR[torch.float32]
    assert_close_to_oracle("out", out, ref, low, floor)
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, floor)
    g = torch.Generator().manual_seed(2)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    got = _grads(out, lse, [q, k, v, *case.learnable], g_out, g_lse)
    want = _grads(ref, ref_lse, [q, k, v, *oracle.learnable], g_out, g_lse)
    lowg = _grads(low, low_lse, [q, k, v, *case.learnable], g_out, g_lse)
    for label, a, b, c in zip(["dq", "dk", "dv", "dslopes"], got, want, lowg):
        assert_close_to_oracle(label, a, b, c, floor * max(1.0, b.abs().max().item()))
    if scale == 0:
        assert torch.equal(got[0], torch.zeros_like(q)) and torch.equal(got[1], torch.zeros_like(k))
