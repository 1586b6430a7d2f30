"""The torch functions a mod may call, each as the IR it builds (``register`` fills
``proxy._HANDLERS``).

Most are compositions of IR ops (gelu of erf, softplus of log1p and exp, isnan as ``x != x``), so
the derivative, the interval rules and both renderers serve them unchanged; each composition
keeps torch's values at its edges (NaN in, NaN out; torch's subgradient at a kink) and keeps
the branch ``torch.where`` does not take finite, so its zero gradient stays zero, never NaN.
"""
from __future__ import annotations

import math

import torch

from flexjit.ir import nodes as ir
from flexjit.ir.nodes import DType, Node, Op, build_binary, cast
from flexjit.frontend.proxy import (_HANDLERS, _NARROW_FLOAT, _NARROW_INT, _TORCH_DTYPES, Proxy,
                                    _binary, _coerce, _Context, _convert, _find_ctx,
                                    _full_like, _index, _logic, _shift, _unary, _where, keeps_dtype)


def _h_unary(op):
    return keeps_dtype(lambda x, *a, **k: _unary(_find_ctx((x,), {}), op, x))


def _h_binary(op):
    @keeps_dtype
    def h(a, b, *rest, **kw):
        if rest or set(kw) - {"alpha"}:
            _find_ctx((a, b), {}).fail(f"unsupported extra arguments to {op.value}")
        if "alpha" in kw:
            b = b * kw["alpha"]
        return _binary(_find_ctx((a, b), {}), op, a, b)
    return h


def _h_logic(op):
    return keeps_dtype(lambda a, b: _logic(_find_ctx((a, b), {}), op, a, b))


def _h_shift(op, reflected=False):
    @keeps_dtype
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


# --------------------------------------------------------------------------- compositions


def _float(ctx: _Context, x) -> Proxy:
    return Proxy(cast(_coerce(ctx, x), DType.FLOAT32), ctx)


def _no_inplace(ctx: _Context, name: str, inplace: bool) -> None:
    if inplace:
        ctx.fail(f"an in-place {name}", "use inplace=False")


def _h_relu(x, inplace=False):
    """relu: 0 where x <= 0, else x (NaN stays NaN; the gradient at 0 is 0, as torch's)."""
    ctx = _find_ctx((x,), {})
    _no_inplace(ctx, "relu", inplace)
    return _where(ctx, _binary(ctx, Op.LE, x, 0), 0, x)


def _h_leaky_relu(x, negative_slope=0.01, inplace=False):
    ctx = _find_ctx((x,), {})
    _no_inplace(ctx, "leaky_relu", inplace)
    x = _float(ctx, x)
    return _where(ctx, x > 0, x, x * negative_slope)


def _hardtanh(ctx: _Context, x, lo, hi) -> Proxy:
    """lo below lo, hi above hi, x between; NaN stays NaN; no gradient at or past the bounds
    (torch's hardtanh_backward)."""
    return _where(ctx, _binary(ctx, Op.LE, x, lo), lo, _where(ctx, _binary(ctx, Op.GE, x, hi), hi, x))


def _h_hardtanh(x, min_val=-1.0, max_val=1.0, inplace=False):
    ctx = _find_ctx((x,), {})
    _no_inplace(ctx, "hardtanh", inplace)
    return _hardtanh(ctx, _float(ctx, x), float(min_val), float(max_val))


def _h_relu6(x, inplace=False):
    ctx = _find_ctx((x,), {})
    _no_inplace(ctx, "relu6", inplace)
    return _hardtanh(ctx, _float(ctx, x), 0.0, 6.0)


def _h_gelu(x, approximate="none"):
    """gelu as torch computes it: x·½(1 + erf(x/√2)), or with approximate="tanh"
    ½x(1 + tanh(√(2/π)(x + 0.044715x³)))."""
    ctx = _find_ctx((x,), {})
    x = _float(ctx, x)
    if approximate == "none":
        return x * 0.5 * (1.0 + _unary(ctx, Op.ERF, x * _SQRT1_2))
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))
        return 0.5 * x * (1.0 + _unary(ctx, Op.TANH, inner))
    ctx.fail(f"gelu with approximate={approximate!r}", "use approximate='none' or 'tanh'")


_SQRT1_2 = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654


