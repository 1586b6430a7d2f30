"""Compile-only tests of the Blackwell CuTeDSL forward (CPU, no GPU needed), and of what the
sm100 backend does without one: the block lists it derives, and its refusal off Blackwell.

Each compile builds the kernel for sm_100a (the template passes ``--gpu-arch sm_100a`` itself,
so the sm90 tests' CUTE_DSL_ARCH=sm_90a in the same process does not matter) and checks the PTX
for the instructions the design depends on: tcgen05.mma (a kernel that fell back to wgmma or
mma.sync fails), tensor memory allocated, read, written and freed (tcgen05.alloc / ld / st /
dealloc), tcgen05.commit completions, TMA loads (cp.async.bulk.tensor), setmaxnreg, exp2. ptxas
(from Triton's wheel) must report no spills.

Measured on the dev CPU (cutlass-dsl 4.8.1, a shared 2-core machine): 6-12 s per compile without
mods, 8-22 s with rendered mods and a block mask, ptxas ~2 s. Sizes are tiny on purpose: lengths,
batch, heads and strides are runtime values and do not change the code. The kernel has never run
on a Blackwell GPU; nothing here checks its numbers.
"""

import importlib
import os

import pytest

# The suite's sm90 tests compile for the arch in CUTE_DSL_ARCH, which the DSL reads once, at its
# first use in the process: set their default before this file imports cutlass (its own
# compiles pass --gpu-arch sm_100a whatever the variable says).
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402

from flexjit import create_block_mask  # noqa: E402
from flexjit.backends.cute import sm100 as cute_sm100  # noqa: E402
from flexjit.backends.cute.sm90 import _aux_tensor  # noqa: E402
from mods_catalog import CORE, lowered, make_case  # noqa: E402
from sm100_ptx import assert_blackwell_path as _assert_blackwell_path  # noqa: E402
from sm100_ptx import assert_scalars_not_baked, ptx_text as _ptx_text, spill_bytes  # noqa: E402

_tpl = importlib.import_module("flexjit.templates.cute.sm100.fwd")

if not _tpl.tvm_ffi_enabled():
    pytest.skip("the sm100 template compiles through TVM-FFI only", allow_module_level=True)


@cute.jit
def causal_mask(b, h, q_idx, kv_idx, aux):
    return q_idx >= kv_idx


