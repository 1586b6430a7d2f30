"""The Triton backend: render a Program's IR into the Triton templates, compile, cache, launch.

What this module holds
----------------------
* The renderer: an op→code table (``_OPS``) over a small lowering (``_Lowering``) that turns
  one or more IR roots into straight-line SSA Triton statements, sharing common
  subexpressions (the IR is interned, so equal nodes render once). ``render(program, which)``
  fills the holes of ``templates/triton_{fwd,bwd}.py``.
* The compile cache: the rendered source is written to ``$FLEXJIT_CACHE_DIR/triton/<key>.py``
  (default ``~/.cache/flexjit/triton``; ``flexjit.cache``), imported with importlib (Triton
  needs a real file) and kept in memory by key. The key (``cache.kernel_key``) digests the
  Program's IR, which template, flexjit's sources and the Python/torch/Triton versions.
  Triton's own cache then compiles once per (dtype, head dim, block config, arch) under that
  source; captured sizes, strides and scalars are unspecialised arguments, so new values reuse
  the binary. ``FLEXJIT_DEBUG=1`` prints the generated path; ``FLEXJIT_DUMP_DIR`` keeps a
  readable copy of every generated kernel; ``FLEXJIT_POISON=1`` NaN-fills outputs (tests).
* Compile-only builds (``launches_for`` + ``compile_launch``): the exact launches a training
  step makes, built for any sm_XX without a GPU, specialised as Triton's launcher would.
* Block configurations (``fwd_config``/``bwd_config``): a static table per (arch, dtype, head dim),
  fitted to the mask's block size and to shared memory; ``kernel_options`` can override.
* The autograd Function and the backend interface ``supports(call)`` / ``run(call)``.

Semantics follow ``flexjit.interp`` exactly where it matters for masks: integer ``//`` and ``%``
floor (Python), negative indices wrap, every captured-tensor index is clamped into range, and
float ops that feed a discontinuity (a comparison, floor, a cast to int, an index) use the
correctly rounded forms (div_rn, sqrt_rn, libdevice) so block masks agree with the planner.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import math
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

from .. import cache, ir
from ..ir import DType, Node, Op
from ..passes import Program, exact_float_nodes

LOG2E = 1.4426950408889634
log = logging.getLogger("flexjit")
_INTERPRET_ENV = "TRITON_INTERPRET"

STATS = {"render": 0, "import": 0, "fwd_launch": 0, "bwd_launch": 0}
"""Counters: files rendered, modules imported and kernels launched by this process (tests)."""


def _interpreting() -> bool:
    return os.environ.get(_INTERPRET_ENV, "0") not in ("", "0", "false", "False")


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


def _depends(n: Node, memo: dict) -> frozenset:
    """Which of q_idx / kv_idx (or the score, meaning both) a value varies with."""
    if id(n) not in memo:
        if n.op is Op.Q_IDX:
            d = frozenset({"q"})
        elif n.op is Op.KV_IDX:
            d = frozenset({"kv"})
        elif n.op is Op.SCORE:
            d = frozenset({"q", "kv"})
        else:
            d = frozenset().union(*[_depends(s, memo) for s in n.src]) if n.src else frozenset()
        memo[id(n)] = d
    return memo[id(n)]


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

    def __init__(self, roots: list[Node], prefix: str = "t"):
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.loads: dict[int, _Load] = {}
        self.prefix = prefix
        self.exact = exact_float_nodes(roots)
        self.sign: dict = {}
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
        [0, size-1] so rows/columns past L/S (computed, then discarded) never read out of bounds."""
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


def _grad_slots(p: Program) -> list[int]:
    return sorted({g.slot for g in p.grad_loads})


def _buffer_ranks(p: Program) -> dict[int, int]:
    """slot -> rank of every captured tensor the graphs read. Taken from the IR (which the cache
    key covers), not from the tensors: a tensor no graph reads is not passed at all."""
    roots = [r for r in (p.score, p.mask, p.dscore) if r is not None] + [g.grad for g in p.grad_loads]
    return dict(sorted((n.arg[0], n.arg[1]) for n in ir.toposort(roots) if n.op is Op.BUFFER))


def capture_names(p: Program) -> list[str]:
    """Kernel parameters for the captures, in launch order (buffers, then scalars)."""
    names = []
    for slot, ndim in _buffer_ranks(p).items():
        names.append(f"buf{slot}_ptr")
        names += [f"buf{slot}_size{d}" for d in range(ndim)]
        names += [f"buf{slot}_stride{d}" for d in range(ndim)]
    names += [f"scalar{i}" for i in range(len(p.scalars))]
    return names


