"""Traced values: the proxies a mod runs on, and how one torch call on them becomes IR.

* :class:`_Context`: one trace's state (captured buffers and scalars, the mod's name) and its
  errors (:class:`TraceError`, naming the user's line).
* :class:`Proxy`: one traced element; Python operators on it build IR nodes. :class:`BufferView`
  (a captured tensor indexed in some dimensions) and :class:`Vector` (a short row of values,
  ``pos[q_idx]``) stand for what is not yet one element.
* ``_dispatch``: a torch call made while tracing, routed to its entry in ``_HANDLERS`` (filled by
  ``frontend/torch_ops.py``), mapped over rows, or refused with the reason and what to write.
"""
from __future__ import annotations

import inspect
import linecache
import os
from typing import Any, Callable

import torch

from flexjit.ir import nodes as ir
from flexjit.ir.nodes import DType, Node, Op, build_binary, cast
from flexjit.ir.interp import eval_constant

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))

_TORCH_DTYPES = {
    torch.bool: DType.BOOL, torch.int32: DType.INT32, torch.int64: DType.INT64,
    torch.int16: DType.INT32, torch.int8: DType.INT32, torch.uint8: DType.INT32,
    torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT32, torch.bfloat16: DType.FLOAT32,
    torch.float64: DType.FLOAT32,
}
_IR_TO_TORCH = {DType.BOOL: torch.bool, DType.INT32: torch.int32, DType.INT64: torch.int64,
                DType.FLOAT32: torch.float32}


class TraceError(RuntimeError):
    """A mod that flexjit cannot turn into a kernel. The message says where and why. A
    RuntimeError, as torch's errors for a mod it cannot trace (vmap's, dynamo's ``Unsupported``)
    are, so that code catching those catches this."""


# --------------------------------------------------------------------------- context


class _Context:
    """State of one trace: captured buffers/scalars and the mod's identity for errors."""

    def __init__(self, fn: Callable, kind: str):
        self.fn = fn
        self.kind = kind
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self.buffers: list[torch.Tensor] = []
        self._buffer_ids: dict[int, int] = {}
        self.scalars: list[float | int] = []
        self._scalar_ids: dict[tuple[int, int], Proxy] = {}

    def buffer(self, t: torch.Tensor) -> Node:
        if t.dtype not in _TORCH_DTYPES or t.is_complex():
            self.fail(f"captured tensor of dtype {t.dtype} is not supported",
                      "use a bool, integer or floating tensor")
        if t.dim() > 4:
            self.fail(f"captured tensor has {t.dim()} dimensions; at most 4 are supported",
                      "reshape it to 4-D or fewer outside the mod")
        slot = self._buffer_ids.get(id(t))
        if slot is None:
            slot = len(self.buffers)
            self.buffers.append(t)
            self._buffer_ids[id(t)] = slot
        storage = str(t.dtype).replace("torch.", "")
        return ir.node(Op.BUFFER, DType.VOID, (), (slot, t.dim(), storage))

    def scalar(self, value: float | int, key: tuple[int, int]) -> "Proxy":
        """A captured Python number, one slot per (container, name) it was found in."""
        found = self._scalar_ids.get(key)
        if found is None:
            slot = len(self.scalars)
            self.scalars.append(value)
            found = Proxy(ir.node(Op.SCALAR, ir.dtype_of_python(value), (), slot), self)
            self._scalar_ids[key] = found
        return found

    def fail(self, reason: str, hint: str | None = None):
        raise TraceError(self.describe(reason, hint))

    def describe(self, reason: str, hint: str | None = None, tb=None) -> str:
        where = _user_frame_in_traceback(tb) if tb is not None else _user_frame()
        msg = f"cannot trace {self.kind} `{self.name}`"
        if where is not None:
            filename, lineno = where
            src = linecache.getline(filename, lineno).strip()
            msg += f" at {filename}:{lineno}\n    {src}"
        msg += f"\n{reason}"
        if hint:
            msg += f"\nhint: {hint}"
        return msg


def _is_user_file(filename: str) -> bool:
    filename = os.path.abspath(filename)
    return not (filename.startswith(_PKG_DIR) or filename.startswith(_TORCH_DIR)
                or "<frozen" in filename)


def _user_frame() -> tuple[str, int] | None:
    """Innermost frame on the current stack that is neither flexjit's nor torch's own code."""
    f = inspect.currentframe()
    while f is not None:
        if _is_user_file(f.f_code.co_filename):
            return f.f_code.co_filename, f.f_lineno
        f = f.f_back
    return None


def _user_frame_in_traceback(tb) -> tuple[str, int] | None:
    """Innermost user frame of an exception's traceback (where the user's code raised)."""
    found = None
    while tb is not None:
        if _is_user_file(tb.tb_frame.f_code.co_filename):
            found = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


# --------------------------------------------------------------------------- proxy


