"""Compile-only tests of the Hopper CuTeDSL forward template (CPU, no GPU needed).

Each test builds the kernel for sm_90a from CPU example tensors and checks the PTX for the
instructions the design depends on: wgmma (a silent fall back to mma.sync/SIMT fails),
setmaxnreg (warp specialisation with register reallocation) and cp.async.bulk.tensor (TMA).
It also runs ptxas (from Triton's wheel, when present) to check that nothing spills.

Measured on the dev CPU (cutlass-dsl 4.8.1): ~1-2 s per compile without mods, ~3-4 s with a
causal mask_mod and a block mask, ~5-6 s with score_mod + mask_mod reading aux buffers (ptxas
adds ~0.3 s each). The whole file takes 35-60 s, so nothing is marked slow. Shapes are tiny on purpose: sizes and strides are runtime
values, so they do not change the generated code.
"""

import importlib
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402

from ptx_checks import assert_no_spills, ptxas_report  # noqa: E402

_tpl = importlib.import_module("flexjit.templates.cute.sm90.fwd")
FwdConfig, compile_fwd = _tpl.FwdConfig, _tpl.compile_fwd


# Test mods, hand-written in CuTeDSL until the code generator emits them.
@cute.jit
def causal_mask(b, h, q_idx, kv_idx, aux):
    return q_idx >= kv_idx


@cute.jit
def alibi_softcap_score(score, b, h, q_idx, kv_idx, aux):
    slopes = aux.tensors[0]  # (Hq,) fp32
    slope = slopes[cutlass.min(h, slopes.shape[0] - 1)]
    cap = aux.scalars[0]  # runtime Float32
    s = score + slope * Float32(kv_idx - q_idx)
    return cap * cute.math.tanh(s / cap)


@cute.jit
def document_mask(b, h, q_idx, kv_idx, aux):
    doc = aux.tensors[1]  # (S,) int32
    last = doc.shape[0] - 1
    return doc[cutlass.min(q_idx, last)] == doc[cutlass.min(kv_idx, last)]


def _block_mask(nq, nk):
    """A BlockMask with one partial and one full block per query row (content is irrelevant
    for compilation, only dtypes and ranks)."""
    ones = torch.ones(1, 1, nq, dtype=torch.int32)
    idx = torch.zeros(1, 1, nq, nk, dtype=torch.int32)
    return ones, idx, ones.clone(), idx.clone()


def _compile(tmp_path, head_dim, score_mod=None, mask_mod=None, sparse=False, aux=(), scalars=(),
             persistent=False, dynamic_schedule=False, tile_m=None, fp8=False, pack_gqa=1):
    """``head_dim``: D, or a (D, Dv) pair. ``fp8``: e4m3 q, k and Vᵀ (keys padded to 128).
    ``pack_gqa``: the query heads folded into a tile's rows."""
    head_dim, head_dim_v = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)
    # L != S and neither a multiple of 128; GQA 4/2: the compile must not depend on any of it.
    b, hq, hkv, seq_q, seq_k = 2, 4, 2, 300, 500
    q = torch.randn(b, hq, seq_q, head_dim, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, seq_k, head_dim, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, seq_k, head_dim_v, dtype=torch.bfloat16)
    o = torch.empty(b, hq, seq_q, head_dim_v, dtype=torch.bfloat16)
    lse = torch.empty(b, hq, seq_q)
    bm = _block_mask((seq_q + 127) // 128, (seq_k + 127) // 128) if sparse else None
    if sparse and tile_m == 192:  # merged rows: the fifth list, the partial entries' kinds
        bm = bm + (bm[1].clone(),)
    if fp8:
        q, k = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
        v = torch.zeros(b, hkv, head_dim_v, 512, dtype=torch.float8_e4m3fn)
    cfg = FwdConfig(head_dim, head_dim_v, cutlass.BFloat16, score_mod, mask_mod, has_block_mask=sparse,
                    tiling=_tpl.choose_tiling(head_dim, head_dim_v, sparse, persistent=persistent,
                                              dynamic_schedule=dynamic_schedule, tile_m=tile_m,
                                              fp8=fp8), fp8=fp8, pack_gqa=pack_gqa)
    fn = compile_fwd(cfg, q, k, v, o, lse, bm, aux, scalars,
                     options=f"--keep-ptx --keep-cubin --dump-dir {tmp_path}")
    ptx = fn.compiled.__ptx__
    assert ptx, "no PTX produced"
    return ptx


def _assert_hopper_path(ptx):
    assert "wgmma.mma_async" in ptx, "no wgmma: the kernel fell off the Hopper tensor-core path"
    assert "mma.sync" not in ptx, "mma.sync found: Ampere-style MMA instead of wgmma"
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx, "no register reallocation"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads/stores"
    assert "stmatrix" in ptx, "epilogue does not use stmatrix"
    assert "ex2.approx" in ptx, "softmax is not in the exp2 domain"


# Every (D, Dv) of the tile table: the original three, then 32, 96, 192 and
# (192, 128) (DeepSeek-style q/k wider than v).
HEAD_DIMS = [64, 128, 256, 32, 96, 192, (192, 128)]
_IDS = [f"d{d[0]}_v{d[1]}" if isinstance(d, tuple) else f"d{d}" for d in HEAD_DIMS]


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=_IDS)
def test_no_mods(tmp_path, head_dim):
    ptx = _compile(tmp_path, head_dim)
    _assert_hopper_path(ptx)
    assert_no_spills(tmp_path, ptx)


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=_IDS)
def test_causal_block_sparse(tmp_path, head_dim):
    ptx = _compile(tmp_path, head_dim, mask_mod=causal_mask, sparse=True)
    _assert_hopper_path(ptx)
    assert_no_spills(tmp_path, ptx)


