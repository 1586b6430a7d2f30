"""Block-sparse iteration over FlexAttention's BlockMask (128×128 mask blocks): the list tensors
each kernel takes and the reads of one CTA's rows of them. Size-1 leading dims broadcast."""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


class BlockSparse(NamedTuple):
    """The forward's lists, int32: PARTIAL kv blocks (mask_mod applies) and FULL ones (mask_mod
    skipped), counts (Bm, Hm, nQB) and indices (Bm, Hm, nQB, nKVB); the order in a list is free."""

    kv_num_blocks: cute.Tensor
    kv_indices: cute.Tensor
    full_kv_num_blocks: cute.Tensor
    full_kv_indices: cute.Tensor


class BlockSparseRows(NamedTuple):
    """BlockSparse's four lists per query TILE row for tiles taller than a mask block (sm90's
    192-row tiles: rows t of (Bm, Hm, nQT), nQT = ceil(L / tile_m)), plus ``kv_kinds``, shaped
    like ``kv_indices``: each partial entry's kinds k0 | k1 << 2 for the two mask-block rows
    under the tile (``KIND_SKIP`` ...). An entry is full only where both rows are full."""

    kv_num_blocks: cute.Tensor
    kv_indices: cute.Tensor
    full_kv_num_blocks: cute.Tensor
    full_kv_indices: cute.Tensor
    kv_kinds: cute.Tensor


class BlockSparse256(NamedTuple):
    """Per 256-row query tile (Bm, Hm, nQ2 = ceil(nQB / 2)), int32: ``num`` blocks, their kv
    block ``indices`` (Bm, Hm, nQ2, nKVB) and ``kinds`` (same shape, k0 | k1 << 2; see
    ``KIND_SKIP`` ...): the two 128-row blocks' lists merged (sm100's forward)."""

    num: cute.Tensor
    indices: cute.Tensor
    kinds: cute.Tensor


# Kinds of a kv block for one 128-row sub-tile (``BlockSparse256.kinds``).
KIND_SKIP, KIND_PARTIAL, KIND_FULL = 0, 1, 2


class QBlockLists(NamedTuple):
    """The backward's transposed lists, int32: counts (Bm, Hm, nKV), indices (Bm, Hm, nKV, nQ)."""

    q_num_blocks: cute.Tensor
    q_indices: cute.Tensor
    full_q_num_blocks: cute.Tensor
    full_q_indices: cute.Tensor


class QOrder(NamedTuple):
    """Deterministic block-sparse launches (``dq_order``): per entry of the merged q list, int32,
    shaped like q_indices: how many kv blocks add into that q block before this one, and whether
    the entry is a full block (mask_mod skipped)."""

    rank: cute.Tensor
    full: cute.Tensor


def count_of(t: cute.Tensor, batch, head, block):
    """``t[b, h, block]`` of a (Bm, Hm, n) list tensor, broadcasting Bm, Hm of size 1."""
    return t[batch % t.shape[0], head % t.shape[1], block]


def row_of(t: cute.Tensor, batch, head, block):
    """The 1-D row ``t[b, h, block, :]`` of a (Bm, Hm, n, m) list tensor (as ``count_of``)."""
    return t[batch % t.shape[0], head % t.shape[1], block, None]


@cute.jit
def bcast(i: Int32, n: Int32) -> Int32:
    """Index ``i`` into a block-list dim of size ``n`` ∈ {1, full}: a size-1 dim broadcasts.
    (A select, where ``i % n`` would cost an integer division per list.)"""
    return Int32(cutlass.select_(n == 1, Int32(0), i))


@cute.jit
def q_lists(qblocks: QBlockLists, batch: Int32, head: Int32, block, per: cutlass.Constexpr):
    """(partial tile count, full tile count, partial row, full row) of kv block ``block`` for
    query head ``head``, counted in q tiles of ``MASK_BLOCK // per`` rows."""
    cnt, idx = qblocks.q_num_blocks, qblocks.q_indices
    b, h = bcast(batch, cnt.shape[0]), bcast(head, cnt.shape[1])
    n_part = cnt[b, h, block]
    if const_expr(per != 1):
        n_part = n_part * per
    part_row = idx[b, h, block, None]
    cnt, idx = qblocks.full_q_num_blocks, qblocks.full_q_indices
    n_full = cnt[b, h, block]
    if const_expr(per != 1):
        n_full = n_full * per
    full_row = idx[b, h, block, None]
    return n_part, n_full, part_row, full_row


@cute.jit
def order_rows(qorder: QOrder, batch: Int32, head: Int32, block):
    """(rank row, full-flag row) of kv block ``block``'s merged q list for query head ``head``."""
    t = qorder.rank
    b, h = bcast(batch, t.shape[0]), bcast(head, t.shape[1])
    return qorder.rank[b, h, block, None], qorder.full[b, h, block, None]


@cute.jit
def listed_tile(row: cute.Tensor, j: Int32, per: cutlass.Constexpr) -> Int32:
    """The j-th tile of a list row whose entries are mask blocks of ``per`` tiles each."""
    return row[j // per] * per + j % per