def _compile_template(tmp_path, head_dim, mask_mod=None, sparse=False, write_max=False):
    cfg = _tpl.FwdConfig(head_dim, head_dim, cutlass.BFloat16, None, mask_mod,
                         has_block_mask=sparse, write_max=write_max)
    q = torch.randn(2, 4, 300, head_dim, dtype=torch.bfloat16)
    fn = _tpl.compile_fwd(cfg, q, options=f"--keep-ptx --dump-dir {tmp_path}")
    return _ptx_text(fn.compiled)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_no_mods(tmp_path, head_dim):
    ptx = _compile_template(tmp_path, head_dim)
    _assert_blackwell_path(ptx)
    # QK: 2 sub-tiles x D/16 k-steps per kv tile, issued in three places (first tile, loop,
    # none in the tail); PV: 2 x 128/16 in two places (loop, tail).
    assert ptx.count("tcgen05.mma") == 2 * 2 * (head_dim // 16) + 2 * 2 * (128 // 16)
    assert spill_bytes(tmp_path, ptx) == 0


@pytest.mark.parametrize("head_dim", [64, 128])
def test_block_sparse_without_mask_mod(tmp_path, head_dim):
    # A block mask whose mask_mod is elided (e.g. a document mask planned into full blocks):
    # the skip / bounded / full step variants, no mask.
    _assert_blackwell_path(ptx := _compile_template(tmp_path, head_dim, sparse=True))
    assert spill_bytes(tmp_path, ptx) == 0


@pytest.mark.parametrize("head_dim,write_max", [(64, True), (128, False)])
def test_causal_block_sparse(tmp_path, head_dim, write_max):
    # write_max (AuxRequest(max_scores)) on one of the two: it adds one store per row.
    ptx = _compile_template(tmp_path, head_dim, mask_mod=causal_mask, sparse=True,
                            write_max=write_max)
    _assert_blackwell_path(ptx)
    assert ptx.count("st.global.b32") == (4 if write_max else 2)  # LSE (+ max) per sub-tile
    assert spill_bytes(tmp_path, ptx) == 0


# --------------------------------------------------------------- every core mod, rendered

# Every core mod compiles spill-free (measured 2026-12-01, Triton's ptxas 12.9). What
# it took: mask words formed in a runtime loop before S arrives (_mask_bits), the two-pass
# softmax for bias tables (FwdConfig.score_loads), the bound against compile-time columns.
# D = 128 for every core mod; D = 64 for the heaviest of each kind (a bias table on the two-pass
# path, a mask that loads per key, a score_mod and mask together).
_CORE_CASES = [(name, 128) for name in CORE] + [
    (name, 64) for name in ("relative_bias", "document", "softcap_alibi_window")]


@pytest.mark.parametrize("name,D", _CORE_CASES, ids=[f"{n}-d{d}" for n, d in _CORE_CASES])
def test_core_mod_compiles_for_sm100a(name, D, tmp_path):
    B, Hq, Hkv, L, S = 2, 4, 2, 300, 500  # GQA 2:1, L != S, neither a multiple of 128 or 256
    case = make_case(name, B, Hq, L, S)
    program = lowered(case.score_mod, case.mask_mod)
    bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cpu") if case.mask_mod else None
    q = torch.randn(B, Hq, L, D, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, dtype=torch.bfloat16)
    aux = tuple(_aux_tensor(t, q.device) for t in program.buffers)
    fn = cute_sm100.compile_program(program, q, v, bm is not None, aux,
                                    options=f"--keep-ptx --dump-dir {tmp_path}")
    ptx = _ptx_text(fn.compiled)
    _assert_blackwell_path(ptx)
    assert_scalars_not_baked(program, ptx)
    assert spill_bytes(tmp_path, ptx) == 0


def test_two_pass_softmax_for_per_element_score_loads():
    """FwdConfig.score_loads exactly for score_mods that load at an index varying with kv_idx:
    bias tables yes; ALiBi's per-head slope, masks' loads and plain math no."""
    two_pass = {n for n in CORE
                if cute_sm100.score_loads(lowered(*_mods_of(n)))}
    assert two_pass == {"relative_bias", "t5_bias", "learnable_bias"}


def _mods_of(name):
    case = make_case(name, 2, 4, 300, 500)
    return case.score_mod, case.mask_mod


# --------------------------------------------------------------- configuration


def test_config_table():
    """Head dims 64 and 128 only; each fits the smem and the 512 TMEM columns, with one CTA per
    SM; the register split fills the register file exactly (setmaxnreg acts on whole
    warpgroups)."""
    assert cute_sm100.HEAD_DIMS == _tpl.HEAD_DIMS
    for d, dv in _tpl.HEAD_DIMS:
        cfg = _tpl.FwdConfig(d, dv, cutlass.BFloat16, has_block_mask=True)
        assert _tpl.smem_bytes(cfg) <= _tpl.SMEM_CAPACITY
        # One CTA per SM: each allocates all 512 TMEM columns (a second would block in alloc).
        assert 2 * _tpl.smem_bytes(cfg) > _tpl.SMEM_CAPACITY
        assert 2 * _tpl.TILE_N + 2 * dv <= _tpl.TMEM_COLUMNS
        _tpl.FlexAttentionFwdSm100(cfg)
    assert 128 * (2 * _tpl._SOFTMAX_REGS + _tpl._CORRECTION_REGS + _tpl._OTHER_REGS) == 65536
    for d, dv in ((32, 32), (96, 96), (192, 128), (256, 256), (128, 64)):
        with pytest.raises(NotImplementedError, match="head dims"):
            _tpl.FwdConfig(d, dv, cutlass.BFloat16)


# --------------------------------------------------------------- the backend without a GPU


class _Call:
    def __init__(self, q):
        self.q = self.k = self.v = q


def test_backend_refuses_off_blackwell():
    # Off a 10.x GPU the sm100 backend refuses (its first-use gate: tests/runtime/test_sm100_gate.py).
    q = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16)
    ok, why = cute_sm100.supports(_Call(q))
    assert ok is False and why == "needs a CUDA tensor, got cpu"
    from flexjit.runtime import dispatch
    assert dispatch._MODULES["cute_sm100"] is cute_sm100


def _expand(num, idx, kinds, nQB, nKVB):
    """Back to per (128-row block, kv block) kinds: (Bm, Hm, nQB, nKVB) in {0, 1, 2}."""
    Bm, Hm, nQ2 = num.shape
    out = torch.zeros(Bm, Hm, 2 * nQ2, nKVB, dtype=torch.int64)
    for b in range(Bm):
        for h in range(Hm):
            for m in range(nQ2):
                n = int(num[b, h, m])
                seen = idx[b, h, m, :n].tolist()
                assert seen == sorted(set(seen)), "indices must be distinct and ascending"
                for j in range(n):
                    code = int(kinds[b, h, m, j])
                    assert code != 0, "a listed block must be visited by a sub-tile"
                    out[b, h, 2 * m, seen[j]] = code & 3
                    out[b, h, 2 * m + 1, seen[j]] = code >> 2
    assert not out[:, :, nQB:].any(), "a missing odd row visits nothing"
    return out[:, :, :nQB]


def _reference_kinds(kv_num, kv_idx, full_num, full_idx):
    Bm, Hm, nQB, nKVB = kv_idx.shape
    ref = torch.zeros(Bm, Hm, nQB, nKVB, dtype=torch.int64)
    for b in range(Bm):
        for h in range(Hm):
            for r in range(nQB):
                for j in range(int(full_num[b, h, r])):
                    ref[b, h, r, int(full_idx[b, h, r, j])] = cute_sm100.KIND_FULL
                for j in range(int(kv_num[b, h, r])):  # partial wins over full
                    ref[b, h, r, int(kv_idx[b, h, r, j])] = cute_sm100.KIND_PARTIAL
    return ref