def test_causal_dense_mask_mod(tmp_path):
    # mask_mod without a block mask: every kv tile is treated as partial.
    _assert_hopper_path(_compile(tmp_path, 128, mask_mod=causal_mask))


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=_IDS)
def test_score_and_mask_mods_with_aux(tmp_path, head_dim):
    slopes = torch.rand(4)
    docs = torch.zeros(500, dtype=torch.int32)
    ptx = _compile(tmp_path, head_dim, alibi_softcap_score, document_mask, sparse=True,
                   aux=(slopes, docs), scalars=(30.0,))
    _assert_hopper_path(ptx)
    assert_no_spills(tmp_path, ptx)
    # The softcap is a runtime kernel parameter, not a constant folded into the code.
    assert "tanh" in ptx or "ex2" in ptx
    assert "30.0" not in ptx and "0f41F00000" not in ptx, "runtime scalar was baked in"


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("mods", ["causal", "alibi_softcap_document"])
def test_merged_rows_192(tmp_path, mods, persistent):
    """D = 64 with a block mask on the 192-row tile (three consumer warpgroups at 160
    registers). Causal compiles one tile per CTA without spills or serialised wgmmas; heavier
    mods and the persistent kernel spill (these hand-written mods 50-320 bytes), and the tile
    is chosen where it measured faster all the same (``cute_sm90.MERGED_MAX_PARTIAL``)."""
    if mods == "causal":
        ptx = _compile(tmp_path, 64, mask_mod=causal_mask, sparse=True, tile_m=192,
                       persistent=persistent, dynamic_schedule=persistent)
    else:
        ptx = _compile(tmp_path, 64, alibi_softcap_score, document_mask, sparse=True, tile_m=192,
                       aux=(torch.rand(4), torch.zeros(500, dtype=torch.int32)), scalars=(30.0,),
                       persistent=persistent, dynamic_schedule=persistent)
    _assert_hopper_path(ptx)
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+160;", ptx), "not the 3-warpgroup split"
    from benchmarks import sass_compare
    ins = sass_compare.disassemble(sass_compare._largest_cubin(str(tmp_path)))
    if mods == "causal" and not persistent:
        assert_no_spills(tmp_path, ptx, no_serialised_wgmma=True)
        if _under_pv(_first_wgmma_loop(ins)) < 64:
            # The merged kinds are read after the S wait for a mask without row limits; read
            # before the GEMMs they kept the overlap here but spilled 20 bytes a tile.
            pytest.xfail("the partial tiles' mask waits for the PV GEMM")
    else:
        assert "serialized" not in ptxas_report(tmp_path, ptx)  # C7512: wgmmas stay async
        assert _under_pv(_first_wgmma_loop(ins)) >= 64, "the partial tiles' mods wait for the PV GEMM"


_INTERVAL_MASKS = ["causal", "sliding_window", "prefix_lm_per_batch", "batch_dependent"]
_ROW_LIMIT_SPILLS = {(64, "sliding_window"): 8}  # spill-store bytes ptxas reports now


