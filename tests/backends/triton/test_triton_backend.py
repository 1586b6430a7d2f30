"""The Triton backend on the CPU.

* Numerics under the Triton interpreter (TRITON_INTERPRET=1) against the float64 oracle:
  out, LSE and every gradient (q, k, v and captured tensors that require grad) for every core
  mod, with tolerances from the data (err <= 2·err(plain torch in the test dtype) + floor).
  Outputs are poisoned (FLEXJIT_POISON=1: NaN-filled) so an element no kernel writes fails.
* Rendering: golden snapshots of the generated mod code; the op table's Python semantics.
* Caching: one render per IR, scalars and buffer shapes are run-time values (counted).
* Dispatch: supports()/explain reasons.
* Compile-only: the kernels build for sm_80, sm_90 and sm_100 and use that arch's tensor-core
  instructions (mma.sync / wgmma / tcgen05), no GPU needed.

Shapes are small because the interpreter runs every tile op in numpy: S <= 256, D <= 64.
"""
import os
import re
from pathlib import Path

import pytest
import torch

import flexjit
from flexjit import create_block_mask
from flexjit.api.attention import flex_attention
from flexjit import mods
from flexjit.api.attention import prepare_call
from flexjit.backends import triton as tb_entry
from flexjit.backends.triton import prefill as tb
from flexjit.backends.triton.config import _fwd_config as _fresh_fwd_config
from flexjit.ir.nodes import Op, uses
from flexjit.frontend.trace import MASK_MOD, trace_mod
from mods_catalog import CORE, POINTWISE, Case, case_and_oracle, lowered, make_case
from oracle import FLOOR, assert_close_to_oracle, dense_attention, max_err, random_qkv

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    """Outputs poisoned and a private kernel cache, for this module only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEXJIT_POISON", "1")
        mp.setenv("FLEXJIT_CACHE_DIR", str(tmp_path_factory.mktemp("flexjit-cache")))
        yield


def _triton_version() -> tuple:
    import triton
    return tuple(int(x) for x in triton.__version__.split(".")[:2])


@pytest.fixture
def interp(monkeypatch):
    """Run Triton kernels in the interpreter (CPU tensors) for one test. Triton 3.6's
    interpreter breaks on numpy 2 (int() of a 1-element array in tl.range) and cannot share a
    process with compiled builds; CI runs 3.9, and the GPU tests cover 3.6 compiled."""
    if _triton_version() < (3, 9):
        pytest.skip("interpreter tests need triton >= 3.9 (this is " + ".".join(map(str, _triton_version())) + ")")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# --------------------------------------------------------------------------- helpers




def _block_mask(mask_mod, B, H, L, S, block_size):
    """A block mask that broadcasts (B or H = None) unless the mask reads b or h, so both the
    broadcast (stride 0) and the per-batch/per-head list layouts are exercised."""
    if mask_mod is None:
        return None
    traced = trace_mod(mask_mod, MASK_MOD).out
    return create_block_mask(mask_mod, B if uses(traced, Op.B) else None,
                             H if uses(traced, Op.H) else None, L, S, device="cpu",
                             BLOCK_SIZE=block_size)


def _loss_grads(out, lse, inputs, g_out, g_lse):
    finite = torch.isfinite(lse)
    loss = (out.double() * g_out).sum() + (torch.where(finite, lse.double(), 0) * g_lse).sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def check(case, B, Hq, Hkv, L, S, E, Ev, dtype, block_size, seed=0, kernel_options=None,
          qkv=None, bm=None, oracle=None, scale=None):
    """Triton (interpreter) vs the float64 oracle: out, lse and every gradient. ``oracle``: the
    case's float64-captures twin (``case_and_oracle``), differentiated by the float64 math."""
    oracle = oracle or case
    q, k, v = qkv or random_qkv(B, Hq, Hkv, L, S, E, Ev, dtype, seed)
    if bm is None:
        bm = _block_mask(case.mask_mod, B, Hq, L, S, block_size)
    out, lse = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=Hq != Hkv,
                              return_lse=True, backend="triton", kernel_options=kernel_options,
                              scale=scale)
    assert out.dtype == dtype and out.shape == (B, Hq, L, Ev) and lse.dtype == torch.float32
    ref, ref_lse = dense_attention(q, k, v, oracle.score_mod, oracle.mask_mod, scale=scale,
                                   dtype=torch.float64)
    low, low_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, scale=scale, dtype=dtype)
    floor = FLOOR[dtype]
    assert_close_to_oracle("out", out, ref, low, floor)
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, floor)
    g = torch.Generator().manual_seed(seed + 1)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    inputs = [q, k, v, *case.learnable]
    got = _loss_grads(out, lse, inputs, g_out, g_lse)
    want = _loss_grads(ref, ref_lse, [q, k, v, *oracle.learnable], g_out, g_lse)
    lowg = _loss_grads(low, low_lse, inputs, g_out, g_lse)
    labels = ["dq", "dk", "dv"] + [f"d_captured{i}" for i in range(len(case.learnable))]
    for label, a, b, c in zip(labels, got, want, lowg):
        assert a is not None, f"no gradient for {label}"
        # A captured tensor's gradient sums over many scores: scale the floor with its size.
        assert_close_to_oracle(label, a, b, c, floor * max(1.0, b.abs().max().item()))
    return out, lse


# --------------------------------------------------------------------------- numerics

# The common shape: GQA (4 query heads on 2 kv heads), Q_LEN != KV_LEN, S = 80 ragged against
# the 32-blocks (2.5 blocks), D = 32: small enough for the interpreter (~2 s per case).
SHAPE = dict(B=2, Hq=4, Hkv=2, L=96, S=80, E=32, Ev=32)


@pytest.mark.parametrize("name", CORE)
def test_core_mods_bf16(interp, name):
    case, oracle = case_and_oracle(name, SHAPE["B"], SHAPE["Hq"], SHAPE["L"], SHAPE["S"], seed=0)
    check(case, **SHAPE, dtype=torch.bfloat16, block_size=32, oracle=oracle)


@pytest.mark.parametrize("name", ["full", "causal", "softcap", "t5_bias", "natten_2d",
                                  "learnable_alibi", "softcap_alibi_window"])
