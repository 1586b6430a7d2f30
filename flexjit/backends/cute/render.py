"""IR -> CuTeDSL: the generated module a CuTe kernel's holes are filled from (any architecture).

What this module holds
----------------------
* ``render(program)``: the source of one generated module, three plain Python functions over DSL
  values (no control flow, inlined per element when a kernel is traced):
  ``score_mod(score, b, h, q_idx, kv_idx, aux, q_idx_f, kv_idx_f, kv_minus_q_f,
  kv_minus_q_parts)``, ``mask_mod(b, h, q_idx, kv_idx, aux, ...)`` and ``score_mod_and_grad``
  (the modded score and its derivative, for a backward). Each function's ``.float_indices``
  names the float32 copies of the indices it reads (formed cheaply by the kernel,
  ``cute_common.FloatIndices``; kv - q also as (base, offset), so that a tile-uniform multiple
  of it, ALiBi's bias, is one FFMA), and ``.hoisted`` is its tile-uniform part or None.
  Captured tensors are ``aux.tensors[i]`` and runtime scalars ``aux.scalars[j]``.
* The captured-tensor gradients of a backward (``render_captured_grads``: ``score_grads`` and
  ``grad_offsets``), ``grad_slots``, ``captured_grads_in_kernel``.
* The op -> code table ``_OPS`` (one row per ``ir.Op``, checked by tests/test_op_registry.py).

Nothing here depends on the kernel's architecture: the Hopper kernels (``cute_sm90``) use it, and
a Blackwell one will too.

Semantics follow ``flexjit.interp``: integer ``//`` floors (the DSL's ``//`` lowers to
``arith.floordivsi``), ``%`` is written as ``a - (a // b) * b`` so it takes the divisor's sign,
indices wrap when negative and are clamped into range (a memory-safety guard for discarded
rows: ``ir.bounds.check`` raised before launch for any index out of range in the call), and
loads widen to float32.
"""
from __future__ import annotations

import math
import re

from flexjit.ir import nodes as ir
from flexjit.ir.kv_range import BIG, kv_interval
from flexjit.ir.nodes import DType, Node, Op
from flexjit.ir.program import Program
from flexjit.ir.passes import exact_float_nodes

_TYPES = {DType.FLOAT32: "Float32", DType.INT32: "Int32", DType.INT64: "Int64", DType.BOOL: "Boolean"}


# --------------------------------------------------------------------------- renderer


def _const(n: Node) -> str:
    if n.dtype is DType.BOOL:
        return f"Boolean({bool(n.arg)})"
    if n.dtype.is_float:
        v = float(n.arg)
        text = repr(v) if math.isfinite(v) else f"float({str(v)!r})"
        return f"Float32({text})"
    return f"{_TYPES[n.dtype]}({int(n.arg)})"


def _binary(fmt: str):
    return lambda n, a: fmt.format(*a)


def _unary_math(name: str):
    return lambda n, a, fast=False: f"cute.math.{name}({a[0]}{_FAST.get(name, '') if fast else ''})"


# Hardware approximations (MUFU): tanh.approx, ex2.approx, lg2.approx, ... Used unless the
# value feeds a discrete result (a comparison, floor, an index), where rounding must match
# the interpreter (passes.exact_float_nodes).
_FAST = {"tanh": ", approx=True", "exp": ", fastmath=True", "exp2": ", fastmath=True",
         "log": ", fastmath=True", "log2": ", fastmath=True", "sqrt": ", fastmath=True",
         "rsqrt": ", fastmath=True", "sin": ", fastmath=True", "cos": ", fastmath=True"}


def _logic(fn: str, py: str):
    def render(n, a):
        if n.dtype is DType.BOOL:
            return f"cutlass.{fn}({a[0]}, {a[1]})"
        return f"({a[0]} {py} {a[1]})"
    return render