@pytest.mark.parametrize("name", _INTERVAL_MASKS)
@pytest.mark.parametrize("head_dim,tile_m", [(64, 192), (32, 192), (128, None)])
def test_interval_masks_by_row_limits(tmp_path, name, head_dim, tile_m):
    """Rendered masks that keep one interval of keys per row (``mask_mod.rows``: causal, a
    window, a per-batch prefix read from a tensor, padding lengths) on the production tiles,
    persistent: no spills, no serialised wgmma, and on the partial tiles one select per score
    (the SASS of the loop over partial tiles: mask_mod per score, the merged rows' kinds and
    the bound took three on D = 64's 192-row tile)."""
    from benchmarks import sass_compare
    from flexjit.backends.cute.sm90 import load_mods
    from flexjit.frontend.trace import MASK_MOD, trace_mod
    from flexjit.ir.passes import lower
    from mods_catalog import make_case

    torch.manual_seed(0)
    program = lower(None, trace_mod(make_case(name, 2, 4, 300, 500).mask_mod, MASK_MOD),
                    float_index=True)
    mask_mod = load_mods(program).mask_mod
    assert mask_mod.rows is not None
    ptx = _compile(tmp_path, head_dim, mask_mod=mask_mod, sparse=True, tile_m=tile_m,
                   aux=program.buffers, scalars=program.scalars, persistent=True,
                   dynamic_schedule=True)
    if (head_dim, name) in _ROW_LIMIT_SPILLS:
        # evaluating mask_mod per score there, the persistent tile spilled 56-68 bytes for
        # each of these masks; with row limits only the window's two limits still spill
        report = ptxas_report(tmp_path, ptx)
        stores = int(re.search(r"(\d+) bytes spill stores", report).group(1))
        assert stores <= _ROW_LIMIT_SPILLS[head_dim, name] and "serialized" not in report, report
    else:
        assert_no_spills(tmp_path, ptx, no_serialised_wgmma=True)
    ins = sass_compare.disassemble(sass_compare._largest_cubin(str(tmp_path)))
    partial = _first_wgmma_loop(ins)
    scores = 64  # per thread: a warpgroup's 64 rows x 128 keys over its 128 threads
    selects = sum(sass_compare._opcode(t) == "FSEL" for t in partial)
    assert scores <= selects <= scores + 8, selects
    assert _under_pv(partial) >= scores, "the partial tiles' masking waits for the PV GEMM"


def _under_pv(loop):
    """How many instructions of a loop lie between its two wgmma waits (wait_group 1, then 0):
    the work that overlaps the PV GEMM. With one load that all the masking waits for after the S
    wait (the merged rows' kinds), ptxas put the second wait 3-11 instructions after the first."""
    first = next(i for i, t in enumerate(loop) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in t)
    second = next(i for i, t in enumerate(loop) if i > first and "DEPBAR.LE gsb0, 0x0" in t)
    return second - first - 1


def _wgmma_loops(ins):
    """The bodies of the loops that issue wgmmas, in address order."""
    for addr, text in ins:
        m = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        start = int(m.group(1), 16) if m else None
        if start is not None and start < addr and text.startswith("@"):  # a loop's back edge
            body = [t for a, t in ins if start <= a <= addr]
            if any("HGMMA" in t for t in body):
                yield body


def _first_wgmma_loop(ins):
    """The body of the first loop that issues wgmmas: the loop over partial tiles (visited
    before the full ones)."""
    for body in _wgmma_loops(ins):
        return body
    raise AssertionError("no loop issues wgmmas")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mods", ["none", "causal_sparse", "alibi_softcap_document"])
def test_fp8(tmp_path, head_dim, mods):
    """The FP8 forward: both GEMMs on e4m3 wgmma, P converted by cvt (two values an
    instruction), no spills, no serialised wgmma."""
    if mods == "none":
        ptx = _compile(tmp_path, head_dim, fp8=True)
    elif mods == "causal_sparse":
        ptx = _compile(tmp_path, head_dim, mask_mod=causal_mask, sparse=True, fp8=True)
    else:
        ptx = _compile(tmp_path, head_dim, alibi_softcap_score, document_mask, sparse=True,
                       aux=(torch.rand(4), torch.zeros(500, dtype=torch.int32)), scalars=(30.0,),
                       fp8=True)
    _assert_hopper_path(ptx)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.(\w+)", ptx))
    tile_n = _tpl.choose_tiling(head_dim, head_dim, fp8=True).tile_n
    assert shapes == {(f"m64n{tile_n}k32", "e4m3", "e4m3"), (f"m64n{head_dim}k32", "e4m3", "e4m3")}, shapes
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if mods == "alibi_softcap_document" and head_dim == 128:
        # The FP8 scale (scale × |q·k descales|) is a register where the 16-bit kernel reads a
        # parameter: with these three hand-written mods at once ptxas spills 12 bytes.
        out = ptxas_report(tmp_path, ptx)
        spilled = re.search(r"(\d+) bytes spill stores", out)
        assert spilled and int(spilled.group(1)) <= 16 and "serialized" not in out, out
    else:
        assert_no_spills(tmp_path, ptx, no_serialised_wgmma=True)


def test_fp8_loop_is_the_16_bit_loop_with_e4m3_gemms(tmp_path):
    """On the SASS of the steady-state loop (sass_compare's path, dense D = 128): the FP8
    forward runs the bf16 forward's softmax instruction for instruction (exp2, max, sums,
    scaling, the row reductions' shuffles) and differs only in its GEMMs (QGMMA, k = 32) and P's
    conversion: 32 two-value e4m3 converts and at most 16 byte permutes to pair them, no
    shuffles (KEY_SLOT's permuted Vᵀ makes the accumulator layout P's operand layout)."""
    import collections

    from benchmarks import sass_compare as sc

    ops = {}
    for fp8 in (False, True):
        cubin = sc._ours("fwd", False, str(tmp_path / str(fp8)), 128, None, fp8)
        path, _ = sc.hot_path(sc.disassemble(cubin))
        ops[fp8] = collections.Counter(map(sc._opcode, path))
    bf16, e4m3 = ops[False], ops[True]
    for op in ("MUFU.EX2", "FMNMX", "FFMA", "FADD", "FMUL", "SHFL.BFLY"):
        assert e4m3[op] == bf16[op] > 0, (op, e4m3[op], bf16[op])
    assert e4m3["QGMMA.64x128x32.F32.E4M3.E4M3"] == 8 and not any(o.startswith("HGMMA") for o in e4m3)
    assert sum(n for o, n in e4m3.items() if o.startswith("F2FP") and "E4M3" in o) == 32
    assert e4m3["PRMT"] <= 16


