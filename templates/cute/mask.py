"""mask_mod without evaluating it per element.

* As bits: 32 elements of a row (or a column) evaluated into one word ahead of the scores, so the
  mask's own loads never sit in registers beside them; a kept element's bit is 1.
* As row limits (``row_limits``, ``in_row``): where the mask keeps one interval of keys per row
  (``mask_mod.rows``), each element costs one compare of its compile-time column per side.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from flexjit.templates.cute.common import FloatIndices, bind


@cute.jit
def mask_word(mask_mod: cutlass.Constexpr, batch: Int32, head: Int32, fixed: Int32, base: Int32,
              seqlen: Int32, aux, along_kv: cutlass.Constexpr):
    """Bit i keeps element ``base + i`` along kv (``along_kv``: query ``fixed``, keys
    base..base+31) or along q (key ``fixed``, queries base..base+31): mask_mod and the
    ``< seqlen`` bound of that axis. Call it from a runtime loop over the words (unrolled,
    ptxas keeps every element's index math live at once and spills)."""
    limit = seqlen - base
    if const_expr(along_kv):
        indices = FloatIndices(fixed, base)
    else:
        indices = FloatIndices(base, fixed)
    word = cutlass.Uint32(0)
    bound = bind(mask_mod, batch, head, aux)
    for i in cutlass.range_constexpr(32):
        idx = base + i
        if const_expr(along_kv):
            keep = bound(batch, head, fixed, idx, aux, *indices.args(mask_mod, fixed, idx, (0, i)))
        else:
            keep = bound(batch, head, idx, fixed, aux, *indices.args(mask_mod, idx, fixed, (i, 0)))
        bit = cutlass.Uint32(1 << i) if keep else cutlass.Uint32(0)
        word = word | (bit if i < limit else cutlass.Uint32(0))
    return word


def kept(bits, col: int):
    """Whether column ``col`` (a compile-time index) of the words ``bits`` is kept."""
    return ((bits[col // 32] >> (col % 32)) & cutlass.Uint32(1)) != cutlass.Uint32(0)


# A row's limits are clamped to this, relative to the tile's first column: far past any tile.
_CAP = 1 << 29  # (the difference of two limits stays an int32)


@cute.jit
def row_limits(rows: cutlass.Constexpr, batch: Int32, head: Int32, q_idx: Int32, kv0: Int32,
               seqlen: Int32, aux, sub_full=None, sub_partial=None):
    """(first, last): the columns of row ``q_idx`` that mask_mod keeps, relative to the tile's
    first key ``kv0``, from the mask's interval form (``rows``: ``mask_mod.rows``, bound) and
    the ``< seqlen`` bound; a column c is kept iff first <= c <= last. Computed in 64 bits (the
    limits may lie far outside the tile), then clamped. Merged rows: ``sub_full`` keeps every
    column in bounds, neither it nor ``sub_partial`` none."""
    lo, hi = rows(batch, head, q_idx, kv0, aux, None, None, None, None)
    base = Int64(kv0)
    # Clamped in 64 bits about kv0, then made relative in 32: the compares stay 32-bit.
    near, far = base - Int64(_CAP), base + Int64(_CAP)
    end = Int64(seqlen) - Int64(1)
    last = cutlass.min(hi, end)
    first = lo
    if const_expr(sub_full is not None):
        first = Int64(cutlass.select_(sub_full, near, first))
        last = Int64(cutlass.select_(sub_full, end, cutlass.select_(sub_partial, last, base - Int64(1))))
    first = Int32(cutlass.max(cutlass.min(first, far), near)) - kv0
    last = Int32(cutlass.max(cutlass.min(last, far), near)) - kv0
    return first, last


def in_row(limits, col: int, bounds):
    """Whether the compile-time column ``col`` lies within ``limits`` (``row_limits``);
    ``bounds``: which sides the interval has. One side: one compare. Two: one unsigned compare
    of col - first against last - first (two compares and'ed became two selects per score)."""
    if not bounds[0]:
        return Int32(col) <= limits[1]
    first, last = limits
    empty = last < first  # then col - first < 0 for every column: huge unsigned, never kept
    start = cutlass.select_(empty, Int32(_CAP), first)
    width = cutlass.select_(empty, Int32(0), last - first)
    return cutlass.Uint32(Int32(col) - start) <= cutlass.Uint32(width)