def grad_names(p: Program) -> list[str]:
    names = []
    ranks = _buffer_ranks(p)
    for slot in _grad_slots(p):
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
        deps = frozenset().union(*[_depends(s, memo) for s in g.load.src[1:]]) if g.load.src[1:] \
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
    """The lines each hole of template ``which`` ("fwd" or "bwd") is replaced by."""
    caps = capture_names(p)
    holes = {"CAPTURE_PARAMS": [", ".join(caps) + ","] if caps else [],
             "CAPTURE_ARGS": [", ".join(caps) + ","] if caps else []}
    dns = _unspecialized(caps)
    if which == "bwd":
        grads = grad_names(p)
        holes["GRAD_PARAMS"] = [", ".join(grads) + ","] if grads else []
        holes["GRAD_ARGS"] = holes["GRAD_PARAMS"]
        dns += _unspecialized(grads)
    holes["DO_NOT_SPECIALIZE"] = [f"DO_NOT_SPECIALIZE = {dns!r}"]
    score_low = _Lowering([n for _, n in _score_roots(p, which == "bwd")], "t")
    score_lines = score_low.assign(_score_roots(p, which == "bwd"))
    holes["SCORE_BWD" if which == "bwd" else "SCORE_MOD"] = score_lines
    if p.mask is not None:
        holes["MASK_MOD"] = _Lowering([p.mask], "m").assign([("mask", p.mask)])
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
    """The template source, from the installed package (flexjit.templates) or the checkout."""
    return (cache.templates_dir() / f"triton_{which}.py").read_text()


@functools.lru_cache(maxsize=None)
def _common_lines() -> tuple[str, ...]:
    """The shared helpers of templates/triton_common.py (after its imports), pasted at # {{COMMON}}."""
    text = template_text("common")
    return tuple(text[text.index("@triton.jit"):].rstrip("\n").splitlines())


def render(p: Program, which: str) -> str:
    """The full generated module source for template ``which`` ("fwd" or "bwd")."""
    header = (f"# Generated by flexjit from templates/triton_{which}.py; do not edit.\n"
              f"# score_mod: {p.score_name}  mask_mod: {p.mask_name}\n")
    holes = dict(render_holes(p, which), COMMON=list(_common_lines()))
    return header + fill(template_text(which), holes)


# --------------------------------------------------------------------------- compile cache


def cache_key(p: Program, which: str) -> str:
    """The generated file's identity: the Program's IR and the toolchain (flexjit's sources and
    templates by content, torch/triton versions). Dtype, head dim, block config and arch are
    Triton's own specialisation of that file (constexprs and target), cached by Triton."""
    return cache.kernel_key(p.key, f"triton-{which}", (), "any")


_MODULES: dict[tuple[str, bool], object] = {}
_TMP_DIR: list[Path] = []


def _source_dir() -> Path:
    if cache.enabled():
        return cache.cache_dir("triton")
    if not _TMP_DIR:  # FLEXJIT_CACHE=0: Triton still needs a real file; keep it per process
        _TMP_DIR.append(Path(tempfile.mkdtemp(prefix="flexjit-triton-")))
    return _TMP_DIR[0]


@contextlib.contextmanager
def _interpret_env(interpret: bool):
    """TRITON_INTERPRET set to ``interpret`` for a block (decorating, or compiling: Triton's
    code generator misbehaves when the variable is on)."""
    previous = os.environ.get(_INTERPRET_ENV)
    os.environ[_INTERPRET_ENV] = "1" if interpret else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[_INTERPRET_ENV]
        else:
            os.environ[_INTERPRET_ENV] = previous


@functools.lru_cache(maxsize=None)
def _interpreter_libdevice():
    """libdevice for the interpreter, where Triton's libdevice stubs return None: the same
    functions from ``tl`` ops, which the interpreter evaluates with numpy in float32."""
    import types

    _import_triton()
    import triton.language as tl

    def tanh(x):
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    def pow(a, b):  # torch.pow for real results: negative bases need integral exponents
        a, b = a + b * 0.0, b + a * 0.0  # both tensors of the broadcast shape
        r = tl.exp2(b * tl.log2(tl.abs(a)))
        odd = tl.floor(b * 0.5) * 2.0 != b
        r = tl.where((a < 0) & odd, -r, r)
        r = tl.where((a < 0) & (tl.floor(b) != b), float("nan"), r)
        return tl.where(b == 0, 1.0, r)

    # Looked up at call time: the interpreter patches tl's builtins only while a kernel runs.
    ns = {name: (lambda name: lambda x: getattr(tl, name)(x))(name)
          for name in ("exp", "exp2", "log", "log2", "sin", "cos", "rsqrt")}
    return types.SimpleNamespace(tanh=tanh, pow=pow, **ns)


def _import_triton():
    """Import Triton itself compiled, whatever TRITON_INTERPRET says: its own jit helpers are
    fixed at import, and only compiled ones let one process both build kernels and interpret
    ours (the templates call no library jit function, so interpreted kernels work either way)."""
    if "triton" not in sys.modules:
        with _interpret_env(False):
            import triton.language  # noqa: F401
            from triton.language.extra import libdevice  # noqa: F401


def load_module(p: Program, which: str, interpret: bool | None = None):
    """The imported generated module for (program, template), rendering it on a miss."""
    interpret = _interpreting() if interpret is None else interpret
    _import_triton()
    key = cache_key(p, which)
    mod = _MODULES.get((key, interpret))
    if mod is not None:
        return mod
    path = _source_dir() / f"{key}.py"
    if not path.exists():
        source = render(p, which)
        STATS["render"] += 1
        cache.atomic_write(path, source)
        dump = os.environ.get("FLEXJIT_DUMP_DIR")
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            (Path(dump) / f"{p.score_name}__{p.mask_name}__{key[:12]}_{which}.py").write_text(source)
    if os.environ.get("FLEXJIT_DEBUG"):
        print(f"[flexjit] triton {which} kernel for {p.score_name}/{p.mask_name}: {path}")
    name = f"flexjit_triton_{key}{'_interp' if interpret else ''}"
    with _interpret_env(interpret):  # triton.jit reads it at decoration
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    if interpret:
        mod.libdevice = _interpreter_libdevice()
    STATS["import"] += 1
    _MODULES[(key, interpret)] = mod
    return mod