@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, False), (64, True), (128, True)])
def test_p_conversion_and_o_rescale_interleave_with_exp2(tmp_path, head_dim, causal):
    """On the loops over unmasked tiles (dense; with a causal block mask, the loop over full
    tiles, the one with the most wgmmas), P's 32 bf16 conversions interleave with the 64 exp2s,
    and at head dim 64 O's multiplies by the row factor too (``interleave_rescale``): at most 8
    of either in a row with no exp2 between. Left to LLVM the conversions all ran after the
    last exp2, and the multiplies waited behind a warp vote and the factor's exp2 (issued
    last): chains of waits the tile's latency paid. At 128 the vote stays (it measured faster)."""
    from benchmarks import sass_compare as sc

    ins = sc.disassemble(sc._ours("fwd", causal, str(tmp_path), head_dim))
    loop = max(_wgmma_loops(ins), key=lambda b: sum("HGMMA" in t for t in b))
    ops = [sc._opcode(t) for t in loop]
    assert sum(o.startswith("F2FP") for o in ops) >= 32 and ops.count("FMUL") >= head_dim // 2
    checks = [("conversions", lambda o: o.startswith("F2FP"))]
    if head_dim <= 64:
        checks.append(("multiplies", lambda o: o == "FMUL"))
    for name, match in checks:
        longest = run = 0
        for op in ops:
            run = run + 1 if match(op) else 0 if op.startswith("MUFU.EX2") else run
            longest = max(longest, run)
        assert longest <= 8, f"{longest} {name} in a row after an exp2"


def test_fp8_tiling_refuses():
    with pytest.raises(NotImplementedError, match="FP8 head dims"):
        _tpl.choose_tiling(96, 96, fp8=True)
    with pytest.raises(NotImplementedError, match="one tile per CTA"):
        _tpl.choose_tiling(128, 128, persistent=True, fp8=True)
    for D, sparse in ((64, True), (128, False), (256, False)):
        with pytest.raises(NotImplementedError, match="192 at head dim 64 without a block mask"):
            _tpl.choose_tiling(D, D, sparse, tile_m=192, fp8=True)


def test_fp8_tiling_rows():
    """D = 64 without a block mask: the 16-bit row's 192 × 128 tile (three consumer warpgroups);
    128 rows with a block mask or pinned; D = 128 and 256 as before."""
    T = _tpl.Tiling
    assert _tpl.choose_tiling(64, 64, False, fp8=True) == T(192, 128, 3, 3, True, 160, 32)
    assert _tpl.choose_tiling(64, 64, False, tile_m=192, fp8=True) == T(192, 128, 3, 3, True, 160, 32)
    assert _tpl.choose_tiling(64, 64, False, tile_m=128, fp8=True) == T(128, 128, 3, 2, True, 240, 24)
    assert _tpl.choose_tiling(64, 64, True, fp8=True) == T(128, 128, 3, 2, True, 240, 24)
    assert _tpl.choose_tiling(128, 128, False, fp8=True) == T(128, 128, 3, 2, True, 240, 24)
    assert _tpl.choose_tiling(256, 256, True, fp8=True) == T(128, 64, 2, 2, False, 240, 24)


def test_tile_192_only_at_head_dims_32_64_and_96():
    assert _tpl.choose_tiling(64, 64, True, tile_m=192).num_mma_wgs == 3
    assert _tpl.choose_tiling(64, 64, False, tile_m=128).tile_m == 128
    # Head dim 96: only where asked for, with P through shared memory, within smem persistent too.
    T = _tpl.Tiling
    for sparse in (False, True):
        assert _tpl.choose_tiling(96, 96, sparse, tile_m=192) == \
            T(192, 128, 2, 3, True, 160, 32, p_smem=True)
        for persistent in (False, True):
            cfg = FwdConfig(96, 96, cutlass.BFloat16, has_block_mask=sparse,
                            tiling=_tpl.choose_tiling(96, 96, sparse, persistent=persistent,
                                                      tile_m=192))
            assert _tpl.smem_bytes(cfg) <= _tpl.SMEM_CAPACITY
    assert not _tpl.choose_tiling(96, 96, True).p_smem
    with pytest.raises(NotImplementedError, match="192 rows are served at head dims 32, 64 and 96"):
        _tpl.choose_tiling(128, 128, True, tile_m=192)