def _coerce(ctx: _Context, x, like: DType | None = None) -> Node:
    """Turn an operand into a node. Python numbers are weakly typed: they take
    the kind of the other operand where that does not lose information."""
    if isinstance(x, Proxy):
        return x.node
    if isinstance(x, Vector) or (isinstance(x, BufferView) and x.row() is not None):
        n = len(x.items) if isinstance(x, Vector) else x.tensor.shape[-1]
        ctx.fail(f"a row of {n} values where one value is needed",
                 "reduce the row first, e.g. (pos[q_idx] - pos[kv_idx]).pow(2).sum(-1)")
    if isinstance(x, BufferView):
        given = [_index_label(n) for n in x.index]
        ctx.fail(f"a captured tensor of {x.tensor.dim()} dimensions was indexed with {len(given)}, not down "
                 "to one element", f"index every dimension at once, e.g. t[{', '.join(given + ['i'] * x.ndim)}]")
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            return ir.node(Op.LOAD, _TORCH_DTYPES[x.dtype], (ctx.buffer(x),))
        ctx.fail(f"a captured tensor of shape {tuple(x.shape)} was used in arithmetic directly",
                 "index it with the traced indices, e.g. bias[h, q_idx, kv_idx]")
    if isinstance(x, (bool, int, float)):
        if isinstance(x, bool):
            return ir.const(x)
        if isinstance(x, int):
            if like is not None and like.is_float:
                return ir.const(float(x), DType.FLOAT32)
            if like is DType.INT64:
                return ir.const(x, DType.INT64)
            return ir.const(x)
        return ir.const(x, DType.FLOAT32)
    ctx.fail(f"value of type {type(x).__name__} cannot be used in a mod",
             "use Python numbers, the traced arguments, or captured tensors")


def _index_label(n: Node) -> str:
    """How an index appears in a hint: the traced argument's name, a literal, else ``...``."""
    if n.op in ir.INDEX_LEAVES:
        return n.op.value
    if n.op is Op.CONST:
        return repr(n.arg)
    return "..."


# --------------------------------------------------------------------------- narrow dtypes

# torch dtypes narrower than the IR's float32 and int32. A traced value of one (after a cast, or
# an op torch computes in it) holds a value of that dtype, and every op on it rounds (floats) or
# wraps (integers) its result into it, as torch does. Captured tensors of these dtypes widen on
# load instead: they are float32 and int32 values.
_NARROW_FLOAT = {torch.float16: Op.ROUND_F16, torch.bfloat16: Op.ROUND_BF16}
_NARROW_INT = {torch.int8: (8, True), torch.int16: (16, True), torch.uint8: (8, False)}


def _is_narrow(x) -> bool:
    return isinstance(x, Proxy) and x.low is not None


def _common_dtype(args) -> torch.dtype | None:
    """torch's common dtype of an elementwise op's operands where it is a narrow one, else None.
    Traced values are 0-d tensors and Python numbers scalars (torch's rules: a number raises the
    result only to its category's default dtype); anything else counts in the IR's dtypes."""
    if not any(_is_narrow(x) for x in args):
        return None
    tensors, numbers = [], []
    for x in args:
        if isinstance(x, Proxy):
            tensors.append(x.dtype)
        elif isinstance(x, (bool, int, float)):
            numbers.append(x)
        elif isinstance(x, torch.Tensor) and x.dtype in _TORCH_DTYPES:
            tensors.append(_IR_TO_TORCH[_TORCH_DTYPES[x.dtype]])
        elif isinstance(x, (Vector, BufferView)):
            tensors.append(torch.float32)
    common = tensors[0]
    for d in tensors[1:]:
        common = torch.promote_types(common, d)
    for v in numbers:
        kind = 2 if isinstance(v, float) else 1 if not isinstance(v, bool) else 0
        have = 2 if common.is_floating_point else 0 if common is torch.bool else 1
        if kind > have:
            common = torch.float32 if kind == 2 else torch.int64
    return common if common in _NARROW_FLOAT or common in _NARROW_INT else None


def _number_in(value, dtype: torch.dtype):
    """A Python number as torch converts it to ``dtype`` (rounded or wrapped)."""
    with torch._C.DisableTorchFunction():  # our own conversion is not the user's code
        return torch.tensor(value).to(dtype).item()


def _plain(x):
    """A narrow traced value as its IR value (the op is then computed in float32/int32)."""
    return Proxy(x.node, x.ctx) if _is_narrow(x) else x


def _convert(ctx: _Context, n: Node, dtype: torch.dtype) -> "Proxy":
    """``n`` converted to the torch dtype ``dtype`` as torch converts: floats truncate toward zero
    into integers, and a narrow dtype rounds (to nearest even) or wraps (two's complement)."""
    if dtype in _NARROW_FLOAT:
        return Proxy(ir.node(_NARROW_FLOAT[dtype], DType.FLOAT32, (cast(n, DType.FLOAT32),)), ctx, dtype)
    if dtype in _NARROW_INT:
        bits, signed = _NARROW_INT[dtype]
        n = cast(n, DType.INT32) if not n.dtype.is_int else n
        mask, half = ir.const((1 << bits) - 1, n.dtype), ir.const(1 << (bits - 1), n.dtype)
        if signed:
            n = build_binary(Op.SUB, build_binary(Op.AND, build_binary(Op.ADD, n, half), mask), half)
        else:
            n = build_binary(Op.AND, n, mask)
        return Proxy(cast(n, DType.INT32), ctx, dtype)
    target = _TORCH_DTYPES[dtype]
    if target is DType.BOOL and n.dtype is not DType.BOOL:
        return Proxy(ir.node(Op.NE, DType.BOOL, (n, ir.const(0, n.dtype))), ctx)
    return Proxy(cast(n, target), ctx)


def _in_common(ctx: _Context, common: torch.dtype, args) -> list:
    """The operands as torch converts them to the narrow ``common`` dtype before an op: traced
    values of another dtype and Python numbers converted into it."""
    out = []
    for x in args:
        if isinstance(x, Proxy) and x.low is not common:
            x = _convert(ctx, x.node, common)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            x = _number_in(x, common)
        out.append(_plain(x))
    return out