def triton_compiles(mod) -> int:
    """Compiled binaries Triton holds for a generated module's kernels (0 under the interpreter)."""
    total = 0
    for fn in (getattr(mod, n, None) for n in ("flex_fwd", "flex_bwd", "flex_bwd_preprocess")):
        caches = getattr(fn, "device_caches", None)
        if caches is not None:
            total += sum(len(c[0]) for c in caches.values())
        elif isinstance(getattr(fn, "cache", None), dict):
            total += sum(len(c) for c in fn.cache.values())
    return total



# --------------------------------------------------------------------------- configurations


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    BLOCK_M1: int  # query sub-tile walked by the dK/dV role
    BLOCK_N1: int  # key tile owned by the dK/dV role
    BLOCK_M2: int  # query tile owned by the dQ role
    BLOCK_N2: int  # key sub-tile walked by the dQ role
    num_warps: int
    num_stages: int


# Forward (BLOCK_M, BLOCK_N, num_warps, num_stages) by (arch class, 16-bit inputs, padded head
# dim). Chosen compile-only (triton 3.9) as the largest tiles ptxas fits without spilling for a
# mask + score_mod kernel (softcap + ALiBi + window), within shared memory:
# * sm90 (227 KB smem): 128x128 tiles, 8 warps = two warpgroups of 64 rows each (wgmma M=64),
#   3 stages = 3 K/V buffers in flight (224 KB at D=128); D=256 halves BLOCK_N and stages.
# * sm100: as sm90 but BLOCK_N 64 at D=128 (128x128 spills 128 B there).
# * sm80 (163 KB smem) and smaller parts: BLOCK_N 64 (the mma.sync register budget).
# fp32 inputs run IEEE fp32 dots (no tensor cores) and get small tiles.
_FWD_TABLE = {
    ("sm90", True, 64): (128, 128, 8, 3), ("sm90", True, 128): (128, 128, 8, 3),
    ("sm90", True, 256): (128, 64, 8, 2),
    ("sm100", True, 64): (128, 128, 8, 3), ("sm100", True, 128): (128, 64, 8, 3),
    ("sm100", True, 256): (128, 64, 8, 2),
    ("sm80", True, 64): (128, 64, 4, 3), ("sm80", True, 128): (128, 64, 8, 3),
    ("sm80", True, 256): (64, 64, 4, 2),
}
_FWD_FP32 = {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 2)}
# sm90, block masks whose query blocks visit at most SHORT_KV_LOOP keys on average (windows,
# short documents): 64x64 tiles, 4 warps, fewer registers per CTA, so several CTAs share an SM
# and one's prologue/epilogue hides under another's loop. Measured on the H200 at S=8k, D=128
# (results/2026-11-30-gpu-s2-triton-tune): sliding window 1024 1.30x the 128x128 default,
# document 1.04x; on causal-length loops (ALiBi, 32 blocks) only 1.02x, full attention 0.89x.
_FWD_SHORT_SM90 = (64, 64, 4, 3)
SHORT_KV_LOOP = 2048
# Backward (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages), same keys. The dK/dV
# role keeps a key tile's dK, dV in registers and streams query sub-tiles; the dQ role the
# mirror image (FlashAttention-2 §3.2). Both roles share one kernel, so registers are the max
# of the two. sm90 D=128: 64x128 spills 112 bytes (32x128 fits in 234 registers) and is still
# the fastest on the H200: 1.08-1.23x 32x128 on forward+backward at S=8k across full, causal,
# ALiBi, window and document (benchmarks/tune_triton.py, results/2026-11-30-gpu-s2-triton-tune).
_BWD_TABLE = {
    ("sm90", True, 64): (64, 128, 128, 64, 8, 3), ("sm90", True, 128): (64, 128, 128, 64, 8, 3),
    ("sm90", True, 256): (32, 32, 32, 32, 4, 2),
    ("sm100", True, 64): (64, 128, 128, 64, 8, 3), ("sm100", True, 128): (32, 128, 128, 32, 8, 3),
    ("sm100", True, 256): (32, 32, 32, 32, 4, 2),
    ("sm80", True, 64): (32, 128, 128, 32, 8, 3), ("sm80", True, 128): (64, 64, 64, 64, 8, 2),
    ("sm80", True, 256): (32, 32, 32, 32, 4, 2),
}
_BWD_FP32 = {64: (32, 64, 64, 32, 4, 2), 128: (32, 64, 64, 32, 4, 2), 256: (16, 32, 32, 16, 4, 2)}
_SMEM_BY_ARCH = {80: 163 << 10, 87: 163 << 10, 90: 227 << 10, 100: 227 << 10, 103: 227 << 10}


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def head_pad(d: int) -> int:
    """Head dims are padded to a power of two (>= 16, tl.dot's K minimum) and masked."""
    return max(16, _next_pow2(d))