@cute.jit
def alibi_score(score, b, h, q_idx, kv_idx, aux):
    slopes = aux.tensors[0]  # (Hq,) fp32
    return score + slopes[cutlass.min(h, slopes.shape[0] - 1)] * Float32(kv_idx - q_idx)


@cute.jit
def softcap_score(score, b, h, q_idx, kv_idx, aux):
    cap = aux.scalars[0]  # runtime Float32
    return cap * cute.math.tanh(score / cap)


@cute.jit
def sliding_window_mask(b, h, q_idx, kv_idx, aux):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 1024)


_DOCS = torch.zeros(500, dtype=torch.int32)
# The mods each 192-row tile below is compiled with: name -> _compile's keyword arguments.
_TILE_192_MODS = {
    "no_mods": {},
    "alibi": {"score_mod": alibi_score, "aux": (torch.rand(4),)},
    "softcap": {"score_mod": softcap_score, "scalars": (30.0,)},
    "causal": {"mask_mod": causal_mask, "sparse": True},
    "sliding_window": {"mask_mod": sliding_window_mask, "sparse": True},
    "document": {"mask_mod": document_mask, "sparse": True, "aux": (torch.rand(4), _DOCS)},
}
# Per head dim, the mods that spill as ptxas reports them now (stores/loads in bytes,
# cutlass-dsl 4.8.1's ptxas); the others compile spill-free.
# * D = 96: three consumer warpgroups at 160 registers, O 48 + S 64 per thread while PV(j-1) is
#   in flight; P goes through smem so no register holds it then. Document spills the merged
#   rows' kind shift (2 · which mask-block row), a per-thread value kept through the partial
#   loop. Formed from the warp index instead, it takes document to none, but then sliding
#   window spills one of the four stmatrix addresses of P's store (4/4), so it stays as it is.
# * D = 32: D = 64's row (P in registers): O 16 + S 64 + P 32 per thread; the window's two
#   limits spill as on D = 64's merged tile.
_TILE_192_SPILLS = {96: {"document": "4/4"}, 32: {"sliding_window": "8/32"}}


@pytest.mark.parametrize("name", list(_TILE_192_MODS))
@pytest.mark.parametrize("head_dim", [96, 32])
def test_tile_192_beside_head_dim_64(tmp_path, head_dim, name):
    """Head dims 96 and 32 on 192×128 tiles (``tile_m=192``): the three-warpgroup register
    split; at 96 P through smem (the SS PV GEMM), at 32 P read from registers (RS); wgmmas
    never serialised (C7512), and no spills where ptxas reports none (the others are xfails
    that fail once the spill is gone, so a fix shows)."""
    spills = _TILE_192_SPILLS[head_dim].get(name)
    ptx = _compile(tmp_path, head_dim, tile_m=192, **_TILE_192_MODS[name])
    _assert_hopper_path(ptx)
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+160;", ptx), "not the 3-warpgroup split"
    # RS wgmma names a register A operand ({...}); the SS form passes two descriptors.
    rs_pv = re.search(rf"wgmma\.mma_async[^;]*m64n{head_dim}k16[^;]*\{{[^}}]*\}},\s*\{{", ptx)
    if head_dim == 96:
        assert not rs_pv, "PV is not SS"
    else:
        assert rs_pv, "PV is not RS"
    report = ptxas_report(tmp_path, ptx)
    assert "serialized" not in report, report
    if spills is not None:
        assert "0 bytes spill stores" not in report, report
        pytest.xfail(f"ptxas spills (stores/loads {spills} bytes)")
    assert_no_spills(tmp_path, ptx, no_serialised_wgmma=True)


def test_tile_table():
    """The table's rows: 64/128/256 exactly as they were before the other rows came (their kernels must stay
    byte-identical), and for every (D, Dv) with a block mask a 128-row tile whose tile_n divides
    the 128-key mask block; every row within the 227 KB of shared memory."""
    T = _tpl.Tiling
    assert _tpl.choose_tiling(64, 64, False) == T(192, 128, 3, 3, True, 160, 32)
    assert _tpl.choose_tiling(64, 64, True) == T(128, 128, 3, 2, True, 240, 24)
    assert _tpl.choose_tiling(128, 128, True) == _tpl.choose_tiling(128, 128, False) == \
        T(128, 128, 2, 2, True, 240, 24)
    assert _tpl.choose_tiling(256, 256, True) == T(128, 64, 2, 2, False, 240, 24)
    assert _tpl.choose_tiling(32, 32, False) == _tpl.choose_tiling(32, 32, True) == \
        T(128, 128, 3, 2, True, 240, 24)
    assert _tpl.choose_tiling(96, 96, False) == T(128, 128, 2, 2, True, 240, 24)
    assert _tpl.choose_tiling(192, 192, True) == T(128, 64, 2, 2, True, 240, 24)
    assert _tpl.choose_tiling(192, 128, True) == T(128, 128, 2, 2, True, 240, 24)
    for d, dv in _tpl.HEAD_DIMS:
        for sparse in (False, True):
            cfg = FwdConfig(d, dv, cutlass.BFloat16, has_block_mask=sparse)
            t = cfg.tiling
            assert _tpl.smem_bytes(cfg) <= _tpl.SMEM_CAPACITY, (d, dv, _tpl.smem_bytes(cfg))
            # Registers: consumers at mma_regs, the producer warpgroup at load_regs.
            assert 128 * (t.num_mma_wgs * t.mma_regs + t.load_regs) <= 65536
            if sparse:
                assert t.tile_m == 128 and 128 % t.tile_n == 0
            _tpl.FlexAttentionFwdSm90(cfg)
    for d, dv in ((128, 96), (96, 128), (80, 80), (512, 512), (192, 64)):
        with pytest.raises(NotImplementedError, match="head dims"):
            _tpl.choose_tiling(d, dv, True)


