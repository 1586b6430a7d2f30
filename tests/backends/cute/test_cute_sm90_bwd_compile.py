"""Compile-only tests of the Hopper CuTeDSL backward (CPU, no GPU needed), plus the CPU helpers.

Each test builds the three backward kernels (preprocess, main, postprocess) for sm_90a
(CUTE_DSL_ARCH=sm_90a) with real generated mods (traced + lowered by flexjit, rendered by
``flexjit.backends.cute_sm90.load_mods``) and checks the PTX for the machinery the design depends
on: wgmma (a fall back to mma.sync fails), setmaxnreg (warp specialisation), TMA loads and stores
(cp.async.bulk.tensor), the TMA reduce-add of dQ (cp.reduce.async.bulk.tensor ... add.f32),
stmatrix (.trans for dSᵀ) and exp2. ptxas (from Triton's wheel) must report no spills, no stack
frame and no "wgmma serialized" advisory (C7512: ptxas waits after every wgmma when registers
run out, which silently costs most of the speed).

Measured on the dev CPU (cutlass-dsl 4.8.1): the main kernel compiles in ~1.4-2 s without
mods, ~2-3 s with a causal mask_mod and block lists, ~3-4 s with score_mod + mask_mod reading
aux buffers; pre/postprocess ~0.3 s each; ptxas ~0.2-0.7 s. The whole file takes ~2 min, most of
it the sweep over every core mod at D = 128 (the register-tight head dim). Sizes never matter
(they are runtime values), so no example tensors are built except the captured buffers.

CPU value tests: ``flexjit.block_mask.dq_order`` (the deterministic mode's merged lists and
order table) against a brute-force count, and the launch path's marshalling with recording
stand-ins for the kernels.
"""

import dataclasses
import importlib
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
cutlass = pytest.importorskip("cutlass")

from flexjit.ir import nodes as ir  # noqa: E402
from flexjit import mods as fmods  # noqa: E402
from flexjit.backends.cute.sm90 import _aux_tensor, load_mods, unit_dscore  # noqa: E402
from flexjit.planner.block_mask import dq_order  # noqa: E402
from flexjit import create_block_mask
from flexjit.ir.nodes import Op  # noqa: E402
from mods_catalog import CORE, lowered, make_case  # noqa: E402
from ptx_checks import assert_no_spills  # noqa: E402

tpl = importlib.import_module("flexjit.templates.cute.sm90.bwd")
host = importlib.import_module("flexjit.templates.cute.sm90.bwd_host")
tiling_tpl = importlib.import_module("flexjit.templates.cute.sm90.bwd_tiling")
prepost_tpl = importlib.import_module("flexjit.templates.cute.sm90.bwd_prepost")
cute_host = importlib.import_module("flexjit.templates.cute.host")


def _program(score_mod, mask_mod):
    return lowered(score_mod, mask_mod)


def _softcap_alibi_document():
    """score_mod with a captured tensor (ALiBi slopes) and a captured float (the softcap, a
    runtime scalar); mask_mod with a captured tensor (document ids) and causality."""
    slopes = torch.rand(4)
    docs = torch.randint(0, 3, (500,)).sort().values
    cap = 30.0

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap) + slopes[h] * (kv_idx - q_idx)

    def mask_mod(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)
    return score_mod, mask_mod


def _compile(tmp_path, head_dim, score_mod=None, mask_mod=None, sparse=False,
             deterministic=False, parts=host.PARTS, overlap_dp=None, program=None, head_dim_v=None,
             config=""):
    """The PTX of each part in ``parts``; ``config``: ``BWD_CONFIG`` tokens (the tile table's
    row with them, ``bwd_tiling``)."""
    program = program or _program(score_mod, mask_mod)
    mods = load_mods(program)
    head_dim_v = head_dim_v or head_dim
    tiling = tiling_tpl.bwd_tiling(head_dim, head_dim_v, overlap_dp, config) if config else None
    cfg = tpl.BwdConfig(head_dim, head_dim_v, cutlass.BFloat16, mods.score_mod_and_grad,
                        mods.mask_mod, has_block_mask=sparse, deterministic=deterministic,
                        overlap_dp=overlap_dp, unit_dscore=unit_dscore(program), tiling=tiling)
    aux = tuple(_aux_tensor(t, torch.device("cpu")) for t in program.buffers)
    fn = host.compile_bwd(cfg, aux, program.scalars, options=f"--keep-ptx --dump-dir {tmp_path}",
                         parts=parts)
    ptx = {name: part.compiled.__ptx__ for name, part in fn.parts.items()}
    for name, text in ptx.items():
        assert text and ".entry" in text, f"{name}: no PTX produced"
    return ptx


def _assert_clean_registers(tmp_path, ptx):
    assert_no_spills(tmp_path, ptx, no_serialised_wgmma=True)


def _assert_main_machinery(ptx, rs=True):
    """``rs``: dV and dK read P and dS from registers (False: from smem, ``BwdTiling.q_split``)."""
    assert "wgmma.mma_async" in ptx, "no wgmma: off the Hopper tensor-core path"
    assert "mma.sync" not in ptx, "mma.sync found: Ampere-style MMA instead of wgmma"
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx, "no register reallocation"
    assert "cp.async.bulk.tensor" in ptx and "mbarrier::complete_tx" in ptx, "no TMA loads"
    assert "cp.reduce.async.bulk.tensor" in ptx and ".add." in ptx, "dQ is not TMA reduce-added"
    assert "red.global.add.f32" not in ptx and "atom.global.add.f32" not in ptx
    assert "stmatrix.sync.aligned.m8n8.x4.trans" in ptx, "dSᵀ is not stored with stmatrix.trans"
    assert "ex2.approx" in ptx, "P is not recomputed in the exp2 domain"
    # dV and dK read P and dS from registers (RS: the A operand is a register vector), the
    # S/dP/dQ GEMMs read shared memory (SS: two descriptors).
    wgmma = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.b?f16\.b?f16\s+\{[^}]*\},\s*"
    if rs:
        assert re.search(wgmma + r"\{", ptx), "no RS wgmma: P/dS do not feed dV/dK from registers"
    else:
        assert not re.search(wgmma + r"\{", ptx), "an RS wgmma where every GEMM reads smem"
    assert re.search(wgmma + r"%rd", ptx), "no SS wgmma"


def _assert_deterministic_machinery(ptx):
    assert "ld.acquire.gpu" in ptx or "ld.global.acquire.gpu" in ptx, "no acquire spin on the semaphore"
    assert "release" in ptx and ("atom" in ptx or "red." in ptx), "no release increment"
    assert "fence.proxy.async.global" in ptx, "no proxy fence around the bulk reduce"