def _narrow_binary(ctx: _Context, op: Op, a, b) -> "Proxy":
    """A binary op with a narrow operand, as torch's flex_attention runs a mod (vmap): the
    operands converted to the common dtype, Python numbers included, then the op in float32 and
    its result rounded (or wrapped) once. ``number / t`` is ``t.reciprocal() * number``, torch's
    Tensor.__rtruediv__."""
    common = _common_dtype((a, b))
    if common is None:
        return _binary(ctx, op, _plain(a), _plain(b))
    if op is Op.DIV and isinstance(a, (int, float)) and common in _NARROW_FLOAT:
        return _binary(ctx, Op.MUL, _narrowed(ctx, _binary(ctx, Op.DIV, 1.0, _plain(b)), common), a)
    a, b = _in_common(ctx, common, (a, b))
    return _narrowed(ctx, _binary(ctx, op, a, b), common)


def _narrowed(ctx: _Context, result, common: torch.dtype | None):
    """An op's result as torch's value of dtype ``common``: a float result rounded into a narrow
    float, an integer result wrapped into a narrow integer; other results as they are."""
    if common is None or not isinstance(result, Proxy):
        return result
    float_result = result.node.dtype.is_float
    if (float_result and common in _NARROW_FLOAT) or (result.node.dtype.is_int and common in _NARROW_INT):
        return _convert(ctx, result.node, common)
    return result


def _binary(ctx: _Context, op: Op, a, b) -> "Proxy":
    if _is_row(a) or _is_row(b):
        return _map(ctx, lambda x, y: _binary(ctx, op, x, y), a, b)
    if _is_narrow(a) or _is_narrow(b):
        return _narrow_binary(ctx, op, a, b)
    like = next((x.node.dtype for x in (a, b) if isinstance(x, Proxy)), None)
    na, nb = _coerce(ctx, a, like), _coerce(ctx, b, like)
    if na.dtype is DType.BOOL and nb.dtype is DType.BOOL and op in (Op.ADD, Op.SUB, Op.MUL):
        # torch's bool arithmetic stays bool: + is or, * is and, and - is refused
        if op is Op.SUB:
            ctx.fail("subtracting two bools (torch refuses it too)",
                     "use ^ or torch.logical_xor, or count with .int() first")
        return Proxy(ir.node(Op.OR if op is Op.ADD else Op.AND, DType.BOOL, (na, nb)), ctx)
    return Proxy(build_binary(op, na, nb), ctx)


def _unary(ctx: _Context, op: Op, x) -> "Proxy":
    if _is_row(x):
        return _map(ctx, lambda y: _unary(ctx, op, y), x)
    if _is_narrow(x):
        return _narrowed(ctx, _unary(ctx, op, _plain(x)), x.low)
    n = _coerce(ctx, x)
    if op in ir.TRANSCENDENTAL or op in ir.ROUNDING:
        if op in ir.ROUNDING and not n.dtype.is_float:
            return Proxy(n, ctx)
        n = cast(n, DType.FLOAT32)
        return Proxy(ir.node(op, DType.FLOAT32, (n,)), ctx)
    if op is Op.NEG and n.dtype is DType.BOOL:
        ctx.fail("negation of a bool is not supported", "use ~x for logical not")
    if op is Op.ABS and n.dtype is DType.BOOL:
        return Proxy(n, ctx)
    return Proxy(ir.node(op, n.dtype, (n,)), ctx)


def _where(ctx: _Context, c, a, b) -> "Proxy":
    if _is_row(c) or _is_row(a) or _is_row(b):
        return _map(ctx, lambda x, y, z: _where(ctx, x, y, z), c, a, b)
    if _is_narrow(a) or _is_narrow(b):
        common = _common_dtype((a, b))
        if common is not None:
            a, b = _in_common(ctx, common, (a, b))
        return _narrowed(ctx, _where(ctx, c, _plain(a), _plain(b)), common)
    nc = _coerce(ctx, c)
    if nc.dtype is not DType.BOOL:
        ctx.fail(f"torch.where needs a bool condition, got {nc.dtype.value}",
                 "compare first, e.g. torch.where(x > 0, a, b)")
    like = next((x.node.dtype for x in (a, b) if isinstance(x, Proxy)), None)
    na, nb = _coerce(ctx, a, like), _coerce(ctx, b, like)
    dt = ir.promote(na.dtype, nb.dtype)
    return Proxy(ir.node(Op.WHERE, dt, (nc, cast(na, dt), cast(nb, dt))), ctx)


def _concrete(p: "Proxy"):
    """The Python value of a proxy that depends only on captured scalars and constants."""
    leaves = {n.op for n in ir.walk(p.node)}
    if leaves & (ir.INDEX_LEAVES | {Op.SCORE, Op.LOAD}):
        return None
    with torch._C.DisableTorchFunction():  # our own evaluation is not the user's code
        return eval_constant(p.node, p.ctx.scalars)


