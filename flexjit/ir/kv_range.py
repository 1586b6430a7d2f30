"""A mask as one interval of keys per query row: keep(b, h, q, kv) ⟺ lo(b, h, q) ≤ kv ≤ hi(b, h, q).

Causal, sliding windows (one- or two-sided, ``abs`` included), prefix-LM (an int or a per-batch
tensor), padding lengths and any and/or/not of integer comparisons linear in ``kv_idx`` with
coefficient ±1 reduce to it. A kernel then masks a partial tile by comparing each element's
column (a compile-time constant) with its row's two limits, computed once per row, instead of
evaluating mask_mod per element (FlashAttention's causal and local masks work the same way).

``lo`` and ``hi`` are int64 graphs over b, h, q_idx, scalars and captured tensors, never kv_idx,
built from the mask's own subexpressions: ``kv + a <= b`` becomes ``hi = b - a``, the new
arithmetic in int64. The forms agree wherever the mask's own int32 arithmetic does not wrap
(a wrapping mask is wrong in torch too). An unbounded side is None. Where the mask is not of
this form (document ids compared, a bias threshold, ``!=``), ``kv_interval`` returns None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from flexjit.ir import nodes as ir
from flexjit.ir.nodes import DType, Node, Op

# Past every index: a limit that keeps (or drops) a whole row. Kernels clamp limits to their
# own range, so only its sign and size matter.
BIG = 2 ** 40


@dataclass(frozen=True)
class KvInterval:
    lo: Optional[Node]  # int64, or None: unbounded below
    hi: Optional[Node]  # int64, or None: unbounded above


class _NotAffine(Exception):
    pass


def kv_interval(mask: Node) -> Optional[KvInterval]:
    """``mask``'s kept keys per row as one interval, or None where it is not of that form."""
    if mask.dtype is not DType.BOOL:
        return None
    try:
        return _interval(mask, False)
    except _NotAffine:
        return None


def _i64(n: Node) -> Node:
    return n if n.dtype is DType.INT64 else ir.cast(n, DType.INT64)


def _add(a: Optional[Node], b: Optional[Node]) -> Optional[Node]:
    if a is None or b is None:
        return b if a is None else a
    return ir.node(Op.ADD, DType.INT64, (_i64(a), _i64(b)))


def _neg(a: Optional[Node]) -> Optional[Node]:
    if a is None or a.op is Op.NEG:
        return None if a is None else _i64(a.src[0])
    return ir.node(Op.NEG, DType.INT64, (_i64(a),))


def _plus(a: Optional[Node], k: int) -> Node:
    return _add(a, ir.const(k, DType.INT64)) if k else (_i64(a) if a is not None else ir.const(0, DType.INT64))


def _split(n: Node) -> tuple[int, Optional[Node]]:
    """``n`` = c·kv_idx + rest, rest free of kv_idx (None: 0)."""
    if not n.dtype.is_int:
        raise _NotAffine
    if n.op is Op.KV_IDX:
        return 1, None
    if not ir.uses(n, Op.KV_IDX):
        return 0, n
    if n.op is Op.CAST and n.src[0].dtype.is_int:
        return _split(n.src[0])
    if n.op in (Op.ADD, Op.SUB):
        (ca, ra), (cb, rb) = _split(n.src[0]), _split(n.src[1])
        if n.op is Op.SUB:
            cb, rb = -cb, _neg(rb)
        return ca + cb, _add(ra, rb)
    if n.op is Op.NEG:
        c, r = _split(n.src[0])
        return -c, _neg(r)
    raise _NotAffine


def _empty() -> KvInterval:
    return KvInterval(None, ir.const(-BIG, DType.INT64))


