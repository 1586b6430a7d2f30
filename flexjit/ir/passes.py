"""Analysis and rewrite passes over the IR, and the pipeline that runs them.

Pipeline (``lower``), in order:
  1. ``relocate``  -- give the mask_mod's buffers/scalars slots after the score_mod's.
  2. ``simplify``  -- constant folding and algebraic identities, to a fixed point.
  3. ``derivative``-- reverse-mode d(score_mod)/d(score) and d(score_mod)/d(load) for
                      every load of a captured tensor that requires grad.
  4. ``simplify``  -- again, on the derivative graphs.
  5. ``float index``-- (lengths below FLOAT_INDEX_LIMIT) float casts of index sums move onto
                      the leaves.
  6. ``widen``     -- per call: int32 arithmetic that can overflow at the call's lengths and
                      scalar values is computed in int64.

The result, a :class:`Program`, is everything a backend renders. Its ``key`` is
the structural digest of all its graphs: the compile-cache key.

``to_sympy`` converts an arithmetic graph to sympy; tests use it as an
independent oracle for ``derivative`` and ``simplify``.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from flexjit import config
from flexjit.ir import intervals, nodes as ir
from flexjit.ir.interp import Env, evaluate
from flexjit.ir.nodes import DType, Node, Op
from flexjit.ir.program import GradLoad, Program, TracedMod
from flexjit.ir.nodes import build_binary, cast

LN2 = math.log(2.0)


# --------------------------------------------------------------------------- rewriting


def rewrite(roots: list[Node], fn: Callable[[Node, tuple[Node, ...]], Node]) -> list[Node]:
    """Rebuild graphs bottom-up: ``fn(old_node, new_srcs)`` returns the replacement."""
    new: dict[int, Node] = {}
    for n in ir.toposort(roots):
        srcs = tuple(new[id(s)] for s in n.src)
        new[id(n)] = fn(n, srcs)
    return [new[id(r)] for r in roots]


def relocate(root: Node, buffer_offset: int, scalar_offset: int) -> Node:
    """Shift BUFFER and SCALAR slot numbers (to merge two mods' captures)."""
    def fn(n: Node, srcs):
        if n.op is Op.BUFFER:
            slot, ndim, storage = n.arg
            return ir.node(Op.BUFFER, n.dtype, (), (slot + buffer_offset, ndim, storage))
        if n.op is Op.SCALAR:
            return ir.node(Op.SCALAR, n.dtype, (), n.arg + scalar_offset)
        return ir.node(n.op, n.dtype, srcs, n.arg)
    return rewrite([root], fn)[0]


# --------------------------------------------------------------------------- simplify


def _is_const(n: Node, value=None) -> bool:
    return n.op is Op.CONST and (value is None or n.arg == value)


def _fold(n: Node, srcs: tuple[Node, ...]) -> Node:
    """Evaluate an op on constant operands with float32 semantics, like a kernel would."""
    out = evaluate(ir.node(n.op, n.dtype, srcs, n.arg), Env(float_dtype=torch.float32))
    return ir.const(out.item(), n.dtype)


def _simplify_node(n: Node, srcs: tuple[Node, ...]) -> Node:
    op = n.op
    if op in ir.LEAVES or op is Op.LOAD:
        return ir.node(op, n.dtype, srcs, n.arg)
    if srcs and all(s.op is Op.CONST for s in srcs):
        return _fold(n, srcs)
    if op is Op.CAST:
        return cast(srcs[0], n.arg)
    if op in ir.LOW_PRECISION and _holds_exactly(srcs[0], op):
        return srcs[0]
    a = srcs[0]
    b = srcs[1] if len(srcs) > 1 else None
    if op is Op.ADD:
        if _is_const(b, 0):
            return a
        if _is_const(a, 0):
            return b
    elif op is Op.SUB and _is_const(b, 0):
        return a
    elif op is Op.MUL:
        if _is_const(b, 1):
            return a
        if _is_const(a, 1):
            return b
        if n.dtype.is_int and (_is_const(a, 0) or _is_const(b, 0)):
            return ir.const(0, n.dtype)
    elif op is Op.DIV and _is_const(b, 1):
        return a
    elif op is Op.NEG and a.op is Op.NEG:
        return a.src[0]
    elif op is Op.NOT and a.op is Op.NOT:
        return a.src[0]
    elif op in (Op.AND, Op.OR) and n.dtype is DType.BOOL:
        absorbing, neutral = (False, True) if op is Op.AND else (True, False)
        for x, y in ((a, b), (b, a)):
            if _is_const(x, neutral):
                return y
            if _is_const(x, absorbing):
                return ir.const(absorbing)
        if a is b:
            return a
    elif op is Op.WHERE:
        c, x, y = srcs
        if _is_const(c, True):
            return x
        if _is_const(c, False):
            return y
        if x is y:
            return x
    elif op in (Op.MAX, Op.MIN) and a is b:
        return a
    return ir.node(op, n.dtype, srcs, n.arg)


# Ops whose result is exactly representable in a narrower float when their float operands are:
# a rounding op's result is representable in its own format.
_KEEPS_FORMAT = frozenset({Op.NEG, Op.ABS, Op.MAX, Op.MIN, Op.WHERE}) | ir.ROUNDING


def _holds_exactly(n: Node, rounding: Op) -> bool:
    """Whether ``n`` is already a value of the format ``rounding`` rounds to (so rounding it
    again changes nothing): that rounding's result, a constant it keeps, or a sign change,
    min/max, select or integer rounding of such values."""
    if n.op is rounding:
        return True
    if n.op is Op.CONST and n.dtype.is_float:
        return _fold(ir.node(rounding, n.dtype, (n,)), (n,)).arg == n.arg or n.arg != n.arg
    if n.op in _KEEPS_FORMAT and n.dtype.is_float:
        return all(_holds_exactly(s, rounding) for s in n.src if s.dtype.is_float)
    return False


def _cancel_node(n: Node, srcs: tuple[Node, ...]) -> Node:
    """(a·x)/a -> x and (x·a)/a -> x for a scalar or nonzero constant a (float only)."""
    if n.op is Op.DIV and n.dtype.is_float:
        num, den = srcs
        if num.op is Op.MUL and den.op in (Op.SCALAR, Op.CONST) and not _is_const(den, 0.0):
            if num.src[0] is den:
                return num.src[1]
            if num.src[1] is den:
                return num.src[0]
    return _simplify_node(n, srcs)


def simplify(root: Node, cancel: bool = False) -> Node:
    """Constant folding and algebraic identities that hold for every input.

    ``cancel`` also applies (a·x)/a -> x, exact in real arithmetic but not bit for bit in
    floating point: used on derivative graphs, which feed no comparison."""
    rule = _cancel_node if cancel else _simplify_node
    while True:
        new = rewrite([root], rule)[0]
        if new is root:
            return new
        root = new


# --------------------------------------------------------------------------- derivative


def _c(v: float) -> Node:
    return ir.const(v, DType.FLOAT32)


def _mul(a: Node, b: Node) -> Node:
    return ir.node(Op.MUL, DType.FLOAT32, (a, b))


def _add(a: Node | None, b: Node) -> Node:
    return b if a is None else ir.node(Op.ADD, DType.FLOAT32, (a, b))


def _neg(a: Node) -> Node:
    return ir.node(Op.NEG, DType.FLOAT32, (a,))


def _div(a: Node, b: Node) -> Node:
    return ir.node(Op.DIV, DType.FLOAT32, (a, b))


def _where(c: Node, a: Node, b: Node) -> Node:
    return ir.node(Op.WHERE, DType.FLOAT32, (c, a, b))


def _cmp(op: Op, a: Node, b: Node) -> Node:
    return ir.node(op, DType.BOOL, (a, b))


def _local_grads(n: Node, g: Node) -> list[Node | None]:
    """Gradient of ``n`` w.r.t. each operand, given the gradient ``g`` of n.

    Ties and kinks follow torch autograd (max/min split ties; abs'(0) = 0)."""
    op, s = n.op, n.src
    zero = _c(0.0)
    if op is Op.ADD:
        return [g, g]
    if op is Op.SUB:
        return [g, _neg(g)]
    if op is Op.MUL:
        return [_mul(g, s[1]), _mul(g, s[0])]
    if op is Op.DIV:
        return [_div(g, s[1]), _neg(_div(_mul(g, n), s[1]))]
    if op is Op.NEG:
        return [_neg(g)]
    if op is Op.ABS:
        return [_where(_cmp(Op.GT, s[0], zero), g, _where(_cmp(Op.LT, s[0], zero), _neg(g), zero))]
    if op is Op.EXP:
        return [_mul(g, n)]
    if op is Op.EXP2:
        return [_mul(g, _mul(n, _c(LN2)))]
    if op is Op.LOG:
        return [_div(g, s[0])]
    if op is Op.LOG2:
        return [_div(g, _mul(s[0], _c(LN2)))]
    if op is Op.TANH:
        return [_mul(g, ir.node(Op.SUB, DType.FLOAT32, (_c(1.0), _mul(n, n))))]
    if op is Op.SIGMOID:
        return [_mul(g, _mul(n, ir.node(Op.SUB, DType.FLOAT32, (_c(1.0), n))))]
    if op is Op.SQRT:
        return [_div(_mul(g, _c(0.5)), n)]
    if op is Op.RSQRT:
        return [_div(_mul(g, _mul(_c(-0.5), n)), s[0])]
    if op is Op.SIN:
        return [_mul(g, ir.node(Op.COS, DType.FLOAT32, (s[0],)))]
    if op is Op.COS:
        return [_neg(_mul(g, ir.node(Op.SIN, DType.FLOAT32, (s[0],))))]
    if op is Op.POW:
        a, b = s
        da = _mul(g, _mul(b, ir.node(Op.POW, DType.FLOAT32, (a, ir.node(Op.SUB, DType.FLOAT32, (b, _c(1.0)))))))
        db = _mul(g, _mul(n, ir.node(Op.LOG, DType.FLOAT32, (a,))))
        return [da, db]
    if op in (Op.MAX, Op.MIN):
        a, b = s
        win = Op.GT if op is Op.MAX else Op.LT
        half = _mul(g, _c(0.5))
        eq = _cmp(Op.EQ, a, b)
        return [_where(_cmp(win, a, b), g, _where(eq, half, zero)),
                _where(_cmp(win, b, a), g, _where(eq, half, zero))]
    if op is Op.WHERE:
        return [None, _where(s[0], g, zero), _where(s[0], zero, g)]
    if op is Op.MOD:  # remainder: a - floor(a/b) * b
        return [g, _neg(_mul(g, ir.node(Op.FLOOR, DType.FLOAT32, (_div(s[0], s[1]),))))]
    if op is Op.FMOD:  # a - trunc(a/b) * b
        return [g, _neg(_mul(g, ir.node(Op.TRUNC, DType.FLOAT32, (_div(s[0], s[1]),))))]
    if op is Op.TAN:
        return [_mul(g, ir.node(Op.ADD, DType.FLOAT32, (_c(1.0), _mul(n, n))))]
    if op is Op.ATAN:
        return [_div(g, ir.node(Op.ADD, DType.FLOAT32, (_c(1.0), _mul(s[0], s[0]))))]
    if op is Op.SINH:
        return [_mul(g, ir.node(Op.COSH, DType.FLOAT32, (s[0],)))]
    if op is Op.COSH:
        return [_mul(g, ir.node(Op.SINH, DType.FLOAT32, (s[0],)))]
    if op in (Op.ASIN, Op.ACOS):
        root = ir.node(Op.RSQRT, DType.FLOAT32, (ir.node(Op.SUB, DType.FLOAT32, (_c(1.0), _mul(s[0], s[0]))),))
        return [_mul(g, root) if op is Op.ASIN else _neg(_mul(g, root))]
    if op is Op.LOG1P:
        return [_div(g, ir.node(Op.ADD, DType.FLOAT32, (_c(1.0), s[0])))]
    if op is Op.EXPM1:
        return [_mul(g, ir.node(Op.ADD, DType.FLOAT32, (n, _c(1.0))))]
    if op is Op.ERF:  # 2/sqrt(pi) * exp(-x^2)
        return [_mul(g, _mul(_c(2.0 / math.sqrt(math.pi)),
                             ir.node(Op.EXP, DType.FLOAT32, (_neg(_mul(s[0], s[0])),))))]
    if op is Op.CAST:
        return [g if s[0].dtype.is_float else None]
    if op in ir.LOW_PRECISION:  # straight through, as torch's cast backward (less its rounding)
        return [g]
    if op is Op.ATAN2:  # torch's atan2_backward: 0 where 1/(y² + x²) overflows
        y, x = s
        recip = _div(_c(1.0), ir.node(Op.ADD, DType.FLOAT32, (_mul(y, y), _mul(x, x))))
        recip = _where(_cmp(Op.EQ, recip, _c(math.inf)), zero, recip)
        return [_mul(_mul(g, x), recip), _neg(_mul(_mul(g, y), recip))]
    if op in NO_GRADIENT:
        return [None] * len(s)
    raise NotImplementedError(f"no derivative rule for {op.value}")


# Ops through which no gradient flows: floor, ceil and float floordiv are zero almost everywhere,
# comparisons and logic are not differentiable, a load's gradient goes to its buffer
# (``Program.grad_loads``), leaves have no operands. Every other op has a rule in _local_grads.
NO_GRADIENT = frozenset({Op.FLOORDIV, Op.NOT, Op.LOAD}) | ir.ROUNDING | ir.COMPARE | ir.LOGIC \
    | ir.SHIFT | ir.LEAVES


def derivative(out: Node, wrt: list[Node]) -> list[Node]:
    """d(out)/d(w) for each node w in ``wrt`` (leaves or loads), as graphs over forward nodes."""
    grads: dict[int, Node] = {id(out): _c(1.0)}
    targets = {id(w) for w in wrt}
    for n in reversed(ir.toposort([out])):
        g = grads.get(id(n))
        if g is None or not n.dtype.is_float or id(n) in targets and n.op in (Op.SCORE, Op.LOAD):
            continue
        for s, gs in zip(n.src, _local_grads(n, g)):
            if gs is not None and s.dtype.is_float:
                grads[id(s)] = _add(grads.get(id(s)), gs)
    return [simplify(grads.get(id(w), _c(0.0)), cancel=True) for w in wrt]


# --------------------------------------------------------------------------- precision analysis

_DISCONTINUOUS = frozenset({Op.FLOORDIV, Op.MOD, Op.FMOD, Op.LOAD}) | ir.ROUNDING | ir.COMPARE \
    | ir.LOW_PRECISION


def exact_float_nodes(roots: list[Node]) -> set[int]:
    """Float nodes whose rounding can change a discrete result (a comparison, floor, an int
    cast, an index, a rounding to float16/bfloat16): they render with correctly rounded ops so
    masks and rounded values match the interpreter."""
    exact: set[int] = set()
    for n in reversed(ir.toposort(roots)):
        sink = n.op in _DISCONTINUOUS or (n.op is Op.CAST and not n.dtype.is_float)
        if sink or id(n) in exact:
            for s in n.src:
                if s.dtype.is_float:
                    exact.add(id(s))
    return exact


# --------------------------------------------------------------------------- int64 where int32 overflows

# Integer ops whose exact result can leave their operands' range; the rest (min, max, %, the
# bitwise ops) stay inside it.
_CAN_OVERFLOW = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.NEG, Op.ABS, Op.FLOORDIV, Op.SHL})
# Ops whose result has their operands' dtype (for WHERE: the two values).
_SAME_DTYPE = ir.ARITH | ir.LOGIC | ir.SHIFT | frozenset({Op.NEG, Op.ABS, Op.NOT, Op.WHERE})
_I32_LIMITS = (-(2.0 ** 31), 2.0 ** 31 - 1)
_I64_LIMITS = (-(2.0 ** 63), 2.0 ** 63)