def _softplus(ctx: _Context, x: Proxy, beta: float, threshold: float) -> Proxy:
    """log(1 + exp(βx))/β, and x where βx > threshold (torch's). The exp's argument is capped at
    the threshold, so the branch not taken stays finite and its zero gradient is not NaN."""
    xb = x * beta
    capped = _where(ctx, xb > threshold, threshold, xb)
    soft = _unary(ctx, Op.LOG1P, _unary(ctx, Op.EXP, capped))
    return _where(ctx, xb > threshold, x, soft if beta == 1 else soft / beta)


def _h_softplus(x, beta=1.0, threshold=20.0):
    ctx = _find_ctx((x,), {})
    return _softplus(ctx, _float(ctx, x), float(beta), float(threshold))


def _h_logsigmoid(x):
    """log(sigmoid(x)) = -softplus(-x), stable for large |x|."""
    ctx = _find_ctx((x,), {})
    return -_softplus(ctx, -_float(ctx, x), 1.0, 20.0)


def _h_mish(x, inplace=False):
    ctx = _find_ctx((x,), {})
    _no_inplace(ctx, "mish", inplace)
    x = _float(ctx, x)
    return x * _unary(ctx, Op.TANH, _softplus(ctx, x, 1.0, 20.0))


def _elu(ctx: _Context, x: Proxy, alpha: float, scale: float = 1.0, input_scale: float = 1.0) -> Proxy:
    """x·scale for x > 0, else α·scale·expm1(x·input_scale); the expm1 sees min(x, 0), so the
    branch not taken stays finite."""
    neg = _where(ctx, x > 0, 0.0, x)
    below = _unary(ctx, Op.EXPM1, neg * input_scale if input_scale != 1.0 else neg) * (alpha * scale)
    return _where(ctx, x > 0, x * scale if scale != 1.0 else x, below)


def _h_elu(x, alpha=1.0, inplace=False):
    ctx = _find_ctx((x,), {})
    _no_inplace(ctx, "elu", inplace)
    return _elu(ctx, _float(ctx, x), float(alpha))


def _h_celu(x, alpha=1.0, inplace=False):
    ctx = _find_ctx((x,), {})
    _no_inplace(ctx, "celu", inplace)
    return _elu(ctx, _float(ctx, x), float(alpha), input_scale=1.0 / float(alpha))


def _h_selu(x, inplace=False):
    ctx = _find_ctx((x,), {})
    _no_inplace(ctx, "selu", inplace)
    return _elu(ctx, _float(ctx, x), 1.6732632423543772848170429916717, 1.0507009873554804934193349852946)


def _h_hardsigmoid(x, inplace=False):
    """0 at or below -3, 1 at or above 3, x/6 + 1/2 between (gradient 1/6 strictly inside)."""
    ctx = _find_ctx((x,), {})
    _no_inplace(ctx, "hardsigmoid", inplace)
    x = _float(ctx, x)
    return _where(ctx, x <= -3.0, 0.0, _where(ctx, x >= 3.0, 1.0, x / 6.0 + 0.5))


def _h_hardswish(x, inplace=False):
    """0 below -3, x above 3, x(x + 3)/6 between, the bounds included (torch's gradient there)."""
    ctx = _find_ctx((x,), {})
    _no_inplace(ctx, "hardswish", inplace)
    x = _float(ctx, x)
    return _where(ctx, x < -3.0, 0.0, _where(ctx, x <= 3.0, x * (x + 3.0) / 6.0, x))


def _h_square(x):
    return x * x


def _h_reciprocal(x):
    ctx = _find_ctx((x,), {})
    return _binary(ctx, Op.DIV, 1.0, x)


def _h_rsub(a, b, alpha=1):
    ctx = _find_ctx((a, b), {})
    return _binary(ctx, Op.SUB, b, a * alpha if alpha != 1 else a)


def _h_erfc(x):
    ctx = _find_ctx((x,), {})
    return 1.0 - _unary(ctx, Op.ERF, x)


def _h_lerp(start, end, weight):
    """start + w·(end - start) for |w| < 1/2, else end - (end - start)·(1 - w): torch's two forms,
    exact at both ends (w = 0 gives start, w = 1 gives end)."""
    ctx = _find_ctx((start, end, weight), {})
    start, end = _float(ctx, start), _float(ctx, end)
    diff = end - start
    low, high = start + weight * diff, end - diff * (1.0 - weight)
    if isinstance(weight, (int, float)):
        return low if abs(weight) < 0.5 else high
    return _where(ctx, _unary(ctx, Op.ABS, weight) < 0.5, low, high)


