"""The IR interpreter: the living definition of every op, on torch tensors.

It evaluates a graph with broadcasting: the leaves b, h, q_idx, kv_idx (and
score) are tensors shaped so that they broadcast against each other, e.g.
b (B,1,1,1), h (1,H,1,1), q_idx (1,1,L,1), kv_idx (1,1,1,S). The reference
backend, the dense mask builder and constant folding all go through here, and
every kernel renderer must agree with it.

Semantics worth knowing:
  * floating values are computed in ``float_dtype`` (float32, or float64 for a
    float64 reference); loads widen bf16/fp16 buffers to it.
  * integer ``//`` and ``%`` follow Python (floor, sign of the divisor).
  * a negative index counts from the end (Python), an index past the end is an
    IndexError here. Kernels cannot raise: ``bounds.check`` raises the same before any
    kernel runs, and their clamp after wrapping only keeps discarded rows in bounds.
"""
from __future__ import annotations

import dataclasses

import torch

from flexjit.ir.nodes import DType, Node, Op, toposort

_INT_TORCH = {DType.BOOL: torch.bool, DType.INT32: torch.int32, DType.INT64: torch.int64}


@dataclasses.dataclass
class Env:
    """Values of the leaves for one evaluation."""
    b: torch.Tensor | None = None
    h: torch.Tensor | None = None
    q_idx: torch.Tensor | None = None
    kv_idx: torch.Tensor | None = None
    score: torch.Tensor | None = None
    buffers: tuple = ()
    scalars: tuple = ()
    float_dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    # Pre-computed values for nodes (used by the reference backward to make loads leaves).
    overrides: dict | None = None

    def torch_dtype(self, dt: DType) -> torch.dtype:
        return self.float_dtype if dt is DType.FLOAT32 else _INT_TORCH[dt]


_UNARY = {
    Op.EXP: torch.exp, Op.EXP2: torch.exp2, Op.LOG: torch.log, Op.LOG2: torch.log2,
    Op.TANH: torch.tanh, Op.SIGMOID: torch.sigmoid, Op.SQRT: torch.sqrt, Op.RSQRT: torch.rsqrt,
    Op.SIN: torch.sin, Op.COS: torch.cos, Op.FLOOR: torch.floor, Op.CEIL: torch.ceil,
    Op.NEG: torch.neg, Op.ABS: torch.abs, Op.ROUND: torch.round, Op.TRUNC: torch.trunc,
    Op.TAN: torch.tan, Op.ATAN: torch.atan, Op.SINH: torch.sinh, Op.COSH: torch.cosh,
    Op.ASIN: torch.asin, Op.ACOS: torch.acos, Op.LOG1P: torch.log1p, Op.EXPM1: torch.expm1,
    Op.ERF: torch.erf,
}


class _Rounded(torch.autograd.Function):
    """torch's conversion to a narrower float and back, with the gradient passed straight through
    (the derivative pass's rule; torch's own backward would round the gradient too)."""

    @staticmethod
    def forward(ctx, x, dtype):
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


_UNARY[Op.ROUND_F16] = lambda x: _Rounded.apply(x, torch.float16)
_UNARY[Op.ROUND_BF16] = lambda x: _Rounded.apply(x, torch.bfloat16)

_BINARY = {
    Op.ADD: torch.add, Op.SUB: torch.sub, Op.MUL: torch.mul, Op.DIV: torch.true_divide,
    Op.MOD: torch.remainder, Op.FMOD: torch.fmod, Op.POW: torch.pow, Op.ATAN2: torch.atan2,
    Op.MAX: torch.maximum, Op.MIN: torch.minimum,
    Op.LT: torch.lt, Op.LE: torch.le, Op.GT: torch.gt, Op.GE: torch.ge, Op.EQ: torch.eq, Op.NE: torch.ne,
    Op.AND: torch.bitwise_and, Op.OR: torch.bitwise_or, Op.XOR: torch.bitwise_xor,
    Op.SHL: torch.bitwise_left_shift, Op.SHR: torch.bitwise_right_shift,
}


def evaluate(roots: list[Node] | Node, env: Env) -> list[torch.Tensor] | torch.Tensor:
    """Evaluate one root or a list of roots (sharing common subexpressions)."""
    single = isinstance(roots, Node)
    root_list = [roots] if single else list(roots)
    values: dict[int, torch.Tensor] = {}
    overrides = env.overrides or {}
    for n in toposort(root_list):
        if id(n) in overrides:
            values[id(n)] = overrides[id(n)]
            continue
        if n.op is Op.BUFFER:
            continue
        values[id(n)] = _eval_node(n, [values.get(id(s)) for s in n.src], env)
    out = [values[id(r)] for r in root_list]
    return out[0] if single else out


def _eval_node(n: Node, args: list, env: Env) -> torch.Tensor:
    op = n.op
    dt = env.torch_dtype(n.dtype) if n.dtype is not DType.VOID else None
    if op is Op.CONST:
        return torch.tensor(n.arg, dtype=dt, device=env.device)
    if op is Op.SCALAR:
        return torch.tensor(env.scalars[n.arg], dtype=dt, device=env.device)
    if op in (Op.SCORE, Op.B, Op.H, Op.Q_IDX, Op.KV_IDX):
        v = getattr(env, op.value)
        if v is None:
            raise ValueError(f"no value for leaf {op.value}")
        return v if op is Op.SCORE else v.to(dt)
    if op is Op.LOAD:
        return _load(n, args[1:], env)
    if op is Op.CAST:
        return args[0].to(dt)
    if op is Op.NOT:
        return torch.logical_not(args[0]) if n.dtype is DType.BOOL else torch.bitwise_not(args[0])
    if op in _UNARY:
        return _UNARY[op](args[0])
    if op is Op.FLOORDIV:
        if n.dtype.is_float:
            return torch.floor(args[0] / args[1])
        return torch.div(args[0], args[1], rounding_mode="floor")
    if op in _BINARY:
        out = _BINARY[op](args[0], args[1])
        return out if op in (Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE) else out.to(dt)
    if op is Op.WHERE:
        return torch.where(args[0], args[1], args[2])
    raise NotImplementedError(f"interpreter has no rule for {op}")


def _load(n: Node, index: list[torch.Tensor], env: Env) -> torch.Tensor:
    slot, ndim, _ = n.src[0].arg
    buf = env.buffers[slot]
    target = torch.device(env.device)
    if buf.device != target:
        buf = buf.to(target)
    if ndim == 0:
        return buf.to(env.torch_dtype(n.dtype))
    idx = tuple(i.long() for i in index)
    try:
        out = buf[idx]
    except IndexError as e:
        raise IndexError(f"a mod indexed captured tensor #{slot} of shape {tuple(buf.shape)} "
                         f"out of range: {e}") from e
    return out.to(env.torch_dtype(n.dtype))


def eval_constant(root: Node, scalars) -> bool | int | float:
    """Python value of a graph with no position-dependent leaves."""
    return evaluate(root, Env(scalars=tuple(scalars), float_dtype=torch.float64)).item()