# 64 and 128, then 32 and 96; (192, 192) and (192, 128) (the 64-key "dim split"
# tile) in the tests below that take both head dims.
HEAD_DIMS = [64, 128, 32, 96]
# (head_dim, head_dim_v) of the 64-key tile: the kv tile is half a mask block, the MMA
# warpgroups split dK/dV/dQ by columns; each computes all of Sᵀ/dPᵀ ("sdpdup") or half of
# their query rows ("qsplit", P and dS through smem). Both forms are named, whichever is the
# table's.
DIM_SPLIT = [(192, 192), (192, 128)]
DIM_SPLIT_FORMS = ["sdpdup", "qsplit"]


@pytest.mark.parametrize("form", DIM_SPLIT_FORMS)
@pytest.mark.parametrize("dims", DIM_SPLIT)
def test_dim_split_no_mods(tmp_path, dims, form):
    # All three kernels (pre/postprocess read rows of 192 / 128).
    ptx = _compile(tmp_path, dims[0], head_dim_v=dims[1], config=form)
    _assert_main_machinery(ptx["main"], rs=form == "sdpdup")
    for part in ("main", "pre", "post"):
        _assert_clean_registers(tmp_path, ptx[part])
    # dK/dV/dQ GEMMs are each warpgroup's half of the head dims: N = 96 (and 64 for dV at 128).
    assert "m64n96k16" in ptx["main"]
    # Sᵀ/dPᵀ: 64 keys × 64 queries per warpgroup, or 64 × 32 split by query rows.
    assert ("m64n32k16" in ptx["main"]) == (form == "qsplit")
    if form == "sdpdup":
        assert "m64n64k16" in ptx["main"]


@pytest.mark.parametrize("form", DIM_SPLIT_FORMS)
@pytest.mark.parametrize("dims", DIM_SPLIT)
def test_dim_split_fits_shared_memory(dims, form):
    # The qsplit form adds a Pᵀ stage per Q stage beside dS's (16 KB): 225 KB at (192, 192),
    # the closest to the 227 KB an sm90 CTA may use. The size is the kernel's shared storage.
    made = []

    class Recorded(tpl.FlexAttentionBwdSm90):
        def __init__(self, cfg):
            super().__init__(cfg)
            made.append(self)

    cfg = tpl.BwdConfig(dims[0], dims[1], cutlass.BFloat16, None, None,
                        tiling=tiling_tpl.bwd_tiling(dims[0], dims[1], None, form))
    cute_host.compile_parts({"main": lambda: (Recorded(cfg), cute_host.placeholder_main_args(cfg, (), ()))},
                            "", ("main",))
    used = made[0].shared_storage.size_in_bytes()
    assert used <= 227 * 1024, used


@pytest.mark.parametrize("deterministic", [
    pytest.param(False, marks=pytest.mark.compile_all(
        reason="the same kernel as test_every_core_mod_fits[causal-192_*] (192 always overlaps dP)")),
    True])
@pytest.mark.parametrize("form", DIM_SPLIT_FORMS)
@pytest.mark.parametrize("dims", DIM_SPLIT)
def test_dim_split_causal_block_lists(tmp_path, dims, deterministic, form):
    # Two kv tiles per mask block: the block lists are read at column n // 2, and in
    # deterministic mode the ranks are per kv tile (2·rank + which half).
    ptx = _compile(tmp_path, dims[0], mask_mod=fmods.causal(), sparse=True, parts=("main",),
                   deterministic=deterministic, head_dim_v=dims[1], config=form)["main"]
    _assert_main_machinery(ptx, rs=form == "sdpdup")
    _assert_clean_registers(tmp_path, ptx)
    if deterministic:
        _assert_deterministic_machinery(ptx)


@pytest.mark.parametrize("form", DIM_SPLIT_FORMS)
@pytest.mark.parametrize("dims", DIM_SPLIT)
def test_dim_split_score_and_mask_mods_with_aux(tmp_path, dims, form):
    score_mod, mask_mod = _softcap_alibi_document()
    ptx = _compile(tmp_path, dims[0], score_mod, mask_mod, sparse=True, parts=("main",),
                   head_dim_v=dims[1], config=form)["main"]
    _assert_main_machinery(ptx, rs=form == "sdpdup")
    _assert_clean_registers(tmp_path, ptx)
    assert "tanh.approx" in ptx


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_no_mods(tmp_path, head_dim):
    ptx = _compile(tmp_path, head_dim)
    _assert_main_machinery(ptx["main"])
    _assert_clean_registers(tmp_path, ptx["main"])
    assert "ld.global.v4" in ptx["pre"] and "st.global.v4" in ptx["pre"]  # 16-byte accesses
    assert "ld.global.v4" in ptx["post"]
    for part in ("pre", "post"):
        _assert_clean_registers(tmp_path, ptx[part])


def _causal_lists_cases():
    # At D <= 96 the tile table forms P under dP whatever overlap_dp says, so None builds the
    # same kernel as True; True at 128 and 96 is test_every_core_mod_fits[causal-128/96]'s kernel
    # (the same program, mask and config). Those run under FLEXJIT_COMPILE_ALL=1 only.
    for head_dim in HEAD_DIMS:
        for overlap_dp in (None, True):
            if overlap_dp is None and head_dim <= 96:
                marks = [pytest.mark.compile_all(reason="the same kernel as overlap_dp=True here")]
            elif overlap_dp and head_dim in (128, 96):
                marks = [pytest.mark.compile_all(
                    reason=f"the same kernel as test_every_core_mod_fits[causal-{head_dim}]")]
            else:
                marks = []
            yield pytest.param(head_dim, overlap_dp, id=f"{head_dim}-{overlap_dp}", marks=marks)


@pytest.mark.parametrize("head_dim,overlap_dp", list(_causal_lists_cases()))
def test_causal_block_lists(tmp_path, head_dim, overlap_dp):
    # overlap_dp=True is what the backend asks for light mods (comparisons only): it must fit.
    ptx = _compile(tmp_path, head_dim, mask_mod=fmods.causal(), sparse=True, parts=("main",),
                   overlap_dp=overlap_dp)
    _assert_main_machinery(ptx["main"])
    _assert_clean_registers(tmp_path, ptx["main"])


@pytest.mark.compile_all(reason="the same kernel as test_every_core_mod_fits[sliding_window-128] "
                                "(the window is a runtime Int32: same program key and source)")
def test_sliding_window_overlapped(tmp_path):
    # A light mask with a captured runtime window (an Int32 scalar), P formed under dP.
    ptx = _compile(tmp_path, 128, mask_mod=fmods.sliding_window(200), sparse=True,
                   parts=("main",), overlap_dp=True)["main"]
    _assert_main_machinery(ptx)
    _assert_clean_registers(tmp_path, ptx)


