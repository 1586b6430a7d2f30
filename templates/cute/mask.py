"""mask_mod as bits: 32 elements of a row (or a column) evaluated into one word ahead of the scores,
so the mask's own loads never sit in registers beside them; a kept element's bit is 1."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

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