def test_core_mods_fp32(interp, name):
    # fp32 runs IEEE fp32 dots: errors near 1e-6, so a wrong op or index shows at once.
    case, oracle = case_and_oracle(name, SHAPE["B"], SHAPE["Hq"], SHAPE["L"], SHAPE["S"], seed=1)
    check(case, **SHAPE, dtype=torch.float32, block_size=32, seed=1, oracle=oracle)


@pytest.mark.parametrize("name", ["document", "learnable_bias", "alibi"])
def test_core_mods_fp16(interp, name):
    case, oracle = case_and_oracle(name, SHAPE["B"], SHAPE["Hq"], SHAPE["L"], SHAPE["S"], seed=2)
    check(case, **SHAPE, dtype=torch.float16, block_size=32, seed=2, oracle=oracle)


@pytest.mark.parametrize("scale", [0.0, -0.3])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "full", "learnable_alibi"])
def test_nonpositive_scales(interp, name, scale):
    # Where the sm90 forward refuses them (no score_mod: ``cute_sm90.call_refusal``) Triton
    # runs them: scale 0 keeps every score at 0 beside masked and ragged -inf ones, and below 0
    # the largest q·k is the smallest score. Out, lse and every gradient (0 for q and k at 0).
    case, oracle = case_and_oracle(name, SHAPE["B"], SHAPE["Hq"], SHAPE["L"], SHAPE["S"], seed=3)
    check(case, **SHAPE, dtype=torch.float32, block_size=32, seed=3, oracle=oracle, scale=scale)


def _record_tma(monkeypatch) -> dict:
    """kernel name -> the USE_TMA each launch of it ran with (spies on the backend's launcher)."""
    seen = {}
    run = tb._run

    def spy(plan, launch):
        seen.setdefault(launch.kernel, []).append(launch.constexprs.get("USE_TMA"))
        return run(plan, launch)
    monkeypatch.setattr(tb, "_run", spy)
    return seen


# Tensor descriptors (USE_TMA) under the interpreter, which runs host-side descriptors on the
# CPU: GQA (2 query heads per kv head) and two batches put tiles at many (b, h) row offsets of
# the (rows, dim) views, so a wrong offset reads another head. 128 = 4 mask blocks of 32, the
# lengths the descriptors need (even); D = 32 (64-byte rows, 16-byte aligned).
TMA_SHAPE = dict(B=2, Hq=4, Hkv=2, L=128, S=128, E=32, Ev=32)


@pytest.mark.parametrize("name", ["full", "causal", "document", "softcap_alibi_window", "learnable_alibi"])
def test_tma_descriptor_path(interp, monkeypatch, name):
    seen = _record_tma(monkeypatch)
    case, oracle = case_and_oracle(name, TMA_SHAPE["B"], TMA_SHAPE["Hq"], TMA_SHAPE["L"], TMA_SHAPE["S"],
                                   seed=11)
    check(case, **TMA_SHAPE, dtype=torch.bfloat16, block_size=32, seed=11, oracle=oracle,
          kernel_options={"USE_TMA": True, "WARP_SPECIALIZE": True})
    assert seen["flex_fwd"] == [True] and seen["flex_bwd"] == [True], seen


def test_warp_specialize_walks_both_block_lists_in_one_loop(interp, monkeypatch):
    # WARP_SPECIALIZE alone (pointer loads) with partial and full blocks: the forward's merged
    # loop (MERGE_LISTS) must apply mask_mod on the partial tiles only. Ragged S (the last
    # mask block partial) checks the length mask on top of it.
    seen = []
    run = tb._run

    def spy(plan, launch):
        seen.append(launch.constexprs.get("MERGE_LISTS"))
        return run(plan, launch)
    monkeypatch.setattr(tb, "_run", spy)
    case, oracle = case_and_oracle("softcap_alibi_window", 2, 4, 128, 112, seed=13)
    check(case, B=2, Hq=4, Hkv=2, L=128, S=112, E=32, Ev=32, dtype=torch.bfloat16, block_size=32,
          seed=13, oracle=oracle, kernel_options={"WARP_SPECIALIZE": True})
    assert seen[0] is True, seen


def test_tma_falls_back_to_pointers_where_descriptors_cannot_serve(interp, monkeypatch):
    # Ragged lengths (a tile would reach into the next head's rows) and non-contiguous inputs
    # run the pointer path under USE_TMA, with the same numerics; per pass options too.
    seen = _record_tma(monkeypatch)
    torch.manual_seed(12)
    case = make_case("causal_or_global", 2, 2, 77, 53)
    check(case, B=2, Hq=2, Hkv=2, L=77, S=53, E=32, Ev=32, dtype=torch.bfloat16, block_size=32,
          seed=12, kernel_options={"USE_TMA": True})
    B, H, L, D = 1, 2, 64, 32
    q = torch.randn(B, L, H, D).transpose(1, 2).to(torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16).requires_grad_(True) for _ in "kv")
    check(make_case("alibi", B, H, L, L), B=B, Hq=H, Hkv=H, L=L, S=L, E=D, Ev=D,
          dtype=torch.bfloat16, block_size=32, qkv=(q, k, v),
          kernel_options={"fwd_USE_TMA": True, "bwd_USE_TMA": True})
    assert seen["flex_fwd"] == [False, False] and seen["flex_bwd"] == [False, False], seen


def test_a_warp_specialised_build_triton_cannot_lower_runs_unspecialised(interp, monkeypatch):
    # Triton's Hopper warp specialiser takes only simple loops (3.6: the dense forward without
    # a score_mod at 4 warps; others fail in its pass with "PassManager::run failed"): the
    # launch then runs the same kernel unspecialised, and remembers so. A stand-in kernel that
    # fails like Triton's compiler whenever WARP_SPEC is on checks that path; its real launch
    # check is the GPU test's.
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                calls.append(kw["WARP_SPEC"])
                if kw["WARP_SPEC"]:
                    raise RuntimeError("PassManager::run failed")
            return launch
    monkeypatch.setattr(tb, "load_module", lambda *a: type("M", (), {"flex_fwd": Kernel()}))
    q = torch.randn(1, 2, 64, 32, dtype=torch.bfloat16)
    call = prepare_call(q, q, q, None, None, None, False, {"WARP_SPECIALIZE": True})
    plan = tb.make_plan(call)
    launch = tb.fwd_launch(plan, q, q, q, torch.empty_like(q), torch.empty(1, 2, 64), [])
    tb.WS_REFUSED.clear()
    tb._run(plan, launch)
    tb._run(plan, launch)
    assert calls == [True, False, False] and len(tb.WS_REFUSED) == 1
    tb.WS_REFUSED.clear()