def _pow2_divisor(x: int) -> int:
    return x & -x


def _fit_block(want: int, sparse: int | None, length: int) -> int:
    """The largest power of two <= want that divides the mask block and is not much longer
    than the sequence; at least 16."""
    b = min(_next_pow2(want), max(16, _next_pow2(length)))
    if sparse is not None:
        b = min(b, _pow2_divisor(sparse))
    return max(16, b)


def _user_block(opts: dict, names: tuple[str, ...], sparse: int | None) -> int | None:
    for n in names:
        if n in opts:
            b = int(opts[n])
            if b < 16 or b & (b - 1):
                raise ValueError(f"kernel_options[{n!r}] = {b}: must be a power of two >= 16")
            if sparse is not None and sparse % b:
                raise ValueError(f"kernel_options[{n!r}] = {b} must divide the block mask's block "
                                 f"size {sparse}; pick a divisor of {sparse}")
            return b
    return None


def _opt(opts: dict, names: tuple[str, ...], default):
    for n in names:
        if n in opts:
            return int(opts[n])
    return default


def _table_entry(table: dict, fp32: dict, arch: int, dtype: torch.dtype, e_pad: int) -> tuple:
    d = min(256, max(64, e_pad))
    if dtype == torch.float32:
        return fp32[d]
    cls = "sm90" if arch == 90 else "sm100" if arch in (100, 103) else "sm80"
    return table[(cls, True, d)]


def smem_limit(arch: int) -> int:
    return _SMEM_BY_ARCH.get(arch, 99 << 10)


def _fwd_smem(bm, bn, stages, e_pad, ev_pad, elem) -> int:
    return elem * (bm * e_pad + stages * bn * (e_pad + ev_pad))  # Triton keeps num_stages buffers


def _bwd_smem(c: "BwdConfig", e_pad, ev_pad, elem) -> int:
    buffers = c.num_stages
    role_kv = c.BLOCK_N1 * (e_pad + ev_pad) + buffers * c.BLOCK_M1 * (e_pad + ev_pad) \
        + c.BLOCK_M1 * c.BLOCK_N1
    role_q = c.BLOCK_M2 * (e_pad + ev_pad) + buffers * c.BLOCK_N2 * (e_pad + ev_pad) \
        + c.BLOCK_M2 * c.BLOCK_N2
    return elem * max(role_kv, role_q)