# ------------------------------------------------------------------ the persistent variant
# Tiling.persistent: min(num_tiles, num_SMs) CTAs loop over the tiles (grid-stride over
# %nctaid.x), O has its own smem buffer, and the epilogue waits for the previous tile's TMA store
# to finish reading it (cp.async.bulk.wait_group.read before the barrier ahead of stmatrix) plus
# once after the loop.


def _assert_persistent(ptx):
    assert "%nctaid.x" in ptx, "no grid-stride tile loop"
    assert ptx.count("cp.async.bulk.wait_group.read") >= 2, "sO reuse is not guarded"


def test_default_is_not_persistent(tmp_path):
    assert FwdConfig(128, 128, cutlass.BFloat16).tiling.persistent is False
    assert "%nctaid.x" not in _compile(tmp_path, 128)


@pytest.mark.parametrize("head_dim", [64, 128, 32, 96])
def test_persistent_no_mods(tmp_path, head_dim):
    ptx = _compile(tmp_path, head_dim, persistent=True)
    _assert_hopper_path(ptx)
    _assert_persistent(ptx)
    assert_no_spills(tmp_path, ptx)


@pytest.mark.parametrize("head_dim", [64, 128, 32, 96])
def test_persistent_causal_block_sparse(tmp_path, head_dim):
    ptx = _compile(tmp_path, head_dim, mask_mod=causal_mask, sparse=True, persistent=True)
    _assert_hopper_path(ptx)
    _assert_persistent(ptx)
    assert_no_spills(tmp_path, ptx)


def test_persistent_causal_dense_mask_mod(tmp_path):
    ptx = _compile(tmp_path, 128, mask_mod=causal_mask, persistent=True)
    _assert_hopper_path(ptx)
    _assert_persistent(ptx)
    assert_no_spills(tmp_path, ptx)


def test_persistent_score_and_mask_mods_with_aux(tmp_path):
    slopes = torch.rand(4)
    docs = torch.zeros(500, dtype=torch.int32)
    ptx = _compile(tmp_path, 128, alibi_softcap_score, document_mask, sparse=True,
                   aux=(slopes, docs), scalars=(30.0,), persistent=True)
    _assert_hopper_path(ptx)
    _assert_persistent(ptx)
    assert_no_spills(tmp_path, ptx)
    assert "30.0" not in ptx and "0f41F00000" not in ptx, "runtime scalar was baked in"


def test_persistent_smem_budget():
    """O's own buffer must fit: D=128 192 KB, D=64 <= 148 KB, D=96 145 KB, D=32 65 KB; D=256
    and 192 (either Dv) are refused up front."""
    for d, sparse in ((64, False), (64, True), (128, False), (128, True), (32, False), (32, True),
                      (96, False), (96, True)):
        cfg = FwdConfig(d, d, cutlass.BFloat16, has_block_mask=sparse,
                        tiling=_tpl.choose_tiling(d, d, sparse, persistent=True))
        assert _tpl.smem_bytes(cfg) <= _tpl.SMEM_CAPACITY
        _tpl.FlexAttentionFwdSm90(cfg)  # the constructor's own check passes
    for d, dv in ((256, 256), (192, 192), (192, 128)):
        with pytest.raises(NotImplementedError, match="persistent"):
            _tpl.choose_tiling(d, dv, True, persistent=True)