def test_tma_options_are_checked_and_need_sm90():
    on = {"USE_TMA": True, "WARP_SPECIALIZE": True}
    args = (torch.bfloat16, 128, 128, 2048, 2048, (128, 128))
    c90 = tb.fwd_config(90, *args, {"USE_TMA": True})
    assert (c90.use_tma, c90.warp_specialize) == (True, False)
    ci = tb.fwd_config(90, *args, on, interpret=True)  # the interpreter runs the merged loop
    assert (ci.use_tma, ci.warp_specialize) == (True, True)
    for config in (tb.fwd_config, tb.bwd_config):  # it deadlocked on the H200: refused there
        with pytest.raises(ValueError, match="WARP_SPECIALIZE is refused"):
            config(90, *args, on)
    assert not tb.fwd_config(90, *args, {}).use_tma  # off by default (until the sweep says)
    c80 = tb.fwd_config(80, *args, on)
    assert (c80.use_tma, c80.warp_specialize) == (False, False)  # no TMA before Hopper
    b90 = tb.bwd_config(90, *args, {"bwd_USE_TMA": True, "fwd_USE_TMA": False})
    assert b90.use_tma and not tb.fwd_config(90, *args, {"bwd_USE_TMA": True, "fwd_USE_TMA": False}).use_tma
    with pytest.raises(TypeError, match="USE_TMA"):
        tb.fwd_config(90, *args, {"USE_TMA": "yes"})
    q = torch.randn(1, 1, 16, 16)
    with pytest.raises(ValueError, match="unknown kernel_options"):
        flex_attention(q, q, q, kernel_options={"USE_TMAX": True}, backend="reference")


def test_captured_gradient_sums_without_fp32_rounding(interp):
    # relative_bias under a causal mask: table entry 0 (kv - q <= -16) takes one atomic per score,
    # ~29k per head here (~500k at L = 1024). Summed in fp32, each add rounds a running sum of
    # magnitude ~10: that error (9e-5 here, against 4e-6 with fp64 sums) was nearly all of the
    # gradient's error. The oracle's table is float64 (a float32 table makes autograd sum the index
    # backward in fp32: an oracle no better than the kernel); plain torch runs the fp32 math with
    # that float64 table, so only each score's fp32 error is left: the floor is not scaled with
    # the gradient's size as check() does.
    torch.manual_seed(10)
    B, H, L, E = 1, 2, 256, 32
    table = torch.randn(H, 33, dtype=torch.float64).mul_(0.5).float().requires_grad_(True)
    t64 = table.detach().double().requires_grad_(True)
    q, k, v = random_qkv(B, H, H, L, L, E, E, torch.float32, 10)
    causal = mods.causal()
    bm = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=64)
    out, lse = flex_attention(q, k, v, mods.relative_bias(table), block_mask=bm, return_lse=True,
                              backend="triton")
    ref, ref_lse = dense_attention(q, k, v, mods.relative_bias(t64), causal, dtype=torch.float64)
    low, low_lse = dense_attention(q, k, v, mods.relative_bias(t64), causal, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    got, = _loss_grads(out, lse, [table], g_out, g_lse)
    want, = _loss_grads(ref, ref_lse, [t64], g_out, g_lse)
    lowg, = _loss_grads(low, low_lse, [t64], g_out, g_lse)
    assert want.abs().max() > 5  # sums that fp32 would round
    assert_close_to_oracle("d_table", got, want, lowg, FLOOR[torch.float32])


@pytest.mark.parametrize("block_size,L,S", [(128, 256, 200), (256, 256, 256), ((256, 128), 256, 192)])
def test_block_sizes(interp, block_size, L, S):
    # The torch-default mask blocks: the kernel tiles walk each mask block in sub-tiles.
    # One batch and 2 heads keep S = 256 affordable in the interpreter.
    torch.manual_seed(3)
    case = make_case("learnable_alibi", 1, 2, L, S)
    check(case, B=1, Hq=2, Hkv=1, L=L, S=S, E=32, Ev=32, dtype=torch.bfloat16,
          block_size=block_size, seed=3)


def test_sub_tiles_of_a_mask_block(interp):
    # Forcing 16-row/column kernel tiles under 64-blocks: 4x4 sub-tiles per mask block.
    torch.manual_seed(4)
    case = make_case("document", 1, 2, 112, 100)
    opts = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16)
    check(case, B=1, Hq=2, Hkv=2, L=112, S=100, E=16, Ev=16, dtype=torch.float32, block_size=64,
          seed=4, kernel_options=opts)


@pytest.mark.parametrize("E,Ev", [(64, 64), (48, 24), (8, 40)])
def test_head_dims(interp, E, Ev):
    # 64 as is; 48/24/40 are padded to powers of two in the kernel and masked; 8 < 16 pads to 16.
    torch.manual_seed(5)
    case = make_case("softcap", 1, 2, 64, 72)
    check(case, B=1, Hq=2, Hkv=1, L=64, S=72, E=E, Ev=Ev, dtype=torch.float32, block_size=32, seed=5)


def test_ragged_lengths_not_multiples_of_16(interp):
    torch.manual_seed(6)
    case = make_case("causal_or_global", 2, 2, 77, 53)
    check(case, B=2, Hq=2, Hkv=2, L=77, S=53, E=32, Ev=32, dtype=torch.bfloat16, block_size=32, seed=6)


def test_strided_inputs(interp):
    # (B, L, H, D) memory viewed as (B, H, L, D), and k/v with a non-unit last-dim stride.
    torch.manual_seed(7)
    B, H, L, S, D = 1, 2, 64, 48, 32
    q = torch.randn(B, L, H, D).transpose(1, 2).requires_grad_(True)
    k = torch.randn(B, H, S, 2 * D)[..., ::2].requires_grad_(True)
    v = torch.randn(B, S, H, D).transpose(1, 2).requires_grad_(True)
    assert not q.is_contiguous() and k.stride(-1) == 2
    check(make_case("alibi", B, H, L, S), B=B, Hq=H, Hkv=H, L=L, S=S, E=D, Ev=D,
          dtype=torch.float32, block_size=32, qkv=(q, k, v))