def test_causal_mask_mod_without_block_lists(tmp_path):
    # mask_mod without a block mask: every q tile is visited as partial.
    ptx = _compile(tmp_path, 128, mask_mod=fmods.causal(), parts=("main",))
    _assert_main_machinery(ptx["main"])
    _assert_clean_registers(tmp_path, ptx["main"])


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_score_and_mask_mods_with_aux(tmp_path, head_dim):
    score_mod, mask_mod = _softcap_alibi_document()
    ptx = _compile(tmp_path, head_dim, score_mod, mask_mod, sparse=True, parts=("main",))["main"]
    _assert_main_machinery(ptx)
    _assert_clean_registers(tmp_path, ptx)
    assert "tanh.approx" in ptx, "softcap (and its derivative) not rendered"
    # The softcap is a runtime kernel parameter, not a constant folded into the code.
    assert "0f41F00000" not in ptx and "30.0" not in ptx, "runtime scalar was baked in"


@pytest.mark.parametrize("causal,head_dim", [(False, 128), (True, 128), (False, 64)])
def test_row_values_are_read_before_the_waits(tmp_path, causal, head_dim):
    # An ncu profile showed short-scoreboard stalls twice FA4's: lse2 and delta
    # are read from smem into registers before the Sᵀ / dPᵀ wgmma waits, so their LDS latency
    # runs under the GEMMs. On the SASS of the steady-state loop (sass_compare's path): every
    # one of the 16 LDS.64 per 64 query rows crosses a wgmma wait before its first use, and no
    # LDS sits right behind a wait. main before this read them after the waits: 5 LDS within 5
    # instructions of a DEPBAR, first use 3-11 later, at each of these three kernels. Dense and
    # causal D = 128 (the register-tight head dim) and dense D = 64.
    from benchmarks import sass_compare, sass_latency

    cubin = sass_compare._ours("bwd", causal, str(tmp_path), head_dim)
    path, _ = sass_compare.hot_path(sass_compare.disassemble(cubin))
    rows = sass_latency.distances(path)
    lds = [r for r in rows if r["text"].startswith("LDS")]
    assert len(lds) == 16, [r["text"] for r in lds]
    late = [r["text"] for r in lds if r["dist"] is None or not r["waits"]]
    assert not late, f"LDS read before any wgmma wait covers it: {late}"
    assert not sass_latency.behind_waits(path, rows)


def test_backward_tile_table():
    """One 64 × 128 row for every head dim (the kv tile is the mask block), P formed under dP
    always for D <= 96; 64/128 exactly as they were before the other head dims came; K's swizzle atom narrows only for D = 96 (its dQ split at column 48);
    192 and (192, 128) take a 64-key tile (half a mask block; dK + dV with 128 keys would take
    192 / 160 of 240 registers), P under dP always; Q and K there get 32-column atoms, V and
    dO too at Dv = 192 (each warpgroup's half of the head dims starts on an atom)."""
    T = tpl.BwdTiling
    assert tpl.choose_bwd_tiling(128, 128, False) == T(64, 128, 2, "cols", False, 240, 24)
    assert tpl.choose_bwd_tiling(128, 128, True) == T(64, 128, 2, "cols", True, 240, 24)
    assert tpl.choose_bwd_tiling(64, 64, False) == T(64, 128, 2, "cols", True, 240, 24)
    assert tpl.choose_bwd_tiling(32, 32, False) == T(64, 128, 2, "cols", True, 240, 24)
    assert tpl.choose_bwd_tiling(96, 96, False) == T(64, 128, 2, "cols", True, 240, 24)
    assert [importlib.import_module("flexjit.templates.cute.sm90.dq").k_atom_cols(d, "cols") for d in (32, 64, 96, 128, 192)] == [32, 64, 48, 128, 96]
    for dv in (192, 128):
        assert tpl.choose_bwd_tiling(192, dv, False) == T(64, 64, 2, "cols", True, 240, 24,
                                                          q_split=tiling_tpl.D192_Q_SPLIT)
        # Either form of the dim split by name, nothing else there; the forms nowhere else.
        assert tiling_tpl.bwd_tiling(192, dv, None, "qsplit") == T(64, 64, 2, "cols", True, 240, 24,
                                                                   q_split=True)
        assert tiling_tpl.bwd_tiling(192, dv, None, "sdpdup") == T(64, 64, 2, "cols", True, 240, 24)
        for bad in ("late", "qsplit+sdpdup", "qsplit+lpt"):
            with pytest.raises(ValueError, match="only backward variant"):
                tiling_tpl.bwd_tiling(192, dv, None, bad)
    with pytest.raises(ValueError, match="head dim 192 only"):
        tiling_tpl.bwd_tiling(128, 128, None, "qsplit")
    # Pre/postprocess: a row's lanes are a power of two within one warp, covering the row.
    assert [prepost_tpl._lanes_per_row(d) for d in (32, 64, 96, 128)] == [4, 8, 4, 16]
    for d in (32, 64, 96, 128):
        n = prepost_tpl._lanes_per_row(d)
        assert 32 % n == 0 and (d // n) % 8 == 0
    for d, dv in ((256, 256), (128, 96), (192, 96)):
        with pytest.raises(NotImplementedError, match="head dims"):
            tpl.choose_bwd_tiling(d, dv)


def light_mods(program) -> bool:
    """The rule the backend should use for ``BwdConfig.overlap_dp``: no loads and no
    transcendentals in the score, its derivative or the mask (comparisons and integer/float
    arithmetic only). Such mods leave room to form P while the dP GEMM runs at D = 128."""
    roots = [r for r in (program.score, program.dscore, program.mask) if r is not None]
    return not any(n.op is Op.LOAD or n.op in ir.TRANSCENDENTAL for n in ir.toposort(roots))


def _clean_main_ptx(tmp_path, cfg, program) -> str:
    """The main kernel's PTX for ``cfg``, checked for the Hopper machinery and clean registers."""
    aux = tuple(_aux_tensor(t, torch.device("cpu")) for t in program.buffers)
    fn = host.compile_bwd(cfg, aux, program.scalars, options=f"--keep-ptx --dump-dir {tmp_path}",
                         parts=("main",))
    ptx = fn.parts["main"].compiled.__ptx__
    _assert_main_machinery(ptx, rs=not cfg.tiling.q_split)
    _assert_clean_registers(tmp_path, ptx)
    return ptx


# CI compiles every core mod at 128 (the register-tight head dim; "full" is test_no_mods[128]'s
# main kernel), and at 96, 192 and (192, 128) the mods with the most live state beside dK + dV
# (a per-head slope, a tanh, document ids, a mask); every core mod at 192 / (192, 128) passed on
# the CPU and their GPU tests on the H200, and at 96 in every
# CI run up to 2026-12-01. FLEXJIT_COMPILE_ALL=1 compiles every pair (about 7 more minutes on 2
# cores). 192's two forms (DIM_SPLIT_FORMS) each compile the same mods.
_WIDE = {"causal", "alibi", "softcap", "document"}


def _every_core_mod_cases():
    for d in (128, 96, (192, 192), (192, 128)):
        for form in (DIM_SPLIT_FORMS if isinstance(d, tuple) else [""]):
            for n in CORE:
                tag = f"{d[0]}_{d[1]}" if isinstance(d, tuple) else str(d)
                marks = []
                if d == 128 and n == "full":
                    marks = [pytest.mark.compile_all(reason="the same main kernel as test_no_mods[128]")]
                elif d != 128 and n not in _WIDE:
                    marks = [pytest.mark.compile_all(reason="the _WIDE mods represent this head dim")]
                yield pytest.param(n, d, form, id=f"{n}-{tag}" + (f"-{form}" if form else ""),
                                   marks=marks)


@pytest.mark.parametrize("name,head_dim,form", list(_every_core_mod_cases()))
def test_every_core_mod_fits(tmp_path, name, head_dim, form):
    # D = 128 is the register-tight case (dV + dK = 128 registers), D = 96 the next (96); 192
    # and (192, 128) hold dK + dV = 96 (80) per thread in the 64-key tile, beside a full
    # 64 × 64 Sᵀ and dPᵀ; with the overlap rule above every core mod must compile without
    # spills and without serialised wgmmas.
    head_dim, head_dim_v = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)
    case = make_case(name, 2, 4, 300, 500)
    program = _program(case.score_mod, case.mask_mod)
    mods = load_mods(program)
    overlap = True if light_mods(program) else None
    cfg = tpl.BwdConfig(head_dim, head_dim_v, cutlass.BFloat16, mods.score_mod_and_grad, mods.mask_mod,
                        has_block_mask=case.mask_mod is not None, overlap_dp=overlap,
                        tiling=tiling_tpl.bwd_tiling(head_dim, head_dim_v, overlap, form) if form else None)
    _clean_main_ptx(tmp_path, cfg, program)


