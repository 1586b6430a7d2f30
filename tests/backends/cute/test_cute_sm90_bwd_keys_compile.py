"""Compile-only tests of the sm90 backward's 96-key tile (``BWD_CONFIG`` "keys96", head dims
(192, 192) and (192, 128); ``templates/cute/sm90/bwd_keys.py``), CPU only.

Each builds the main kernel for sm_90a (CUTE_DSL_ARCH=sm_90a) with real generated mods and
checks the PTX for the GEMM shapes the design depends on (m64n48 for S, dP, dKᵀ and dVᵀ: a
warpgroup's 48 keys; m64n96 for dQ: half the head dims), P and dS stored by stmatrix (not
transposed: the S accumulator is queries × keys) and dKᵀ/dVᵀ by stmatrix.trans, and that
ptxas reports no spills, no stack frame and no serialised wgmma (C7512). The mods: one per
kind of element work the tile does (none; comparisons with and without block lists; a load and
an exp-domain bias; a transcendental; a captured document table under block lists; all of
softcap, ALiBi and documents at once). A main kernel compiles in about 2-4 s.

CPU value test: ``tile_q_lists`` (the block lists per 96-key tile) against a brute-force
classification of a dense mask.
"""

import importlib
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
cutlass = pytest.importorskip("cutlass")

from flexjit import create_block_mask  # noqa: E402
from flexjit.backends.cute.sm90 import _aux_tensor, bwd_block_lists, light_mods, load_mods  # noqa: E402
from flexjit.planner.block_mask import create_mask, tile_q_lists  # noqa: E402
from mods_catalog import lowered, make_case  # noqa: E402
from ptx_checks import assert_no_spills  # noqa: E402

tpl = importlib.import_module("flexjit.templates.cute.sm90.bwd")
keys_tpl = importlib.import_module("flexjit.templates.cute.sm90.bwd_keys")
host = importlib.import_module("flexjit.templates.cute.sm90.bwd_host")
tiling_tpl = importlib.import_module("flexjit.templates.cute.sm90.bwd_tiling")
cute_host = importlib.import_module("flexjit.templates.cute.host")

DIMS = [(192, 192), (192, 128)]
# The mods the brief of this tile covers: no mods, causal (comparisons), sliding window (a
# runtime scalar), ALiBi (a captured table read per element), softcap (tanh and its
# derivative), documents (a captured table under block lists).
MODS = ["full", "causal", "sliding_window", "alibi", "softcap", "document"]


def _cfg(dims, program, sparse, broadcast=False):
    mods = load_mods(program)
    overlap = True if light_mods(program) else None
    return tpl.BwdConfig(dims[0], dims[1], cutlass.BFloat16, mods.score_mod_and_grad, mods.mask_mod,
                         has_block_mask=sparse, overlap_dp=overlap, kv_batch_broadcast=broadcast,
                         tiling=tiling_tpl.bwd_tiling(dims[0], dims[1], overlap, "keys96"))


def _main_ptx(tmp_path, dims, program, sparse, broadcast=False):
    cfg = _cfg(dims, program, sparse, broadcast)
    aux = tuple(_aux_tensor(t, torch.device("cpu")) for t in program.buffers)
    fn = host.compile_bwd(cfg, aux, program.scalars, options=f"--keep-ptx --dump-dir {tmp_path}",
                          parts=("main",))
    ptx = fn.parts["main"].compiled.__ptx__
    assert ptx and ".entry" in ptx
    return ptx


def _assert_keys_machinery(ptx, dims):
    assert "mma.sync" not in ptx and "setmaxnreg.inc" in ptx
    assert "cp.reduce.async.bulk.tensor" in ptx, "dQ is not TMA reduce-added"
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+)k16", ptx)
    assert set(shapes) == {"m64n48", "m64n96"}, set(shapes)
    # Every GEMM reads smem (two descriptors), none a register A operand.
    assert not re.search(r"wgmma\.mma_async[^\n]*\{[^}]*\},\s*\{", ptx)
    assert "stmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx, "P/dS not stored by stmatrix"
    assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx, "dKᵀ/dVᵀ not by stmatrix.trans"
    assert "ex2.approx" in ptx