class Proxy:
    """A traced value. Operators record IR; Python control flow on it is an error."""

    __slots__ = ("node", "ctx", "low")
    __hash__ = None  # __eq__ builds IR

    def __init__(self, node: Node, ctx: _Context, low: torch.dtype | None = None):
        self.node = node
        self.ctx = ctx
        self.low = low  # the narrow torch dtype the value has (_NARROW_FLOAT, _NARROW_INT), if any

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(_find_ctx(args, kwargs or {}), func, args, kwargs or {})

    def __repr__(self):
        return f"Proxy({self.node.op.value}: {self.node.dtype.value})"

    # arithmetic
    def __add__(self, o): return _binary(self.ctx, Op.ADD, self, o)
    def __radd__(self, o): return _binary(self.ctx, Op.ADD, o, self)
    def __sub__(self, o): return _binary(self.ctx, Op.SUB, self, o)
    def __rsub__(self, o): return _binary(self.ctx, Op.SUB, o, self)
    def __mul__(self, o): return _binary(self.ctx, Op.MUL, self, o)
    def __rmul__(self, o): return _binary(self.ctx, Op.MUL, o, self)
    def __truediv__(self, o): return _binary(self.ctx, Op.DIV, self, o)
    def __rtruediv__(self, o): return _binary(self.ctx, Op.DIV, o, self)
    def __floordiv__(self, o): return _binary(self.ctx, Op.FLOORDIV, self, o)
    def __rfloordiv__(self, o): return _binary(self.ctx, Op.FLOORDIV, o, self)
    def __mod__(self, o): return _binary(self.ctx, Op.MOD, self, o)
    def __rmod__(self, o): return _binary(self.ctx, Op.MOD, o, self)
    def __pow__(self, o): return _binary(self.ctx, Op.POW, self, o)
    def __rpow__(self, o): return _binary(self.ctx, Op.POW, o, self)
    def __neg__(self): return _unary(self.ctx, Op.NEG, self)
    def __pos__(self): return self
    def __abs__(self): return _unary(self.ctx, Op.ABS, self)
    def __invert__(self): return _unary(self.ctx, Op.NOT, self)
    # comparisons and logic
    def __lt__(self, o): return _binary(self.ctx, Op.LT, self, o)
    def __le__(self, o): return _binary(self.ctx, Op.LE, self, o)
    def __gt__(self, o): return _binary(self.ctx, Op.GT, self, o)
    def __ge__(self, o): return _binary(self.ctx, Op.GE, self, o)
    def __eq__(self, o): return _binary(self.ctx, Op.EQ, self, o)
    def __ne__(self, o): return _binary(self.ctx, Op.NE, self, o)
    def __and__(self, o): return _logic(self.ctx, Op.AND, self, o)
    def __rand__(self, o): return _logic(self.ctx, Op.AND, o, self)
    def __or__(self, o): return _logic(self.ctx, Op.OR, self, o)
    def __ror__(self, o): return _logic(self.ctx, Op.OR, o, self)
    def __xor__(self, o): return _logic(self.ctx, Op.XOR, self, o)
    def __rxor__(self, o): return _logic(self.ctx, Op.XOR, o, self)
    def __lshift__(self, o): return _shift(self.ctx, Op.SHL, self, o)
    def __rlshift__(self, o): return _shift(self.ctx, Op.SHL, o, self)
    def __rshift__(self, o): return _shift(self.ctx, Op.SHR, self, o)
    def __rrshift__(self, o): return _shift(self.ctx, Op.SHR, o, self)

    # Python-level conversions: allowed only for values that do not depend on the
    # position (captured scalars and constants); resolved against today's values.
    def __bool__(self):
        v = _concrete(self)
        if v is None:
            self.ctx.fail("Python control flow (`if`, `and`, `or`, `not`, min/max, a bool() call) "
                          "on a traced value: its value differs per element",
                          "use torch.where(cond, a, b), `&`, `|`, `~`, torch.minimum/maximum")
        return bool(v)

    def _number(self, kind: str):
        v = _concrete(self)
        if v is None:
            self.ctx.fail(f"{kind} on a traced value: the mod runs per element inside a kernel",
                          "use torch functions (torch.exp, torch.log, ...) instead of math.*, "
                          "and index captured tensors directly with the traced value")
        return v

    def __float__(self): return float(self._number("float()/math.*"))
    def __int__(self): return int(self._number("int()"))

    def __index__(self):
        v = _concrete(self)
        if v is None:
            self.ctx.fail("a Python list, tuple or range indexed by a traced value: its value differs "
                          "per element", "put the values in a tensor outside the mod and index that, "
                          "e.g. table = torch.tensor(values); ... table[q_idx]")
        return int(v)

    def __iter__(self):
        self.ctx.fail("iterating over a traced value", "a traced value is one element, not a tensor")

    def __len__(self):
        self.ctx.fail("len() of a traced value", "a traced value is one element, not a tensor")

    def __getitem__(self, idx):
        self.ctx.fail("indexing a traced argument", "index captured tensors instead, e.g. bias[q_idx]")

    def __setitem__(self, idx, value):
        self.ctx.fail("an in-place assignment", "build a new value, e.g. torch.where(...)")

    def __getattr__(self, name):
        # Tensor methods are looked up here; in-place ones (add_, mul_, ...) are refused.
        if name.startswith("__"):
            raise AttributeError(name)
        if name.endswith("_") and not name.startswith("_"):
            self.ctx.fail(f"in-place op `.{name}()`", f"use the out-of-place `.{name[:-1]}()`")
        if name == "item" or name == "tolist" or name == "numpy" or name == "cpu" or name == "cuda":
            self.ctx.fail(f"`.{name}()` on a traced value: it has no concrete value at trace time",
                          "keep the value traced (use torch.where instead of Python branches)")
        method = getattr(torch.Tensor, name, None)
        if method is None:
            raise AttributeError(f"traced value has no attribute {name!r}")
        return lambda *args, **kwargs: _dispatch(self.ctx, method, args, kwargs, first=self)

    @property
    def dtype(self):
        return self.low or _IR_TO_TORCH[self.node.dtype]

    @property
    def shape(self):
        return torch.Size([])

    def dim(self):
        return 0

    @property
    def ndim(self):
        return 0

    @property
    def device(self):
        return torch.device("cpu")

    def size(self, dim=None):
        if dim is not None:
            self.ctx.fail("size(dim) of a traced value", "a traced value is a single element")
        return torch.Size([])

    def new_ones(self, size=(), dtype=None, **kw):
        return _full_like(self, 1, dtype, size)

    def new_zeros(self, size=(), dtype=None, **kw):
        return _full_like(self, 0, dtype, size)

    def new_full(self, size, fill_value, dtype=None, **kw):
        return _full_like(self, fill_value, dtype, size)