def _h_addcmul(x, t1, t2, *, value=1):
    return x + value * t1 * t2 if value != 1 else x + t1 * t2


def _h_addcdiv(x, t1, t2, *, value=1):
    ctx = _find_ctx((x, t1, t2), {})
    return x + value * _binary(ctx, Op.DIV, t1, t2)


def _h_masked_fill(x, mask, value):
    """torch's masked_fill: value where mask, else x, in x's dtype."""
    ctx = _find_ctx((x, mask, value), {})
    n = _coerce(ctx, x)
    if _coerce(ctx, mask).dtype is not DType.BOOL:
        ctx.fail("masked_fill needs a bool mask", "compare first, e.g. x.masked_fill(q_idx < kv_idx, 0.0)")
    v = _coerce(ctx, value, n.dtype)
    return Proxy(ir.node(Op.WHERE, n.dtype, (_coerce(ctx, mask), cast(v, n.dtype), n)), ctx)


def _h_isnan(x):
    ctx = _find_ctx((x,), {})
    n = _coerce(ctx, x)
    if not n.dtype.is_float:
        return Proxy(ir.const(False), ctx)
    return Proxy(ir.node(Op.NE, DType.BOOL, (n, n)), ctx)


def _infinite(ctx: _Context, x, sign: int) -> Proxy:
    """x is +inf (sign 1), -inf (-1) or either (0)."""
    n = _coerce(ctx, x)
    if not n.dtype.is_float:
        return Proxy(ir.const(False), ctx)
    if sign == 0:
        n = ir.node(Op.ABS, DType.FLOAT32, (n,))
    return Proxy(ir.node(Op.EQ, DType.BOOL, (n, ir.const(float("-inf") if sign < 0 else float("inf")))), ctx)


def _h_isfinite(x):
    ctx = _find_ctx((x,), {})
    if not _coerce(ctx, x).dtype.is_float:
        return Proxy(ir.const(True), ctx)
    return ~(_h_isnan(x) | _infinite(ctx, x, 0))


def _h_nan_to_num(x, nan=0.0, posinf=None, neginf=None):
    """NaN, +inf and -inf replaced (by default 0 and float32's largest finite values: the mod's
    floats are float32); the gradient flows where x is finite, as torch's."""
    ctx = _find_ctx((x,), {})
    n = _coerce(ctx, x)
    if not n.dtype.is_float:
        return Proxy(n, ctx)
    big = torch.finfo(torch.float32).max
    out = _where(ctx, _infinite(ctx, x, -1), -big if neginf is None else neginf, x)
    out = _where(ctx, _infinite(ctx, x, 1), big if posinf is None else posinf, out)
    return _where(ctx, _h_isnan(x), 0.0 if nan is None else nan, out)


def _h_isin(elements, test_elements, *, assume_unique=False, invert=False):
    """Whether the traced value equals any element of a captured tensor (or a Python list): one
    comparison per element, read at run time, so a new content needs no new kernel."""
    ctx = _find_ctx((elements, test_elements), {})
    if not isinstance(elements, Proxy):
        ctx.fail("torch.isin with a traced value as the test elements",
                 "test the traced value against a captured tensor: torch.isin(kv_idx, ids)")
    if isinstance(test_elements, torch.Tensor):
        n = test_elements.numel()
        if n > _ISIN_MAX:
            ctx.fail(f"torch.isin against a captured tensor of {n} elements; at most {_ISIN_MAX} are "
                     "compared per element",
                     "build a lookup table outside the mod, e.g. table = torch.zeros(n, dtype=torch.bool); "
                     "table[ids] = True; then use table[kv_idx]")
        items = [_index(ctx, test_elements, (), _unravel(j, test_elements.shape)) if test_elements.dim()
                 else test_elements for j in range(n)]
    elif isinstance(test_elements, (list, tuple)):
        items = list(test_elements)
    else:
        items = [test_elements]
    hit = Proxy(ir.const(False), ctx)
    for item in items:
        hit = _logic(ctx, Op.OR, hit, _binary(ctx, Op.EQ, elements, item))
    return ~hit if invert else hit


# Elements of an isin test set compared one by one: as many as a row of a captured tensor.
_ISIN_MAX = 64