@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "prefix_lm_per_batch",
                                  "natten_2d", "dilated_window"])
def test_sm100_block_lists_match_the_block_mask(name):
    # 5 query blocks (odd: the last 256-row tile has one block row) x 7 kv blocks, ragged both.
    B, H, L, S = 2, 3, 600, 830
    torch.manual_seed(0)
    case = make_case(name, B, H, L, S)
    bm = create_block_mask(case.mask_mod, B, H, L, S, device="cpu")
    lists = cute_sm100.block_sparse_args(bm)
    num, idx, kinds = cute_sm100.sm100_block_lists(bm)
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in (num, idx, kinds))
    nQB, nKVB = bm.kv_indices.shape[-2:]
    assert num.shape[-1] == (nQB + 1) // 2 and idx.shape[-1] == nKVB
    assert torch.equal(_expand(num, idx, kinds, nQB, nKVB), _reference_kinds(*lists))
    assert cute_sm100.sm100_block_lists(bm) is cute_sm100.sm100_block_lists(bm)  # remembered


def test_merge_block_lists_handmade():
    """Garbage past each count is ignored; a block listed partial and full is partial."""
    kv_num = torch.tensor([[[1, 2, 0]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[3, 9, 9, 9], [0, 2, 9, 9], [9, 9, 9, 9]]]], dtype=torch.int32) % 4
    full_num = torch.tensor([[[2, 1, 1]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[0, 3, 1, 1], [1, 0, 0, 0], [2, 0, 0, 0]]]], dtype=torch.int32)
    num, idx, kinds = cute_sm100.merge_block_lists(kv_num, kv_idx, full_num, full_idx)
    # Tile 0: row 0 = {0: full, 3: partial (listed both)}, row 1 = {0: partial, 1: full,
    # 2: partial}. Tile 1: row 2 = {2: full}, no row 3.
    assert num.tolist() == [[[4, 1]]]
    assert idx[0, 0, 0].tolist() == [0, 1, 2, 3] and idx[0, 0, 1, 0] == 2
    P, F = cute_sm100.KIND_PARTIAL, cute_sm100.KIND_FULL
    assert kinds[0, 0, 0].tolist() == [F | P << 2, F << 2, P << 2, P]
    assert kinds[0, 0, 1, 0] == F


# --------------------------------------------------------------- on a Blackwell GPU (none yet)


_BLACKWELL = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


@pytest.mark.gpu
@pytest.mark.skipif(not _BLACKWELL, reason="needs a Blackwell (sm_100) GPU; none has run this")
@pytest.mark.parametrize("name", ["full", "causal", "document", "alibi", "softcap",
                                  "relative_bias", "natten_2d"])
@pytest.mark.parametrize("D", [64, 128])
def test_forward_matches_float64_on_blackwell(name, D):
    """The first-use self-check's content, by hand: the kernel called directly (``forward`` runs
    its self-check first and raises if it fails), against float64 math. L = 700 (ragged against 128 and 256, an odd number of
    block rows), S = 1000, GQA 4:2."""
    import math

    from flexjit.runtime.call import Call
    from oracle import FLOOR, assert_close_to_oracle, dense_attention, dense_scores

    B, Hq, Hkv, L, S = 2, 4, 2, 700, 1000
    torch.manual_seed(0)
    case = make_case(name, B, Hq, L, S, device="cuda")
    program = lowered(case.score_mod, case.mask_mod)
    bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cuda") if case.mask_mod else None
    q, k, v = (torch.randn(B, h, n, D, device="cuda", dtype=torch.bfloat16)
               for h, n in ((Hq, L), (Hkv, S), (Hkv, S)))
    torch.full((1 << 28,), float("nan"), device="cuda")  # poison the allocator's next blocks
    call = Call(q, k, v, program, bm, 1 / math.sqrt(D), {}, grad=False, max_scores=True)
    out, lse, mx = cute_sm100.forward(call)
    args = (q, k, v, case.score_mod, case.mask_mod, call.scale)
    ref, ref_lse = dense_attention(*args, dtype=torch.float64)
    low, low_lse = dense_attention(*args, dtype=torch.bfloat16)
    mx64 = dense_scores(q, k, case.score_mod, case.mask_mod, call.scale).amax(-1)
    mx16 = dense_scores(q, k, case.score_mod, case.mask_mod, call.scale, torch.bfloat16).amax(-1)
    assert_close_to_oracle(f"{name} out", out, ref, low, FLOOR[torch.bfloat16])
    assert_close_to_oracle(f"{name} lse", lse, ref_lse, low_lse, FLOOR[torch.bfloat16])
    assert_close_to_oracle(f"{name} max_scores", mx, mx64, mx16, FLOOR[torch.bfloat16])