def _logic(ctx: _Context, op: Op, a, b) -> Proxy:
    for x in (a, b):
        if isinstance(x, Proxy) and x.node.dtype.is_float:
            ctx.fail(f"`{'&|^'[[Op.AND, Op.OR, Op.XOR].index(op)]}` on a floating value",
                     "compare first to get a bool, e.g. (x > 0) & (y < 1)")
        if isinstance(x, float):
            ctx.fail("a bitwise/logical op with a float constant", "use a bool or an int")
    return _binary(ctx, op, a, b)


def _shift(ctx: _Context, op: Op, a, b) -> Proxy:
    for x in (a, b):
        if (isinstance(x, Proxy) and x.node.dtype.is_float) or isinstance(x, float):
            ctx.fail(f"`{'<<' if op is Op.SHL else '>>'}` on a floating value", "shift integers only")
    return _binary(ctx, op, a, b)


def _full_like(p: Proxy, value, dtype, size=()):
    if tuple(size) not in ((), (1,)):
        p.ctx.fail(f"a tensor of shape {tuple(size)} created inside the mod",
                   "a mod works on one element: return a scalar expression")
    dtype = dtype if dtype is not None else p.dtype
    if dtype in _NARROW_FLOAT or dtype in _NARROW_INT:
        return Proxy(ir.const(_number_in(value, dtype), _TORCH_DTYPES[dtype]), p.ctx, dtype)
    return Proxy(ir.const(value, _TORCH_DTYPES[dtype]), p.ctx)


class BufferView:
    """A captured tensor partially indexed with traced values (``bias[h]``)."""

    __slots__ = ("tensor", "index", "ctx")

    def __init__(self, tensor: torch.Tensor, index: tuple[Node, ...], ctx: _Context):
        self.tensor, self.index, self.ctx = tensor, index, ctx

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(_find_ctx(args, kwargs or {}), func, args, kwargs or {})

    @property
    def ndim(self):
        return self.tensor.dim() - len(self.index)

    def __getitem__(self, idx):
        if isinstance(idx, tuple) and idx and idx[0] is Ellipsis and len(idx) - 1 == self.ndim:
            idx = idx[1:]  # view[..., j]: the remaining dimensions are the last ones
        return _index(self.ctx, self.tensor, self.index, idx)

    def row(self) -> "Vector | None":
        """The view as a Vector of loads when one short dimension is left (else None)."""
        if self.ndim != 1 or self.tensor.shape[-1] > MAX_ROW:
            return None
        given = [_index_label(n) for n in self.index]
        origin = (f"a captured tensor of {self.tensor.dim()} dimensions was indexed with "
                  f"{len(given)}; index every dimension at once, e.g. t[{', '.join(given + ['i'])}]")
        return Vector([_index(self.ctx, self.tensor, self.index, j)
                       for j in range(self.tensor.shape[-1])], self.ctx, origin)

    def _as_row(self) -> "Vector":
        row = self.row()
        if row is None:
            given = [_index_label(n) for n in self.index]
            self.ctx.fail(f"a captured tensor of shape {tuple(self.tensor.shape)} indexed with "
                          f"{len(given)} index(es) used as a value",
                          f"index it down to one element, e.g. t[{', '.join(given + ['i'] * self.ndim)}], "
                          f"or to a row of at most {MAX_ROW} values")
        return row

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._as_row(), name)

    def _scalar(self, *_):
        self.ctx.fail(f"Python control flow or a number conversion on a captured tensor of shape "
                      f"{tuple(self.tensor.shape)} indexed with {len(self.index)} index(es)",
                      "index it down to one element (or reduce its row), and use torch.where "
                      "instead of `if`")
    __bool__ = __float__ = __int__ = __index__ = _scalar


# The longest row of a captured tensor a mod may hold (``pos[q_idx]`` with ``pos`` of shape
# (S, 3)): rows are unrolled into scalar code, one value per element.
MAX_ROW = 64