def _unravel(j: int, shape) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        j, r = divmod(j, size)
        out.append(r)
    return tuple(reversed(out))


def _h_deg2rad(x):
    """x·(π/180), the constant rounded to the working precision as torch's scalar is."""
    return _float(_find_ctx((x,), {}), x) * (math.pi / 180.0)


def _h_rad2deg(x):
    return _float(_find_ctx((x,), {}), x) * (180.0 / math.pi)


def _h_hypot(x, y):
    """√(x² + y²) without overflow or underflow: both scaled by a power of two (exact) when the
    larger magnitude is past 2^±50, so the squares stay normal float32 values; exact where the
    squares and their sum are (3, 4 gives 5, as a mask's integer radius needs), within an ulp of
    torch's correctly rounded hypot elsewhere. ±inf wins over NaN, as C's hypot."""
    ctx = _find_ctx((x, y), {})
    ax, ay = _unary(ctx, Op.ABS, _float(ctx, x)), _unary(ctx, Op.ABS, _float(ctx, y))
    big = _binary(ctx, Op.MAX, ax, ay)
    high, low = big > _HYPOT_EDGE, big < 1.0 / _HYPOT_EDGE
    scale = _where(ctx, high, 2.0 ** -70, _where(ctx, low, 2.0 ** 70, 1.0))
    unscale = _where(ctx, high, 2.0 ** 70, _where(ctx, low, 2.0 ** -70, 1.0))
    sx, sy = ax * scale, ay * scale
    h = _unary(ctx, Op.SQRT, sx * sx + sy * sy) * unscale
    return _where(ctx, (ax == math.inf) | (ay == math.inf), math.inf, h)


_HYPOT_EDGE = 2.0 ** 50


def _logaddexp(ctx: _Context, a, b, base2: bool) -> Proxy:
    """torch's logaddexp(2): max(a, b) + log1p(exp(-|a - b|)) (exp2, and the log in base 2), and
    a itself where a and b are the same infinity. There the difference is taken as 0, so the
    branch not taken stays finite and the gradient is max's tie split, ½ each (torch's is NaN)."""
    a, b = _float(ctx, a), _float(ctx, b)
    same_inf = (_unary(ctx, Op.ABS, a) == math.inf) & (a == b)
    top = _binary(ctx, Op.MAX, a, b)
    gap = -_unary(ctx, Op.ABS, _where(ctx, same_inf, 0.0, a - b))
    tail = _unary(ctx, Op.LOG1P, _unary(ctx, Op.EXP2 if base2 else Op.EXP, gap))
    return _where(ctx, same_inf, top, top + (tail * (1.0 / _LN2) if base2 else tail))


_LN2 = math.log(2.0)


def _h_logaddexp(a, b):
    return _logaddexp(_find_ctx((a, b), {}), a, b, base2=False)


def _h_logaddexp2(a, b):
    return _logaddexp(_find_ctx((a, b), {}), a, b, base2=True)


def _xlogy(ctx: _Context, x, y, log_op: Op, pole: float) -> Proxy:
    """torch's xlogy (log_op LOG, pole 0) and xlog1py (LOG1P, pole -1): 0 where x == 0 and y is
    not NaN, else x·log(y). Gradients as torch's: d/dx is log(y), 0 where x == 0 and y is at or
    below the pole; d/dy is x/y. Each branch sees a finite log where it is not taken."""
    x, y = _float(ctx, x), _float(ctx, y)
    zero_x = (x == 0.0) & ~_h_isnan(y)
    finite = (y > pole) & (y < math.inf)  # log(y) finite: where x == 0 it is d/dx
    at_zero = _where(ctx, finite, _unary(ctx, log_op, _where(ctx, finite, y, pole + 1.0)), 0.0)
    elsewhere = _unary(ctx, log_op, _where(ctx, zero_x, pole + 1.0, y))
    return _where(ctx, zero_x, _where(ctx, zero_x, x, 0.0) * at_zero, x * elsewhere)


def _h_xlogy(x, y):
    return _xlogy(_find_ctx((x, y), {}), x, y, Op.LOG, 0.0)


def _h_xlog1py(x, y):
    return _xlogy(_find_ctx((x, y), {}), x, y, Op.LOG1P, -1.0)