def test_fully_masked_rows_give_zero_and_no_nan(interp):
    # Rows q < 20 keep nothing: out = 0, lse = -inf, finite zero gradients from those rows.
    def late_rows(b, h, q_idx, kv_idx):
        return (q_idx >= 20) & (kv_idx <= q_idx)
    case = make_case("full", 1, 2, 64, 64)
    case.mask_mod = late_rows
    out, lse = check(case, B=1, Hq=2, Hkv=2, L=64, S=64, E=16, Ev=16, dtype=torch.float32,
                     block_size=16, seed=8)
    assert torch.all(out[:, :, :20] == 0) and torch.all(torch.isneginf(lse[:, :, :20]))


def test_lse_merge_of_disjoint_masks_equals_union(interp):
    # Attention over A ∪ B is the LSE-weighted merge of attention over A and over B.
    torch.manual_seed(9)
    q, k, v = random_qkv(1, 2, 2, 64, 64, 32, 32, torch.float32, 9)

    def even(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx % 2 == 0)

    def odd(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx % 2 == 1)

    def both(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    res = {}
    for fn in (even, odd, both):
        bm = create_block_mask(fn, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
        res[fn.__name__] = flex_attention(q, k, v, block_mask=bm, return_lse=True, backend="triton")
    (oa, la), (ob, lb), (ou, lu) = res["even"], res["odd"], res["both"]
    lse = torch.logaddexp(la, lb)
    wa = torch.where(torch.isinf(la), 0, torch.exp(la - lse)).unsqueeze(-1)
    wb = torch.where(torch.isinf(lb), 0, torch.exp(lb - lse)).unsqueeze(-1)
    assert max_err(lse, lu) < 1e-5 and max_err(wa * oa + wb * ob, ou) < 1e-5


def test_python_semantics_of_rendered_ops(interp):
    # Floor // and % on negatives, negative indices wrapping, int64, float division feeding a
    # floor (rendered correctly rounded), pow, where, bool logic: all against eager torch.
    torch.manual_seed(10)
    table = torch.randn(40)
    big = 2 ** 40

    def ops_score(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        wrap = table[d % 7 - 7]  # always negative: counts from the end
        frac = torch.floor((kv_idx + 1) / 3.0) * 0.01
        i64 = ((d.long() + big) // 5 - big // 5).float() * 0.001
        pw = torch.pow(torch.abs(score) + 1.0, 0.5)
        return torch.where((d // 3) % 2 == 0, score, pw) + wrap + frac + i64 + (d % -4).float() * 0.1

    def ops_mask(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx) // -3 <= 0) | ~(kv_idx % 5 != 2) ^ (h == 1)
    case = make_case("full", 1, 2, 48, 40)
    case.score_mod, case.mask_mod = ops_score, ops_mask
    check(case, B=1, Hq=2, Hkv=2, L=48, S=40, E=16, Ev=16, dtype=torch.float32, block_size=16,
          seed=10)


# --------------------------------------------------------------------------- caching


def _call(score_mod=None, mask_mod=None, L=64, S=64, dtype=torch.float32, H=2):
    q = torch.randn(1, H, L, 16, dtype=dtype)
    bm = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=32) if mask_mod else None
    return prepare_call(q, torch.randn(1, H, S, 16, dtype=dtype), torch.randn(1, H, S, 16, dtype=dtype),
                        score_mod, bm, None, False, None)


def test_new_scalar_or_buffer_shape_reuses_the_kernel(interp):
    # Captured numbers and captured tensors' shapes are run-time arguments: one generated
    # module serves them all, and Triton is told not to specialise on them.
    torch.manual_seed(11)
    q, k, v = random_qkv(1, 2, 2, 64, 64, 16, 16, torch.float32, 11)
    cap = 7.0

    def capped(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    bias_small, bias_big = torch.randn(2, 130), torch.randn(2, 500)
    table = [bias_small]

    def biased(score, b, h, q_idx, kv_idx):
        return score + table[0][h, q_idx - kv_idx]
    flex_attention(q, k, v, capped, backend="triton")
    flex_attention(q, k, v, biased, backend="triton")
    before = dict(tb.STATS)
    for cap_value, tab in [(15.0, bias_big), (31.0, bias_small)]:
        cap, table[0] = cap_value, tab
        for mod in (capped, biased):
            out = flex_attention(q, k, v, mod, backend="triton")
            ref, _ = dense_attention(q, k, v, mod)
            assert max_err(out, ref) < 1e-5
    assert tb.STATS["render"] == before["render"] and tb.STATS["import"] == before["import"]
    prog = _call(biased).program
    dns = tb.load_module(prog, "fwd").DO_NOT_SPECIALIZE
    assert {"buf0_size0", "buf0_size1", "buf0_stride0", "buf0_stride1"} <= set(dns)
    assert "scalar0" in tb.load_module(_call(capped).program, "fwd").DO_NOT_SPECIALIZE


def test_unspecialised_arguments_exist_and_cover_the_block_lists(interp):
    # Triton ignores a do_not_specialize name that is not a parameter, so a typo would silently
    # bring back one compile per sequence length (block-list strides follow the block counts).
    import inspect
    table = torch.randn(2, 64)
    prog = _call(lambda score, b, h, q_idx, kv_idx: score + table[h, kv_idx]).program
    for which, kernel, must in (("fwd", "flex_fwd", {"stride_nh", "stride_im", "n_dense"}),
                                ("bwd", "flex_bwd", {"stride_kvnh", "stride_qin", "n_q_tiles"})):
        mod = tb.load_module(prog, which)
        params = set(inspect.signature(getattr(mod, kernel).fn).parameters)
        dns = set(mod.DO_NOT_SPECIALIZE)
        assert dns <= params, dns - params
        assert must <= dns and "buf0_stride0" in dns
        assert not {"stride_ij", "stride_qm", "L", "S"} & dns  # these keep their hints


def test_captured_tensor_no_graph_reads_is_not_passed(interp):
    # `ids[...] * 0` folds away: the tensor stays captured but no graph reads it, so its rank
    # (1-D, then 2-D) is not in the cache key and must not shape the kernel's parameters.
    torch.manual_seed(12)
    q, k, v = random_qkv(1, 2, 2, 32, 32, 16, 16, torch.float32, 12)
    ids = [torch.arange(4, dtype=torch.int32)]

    def folded(score, b, h, q_idx, kv_idx):
        x = ids[0][h] if ids[0].dim() == 1 else ids[0][h, 0]
        return score * 2.0 + (x * 0).float()
    for t in (ids[0], torch.ones(4, 3, dtype=torch.int32)):
        ids[0] = t
        out = flex_attention(q, k, v, folded, backend="triton")
        assert max_err(out, dense_attention(q, k, v, folded)[0]) < 1e-5


def test_triton_specialisation_ignores_scalar_values_and_buffer_shapes():
    # What Triton keys its compiled binaries on: the same for window 16 vs 17 (an int that is
    # or is not 16-divisible) and for a bias table of another length.
    create = pytest.importorskip("triton.runtime.jit").create_function_from_signature
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    backend = make_backend(GPUTarget("cuda", 90, 32))
    keys = set()
    for window, n in [(16, 64), (17, 100), (1, 33)]:
        bias = torch.randn(n)

        def windowed(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx - kv_idx < window, score + bias[kv_idx], -float("inf"))
        call = _call(windowed)
        plan = tb.make_plan(call, arch=90, interpret=False)
        launch = tb.launches_for(call, 90)[0]
        fn = tb.load_module(plan.program, "fwd", interpret=False).flex_fwd
        binder = create(fn.signature, fn.params, backend)
        _, spec, _ = binder(*launch.args, **launch.constexprs, **launch.options)
        names = [p.name for p in fn.params]
        keys.add(tuple((n, s) for n, s in zip(names, spec) if n.startswith(("scalar", "buf"))))
    assert len(keys) == 1, keys


def test_generated_source_cache_debug_and_dump(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLEXJIT_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("FLEXJIT_DEBUG", "1")

    def scaled(score, b, h, q_idx, kv_idx):  # a mod no other test renders
        return score * 0.75 + 0.125
    prog = _call(scaled).program
    mod = tb.load_module(prog, "fwd")
    path = Path(mod.__file__)
    assert path.parent == Path(os.environ["FLEXJIT_CACHE_DIR"]) / "triton" and path.exists()
    assert str(path) in capsys.readouterr().out
    dumped = list((tmp_path / "dump").glob("scaled__noop__*_fwd.py"))
    assert len(dumped) == 1 and dumped[0].read_text() == path.read_text()
    # A new process (an empty in-memory cache) imports the file again without re-rendering.
    tb.forget_imported()
    renders = tb.STATS["render"]
    assert tb.load_module(prog, "fwd").__file__ == mod.__file__ and tb.STATS["render"] == renders


def test_templates_are_python_with_marked_holes():
    # Each template alone (holes left as their default lines) is importable Python.
    for which in ("fwd", "bwd"):
        compile(tb.template_text(which), f"triton_{which}.py", "exec")
        assert "{{SCORE_" in tb.template_text(which) and "{{MASK_MOD}}" in tb.template_text(which)


# --------------------------------------------------------------------------- rendering


def _program(name):
    torch.manual_seed(0)  # captured tensors' values don't reach the code, only dtypes/ranks do
    case = make_case(name, 2, 4, 256, 256)
    return lowered(case.score_mod, case.mask_mod)


def _holes_text(prog) -> str:
    parts = []
    for which in ("fwd", "bwd"):
        for hole, lines in tb.render_holes(prog, which).items():
            parts.append(f"# ---- {which} {hole}\n" + "\n".join(lines))
    return "\n".join(parts) + "\n"


@pytest.mark.parametrize("name", CORE)
def test_rendered_mods_match_golden(name):
    # Snapshot of the generated mod code (the holes only: template edits don't churn these).
    # To accept an intended change: FLEXJIT_UPDATE_GOLDEN=1, then review the diff.
    text = _holes_text(_program(name))
    path = GOLDEN / f"{name}.py.txt"
    if os.environ.get("FLEXJIT_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; create it with FLEXJIT_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"rendered code for {name} changed; see {path}"


def test_rendered_modules_are_valid_python():
    for name in CORE:
        for which in ("fwd", "bwd"):
            compile(tb.render(_program(name), which), f"{name}_{which}", "exec")


def test_one_atomic_per_row_column_or_tile_for_learnable_tensors():
    # slopes[h] varies with neither q nor kv: one atomic per tile (a full reduction);
    # a table read at [h, kv - q] varies with both: one per element.
    alibi = _holes_text(_program("learnable_alibi"))
    assert "= _sum(gv0, None, False)" in alibi and alibi.count("tl.atomic_add") == 1
    bias = _holes_text(_program("learnable_bias"))
    assert "_sum(gv0" not in bias and bias.count("tl.atomic_add") == 1


# --------------------------------------------------------------------------- dispatch


def test_supports_and_explain(interp):
    call = _call()
    ok, why = tb_entry.supports(call)
    assert ok and "interpreter" in why
    assert flexjit.explain(call.q, call.k, call.v, backend="triton").name == "triton"
    ok, why = tb_entry.supports(_call(dtype=torch.float64))
    assert not ok and "float64" in why
    with pytest.raises(NotImplementedError, match="float64"):
        flexjit.explain(*(torch.randn(1, 1, 16, 16, dtype=torch.float64) for _ in range(3)),
                        backend="triton")
    q = torch.randn(1, 1, 16, 512)
    ok, why = tb_entry.supports(prepare_call(q, q, q, None, None, None, False, None))
    assert not ok and "512" in why


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, why = tb_entry.supports(_call())
    assert not ok and "TRITON_INTERPRET" in why


def test_kernel_block_must_divide_mask_block(interp):
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    q = torch.randn(1, 1, 96, 16)
    bm = create_block_mask(causal, None, None, 96, 96, device="cpu", BLOCK_SIZE=48)
    with pytest.raises(ValueError, match="must divide"):
        flex_attention(q, q, q, block_mask=bm, backend="triton", kernel_options={"BLOCK_M": 32})
    # Without an override the kernel picks 16-row tiles (48 = 3 x 16) and is right.
    out = flex_attention(q, q, q, block_mask=bm, backend="triton")
    ref, _ = dense_attention(q, q, q, mask_mod=causal)
    assert max_err(out, ref) < 1e-5


def test_block_config_fits_mask_and_shared_memory():
    for arch in (80, 90, 100):
        for E in (16, 64, 96, 128, 256):
            for sparse in (None, (128, 128), (256, 128), (64, 32)):
                c = tb.fwd_config(arch, torch.bfloat16, E, E, 4096, 4096, sparse, {})
                b = tb.bwd_config(arch, torch.bfloat16, E, E, 4096, 4096, sparse, {})
                if sparse:
                    assert sparse[0] % c.BLOCK_M == 0 and sparse[1] % c.BLOCK_N == 0
                    assert sparse[0] % b.BLOCK_M1 == 0 and sparse[0] % b.BLOCK_M2 == 0
                    assert sparse[1] % b.BLOCK_N1 == 0 and sparse[1] % b.BLOCK_N2 == 0
                pad = tb.head_pad(E)
                assert tb._fwd_smem(c.BLOCK_M, c.BLOCK_N, c.num_stages, pad, pad, 2) <= tb.smem_limit(arch)


# --------------------------------------------------------------------------- compile-only

_ARCH_INSTR = {80: "mma.sync", 90: "wgmma", 100: "tcgen05"}

# Each case exercises different generated code: learnable ALiBi (gradient atomics, D=64),
# softcap+ALiBi+window (fast tanh, a mask and a score_mod, D=128), T5 buckets (libdevice log and
# correctly rounded division feeding an index, D=96 padded to 128), full (the dense mode).
_COMPILE_CASES = [("learnable_alibi", 64, (80, 90, 100)), ("softcap_alibi_window", 128, (90,)),
                  ("t5_bias", 96, (100,)), ("full", 128, (80,))]


def _compile_all(name, E, arch, dtype=torch.bfloat16):
    torch.manual_seed(0)
    case = make_case(name, 2, 4, 512, 512)
    bm = _block_mask(case.mask_mod, 2, 4, 512, 512, 128)  # per-batch/head lists where b/h are read
    q = torch.randn(2, 4, 512, E, dtype=dtype)
    kv = torch.randn(2, 2, 512, E, dtype=dtype)
    call = prepare_call(q, kv, kv, case.score_mod, bm, None, True, None)
    plan = tb.make_plan(call, arch=arch, interpret=False)
    return {launch.kernel: tb.compile_launch(plan, launch, arch).asm["ptx"]
            for launch in tb.launches_for(call, arch)}


@pytest.mark.parametrize("name,E,arch", [(n, e, a) for n, e, archs in _COMPILE_CASES for a in archs])
def test_kernels_compile_for_arch(name, E, arch):
    ptx = _compile_all(name, E, arch)
    assert set(ptx) == {"flex_fwd", "flex_bwd_preprocess", "flex_bwd"}
    for kernel in ("flex_fwd", "flex_bwd"):
        assert _ARCH_INSTR[arch] in ptx[kernel], f"{kernel} on sm_{arch}: no {_ARCH_INSTR[arch]}"
        assert "cp.async" in ptx[kernel] or "cp.async.bulk" in ptx[kernel], "loads not pipelined"
    if name.startswith("learnable"):
        # fp64 accumulators (see test_captured_gradient_sums_without_fp32_rounding)
        assert re.search(r"(red|atom)\.global\.[\w.]*add\.f64", ptx["flex_bwd"])
    if "softcap" in name:
        assert "tanh.approx.f32" in ptx["flex_fwd"]


@pytest.mark.skipif(os.environ.get("FLEXJIT_COMPILE_ALL") != "1",
                    reason="every core mod x 3 archs takes ~15 min; set FLEXJIT_COMPILE_ALL=1")
@pytest.mark.parametrize("arch", [80, 90, 100])
@pytest.mark.parametrize("name", CORE)
def test_every_core_mod_compiles(name, arch):
    ptx = _compile_all(name, 64, arch)
    assert all(_ARCH_INSTR[arch] in ptx[k] for k in ("flex_fwd", "flex_bwd"))


def test_max_scores_forward_compiles_for_sm90():
    # The OUTPUT_MAX forward (AuxRequest(max_scores=True)) as the GPU builds it: one more store.
    case = make_case("softcap", 2, 4, 512, 512)
    q = torch.randn(2, 4, 512, 64, dtype=torch.bfloat16)
    call = prepare_call(q, q, q, case.score_mod, None, None, False, None)
    plain = tb.compile_launch(tb.make_plan(call, arch=90, interpret=False),
                              tb.launches_for(call, 90)[0], 90).asm["ptx"]
    call.max_scores = True
    launch = tb.launches_for(call, 90)[0]
    assert launch.constexprs["OUTPUT_MAX"]
    ptx = tb.compile_launch(tb.make_plan(call, arch=90, interpret=False), launch, 90).asm["ptx"]
    assert "wgmma" in ptx and ptx.count("st.global") > plain.count("st.global")


@pytest.mark.parametrize("name", ["causal", "softcap"])
def test_tma_kernels_lower_to_bulk_tensor_copies_on_sm90(name):
    # USE_TMA as the H200 builds it (D = 128, the benchmark's 128-blocks): K/V (forward) and
    # the streamed Q/dO, K/V tiles (backward) become cp.async.bulk.tensor copies and the
    # pointer path's cp.async disappears; the default build keeps cp.async and no bulk copy.
    # Warp specialisation: see test_warp_specialised_forward_lowers_on_triton_36.
    torch.manual_seed(0)
    N = 1024
    case = make_case(name, 1, 2, N, N)
    bm = _block_mask(case.mask_mod, 1, 2, N, N, 128)
    q = torch.randn(1, 2, N, 128, dtype=torch.bfloat16)
    for opts, tma in (({"USE_TMA": True}, True), ({}, False)):
        call = prepare_call(q, q, q, case.score_mod, bm, None, True, opts)
        plan = tb.make_plan(call, arch=90, interpret=False)
        for launch in tb.launches_for(call, 90):
            if launch.kernel == "flex_bwd_preprocess":
                continue
            assert launch.constexprs["USE_TMA"] is tma
            ptx = tb.compile_launch(plan, launch, 90).asm["ptx"]
            assert ("cp.async.bulk.tensor" in ptx) is tma, (launch.kernel, opts)
            assert ("cp.async.cg" in ptx) is not tma, (launch.kernel, opts)
            assert "wgmma" in ptx


def test_fp16_and_fp32_compile():
    ptx16 = _compile_all("causal", 64, 90, torch.float16)
    assert "wgmma" in ptx16["flex_fwd"]
    ptx32 = _compile_all("causal", 32, 80, torch.float32)
    assert "fma.rn.f32" in ptx32["flex_fwd"] and "mma.sync" not in ptx32["flex_fwd"]  # IEEE fp32


def test_short_kv_loops_get_small_tiles_on_sm90():
    # Window-like block masks (few keys per query block) run 64x64 tiles with 4 warps on sm90
    # (measured 1.3x on a 1024 window); long loops keep the 128x128 table entry.
    window = create_block_mask(mods.sliding_window(1024), None, None, 8192, 8192, device="cpu")
    causal = create_block_mask(mods.causal(), None, None, 8192, 8192, device="cpu")
    assert window.mean_kv_tokens() <= tb.SHORT_KV_LOOP < causal.mean_kv_tokens()
    short = tb.fwd_config(90, torch.bfloat16, 128, 128, 8192, 8192, (128, 128), {}, short_kv_loop=True)
    assert (short.BLOCK_M, short.BLOCK_N, short.num_warps, short.num_stages) == (64, 64, 4, 3)
    long = tb.fwd_config(90, torch.bfloat16, 128, 128, 8192, 8192, (128, 128), {})
    assert (long.BLOCK_M, long.BLOCK_N) == (128, 128)
    # Other architectures and user options are unaffected.
    assert tb.fwd_config(80, torch.bfloat16, 128, 128, 8192, 8192, (128, 128), {},
                         short_kv_loop=True) == tb.fwd_config(80, torch.bfloat16, 128, 128, 8192,
                                                              8192, (128, 128), {})
    forced = tb.fwd_config(90, torch.bfloat16, 128, 128, 8192, 8192, (128, 128),
                           {"BLOCK_M": 128, "BLOCK_N": 128}, short_kv_loop=True)
    assert (forced.BLOCK_M, forced.BLOCK_N) == (128, 128)


def test_captured_gradients_keep_the_spill_free_backward_tiles_on_sm90():
    # The tuned 64x128 backward spills ~0.8 KB once a learnable table's atomics join in;
    # those kernels keep 32x128 (12 B), the tiles their GPU tests passed with.
    plain = tb.bwd_config(90, torch.bfloat16, 128, 128, 8192, 8192, (128, 128), {})
    grads = tb.bwd_config(90, torch.bfloat16, 128, 128, 8192, 8192, (128, 128), {}, captured_grads=True)
    assert (plain.BLOCK_M1, plain.BLOCK_N1) == (64, 128)
    assert (grads.BLOCK_M1, grads.BLOCK_N1, grads.BLOCK_M2, grads.BLOCK_N2) == (32, 128, 128, 32)


# --------------------------------------------------------------------------- per-call host path


def test_block_lists_are_remembered_until_a_list_is_replaced():
    # The int32 lists the kernels read are built once per BlockMask; assigning a new list
    # tensor to the mask must not serve the old one.
    bm = create_block_mask(mods.causal(), 1, 1, 256, 256, device="cpu", BLOCK_SIZE=128)
    first = tb._kv_lists(bm)
    assert tb._kv_lists(bm) is first
    bm.kv_num_blocks = torch.zeros_like(bm.kv_num_blocks)
    rebuilt = tb._kv_lists(bm)
    assert rebuilt is not first and int(rebuilt.num.sum()) == 0
    assert torch.equal(rebuilt.idx, bm.kv_indices.to(torch.int32))


def test_fwd_config_is_remembered_and_equal_to_a_fresh_one():
    args = (90, torch.bfloat16, 128, 128, 2048, 2048, (128, 128))
    a = tb.fwd_config(*args, {}, short_kv_loop=True)
    assert tb.fwd_config(*args, {}, short_kv_loop=True) is a
    assert a == _fresh_fwd_config(*args, {}, True)
    # kernel_options with an unhashable value are answered, not cached
    odd = {"BLOCK_M": 64, "note": ["unhashable"]}
    assert tb.fwd_config(*args, odd).BLOCK_M == 64


def test_bwd_config_is_remembered_and_equal_to_a_fresh_one():
    from flexjit.backends.triton.config import _bwd_config
    args = (90, torch.bfloat16, 128, 128, 2048, 2048, (128, 128))
    a = tb.bwd_config(*args, {}, captured_grads=True)
    assert tb.bwd_config(*args, {}, captured_grads=True) is a
    assert a == _bwd_config(*args, {}, True) and a != tb.bwd_config(*args, {}, captured_grads=False)


@pytest.mark.parametrize("setting,want", [("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")])
def test_fp32_dots_follow_torchs_matmul_precision(setting, want):
    # Fp32 inputs honour torch.set_float32_matmul_precision as torch's matmuls (and
    # torch Flex-Triton) do; 16-bit inputs and the interpreter are unaffected.
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(setting)
        assert tb._dot_precision(torch.float32, interpret=False) == want
        assert tb._dot_precision(torch.bfloat16, interpret=False) == "ieee"
        assert tb._dot_precision(torch.bfloat16, interpret=True) == "interp-upcast"
    finally:
        torch.set_float32_matmul_precision(before)


def test_fp32_configs_come_from_the_precisions_table():
    # The H200 sweep's fp32 entries (triton_config): IEEE dots 32x64 over 8 warps, TF32 128x64;
    # 8 warps survive the fitting (fp32 tiles count 256 elements a warp, 16-bit ones 512).
    ieee = tb.fwd_config(90, torch.float32, 128, 128, 8192, 8192, (128, 128), {})
    tf32 = tb.fwd_config(90, torch.float32, 128, 128, 8192, 8192, (128, 128), {}, tf32=True)
    assert (ieee.BLOCK_M, ieee.BLOCK_N, ieee.num_warps) == (32, 64, 8)
    assert (tf32.BLOCK_M, tf32.BLOCK_N, tf32.num_warps) == (128, 64, 8)
    # 4 bytes a value: three 64x128 K/V stages do not fit beside Q, two do
    assert tb._fwd_smem(128, 64, tf32.num_stages, 128, 128, 4) <= tb.smem_limit(90)
    b_ieee = tb.bwd_config(90, torch.float32, 128, 128, 8192, 8192, (128, 128), {})
    b_tf32 = tb.bwd_config(90, torch.float32, 128, 128, 8192, 8192, (128, 128), {}, tf32=True)
    assert (b_ieee.BLOCK_M1, b_ieee.BLOCK_N1, b_ieee.num_warps) == (32, 64, 8)
    assert (b_tf32.BLOCK_M1, b_tf32.BLOCK_N1, b_tf32.BLOCK_M2, b_tf32.BLOCK_N2) == (32, 128, 128, 32)
    # remembered per precision: the TF32 answer is not served for IEEE
    assert tb.fwd_config(90, torch.float32, 128, 128, 8192, 8192, (128, 128), {}) is ieee


@pytest.mark.parametrize("name", sorted(POINTWISE))
def test_pointwise_ops(interp, name):
    # The pointwise ops (mods_catalog.POINTWISE) on the Triton kernels, with gradients.
    check(Case(POINTWISE[name], None), 1, 2, 2, 64, 48, 16, 16, torch.float32, 32)


def test_index_by_a_captured_0d_tensor(interp):
    # Bias[b][h][which, q_idx] with which = torch.tensor(1): the 0-d tensor is read at
    # run time (a new value needs no new trace), on the Triton kernels and the reference. (The
    # oracle writes bias[b, h, w, q_idx]: eager torch cannot chain tensor indices.)
    bias = torch.randn(1, 2, 3, 64)
    which = torch.tensor(1)

    def picked(score, b, h, q_idx, kv_idx):
        return score + bias[b][h][which, q_idx]
    q, k, v = random_qkv(1, 2, 2, 64, 48, 16, 16, torch.float32, 5)
    for w in (1, 2):
        which.fill_(w)

        def oracle(score, b, h, q_idx, kv_idx, w=w):
            return score + bias[b, h, w, q_idx]
        ref = dense_attention(q, k, v, oracle, None, dtype=torch.float64)[0]
        low = dense_attention(q, k, v, oracle, None, dtype=torch.float32)[0]
        for backend in ("triton", "reference"):
            got = flex_attention(q, k, v, score_mod=picked, backend=backend)
            assert_close_to_oracle(f"{backend} which={w}", got, ref, low, FLOOR[torch.float32])


def test_index_math_past_int32_runs_in_int64(interp):
    # At these lengths q_idx * 50000000 and kv_idx * 100000000 leave int32, and a
    # captured int32 offset near the top of int32 plus kv_idx does: the kernels compute them in
    # int64, as torch's eager mods (the oracle) do. In int32 the mask and the bias would wrap.
    from mods_catalog import past_int32
    check(Case(*past_int32()), B=2, Hq=2, Hkv=2, L=64, S=48, E=16, Ev=16, dtype=torch.float32,
          block_size=32)


@pytest.mark.parametrize("name,L,S,block_size", [("softcap", 64, 48, 32), ("document", 72, 64, 32),
                                                 ("alibi", 64, 64, None)])
def test_max_scores(interp, name, L, S, block_size):
    # AuxRequest(max_scores=True) on the Triton forward: the row max of the modded scores, -inf
    # on a fully masked row (the oracle: the float64 scores' max), ragged rows included.
    from oracle import dense_scores
    from flexjit.api.attention import AuxRequest
    case = make_case(name, 1, 2, L, S)
    mask = case.mask_mod

    def starts_late(b, h, q_idx, kv_idx):  # the first rows keep nothing
        return (q_idx >= 3) & (mask(b, h, q_idx, kv_idx) if mask is not None else True)
    q, k, v = random_qkv(1, 2, 2, L, S, 16, 16, torch.float32, 7)
    bm = _block_mask(starts_late, 1, 2, L, S, block_size or 64)
    out, aux = flex_attention(q, k, v, case.score_mod, bm, backend="triton",
                              return_aux=AuxRequest(lse=True, max_scores=True))
    ref = dense_scores(q, k, case.score_mod, starts_late).amax(-1)
    low = dense_scores(q, k, case.score_mod, starts_late, dtype=torch.float32).amax(-1)
    assert torch.isneginf(aux.max_scores[:, :, :3]).all()
    assert_close_to_oracle("max_scores", aux.max_scores, ref, low, FLOOR[torch.float32])
    plain, lse = flex_attention(q, k, v, case.score_mod, bm, backend="triton", return_lse=True)
    assert torch.equal(out, plain) and torch.equal(aux.lse, lse)


def test_tune_triton_tma_grid_plans_descriptors_and_the_torch_baseline(tmp_path):
    # The lead's one-call sweep (--grid tma --torch), planned on the CPU: every pass has its
    # default (pointer loads), TMA candidates the planner resolves to descriptors for sm90, and
    # one torch Flex-Triton row per case (not launched in a dry run).
    import json
    from benchmarks import tune_triton
    tune_triton.main(["--dry-run", "--grid", "tma", "--torch", "--out", str(tmp_path), "--S", "2k",
                      "--variants", "causal"])
    rows = json.loads((tmp_path / "tune_triton.json").read_text())["rows"]
    for pass_ in ("fwd", "fwdbwd"):
        prow = [r for r in rows if r["pass"] == pass_]
        assert sum(r["default"] for r in prow) == 1
        assert not next(r for r in prow if r["default"])["config"]["tma"]
        assert sum(1 for r in prow if r.get("baseline")) == 1
        assert any(r["config"].get("tma") and " tma" in r["label"] for r in prow), prow
    assert "best x torch" in (tmp_path / "tune_triton.md").read_text()
