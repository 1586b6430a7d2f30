"""The Triton backend's renderer: a Program's IR as Triton source text in the templates' holes.

What this module holds
----------------------
* The lowering: an op→code table (``_OPS``, and ``_EXACT_OPS`` for the correctly rounded forms)
  over ``_Lowering``, which turns one or more IR roots into straight-line SSA Triton statements,
  sharing common subexpressions (the IR is interned, so equal nodes render once).
* The holes: ``render_holes(program, which)`` gives the lines of every ``# {{HOLE}}`` of
  ``templates/triton/{fwd,bwd}.py`` (captured parameters, the score/mask bodies, the captured
  tensors' gradient atomics); ``fill`` pastes them in; ``render`` returns the whole module,
  with ``templates/triton/common.py`` pasted at ``# {{COMMON}}``.
* The kernel parameters the captures become (``capture_names``, ``grad_names``,
  ``buffer_ranks``, ``grad_slots``), which the launches pass in the same order.

Semantics follow ``flexjit.interp`` exactly where it matters for masks: integer ``//`` and ``%``
floor (Python), negative indices wrap, every captured-tensor index is clamped into range (a
guard for the discarded rows past L and S: ``ir.bounds.check`` raised for any index out of range
in the call before launch), and
float ops that feed a discontinuity (a comparison, floor, a cast to int, an index) use the
correctly rounded forms (div_rn, sqrt_rn, libdevice) so block masks agree with the planner.
Pure text: nothing here imports Triton.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from importlib import resources

from flexjit.ir import nodes as ir
from flexjit.ir.nodes import DType, Node, Op
from flexjit.ir.program import Program
from flexjit.ir.passes import exact_float_nodes


# --------------------------------------------------------------------------- lowering


@dataclasses.dataclass
class _Load:
    """What the gradient atomics of a load need: the clamped index names of each dim."""
    slot: int
    indices: list[str]


def _nonneg(n: Node, memo: dict) -> bool:
    """A sound 'is never negative' for integer nodes (scalars and loads are unknown)."""
    if id(n) in memo:
        return memo[id(n)]
    op = n.op
    if op in (Op.B, Op.H, Op.Q_IDX, Op.KV_IDX):
        r = True
    elif op is Op.CONST:
        r = not isinstance(n.arg, float) or not math.isnan(n.arg)
        r = r and n.arg >= 0
    elif op in (Op.ADD, Op.MUL, Op.MIN, Op.AND):
        r = all(_nonneg(s, memo) for s in n.src)
    elif op is Op.MAX:
        r = any(_nonneg(s, memo) for s in n.src)
    elif op in (Op.FLOORDIV, Op.MOD):
        r = _nonneg(n.src[0], memo) and _positive_const(n.src[1])
    elif op is Op.WHERE:
        r = _nonneg(n.src[1], memo) and _nonneg(n.src[2], memo)
    elif op is Op.CAST:
        r = n.src[0].dtype is DType.BOOL or (n.src[0].dtype.is_int and _nonneg(n.src[0], memo))
    else:
        r = n.dtype is DType.BOOL
    memo[id(n)] = r
    return r


def _positive_const(n: Node) -> bool:
    return n.op is Op.CONST and not isinstance(n.arg, bool) and n.arg > 0


_TL_TYPE = {DType.BOOL: "tl.int1", DType.INT32: "tl.int32", DType.INT64: "tl.int64",
            DType.FLOAT32: "tl.float32"}
_FLOAT_STORAGE = ("float16", "bfloat16", "float32", "float64")

# op -> code for the fast path; "{0}", "{1}", "{2}" are the operands' names.
_OPS = {
    Op.ADD: "{0} + {1}", Op.SUB: "{0} - {1}", Op.MUL: "{0} * {1}", Op.DIV: "{0} / {1}",
    Op.NEG: "-{0}", Op.ABS: "tl.abs({0})",
    Op.EXP: "tl.exp({0})", Op.EXP2: "tl.exp2({0})", Op.LOG: "tl.log({0})", Op.LOG2: "tl.log2({0})",
    Op.TANH: "_tanh({0}, FAST_MATH)", Op.SIGMOID: "1.0 / (1.0 + tl.exp(-{0}))", Op.SQRT: "tl.sqrt({0})",
    Op.RSQRT: "tl.rsqrt({0})", Op.SIN: "tl.sin({0})", Op.COS: "tl.cos({0})",
    Op.FLOOR: "tl.floor({0})", Op.CEIL: "tl.ceil({0})", Op.POW: "libdevice.pow({0}, {1})",
    Op.ROUND: "libdevice.rint({0})", Op.TRUNC: "libdevice.trunc({0})", Op.TAN: "libdevice.tan({0})",
    Op.ATAN: "libdevice.atan({0})", Op.SINH: "libdevice.sinh({0})", Op.COSH: "libdevice.cosh({0})",
    Op.ASIN: "libdevice.asin({0})", Op.ACOS: "libdevice.acos({0})", Op.LOG1P: "libdevice.log1p({0})",
    Op.EXPM1: "libdevice.expm1({0})", Op.ERF: "tl.erf({0})", Op.ATAN2: "libdevice.atan2({0}, {1})",
    # rounds to nearest even (Triton's default downcast; the interpreter's: sources.py)
    Op.ROUND_F16: "{0}.to(tl.float16).to(tl.float32)", Op.ROUND_BF16: "{0}.to(tl.bfloat16).to(tl.float32)",
    Op.FMOD: "{0} % {1}",  # C's remainder on ints and floats: torch.fmod's
    Op.LT: "{0} < {1}", Op.LE: "{0} <= {1}", Op.GT: "{0} > {1}", Op.GE: "{0} >= {1}",
    Op.EQ: "{0} == {1}", Op.NE: "{0} != {1}",
    Op.AND: "{0} & {1}", Op.OR: "{0} | {1}", Op.XOR: "{0} ^ {1}",
    Op.WHERE: "tl.where({0}, {1}, {2})",
}
# Correctly rounded forms, used where a float result feeds a discontinuity.
_EXACT_OPS = {
    Op.DIV: "tl.div_rn({0}, {1})", Op.SQRT: "tl.sqrt_rn({0})", Op.EXP: "libdevice.exp({0})",
    Op.EXP2: "libdevice.exp2({0})", Op.LOG: "libdevice.log({0})", Op.LOG2: "libdevice.log2({0})",
    Op.TANH: "libdevice.tanh({0})", Op.RSQRT: "libdevice.rsqrt({0})", Op.SIN: "libdevice.sin({0})",
    Op.COS: "libdevice.cos({0})", Op.SIGMOID: "tl.div_rn(1.0, 1.0 + libdevice.exp(-{0}))",
}


class _Lowering:
    """Straight-line Triton statements for IR roots; one instance per rendered function body.

    Leaves map to the template's names: ``score``, ``off_b``, ``off_h``, ``q_idx``, ``kv_idx``,
    ``scalar<i>`` and ``buf<i>_ptr``/``_size<d>``/``_stride<d>``. Every other node becomes a
    temporary ``t<k>`` computed once.
    """

    def __init__(self, roots: list[Node], prefix: str = "t", heads_vary: bool = False):
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.loads: dict[int, _Load] = {}
        self.prefix = prefix
        self.exact = exact_float_nodes(roots)
        self.sign: dict = {}
        self.varies: dict = {}  # ir.varies_with's memo
        if heads_vary:  # the decode tile's rows span query heads: ``off_h`` is a row vector there
            self.varies.update((id(n), frozenset({"q"})) for n in ir.toposort(roots) if n.op is Op.H)
        self.clamped: dict[tuple[int, int, int], str] = {}  # (slot, dim, index node) -> name
        self._count = 0

    def _tmp(self, code: str) -> str:
        name = f"{self.prefix}{self._count}"
        self._count += 1
        self.lines.append(f"{name} = {code}")
        return name

    def value(self, n: Node) -> str:
        """The name (or literal) holding n's value, emitting its statements first."""
        for m in ir.toposort([n]):
            if id(m) not in self.names and m.op is not Op.BUFFER:
                self.names[id(m)] = self._node(m)
        return self.names[id(n)]

    def _node(self, n: Node) -> str:
        op = n.op
        leaf = {Op.SCORE: "score", Op.B: "off_b", Op.H: "off_h", Op.Q_IDX: "q_idx", Op.KV_IDX: "kv_idx"}
        if op in leaf:
            return leaf[op]
        if op is Op.CONST:
            return _literal(n.arg, n.dtype)
        if op is Op.SCALAR:
            return f"scalar{n.arg}"
        if op is Op.LOAD:
            return self._load(n)
        a = [self.names[id(s)] for s in n.src]
        if op is Op.CAST:
            return self._cast(n, a[0])
        if op is Op.NOT:
            return self._tmp(f"{a[0]} == 0" if n.dtype is DType.BOOL else f"~{a[0]}")
        if op in (Op.FLOORDIV, Op.MOD):
            return self._floor_div_mod(n, a[0], a[1])
        if op in (Op.SHL, Op.SHR):
            return self._shift(n, a[0], a[1])
        if op in (Op.AND, Op.OR, Op.XOR) and n.dtype is DType.BOOL:
            mixed = self._uniform_and_block(n, a)
            if mixed is not None:
                return mixed
        if op in (Op.MAX, Op.MIN):
            if n.dtype is DType.BOOL:
                return self._tmp(f"{a[0]} | {a[1]}" if op is Op.MAX else f"{a[0]} & {a[1]}")
            fn = "tl.maximum" if op is Op.MAX else "tl.minimum"
            nan = ", propagate_nan=tl.PropagateNan.ALL" if n.dtype.is_float else ""
            return self._tmp(f"{fn}({a[0]}, {a[1]}{nan})")
        table = _EXACT_OPS if id(n) in self.exact and op in _EXACT_OPS else _OPS
        if op not in table:
            raise NotImplementedError(f"the Triton renderer has no rule for {op.value}")
        return self._tmp(table[op].format(*a))

    def _uniform_and_block(self, n: Node, a: list[str]) -> str | None:
        """A bool op of a value uniform over the tile (a scalar) and a block, as a select on the
        scalar: Triton's interpreter fails on ``block | scalar`` where the scalar compares a
        loaded float (``(q_idx <= c) | (tab[h] > 0)``). The same select on the GPU. None when
        both sides are alike."""
        uniform = [not ir.varies_with(s, self.varies) for s in n.src]
        if uniform[0] == uniform[1]:
            return None
        s, t = (a[0], a[1]) if uniform[0] else (a[1], a[0])
        code = {Op.OR: f"tl.where({s}, True, {t})", Op.AND: f"tl.where({s}, {t}, False)",
                Op.XOR: f"tl.where({s}, {t} == 0, {t})"}[n.op]
        return self._tmp(code)

    def _cast(self, n: Node, a: str) -> str:
        src = n.src[0]
        if src.op is Op.CONST:
            return _literal(src.arg, n.dtype)
        if n.dtype is DType.BOOL:
            return self._tmp(f"{a} != 0")
        return self._tmp(f"{a}.to({_TL_TYPE[n.dtype]})")

    def _floor_div_mod(self, n: Node, a: str, b: str) -> str:
        """Python's floor // and % (sign of the divisor); Triton's are C's (truncating)."""
        x, y = n.src
        if n.dtype.is_float:
            if n.op is Op.FLOORDIV:
                return self._tmp(f"tl.floor(tl.div_rn({a}, {b}))")
            r = self._tmp(f"{a} % {b}")  # fmod, the sign of the dividend
            if y.op is Op.CONST:
                fix = f"{r} < 0" if y.arg > 0 else f"{r} > 0"
            else:
                fix = f"({r} != 0) & (({r} < 0) != ({b} < 0))"
            return self._tmp(f"tl.where({fix}, {r} + {b}, {r})")
        if _nonneg(x, self.sign) and _positive_const(y):
            return self._tmp(f"{a} // {b}" if n.op is Op.FLOORDIV else f"{a} % {b}")
        r = self._tmp(f"{a} % {b}")
        if y.op is Op.CONST:  # C's remainder has the dividend's sign; fix it when it differs
            fix = self._tmp(f"{r} < 0" if y.arg > 0 else f"{r} > 0")
        else:
            fix = self._tmp(f"({r} != 0) & (({r} < 0) != ({b} < 0))")
        if n.op is Op.MOD:
            return self._tmp(f"tl.where({fix}, {r} + {b}, {r})")
        return self._tmp(f"tl.where({fix}, {a} // {b} - 1, {a} // {b})")

    def _shift(self, n: Node, a: str, b: str) -> str:
        """torch's shifts: an amount outside [0, bits) gives 0 (>>: -1 for a negative a), where
        Triton's (LLVM's) would be poison; >> on signed ints is arithmetic."""
        bits = 64 if n.dtype is DType.INT64 else 32
        sym = "<<" if n.op is Op.SHL else ">>"
        y = n.src[1]
        if y.op is Op.CONST and 0 <= y.arg < bits:
            return self._tmp(f"{a} {sym} {b}")
        shifted = self._tmp(f"{a} {sym} ({b} & {bits - 1})")
        ok = self._tmp(f"({b} >= 0) & ({b} < {bits})")
        other = "0" if n.op is Op.SHL else f"tl.where({a} < 0, -1, 0)"
        return self._tmp(f"tl.where({ok}, {shifted}, {other})")

    def _load(self, n: Node) -> str:
        slot, ndim, storage = n.src[0].arg
        idx = []
        for d, s in enumerate(n.src[1:]):
            idx.append(self._clamped(slot, d, s))
        self.loads[id(n)] = _Load(slot, idx)
        off = " + ".join(f"{i} * buf{slot}_stride{d}" for d, i in enumerate(idx))
        ptr = f"buf{slot}_ptr + {off}" if idx else f"buf{slot}_ptr"
        val = f"tl.load({ptr})"
        if storage == "bool":
            return self._tmp(f"{val} != 0")
        if storage in _FLOAT_STORAGE and storage != "float32":
            return self._tmp(f"{val}.to(tl.float32)")
        if storage in ("int8", "int16", "uint8"):
            return self._tmp(f"{val}.to(tl.int32)")
        return self._tmp(val)

    def _clamped(self, slot: int, d: int, s: Node) -> str:
        """Index s into dim d of buffer slot: wrapped if negative (Python), then clamped into
        [0, size-1]. The clamp is a memory-safety guard, not a semantics: ``ir.bounds.check``
        has raised before launch for any index out of range in the call, so it only keeps
        rows/columns past L/S (computed, then discarded) in bounds."""
        key = (slot, d, id(s))
        if key not in self.clamped:
            i, size = self.names[id(s)], f"buf{slot}_size{d}"
            if not _nonneg(s, self.sign):
                i = self._tmp(f"tl.where({i} < 0, {i} + {size}, {i})")
                i = self._tmp(f"tl.minimum(tl.maximum({i}, 0), {size} - 1)")
            else:
                i = self._tmp(f"tl.minimum({i}, {size} - 1)")
            self.clamped[key] = i
        return self.clamped[key]

    def assign(self, targets: list[tuple[str, Node]]) -> list[str]:
        """Statements computing every root, then one assignment of all targets."""
        vals = [self.value(n) for _, n in targets]
        if targets:
            lhs = ", ".join(t for t, _ in targets)
            self.lines.append(f"{lhs} = {', '.join(vals)}")
        return self.lines