def _h_heaviside(x, values):
    """0 where x < 0, ``values`` where x == 0, 1 where x > 0 (and 0 for NaN), in the operands'
    dtype. torch has no derivative for it; here d/dx is 0 (the step's, almost everywhere) and
    d/dvalues flows where x == 0."""
    ctx = _find_ctx((x, values), {})
    n = _coerce(ctx, x)
    if n.dtype is DType.BOOL:
        ctx.fail("torch.heaviside of a bool", "compare instead, e.g. torch.where(x, 1, values)")
    one, zero = (Proxy(ir.const(v, n.dtype), ctx) for v in (1, 0))
    step = _where(ctx, _binary(ctx, Op.GT, x, 0), one, zero)
    return _where(ctx, _binary(ctx, Op.EQ, x, 0), values, step)


def _h_logit(x, eps=None):
    """log(x / (1 - x)), x first clamped into [eps, 1 - eps] when eps is given and not negative
    (NaN passes; no gradient outside the bounds, a gradient at them), as torch's."""
    ctx = _find_ctx((x,), {})
    x = _float(ctx, x)
    if eps is not None and eps >= 0:
        lo, hi = eps, 1.0 - eps
        x = _where(ctx, x < lo, lo, _where(ctx, x > hi, hi, x))
    return _unary(ctx, Op.LOG, x / (1.0 - x))


# --------------------------------------------------------------------------- constants


def _created_inside(ctx: _Context, what: str):
    ctx.fail(f"a tensor is created inside the mod ({what})",
             "a mod works on one element: use a Python number or a 0-d tensor (torch.tensor(c)), or "
             "create the tensor outside the mod and capture it")


def _h_constant(func, data_arg: int | None):
    """torch.tensor(c), torch.full((), c), torch.zeros(()), ... inside a mod: one element, a
    constant of the IR (torch's dtype; an integer one weakly typed, as a Python int, unless a
    dtype is given). ``data_arg``: the position of the value argument, which may be traced
    (``torch.tensor(x)`` of a captured number is that number)."""
    name = f"torch.{func.__name__}"

    def h(*args, **kwargs):
        ctx = _find_ctx(args, kwargs)
        dtype = kwargs.get("dtype")
        data = args[data_arg] if data_arg is not None and len(args) > data_arg else kwargs.get("fill_value")
        if isinstance(data, Proxy):
            if func is torch.full and tuple(args[0]) not in ((), (1,)):
                _created_inside(ctx, f"{name} of shape {tuple(args[0])}")
            return _to_dtype(ctx, data, dtype) if dtype is not None else data
        if any(isinstance(x, Proxy) for x in list(args) + list(kwargs.values())):
            _created_inside(ctx, f"{name} of traced values")
        t = func(*args, **kwargs)  # a real tensor: the mode is off inside its handler
        if t.numel() != 1 or t.dim() > 1:
            _created_inside(ctx, f"{name} of shape {tuple(t.shape)}")
        dt = _TORCH_DTYPES.get(t.dtype)
        if dt is None:
            ctx.fail(f"{name} of dtype {t.dtype} inside a mod", "use a bool, integer or floating constant")
        value = t.item()
        if dt.is_int and dtype is None:
            return Proxy(ir.const(int(value)), ctx)
        narrow = t.dtype if t.dtype in _NARROW_FLOAT or t.dtype in _NARROW_INT else None
        return Proxy(ir.const(value, dt), ctx, narrow)
    return h


def _h_like(value):
    """zeros_like / ones_like / full_like of a traced value: a constant in its dtype."""
    def h(x, *args, dtype=None, **kwargs):
        fill = value if value is not None else (args[0] if args else kwargs.get("fill_value"))
        if not isinstance(x, Proxy):
            _created_inside(_find_ctx((x, fill), {}), "a *_like of a captured tensor")
        return _full_like(x, fill, dtype)
    return h


def _h_rbinary(op):
    return keeps_dtype(lambda a, b: _binary(_find_ctx((a, b), {}), op, b, a))


def _h_div(a, b, *, rounding_mode=None):
    ctx = _find_ctx((a, b), {})
    if rounding_mode is None:
        return _binary(ctx, Op.DIV, a, b)
    if rounding_mode == "floor":
        return _binary(ctx, Op.FLOORDIV, a, b)
    if rounding_mode == "trunc":
        return _trunc_div(ctx, a, b)
    ctx.fail(f"division with rounding_mode={rounding_mode!r}", "use rounding_mode='floor', 'trunc' or None")


