"""The torch functions a mod may call, each as the IR it builds (``register`` fills
``proxy._HANDLERS``).

Most are compositions of IR ops (gelu of erf, softplus of log1p and exp, isnan as ``x != x``), so
the derivative, the interval rules and both renderers serve them unchanged; each composition
keeps torch's values at its edges (NaN in, NaN out; torch's subgradient at a kink) and keeps
the branch ``torch.where`` does not take finite, so its zero gradient stays zero, never NaN.
"""
from __future__ import annotations

import torch

from flexjit.ir import nodes as ir
from flexjit.ir.nodes import DType, Node, Op, build_binary, cast
from flexjit.frontend.proxy import (_HANDLERS, _TORCH_DTYPES, Proxy, _binary, _coerce, _Context,
                                    _find_ctx, _full_like, _index, _logic, _shift, _unary, _where)


def _h_unary(op):
    return lambda x, *a, **k: _unary(_find_ctx((x,), {}), op, x)


def _h_binary(op):
    def h(a, b, *rest, **kw):
        if rest or set(kw) - {"alpha"}:
            _find_ctx((a, b), {}).fail(f"unsupported extra arguments to {op.value}")
        if "alpha" in kw:
            b = b * kw["alpha"]
        return _binary(_find_ctx((a, b), {}), op, a, b)
    return h


def _h_logic(op):
    return lambda a, b: _logic(_find_ctx((a, b), {}), op, a, b)


def _h_shift(op, reflected=False):
    def h(a, b):
        if reflected:  # t.__rlshift__(x) is x << t
            a, b = b, a
        return _shift(_find_ctx((a, b), {}), op, a, b)
    return h


def _truth(ctx: _Context, x) -> Node:
    """``x`` as torch's logical ops read it: a bool, or ``x != 0``."""
    n = _coerce(ctx, x)
    return n if n.dtype is DType.BOOL else build_binary(Op.NE, n, ir.const(0, n.dtype))


def _h_logical(op):
    """torch.logical_and/or/xor: bool results of the operands' truth (not bitwise on ints)."""
    def h(a, b, **kw):
        ctx = _find_ctx((a, b), {})
        return Proxy(ir.node(op, DType.BOOL, (_truth(ctx, a), _truth(ctx, b))), ctx)
    return h


def _h_logical_not(x, **kw):
    ctx = _find_ctx((x,), {})
    return Proxy(ir.node(Op.NOT, DType.BOOL, (_truth(ctx, x),)), ctx)


def _h_sign(x, **kw):
    """torch.sign: -1, 0 or 1 in x's dtype (two comparisons: exact, no gradient)."""
    ctx = _find_ctx((x,), {})
    n = _coerce(ctx, x)
    if n.dtype is DType.BOOL:
        return Proxy(n, ctx)
    one, zero = ir.const(1, n.dtype), ir.const(0, n.dtype)
    neg = ir.node(Op.WHERE, n.dtype, (build_binary(Op.LT, n, zero), ir.const(-1, n.dtype), zero))
    return Proxy(ir.node(Op.WHERE, n.dtype, (build_binary(Op.GT, n, zero), one, neg)), ctx)


def _h_silu(x, inplace=False):
    """silu(x) = x * sigmoid(x)."""
    if inplace:
        _find_ctx((x,), {}).fail("an in-place silu", "use inplace=False")
    return x * _unary(_find_ctx((x,), {}), Op.SIGMOID, x)


def _h_round(x, *, decimals=0):
    if decimals:
        _find_ctx((x,), {}).fail("torch.round with decimals", "scale, round and scale back: "
                                 "torch.round(x * 100) / 100")
    return _unary(_find_ctx((x,), {}), Op.ROUND, x)


def _h_rbinary(op):
    return lambda a, b: _binary(_find_ctx((a, b), {}), op, b, a)


def _h_div(a, b, *, rounding_mode=None):
    ctx = _find_ctx((a, b), {})
    if rounding_mode is None:
        return _binary(ctx, Op.DIV, a, b)
    if rounding_mode == "floor":
        return _binary(ctx, Op.FLOORDIV, a, b)
    ctx.fail(f"division with rounding_mode={rounding_mode!r}", "use rounding_mode='floor' or //")


def _h_where(cond, a=None, b=None):
    ctx = _find_ctx((cond, a, b), {})
    if a is None:
        ctx.fail("single-argument torch.where (nonzero) is not supported")
    return _where(ctx, cond, a, b)


