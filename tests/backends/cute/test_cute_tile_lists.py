"""The sm90 forward's tile choice and the block lists merged for its 192-row query tiles (CPU).

``merged_row_lists`` is checked against a brute-force reading of the 128×128 lists: for tile t
and kv block n, the kinds of the two block rows under the tile, visited where either lists the
block, full only where both do; the GPU tests (``test_cute_tile_gpu.py``) check the kernel.
"""
import pytest
import torch

from flexjit import create_block_mask
from flexjit.backends.cute.sm90 import forward_lists, forward_tile_m, merged_row_lists
from flexjit.planner.block_mask import _dense_to_ordered, block_classes
from flexjit.runtime import options


def _lists(kinds):
    p_num, p_idx = _dense_to_ordered(kinds == 1)
    f_num, f_idx = _dense_to_ordered(kinds == 2)
    return p_num, p_idx, f_num, f_idx


@pytest.mark.parametrize("nqb,nkb,seed", [(1, 1, 0), (2, 3, 1), (5, 4, 2), (8, 8, 3), (9, 7, 4)])
def test_merged_rows_against_brute_force(nqb, nkb, seed):
    g = torch.Generator().manual_seed(seed)
    kinds = torch.randint(0, 3, (2, 3, nqb, nkb), generator=g)
    p_num, p_idx, f_num, f_idx, codes = merged_row_lists(*_lists(kinds))
    n_tiles = -(-nqb * 128 // 192)
    assert p_num.shape == (2, 3, n_tiles) and codes.shape == p_idx.shape == (2, 3, n_tiles, nkb)
    for b in range(2):
        for h in range(3):
            for t in range(n_tiles):
                r0 = t * 192 // 128
                r1 = (t * 192 + 191) // 128
                r1 = r1 if r1 < nqb else r0
                k0, k1 = kinds[b, h, r0], kinds[b, h, r1]
                want_full = {n for n in range(nkb) if k0[n] == 2 and k1[n] == 2}
                want_part = {n: int(k0[n]) | int(k1[n]) << 2 for n in range(nkb)
                             if (k0[n] or k1[n]) and n not in want_full}
                got_full = f_idx[b, h, t, :f_num[b, h, t]].tolist()
                got_part = p_idx[b, h, t, :p_num[b, h, t]].tolist()
                assert set(got_full) == want_full and got_full == sorted(got_full)
                assert got_part == sorted(want_part)
                assert codes[b, h, t, :len(got_part)].tolist() == [want_part[n] for n in got_part]
                assert (codes[b, h, t, len(got_part):] == 0).all()


def test_a_block_listed_partial_and_full_counts_as_partial():
    one = torch.ones(1, 1, 1, dtype=torch.int32)
    idx = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    assert block_classes(one, idx, one, idx).tolist() == [[[[1]]]]
    assert block_classes(one, idx, None, None).tolist() == [[[[1]]]]


def test_causal_tiles_visit_both_diagonal_blocks():
    """Causal over 1000 tokens: 192-row tile t has its rows' diagonal blocks partial and every
    block left of them full for both of its block rows."""
    bm = create_block_mask(lambda b, h, q, k: q >= k, None, None, 1000, 1000, device="cpu")
    p_num, p_idx, f_num, f_idx, codes = forward_lists(bm, 192)
    assert p_num[0, 0].tolist() == [2, 2, 2, 2, 2, 1]
    assert f_num[0, 0].tolist() == [0, 1, 3, 4, 6, 7]
    assert codes[0, 0, 0, :2].tolist() == [1 | 2 << 2, 0 | 1 << 2]
    assert forward_lists(bm, 192) is forward_lists(bm, 192)  # made once per BlockMask
    assert len(forward_lists(bm, 128)) == 4


def test_tile_choice():
    """192 rows at D = 64 (and 32) where few merged tiles are partial (causal over 8k: 6%), else 128
    (a 256-token window: 40%, and causal over 512 tokens: every tile holds two diagonal blocks)."""
    bm = create_block_mask(lambda b, h, q, k: q >= k, None, None, 8192, 8192, device="cpu")
    assert forward_tile_m(64, bm) == 192 and forward_tile_m(64, None) == 192
    window = create_block_mask(lambda b, h, q, k: (q >= k) & (q - k < 256), None, None, 8192,
                               8192, device="cpu")
    assert forward_tile_m(64, window) == 128
    short = create_block_mask(lambda b, h, q, k: q >= k, None, None, 512, 512, device="cpu")
    assert forward_tile_m(64, short) == 128
    assert forward_tile_m(64, window, pinned=192) == 192
    assert forward_tile_m(64, bm, pinned=128) == 128
    assert forward_tile_m(32, bm) == 192 and forward_tile_m(32, window) == 128
    for d in (96, 128, 192, 256):
        assert forward_tile_m(d, bm) == 128
    with pytest.raises(ValueError, match="TILE_M=192"):
        forward_tile_m(128, bm, pinned=192)


@pytest.mark.parametrize("bad", [64, 256, True, "192"])
def test_tile_m_option_is_checked(bad):
    with pytest.raises(ValueError, match="TILE_M"):
        options.validate({"TILE_M": bad}, "auto")
    assert options.validate({"TILE_M": 192}, "auto")[0] == {"TILE_M": 192}