def _int64_twin(n: Node, srcs: tuple[Node, ...]) -> Node:
    """``n`` computed in int64: its integer value operands cast up."""
    first = 1 if n.op is Op.WHERE else 0
    srcs = srcs[:first] + tuple(cast(s, DType.INT64) if s.dtype is DType.INT32 else s for s in srcs[first:])
    return ir.node(n.op, DType.INT64, srcs, n.arg)


def widen(roots: list[Node], lengths: tuple[int, int, int, int], scalars) -> list[Node]:
    """Integer arithmetic that can leave int32 in this call is computed in int64.

    Over every position of a call with lengths (B, H, L, S), with these scalar values and with
    captured integer tensors holding anything their dtype holds, an int32 add, subtract,
    multiply, negate, abs, floor division or left shift whose exact result can leave int32
    becomes int64, and so does everything computed from it; the rest is untouched (int32 is
    what the kernels' indices are). This is the answer torch's eager mods give, whose indices
    are int64: ``(q_idx * 100000000) > kv_idx`` at S=256 wraps in int32 and is right in int64.
    int64 arithmetic wraps, as in torch. (One difference stays: ``.int()`` of a value the IR
    already holds in int32 is no cast at all, so it does not make the value wrap where torch's
    would.)
    """
    roots = list(roots)
    if not _has_int32_arith(tuple(roots)):
        return roots
    key = (tuple(roots), tuple(lengths), tuple(scalars))
    found = _WIDENED.get(key)
    if found is not None:
        return list(found)
    env = intervals.domain(tuple(lengths), tuple(scalars))
    bounds: dict[Node, tuple] = {}  # keyed by node: keeps the int64 twins alive while in use

    def bound(n: Node) -> tuple:
        if n not in bounds:
            b = intervals.bound(n, [None if s.op is Op.BUFFER else bound(s) for s in n.src], env)
            if n.dtype.is_int:  # a typed value lies in its type: drops "unknown" (±inf) bounds
                lo, hi = _I32_LIMITS if n.dtype is DType.INT32 else _I64_LIMITS
                b = ("num", b[1].nan_to_num(lo).clamp(lo, hi), b[2].nan_to_num(hi).clamp(lo, hi))
            bounds[n] = b
        return bounds[n]

    def fn(n: Node, srcs: tuple[Node, ...]) -> Node:
        if n.op is Op.CAST:
            return cast(srcs[0], n.dtype)
        if n.dtype is DType.INT32 and n.op in _SAME_DTYPE and any(s.dtype is DType.INT64 for s in srcs):
            return _int64_twin(n, srcs)
        if n.op in ir.COMPARE:
            return build_binary(n.op, *srcs)  # casts an int32 side up to a widened one
        m = ir.node(n.op, n.dtype, srcs, n.arg)
        if m.dtype is DType.INT32 and m.op in _CAN_OVERFLOW:
            twin = _int64_twin(m, m.src)
            _, lo, hi = bound(twin)
            if lo.item() < _I32_LIMITS[0] or hi.item() > _I32_LIMITS[1]:
                return twin
        return m

    out = rewrite(roots, fn)
    if len(_WIDENED) > 4096:
        _WIDENED.clear()
    _WIDENED[key] = tuple(out)
    return out