def _compare(op: Op, a: Node, b: Node) -> KvInterval:
    """The keys with ``a op b`` (op one of <, <=, >, >=, ==; kv_idx on either side)."""
    if not (a.dtype.is_int and b.dtype.is_int):
        raise _NotAffine
    for abs_side, other, flipped in ((a, b, False), (b, a, True)):
        if abs_side.op is Op.ABS and ir.uses(abs_side, Op.KV_IDX) and not ir.uses(other, Op.KV_IDX):
            # |x| <= r  ⟺  -r <= x <= r (and < alike); the other directions are two intervals.
            keep = {Op.LE: Op.LE, Op.LT: Op.LT, Op.GE: Op.LE, Op.GT: Op.LT}.get(op)
            if keep is None or (op in (Op.GE, Op.GT)) != flipped:
                raise _NotAffine
            x = abs_side.src[0]
            r = _i64(other)
            upper = _compare(keep, x, r)
            lower = _compare(keep, _neg(r), x)
            return _and(upper, lower)
    (ca, ra), (cb, rb) = _split(a), _split(b)
    c, r = ca - cb, _add(ra, _neg(rb))  # a - b = c·kv + r
    if c == 0:  # a row predicate: every key of the row, or none
        pred = ir.node(op, DType.BOOL, (a, b))
        return KvInterval(None, _where(pred, BIG, -BIG))
    if c not in (1, -1):
        raise _NotAffine
    if c == -1:  # -kv + r op 0  ⟺  kv (op mirrored) r
        op = {Op.LT: Op.GT, Op.LE: Op.GE, Op.GT: Op.LT, Op.GE: Op.LE, Op.EQ: Op.EQ}.get(op)
        bound = r
    else:  # kv + r op 0  ⟺  kv op -r
        bound = _neg(r)
    if op is Op.LT:
        return KvInterval(None, _plus(bound, -1))
    if op is Op.LE:
        return KvInterval(None, _plus(bound, 0))
    if op is Op.GT:
        return KvInterval(_plus(bound, 1), None)
    if op is Op.GE:
        return KvInterval(_plus(bound, 0), None)
    if op is Op.EQ:
        v = _plus(bound, 0)
        return KvInterval(v, v)
    raise _NotAffine  # != is two intervals


def _where(pred: Node, yes: int, no: int) -> Node:
    return ir.node(Op.WHERE, DType.INT64, (pred, ir.const(yes, DType.INT64), ir.const(no, DType.INT64)))


def _pick(op: Op, a: Optional[Node], b: Optional[Node]) -> Optional[Node]:
    if a is None or b is None:
        return None
    return ir.node(op, DType.INT64, (a, b))


def _tighter(op: Op, a: Optional[Node], b: Optional[Node]) -> Optional[Node]:
    if a is None or b is None:
        return b if a is None else a
    return ir.node(op, DType.INT64, (a, b))


def _and(x: KvInterval, y: KvInterval) -> KvInterval:
    return KvInterval(_tighter(Op.MAX, x.lo, y.lo), _tighter(Op.MIN, x.hi, y.hi))


def _or(x: KvInterval, y: KvInterval) -> KvInterval:
    # Two intervals unbounded on the same side are one; otherwise there may be a gap.
    if x.lo is None and y.lo is None:
        return KvInterval(None, _pick(Op.MAX, x.hi, y.hi))
    if x.hi is None and y.hi is None:
        return KvInterval(_pick(Op.MIN, x.lo, y.lo), None)
    raise _NotAffine


_NEGATED = {Op.LT: Op.GE, Op.LE: Op.GT, Op.GT: Op.LE, Op.GE: Op.LT}


def _interval(n: Node, negate: bool) -> KvInterval:
    if n.op is Op.CONST and n.dtype is DType.BOOL:
        return KvInterval(None, None) if bool(n.arg) != negate else _empty()
    if not ir.uses(n, Op.KV_IDX):  # a row predicate
        pred = ir.node(Op.NOT, DType.BOOL, (n,)) if negate else n
        return KvInterval(None, _where(pred, BIG, -BIG))
    if n.op is Op.NOT and n.dtype is DType.BOOL:
        return _interval(n.src[0], not negate)
    if n.op in (Op.AND, Op.OR) and n.dtype is DType.BOOL:
        x, y = _interval(n.src[0], negate), _interval(n.src[1], negate)
        return _and(x, y) if (n.op is Op.AND) != negate else _or(x, y)
    if n.op in _NEGATED or n.op is Op.EQ:
        op = _NEGATED.get(n.op) if negate else n.op
        if op is None:
            raise _NotAffine
        return _compare(op, n.src[0], n.src[1])
    if n.op is Op.NE and negate:
        return _compare(Op.EQ, n.src[0], n.src[1])
    raise _NotAffine
