"""mask_mod without evaluating it per element.

* As bits: 32 elements of a row (or a column) evaluated into one word ahead of the scores, so the
  mask's own loads never sit in registers beside them; a kept element's bit is 1.
* As row limits (``row_limits``, ``in_row``): where the mask keeps one interval of keys per row
  (``mask_mod.rows``), the limits become words over the row's accumulator elements
  (``row_words``), so an element costs one bit test (ptxas turns a word's tests into R2P, seven
  predicates per instruction) where it cost one compare of its compile-time column per side.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

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
    the ``< seqlen`` bound; a column c is kept iff first <= c <= last. Made relative and clamped
    in 64 bits (the limits may lie far outside the tile), the rest in 32. Merged rows:
    ``sub_full`` keeps every column in bounds, neither it nor ``sub_partial`` none."""
    lo, hi = rows(batch, head, q_idx, kv0, aux, None, None, None, None)
    base = Int64(kv0)

    def relative(limit):  # limit - kv0, clamped in 64 bits, then 32 bits for the rest
        return Int32(cutlass.max(cutlass.min(limit - base, Int64(_CAP)), Int64(-_CAP)))

    end = cutlass.min(seqlen - Int32(1) - kv0, Int32(_CAP))
    first = relative(lo)
    last = cutlass.min(relative(hi), end)
    if const_expr(sub_full is not None):
        first = cutlass.select_(sub_full, Int32(-_CAP), first)
        last = cutlass.select_(sub_full, end, cutlass.select_(sub_partial, last, Int32(-1)))
    return first, last


def in_row(limits, col: int, bounds):
    """Whether the compile-time column ``col`` lies within ``limits`` (``row_limits``, or the
    ``RowWords`` of ``row_words``); ``bounds``: which sides the interval has. One side: one
    compare. Two: one unsigned compare of col - first against last - first (two compares
    and'ed became two selects per score)."""
    if const_expr(isinstance(limits, RowWords)):
        return kept(limits.words, limits.element[col])
    if not bounds[0]:
        return Int32(col) <= limits[1]
    first, last = limits
    empty = last < first  # then col - first < 0 for every column: huge unsigned, never kept
    start = cutlass.select_(empty, Int32(_CAP), first)
    width = cutlass.select_(empty, Int32(0), last - first)
    return cutlass.Uint32(Int32(col) - start) <= cutlass.Uint32(width)


# Limits are biased by this multiple of 8 before the shift in ``_columns_below`` (a clamped
# limit lies within ±_CAP + 1 of 0, so the biased value is positive and below 2^31).
_BIAS = 1 << 30


class RowWords:
    """A row's limits as words over its elements (``row_words``): ``element[col]`` is the bit of
    the row's column ``col`` (relative to the row's first)."""

    def __init__(self, words, element):
        self.words, self.element = words, element


def accumulator_elements(cols):
    """{col: e}: each of a row's compile-time columns (relative to its first) and its place e in
    the row, where they are a wgmma accumulator row's 0, 1, 8, 9, 16, .. (``_columns_below``
    counts those); None for any other pattern."""
    cols = sorted(set(cols))
    if cols != [8 * (e // 2) + e % 2 for e in range(len(cols))]:
        return None
    return {c: e for e, c in enumerate(cols)}


def row_words(limits, cols, bounds):
    """``limits`` (``row_limits``) as a ``RowWords`` over the row's columns ``cols``, or the
    limits themselves where the columns are not an accumulator row's (``accumulator_elements``).
    Element e is kept iff lo <= e < hi, lo and hi counting the row's columns below first and
    last + 1; a word is all ones shifted by the part of its 32 elements outside that range."""
    element = accumulator_elements(cols)
    if element is None:
        return limits
    first, last = limits
    hi = _columns_below(last + 1)
    lo = _columns_below(first) if const_expr(bounds[0]) else None
    words = []
    for s in range((len(element) + 31) // 32):
        word = _shift_ones(cutlass.max(Int32(32 * (s + 1)) - hi, Int32(0)), left=False)
        if const_expr(lo is not None):
            word = word & _shift_ones(cutlass.max(lo - Int32(32 * s), Int32(0)), left=True)
        words.append(word)
    return RowWords(words, element)


def _columns_below(x: Int32) -> Int32:
    """How many of the columns 0, 1, 8, 9, 16, 17, .. lie below ``x`` (a clamped limit, any
    sign; negative counts are the shifts' business): 2 per 8 columns, plus min(x mod 8, 2)."""
    b = x + Int32(_BIAS)
    return (b >> 3) * 2 + cutlass.min(b & 7, Int32(2)) - Int32(_BIAS >> 2)


@dsl_user_op
def _shift_ones(n: Int32, left: bool, *, loc=None, ip=None) -> Uint32:
    """0xffffffff shifted left or right (logical) by ``n`` >= 0 as PTX shifts: by 32 or more
    gives 0, where LLVM's shift of that size is undefined."""
    op = "shl.b32" if left else "shr.b32"
    value = llvm.inline_asm(T.i32(), [Int32(n).ir_value(loc=loc, ip=ip)],
                            f"{op} $0, 0xffffffff, $1;", "=r,r", has_side_effects=False,
                            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Uint32(value)
