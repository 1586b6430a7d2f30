"""Gradients of captured tensors that require grad, added by the backward: per element
g = P∘(dP − delta), and for each learnable load j ``acc_j[offset_j] += g · d score / d load_j``
in fp64 (``score_grads`` / ``grad_offsets``, rendered by the backend).

A load whose offset varies with neither q_idx nor kv_idx (``slopes[h]``) is summed per thread in
fp32 and flushed per warp by a butterfly (one add per warp and tile); any other load
(``table[h, clamp(kv - q)]``) adds per element, skipped where g = 0. fp64 because a table entry
can receive ~L·S/2 adds; their order is not fixed, so these gradients are not bit-reproducible
even in deterministic mode."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr


@cute.jit
def _add(ptr, value, use_red: cutlass.Constexpr):
    if const_expr(use_red):
        # red, not atom: an unused returned fp64 holds 2 registers per add.
        cute.arch.red(ptr, value, op="add", dtype="f64", sem="relaxed", scope="gpu")
    else:
        cute.arch.atomic_add(ptr, value)


@cute.jit
def add_element(g: Float32, derivs, offsets, sums: list, grad_offsets: cutlass.Constexpr, accs,
                only_wg0, use_red: cutlass.Constexpr):
    """One element's contributions: the uniform loads' into ``sums`` (in place), the others into
    their accumulators. A derivative may be inf/NaN where the element is masked (g = 0):
    selected away. ``only_wg0`` (or None): a warpgroup index, where both hold the same
    elements and only warpgroup 0 adds them."""
    zero = Float32(0.0)
    uniform, acc_of = grad_offsets.uniform, grad_offsets.acc
    for j in cutlass.range_constexpr(len(uniform)):
        contrib = Float32(cutlass.select_(g == zero, zero, g * derivs[1 + j]))
        if const_expr(only_wg0 is not None):
            contrib = Float32(cutlass.select_(only_wg0 == 0, contrib, zero))
        if const_expr(uniform[j]):
            sums[j] = sums[j] + contrib
        else:
            if contrib != zero:
                _add(accs[acc_of[j]].iterator + offsets[j], contrib.to(cutlass.Float64), use_red)


def d_score(g: Float32, derivs, score_grads):
    """dS = g · d score / d score (g itself where the score_mod's derivative is 1)."""
    if const_expr(score_grads.unit_dscore):
        return g
    zero = Float32(0.0)
    return Float32(cutlass.select_(g == zero, zero, g * derivs[0]))


@cute.jit
def flush_uniform(sums, offsets, grad_offsets: cutlass.Constexpr, accs,
                  use_red: cutlass.Constexpr):
    """The uniform loads' per-thread sums: a warp butterfly, then one fp64 add by lane 0
    (``offsets``: any element's, the offsets vary with neither index)."""
    uniform, acc_of = grad_offsets.uniform, grad_offsets.acc
    for j in cutlass.range_constexpr(len(uniform)):
        if const_expr(uniform[j]):
            total = sums[j]
            for sh in cutlass.range_constexpr(5):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=16 >> sh)
            if cute.arch.lane_idx() == 0:
                _add(accs[acc_of[j]].iterator + offsets[j], total.to(cutlass.Float64), use_red)


@cute.jit
def element(g: Float32, batch, head, q_idx, kv_idx, aux, indices, sums: list,
            score_grads: cutlass.Constexpr, grad_offsets: cutlass.Constexpr, accs, only_wg0,
            use_red: cutlass.Constexpr, at=None):
    """One element (q_idx, kv_idx) with g = P∘(dP − delta): the derivatives and offsets of the
    learnable loads there, their contributions (``add_element``), and dS (``d_score``).
    ``at``: the element's index offsets from ``indices``' base (``FloatIndices.args``)."""
    derivs = score_grads(batch, head, q_idx, kv_idx, aux,
                         *indices.args(score_grads, q_idx, kv_idx, at))
    offsets = None
    if const_expr(not all(grad_offsets.uniform)):
        offsets = grad_offsets(batch, head, q_idx, kv_idx, aux,
                               *indices.args(grad_offsets, q_idx, kv_idx, at))
    add_element(g, derivs, offsets, sums, grad_offsets, accs, only_wg0, use_red)
    return d_score(g, derivs, score_grads)