_WIDENED: dict[tuple, tuple] = {}


@functools.lru_cache(maxsize=4096)
def _has_int32_arith(roots: tuple[Node, ...]) -> bool:
    return any(n.dtype is DType.INT32 and n.op in _CAN_OVERFLOW for n in ir.toposort(list(roots)))


# --------------------------------------------------------------------------- program


# --------------------------------------------------------------------------- float indices

# Indices (and their sums below) are exact in float32 below 2**24; with at most two index terms
# below this limit and constants summing below it, every partial sum stays below 3 * 2**22.
FLOAT_INDEX_LIMIT = 2 ** 22


def _index_terms(n: Node) -> tuple[int, int] | None:
    """(number of index leaves, sum of |constants|) if ``n`` is an integer sum/difference of
    index leaves and constants (what ALiBi-style mods cast to float), else None."""
    if n.op in ir.INDEX_LEAVES:
        return 1, 0
    if n.op is Op.CONST and n.dtype.is_int:
        return 0, abs(int(n.arg))
    if n.op in (Op.ADD, Op.SUB, Op.NEG) and n.dtype.is_int:
        terms = [_index_terms(s) for s in n.src]
        if any(t is None for t in terms):
            return None
        return sum(t[0] for t in terms), sum(t[1] for t in terms)
    return None