def _trunc_div(ctx: _Context, a, b) -> Proxy:
    """torch.div(a, b, rounding_mode="trunc"): the quotient rounded toward zero. Floats: trunc of
    the true quotient, as torch computes it. Integers: the floor quotient, plus one where it is
    inexact and negative (the operands' signs differ), which never leaves the operands' range."""
    na, nb = _coerce(ctx, a), _coerce(ctx, b)
    if na.dtype.is_float or nb.dtype.is_float:
        return _unary(ctx, Op.TRUNC, _binary(ctx, Op.DIV, a, b))
    q = _binary(ctx, Op.FLOORDIV, a, b)
    inexact = _binary(ctx, Op.NE, _binary(ctx, Op.MOD, a, b), 0)
    negative = _binary(ctx, Op.NE, _binary(ctx, Op.LT, a, 0), _binary(ctx, Op.LT, b, 0))
    return _where(ctx, _logic(ctx, Op.AND, inexact, negative), _binary(ctx, Op.ADD, q, 1), q)


@keeps_dtype
def _h_where(cond, a=None, b=None):
    ctx = _find_ctx((cond, a, b), {})
    if a is None:
        ctx.fail("single-argument torch.where (nonzero) is not supported")
    return _where(ctx, cond, a, b)


@keeps_dtype
def _h_clamp(x, min=None, max=None):
    ctx = _find_ctx((x, min, max), {})
    out = x
    if min is not None:
        out = _binary(ctx, Op.MAX, out, min)
    if max is not None:
        out = _binary(ctx, Op.MIN, out, max)
    return out if isinstance(out, Proxy) else Proxy(_coerce(ctx, out), ctx)


def _h_minmax(op, name):
    @keeps_dtype
    def h(a, b=None, *rest, **kw):
        ctx = _find_ctx((a, b), kw)
        if b is None or (isinstance(b, int) and not isinstance(b, bool)) or rest or kw:
            ctx.fail(f"`{name}` as a reduction; a mod computes one element at a time",
                     f"use torch.{'maximum' if op is Op.MAX else 'minimum'}(a, b) for two values")
        return _binary(ctx, op, a, b)
    return h


@keeps_dtype
def _h_cast(x, *args, **kwargs):
    """Tensor.to: a dtype given directly, by keyword or as another tensor's (``.to(bias)``); a
    device alone is a no-op for a traced value."""
    ctx = _find_ctx((x,), {})
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (Proxy, torch.Tensor)):
            dtype = a.dtype
    if dtype is None:
        return x
    return _to_dtype(ctx, x, dtype)


@keeps_dtype
def _h_type(x, dtype=None, non_blocking=False, **kwargs):
    """Tensor.type: with no dtype the type's name (``'torch.FloatTensor'``), else a cast to a dtype
    or to a named tensor type (``'torch.HalfTensor'``)."""
    ctx = _find_ctx((x,), {})
    if dtype is None:
        return {torch.float32: "torch.FloatTensor", torch.float16: "torch.HalfTensor",
                torch.bfloat16: "torch.BFloat16Tensor", torch.int32: "torch.IntTensor",
                torch.int64: "torch.LongTensor", torch.int16: "torch.ShortTensor",
                torch.int8: "torch.CharTensor", torch.uint8: "torch.ByteTensor",
                torch.bool: "torch.BoolTensor"}[x.dtype]
    if isinstance(dtype, str):
        named = {f"torch.{n}Tensor": d for n, d in (
            ("Float", torch.float32), ("Double", torch.float64), ("Half", torch.float16),
            ("BFloat16", torch.bfloat16), ("Int", torch.int32), ("Long", torch.int64),
            ("Short", torch.int16), ("Char", torch.int8), ("Byte", torch.uint8), ("Bool", torch.bool))}
        found = named.get(dtype.replace("torch.cuda.", "torch."))
        if found is None:
            ctx.fail(f"Tensor.type({dtype!r}) inside a mod", "cast to a dtype, e.g. .to(torch.float16)")
        dtype = found
    return _to_dtype(ctx, x, dtype)


