"""flexjit's one IR: immutable, interned expression nodes.

A traced ``score_mod`` or ``mask_mod`` is a DAG of :class:`Node`. Every node is
``(op, dtype, src, arg)``:

* ``op``    -- an :class:`Op`; opcodes are grouped into category sets below.
* ``dtype`` -- a :class:`DType`. Floating values are always float32 inside the IR
  (low-precision buffers are widened on load), integers are int32 or int64.
* ``src``   -- the operand nodes.
* ``arg``   -- the op's static argument (a constant's value, a slot number, ...).

Nodes are interned: building an equal node twice returns the same object, so
common subexpressions are shared for free and ``is`` is structural equality.
:func:`digest` gives a hash of the whole graph that is stable across processes;
it is the compile-cache key of everything downstream.

Leaves:
    SCORE                the attention score (float32, already scaled), score_mod only
    B, H, Q_IDX, KV_IDX  int32 coordinates of the score (H is the query head)
    CONST                a literal; arg is the Python value
    SCALAR               a captured Python number, passed at run time; arg = slot
    BUFFER               a captured tensor; arg = (slot, ndim, storage dtype name).
                         Not a value: only LOAD reads it.
"""
from __future__ import annotations

import enum
import hashlib
import math
import weakref
from typing import Any, Iterator


class DType(enum.Enum):
    BOOL = "bool"
    INT32 = "int32"
    INT64 = "int64"
    FLOAT32 = "float32"
    VOID = "void"  # a BUFFER node: not a value

    @property
    def is_float(self) -> bool:
        return self is DType.FLOAT32

    @property
    def is_int(self) -> bool:
        return self in (DType.INT32, DType.INT64)

    @property
    def is_bool(self) -> bool:
        return self is DType.BOOL


class Op(enum.Enum):
    # leaves
    SCORE = "score"
    B = "b"
    H = "h"
    Q_IDX = "q_idx"
    KV_IDX = "kv_idx"
    CONST = "const"
    SCALAR = "scalar"
    BUFFER = "buffer"
    # memory
    LOAD = "load"
    # unary
    NEG = "neg"
    ABS = "abs"
    EXP = "exp"
    EXP2 = "exp2"
    LOG = "log"
    LOG2 = "log2"
    TANH = "tanh"
    SIGMOID = "sigmoid"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    SIN = "sin"
    COS = "cos"
    FLOOR = "floor"
    CEIL = "ceil"
    ROUND = "round"  # half to even, as torch.round
    TRUNC = "trunc"
    TAN = "tan"
    ATAN = "atan"
    SINH = "sinh"
    COSH = "cosh"
    ASIN = "asin"
    ACOS = "acos"
    LOG1P = "log1p"
    EXPM1 = "expm1"
    ERF = "erf"
    NOT = "not"  # logical not on bool, bitwise not on ints
    CAST = "cast"  # arg: target DType
    ROUND_F16 = "round_f16"  # to the nearest float16 value (ties to even, ±inf past it), kept float32
    ROUND_BF16 = "round_bf16"  # the same for bfloat16
    # binary
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"  # true division, float result
    FLOORDIV = "floordiv"  # Python semantics: rounds toward -inf
    MOD = "mod"  # Python semantics: sign of the divisor
    FMOD = "fmod"  # C semantics (torch.fmod): sign of the dividend
    POW = "pow"
    ATAN2 = "atan2"  # torch.atan2(y, x): the angle of (x, y), float result
    MAX = "max"
    MIN = "min"
    AND = "and"  # logical on bool, bitwise on ints
    OR = "or"
    XOR = "xor"
    SHL = "shl"  # integer shifts, torch's: an amount outside [0, bits) gives 0 (>>: 0 or -1)
    SHR = "shr"  # arithmetic: rounds toward -inf
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"
    EQ = "eq"
    NE = "ne"
    # ternary
    WHERE = "where"


LEAVES = frozenset({Op.SCORE, Op.B, Op.H, Op.Q_IDX, Op.KV_IDX, Op.CONST, Op.SCALAR, Op.BUFFER})
INDEX_LEAVES = frozenset({Op.B, Op.H, Op.Q_IDX, Op.KV_IDX})
TRANSCENDENTAL = frozenset({Op.EXP, Op.EXP2, Op.LOG, Op.LOG2, Op.TANH, Op.SIGMOID, Op.SQRT,
                            Op.RSQRT, Op.SIN, Op.COS, Op.TAN, Op.ATAN, Op.SINH, Op.COSH, Op.ASIN,
                            Op.ACOS, Op.LOG1P, Op.EXPM1, Op.ERF, Op.ATAN2})  # ATAN2: binary
ROUNDING = frozenset({Op.FLOOR, Op.CEIL, Op.ROUND, Op.TRUNC})  # float -> float; ints unchanged
LOW_PRECISION = frozenset({Op.ROUND_F16, Op.ROUND_BF16})  # a torch cast to a narrower float
UNARY = (TRANSCENDENTAL - {Op.ATAN2}) | ROUNDING | LOW_PRECISION | frozenset({Op.NEG, Op.ABS, Op.NOT,
                                                                             Op.CAST})