def _captured_grads_cases():
    # 32-128 share one 64 x 128 tile (test_backward_tile_table), 192 has the 64-key one (both
    # forms): CI keeps both mods at 128 and 192 and the per-element table (the heavier) at 96.
    for name in ("learnable_bias", "learnable_alibi"):
        for head_dim in (128, 64, 96, 192):
            extra = head_dim == 64 or (head_dim == 96 and name == "learnable_alibi")
            marks = [pytest.mark.compile_all(reason="the 64 x 128 tile is covered at 128 and 96")
                     ] if extra else []
            for form in (DIM_SPLIT_FORMS if head_dim == 192 else [""]):
                yield pytest.param(name, head_dim, form,
                                   id=f"{name}-{head_dim}" + (f"-{form}" if form else ""), marks=marks)


@pytest.mark.parametrize("name,head_dim,form", list(_captured_grads_cases()))
def test_captured_tensor_grads(tmp_path, name, head_dim, form):
    # A learnable captured tensor's gradient from the sm90 backward itself. The
    # relative-bias table's index varies per element (one predicated fp64 atomic per element),
    # the ALiBi slopes' index is uniform over the tile (warp butterfly, one atomic per warp).
    # Causal block mask, D = 128 (register-tight: 0 spills before this change; must stay 0) and 64.
    case = make_case(name, 2, 4, 300, 500)
    program = _program(case.score_mod, case.mask_mod)
    assert program.grad_loads
    mods = load_mods(program)
    assert mods.score_grads is not None and mods.grad_offsets is not None
    assert mods.grad_offsets.uniform == ((name == "learnable_alibi"),)
    overlap = True if light_mods(program) else None
    cfg = tpl.BwdConfig(head_dim, head_dim, cutlass.BFloat16, mods.score_mod_and_grad,
                        mods.mask_mod, has_block_mask=True, overlap_dp=overlap,
                        score_grads=mods.score_grads, grad_offsets=mods.grad_offsets,
                        tiling=tiling_tpl.bwd_tiling(head_dim, head_dim, overlap, form) if form else None)
    assert cute_host.num_grad_accs(cfg) == 1
    ptx = _clean_main_ptx(tmp_path, cfg, program)
    assert re.search(r"(red|atom)\.global(\.\w+)*\.add\.f64", ptx), "no fp64 atomic add"
    if name == "learnable_alibi":
        assert "shfl.sync.bfly" in ptx, "uniform-index gradient not warp-reduced"


def test_score_dependent_captured_grads_stay_on_triton():
    # d(score · scale[h]) / d scale[h] = score: the kernel cannot re-evaluate it after the dP
    # GEMM, so the renderer leaves the holes None and backward_supports sends it to Triton.
    from flexjit.backends.cute.sm90 import captured_grads_in_kernel, render
    scale = torch.rand(4).requires_grad_(True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * scale[h]
    program = _program(score_mod, None)
    assert program.grad_loads
    ok, why = captured_grads_in_kernel(program)
    assert not ok and "depends on the score" in why
    assert "score_grads = None" in render(program)


@pytest.mark.parametrize("sparse,heavy", [(False, False), (True, False), (True, True)])
def test_deterministic(tmp_path, sparse, heavy):
    # heavy: the merged list's per-tile choice between the partial and the full body, with the
    # most register-hungry mods (captured tensors in both holes, a runtime scalar).
    score, mask = _softcap_alibi_document() if heavy else (None, fmods.causal() if sparse else None)
    ptx = _compile(tmp_path, 128, score_mod=score, mask_mod=mask, sparse=sparse, deterministic=True)
    _assert_main_machinery(ptx["main"])
    _assert_deterministic_machinery(ptx["main"])
    _assert_clean_registers(tmp_path, ptx["main"])
    _assert_clean_registers(tmp_path, ptx["pre"])


# ----------------------------------------------------------------------------- CPU helpers


def _brute_force_order(bm):
    """What ``dq_order`` must give, by direct loops over the q lists: per kv block n, the sorted
    union of its partial and full q blocks; each entry's rank = #{n' > n listing that q block}
    and flag = listed as full only."""
    lists = ((bm.q_num_blocks, bm.q_indices), (bm.full_q_num_blocks, bm.full_q_indices))
    Bm, Hm, nKV, nQ = bm.q_indices.shape
    part, full = ({(b, h, n): {int(idx[b, h, n, j]) for j in range(int(num[b, h, n]))}
                   for b in range(Bm) for h in range(Hm) for n in range(nKV)}
                  for num, idx in lists)
    num = torch.zeros(Bm, Hm, nKV, dtype=torch.int32)
    idx, rank, flag = (torch.zeros(Bm, Hm, nKV, nQ, dtype=torch.int32) for _ in range(3))
    for (b, h, n), p in part.items():
        merged = sorted(p | full[(b, h, n)])
        num[b, h, n] = len(merged)
        for j, m in enumerate(merged):
            idx[b, h, n, j] = m
            rank[b, h, n, j] = sum(m in part[(b, h, n2)] | full[(b, h, n2)]
                                   for n2 in range(n + 1, nKV))
            flag[b, h, n, j] = int(m in full[(b, h, n)] and m not in p)
    return num, idx, rank, flag


@pytest.mark.parametrize("case", ["causal", "document_per_head"])
def test_dq_order_matches_brute_force(case):
    # 700 x 900 tokens: 6 x 8 mask blocks, ragged both ways; per-head masks check the H dim.
    torch.manual_seed(0)
    if case == "causal":
        mask = fmods.causal()
        B, H = None, None
    else:
        docs = torch.randint(0, 4, (900,)).sort().values

        def mask(b, h, q_idx, kv_idx):
            return (docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx + 128 * h)
        B, H = 1, 3
    bm = create_block_mask(mask, B, H, 700, 900, device="cpu")
    lists = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
             bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)
    (num, idx, fnum, fidx), (rank, flag) = dq_order(lists)
    want_num, want_idx, want_rank, want_flag = _brute_force_order(bm)
    assert all(t.dtype == torch.int32 for t in (num, idx, fnum, fidx, rank, flag))
    assert idx.shape == rank.shape == flag.shape == bm.q_indices.shape
    assert torch.equal(num, want_num) and not fnum.any()  # everything in the merged list
    valid = torch.arange(idx.shape[-1]) < num.unsqueeze(-1)
    for got, want in ((idx, want_idx), (rank, want_rank), (flag, want_flag)):
        assert torch.equal(torch.where(valid, got, 0), want)
    assert flag.any() and (flag == 0).logical_and(valid).any()  # both kinds occur here
    # Every q block's ranks are 0..count-1 exactly once (the semaphore's whole sequence).
    Bm, Hm, nKV, _ = idx.shape
    seen = torch.zeros(Bm, Hm, bm.kv_indices.shape[2], dtype=torch.int64)
    count = torch.zeros_like(seen)
    for b in range(Bm):
        for h in range(Hm):
            for n in range(nKV):
                for j in range(int(num[b, h, n])):
                    m = int(idx[b, h, n, j])
                    seen[b, h, m] += 1 << int(rank[b, h, n, j])
                    count[b, h, m] += 1
    assert torch.equal(seen, (1 << count) - 1)
    assert torch.equal(count, (bm.kv_num_blocks + bm.full_kv_num_blocks).long())