def _literal(v, dt: DType) -> str:
    if dt is DType.BOOL:
        return "True" if v else "False"
    if dt.is_float:
        v = float(v)
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else 'float("-inf")'
        return repr(v)
    if dt is DType.INT64:
        return f"tl.full([], {int(v)}, tl.int64)"
    return repr(int(v))


# --------------------------------------------------------------------------- rendering


def grad_slots(p: Program) -> list[int]:
    return sorted({g.slot for g in p.grad_loads})


def buffer_ranks(p: Program) -> dict[int, int]:
    """slot -> rank of every captured tensor the graphs read. Taken from the IR (which the cache
    key covers), not from the tensors: a tensor no graph reads is not passed at all."""
    roots = tuple(r for r in (p.score, p.mask, p.dscore) if r is not None) + \
        tuple(g.grad for g in p.grad_loads)
    ranks = _RANKS.get(roots)  # graphs are interned: the same mods give the same roots
    if ranks is None:
        if len(_RANKS) > 4096:
            _RANKS.clear()
        ranks = _RANKS[roots] = dict(sorted((n.arg[0], n.arg[1]) for n in ir.toposort(list(roots))
                                            if n.op is Op.BUFFER))
    return ranks


_RANKS: dict[tuple, dict[int, int]] = {}


def capture_names(p: Program) -> list[str]:
    """Kernel parameters for the captures, in launch order (buffers, then scalars)."""
    names = []
    for slot, ndim in buffer_ranks(p).items():
        names.append(f"buf{slot}_ptr")
        names += [f"buf{slot}_size{d}" for d in range(ndim)]
        names += [f"buf{slot}_stride{d}" for d in range(ndim)]
    names += [f"scalar{i}" for i in range(len(p.scalars))]
    return names