def _to_dtype(ctx, x, dtype):
    """A cast as torch computes it: float16/bfloat16 round to nearest even, int8/int16/uint8 wrap,
    floats truncate toward zero into integers; the value then has that dtype (``Proxy.low``)."""
    if dtype is torch.float64:
        ctx.fail("a cast to torch.float64: flexjit computes a mod's floating values in float32 "
                 "(float64 only for float64 inputs) and cannot keep a float64 value in a kernel",
                 "drop the cast, or use .float()")
    if dtype not in _TORCH_DTYPES:
        ctx.fail(f"a cast to {dtype} inside a mod is not supported",
                 "cast to a float (float32, float16, bfloat16), an integer (int64, int32, int16, int8, "
                 "uint8) or bool")
    if isinstance(x, Proxy) and x.low is dtype:
        return x
    return _convert(ctx, _coerce(ctx, x), dtype)


def _method_cast(dtype):
    return keeps_dtype(lambda x, *a, **k: _to_dtype(_find_ctx((x,), {}), x, dtype))


def _h_getitem(t, idx):
    if isinstance(t, Proxy):
        t.ctx.fail("indexing a traced argument", "index captured tensors instead, e.g. bias[q_idx]")
    return _index(_find_ctx((idx,), {}), t, (), idx)



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
        Op.ATAN2: [torch.atan2, T.atan2, torch.arctan2, T.arctan2],
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
    _HANDLERS[T.to] = _h_cast
    _HANDLERS[T.type] = _h_type
    for name, dt in [("float", torch.float32), ("int", torch.int32), ("long", torch.int64),
                     ("bool", torch.bool), ("double", torch.float64), ("half", torch.float16),
                     ("bfloat16", torch.bfloat16), ("short", torch.int16), ("char", torch.int8),
                     ("byte", torch.uint8)]:
        _HANDLERS[getattr(T, name)] = _method_cast(dt)
    _HANDLERS[T.__getitem__] = _h_getitem
    _HANDLERS[torch.full_like] = _h_like(None)
    _HANDLERS[torch.zeros_like] = _h_like(0)
    _HANDLERS[torch.ones_like] = _h_like(1)
    for f, data in [(torch.tensor, 0), (torch.as_tensor, 0), (torch.scalar_tensor, 0), (torch.full, 1),
                    (torch.zeros, None), (torch.ones, None)]:
        _HANDLERS[f] = _h_constant(f, data)
    _register_compositions()
    _HANDLERS[T.detach] = _HANDLERS[T.contiguous] = _HANDLERS[T.clone] = lambda x, *a, **k: x




def _torch_names(name: str) -> list:
    """Every object a mod may call for torch's ``name``: torch.nn.functional's, torch's, the
    Tensor method and the ATen binding F's may forward to (what __torch_function__ receives)."""
    F = torch.nn.functional
    found = []
    for owner in (F, torch, torch.Tensor, torch._C._nn, torch.special):
        f = getattr(owner, name, None)
        if f is not None and f not in found:
            found.append(f)
    return found


def _register_compositions():
    table = {
        "relu": _h_relu, "leaky_relu": _h_leaky_relu, "hardtanh": _h_hardtanh, "relu6": _h_relu6,
        "gelu": _h_gelu, "softplus": _h_softplus, "logsigmoid": _h_logsigmoid,
        "log_sigmoid": _h_logsigmoid, "mish": _h_mish, "elu": _h_elu, "celu": _h_celu,
        "selu": _h_selu, "hardsigmoid": _h_hardsigmoid, "hardswish": _h_hardswish,
        "square": _h_square, "reciprocal": _h_reciprocal, "rsub": _h_rsub, "erfc": _h_erfc,
        "lerp": _h_lerp, "addcmul": _h_addcmul, "addcdiv": _h_addcdiv, "masked_fill": _h_masked_fill,
        "isnan": _h_isnan, "isinf": lambda x: _infinite(_find_ctx((x,), {}), x, 0),
        "isposinf": lambda x: _infinite(_find_ctx((x,), {}), x, 1),
        "isneginf": lambda x: _infinite(_find_ctx((x,), {}), x, -1),
        "isfinite": _h_isfinite, "nan_to_num": _h_nan_to_num, "isin": _h_isin,
        "deg2rad": _h_deg2rad, "rad2deg": _h_rad2deg, "hypot": _h_hypot, "logaddexp": _h_logaddexp,
        "logaddexp2": _h_logaddexp2, "xlogy": _h_xlogy, "xlog1py": _h_xlog1py,
        "heaviside": _h_heaviside, "logit": _h_logit,
    }
    for name, handler in table.items():
        for f in _torch_names(name):
            _HANDLERS[f] = handler