def _as_float(n: Node) -> Node:
    """The float32 graph of an integer index sum: casts move onto the leaves."""
    if n.op in ir.INDEX_LEAVES or n.op is Op.CONST:
        return cast(n, DType.FLOAT32)
    return ir.node(n.op, DType.FLOAT32, tuple(_as_float(s) for s in n.src))


def _float_index_node(n: Node, srcs: tuple[Node, ...]) -> Node:
    n = ir.node(n.op, n.dtype, srcs, n.arg)
    if n.op is Op.CAST and n.dtype is DType.FLOAT32 and n.src[0].op not in ir.INDEX_LEAVES:
        terms = _index_terms(n.src[0])
        if terms is not None and terms[0] <= 2 and terms[1] < FLOAT_INDEX_LIMIT:
            return _as_float(n.src[0])
    return n


def _float_index_graphs(graphs: tuple) -> tuple:
    """``float(kv_idx - q_idx)`` -> ``float(kv_idx) - float(q_idx)`` in a program's four graphs,
    exact while every index is below FLOAT_INDEX_LIMIT (the caller checks the lengths). Kernels
    then convert each index once per row or column (Triton: a 1-D vector; CuTe: one base plus
    constants) instead of once per score element: an int->float conversion runs at the MUFU's
    quarter rate on Hopper, beside exp2, so ALiBi's conversions were as costly as its softmax."""
    return _on_graphs(graphs, lambda roots: rewrite(roots, _float_index_node))


