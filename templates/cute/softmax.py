"""The online softmax in the exp2 domain (FlashAttention-2 §3.1): the running max and its rescale
factor, the exponent's multiplier, and the final normalisation and LSE. p = exp2(s·c − m·c)."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from flexjit.templates.cute.common import LN_2, LOG2_E, fadd, quad_allreduce, rows_cols, tree


def exp2_multiplier(score_mod, softmax_scale):
    """c: softmax_scale·log2(e) for raw q·k scores, log2(e) where a score_mod already produced
    natural-unit scores."""
    c = Float32(LOG2_E)
    if const_expr(score_mod is None):
        c = softmax_scale * LOG2_E
    return c


@cute.jit
def max_step(blk_max: Float32, m_old: Float32, c: Float32, threshold: cutlass.Constexpr):
    """(factor the running sum and O are rescaled by, the kept max). The max moves only when it
    grew by more than ``threshold`` (log2 units): below it the stale max stays, exact because
    the sum and the LSE use the same one."""
    # NaN (both -inf) compares false: keep -inf.
    grow = (blk_max - m_old) * c > threshold
    m_new = blk_max if grow else m_old
    # Only evaluated where the max moved: m_old = m_new = -inf would give NaN.
    scale = cute.math.exp2((m_old - m_new) * c, fastmath=True) if grow else Float32(1.0)
    return scale, m_new


@cute.jit
def max_step_every_tile(blk_max: Float32, m_old: Float32, c: Float32):
    """``max_step`` at threshold 0 without a branch on whether the max grew: the factor is
    exactly 1 where it did not, and 0 while the row has kept nothing (m_old = -inf: O and the
    sum are still 0), also where c = 0 would make the exponent NaN."""
    m_new = cute.arch.fmax(blk_max, m_old)
    scale = cute.math.exp2((m_old - m_new) * c, fastmath=True)
    return cutlass.select_(m_old == -Float32.inf, Float32(0.0), scale), m_new


@cute.jit
def exp2_bias(m: Float32, c: Float32) -> Float32:
    """m·c, with 0 for a row that has kept nothing yet (m = -inf)."""
    return (Float32(0.0) if m == -Float32.inf else m) * c


@cute.jit
def finalize(row_sum: Float32, row_max: Float32, c: Float32):
    """(1 / row_sum, LSE in natural log); (0, -inf) for a row with nothing kept, never NaN."""
    ok = row_sum > 0.0  # false for an all-masked row (0) and for NaN
    inv = cute.arch.rcp_approx(row_sum if ok else Float32(1.0))
    inv = inv if ok else Float32(0.0)
    m_safe = Float32(0.0) if row_max == -Float32.inf else row_max
    lse = (m_safe * c + cute.math.log2(row_sum if ok else Float32(1.0), fastmath=True)) * LN_2
    lse = lse if ok else -Float32.inf
    return inv, lse


@cute.jit
def online_softmax(acc_S: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, row_peak,
                   c: Float32, threshold: cutlass.Constexpr, first: cutlass.Constexpr,
                   interleave: cutlass.Constexpr = False):
    """One step over an sm90 S accumulator, in place -> P (unnormalised): the 4 threads of a row
    reduce by shuffles. ``row_peak`` (or None) tracks the true max. Returns the per-row factor
    O must be multiplied by (1.0 where the kept max did not change). ``interleave`` (threshold
    0 only): the factor without a branch, its exp2 first in the row sum's tree, so that ptxas
    issues O's multiplies among the exp2s (``rescale_rows(vote=False)``)."""
    s_rc = rows_cols(acc_S)
    n_rows = cute.size(s_rc, mode=[0])
    n_cols = cute.size(s_rc, mode=[1])
    row_scale = cute.make_rmem_tensor(n_rows, Float32)
    for r in cutlass.range_constexpr(n_rows):
        blk_max = tree([s_rc[r, k] for k in range(n_cols)], cute.arch.fmax)
        blk_max = quad_allreduce(blk_max, cute.arch.fmax)
        if const_expr(row_peak is not None):
            row_peak[r] = cute.arch.fmax(row_peak[r], blk_max)
        m_new = blk_max
        scale = Float32(1.0)
        if const_expr(not first and interleave):
            scale, m_new = max_step_every_tile(blk_max, row_max[r], c)
        elif const_expr(not first):
            scale, m_new = max_step(blk_max, row_max[r], c, threshold)
        row_max[r] = m_new
        bias = exp2_bias(m_new, c)
        for k in cutlass.range_constexpr(n_cols):
            s_rc[r, k] = cute.math.exp2(cute.fma(s_rc[r, k], c, -bias), fastmath=True)
        if const_expr(first):
            row_sum[r] = tree([s_rc[r, k] for k in range(n_cols)], fadd)
        elif const_expr(interleave):
            # The rescaled old sum enters the tree first: the scale's exp2 then starts a chain
            # instead of ending one, and ptxas issues it early, O's multiplies after it.
            row_sum[r] = tree([row_sum[r] * scale] + [s_rc[r, k] for k in range(n_cols)], fadd)
        else:
            row_sum[r] = row_sum[r] * scale + tree([s_rc[r, k] for k in range(n_cols)], fadd)
        row_scale[r] = scale
    return row_scale


@cute.jit
def rescale_rows(acc_O: cute.Tensor, row_scale: cute.Tensor, vote: cutlass.Constexpr = True):
    """O *= row_scale on an sm90 accumulator; ``vote``: skipped when no row of this warp changed
    its kept max (a warp vote, a branch); without, straight-line code ptxas can interleave."""
    o_rc = rows_cols(acc_O)
    if const_expr(vote):
        smallest = tree([row_scale[r] for r in range(cute.size(row_scale))], cute.arch.fmin)
        if cute.arch.vote_any_sync(smallest < 1.0):
            _scale_rows(o_rc, row_scale)
    else:
        _scale_rows(o_rc, row_scale)


@cute.jit
def _scale_rows(o_rc: cute.Tensor, row_scale: cute.Tensor):
    for r in cutlass.range_constexpr(cute.size(o_rc, mode=[0])):
        for k in cutlass.range_constexpr(cute.size(o_rc, mode=[1])):
            o_rc[r, k] = o_rc[r, k] * row_scale[r]


@cute.jit
def p_dscore(p: Float32, ds: Float32, ok):
    """A backward's P∘(d modded / d score), 0 where ``ok`` (the mask and bounds, None where
    nothing is dropped) drops the entry: the derivative may be inf/NaN there."""
    pd = p * ds
    if const_expr(ok is not None):
        pd = pd if ok else Float32(0.0)
    return pd
