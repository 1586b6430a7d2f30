"""A scale of 0 or below: softmax over q·k·scale as torch defines it, on every backend.

The CuTe kernels stabilise a row by its largest q·k and multiply masked scores by the scale, so
``dispatch`` hands every backend a positive scale with the same scores (``positive_scale``).
Here a stand-in backend refuses any scale <= 0 and otherwise runs the reference; results are
compared with the float64 oracle at the scale the user gave. The GPU tests run the CuTe kernels
on scale 0 and below (``test_cute_gpu``, ``test_cute_sm90_bwd_gpu``).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flexjit import create_block_mask
from flexjit.api.attention import flex_attention, prepare_call
from flexjit.backends import reference
from flexjit.runtime import dispatch
from mods_catalog import case_and_oracle
from oracle import FLOOR, assert_close_to_oracle, dense_attention, random_qkv

B, Hq, Hkv, L, S, E = 2, 4, 2, 40, 56, 16


@pytest.fixture
def positive_only(monkeypatch):
    """The reference backend, refusing a scale <= 0 as a kernel that would answer NaN should."""
    seen = []

    def forward(call):
        assert call.scale > 0, f"a backend got scale {call.scale}"
        seen.append(call.scale)
        return real_forward(call)

    def backward(call, *args):
        assert call.scale > 0, f"a backend's backward got scale {call.scale}"
        return real_backward(call, *args)

    real_forward, real_backward = reference.forward, reference.backward
    monkeypatch.setattr(reference, "forward", forward)
    monkeypatch.setattr(reference, "backward", backward)
    return seen


def _grads(out, lse, inputs, seed):
    g = torch.Generator().manual_seed(seed)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    finite = torch.isfinite(lse)
    loss = (out.double() * g_out).sum() + (torch.where(finite, lse.double(), 0) * g_lse).sum()
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("scale", [0.0, -0.0, -0.3])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "learnable_alibi", "softcap"])
def test_nonpositive_scale_matches_the_oracle(positive_only, name, scale):
    case, oracle = case_and_oracle(name, B, Hq, L, S)
    q, k, v = random_qkv(B, Hq, Hkv, L, S, E, E, torch.float32, seed=1)
    bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cpu") if case.mask_mod else None
    out, lse = flex_attention(q, k, v, case.score_mod, bm, scale=scale, enable_gqa=True,
                              return_lse=True, backend="reference")
    assert positive_only == [1.0 if scale == 0 else -scale]
    ref, ref_lse = dense_attention(q, k, v, oracle.score_mod, oracle.mask_mod, scale=scale)
    low, low_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, scale=scale,
                                   dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.float32])
    inputs = [q, k, v, *case.learnable]
    got = _grads(out, lse, inputs, 2)
    want = _grads(ref, ref_lse, [q, k, v, *oracle.learnable], 2)
    lowg = _grads(low, low_lse, inputs, 2)
    for label, a, b, c in zip(["dq", "dk", "dv", "dslopes"], got, want, lowg):
        assert_close_to_oracle(label, a, b, c, FLOOR[torch.float32] * max(1.0, b.abs().max().item()))
    if scale == 0:  # every score is score_mod(0): no gradient reaches q or k
        assert torch.equal(got[0], torch.zeros_like(q)) and torch.equal(got[1], torch.zeros_like(k))


def _call(q, k, v, scale):
    return prepare_call(q, k, v, None, None, scale, False, None)


@pytest.mark.parametrize("scale", [-0.25, 0.0])
def test_the_stand_in_scores_are_the_same_bits(scale):
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.bfloat16) for _ in range(3))
    stand, dq_factor = dispatch.positive_scale(_call(q, k, v, scale))
    assert stand.scale > 0 and dq_factor == (0 if scale == 0 else -1)
    scores = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    stand_scores = torch.matmul(stand.q.double(), k.double().transpose(-1, -2)) * stand.scale
    assert torch.equal(scores, stand_scores)


@pytest.mark.parametrize("scale", [-0.25, 0.0])
def test_an_fp8_query_stands_in_exactly(scale):
    q = (torch.randn(2, 2, 5, 16) * 4).to(torch.float8_e4m3fn)
    k, v = ((torch.randn(2, 2, 5, 16)).to(torch.float8_e4m3fn) for _ in range(2))
    call = _call(q, k, v, 0.5)
    stand, _ = dispatch.positive_scale(dataclasses.replace(call, scale=scale))
    assert stand.q.dtype == q.dtype and stand.scale > 0
    assert torch.equal(stand.q.float(), -q.float() if scale < 0 else torch.zeros(q.shape))
