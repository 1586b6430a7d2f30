"""The Triton backend on a CUDA GPU, at realistic shapes.

    python -m pytest -q -m gpu tests/backends/triton/test_triton_gpu.py

* Every core mod, head dims 64 and 128, bf16, GQA, Q_LEN != KV_LEN, ragged lengths: out, LSE
  and every gradient against the float64 oracle with tolerances from the data
  (err <= 2·err(plain torch in bf16) + floor), outputs poisoned first (FLEXJIT_POISON=1).
* The USE_TMA option on the benchmark's variants.
* Long sequences (S = 16k): out and LSE on sampled query rows against a float64 oracle of those
  rows; gradients against the reference backend (fp32) by relative norm.
* Compiles are counted: a new captured scalar, a captured tensor of a new shape or a new
  sequence length reuses the compiled kernels.
* Dispatch: backend="triton" runs it; "auto" picks it on any GPU without a faster backend.
"""
import math

import pytest
import torch

import flexjit
from flexjit import create_block_mask
from flexjit.api.attention import flex_attention
from flexjit.backends import triton as tb_entry
from flexjit.backends.triton import prefill as tb
from flexjit.ir.nodes import Op, uses
from flexjit.frontend.trace import MASK_MOD, trace_mod
from mods_catalog import CORE, case_and_oracle, make_case
from oracle import FLOOR, assert_close_to_oracle, dense_attention, max_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("FLEXJIT_POISON", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _inputs(B, Hq, Hkv, L, S, E, Ev, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, Hq, L, E, generator=g, device=DEV).to(dtype).requires_grad_(True)
    k = torch.randn(B, Hkv, S, E, generator=g, device=DEV).to(dtype).requires_grad_(True)
    v = torch.randn(B, Hkv, S, Ev, generator=g, device=DEV).to(dtype).requires_grad_(True)
    return q, k, v


def _block_mask(mask_mod, B, H, L, S, block_size=128):
    if mask_mod is None:
        return None
    traced = trace_mod(mask_mod, MASK_MOD).out
    return create_block_mask(mask_mod, B if uses(traced, Op.B) else None,
                             H if uses(traced, Op.H) else None, L, S, device=DEV,
                             BLOCK_SIZE=block_size)


def _loss_grads(out, lse, inputs, g_out, g_lse):
    finite = torch.isfinite(lse)
    loss = (out.double() * g_out).sum() + (torch.where(finite, lse.double(), 0) * g_lse).sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def check(case, B, Hq, Hkv, L, S, E, Ev, dtype=torch.bfloat16, block_size=128, seed=0, oracle=None,
          kernel_options=None):
    """``oracle``: the case's float64-captures twin (``case_and_oracle``) for the float64 math."""
    oracle = oracle or case
    q, k, v = _inputs(B, Hq, Hkv, L, S, E, Ev, dtype, seed)
    bm = _block_mask(case.mask_mod, B, Hq, L, S, block_size)
    out, lse = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=Hq != Hkv,
                              return_lse=True, backend="triton", kernel_options=kernel_options)
    ref, ref_lse = dense_attention(q, k, v, oracle.score_mod, oracle.mask_mod, dtype=torch.float64)
    low, low_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=dtype)
    floor = FLOOR[dtype]
    assert_close_to_oracle("out", out, ref, low, floor)
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, floor)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    g_out = torch.randn(out.shape, generator=g, device=DEV, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=g, device=DEV, dtype=torch.float64)
    inputs = [q, k, v, *case.learnable]
    got = _loss_grads(out, lse, inputs, g_out, g_lse)
    want = _loss_grads(ref, ref_lse, [q, k, v, *oracle.learnable], g_out, g_lse)
    lowg = _loss_grads(low, low_lse, inputs, g_out, g_lse)
    for label, a, b, c in zip(["dq", "dk", "dv", "d_captured0", "d_captured1"], got, want, lowg):
        assert a is not None, f"no gradient for {label}"
        assert_close_to_oracle(label, a, b, c, floor * max(1.0, b.abs().max().item()))


# 2k keys under 1.5k queries on 8 query heads over 2 kv heads: several 128-blocks each way, the
# dense float64 oracle with its autograd graph stays within a few GB.
@pytest.mark.parametrize("E", [64, 128])
@pytest.mark.parametrize("name", CORE)
def test_core_mods(name, E):
    case, oracle = case_and_oracle(name, 2, 8, 1536, 2048, device=DEV, seed=0)
    check(case, B=2, Hq=8, Hkv=2, L=1536, S=2048, E=E, Ev=E, oracle=oracle)