ARITH = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.FLOORDIV, Op.MOD, Op.FMOD, Op.POW, Op.ATAN2,
                   Op.MAX, Op.MIN})
LOGIC = frozenset({Op.AND, Op.OR, Op.XOR})
SHIFT = frozenset({Op.SHL, Op.SHR})
COMPARE = frozenset({Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE})
BINARY = ARITH | LOGIC | SHIFT | COMPARE
COMMUTATIVE = frozenset({Op.ADD, Op.MUL, Op.MAX, Op.MIN, Op.AND, Op.OR, Op.XOR, Op.EQ, Op.NE})


class Node:
    """One immutable IR node. Build with :func:`node`, never directly."""

    __slots__ = ("op", "dtype", "src", "arg", "_hash", "__weakref__")

    op: Op
    dtype: DType
    src: tuple["Node", ...]
    arg: Any

    def __setattr__(self, name, value):
        raise AttributeError("IR nodes are immutable")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:  # interned: identity is structural equality
        return self is other

    def __repr__(self) -> str:
        return f"Node({self.op.value}, {self.dtype.value}, arg={self.arg!r}, n_src={len(self.src)})"

    def toposort(self) -> list["Node"]:
        """All nodes reachable from self, operands before users."""
        return toposort([self])


_INTERN: "weakref.WeakValueDictionary[tuple, Node]" = weakref.WeakValueDictionary()


def _arg_key(arg: Any) -> Any:
    # -0.0 == 0.0 and nan != nan in Python; key floats by their exact bits and kind.
    if isinstance(arg, float):
        return ("f", arg.hex() if not math.isnan(arg) else "nan")
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return ("i", arg)
    return arg


def node(op: Op, dtype: DType, src: tuple[Node, ...] = (), arg: Any = None) -> Node:
    """Build (or find) the interned node ``(op, dtype, src, arg)``."""
    key = (op, dtype, tuple(id(s) for s in src), _arg_key(arg))
    found = _INTERN.get(key)
    if found is not None:
        return found
    n = object.__new__(Node)
    object.__setattr__(n, "op", op)
    object.__setattr__(n, "dtype", dtype)
    object.__setattr__(n, "src", tuple(src))
    object.__setattr__(n, "arg", arg)
    object.__setattr__(n, "_hash", hash((op, dtype, tuple(s._hash for s in src), _arg_key(arg))))
    _INTERN[key] = n
    return n


def const(value, dtype: DType | None = None) -> Node:
    if dtype is None:
        dtype = dtype_of_python(value)
    if dtype is DType.BOOL:
        value = bool(value)
    elif dtype.is_int:
        value = int(value)
    else:
        value = float(value)
    return node(Op.CONST, dtype, (), value)


def dtype_of_python(value) -> DType:
    if isinstance(value, bool):
        return DType.BOOL
    if isinstance(value, int):
        return DType.INT32 if -(2**31) <= value < 2**31 else DType.INT64
    if isinstance(value, float):
        return DType.FLOAT32
    raise TypeError(f"no IR dtype for Python value {value!r}")


def toposort(roots: list[Node]) -> list[Node]:
    order: list[Node] = []
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        n, expanded = stack.pop()
        if id(n) in seen:
            continue
        if expanded:
            seen.add(id(n))
            order.append(n)
            continue
        stack.append((n, True))
        for s in reversed(n.src):
            if id(s) not in seen:
                stack.append((s, False))
    return order


def walk(root: Node) -> Iterator[Node]:
    yield from toposort([root])


def uses(root: Node, op: Op) -> bool:
    return any(n.op is op for n in walk(root))


def varies_with(n: Node, memo: dict) -> frozenset:
    """Which of q_idx / kv_idx (the score counts as both) a value varies with inside one
    (batch, head): empty for a value uniform over an attention tile. ``memo`` is shared across
    calls on the same graphs."""
    if id(n) not in memo:
        if n.op is Op.Q_IDX:
            d = frozenset({"q"})
        elif n.op is Op.KV_IDX:
            d = frozenset({"kv"})
        elif n.op is Op.SCORE:
            d = frozenset({"q", "kv"})
        else:
            d = frozenset().union(*[varies_with(s, memo) for s in n.src]) if n.src else frozenset()
        memo[id(n)] = d
    return memo[id(n)]


def promote(*dtypes: DType) -> DType:
    """Result dtype of an arithmetic op: float beats int beats bool; int64 beats int32."""
    if any(d.is_float for d in dtypes):
        return DType.FLOAT32
    if DType.INT64 in dtypes:
        return DType.INT64
    if any(d.is_int for d in dtypes):
        return DType.INT32
    return DType.BOOL