def _cast(n: Node, a: list[str]) -> str:
    src = n.src[0].dtype
    if n.dtype is DType.BOOL:
        zero = "Float32(0.0)" if src.is_float else f"{_TYPES[src]}(0)"
        return f"({a[0]} != {zero})"
    return f"{_TYPES[n.dtype]}({a[0]})" if src is DType.BOOL else f"{a[0]}.to({_TYPES[n.dtype]})"


def _int_fmod(n: Node, a: list[str]) -> str:
    """C's remainder (the dividend's sign) from the DSL's floor division: Python's remainder,
    moved by one divisor where the operands' signs differ and it is not zero."""
    t = _TYPES[n.dtype]
    r = f"({a[0]} - ({a[0]} // {a[1]}) * {a[1]})"
    return (f"{t}(cutlass.select_(({r} != {t}(0)) & (({a[0]} < {t}(0)) != ({a[1]} < {t}(0))), "
            f"{r} - {a[1]}, {r}))")


def _shift(n: Node, a: list[str]) -> str:
    """torch's shifts: an amount outside [0, bits) gives 0 (>>: -1 for a negative a), where the
    DSL's (MLIR's) would be poison; >> on signed ints is arithmetic."""
    t, bits = _TYPES[n.dtype], 64 if n.dtype is DType.INT64 else 32
    sym = "<<" if n.op is Op.SHL else ">>"
    y = n.src[1]
    if y.op is Op.CONST and 0 <= y.arg < bits:
        return f"({a[0]} {sym} {a[1]})"
    shifted = f"({a[0]} {sym} ({a[1]} & {t}({bits - 1})))"
    ok = f"(({a[1]} >= {t}(0)) & ({a[1]} < {t}({bits})))"
    other = f"{t}(0)" if n.op is Op.SHL else f"{t}(cutlass.select_({a[0]} < {t}(0), {t}(-1), {t}(0)))"
    return f"{t}(cutlass.select_({ok}, {shifted}, {other}))"


def _minmax(fn: str):
    return lambda n, a: f"{_TYPES[n.dtype]}(cutlass.{fn}({a[0]}, {a[1]}))"


_OPS = {
    Op.ADD: _binary("({} + {})"), Op.SUB: _binary("({} - {})"), Op.MUL: _binary("({} * {})"),
    Op.DIV: _binary("({} / {})"), Op.NEG: lambda n, a: f"(-{a[0]})",
    Op.FLOORDIV: lambda n, a: (f"cute.math.floor({a[0]} / {a[1]})" if n.dtype.is_float
                               else f"({a[0]} // {a[1]})"),
    Op.MOD: lambda n, a: (f"({a[0]} - cute.math.floor({a[0]} / {a[1]}) * {a[1]})" if n.dtype.is_float
                          else f"({a[0]} - ({a[0]} // {a[1]}) * {a[1]})"),
    Op.POW: lambda n, a: f"cute.math.pow({a[0]}, {a[1]})",
    Op.MAX: _minmax("max"), Op.MIN: _minmax("min"),
    Op.LT: _binary("({} < {})"), Op.LE: _binary("({} <= {})"), Op.GT: _binary("({} > {})"),
    Op.GE: _binary("({} >= {})"), Op.EQ: _binary("({} == {})"), Op.NE: _binary("({} != {})"),
    Op.AND: _logic("and_", "&"), Op.OR: _logic("or_", "|"),
    Op.XOR: lambda n, a: f"({a[0]} != {a[1]})" if n.dtype is DType.BOOL else f"({a[0]} ^ {a[1]})",
    Op.NOT: lambda n, a: f"cutlass.not_({a[0]})" if n.dtype is DType.BOOL else f"(~{a[0]})",
    Op.SHL: _shift, Op.SHR: _shift,
    Op.ABS: lambda n, a: (f"cute.math.abs({a[0]})" if n.dtype.is_float
                          else f"{_TYPES[n.dtype]}(cutlass.select_({a[0]} < 0, -{a[0]}, {a[0]}))"),
    Op.EXP: _unary_math("exp"), Op.EXP2: _unary_math("exp2"), Op.LOG: _unary_math("log"),
    Op.LOG2: _unary_math("log2"), Op.TANH: _unary_math("tanh"), Op.SQRT: _unary_math("sqrt"),
    Op.RSQRT: _unary_math("rsqrt"), Op.SIN: _unary_math("sin"), Op.COS: _unary_math("cos"),
    Op.FLOOR: _unary_math("floor"), Op.CEIL: _unary_math("ceil"),
    Op.ROUND: _unary_math("roundeven"), Op.TRUNC: _unary_math("trunc"), Op.TAN: _unary_math("tan"),
    Op.ATAN: _unary_math("atan"), Op.SINH: _unary_math("sinh"), Op.COSH: _unary_math("cosh"),
    Op.ASIN: _unary_math("asin"), Op.ACOS: _unary_math("acos"), Op.LOG1P: _unary_math("log1p"),
    Op.EXPM1: _unary_math("expm1"), Op.ERF: _unary_math("erf"),
    Op.ATAN2: lambda n, a, fast=False: f"cute.math.atan2({a[0]}, {a[1]})",
    Op.ROUND_F16: lambda n, a: f"{a[0]}.to(cutlass.Float16).to(Float32)",
    Op.ROUND_BF16: lambda n, a: f"{a[0]}.to(cutlass.BFloat16).to(Float32)",
    Op.FMOD: lambda n, a: (f"cute.math.rem({a[0]}, {a[1]})" if n.dtype.is_float else _int_fmod(n, a)),
    Op.SIGMOID: lambda n, a, fast=False: (f"(Float32(1.0) / (Float32(1.0) + cute.math.exp(-{a[0]}"
                                          f"{', fastmath=True' if fast else ''})))"),
    Op.WHERE: lambda n, a: f"{_TYPES[n.dtype]}(cutlass.select_({a[0]}, {a[1]}, {a[2]}))",
    Op.CAST: _cast,
}