def _warps(want: int, bm: int, bn: int) -> int:
    return max(1, min(want, (bm * bn) // 512))


def fwd_config(arch: int, dtype, E: int, EV: int, L: int, S: int, sparse, opts: dict,
               short_kv_loop: bool = False) -> FwdConfig:
    """The forward's block config: table default, fitted to the mask blocks, lengths and smem;
    ``kernel_options`` (BLOCK_M, BLOCK_N, num_warps, num_stages, or fwd_-prefixed) override.
    ``short_kv_loop``: a block mask whose query blocks visit few keys (SHORT_KV_LOOP)."""
    e_pad, ev_pad = head_pad(E), head_pad(EV)
    bm, bn, warps, stages = _table_entry(_FWD_TABLE, _FWD_FP32, arch, dtype, max(e_pad, ev_pad))
    if short_kv_loop and arch == 90 and dtype != torch.float32 and max(e_pad, ev_pad) <= 128:
        bm, bn, warps, stages = _FWD_SHORT_SM90
    sq, skv = sparse if sparse is not None else (None, None)
    ubm = _user_block(opts, ("fwd_BLOCK_M", "BLOCK_M"), sq)
    ubn = _user_block(opts, ("fwd_BLOCK_N", "BLOCK_N"), skv)
    bm = ubm or _fit_block(bm, sq, L)
    bn = ubn or _fit_block(bn, skv, S)
    stages = _opt(opts, ("fwd_num_stages", "num_stages"), stages)
    elem = torch.finfo(dtype).bits // 8
    while "num_stages" not in opts and stages > 1 and \
            _fwd_smem(bm, bn, stages, e_pad, ev_pad, elem) > smem_limit(arch):
        stages -= 1
    while ubn is None and bn > 16 and _fwd_smem(bm, bn, stages, e_pad, ev_pad, elem) > smem_limit(arch):
        bn //= 2
    warps = _opt(opts, ("fwd_num_warps", "num_warps"), _warps(warps, bm, bn))
    return FwdConfig(bm, bn, warps, stages)


def bwd_config(arch: int, dtype, E: int, EV: int, L: int, S: int, sparse, opts: dict) -> BwdConfig:
    """The backward's block config (table, fitted like the forward's; kernel_options BLOCK_M1,
    BLOCK_N1, BLOCK_M2, BLOCK_N2, bwd_num_warps, bwd_num_stages override)."""
    e_pad, ev_pad = head_pad(E), head_pad(EV)
    m1, n1, m2, n2, warps, stages = _table_entry(_BWD_TABLE, _BWD_FP32, arch, dtype, max(e_pad, ev_pad))
    sq, skv = sparse if sparse is not None else (None, None)
    m1 = _user_block(opts, ("BLOCK_M1",), sq) or _fit_block(m1, sq, L)
    n1 = _user_block(opts, ("BLOCK_N1",), skv) or _fit_block(n1, skv, S)
    m2 = _user_block(opts, ("BLOCK_M2",), sq) or _fit_block(m2, sq, L)
    n2 = _user_block(opts, ("BLOCK_N2",), skv) or _fit_block(n2, skv, S)
    stages = _opt(opts, ("bwd_num_stages",), stages)
    c = BwdConfig(m1, n1, m2, n2, warps, stages)
    elem = torch.finfo(dtype).bits // 8
    while "bwd_num_stages" not in opts and c.num_stages > 1 and \
            _bwd_smem(c, e_pad, ev_pad, elem) > smem_limit(arch):
        c = dataclasses.replace(c, num_stages=c.num_stages - 1)
    warps = _opt(opts, ("bwd_num_warps",), _warps(warps, max(m1, m2), max(n1, n2)))
    return dataclasses.replace(c, num_warps=warps)


# --------------------------------------------------------------------------- launch


def arch_number(device: torch.device) -> int:
    """80, 90, 100, ... for a CUDA device; 80 for the interpreter (its tables are Ampere's)."""
    if device.type != "cuda":
        return 80
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _dot_precision(dtype: torch.dtype, interpret: bool) -> str:
    """tl.dot's input_precision: fp32 inputs stay IEEE unless torch allows TF32 (as torch's own
    matmuls do); the interpreter upcasts bf16 (see the templates' ``_dot``)."""
    if interpret and dtype == torch.bfloat16:
        return "interp-upcast"
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _bcast_strides(t: torch.Tensor) -> list[int]:
    """Strides with 0 on size-1 dims, so one offset formula serves B/H broadcast lists."""
    return [0 if n == 1 else s for n, s in zip(t.shape, t.stride())]


@dataclasses.dataclass
class _Lists:
    """Block lists as the kernels read them: int32, contiguous, broadcast strides."""
    num: torch.Tensor | None
    idx: torch.Tensor | None
    full_num: torch.Tensor | None
    full_idx: torch.Tensor | None

    @property
    def present(self) -> bool:
        return self.num is not None or self.full_num is not None

    def args(self, dummy: torch.Tensor) -> list:
        num = self.num if self.num is not None else self.full_num
        idx = self.idx if self.idx is not None else self.full_idx
        if num is None:
            return [dummy] * 4 + [0] * 7
        full_num = self.full_num if self.full_num is not None else num
        full_idx = self.full_idx if self.full_idx is not None else idx
        return [num if self.num is not None else dummy, idx if self.idx is not None else dummy,
                full_num, full_idx, *_bcast_strides(num), *_bcast_strides(idx)]


def _i32(t):
    return None if t is None else t.to(torch.int32).contiguous()


@dataclasses.dataclass
class Plan:
    """Everything about one call that is not a differentiable tensor."""
    program: Program
    scale: float
    kv_lists: _Lists
    q_lists: _Lists | None  # computed lazily for the backward
    block_mask: object
    sparse: tuple[int, int] | None
    fwd: FwdConfig
    kernel_options: dict
    arch: int
    interpret: bool
    fast_math: bool


def _capture_args(p: Program, bufs) -> list:
    """Run-time values for ``capture_names``: each read tensor (bool as uint8), its sizes and
    strides, then the scalars."""
    args = []
    for slot in _buffer_ranks(p):
        t = bufs[slot]
        args.append(t.view(torch.uint8) if t.dtype == torch.bool else t)
        args += list(t.shape) + list(t.stride())
    return args + list(p.scalars)


def _common_constexprs(plan: Plan, E: int, EV: int) -> dict:
    p = plan.program
    return dict(E=E, EV=EV, E_PAD=head_pad(E), EV_PAD=head_pad(EV),
                SPARSE_Q=plan.sparse[0] if plan.sparse else 16,
                SPARSE_KV=plan.sparse[1] if plan.sparse else 16,
                HAS_BLOCK_MASK=plan.sparse is not None,
                HAS_MASK_MOD=p.mask is not None, HAS_SCORE_MOD=p.score is not None,
                FAST_MATH=plan.fast_math)


@dataclasses.dataclass
class Launch:
    """One kernel launch: the kernel's name in the generated module, grid, positional run-time
    arguments (in the kernel's parameter order), constexprs and launch options. Real launches
    and compile-only builds (``compile_launch``) are made from the same object."""
    which: str
    kernel: str
    grid: tuple
    args: list
    constexprs: dict
    options: dict


def _options(num_warps: int, num_stages: int) -> dict:
    # FMA contraction on (Triton 3.9's default, to become opt-in in 3.10): the softmax's
    # scale-and-subtract and the O rescale are FMAs. Mask arithmetic is integer in practice.
    return dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True)


def fwd_launch(plan: Plan, q, k, v, out, lse, bufs) -> Launch:
    B, Hq, L, E = q.shape
    Hkv, S, EV = k.shape[1], k.shape[2], v.shape[3]
    c = plan.fwd
    lists = plan.kv_lists
    args = [q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            *lists.args(lse), Hq, L, S, Hq // Hkv, triton_cdiv(S, c.BLOCK_N),
            plan.scale, plan.scale * LOG2E, *_capture_args(plan.program, bufs)]
    consts = _common_constexprs(plan, E, EV)
    consts.update(BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, HAS_PARTIAL=lists.num is not None,
                  HAS_FULL=lists.full_num is not None, EVEN_M=L % c.BLOCK_M == 0,
                  EVEN_N=_even(S, c.BLOCK_N, plan.sparse, 1), DOT_PRECISION=_dot_precision(q.dtype, plan.interpret),
                  NUM_STAGES=c.num_stages)
    return Launch("fwd", "flex_fwd", (triton_cdiv(L, c.BLOCK_M), Hq, B), args, consts,
                  _options(c.num_warps, c.num_stages))


def _even(length: int, block: int, sparse, axis: int) -> bool:
    """Whether no tile a loop visits can reach past ``length`` (bounds checks compiled out).
    A walked block list visits every sub-tile of a listed mask block, so with a block mask
    the mask block must divide the length too (the last mask block may overhang it by more
    than one kernel tile)."""
    return length % block == 0 and (sparse is None or length % sparse[axis] == 0)


_STAGES_THAT_FIT: dict[tuple, int] = {}


def _run(plan: Plan, launch: Launch) -> None:
    """Launch; if Triton's real shared-memory use exceeds the estimate (a mod's loads can add
    layout-conversion buffers), retry with fewer pipeline stages and remember what fit."""
    mod = load_module(plan.program, launch.which, plan.interpret)
    kernel = getattr(mod, launch.kernel)
    key = (plan.program.key, launch.kernel, tuple(sorted(launch.constexprs.items())),
           tuple(sorted(launch.options.items())))
    stages = _STAGES_THAT_FIT.get(key, launch.options["num_stages"])
    while True:
        consts = dict(launch.constexprs)
        if "NUM_STAGES" in consts:
            consts["NUM_STAGES"] = stages
        try:
            kernel[launch.grid](*launch.args, **consts, **dict(launch.options, num_stages=stages))
        except Exception as e:  # triton.runtime.errors.OutOfResources (its module moved across versions)
            if type(e).__name__ != "OutOfResources" or stages <= 1:
                raise
            stages -= 1
            log.info("flexjit: %s needs more shared memory than it has; retrying with %d stages",
                     launch.kernel, stages)
            continue
        _STAGES_THAT_FIT[key] = stages
        return


def forward(plan: Plan, q, k, v, bufs) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel: out (B, Hq, L, EV) in q's dtype, lse (B, Hq, L) fp32."""
    B, Hq, L, _ = q.shape
    out = _out((B, Hq, L, v.shape[3]), q.dtype, q.device)
    lse = _out((B, Hq, L), torch.float32, q.device)
    _run(plan, fwd_launch(plan, q, k, v, out, lse, bufs))
    STATS["fwd_launch"] += 1
    return out, lse


def _out(shape, dtype, device) -> torch.Tensor:
    """An output buffer; NaN-filled under FLEXJIT_POISON=1 so an element no kernel writes shows."""
    if os.environ.get("FLEXJIT_POISON") == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _q_lists(plan: Plan) -> _Lists:
    """The transposed block lists (per key block: the query blocks), for the dK/dV role."""
    if plan.q_lists is None:
        bm = plan.block_mask
        qn, qi, fqn, fqi = bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices
        if qn is None:
            from ..block_mask import _transpose_ordered
            qn, qi = _transpose_ordered(bm.kv_num_blocks, bm.kv_indices)
            if bm.full_kv_num_blocks is not None:
                fqn, fqi = _transpose_ordered(bm.full_kv_num_blocks, bm.full_kv_indices)
        plan.q_lists = _Lists(_i32(qn), _i32(qi), _i32(fqn), _i32(fqi))
    return plan.q_lists


_PRE_BLOCK = 64

# The captured tensors' gradient accumulators. A table entry read at a clamped relative position
# (relative_bias: every kv - q <= -max_distance) receives one atomic per score, ~L·S/2 of them:
# in fp32 each add rounds the running sum (|sum| up to tens, ulp ~1e-6), and at L = S = 1024
# that summation error (2.5e-4) was the whole error of the gradient; fp64 sums leave only the
# per-score fp32 error of ds (1.6e-5 against a float64 oracle). Same atomic count, native
# red.global.add.f64 on sm_60+.
_GRAD_ACC = torch.float64


def preprocess_launch(plan: Plan, out, dout, lse, dlse, delta, lse2) -> Launch:
    B, Hq, L, EV = out.shape
    args = [out, dout, lse, dlse if dlse is not None else lse, delta, lse2, *out.stride(),
            *dout.stride(), Hq, L]
    consts = dict(EV=EV, EV_PAD=head_pad(EV), BLOCK=_PRE_BLOCK, HAS_DLSE=dlse is not None)
    return Launch("bwd", "flex_bwd_preprocess", (triton_cdiv(L, _PRE_BLOCK), Hq, B), args, consts,
                  _options(4, 1))


def bwd_launch(plan: Plan, c: BwdConfig, q, k, v, dout, lse2, delta, dq, dk, dv, bufs,
               grads: dict) -> Launch:
    B, Hq, L, E = q.shape
    Hkv, S, EV = k.shape[1], k.shape[2], v.shape[3]
    grad_args = []
    for g in grads.values():
        grad_args += [g, *g.stride()]
    kv_lists = plan.kv_lists
    q_lists = _q_lists(plan) if plan.sparse is not None else _Lists(None, None, None, None)
    n_kv, n_q, G = triton_cdiv(S, c.BLOCK_N1), triton_cdiv(L, c.BLOCK_M2), Hq // Hkv
    kv_args, q_args = kv_lists.args(delta), q_lists.args(delta)
    args = [q, k, v, dout, lse2, delta, dq, dk, dv, *q.stride(), *k.stride(), *v.stride(),
            *dout.stride(), *dq.stride(), *dk.stride(), *dv.stride(),
            *kv_args[:4], *q_args[:4], *kv_args[4:], *q_args[4:],
            Hq, L, S, G, n_kv, n_q, triton_cdiv(L, c.BLOCK_M1), triton_cdiv(S, c.BLOCK_N2),
            plan.scale, *_capture_args(plan.program, bufs), *grad_args]
    consts = _common_constexprs(plan, E, EV)
    consts.update(BLOCK_M1=c.BLOCK_M1, BLOCK_N1=c.BLOCK_N1, BLOCK_M2=c.BLOCK_M2, BLOCK_N2=c.BLOCK_N2,
                  HAS_PARTIAL=kv_lists.num is not None, HAS_FULL=kv_lists.full_num is not None,
                  ACC_GRADS=bool(grads),
                  EVEN_M=_even(L, max(c.BLOCK_M1, c.BLOCK_M2), plan.sparse, 0),
                  EVEN_N=_even(S, max(c.BLOCK_N1, c.BLOCK_N2), plan.sparse, 1),
                  DOT_PRECISION=_dot_precision(q.dtype, plan.interpret), NUM_STAGES=c.num_stages)
    return Launch("bwd", "flex_bwd", (n_kv + n_q * G, Hkv, B), args, consts,
                  _options(c.num_warps, c.num_stages))


def _backward(plan: Plan, q, k, v, out, lse, dout, dlse, bufs):
    """Launch preprocess + backward: (dq, dk, dv, grads of captured tensors by slot)."""
    B, Hq, L, E = q.shape
    S, EV = k.shape[2], v.shape[3]
    c = bwd_config(plan.arch, q.dtype, E, EV, L, S, plan.sparse, plan.kernel_options)
    delta = _out((B, Hq, L), torch.float32, q.device)
    lse2 = _out((B, Hq, L), torch.float32, q.device)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()  # autograd may hand an expanded (stride 0) grad
    _run(plan, preprocess_launch(plan, out, dout, lse, dlse, delta, lse2))
    dq = _out(q.shape, q.dtype, q.device)
    dk = _out(k.shape, k.dtype, k.device)
    dv = _out(v.shape, v.dtype, v.device)
    grads = {s: torch.zeros(bufs[s].shape, dtype=_GRAD_ACC, device=q.device)
             for s in _grad_slots(plan.program)}
    _run(plan, bwd_launch(plan, c, q, k, v, dout, lse2, delta, dq, dk, dv, bufs, grads))
    STATS["bwd_launch"] += 1
    return dq, dk, dv, grads


def backward(call, q, k, v, out, lse, dout, dlse) -> tuple:
    """(dq, dk, dv, *grads of the captured tensors) for a forward computed elsewhere (the CuTeDSL
    forward saves out and lse and borrows this backward); None for a tensor needing no grad."""
    bufs = [t.detach().to(q.device) for t in call.program.buffers]
    wanted = [t.requires_grad for t in call.program.buffers]
    return _gradients(make_plan(call), q, k, v, out, lse.float(), dout, dlse, bufs, wanted)


def _gradients(plan: Plan, q, k, v, out, lse, dout, dlse, bufs, wanted) -> tuple:
    """(dq, dk, dv, *captured-tensor grads), None where ``wanted`` says no grad is needed."""
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, grads = _backward(plan, q, k, v, out, lse, dout, dlse, bufs)
    dbufs = [grads[s].to(b.dtype) if s in grads and want else None
             for s, (b, want) in enumerate(zip(bufs, wanted))]
    return (dq, dk, dv, *dbufs)


class _FlexAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: Plan, q, k, v, *bufs):
        out, lse = forward(plan, q, k, v, bufs)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse, *bufs)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *bufs = ctx.saved_tensors
        wanted = ctx.needs_input_grad[4:]
        return (None, *_gradients(ctx.plan, q, k, v, out, lse, dout, dlse, bufs, wanted))