def _h_clamp(x, min=None, max=None):
    ctx = _find_ctx((x, min, max), {})
    out = x
    if min is not None:
        out = _binary(ctx, Op.MAX, out, min)
    if max is not None:
        out = _binary(ctx, Op.MIN, out, max)
    return out if isinstance(out, Proxy) else Proxy(_coerce(ctx, out), ctx)


def _h_minmax(op, name):
    def h(a, b=None, *rest, **kw):
        ctx = _find_ctx((a, b), kw)
        if b is None or (isinstance(b, int) and not isinstance(b, bool)) or rest or kw:
            ctx.fail(f"`{name}` as a reduction; a mod computes one element at a time",
                     f"use torch.{'maximum' if op is Op.MAX else 'minimum'}(a, b) for two values")
        return _binary(ctx, op, a, b)
    return h


def _h_cast(x, *args, **kwargs):
    ctx = _find_ctx((x,), {})
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
    if dtype is None:
        return x  # .to(device) and friends: a no-op for a traced scalar
    return _to_dtype(ctx, x, dtype)


def _to_dtype(ctx, x, dtype):
    if dtype in (torch.float16, torch.bfloat16, torch.float64):
        ctx.fail(f"cast to {dtype}: flexjit computes floating values in float32",
                 "use .float() / torch.float32")
    if dtype not in _TORCH_DTYPES:
        ctx.fail(f"cast to {dtype} is not supported")
    n = _coerce(ctx, x)
    target = _TORCH_DTYPES[dtype]
    if target is DType.BOOL and n.dtype is not DType.BOOL:
        return Proxy(ir.node(Op.NE, DType.BOOL, (n, ir.const(0, n.dtype))), ctx)
    return Proxy(cast(n, target), ctx)


def _method_cast(dtype):
    return lambda x, *a, **k: _to_dtype(_find_ctx((x,), {}), x, dtype)


def _h_getitem(t, idx):
    if isinstance(t, Proxy):
        t.ctx.fail("indexing a traced argument", "index captured tensors instead, e.g. bias[q_idx]")
    return _index(_find_ctx((idx,), {}), t, (), idx)


def _h_full_like(x, fill_value, *a, dtype=None, **k):
    return _full_like(x, fill_value, dtype)