def _load(n: Node, a: list[str], indices=None) -> str:
    """A captured tensor's element; ``indices``: each dim's clamped index as an expression
    (else formed here from ``a``)."""
    slot = n.src[0].arg[0]
    t = f"aux.tensors[{slot}]"
    if not a[1:]:
        idx = "0"  # a 0-d captured tensor arrives as a 1-element tensor
    else:
        idx = ", ".join(indices or [f"_index({i}, {t}.shape[{d}])" for d, i in enumerate(a[1:])])
    value = f"{t}[({idx},)]" if len(a[1:]) <= 1 else f"{t}[{idx}]"
    if n.dtype is DType.BOOL:
        return value
    return f"{value}.to({_TYPES[n.dtype]})"


_LEAVES = {Op.SCORE: "score", Op.B: "b", Op.H: "h", Op.Q_IDX: "q_idx", Op.KV_IDX: "kv_idx"}
# float(q_idx) and float(kv_idx) arrive as arguments: the kernel forms them as one converted
# base plus compile-time offsets, where a conversion per score element would load the MUFU
# pipe as much as exp2 does (see passes._float_index_graphs).
_FLOAT_LEAVES = {Op.Q_IDX: "q_idx_f", Op.KV_IDX: "kv_idx_f"}


def _float_index_pair(n: Node):
    """(a, b) when ``n`` is float(a) - float(b) for index leaves a, b, else None."""
    if all(s.op is Op.CAST and s.dtype is DType.FLOAT32 and s.src[0].op in _FLOAT_LEAVES
           for s in n.src):
        return tuple(s.src[0].op for s in n.src)
    return None


def render_function(name: str, params: str, *roots: Node) -> str:
    """One straight-line function computing ``roots`` (a tuple if several, sharing common
    subexpressions); each non-leaf node is one statement. What is uniform over a tile (varies
    with neither index nor the score: ALiBi's slope load, a captured tensor's extent) goes into
    ``<name>.hoisted(b, h, aux)``, which a kernel calls once per tile and passes on as
    ``hoisted=``: traced per element, it was a third of a forward's IR."""
    body, names = _render_body(roots)
    body.returns = [names[id(r)] for r in roots]
    return _wrap(name, params, body)