# --------------------------------------------------------------------------- compile-only

_SIG_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
              torch.float64: "fp64", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
              torch.int64: "i64", torch.uint8: "u8", torch.bool: "i1"}


def _sig_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _SIG_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2 ** 31) <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton signature type for {type(value).__name__}")


def compile_launch(plan: Plan, launch: Launch, arch: int):
    """Build one launch's kernel for ``sm_<arch>`` without a GPU (``triton.compile`` on an
    ``ASTSource``); returns Triton's compiled kernel (``.asm["ptx"]`` holds the PTX).

    The arguments are specialised as a real launch would be (an int 1 becomes a constant,
    16-divisible ints and 16-byte aligned pointers are marked so), through Triton's own binder
    where this Triton has it, so the PTX is what the GPU would run."""
    _import_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(load_module(plan.program, launch.which, interpret=False), launch.kernel)
    target = GPUTarget("cuda", arch, 32)
    runtime = [n for n in fn.arg_names if n not in launch.constexprs]
    if len(runtime) != len(launch.args):
        raise RuntimeError(f"{launch.kernel}: {len(launch.args)} arguments for {len(runtime)} parameters")
    with _interpret_env(False):
        try:
            from triton.compiler import make_backend
            from triton.runtime.jit import create_function_from_signature
            backend = make_backend(target)
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            kwargs = dict(launch.constexprs, **launch.options)
            bound, spec, options = binder(*launch.args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
            src = ASTSource(fn, signature, constexprs, attrs)
            options = options.__dict__
        except (ImportError, AttributeError, TypeError):  # another Triton's internals: unspecialised
            signature = {n: _sig_type(v) for n, v in zip(runtime, launch.args)}
            signature.update({n: "constexpr" for n in launch.constexprs})
            src = ASTSource(fn, signature, constexprs=dict(launch.constexprs))
            options = dict(launch.options)
        return triton.compile(src, target=target, options=options)


def launches_for(call, arch: int) -> list[Launch]:
    """Every launch a training step of ``call`` makes (forward, preprocess, backward), planned
    for ``sm_<arch>``, with meta tensors standing in for the data (compile-only)."""
    plan = make_plan(call, arch=arch, interpret=False)
    q, k, v = (t.to("meta") for t in (call.q, call.k, call.v))
    B, Hq, L, E = q.shape
    S, EV = k.shape[2], v.shape[3]
    bufs = [t.detach().to("meta") for t in call.program.buffers]
    out = torch.empty(B, Hq, L, EV, dtype=q.dtype, device="meta")
    lse = torch.empty(B, Hq, L, dtype=torch.float32, device="meta")
    c = bwd_config(arch, q.dtype, E, EV, L, S, plan.sparse, plan.kernel_options)
    grads = {s: torch.empty(bufs[s].shape, dtype=_GRAD_ACC, device="meta")
             for s in _grad_slots(plan.program)}
    return [fwd_launch(plan, q, k, v, out, lse, bufs),
            preprocess_launch(plan, out, out, lse, None, lse, lse),
            bwd_launch(plan, c, q, k, v, out, lse, lse, q, k, v, bufs, grads)]


# --------------------------------------------------------------------------- backend interface


def supports(call) -> tuple[bool, str]:
    q = call.q
    interp = _interpreting()
    if q.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(q.device)
        if (major, minor) < (7, 5):
            return False, f"Triton needs sm75 or newer, this GPU is sm{major}{minor}"
        if q.dtype == torch.bfloat16 and major < 8:
            return False, f"bfloat16 needs sm80 or newer, this GPU is sm{major}{minor}"
        where = f"Triton kernels for sm{major}{minor}"
    elif q.device.type == "cpu" and interp:
        where = "Triton interpreter on the CPU (TRITON_INTERPRET=1)"
    else:
        return False, (f"Triton runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1); "
                       f"the inputs are on {q.device}")
    try:
        _import_triton()
    except ImportError as e:
        return False, f"triton is not installed ({e})"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False, f"dtype {q.dtype} is not supported by the Triton kernels (fp16, bf16, fp32)"
    E, EV = q.shape[-1], call.v.shape[-1]
    if max(E, EV) > 256:
        return False, f"head dims {E}/{EV} exceed 256"
    for slot, t in enumerate(call.program.buffers):
        if t.numel() == 0:
            return False, f"captured tensor #{slot} is empty"
    return True, where


def make_plan(call, arch: int | None = None, interpret: bool | None = None) -> Plan:
    """The launch plan of a call; ``arch``/``interpret`` default to the inputs' device (a
    compile-only build passes the target's arch and ``interpret=False``)."""
    q = call.q
    B, Hq, L, E = q.shape
    S, EV = call.k.shape[2], call.v.shape[3]
    bm = call.block_mask
    interp = q.device.type != "cuda" if interpret is None else interpret
    arch = arch_number(q.device) if arch is None else arch
    if bm is not None:
        kv = _Lists(_i32(bm.kv_num_blocks), _i32(bm.kv_indices), _i32(bm.full_kv_num_blocks),
                    _i32(bm.full_kv_indices))
        sparse = tuple(bm.BLOCK_SIZE)
    else:
        kv, sparse = _Lists(None, None, None, None), None
    opts = dict(call.kernel_options)
    fast = bool(opts.get("FAST_MATH", True)) and not interp
    short = bm is not None and bm.mean_kv_tokens() <= SHORT_KV_LOOP
    cfg = fwd_config(arch, q.dtype, E, EV, L, S, sparse, opts, short_kv_loop=short)
    return Plan(call.program, call.scale, kv, None, bm, sparse, cfg, opts, arch, interp, fast)


def run(call):
    """(out, lse) for a validated call; differentiable in q, k, v and captured tensors."""
    plan = make_plan(call)
    bufs = [t.to(call.q.device) for t in call.program.buffers]
    if not call.needs_grad:
        with torch.no_grad():
            return forward(plan, call.q, call.k, call.v, bufs)
    return _FlexAttentionTriton.apply(plan, call.q, call.k, call.v, *bufs)