def test_persistent_flag_reaches_the_kernel_and_the_cache_keys(tmp_path, monkeypatch):
    """persistent=True compiles the persistent kernel through the backend, under its own
    in-memory key and its own disk-cache key (the tiling is in ``_frozen_config``)."""
    import dataclasses

    from flexjit.backends import kernel_cache as cache
    from flexjit.backends.cute import sm90 as backend
    from mods_catalog import lowered

    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(backend, "_COMPILED", {})
    program = lowered(None, None)
    q = torch.randn(1, 2, 200, 128, dtype=torch.bfloat16)
    k = v = torch.randn(1, 2, 300, 128, dtype=torch.bfloat16)
    fns = {}
    for flag in ("0", "1"):
        fns[flag] = backend.compile_program(program, q, k, v, None, (), persistent=flag == "1",
                                            options=f"--keep-ptx --dump-dir {tmp_path}")
    assert fns["0"].cfg.tiling.persistent is False and fns["1"].cfg.tiling.persistent is True
    assert "%nctaid.x" in fns["1"].compiled.__ptx__ and "%nctaid.x" not in fns["0"].compiled.__ptx__
    assert len(backend._COMPILED) == 2  # two in-memory entries
    frozen = [backend._frozen_config(f.cfg, (), program, "") for f in fns.values()]
    assert dataclasses.astuple(fns["1"].cfg.tiling) in frozen[1]
    keys = {cache.kernel_key(program.key, "cute_sm90_fwd", fz, "sm90") for fz in frozen}
    assert len(keys) == 2  # two disk-cache files
    # head_dim 256 keeps the per-tile kernel under the flag (no room for O's own buffer)
    assert not backend._persistent_fwd(256, None, 1024) and backend._persistent_fwd(128, None, 1024)


# ------------------------------------------------------------------ the dynamic tile scheduler
# Tiling.dynamic_schedule (persistent only): after block_idx, a CTA's producer claims tiles with
# an atomic add on a global counter (grid_dim + old value), publishes each index to the
# consumers through smem with that tile's Q (the sentinel with a plain mbarrier arrive), and the
# last CTA to finish zeroes the counter for the next launch.
_GLOBAL_ATOMIC_ADD = re.compile(r"\b(atom|red)(\.\w+)*\.global(\.\w+)*\.add\b")


def _assert_dynamic(ptx):
    assert _GLOBAL_ATOMIC_ADD.search(ptx), "no atomic add on global memory (the tile counter)"
    # One tile claim per tile plus one finished-CTA count at exit.
    assert len(_GLOBAL_ATOMIC_ADD.findall(ptx)) >= 2
    assert re.search(r"mbarrier\.arrive\.shared\.b64 [^;]*;", ptx), "no plain arrive (sentinel)"
    assert "bar.warp.sync" in ptx


def test_dynamic_schedule_is_the_persistent_default():
    assert _tpl.choose_tiling(128, 128, True, persistent=True).dynamic_schedule is True
    assert FwdConfig(128, 128, cutlass.BFloat16).tiling.dynamic_schedule is False
    # Only meaningful with the persistent kernel.
    assert _tpl.choose_tiling(128, 128, True, dynamic_schedule=True).dynamic_schedule is False
    assert _tpl.choose_tiling(128, 128, True, persistent=True,
                              dynamic_schedule=True).dynamic_schedule is True
    assert _tpl.choose_tiling(64, 64, False, persistent=True).dynamic_schedule is True
    assert _tpl.choose_tiling(64, 64, False).dynamic_schedule is False
    assert _tpl.choose_tiling(128, 128, True, persistent=True,
                              dynamic_schedule=False).dynamic_schedule is False


@pytest.mark.parametrize("head_dim,mask_mod,sparse", [
    (128, None, False),
    (128, causal_mask, True),
    (64, causal_mask, True),
], ids=["d128_no_mods", "d128_causal_block_sparse", "d64_causal_block_sparse"])
def test_dynamic_persistent(tmp_path, head_dim, mask_mod, sparse):
    ptx = _compile(tmp_path, head_dim, mask_mod=mask_mod, sparse=sparse, persistent=True,
                   dynamic_schedule=True)
    _assert_hopper_path(ptx)
    _assert_persistent(ptx)
    _assert_dynamic(ptx)
    assert_no_spills(tmp_path, ptx)


def test_static_kernels_have_no_tile_counter(tmp_path):
    for persistent in (False, True):
        ptx = _compile(tmp_path, 128, mask_mod=causal_mask, sparse=True, persistent=persistent)
        assert not _GLOBAL_ATOMIC_ADD.search(ptx)


def test_dynamic_smem_budget():
    for d, sparse in ((64, False), (64, True), (128, False), (128, True)):
        cfg = FwdConfig(d, d, cutlass.BFloat16, has_block_mask=sparse,
                        tiling=_tpl.choose_tiling(d, d, sparse, persistent=True,
                                                  dynamic_schedule=True))
        assert _tpl.smem_bytes(cfg) <= _tpl.SMEM_CAPACITY
        _tpl.FlexAttentionFwdSm90(cfg)


def test_dynamic_launch_args_carry_the_counter():
    """The TVM-FFI argument tuple ends with the (2,) int32 counter for the dynamic kernel (None
    for the others), then the max_scores tensor (None: not asked for), then the FP8 descale table
    (None for 16-bit inputs); on CPU tensors the counter is a fresh zeroed CPU tensor."""
    q = torch.randn(1, 2, 200, 128, dtype=torch.bfloat16)
    k = v = torch.randn(1, 2, 300, 128, dtype=torch.bfloat16)
    o, lse = torch.empty_like(q), torch.empty(1, 2, 200)
    for dyn in (False, True):
        cfg = FwdConfig(128, 128, cutlass.BFloat16,
                        tiling=_tpl.choose_tiling(128, 128, False, persistent=True,
                                                  dynamic_schedule=dyn))
        args = _tpl._ffi_launch_args(cfg, q, k, v, o, lse, 0.1, None, (), ())
        assert args[-1] is None and args[-2] is None
        if dyn:
            counter = args[-3]
            assert counter.dtype == torch.int32 and counter.shape == (2,)
            assert (counter == 0).all()
        else:
            assert args[-3] is None