def test_padded_len_covers_whole_mask_blocks():
    for L, want in ((1, 128), (128, 128), (129, 256), (1000, 1024)):
        assert cute_host.padded_len(L) == want


def test_host_launch_marshals_workspaces_and_lists():
    # The launch path with recording stand-ins for the three kernels (no GPU): workspace
    # shapes, the dLSE flag, the GQA group, the q lists and the deterministic ranks.
    calls = {}

    def recorder(name):
        return lambda *args: calls.setdefault(name, args)

    cfg = tpl.BwdConfig(128, 128, cutlass.BFloat16, None, None, has_block_mask=True,
                        deterministic=True)
    fn = host.load_bwd(cfg, {name: recorder(name) for name in host.PARTS})
    B, Hq, Hkv, L, S, D = 2, 8, 2, 300, 500, 128
    q, out = torch.randn(B, Hq, L, D).bfloat16(), torch.randn(B, Hq, L, D).bfloat16()
    k, v = torch.randn(B, Hkv, S, D).bfloat16(), torch.randn(B, Hkv, S, D).bfloat16()
    dout = torch.randn(1, 1, 1, 1).bfloat16().expand(B, Hq, L, D)  # stride 0, like out.sum()
    lse = torch.randn(B, Hq, L)
    bm = create_block_mask(fmods.causal(), None, None, L, S, device="cpu")
    lists = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
             bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with pytest.raises(ValueError, match="q_order"):  # deterministic: the host's order is required
        fn(q, k, v, out, dout, lse, None, dq, dk, dv, 0.125, lists, (), ())
    fn(q, k, v, out, dout, lse, None, dq, dk, dv, 0.125, lists, (), (), q_order=dq_order(lists))
    o, do, lse_arg, dlse_arg, has_dlse, lse2, delta, dqacc, sem = calls["pre"]
    assert has_dlse == 0 and dlse_arg is lse
    assert do.stride(-1) == 1 and torch.equal(do, dout)  # made contiguous for TMA
    assert lse2.shape == delta.shape == (B, Hq, 384) and dqacc.shape == (B, Hq, 384, D)
    assert sem.shape == (B, Hq, 2 * 384 // 64) and sem.dtype == torch.int32
    main = calls["main"]
    assert main[9] == 0.125 and main[10] == Hq // Hkv
    qblocks, qorder, sem_main = main[11], main[12], main[13]
    want_lists, want_order = dq_order(lists)  # deterministic: the merged lists
    assert all(torch.equal(a, b) for a, b in zip(qblocks, want_lists))
    assert all(torch.equal(a, b) for a, b in zip(qorder, want_order))
    assert sem_main is sem and main[7] is dk and main[8] is dv and main[6] is dqacc
    assert calls["post"][0] is dqacc and calls["post"][1] is dq and calls["post"][2] == 0.125
    assert main[16] is None  # no captured-gradient accumulators
    with pytest.raises(ValueError, match="accumulators"):
        fn(q, k, v, out, dout, lse, None, dq, dk, dv, 0.125, lists, (), (), q_order=dq_order(lists),
           grad_accs=(torch.zeros(3, dtype=torch.float64),))


def test_host_launch_with_narrower_v():
    # (192, 128): out, dout, v and dv are 128 wide, q, k, dq, dk and the dQ accumulator 192;
    # a v as wide as q is refused (the config was built for 128).
    calls = {}

    def recorder(name):
        return lambda *args: calls.setdefault(name, args)

    cfg = tpl.BwdConfig(192, 128, cutlass.BFloat16, None, None)
    fn = host.load_bwd(cfg, {name: recorder(name) for name in host.PARTS})
    B, Hq, Hkv, L, S = 1, 4, 2, 200, 300
    q, k = torch.randn(B, Hq, L, 192).bfloat16(), torch.randn(B, Hkv, S, 192).bfloat16()
    v = torch.randn(B, Hkv, S, 128).bfloat16()
    out, dout = torch.randn(B, Hq, L, 128).bfloat16(), torch.randn(B, Hq, L, 128).bfloat16()
    lse = torch.randn(B, Hq, L)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fn(q, k, v, out, dout, lse, None, dq, dk, dv, 0.1, None, (), ())
    assert calls["pre"][7].shape == (B, Hq, 256, 192)  # dQ accumulator: q's head dim
    assert calls["main"][2] is v and calls["main"][8] is dv
    wide = torch.randn(B, Hkv, S, 192).bfloat16()
    with pytest.raises(ValueError, match="inconsistent shapes"):
        fn(q, k, wide, torch.randn(B, Hq, L, 192).bfloat16(), None, lse, None, dq, dk,
           torch.empty_like(wide), 0.1, None, (), ())


def test_pointwise_ops_compile_forward_and_backward(tmp_path):
    # The pointwise ops (mods_catalog.POINTWISE: tan, atan, sinh, cosh, asin, acos, log1p,
    # expm1, erf, round, trunc, sign, fmod on floats and ints, silu, logical ops on ints) through
    # the CuTe renderer into both sm90 kernels: every one of them is in the DSL's math and compiles.
    from mods_catalog import POINTWISE

    def every_op(score, b, h, q_idx, kv_idx):
        return sum((mod(score, b, h, q_idx, kv_idx) for mod in POINTWISE.values()), score) * 0.1

    program = _program(every_op, None)
    ops = {n.op for n in ir.walk(program.score)}
    assert {Op.TAN, Op.ATAN, Op.SINH, Op.COSH, Op.ASIN, Op.ACOS, Op.LOG1P, Op.EXPM1, Op.ERF,
            Op.ROUND, Op.TRUNC, Op.FMOD, Op.SHL, Op.SHR} <= ops
    ptx = _compile(tmp_path, 128, every_op, parts=("main",))
    assert "wgmma.mma_async" in ptx["main"]
    fwd_tpl = importlib.import_module("flexjit.templates.cute.sm90.fwd")
    mods = load_mods(program)
    cfg = fwd_tpl.FwdConfig(128, 128, cutlass.BFloat16, mods.score_mod, None)
    q = torch.randn(2, 4, 300, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 500, 128, dtype=torch.bfloat16)
    fn = fwd_tpl.compile_fwd(cfg, q, k, k.clone(), torch.empty_like(q), torch.empty(2, 4, 300), None,
                             (), (), options=f"--keep-ptx --dump-dir {tmp_path}")
    assert "wgmma.mma_async" in fn.compiled.__ptx__


def test_int64_index_math_compiles_forward_and_backward(tmp_path):
    # Index arithmetic that leaves int32 at the call's lengths is int64 in the program
    # (passes.widen); both sm90 kernels render and compile it (the values: the Triton and
    # reference tests against torch's eager mods).
    from flexjit.ir.passes import lower
    from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, trace_mod
    from mods_catalog import past_int32
    bias, mask = past_int32()
    program = lower(trace_mod(bias, SCORE_MOD), trace_mod(mask, MASK_MOD), float_index=True,
                    lengths=(2, 4, 300, 500))
    muls = {n.dtype for r in (program.score, program.mask) for n in ir.walk(r)
            if n.op is Op.MUL and n.dtype.is_int}
    assert muls == {ir.DType.INT64}
    ptx = _compile(tmp_path, 128, program=program, parts=("main",))
    assert "wgmma.mma_async" in ptx["main"] and "mul.lo.s64" in ptx["main"]
    fwd_tpl = importlib.import_module("flexjit.templates.cute.sm90.fwd")
    mods = load_mods(program)
    cfg = fwd_tpl.FwdConfig(128, 128, cutlass.BFloat16, mods.score_mod, mods.mask_mod)
    q = torch.randn(2, 4, 300, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 500, 128, dtype=torch.bfloat16)
    aux = tuple(_aux_tensor(t, torch.device("cpu")) for t in program.buffers)
    fn = fwd_tpl.compile_fwd(cfg, q, k, k.clone(), torch.empty_like(q), torch.empty(2, 4, 300), None,
                             aux, program.scalars, options=f"--keep-ptx --dump-dir {tmp_path}")
    assert "wgmma.mma_async" in fn.compiled.__ptx__ and "mul.lo.s64" in fn.compiled.__ptx__


@pytest.mark.parametrize("section", [8, 2])
@pytest.mark.parametrize("grid", [(64, 4, 2), (7, 3, 5), (1, 1, 1), (3, 16, 2)])
def test_lpt_order_is_a_bijection_longest_first(grid, section):
    # Every (kv tile, kv head, batch) exactly once; kv tiles in rising order inside each section
    # of (head, batch) pairs (tile 0 visits the most q blocks under a causal mask).
    nx, ny, nz = grid
    got = [tiling_tpl.lpt_coords(r, nx, ny, nz, section) for r in range(nx * ny * nz)]
    assert sorted(got) == sorted((n, h, b) for n in range(nx) for h in range(ny) for b in range(nz))
    pairs = ny * nz
    for sec in range(-(-pairs // section)):
        width = min(section, pairs - sec * section)
        block = got[sec * nx * section:][:nx * width]
        assert [n for n, _, _ in block] == sorted(n for n, _, _ in block)
        assert {(h, b) for _, h, b in block} == {(p % ny, p // ny) for p in
                                                 range(sec * section, sec * section + width)}


@pytest.mark.parametrize("config,D,causal", [("m128+psmem+dksmem+shuffle", 64, True),
                                             ("lpt2", 128, True), ("swapdq", 128, False),
                                             ("m128", 32, True), ("m128", 32, False),
                                             ("m128+shuffle", 32, True)])
def test_schedule_variants_compile_clean(tmp_path, config, D, causal):
    # Each variant the GPU suite runs builds without spills or serialised wgmma; the 128-row
    # tile at D = 64 fits only with P and dS read from shared memory and the stats shuffled,
    # at D = 32 (dK + dV 32 registers) with everything in registers.
    mods = load_mods(_program(None, fmods.causal() if causal else None))
    cfg = tpl.BwdConfig(D, D, cutlass.BFloat16, None, mods.mask_mod, has_block_mask=causal,
                        tiling=tiling_tpl.bwd_tiling(D, D, True, config))
    fn = host.compile_bwd(cfg, (), (), options=f"--keep-ptx --dump-dir {tmp_path}",
                         parts=("main", "post"))
    _assert_clean_registers(tmp_path, fn.parts["main"].compiled.__ptx__)
    assert "wgmma.mma_async" in fn.parts["main"].compiled.__ptx__


# The 128-row tile at D = 64 with P and dS read from registers (FlashAttention-4's tile): the
# dV GEMM issued once dS is in smem ("dvafter") leaves ptxas room for the wgmma pipeline; issued
# before the dPᵀ wait, or right after dS is formed ("late"), every wgmma is serialised (C7512).
# Masks only: score mods (ALiBi, softcap) spill there (their variants:
# test_m128_score_mods_compile_clean), and with "late" so does the document mask (8 bytes).
@pytest.mark.parametrize("config,name", [("m128+shuffle+dvafter", "full"),
                                         ("m128+shuffle+dvafter", "causal"),
                                         ("m128+shuffle+dvafter", "document"),
                                         ("m128+shuffle+late+dvafter", "full"),
                                         ("m128+shuffle+late+dvafter", "causal")])
def test_m128_in_registers_compiles_clean(tmp_path, config, name):
    case = make_case(name, 2, 4, 300, 500)
    program = _program(case.score_mod, case.mask_mod)
    mods = load_mods(program)
    cfg = tpl.BwdConfig(64, 64, cutlass.BFloat16, mods.score_mod_and_grad, mods.mask_mod,
                        has_block_mask=case.mask_mod is not None,
                        tiling=tiling_tpl.bwd_tiling(64, 64, True, config))
    ptx = _clean_main_ptx(tmp_path, cfg, program)
    # Every tile kind's dV GEMM (half the RS wgmmas, dK's the other half) lies between the dS
    # stores' proxy fence and the dS barrier.
    rs = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16\s+\{[^}]*\},\s*\{"
    between = re.findall(r"fence\.proxy\.async\.shared::cta;(.*?)bar\.sync\s+1, 256;", ptx, re.S)
    assert 2 * sum(len(re.findall(rs, seg)) for seg in between) == len(re.findall(rs, ptx)) > 0


def test_dv_after_ds_token():
    # "dvafter" moves the RS dV GEMM; with P read from smem ("psmem") there is none to move.
    t = tiling_tpl.bwd_tiling(64, 64, None, "m128+shuffle+dvafter")
    assert (t.tile_m, t.dq_split, t.shuffle_stats, t.dv_after_ds, t.p_late) == (128, "rows", True, True, False)
    assert not tiling_tpl.bwd_tiling(64, 64, None, "m128+shuffle").dv_after_ds
    with pytest.raises(ValueError, match="'dvafter'"):
        tiling_tpl.bwd_tiling(64, 64, None, "psmem+dvafter")


# The 128-row tile at D = 64 (and 32) with score mods, which spill or serialise on the default
# "m128+shuffle+dvafter" (D = 64: ALiBi 264 bytes, relative_bias 272, learnable_bias 660 / 380
# with its gradients, softcap 80 + C7512, t5_bias 104 + C7512, softcap_alibi_window 100 + C7512,
# learnable_alibi's gradients 8 + C7512). Mods whose d score/d score is 1 convert P after dS
# ("late"); with dP issued after P ("dpafter") the per-element bias table fits too. P∘dscore
# (softcap) needs P's 16-bit copy beside it: from smem ("psmem"), it fits with every mod.
# grads: the captured tensors' gradients in the kernel (``score_grads``).
_TALL_MODS = [("m128+shuffle+late+dvafter", 64, "alibi", False),
              ("m128+shuffle+late+dvafter", 64, "t5_bias", False),
              ("m128+shuffle+late+dvafter+dpafter", 64, "alibi", False),
              ("m128+shuffle+late+dvafter+dpafter", 64, "relative_bias", False),
              ("m128+shuffle+late+dvafter+dpafter", 64, "t5_bias", False),
              ("m128+shuffle+late+dvafter+dpafter+dksmem", 64, "learnable_alibi", True),
              ("m128+shuffle+late+dvafter+dpafter", 32, "alibi", False),
              ("m128+shuffle+late+dvafter+dpafter", 32, "relative_bias", False),
              ("m128+psmem+dksmem+shuffle+dpafter", 64, "softcap", False),
              ("m128+psmem+dksmem+shuffle+dpafter", 64, "softcap_alibi_window", False),
              ("m128+psmem+dksmem+shuffle+dpafter", 64, "relative_bias", False),
              ("m128+psmem+dksmem+shuffle+dpafter", 64, "learnable_bias", True),
              ("m128+psmem+dksmem+shuffle+dpafter", 64, "learnable_alibi", True),
              ("m128+psmem+dksmem+shuffle+dpafter", 32, "softcap", False)]


@pytest.mark.parametrize("config,D,name,grads", _TALL_MODS)
def test_m128_score_mods_compile_clean(tmp_path, config, D, name, grads):
    case = make_case(name, 2, 4, 300, 500)
    program = _program(case.score_mod, case.mask_mod)
    mods = load_mods(program)
    tiling = tiling_tpl.bwd_tiling(D, D, None, config)
    assert tiling.tile_m == 128 and not tiling.overlap_dp == ("dpafter" in config)
    cfg = tpl.BwdConfig(D, D, cutlass.BFloat16, mods.score_mod_and_grad, mods.mask_mod,
                        has_block_mask=case.mask_mod is not None, overlap_dp=True,
                        score_grads=mods.score_grads if grads else None,
                        grad_offsets=mods.grad_offsets if grads else None,
                        unit_dscore=unit_dscore(program), tiling=tiling)
    aux = tuple(_aux_tensor(t, torch.device("cpu")) for t in program.buffers)
    fn = host.compile_bwd(cfg, aux, program.scalars, options=f"--keep-ptx --dump-dir {tmp_path}",
                         parts=("main",))
    ptx = fn.parts["main"].compiled.__ptx__
    _assert_clean_registers(tmp_path, ptx)
    assert "wgmma.mma_async" in ptx and "ex2.approx" in ptx
    if grads:
        assert re.search(r"(red|atom)\.global(\.\w+)*\.add\.f64", ptx), "no fp64 atomic add"


def test_late_and_dpafter_tokens():
    # "late" with a score_mod: only where P∘dscore is P (d score/d score = 1); "dpafter" turns
    # off the overlap that the table's row always takes at head dims up to 96.
    from flexjit.backends.cute.sm90 import tiling_for
    alibi, softcap = (_program(make_case(n, 2, 4, 300, 500).score_mod, None)
                      for n in ("alibi", "softcap"))
    assert unit_dscore(alibi) and not unit_dscore(softcap)
    assert tiling_for(alibi, 64, 64, "m128+shuffle+late+dvafter").p_late
    with pytest.raises(ValueError, match="'late'"):
        tiling_for(softcap, 64, 64, "m128+shuffle+late+dvafter")
    assert tiling_tpl.bwd_tiling(64, 64, True, "m128").overlap_dp
    t = tiling_tpl.bwd_tiling(64, 64, True, "m128+dpafter")
    assert not t.overlap_dp and t == dataclasses.replace(tiling_tpl.bwd_tiling(64, 64, True, "m128"),
                                                         overlap_dp=False)
    with pytest.raises(ValueError):
        tiling_tpl.bwd_tiling(192, 192, True, "dpafter")
    # Without the derivative's constancy the kernel refuses "late" with a score_mod.
    mods = load_mods(softcap)
    with pytest.raises(AssertionError):
        tpl.FlexAttentionBwdSm90(tpl.BwdConfig(
            64, 64, cutlass.BFloat16, mods.score_mod_and_grad, None,
            tiling=tiling_tpl.bwd_tiling(64, 64, True, "m128+shuffle+late+dvafter")))


# One CTA per query head ("qhead"): the four head dims of the 128-key tile with no mods, the
# two masks the GPU suite runs (causal, documents: a captured tensor) and ALiBi (a per-head
# slope load, the heaviest of the three beside dK + dV at D = 128).
@pytest.mark.parametrize("name", ["full", "causal", "document", "alibi"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_qhead_compiles_clean(tmp_path, name, head_dim):
    case = make_case(name, 2, 4, 300, 500)
    program = _program(case.score_mod, case.mask_mod)
    mods = load_mods(program)
    overlap = True if light_mods(program) else None
    cfg = tpl.BwdConfig(head_dim, head_dim, cutlass.BFloat16, mods.score_mod_and_grad,
                        mods.mask_mod, has_block_mask=case.mask_mod is not None, overlap_dp=overlap,
                        tiling=tiling_tpl.bwd_tiling(head_dim, head_dim, overlap, "qhead"))
    ptx = _clean_main_ptx(tmp_path, cfg, program)
    _assert_qhead_epilogue(ptx)


def _assert_qhead_epilogue(ptx):
    # dK and dV leave by TMA reduce-add (fp32 boxes through smem): no plain TMA store remains,
    # no thread-issued atomics; the boxes are written 16 bytes at a time (dq_box_view).
    assert not re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx), "a plain dK/dV store"
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor\.4d\.global\.shared::cta\.add", ptx)) >= 4
    assert "red.global" not in ptx and "atom.global.add.f32" not in ptx
    assert "st.shared.v4.f32" in ptx or "st.shared.v4.b32" in ptx


@pytest.mark.parametrize("config,D,name,broadcast", [
    ("qhead+lpt", 64, "causal", False), ("qhead+lpt2", 128, "causal", False),
    ("qhead+dksmem+shuffle", 128, "causal", False), ("qhead", 128, "causal", True),
    ("qhead", 128, "learnable_alibi", False)])
def test_qhead_combinations_compile_clean(tmp_path, config, D, name, broadcast):
    # With the longest-first launches (the tuner's candidates: its order then walks query
    # heads), dS from smem for dK, K/V broadcast over the batch, learnable captured tensors.
    case = make_case(name, 2, 4, 300, 500)
    program = _program(case.score_mod, case.mask_mod)
    mods = load_mods(program)
    overlap = True if light_mods(program) else None
    cfg = tpl.BwdConfig(D, D, cutlass.BFloat16, mods.score_mod_and_grad, mods.mask_mod,
                        has_block_mask=case.mask_mod is not None, overlap_dp=overlap,
                        score_grads=getattr(mods, "score_grads", None),
                        grad_offsets=getattr(mods, "grad_offsets", None), kv_batch_broadcast=broadcast,
                        tiling=tiling_tpl.bwd_tiling(D, D, overlap, config))
    _assert_qhead_epilogue(_clean_main_ptx(tmp_path, cfg, program))


def test_qhead_tiling_and_tokens():
    # "qhead" sets q_head on the table's row, with any other 128-key variant but the swapped dQ
    # (whose transposed postprocess the dK/dV workspaces cannot share); not at head dim 192.
    row = tpl.choose_bwd_tiling(128, 128, True)
    assert tiling_tpl.bwd_tiling(128, 128, True, "qhead") == dataclasses.replace(row, q_head=True)
    assert tiling_tpl.bwd_tiling(64, 64, None, "qhead+lpt2") == dataclasses.replace(
        tpl.choose_bwd_tiling(64, 64), q_head=True, lpt_section=2)
    assert not tiling_tpl.bwd_tiling(128, 128, True, "lpt").q_head
    for bad in ("qhead+swapdq", "qhead+m80"):
        with pytest.raises(ValueError, match="swapped dQ"):
            tiling_tpl.bwd_tiling(128, 128, True, bad)
    with pytest.raises(ValueError, match="only backward variant"):
        tiling_tpl.bwd_tiling(192, 192, None, "qhead")
    # The kernel refuses what the host routes to the head loop.
    with pytest.raises(AssertionError):
        tpl.FlexAttentionBwdSm90(tpl.BwdConfig(128, 128, cutlass.BFloat16, None, None,
                                               deterministic=True,
                                               tiling=dataclasses.replace(row, q_head=True)))


def test_host_launch_qhead_workspaces():
    # q_head: the main kernel gets zeroed fp32 (B, Hkv, Spad, D) workspaces for dK and dV (one
    # allocation), and the postprocess's kernel runs three times: dQ (scaled), then dK and dV
    # from their workspaces at scale 1 (the main kernel scales dK). K/V broadcast over the
    # batch: the workspaces have the query's batch, as dK/dV do.
    for broadcast in (False, True):
        calls = []

        def recorder(name):
            return lambda *args: calls.append((name, args))

        cfg = tpl.BwdConfig(64, 64, cutlass.BFloat16, None, None, kv_batch_broadcast=broadcast,
                            tiling=tiling_tpl.bwd_tiling(64, 64, None, "qhead"))
        fn = host.load_bwd(cfg, {name: recorder(name) for name in host.PARTS})
        B, Hq, Hkv, L, S, D = 3, 8, 2, 200, 300, 64
        q, out = torch.randn(B, Hq, L, D).bfloat16(), torch.randn(B, Hq, L, D).bfloat16()
        Bk = 1 if broadcast else B
        k, v = torch.randn(Bk, Hkv, S, D).bfloat16(), torch.randn(Bk, Hkv, S, D).bfloat16()
        dq = torch.empty_like(q)
        dk, dv = torch.empty(B, Hkv, S, D).bfloat16(), torch.empty(B, Hkv, S, D).bfloat16()
        fn(q, k, v, out, torch.randn_like(out), torch.randn(B, Hq, L), None, dq, dk, dv, 0.125,
           None, (), ())
        assert [name for name, _ in calls] == ["pre", "main", "post", "post", "post"]
        main = calls[1][1]
        dkacc, dvacc = main[7], main[8]
        for acc in (dkacc, dvacc):
            assert acc.shape == (B, Hkv, 384, D) and acc.dtype == torch.float32
            assert acc.is_contiguous() and not acc.any()
        assert dvacc.data_ptr() == dkacc.data_ptr() + dkacc.numel() * 4  # one memset
        assert main[10] == Hq // Hkv
        assert calls[2][1][1] is dq and calls[2][1][2] == 0.125
        assert calls[3][1][0] is dkacc and calls[3][1][1] is dk and calls[3][1][2] == 1.0
        assert calls[4][1][0] is dvacc and calls[4][1][1] is dv and calls[4][1][2] == 1.0


def test_qhead_main_kernel_takes_fp32_dk_dv():
    # The compile's placeholders: dK/dV fp32 under q_head (the workspaces), the input dtype else.
    for config, want in (("qhead", cutlass.Float32), ("", cutlass.BFloat16)):
        cfg = tpl.BwdConfig(64, 64, cutlass.BFloat16, None, None,
                            tiling=tiling_tpl.bwd_tiling(64, 64, None, config) if config else None)
        args = host._main_args(cfg, (), ())
        assert args[7].element_type == want and args[8].element_type == want
        assert args[0].element_type == cutlass.BFloat16