@pytest.mark.parametrize("name", MODS)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
def test_keys96_mods_fit(tmp_path, dims, name):
    # Sizes are runtime values; the case's sizes only shape its captured tables.
    case = make_case(name, 2, 4, 300, 500)
    program = lowered(case.score_mod, case.mask_mod)
    ptx = _main_ptx(tmp_path, dims, program, sparse=case.mask_mod is not None)
    _assert_keys_machinery(ptx, dims)
    assert_no_spills(tmp_path, ptx, no_serialised_wgmma=True)
    if name == "softcap":
        assert "tanh.approx" in ptx


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
def test_keys96_causal_without_block_lists(tmp_path, dims):
    # mask_mod with no block mask: every (q tile, kv tile) visited as partial.
    case = make_case("causal", 2, 4, 300, 500)
    ptx = _main_ptx(tmp_path, dims, lowered(None, case.mask_mod), sparse=False)
    _assert_keys_machinery(ptx, dims)
    assert_no_spills(tmp_path, ptx, no_serialised_wgmma=True)


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
def test_keys96_kv_batch_broadcast(tmp_path, dims):
    # K/V of batch 1 for every query batch: the producer loads them at batch 0, the rest as above.
    case = make_case("causal", 2, 4, 300, 500)
    ptx = _main_ptx(tmp_path, dims, lowered(None, case.mask_mod), sparse=True, broadcast=True)
    _assert_keys_machinery(ptx, dims)
    assert_no_spills(tmp_path, ptx, no_serialised_wgmma=True)


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
def test_keys96_fits_shared_memory(dims):
    # Q two stages, dO one (two at Dv = 128), K, V, P, dS and the dQ boxes: 218 KB (214 at 128),
    # under the 227 KB an sm90 CTA may use. The size is the kernel's shared storage.
    made = []

    class Recorded(keys_tpl.FlexAttentionBwdKeysSm90):
        def __init__(self, cfg):
            super().__init__(cfg)
            made.append(self)

    cfg = tpl.BwdConfig(dims[0], dims[1], cutlass.BFloat16, None, None,
                        tiling=tiling_tpl.bwd_tiling(dims[0], dims[1], None, "keys96"))
    cute_host.compile_parts({"main": lambda: (Recorded(cfg), cute_host.placeholder_main_args(cfg, (), ()))},
                            "", ("main",))
    used = made[0].shared_storage.size_in_bytes()
    assert used <= 227 * 1024, used


def test_keys96_tiling_and_routing():
    t = tiling_tpl.bwd_tiling(192, 128, None, "keys96")
    assert tiling_tpl.keys96(t) and t.tile_n == 96 and t.tile_m == 64
    with pytest.raises(ValueError):
        tiling_tpl.bwd_tiling(128, 128, None, "keys96")
    with pytest.raises(ValueError):
        tiling_tpl.bwd_tiling(192, 192, None, "keys96+qsplit")
    # Deterministic mode and captured-tensor gradients keep the 64-key kernel (the backend
    # routes them there); the kernel refuses them rather than run them wrong.
    cfg = tpl.BwdConfig(192, 192, cutlass.BFloat16, None, None, deterministic=True, tiling=t)
    with pytest.raises(AssertionError):
        keys_tpl.FlexAttentionBwdKeysSm90(cfg)