def _widen_graphs(graphs: tuple, lengths, scalars) -> tuple:
    """``widen`` on a program's four graphs at once."""
    return _on_graphs(graphs, lambda roots: widen(roots, lengths, scalars))


def _on_graphs(graphs: tuple, transform: Callable[[list[Node]], list[Node]]) -> tuple:
    """(score, mask, dscore, grad_loads) through ``transform(roots) -> new roots``, all at once:
    the loads of grad_loads are rewritten with the rest, so they stay the graphs' nodes."""
    score, mask, dscore, grad_loads = graphs
    roots = [r for r in (score, mask, dscore) if r is not None]
    roots += [g.load for g in grad_loads] + [g.grad for g in grad_loads]
    new = iter(transform(roots))
    score, mask, dscore = [next(new) if r is not None else None for r in (score, mask, dscore)]
    loads = [next(new) for _ in grad_loads]
    return score, mask, dscore, tuple(GradLoad(ld, next(new)) for ld in loads)


def _loads(root: Node) -> list[Node]:
    return [n for n in ir.walk(root) if n.op is Op.LOAD]


def lower(score: TracedMod | None, mask: TracedMod | None, float_index: bool = False,
          learnable: tuple[bool, ...] | None = None,
          lengths: tuple[int, int, int, int] | None = None) -> Program:
    """Run the pass pipeline on a traced score_mod and mask_mod.

    The graph work depends only on the traced IR (interned, so identity is structure), the
    number of captures before the mask's and which loads are learnable; it is memoised on
    exactly that, so a call with the same mods costs a dictionary lookup. ``float_index``: also
    move float casts of index sums onto the leaves (``_float_index_graphs``; the caller checks
    that every length is below FLOAT_INDEX_LIMIT). ``learnable``: which captured tensors get
    gradients, where it is not their ``requires_grad`` (inside a custom op, ``flexjit.api.compiled``).
    ``lengths``: the call's (B, Hq, L, S); integer arithmetic that can overflow int32 there is
    computed in int64 (``widen``). Every caller that runs a program passes them."""
    buffers = tuple((score.buffers if score else []) + (mask.buffers if mask else []))
    scalars = tuple((score.scalars if score else []) + (mask.scalars if mask else []))
    n_score_bufs = len(score.buffers) if score else 0
    n_score_scalars = len(score.scalars) if score else 0
    if learnable is None:
        learnable = tuple(bool(t.requires_grad and t.is_floating_point()) for t in buffers)
    key = (score.out if score else None, mask.out if mask else None, n_score_bufs, n_score_scalars,
           learnable, float_index)
    graphs = _LOWERED.get(key)
    if graphs is None:
        graphs = _lower_graphs(*key[:-1])
        if float_index:
            graphs = _float_index_graphs(graphs)
        if len(_LOWERED) > 4096:
            _LOWERED.clear()
        _LOWERED[key] = graphs
    if lengths is not None:
        graphs = _widen_graphs(graphs, lengths, scalars)
    program = Program(*graphs, buffers, scalars, score.name if score else "identity",
                      mask.name if mask else "noop")
    if config.settings.debug:
        print("[flexjit] lowered program\n" + describe(program))
    return program