def register():
    T = torch.Tensor
    unary = {
        Op.EXP: [torch.exp, T.exp], Op.EXP2: [torch.exp2, T.exp2, torch.special.exp2],
        Op.LOG: [torch.log, T.log], Op.LOG2: [torch.log2, T.log2], Op.TANH: [torch.tanh, T.tanh],
        Op.SIGMOID: [torch.sigmoid, T.sigmoid, torch.special.expit],
        Op.SQRT: [torch.sqrt, T.sqrt], Op.RSQRT: [torch.rsqrt, T.rsqrt],
        Op.SIN: [torch.sin, T.sin], Op.COS: [torch.cos, T.cos],
        Op.FLOOR: [torch.floor, T.floor], Op.CEIL: [torch.ceil, T.ceil],
        Op.ABS: [torch.abs, T.abs, T.__abs__], Op.NEG: [torch.neg, T.neg, T.__neg__, torch.negative],
        Op.NOT: [torch.bitwise_not, T.bitwise_not, T.__invert__],
        Op.TAN: [torch.tan, T.tan], Op.ATAN: [torch.atan, T.atan, torch.arctan, T.arctan],
        Op.SINH: [torch.sinh, T.sinh], Op.COSH: [torch.cosh, T.cosh],
        Op.ASIN: [torch.asin, T.asin, torch.arcsin, T.arcsin],
        Op.ACOS: [torch.acos, T.acos, torch.arccos, T.arccos],
        Op.LOG1P: [torch.log1p, T.log1p, torch.special.log1p],
        Op.EXPM1: [torch.expm1, T.expm1, torch.special.expm1],
        Op.ERF: [torch.erf, T.erf, torch.special.erf],
        Op.TRUNC: [torch.trunc, T.trunc, torch.fix, T.fix],
    }
    for op, funcs in unary.items():
        for f in funcs:
            _HANDLERS[f] = _h_unary(op)
    binary = {
        Op.ADD: [torch.add, T.add, T.__add__, T.__radd__], Op.SUB: [torch.sub, T.sub, T.__sub__, torch.subtract],
        Op.MUL: [torch.mul, T.mul, T.__mul__, T.__rmul__, torch.multiply],
        Op.DIV: [torch.true_divide, T.true_divide, T.__truediv__],
        Op.FLOORDIV: [torch.floor_divide, T.floor_divide, T.__floordiv__],
        Op.MOD: [torch.remainder, T.remainder, T.__mod__], Op.POW: [torch.pow, T.pow, T.__pow__],
        Op.MAX: [torch.maximum, T.maximum, torch.fmax], Op.MIN: [torch.minimum, T.minimum, torch.fmin],
        Op.LT: [torch.lt, T.lt, T.__lt__, torch.less], Op.LE: [torch.le, T.le, T.__le__],
        Op.GT: [torch.gt, T.gt, T.__gt__, torch.greater], Op.GE: [torch.ge, T.ge, T.__ge__],
        Op.EQ: [torch.eq, T.eq, T.__eq__], Op.NE: [torch.ne, T.ne, T.__ne__],
    }
    for op, funcs in binary.items():
        for f in funcs:
            _HANDLERS[f] = _h_binary(op)
    for op, funcs in {Op.AND: [torch.bitwise_and, T.bitwise_and, T.__and__, T.__rand__],
                      Op.OR: [torch.bitwise_or, T.bitwise_or, T.__or__, T.__ror__],
                      Op.XOR: [torch.bitwise_xor, T.bitwise_xor, T.__xor__, T.__rxor__]}.items():
        for f in funcs:
            _HANDLERS[f] = _h_logic(op)
    for op, funcs, reflected in ((Op.SHL, [torch.bitwise_left_shift, T.bitwise_left_shift, T.__lshift__],
                                  T.__rlshift__),
                                 (Op.SHR, [torch.bitwise_right_shift, T.bitwise_right_shift, T.__rshift__],
                                  T.__rrshift__)):
        for f in funcs:
            _HANDLERS[f] = _h_shift(op)
        _HANDLERS[reflected] = _h_shift(op, reflected=True)
    for op, funcs in {Op.AND: [torch.logical_and, T.logical_and], Op.OR: [torch.logical_or, T.logical_or],
                      Op.XOR: [torch.logical_xor, T.logical_xor]}.items():
        for f in funcs:
            _HANDLERS[f] = _h_logical(op)
    _HANDLERS[torch.logical_not] = _HANDLERS[T.logical_not] = _h_logical_not
    for f in [torch.sign, T.sign, torch.sgn, T.sgn]:
        _HANDLERS[f] = _h_sign
    _HANDLERS[torch.nn.functional.silu] = _h_silu
    _HANDLERS[torch.round] = _HANDLERS[T.round] = _h_round
    _HANDLERS[torch.fmod] = _HANDLERS[T.fmod] = _h_binary(Op.FMOD)
    for op, f in [(Op.SUB, T.__rsub__), (Op.DIV, T.__rtruediv__), (Op.FLOORDIV, T.__rfloordiv__),
                  (Op.MOD, T.__rmod__), (Op.POW, T.__rpow__)]:
        _HANDLERS[f] = _h_rbinary(op)
    for f in [torch.div, T.div, torch.divide]:
        _HANDLERS[f] = _h_div
    for f in [torch.where, T.where]:
        _HANDLERS[f] = _h_where
    for f in [torch.clamp, T.clamp, torch.clip, T.clip]:
        _HANDLERS[f] = _h_clamp
    _HANDLERS[torch.clamp_min] = _HANDLERS[T.clamp_min] = lambda x, m: _h_clamp(x, min=m)
    _HANDLERS[torch.clamp_max] = _HANDLERS[T.clamp_max] = lambda x, m: _h_clamp(x, max=m)
    for f in [torch.max, T.max]:
        _HANDLERS[f] = _h_minmax(Op.MAX, "max")
    for f in [torch.min, T.min]:
        _HANDLERS[f] = _h_minmax(Op.MIN, "min")
    _HANDLERS[T.to] = _HANDLERS[T.type] = _h_cast
    for name, dt in [("float", torch.float32), ("int", torch.int32), ("long", torch.int64),
                     ("bool", torch.bool), ("double", torch.float64), ("half", torch.float16),
                     ("bfloat16", torch.bfloat16)]:
        _HANDLERS[getattr(T, name)] = _method_cast(dt)
    _HANDLERS[T.__getitem__] = _h_getitem
    _HANDLERS[torch.full_like] = _h_full_like
    _HANDLERS[torch.zeros_like] = lambda x, *a, dtype=None, **k: _full_like(x, 0, dtype)
    _HANDLERS[torch.ones_like] = lambda x, *a, dtype=None, **k: _full_like(x, 1, dtype)
    _HANDLERS[T.detach] = _HANDLERS[T.contiguous] = _HANDLERS[T.clone] = lambda x, *a, **k: x