def _brute_tile_classes(dense_cls, tile, block, n_tiles):
    """(…, nQ, n_tiles) classes per 96-key tile from (…, nQ, nKV) mask-block classes (0 empty,
    1 partial, 2 full): skipped if every covered block is empty, full if every one is full."""
    *lead, n_q, n_kv = dense_cls.shape
    out = torch.zeros(*lead, n_q, n_tiles, dtype=torch.int8)
    for t in range(n_tiles):
        cover = sorted({k // block for k in range(t * tile, (t + 1) * tile) if k // block < n_kv})
        c = dense_cls[..., cover]
        out[..., t] = torch.where((c == 0).all(-1), 0, torch.where((c == 2).all(-1), 2, 1))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_tile_q_lists_against_brute_force(seed):
    # Random block classes over 7 q blocks × 9 kv blocks (12 tiles of 96 keys: both the tiles
    # inside one mask block and those straddling two), per batch and head.
    g = torch.Generator().manual_seed(seed)
    Bm, Hm, nQ, nKV = 2, 3, 7, 9
    cls = torch.randint(0, 3, (Bm, Hm, nQ, nKV), generator=g).to(torch.int8)
    qcls = cls.transpose(-2, -1)  # (…, nKV, nQ): the transposed lists' view

    def ordered(dense):
        d = dense.to(torch.int32)
        return d.sum(-1).to(torch.int32), torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32)

    qn, qi = ordered(qcls == 1)
    fqn, fqi = ordered(qcls == 2)
    n_tiles = -(-nKV * 128 // 96)
    tn, ti, tfn, tfi = tile_q_lists(qn, qi, fqn, fqi, 96)
    assert tn.shape == (Bm, Hm, n_tiles) and ti.shape == (Bm, Hm, n_tiles, nQ)
    want = _brute_tile_classes(cls, 96, 128, n_tiles)  # (…, nQ, n_tiles)
    for num, idx, k in ((tn, ti, 1), (tfn, tfi, 2)):
        got = torch.zeros(Bm, Hm, n_tiles, nQ, dtype=torch.bool)
        for b in range(Bm):
            for h in range(Hm):
                for t in range(n_tiles):
                    listed = idx[b, h, t, :num[b, h, t]].tolist()
                    assert listed == sorted(listed)  # increasing q order
                    got[b, h, t, listed] = True
        assert torch.equal(got, (want == k).transpose(-2, -1)), k


@pytest.mark.parametrize("name", ["causal", "document", "sliding_window"])
def test_keys96_lists_from_a_block_mask_are_sound(name):
    # The backend's lists for the 96-key tile (``bwd_block_lists`` with the keys96 tiling)
    # against the dense mask itself: a (q block, tile) pair left out holds no kept element, one
    # listed full holds only kept ones (within L and S), and every pair with a kept element
    # is listed. L = 1000, S = 1100: ragged against both the 128-row blocks and the 96-key tiles.
    B, H, L, S = 1, 2, 1000, 1100
    torch.manual_seed(0)
    mask_mod = make_case(name, B, H, L, S).mask_mod
    bm = create_block_mask(mask_mod, B, H, L, S, device="cpu")
    dense = create_mask(mask_mod, B, H, L, S, device="cpu").bool()  # (B, H, L, S)
    tiling = tiling_tpl.bwd_tiling(192, 192, None, "keys96")
    lists = bwd_block_lists(bm, tiling)
    assert bwd_block_lists(bm, tiling) is lists  # kept on the BlockMask
    assert bwd_block_lists(bm)[4].shape[-1] == -(-S // 128)  # the 128-key lists untouched
    qn, qi, fqn, fqi = lists[4:]
    n_tiles = -(-S // 96)
    for h in range(H):
        hm = h % qn.shape[1]
        for t in range(n_tiles):
            part = set(qi[0, hm, t, :qn[0, hm, t]].tolist())
            full = set(fqi[0, hm, t, :fqn[0, hm, t]].tolist())
            assert not part & full
            for mq in range(-(-L // 128)):
                block = dense[0, h, mq * 128:(mq + 1) * 128, t * 96:(t + 1) * 96]
                if mq in full:
                    assert block.all(), (h, t, mq)
                elif mq not in part:
                    assert not block.any(), (h, t, mq)