_LOWERED: dict[tuple, tuple] = {}


def _lower_graphs(score: Node | None, mask: Node | None, n_score_bufs: int, n_score_scalars: int,
                  learnable: tuple[bool, ...]):
    """(score, mask, dscore, grad_loads): the pipeline proper, in order."""
    score_out = mask_out = dscore = None
    grad_loads: list[GradLoad] = []
    if score is not None:
        score_out = simplify(score)
    if mask is not None:
        mask_out = simplify(relocate(mask, n_score_bufs, n_score_scalars))
        if mask_out.op is Op.CONST and mask_out.arg is True:
            mask_out = None
    if score_out is not None and score_out.op is Op.SCORE:
        score_out = None
    if score_out is not None:
        loads = [n for n in _loads(score_out) if learnable[n.src[0].arg[0]] and n.dtype.is_float]
        score_leaf = ir.node(Op.SCORE, DType.FLOAT32)
        grads = derivative(score_out, [score_leaf] + loads)
        dscore = grads[0]
        grad_loads = [GradLoad(ld, g) for ld, g in zip(loads, grads[1:]) if not _is_const(g, 0.0)]
    return score_out, mask_out, dscore, tuple(grad_loads)


def describe(p: Program) -> str:
    roots = {}
    if p.score is not None:
        roots[f"score ({p.score_name})"] = p.score
    if p.mask is not None:
        roots[f"mask ({p.mask_name})"] = p.mask
    if p.dscore is not None:
        roots["dscore/dscore"] = p.dscore
    for g in p.grad_loads:
        roots[f"dscore/dbuf{g.slot}"] = g.grad
    if not roots:
        return "  (identity score, no mask)"
    return ir.format_graph(roots)