# The Triton option on the GPU: TMA tensor descriptors (USE_TMA), forward and backward,
# against the float64 oracle. 2k x 2k, GQA 8:2, D = 128 (the benchmark's head dim and
# 128-blocks; lengths the descriptors serve). The launches are spied on so a silent fallback to
# pointer loads fails the test.
_TMA_OPTIONS = {"tma": {"USE_TMA": True},
                "tma_128x64": {"USE_TMA": True, "BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 4}}
# (WARP_SPECIALIZE with 4 warps + TMA never finished on the H200, Triton 3.6: it is refused on a
# GPU, tests/backends/triton/test_triton_backend.py::test_tma_options_are_checked_and_need_sm90.)


@pytest.mark.parametrize("opts", list(_TMA_OPTIONS))
@pytest.mark.parametrize("name", ["full", "causal", "sliding_window", "document", "alibi", "softcap",
                                  "learnable_alibi"])
def test_tma_option(monkeypatch, name, opts):
    kernel_options = _TMA_OPTIONS[opts]
    seen = {}
    run = tb._run

    def spy(plan, launch):
        seen.setdefault(launch.kernel, []).append(
            (launch.constexprs.get("USE_TMA"), launch.constexprs.get("WARP_SPEC")))
        return run(plan, launch)
    monkeypatch.setattr(tb, "_run", spy)
    case, oracle = case_and_oracle(name, 2, 8, 2048, 2048, device=DEV, seed=5)
    check(case, B=2, Hq=8, Hkv=2, L=2048, S=2048, E=128, Ev=128, seed=5, oracle=oracle,
          kernel_options=kernel_options)
    want = (torch.cuda.get_device_capability()[0] >= 9, False)
    assert seen["flex_fwd"] == [want] and seen["flex_bwd"] == [want], seen


@pytest.mark.parametrize("name", ["causal", "document", "learnable_alibi", "softcap_alibi_window"])
def test_ragged_and_odd_head_dim(name):
    # Lengths that are not multiples of 16 or of the block; head dim 96 is padded to 128.
    case, oracle = case_and_oracle(name, 2, 4, 1000, 1337, device=DEV, seed=1)
    check(case, B=2, Hq=4, Hkv=4, L=1000, S=1337, E=96, Ev=96, seed=1, oracle=oracle)


@pytest.mark.parametrize("block_size", [(256, 128), 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dtypes_and_block_sizes(dtype, block_size):
    case, oracle = case_and_oracle("learnable_bias", 1, 4, 1024, 1024, device=DEV, seed=2)
    check(case, B=1, Hq=4, Hkv=4, L=1024, S=1024, E=64, Ev=64, dtype=dtype, block_size=block_size,
          seed=2, oracle=oracle)


def _oracle_rows(q, k, v, score_mod, mask_mod, rows, dtype):
    """dense_attention for the query rows ``rows`` only (q_idx = rows), in ``dtype``."""
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    kk = k.detach().to(dtype).repeat_interleave(g, dim=1)
    vv = v.detach().to(dtype).repeat_interleave(g, dim=1)
    s = torch.matmul(q.detach()[:, :, rows].to(dtype), kk.transpose(-1, -2)) / math.sqrt(E)
    b = torch.arange(B, device=DEV).view(-1, 1, 1, 1)
    h = torch.arange(Hq, device=DEV).view(1, -1, 1, 1)
    qi = rows.view(1, 1, -1, 1)
    ki = torch.arange(S, device=DEV).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki).to(dtype)
    if mask_mod is not None:
        s = torch.where(mask_mod(b, h, qi, ki), s, torch.tensor(-math.inf, dtype=dtype, device=DEV))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0).unsqueeze(-1))
    return torch.matmul(p, vv), lse


@pytest.mark.parametrize("name", ["full", "causal", "alibi", "sliding_window", "document", "softcap"])
def test_long_sequence_16k(name):
    # The benchmark's shape class: S = 16k, D = 128, bf16. 512 sampled rows (the last ones
    # included: they see the most keys under causal masks) against float64.
    torch.manual_seed(3)
    B, H, S, D = 1, 4, 16384, 128
    case = make_case(name, B, H, S, S, device=DEV)
    q, k, v = _inputs(B, H, H, S, S, D, D, torch.bfloat16, 3)
    bm = _block_mask(case.mask_mod, B, H, S, S)
    out, lse = flex_attention(q, k, v, case.score_mod, block_mask=bm, return_lse=True, backend="triton")
    rows = torch.cat([torch.randperm(S - 64, device=DEV)[:448], torch.arange(S - 64, S, device=DEV)])
    ref, ref_lse = _oracle_rows(q, k, v, case.score_mod, case.mask_mod, rows, torch.float64)
    low, low_lse = _oracle_rows(q, k, v, case.score_mod, case.mask_mod, rows, torch.bfloat16)
    floor = FLOOR[torch.bfloat16]
    assert_close_to_oracle("out", out[:, :, rows], ref, low, floor)
    assert_close_to_oracle("lse", lse[:, :, rows], ref_lse, low_lse, floor)
    # Gradients: against the reference backend in fp32 (memory-bounded), by relative norm.
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    r_out = flex_attention(q, k, v, case.score_mod, block_mask=bm, backend="reference")
    want = torch.autograd.grad(r_out, (q, k, v), do)
    for label, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), label
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, f"{label}: relative error {rel:.3g}"