class Vector:
    """A short row of traced values: a captured tensor indexed in all but its last dimension.

    Elementwise ops map over it, broadcasting against single values and rows of the same length;
    reductions over its one dimension (``sum``, ``mean``, ``prod``, ``amax``, ``amin``, ``max``,
    ``min``, ``norm``, ``dot``) unroll into scalar code; a Python int indexes an element. A mod
    reduces its rows to one value before it returns."""

    __slots__ = ("items", "ctx", "origin")
    __hash__ = None

    def __init__(self, items: list, ctx: _Context, origin: str = ""):
        self.items, self.ctx, self.origin = list(items), ctx, origin  # origin: what to say in hints

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(_find_ctx(args, kwargs or {}), func, args, kwargs or {})

    def __repr__(self):
        return f"Vector({len(self.items)})"

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    def _scalar(self, *_):
        self.ctx.fail(f"Python control flow or a number conversion on a row of {len(self.items)} "
                      "traced values", "reduce the row first (e.g. .sum(-1)), and use torch.where "
                      "instead of `if`")
    __bool__ = __float__ = __int__ = __index__ = _scalar

    def __getitem__(self, idx):
        if isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis:
            idx = idx[1]  # row[..., j]: the row's one dimension is its last
        if isinstance(idx, int) and not isinstance(idx, bool) and -len(self.items) <= idx < len(self.items):
            return self.items[idx]
        self.ctx.fail(f"indexing a row of {len(self.items)} values with {idx!r}",
                      "index it with a Python int in range, or index the captured tensor directly")

    @property
    def shape(self):
        return torch.Size([len(self.items)])

    @property
    def ndim(self):
        return 1

    def dim(self):
        return 1

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        method = getattr(torch.Tensor, name, None)
        if method is None:
            raise AttributeError(f"a traced row has no attribute {name!r}")
        return lambda *args, **kwargs: _dispatch(self.ctx, method, args, kwargs, first=self)


for _name, _op in [("add", Op.ADD), ("sub", Op.SUB), ("mul", Op.MUL), ("truediv", Op.DIV),
                   ("floordiv", Op.FLOORDIV), ("mod", Op.MOD), ("pow", Op.POW), ("lt", Op.LT),
                   ("le", Op.LE), ("gt", Op.GT), ("ge", Op.GE), ("eq", Op.EQ), ("ne", Op.NE)]:
    def _fwd(self, o, _op=_op):
        return _binary(self.ctx, _op, self, o)

    def _rev(self, o, _op=_op):
        return _binary(self.ctx, _op, o, self)
    for _cls in (Vector, BufferView):
        setattr(_cls, f"__{_name}__", _fwd)
        if _name not in ("lt", "le", "gt", "ge", "eq", "ne"):
            setattr(_cls, f"__r{_name}__", _rev)
for _cls in (Vector, BufferView):
    _cls.__neg__ = lambda self: _unary(self.ctx, Op.NEG, self)
    _cls.__abs__ = lambda self: _unary(self.ctx, Op.ABS, self)
    _cls.__and__ = lambda self, o: _logic(self.ctx, Op.AND, self, o)
    _cls.__or__ = lambda self, o: _logic(self.ctx, Op.OR, self, o)
    _cls.__invert__ = lambda self: _unary(self.ctx, Op.NOT, self)
BufferView.__hash__ = None


def _is_row(x) -> bool:
    return isinstance(x, Vector) or (isinstance(x, BufferView) and x.ndim == 1)


def _map(ctx: _Context, fn: Callable, *args):
    """``fn`` over the elements of the row arguments, broadcasting single values."""
    rows = [a._as_row() if isinstance(a, BufferView) else a for a in args]
    lengths = {len(r.items) for r in rows if isinstance(r, Vector)}
    if len(lengths) != 1:
        ctx.fail(f"rows of different lengths {sorted(lengths)} in one expression",
                 "combine rows of the same length (or single values)")
    (n,) = lengths
    origin = next(r.origin for r in rows if isinstance(r, Vector))
    return Vector([fn(*(r.items[i] if isinstance(r, Vector) else r for r in rows)) for i in range(n)],
                  ctx, origin)


def _fold(ctx: _Context, op: Op, items: list):
    out = items[0]
    for x in items[1:]:
        out = _binary(ctx, op, out, x)
    return out


def _reduce(ctx: _Context, name: str, row: "Vector", args: tuple, kwargs: dict):
    """A reduction over a row's one dimension (torch's name and arguments)."""
    dim = kwargs.get("dim", args[0] if args else None)
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if dim not in (None, 0, -1):
        ctx.fail(f"`{name}` over dim {dim!r} of a row", "a row has one dimension: dim=-1")
    items = row.items
    if any(_is_narrow(x) for x in items):  # torch accumulates a narrow float row in float32
        common = _common_dtype(items)
        out = _reduce(ctx, name, Vector([_plain(x) for x in items], ctx, row.origin), args, kwargs)
        return _narrowed(ctx, out, common) if common in _NARROW_FLOAT else out
    if name in ("sum", "prod"):  # torch counts bools (a bool + bool would be their or)
        items = [_binary(ctx, Op.ADD, x, 0) if _coerce(ctx, x).dtype is DType.BOOL else x for x in items]
    if name == "sum":
        return _fold(ctx, Op.ADD, items)
    if name == "prod":
        return _fold(ctx, Op.MUL, items)
    if name == "mean":
        return _binary(ctx, Op.DIV, _fold(ctx, Op.ADD, items), float(len(items)))
    if name in ("amax", "amin") or (name in ("max", "min") and dim is None):
        return _fold(ctx, Op.MAX if name in ("amax", "max") else Op.MIN, items)
    if name in ("norm", "vector_norm"):
        p = kwargs.get("p", kwargs.get("ord", 2))
        if p == 1:
            return _fold(ctx, Op.ADD, [_unary(ctx, Op.ABS, x) for x in items])
        if p == float("inf"):
            return _fold(ctx, Op.MAX, [_unary(ctx, Op.ABS, x) for x in items])
        if p == 2:  # torch's subgradient at a zero row is 0: keep sqrt's infinite slope out of it
            sq = _fold(ctx, Op.ADD, [_binary(ctx, Op.MUL, x, x) for x in items])
            zero = _binary(ctx, Op.EQ, sq, 0.0)
            return _where(ctx, zero, 0.0, _unary(ctx, Op.SQRT, _where(ctx, zero, 1.0, sq)))
        ctx.fail(f"a {p}-norm of a row", "use p=1, 2 or inf, or write it out")
    ctx.fail(f"`{name}` with dim={dim!r} on a row returns indices too", f"use a{name}(dim=-1)")