def grad_names(p: Program) -> list[str]:
    names = []
    ranks = buffer_ranks(p)
    for slot in grad_slots(p):
        names.append(f"gbuf{slot}_ptr")
        names += [f"gbuf{slot}_stride{d}" for d in range(ranks[slot])]
    return names


def _unspecialized(names: list[str]) -> list[str]:
    return [n for n in names if not n.endswith("_ptr")]


def _score_roots(p: Program, with_derivatives: bool) -> list[tuple[str, Node]]:
    if p.score is None:
        return []
    roots = [("score", p.score)]
    if with_derivatives:
        if p.dscore is not None and not (p.dscore.op is Op.CONST and p.dscore.arg == 1.0):
            roots.append(("dscore", p.dscore))
        roots += [(f"dload{i}", g.grad) for i, g in enumerate(p.grad_loads)]
    return roots


def _grad_atomics(p: Program, low: _Lowering) -> list[str]:
    """ds · d score_mod/d load, added at the load's clamped index into its fp64 accumulator
    (``_GRAD_ACC``; tl.atomic_add converts the fp32 value to the pointer's type).
    A value that varies with only q (or only kv, or neither) is summed over the other axis
    first, so one atomic per row (or column, or tile) replaces one per element."""
    lines = []
    memo: dict = {}
    for i, g in enumerate(p.grad_loads):
        load = low.loads[id(g.load)]
        grad = g.grad
        val = "ds" if grad.op is Op.CONST and grad.arg == 1.0 else f"ds * dload{i}"
        off = " + ".join(f"{ix} * gbuf{load.slot}_stride{d}" for d, ix in enumerate(load.indices))
        ptr = f"gbuf{load.slot}_ptr + {off}" if off else f"gbuf{load.slot}_ptr"
        deps = frozenset().union(*[ir.varies_with(s, memo) for s in g.load.src[1:]]) if g.load.src[1:] \
            else frozenset()
        lines.append(f"gv{i} = {val}")
        lines.append("if NEED_KEEP:")
        lines.append(f"    gv{i} = tl.where(mask, gv{i}, 0.0)")
        if deps == {"q", "kv"}:
            lines.append(f"tl.atomic_add({ptr}, gv{i}, sem=\"relaxed\")")
            continue
        if deps == {"q"}:
            lines.append(f"gv{i} = _sum(gv{i}, KV_AXIS, True)")
        elif deps == {"kv"}:
            lines.append(f"gv{i} = _sum(gv{i}, 1 - KV_AXIS, True)")
        else:
            lines.append(f"gv{i} = _sum(gv{i}, None, False)")
        lines.append(f"tl.atomic_add({ptr}, gv{i}, sem=\"relaxed\")")
    return lines