def format_graph(roots: dict[str, Node]) -> str:
    """Readable SSA listing of one or more roots; what FLEXJIT_DEBUG prints."""
    names: dict[int, str] = {}
    lines: list[str] = []
    for n in toposort(list(roots.values())):
        if n.op is Op.CONST:
            names[id(n)] = repr(n.arg)
            continue
        if n.op in (Op.SCORE, Op.B, Op.H, Op.Q_IDX, Op.KV_IDX):
            names[id(n)] = n.op.value
            continue
        if n.op is Op.SCALAR:
            names[id(n)] = f"scalar{n.arg}"
            continue
        if n.op is Op.BUFFER:
            names[id(n)] = f"buf{n.arg[0]}"
            continue
        name = f"%{len(lines)}"
        args = ", ".join(names[id(s)] for s in n.src)
        extra = f" -> {n.arg.value}" if n.op is Op.CAST else ""
        lines.append(f"  {name}: {n.dtype.value} = {n.op.value}({args}){extra}")
        names[id(n)] = name
    for label, r in roots.items():
        lines.append(f"  {label} = {names[id(r)]}")
    return "\n".join(lines)


def serialize(roots: list[Node]) -> str:
    """Canonical text of a graph: equal graphs give equal text in every process."""
    index: dict[int, int] = {}
    parts = []
    for i, n in enumerate(toposort(roots)):
        index[id(n)] = i
        arg = n.arg.value if isinstance(n.arg, DType) else n.arg
        parts.append(f"{n.op.value}:{n.dtype.value}:{_arg_key(arg)!r}:{[index[id(s)] for s in n.src]}")
    parts.append("roots:" + ",".join(str(index[id(r)]) for r in roots))
    return "\n".join(parts)


def deserialize(text: str) -> list[Node]:
    """The roots of a graph from :func:`serialize`'s text (the same interned nodes in this
    process: ``deserialize(serialize(r)) == r``)."""
    import ast

    lines = text.split("\n")
    nodes: list[Node] = []
    for line in lines[:-1]:
        op, dtype, rest = line.split(":", 2)
        arg_text, src_text = rest.rsplit(":", 1)
        arg = ast.literal_eval(arg_text)
        if isinstance(arg, tuple) and len(arg) == 2 and arg[0] in ("f", "b", "i"):
            kind, value = arg
            arg = (float("nan") if value == "nan" else float.fromhex(value)) if kind == "f" else value
        if Op(op) is Op.CAST:
            arg = DType(arg)
        src = tuple(nodes[i] for i in ast.literal_eval(src_text))
        nodes.append(node(Op(op), DType(dtype), src, arg))
    roots = lines[-1].removeprefix("roots:")
    return [nodes[int(i)] for i in roots.split(",")] if roots else []


def digest(roots: list[Node]) -> str:
    """Stable structural hash of a graph (hex sha256)."""
    return hashlib.sha256(serialize(roots).encode()).hexdigest()


# --------------------------------------------------------------------------- typed builders


def build_binary(op: Op, na: Node, nb: Node) -> Node:
    """The typed node for a binary op, inserting the casts torch's promotion implies."""
    if op in (Op.AND, Op.OR, Op.XOR):
        if na.dtype.is_float or nb.dtype.is_float:
            raise TypeError(f"`{op.value}` needs bool or integer operands")
        dt = promote(na.dtype, nb.dtype)
        return node(op, dt, (cast(na, dt), cast(nb, dt)))
    if op in SHIFT:
        if na.dtype.is_float or nb.dtype.is_float:
            raise TypeError(f"`{op.value}` needs integer operands")
        dt = promote(na.dtype, nb.dtype, DType.INT32)  # bools shift as ints
        return node(op, dt, (cast(na, dt), cast(nb, dt)))
    if op in COMPARE:
        dt = promote(na.dtype, nb.dtype)
        return node(op, DType.BOOL, (cast(na, dt), cast(nb, dt)))
    if op in (Op.DIV, Op.POW, Op.ATAN2) or (op is Op.FLOORDIV and (na.dtype.is_float or nb.dtype.is_float)):
        dt = DType.FLOAT32 if op is not Op.POW or promote(na.dtype, nb.dtype).is_float \
            else promote(na.dtype, nb.dtype)
        if op is Op.POW and dt.is_int:
            raise TypeError("integer ** integer is not supported; cast one side to float")
        return node(op, dt, (cast(na, dt), cast(nb, dt)))
    dt = promote(na.dtype, nb.dtype)
    if dt is DType.BOOL and op not in (Op.MAX, Op.MIN):
        dt = DType.INT32  # bool arithmetic counts
    return node(op, dt, (cast(na, dt), cast(nb, dt)))


def cast(n: Node, dt: DType) -> Node:
    if n.dtype is dt:
        return n
    if n.op is Op.CONST:
        return const(n.arg, dt)
    return node(Op.CAST, dt, (n,), dt)