_ROW_REDUCTIONS = {torch.sum: "sum", torch.Tensor.sum: "sum", torch.mean: "mean",
                   torch.Tensor.mean: "mean", torch.prod: "prod", torch.Tensor.prod: "prod",
                   torch.amax: "amax", torch.Tensor.amax: "amax", torch.amin: "amin",
                   torch.Tensor.amin: "amin", torch.norm: "norm", torch.Tensor.norm: "norm",
                   torch.linalg.vector_norm: "vector_norm"}


def _row_call(ctx: _Context, func, args: tuple, kwargs: dict):
    """A torch call with a row among its arguments: a reduction, a dot product, or an elementwise
    op mapped over the row."""
    args = tuple(a._as_row() if isinstance(a, BufferView) else a for a in args)
    if func in _ROW_REDUCTIONS or (func in (torch.max, torch.Tensor.max, torch.min, torch.Tensor.min)
                                   and (len(args) == 1 or not _is_row(args[1]))):
        name = _ROW_REDUCTIONS.get(func) or ("max" if func in (torch.max, torch.Tensor.max) else "min")
        return _reduce(ctx, name, args[0], args[1:], kwargs)
    if func in (torch.dot, torch.Tensor.dot, torch.inner, torch.Tensor.inner):
        return _fold(ctx, Op.ADD, _map(ctx, lambda x, y: _binary(ctx, Op.MUL, x, y), *args).items)
    handler = _HANDLERS.get(func)
    if handler is None:
        handler = _unsupported(func)
    if kwargs:
        return _map(ctx, lambda *xs: handler(*xs, **kwargs), *args)
    return _map(ctx, handler, *args)


def _index(ctx: _Context, t: torch.Tensor, prefix: tuple[Node, ...], idx) -> Proxy | BufferView:
    """``t[prefix..., idx...]`` with traced indices: a LOAD, or a view if not all dims are given."""
    items = idx if isinstance(idx, tuple) else (idx,)
    nodes = list(prefix)
    for it in items:
        if it is None or it is Ellipsis or isinstance(it, slice):
            ctx.fail(f"indexing a captured tensor with {it!r}",
                     "index every dimension with one traced or Python integer")
        if isinstance(it, torch.Tensor) and (it.dim() != 0 or it.is_floating_point() or it.is_complex()):
            ctx.fail(f"indexing a captured tensor with a tensor of shape {tuple(it.shape)} and dtype {it.dtype}",
                     "index it with traced values (b, h, q_idx, kv_idx or expressions of them), or "
                     "with a captured 0-d integer tensor")
        n = _coerce(ctx, it)
        if not n.dtype.is_int:
            ctx.fail(f"index of dtype {n.dtype.value} into a captured tensor",
                     "indices must be integers; use .long() or // to make one")
        nodes.append(n)
    if len(nodes) > t.dim():
        ctx.fail(f"too many indices ({len(nodes)}) for a captured tensor of shape {tuple(t.shape)}")
    if len(nodes) < t.dim():
        return BufferView(t, tuple(nodes), ctx)
    buf = ctx.buffer(t)
    return Proxy(ir.node(Op.LOAD, _TORCH_DTYPES[t.dtype], (buf, *nodes)), ctx)


# --------------------------------------------------------------------------- torch functions


def _unsupported(func):
    name = getattr(func, "__name__", str(func))

    def handler(*args, **kwargs):
        ctx = _find_ctx(args, kwargs)
        reason = f"torch.{name} is not supported inside a mod"
        hint = None
        if name in _REDUCTIONS:
            reason = f"`{name}` is a reduction; a mod computes one element at a time"
            hint = "reduce the captured tensor outside the mod and capture the result"
        ctx.fail(reason, hint)
    return handler


_REDUCTIONS = {"sum", "mean", "prod", "amax", "amin", "argmax", "argmin", "any", "all", "std",
               "var", "softmax", "log_softmax", "cumsum", "cumprod", "logsumexp", "norm", "topk",
               "sort", "median", "mode", "max", "min", "count_nonzero", "nansum"}
_FACTORIES = {torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.full,
              torch.empty, torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye,
              torch.scalar_tensor, torch.zeros_like, torch.ones_like, torch.full_like,
              torch.empty_like, torch.rand_like, torch.randn_like, torch.logspace}


def _find_ctx(args, kwargs) -> _Context:
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, (Proxy, BufferView, Vector)):
            return x.ctx
        if isinstance(x, (tuple, list)):
            for y in x:
                if isinstance(y, (Proxy, BufferView, Vector)):
                    return y.ctx
    return _ACTIVE[-1]




# torch function -> IR builder, filled by frontend/torch_ops.py
_HANDLERS: dict[Any, Callable] = {}

_ACTIVE: list[_Context] = []


def _involves_proxy(args, kwargs) -> bool:
    for x in list(args) + list((kwargs or {}).values()):
        if isinstance(x, (Proxy, BufferView, Vector)):
            return True
        if isinstance(x, (tuple, list)) and any(isinstance(y, (Proxy, BufferView, Vector)) for y in x):
            return True
    return False



def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    return []