class _Body:
    """A function's statements: ``uniform`` (the hoisted part, ``u`` names) and ``element``."""

    def __init__(self):
        self.uniform: list[str] = []
        self.element: list[str] = []
        self.returns: list[str] = []


def _wrap(name: str, params: str, body: "_Body") -> str:
    used = " ".join(body.element + body.returns)
    shared = [line.split(" = ")[0].strip() for line in body.uniform]
    shared = [u for u in shared if _mentions(used, u)]
    lines = []
    if shared:
        lines.append(f"def _{name}_hoisted(b, h, aux):")
        lines += body.uniform
        lines.append(f"    return ({', '.join(shared)},)\n\n")
    lines.append(f"def {name}({params}, {', '.join(_FLOAT_PARAMS)}, hoisted=None):")
    if shared:
        lines.append(f"    {', '.join(shared)}, = _{name}_hoisted(b, h, aux) if hoisted is None "
                     "else hoisted")
    lines += body.element
    lines.append(f"    return {', '.join(body.returns)}")
    floats = tuple(p for p in _FLOAT_PARAMS if _mentions(used, p))
    return ("\n".join(lines) + "\n\n\n" f"{name}.float_indices = {floats!r}\n"
            f"{name}.hoisted = {f'_{name}_hoisted' if shared else None}\n")


_FLOAT_PARAMS = ("q_idx_f", "kv_idx_f", "kv_minus_q_f", "kv_minus_q_parts")


def _mentions(text: str, var: str) -> bool:
    return re.search(rf"\b{var}\b", text) is not None


def _is_kv_minus_q(n: Node) -> bool:
    return n.op is Op.SUB and _float_index_pair(n) == (Op.KV_IDX, Op.Q_IDX)


def _scaled_kv_minus_q(n: Node, memo: dict):
    """For ``X * float(kv - q)`` (either order) with X the same for every element of a tile
    (ALiBi's slope): X's node, else None. The kernel forms it as fma(X, offset, X * base).
    ``memo``: ``ir.varies_with``'s."""
    if n.op is not Op.MUL or not n.dtype.is_float:
        return None
    a, b = n.src
    if _is_kv_minus_q(b) and not ir.varies_with(a, memo):
        return a
    if _is_kv_minus_q(a) and not ir.varies_with(b, memo):
        return b
    return None


def _render_body(roots) -> tuple["_Body", dict[int, str]]:
    """The statements computing ``roots`` and the name of every node's value."""
    names: dict[int, str] = {}
    body = _Body()
    exact = exact_float_nodes(list(roots))
    varies = {}  # ir.varies_with's memo
    hoisted: dict[str, str] = {}  # a uniform expression -> its name

    def hoist(expr: str) -> str:
        if expr not in hoisted:
            hoisted[expr] = f"u{len(body.uniform)}"
            body.uniform.append(f"    {hoisted[expr]} = {expr}")
        return hoisted[expr]

    def load_indices(n: Node, args: list[str]) -> list[str]:
        """A varying load's clamped indices: a uniform one whole, once per tile; a varying one
        against its dim's size, read once per tile."""
        t = f"aux.tensors[{n.src[0].arg[0]}]"
        return [hoist(f"_index({a}, {t}.shape[{d}])") if not ir.varies_with(i, varies) else
                f"_index({a}, {hoist(f'_extent({t}.shape[{d}])')})"
                for d, (i, a) in enumerate(zip(n.src[1:], args[1:]))]

    for n in ir.toposort(list(roots)):
        if n.op in _LEAVES:
            names[id(n)] = _LEAVES[n.op]
        elif n.op is Op.CAST and n.dtype is DType.FLOAT32 and n.src[0].op in _FLOAT_LEAVES:
            names[id(n)] = _FLOAT_LEAVES[n.src[0].op]
        elif _is_kv_minus_q(n):
            names[id(n)] = "kv_minus_q_f"
        elif n.op is Op.CONST:
            names[id(n)] = _const(n)
        elif n.op is Op.SCALAR:
            names[id(n)] = f"aux.scalars[{n.arg}]"
        elif n.op is Op.BUFFER:
            names[id(n)] = ""
        else:
            args = [names[id(s)] for s in n.src]
            uniform = not ir.varies_with(n, varies)
            scale = _scaled_kv_minus_q(n, varies)
            if scale is not None:  # X * (base + offset) as one FFMA; X * base is shared
                x = names[id(scale)]
                expr = f"cute.fma({x}, kv_minus_q_parts[1], {x} * kv_minus_q_parts[0])"
            elif n.op is Op.LOAD:
                expr = _load(n, args, None if uniform else load_indices(n, args))
            elif n.op in ir.TRANSCENDENTAL:
                expr = _OPS[n.op](n, args, fast=id(n) not in exact)
            elif n.op is Op.DIV and id(n) not in exact:  # div.full.f32: 2 ulp, no slow path
                expr = f"cute.math.div({args[0]}, {args[1]}, full=True)"
            else:
                expr = _OPS[n.op](n, args)
            lines = body.uniform if uniform else body.element
            var = f"{'u' if uniform else 't'}{len(lines)}"
            lines.append(f"    {var} = {expr}")
            names[id(n)] = var
    return body, names