def render_holes(p: Program, which: str) -> dict[str, list[str]]:
    """The lines each hole of template ``which`` ("fwd", "bwd" or "decode") is replaced by."""
    caps = capture_names(p)
    holes = {"CAPTURE_PARAMS": [", ".join(caps) + ","] if caps else [],
             "CAPTURE_ARGS": [", ".join(caps) + ","] if caps else []}
    dns = _unspecialized(caps)
    if which == "bwd":
        grads = grad_names(p)
        holes["GRAD_PARAMS"] = [", ".join(grads) + ","] if grads else []
        holes["GRAD_ARGS"] = holes["GRAD_PARAMS"]
        dns += _unspecialized(grads)
    # The template's own LENGTH_ARGS (block-list strides, tile counts) stay unspecialised too.
    holes["DO_NOT_SPECIALIZE"] = [f"DO_NOT_SPECIALIZE = LENGTH_ARGS + {dns!r}"]
    heads_vary = which == "decode"
    score_low = _Lowering([n for _, n in _score_roots(p, which == "bwd")], "t", heads_vary)
    score_lines = score_low.assign(_score_roots(p, which == "bwd"))
    if p.score is not None and ir.varies_with(p.score, {}) != {"q", "kv"}:
        # A score that varies with neither index, or one (``h + 0.5``, ``q_idx * 0.01``), is a
        # scalar or a row or column: the softmax reduces a whole tile.
        score_lines.append("score = tl.full(qk.shape, 0.0, tl.float32) + score")
    holes["SCORE_BWD" if which == "bwd" else "SCORE_MOD"] = score_lines
    if p.mask is not None:
        holes["MASK_MOD"] = _Lowering([p.mask], "m", heads_vary).assign([("mask", p.mask)])
    if which == "bwd":
        holes["GRAD_ATOMICS"] = _grad_atomics(p, score_low) or ["pass"]
    return holes