# Tensor methods that turn a captured tensor's values into Python values (by the name the call
# reaches the tracer under, as the user wrote it).
_VALUE_READS = {"item": ".item()", "tolist": ".tolist()", "numpy": ".numpy()", "__array__": "numpy.asarray()",
                "__float__": "float()", "__int__": "int()", "__index__": "using a tensor as an index",
                "__bool__": "bool() (an `if` or `and`)", "__complex__": "complex()",
                "is_nonzero": ".is_nonzero()", "equal": "torch.equal", "allclose": "torch.allclose"}


def _new_values(result, args, kwargs) -> bool:
    """Whether ``result`` holds a tensor of new storage (not a view of an argument)."""
    made = _tensors(result)
    if not made:
        return False
    try:
        seen = {t.untyped_storage().data_ptr() for t in _tensors((tuple(args), tuple(kwargs.values())))}
        return any(t.untyped_storage().data_ptr() not in seen for t in made)
    except (RuntimeError, NotImplementedError):  # no storage to compare (a fake tensor)
        return False


def _as_traced(ctx: _Context, x):
    """A captured tensor as the tracer reads it: a 0-d one as its load, a larger one as a view
    to index (``BufferView``); anything else unchanged."""
    if isinstance(x, torch.Tensor):
        return Proxy(_coerce(ctx, x), ctx) if x.dim() == 0 else BufferView(x, (), ctx)
    if isinstance(x, (tuple, list)):
        return type(x)(_as_traced(ctx, y) for y in x)
    return x


def _dispatch(ctx: _Context, func, args=(), kwargs=None, first=None):
    """One torch call made while tracing: build IR if it touches a proxy. ``first``: the tensor a
    method was looked up on (a row's ``.sum(...)``), put before ``args``."""
    kwargs = kwargs or {}
    if first is not None:
        args = (first, *args)
    if any(_is_row(a) for a in args) or any(_is_row(v) for v in kwargs.values()):
        if "out" in kwargs:
            ctx.fail("an `out=` argument writes in place", "return the value instead")
        return _row_call(ctx, func, tuple(args), kwargs)
    if func in _FACTORIES:  # a constant (torch.tensor(c)) has a handler; the rest are refused
        if func in _HANDLERS:
            return _HANDLERS[func](*args, **kwargs)
        ctx.fail(f"a tensor is created inside the mod (torch.{func.__name__})",
                 "use a Python number (e.g. float('-inf')), or create the tensor "
                 "outside the mod and capture it")
    if not _involves_proxy(args, kwargs):
        name = getattr(func, "__name__", "")
        if name == "__setitem__" or name.endswith("_") and not name.startswith("_"):
            ctx.fail(f"in-place op `{name}` on a captured tensor: the mod would change it while "
                     "being traced", "compute a new value instead; change the tensor outside the mod")
        if name in _VALUE_READS:
            # The trace is reused while the tensor's values change (an optimizer step, a new
            # batch's lengths): a number read here would stay the one read at the first call.
            ctx.fail(f"`{_VALUE_READS[name]}` reads a captured tensor's value into Python while the mod "
                     "is traced, so the kernel would keep that value after the tensor changes",
                     "keep it a tensor (`t[0]`, not `float(t[0])`: read when the kernel runs), or "
                     "convert outside the mod and capture the Python number")
        result = func(*args, **kwargs)
        if not _new_values(result, args, kwargs):
            return result  # metadata (t.shape, t.numel()) or a view: read when the kernel runs
        # New values computed from captured tensors (t[3] + 1.0, t.sigmoid()): computed here
        # they would be frozen into the trace, which is reused while the tensors' values change
        # (an optimizer step). Traced instead, they are read when the kernel runs.
        if func is torch.Tensor.__getitem__:
            return _index(ctx, args[0], (), args[1])
        whole = [t for t in _tensors((tuple(args), tuple(kwargs.values())))
                 if t.dim() > 1 or t.dim() == 1 and t.shape[0] > MAX_ROW]
        if whole:
            ctx.fail(f"torch.{getattr(func, '__name__', func)} on a whole captured tensor of shape "
                     f"{tuple(whole[0].shape)}: a mod reads captured tensors element by element when "
                     "the kernel runs", "apply it to the elements the mod reads (torch.sigmoid(t[h]) "
                     "for torch.sigmoid(t)[h]), or compute it outside the mod and capture the result")
        return _dispatch(ctx, func, _as_traced(ctx, args), {k: _as_traced(ctx, v) for k, v in kwargs.items()})
    handler = _HANDLERS.get(func)
    if handler is None:
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("_"):
            ctx.fail(f"in-place op `{name}`", f"use the out-of-place `{name[:-1]}`")
        handler = _unsupported(func)
    if "out" in kwargs:
        ctx.fail("an `out=` argument writes in place", "return the value instead")
    if getattr(handler, "keeps_dtype", False) or not any(_is_narrow(x) for x in (*args, *kwargs.values())):
        return handler(*args, **kwargs)
    # A composition on narrow values: computed in float32/int32 from their values, its result
    # rounded or wrapped once, as torch computes such an op in opmath.
    common = _common_dtype((*args, *kwargs.values()))
    return _narrowed(ctx, handler(*[_plain(a) for a in args], **{k: _plain(v) for k, v in kwargs.items()}),
                     common)


def keeps_dtype(handler: Callable) -> Callable:
    """Marks a handler that follows narrow dtypes itself (built from ``_binary``, ``_unary`` and
    ``_where``, or a cast); any other handler sees narrow values as float32/int32."""
    handler.keeps_dtype = True
    return handler