_HEADER = '''"""Generated by flexjit (CuTeDSL sm90). score_mod `{score}`, mask_mod `{mask}`.
Program key {key}."""
import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64
from cutlass._mlir_helpers import arith as _arith


def _index(i, n):
    # Python semantics for a negative index, then clamped: never an out-of-bounds read.
    j = Int32(cutlass.select_(i < 0, i + n, i))
    return Int32(cutlass.min(cutlass.max(j, Int32(0)), n - 1))


def _extent(n):
    # A tensor's size as a plain i32: a shape element keeps cute's integer-tuple form, whose
    # every use in _index would build tuple operations for the compiler to fold.
    if isinstance(n, int):
        return n
    return Int32(_arith.ArithValue(Int32(n).ir_value(), True))

'''


def render(program: Program) -> str:
    """The generated module's source: ``score_mod``, ``mask_mod`` and ``score_mod_and_grad``
    (each may be None)."""
    parts = [_HEADER.format(score=program.score_name, mask=program.mask_name, key=program.key)]
    if program.score is not None:
        parts.append(render_function("score_mod", "score, b, h, q_idx, kv_idx, aux", program.score))
    else:
        parts.append("score_mod = None\n")
    parts.append("\n")
    if program.mask is not None:
        parts.append(render_function("mask_mod", "b, h, q_idx, kv_idx, aux", program.mask))
        parts.append(_render_rows(program.mask))
    else:
        parts.append("mask_mod = None\n")
    parts.append("\n")
    # For a backward kernel: the modded score and d(score_mod)/d(score) together, sharing work
    # (softcap's tanh serves both). Gradients of captured tensors: render_captured_grads.
    if program.score is not None:
        parts.append(render_function("score_mod_and_grad", "score, b, h, q_idx, kv_idx, aux",
                                     program.score, program.dscore))
    else:
        parts.append("score_mod_and_grad = None\n")
    if program.grad_loads:
        parts.append("\n")
        parts.append(render_captured_grads(program))
    return "".join(parts)


def _render_rows(mask: Node) -> str:
    """``mask_mod.rows``: the mask's kept keys of a row as one interval (``ir.kv_range``), a
    function returning (lo, hi) with ``.bounds`` (which sides exist); None where the mask has
    no such form. A kernel masks a partial tile with it at one compare per element."""
    iv = kv_interval(mask)
    if iv is None:
        return "\nmask_mod.rows = None\n"
    lo = iv.lo if iv.lo is not None else ir.const(-BIG, DType.INT64)
    hi = iv.hi if iv.hi is not None else ir.const(BIG, DType.INT64)
    return ("\n" + render_function("mask_rows", "b, h, q_idx, kv_idx, aux", lo, hi)
            + f"mask_rows.bounds = ({iv.lo is not None}, {iv.hi is not None})\n"
            "mask_mod.rows = mask_rows\n")