_HOLE = re.compile(r"^(?P<indent>[ \t]*)(?P<code>.*?)#\s*\{\{(?P<name>[A-Z_]+)\}\}\s*$")


def fill(template: str, holes: dict[str, list[str]]) -> str:
    """Replace each line marked ``# {{NAME}}`` by ``holes[NAME]`` at the line's indentation.
    A hole not in ``holes`` keeps its default line (the template's own code, or nothing)."""
    out = []
    for line in template.splitlines():
        m = _HOLE.match(line)
        if m is None or m.group("name") not in holes:
            out.append(line)
            continue
        out += [m.group("indent") + text for text in holes[m.group("name")]]
    return "\n".join(out) + "\n"


@functools.lru_cache(maxsize=None)
def template_text(which: str) -> str:
    """The source of ``templates/triton/<which>.py``."""
    return (resources.files("flexjit.templates.triton") / f"{which}.py").read_text()


@functools.lru_cache(maxsize=None)
def _common_lines() -> tuple[str, ...]:
    """The shared helpers of templates/triton/common.py (after its imports), pasted at # {{COMMON}}."""
    text = template_text("common")
    return tuple(text[text.index("@triton.jit"):].rstrip("\n").splitlines())


def render(p: Program, which: str) -> str:
    """The full generated module source for template ``which`` ("fwd" or "bwd")."""
    header = (f"# Generated by flexjit from templates/triton/{which}.py; do not edit.\n"
              f"# score_mod: {p.score_name}  mask_mod: {p.mask_name}\n")
    # The shared helpers go in first: their own holes (``_score_tile``'s) are filled with the rest.
    pasted = fill(template_text(which), {"COMMON": list(_common_lines())})
    return header + fill(pasted, render_holes(p, which))