def test_compiles_are_counted_and_reused():
    # One compile per (IR, dtype, head dim, block config, arch): a new captured scalar, a
    # captured tensor of another shape or another sequence length (same evenness) reuses it.
    torch.manual_seed(4)
    cap, table = 20.0, [torch.randn(4, 4096, device=DEV)]

    def capped_bias(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap) + table[0][h, q_idx - kv_idx]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(S):
        q, k, v = _inputs(1, 4, 4, S, S, 64, 64, torch.bfloat16, S)
        bm = create_block_mask(causal, None, None, S, S, device=DEV)
        out = flex_attention(q, k, v, capped_bias, block_mask=bm, backend="triton")
        out.sum().backward()
        ref, _ = dense_attention(q, k, v, capped_bias, causal, dtype=torch.float64)
        low, _ = dense_attention(q, k, v, capped_bias, causal, dtype=torch.bfloat16)
        assert_close_to_oracle("out", out, ref, low, FLOOR[torch.bfloat16])
        return q, bm

    q, bm = run(1024)
    # The block mask's mask_mod is part of the Program: without it this would be another kernel.
    call = flexjit.api.attention.prepare_call(q, q, q, capped_bias, bm, None, False, None)
    mods = [tb.load_module(call.program, w) for w in ("fwd", "bwd")]
    count = sum(tb.triton_compiles(m) for m in mods)
    assert count >= 3  # forward, preprocess, backward
    for cap, table[0], S in [(5.0, torch.randn(4, 9000, device=DEV), 1024), (50.0, table[0], 2048)]:
        run(S)
    assert sum(tb.triton_compiles(m) for m in mods) == count


def test_dispatch_picks_triton():
    q = torch.randn(1, 2, 256, 64, device=DEV, dtype=torch.bfloat16)
    assert flexjit.explain(q, q, q, backend="triton").name == "triton"
    choice = flexjit.explain(q, q, q)
    major, _ = torch.cuda.get_device_capability()
    if major != 9:  # no faster backend off Hopper
        assert choice.name == "triton", str(choice)
    else:
        assert choice.name in ("cute", "triton"), str(choice)
    # fp32 and D=96 are outside the Hopper kernel: auto must still pick Triton, and say why.
    q32 = torch.randn(1, 2, 256, 96, device=DEV)
    choice = flexjit.explain(q32, q32, q32)
    assert choice.name == "triton" and choice.reason, str(choice)
    out = flex_attention(q32, q32, q32)
    ref, _ = dense_attention(q32, q32, q32)
    assert max_err(out, ref) < 1e-4


def test_max_scores_and_int64_index_math():
    # The newest paths compiled for the GPU: AuxRequest(max_scores=True) on the Triton
    # forward and index math that leaves int32 at these lengths (computed in int64): both against
    # the float64 oracle.
    from flexjit.api.attention import AuxRequest
    from oracle import dense_scores

    def big(b, h, q_idx, kv_idx):
        return ((kv_idx * 100000000) > q_idx) & (q_idx >= 7)
    q, k, v = _inputs(2, 4, 2, 1000, 777, 128, 128, torch.bfloat16, 31)
    bm = create_block_mask(big, None, None, 1000, 777, device=DEV)
    aux_req = AuxRequest(lse=True, max_scores=True)
    mods_softcap = flexjit.mods.softcap(20.0)
    out, aux = flex_attention(q, k, v, mods_softcap, bm, enable_gqa=True, return_aux=aux_req,
                              backend="triton")
    ref, ref_lse = dense_attention(q, k, v, mods_softcap, big, dtype=torch.float64)
    low, low_lse = dense_attention(q, k, v, mods_softcap, big, dtype=torch.bfloat16)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.bfloat16])
    assert_close_to_oracle("lse", aux.lse, ref_lse, low_lse, FLOOR[torch.bfloat16])
    mx64 = dense_scores(q, k, mods_softcap, big).amax(-1)
    mx16 = dense_scores(q, k, mods_softcap, big, dtype=torch.bfloat16).amax(-1)
    assert torch.isneginf(aux.max_scores[:, :, :7]).all()
    assert_close_to_oracle("max_scores", aux.max_scores, mx64, mx16, FLOOR[torch.bfloat16])
    for backend in ("cute", "triton"):  # the plain call (no max) on both, int64 mask included
        if backend == "cute" and torch.cuda.get_device_capability()[0] != 9:
            continue
        got = flex_attention(q, k, v, mods_softcap, bm, enable_gqa=True, backend=backend)
        assert_close_to_oracle(f"{backend} out", got, ref, low, FLOOR[torch.bfloat16])