def unit_dscore(program: Program) -> bool:
    """Whether the score_mod's derivative d score/d score is the constant 1."""
    dscore = program.dscore
    return dscore is not None and dscore.op is Op.CONST and float(dscore.arg) == 1.0


def grad_slots(program: Program) -> list[int]:
    """The captured tensors (slots) that receive a gradient, in the order of the kernel's fp64
    accumulators."""
    return sorted({g.slot for g in program.grad_loads})


def _grad_roots(program: Program) -> list[Node]:
    roots = [g.grad for g in program.grad_loads] + [i for g in program.grad_loads for i in g.load.src[1:]]
    return roots + ([program.dscore] if program.dscore is not None else [])


def captured_grads_in_kernel(program: Program) -> tuple[bool, str]:
    """Whether the sm90 backward can accumulate this program's captured-tensor gradients
    itself. It re-evaluates d score/d load, d score/d score and the loads' indices after the dP
    GEMM, when the raw score is no longer in registers: none of them may depend on the score
    (additive biases, ALiBi, relative-position tables qualify; ``score * scale[h]`` does not)."""
    if any(n.op is Op.SCORE for n in ir.toposort(_grad_roots(program))):
        return False, ("d score_mod / d captured tensor (or d score_mod / d score) depends on the "
                       "score itself")
    return True, "the sm90 backward accumulates them"


def render_captured_grads(program: Program) -> str:
    """For the backward's captured-tensor gradients (``Program.grad_loads``), two functions
    evaluated per score element after the dP GEMM:

    * ``score_grads(b, h, q_idx, kv_idx, aux, ..)`` -> (d score/d score, d score/d load 0, ..);
      ``.unit_dscore`` says the first is the constant 1;
    * ``grad_offsets(b, h, q_idx, kv_idx, aux, ..)`` -> each load's flat row-major offset into
      its tensor (indices wrapped and clamped as the load reads them); ``.uniform[j]``: load j's
      offset varies with neither q_idx nor kv_idx (the kernel then reduces over a warp before
      one atomic); ``.acc[j]``: which fp64 accumulator (the position of the load's slot in
      ``grad_slots``) receives it.

    Both are None where ``captured_grads_in_kernel`` says no (the Triton backward serves)."""
    ok, _ = captured_grads_in_kernel(program)
    if not ok:
        return "score_grads = None\ngrad_offsets = None\n"
    params = "b, h, q_idx, kv_idx, aux"
    dscore = program.dscore
    roots = [dscore] + [g.grad for g in program.grad_loads]
    parts = [render_function("score_grads", params, *roots)]
    parts.append(f"score_grads.unit_dscore = {unit_dscore(program)}\n\n")
    index_roots = [i for g in program.grad_loads for i in g.load.src[1:]]
    body, names = _render_body(index_roots)
    offsets, uniform, varies = [], [], {}
    for j, g in enumerate(program.grad_loads):
        t = f"aux.tensors[{g.slot}]"
        idx = g.load.src[1:]
        var = f"o{j}"
        if not idx:
            body.element.append(f"    {var} = Int32(0)")
        for d, i in enumerate(idx):
            term = f"_index({names[id(i)]}, {t}.shape[{d}])"
            body.element.append(f"    {var} = {term}" if d == 0 else
                                f"    {var} = {var} * {t}.shape[{d}] + {term}")
        offsets.append(var)
        uniform.append(not any(ir.varies_with(i, varies) for i in idx))
    body.returns = [f"{', '.join(offsets)},"]
    parts.append(_wrap("grad_offsets", params, body))
    slots = grad_slots(program)
    parts.append(f"grad_offsets.uniform = {tuple(uniform)!r}\n")
    parts.append(f"grad_offsets.acc = {tuple(slots.index(g.slot) for g in program.grad_loads)!r}\n")
    return "".join(parts)