@pytest.mark.parametrize("persistent", [False, True])
def test_write_max_adds_one_store(tmp_path, persistent):
    # AuxRequest(max_scores=True): the write_max kernel stores each row's max beside its LSE
    # (more 32-bit global stores: the max's beside the LSE's); without it the kernel has no such store.
    q = torch.randn(2, 4, 300, 128, dtype=torch.bfloat16)
    k = v = torch.randn(2, 2, 500, 128, dtype=torch.bfloat16)
    o, lse = torch.empty_like(q), torch.empty(2, 4, 300)
    stores = {}
    for write_max in (False, True):
        cfg = FwdConfig(128, 128, cutlass.BFloat16, None, None, has_block_mask=True,
                        tiling=_tpl.choose_tiling(128, 128, True, persistent=persistent,
                                                  dynamic_schedule=persistent),
                        write_max=write_max)
        bm = _block_mask(3, 4)
        ptx = compile_fwd(cfg, q, k, v, o, lse, bm, options=f"--keep-ptx --dump-dir {tmp_path}",
                          use_tvm_ffi=False).compiled.__ptx__
        _assert_hopper_path(ptx)
        stores[write_max] = len(re.findall(r"\bst\.global\.(?:b32|f32)\b", ptx))
    assert stores[True] > stores[False] > 0, stores


def test_long_static_loop_warning_is_hidden_for_the_templates_only():
    # The templates unroll per-register loops of 64+ iterations on purpose; cutlass's warning
    # about them must not reach a user's first call, while a user's own CuTe code keeps it.
    import warnings

    import flexjit.templates.cute  # noqa: F401  (installs the filter)
    from cutlass.base_dsl.ast_helpers import range_value_check

    def loop_in(module_name):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import flexjit.templates.cute as package  # the filter, as the package installs it
            importlib.reload(package)  # after simplefilter, so it takes precedence as at import
            exec("range_value_check(64)", {"__name__": module_name, "range_value_check": range_value_check})
        return [str(w.message) for w in caught if "static loop" in str(w.message)]

    assert loop_in("flexjit.templates.cute.sm90.fwd") == []
    assert len(loop_in("my_kernels")) == 1


# TMA tensor copies by rank and direction: "load" (global to shared) or "store".
_TMA_COPY = re.compile(r"cp\.async\.bulk\.tensor\.(\d)d\.(shared::cta\.global|global\.shared::cta)")


def _tma_ranks(ptx) -> set:
    return {(int(rank), "load" if way.startswith("shared") else "store")
            for rank, way in _TMA_COPY.findall(ptx)}


@pytest.mark.parametrize("head_dim,persistent", [(64, False), (64, True), (128, False), (128, True),
                                                 (256, False)])
def test_packed_gqa_moves_q_and_o_over_the_folded_heads(tmp_path, head_dim, persistent):
    """Packed GQA (here 2 query heads per kv head): Q's load and O's store are 5-D TMA copies
    (column, head in the group, position, kv head, batch) where the one-head kernel's are 4-D;
    K and V stay 4-D. Spill-free, on both schedules."""
    ptx = _compile(tmp_path, head_dim, persistent=persistent, dynamic_schedule=persistent, pack_gqa=2)
    _assert_hopper_path(ptx)
    assert_no_spills(tmp_path, ptx)
    assert _tma_ranks(ptx) == {(4, "load"), (5, "load"), (5, "store")}, _tma_ranks(ptx)
    (tmp_path / "plain").mkdir()
    plain = _compile(tmp_path / "plain", head_dim, persistent=persistent, dynamic_schedule=persistent)
    assert _tma_ranks(plain) == {(4, "load"), (4, "store")}, _tma_ranks(plain)


@pytest.mark.parametrize("what", ["score_mod", "mask_mod", "block_mask", "group"])
def test_packed_gqa_refuses_kernels_that_read_a_rows_head_or_position(tmp_path, what):
    """A folded row's head and position are not the kernel's: a kernel whose mods or lists read
    them, or whose tile the group does not divide (128 rows, 3 heads), is refused."""
    kw = {"score_mod": {"score_mod": alibi_softcap_score, "aux": (torch.rand(4),)},
          "mask_mod": {"mask_mod": causal_mask},
          "block_mask": {"mask_mod": causal_mask, "sparse": True}, "group": {}}[what]
    with pytest.raises(NotImplementedError, match="packed GQA"):
        _compile(tmp_path, 128, pack_gqa=3 if what == "group" else 2, **kw)