# --------------------------------------------------------------------------- sympy bridge


def to_sympy(root: Node):
    """A sympy expression for an arithmetic/transcendental graph (for tests and docs).

    Leaves become symbols (score, b, h, q_idx, kv_idx, scalar<i>), loads become
    symbols named after their node, WHERE becomes Piecewise.
    """
    import sympy as sp

    syms: dict[int, object] = {}
    table = {
        Op.ADD: lambda a, b: a + b, Op.SUB: lambda a, b: a - b, Op.MUL: lambda a, b: a * b,
        Op.DIV: lambda a, b: a / b, Op.POW: lambda a, b: a ** b, Op.NEG: lambda a: -a,
        Op.EXP: sp.exp, Op.EXP2: lambda a: 2 ** a, Op.LOG: sp.log, Op.LOG2: lambda a: sp.log(a, 2),
        Op.TANH: sp.tanh, Op.SIGMOID: lambda a: 1 / (1 + sp.exp(-a)), Op.SQRT: sp.sqrt,
        Op.RSQRT: lambda a: 1 / sp.sqrt(a), Op.SIN: sp.sin, Op.COS: sp.cos, Op.ABS: sp.Abs,
        Op.MAX: sp.Max, Op.MIN: sp.Min,
        Op.LT: lambda a, b: a < b, Op.LE: lambda a, b: a <= b, Op.GT: lambda a, b: a > b,
        Op.GE: lambda a, b: a >= b, Op.EQ: sp.Eq, Op.NE: sp.Ne,
        Op.AND: sp.And, Op.OR: sp.Or, Op.NOT: sp.Not, Op.XOR: sp.Xor,
        Op.SHL: lambda a, b: a * 2 ** b, Op.SHR: lambda a, b: sp.floor(a / 2 ** b),  # in range
        Op.FLOOR: sp.floor, Op.CEIL: sp.ceiling, Op.FLOORDIV: lambda a, b: sp.floor(a / b),
        Op.MOD: lambda a, b: a - sp.floor(a / b) * b,  # Python's: the divisor's sign
        Op.FMOD: lambda a, b: a - sp.Function("trunc")(a / b) * b,  # C's: the dividend's sign
        Op.ROUND: sp.Function("round_half_even"), Op.TRUNC: sp.Function("trunc"),
        Op.TAN: sp.tan, Op.ATAN: sp.atan, Op.SINH: sp.sinh, Op.COSH: sp.cosh, Op.ASIN: sp.asin,
        Op.ACOS: sp.acos, Op.LOG1P: lambda a: sp.log(1 + a), Op.EXPM1: lambda a: sp.exp(a) - 1,
        Op.ERF: sp.erf, Op.ATAN2: sp.atan2,
        Op.ROUND_F16: sp.Function("round_f16"), Op.ROUND_BF16: sp.Function("round_bf16"),
    }
    for n in ir.toposort([root]):
        args = [syms[id(s)] for s in n.src]
        if n.op in (Op.SCORE, Op.B, Op.H, Op.Q_IDX, Op.KV_IDX):
            syms[id(n)] = sp.Symbol(n.op.value, real=True)
        elif n.op is Op.SCALAR:
            syms[id(n)] = sp.Symbol(f"scalar{n.arg}", real=True)
        elif n.op is Op.CONST:
            syms[id(n)] = sp.Float(n.arg) if isinstance(n.arg, float) else sp.sympify(n.arg)
        elif n.op is Op.BUFFER:
            syms[id(n)] = None
        elif n.op is Op.LOAD:
            syms[id(n)] = load_symbol(n)
        elif n.op is Op.CAST:
            syms[id(n)] = args[0]
        elif n.op is Op.WHERE:
            syms[id(n)] = sp.Piecewise((args[1], args[0]), (args[2], True))
        elif n.op in table:
            syms[id(n)] = table[n.op](*args)
        else:
            raise NotImplementedError(f"no sympy form for {n.op.value}")
    return syms[id(root)]


def load_symbol(n: Node):
    """The sympy symbol standing for a LOAD node: named by its structure, so it is the
    same symbol in every graph that contains that load."""
    import sympy as sp
    return sp.Symbol(f"load{n.src[0].arg[0]}_{ir.digest([n])[:8]}", real=True)
