"""Block classification by interval analysis: which mask blocks are empty, full, or unknown.

For every (b, h, q-block, kv-block) at once, ``classify`` evaluates the mask
graph over *sets* of positions: q_idx ranges over the block's valid rows and
kv_idx over its valid columns, while b and h are exact. Each numeric node gets
a sound enclosing interval [lo, hi]; each bool node gets (can_be_false,
can_be_true). A block whose mask cannot be true is empty; one whose mask cannot
be false is full; the rest are evaluated densely by the planner.

Soundness is the contract: a block called empty or full must be so for every
element. Where a rule is not sure it widens to "unknown" (±inf, or both truth
values), which is always sound and only costs a dense evaluation. Loads of a
captured tensor over a range of its last index (the others fixed) use a sparse
table of range min/max, so document masks classify exactly off the document
boundaries, for (S,) and (B, S) document ids alike.

Bounds are float64 (exact for integers below 2**53). An int32 node whose
interval leaves the int32 range widens to unknown, since kernels wrap there.

NaN: a float interval whose bound is NaN means "any value, NaN included". A NaN
compares False (True for !=), so it must never let a block be called full or
empty: it arises where an op leaves its domain (log, sqrt, asin of a range that
crosses it), from a captured tensor holding NaN, and from bounds with no answer
(inf * 0, a division by a range containing 0); every arithmetic rule passes it
on, comparisons turn it into "both possible", an int cast into the whole range.
"""
from __future__ import annotations

import math

import torch

from flexjit.ir import nodes as ir
from flexjit.ir.nodes import DType, Node, Op

INF = math.inf
_I32 = (-(2.0 ** 31), 2.0 ** 31 - 1)


class _Range:
    """Range min/max of a 1-D tensor in O(1) per query (a sparse table)."""

    def __init__(self, t: torch.Tensor):
        v = t.to(torch.float64)
        self.size = v.numel()
        self.mins, self.maxs = [v], [v]
        k = 1
        while 2 * k <= self.size:
            lo, hi = self.mins[-1], self.maxs[-1]
            self.mins.append(torch.minimum(lo[:-k], lo[k:]))
            self.maxs.append(torch.maximum(hi[:-k], hi[k:]))
            k *= 2

    def query(self, lo: torch.Tensor, hi: torch.Tensor):
        """min and max over [lo, hi] (inclusive, valid, lo <= hi) elementwise."""
        span = (hi - lo + 1).clamp(min=1)
        level = torch.floor(torch.log2(span)).long().clamp(max=len(self.mins) - 1)
        width = torch.pow(2, level)
        # gather by level: the few distinct levels are looped over
        out_min = torch.empty_like(lo, dtype=torch.float64)
        out_max = torch.empty_like(lo, dtype=torch.float64)
        for lvl in torch.unique(level).tolist():
            sel = level == lvl
            a = lo[sel].long()
            b = (hi[sel] - width[sel] + 1).long()
            out_min[sel] = torch.minimum(self.mins[lvl][a], self.mins[lvl][b])
            out_max[sel] = torch.maximum(self.maxs[lvl][a], self.maxs[lvl][b])
        return out_min, out_max


class _Buffers:
    """Per-buffer facts the load rule needs, computed once per classification."""

    def __init__(self, buffers, device):
        self.buffers = [t.detach().to(device) for t in buffers]
        self._ranges: dict[int, _Range] = {}
        self._global: dict[int, tuple[float, float]] = {}

    def global_range(self, slot: int) -> tuple[float, float]:
        if slot not in self._global:
            t = self.buffers[slot].to(torch.float64)
            if t.numel() == 0:
                self._global[slot] = (-INF, INF)
            elif torch.isnan(t).any():  # a NaN entry may be read: any value, NaN included
                self._global[slot] = (math.nan, math.nan)
            else:
                self._global[slot] = (t.min().item(), t.max().item())
        return self._global[slot]

    def range_flat(self, slot: int) -> _Range:
        """Range min/max over the row-major flattened tensor."""
        if slot not in self._ranges:
            self._ranges[slot] = _Range(self.buffers[slot].reshape(-1))
        return self._ranges[slot]


def _num(lo, hi):
    return ("num", lo, hi)


def _bool(can_false, can_true):
    return ("bool", can_false, can_true)


def _as_num(v):
    """A bool interval seen as the integers 0/1."""
    if v[0] == "num":
        return v
    _, f, t = v
    return _num(torch.where(f, 0.0, 1.0), torch.where(t, 1.0, 0.0))


def _clean(lo, hi, dtype: DType):
    """Float bounds as they are (NaN: maybe NaN); int bounds: NaN (a NaN cast, no answer) and
    int32 bounds that overflow become unknown."""
    if dtype.is_float:
        return _num(lo, hi)
    lo = torch.where(torch.isnan(lo), -INF, lo)
    hi = torch.where(torch.isnan(hi), INF, hi)
    if dtype is DType.INT32:
        bad = (lo < _I32[0]) | (hi > _I32[1])
        lo = torch.where(bad, _I32[0], lo)
        hi = torch.where(bad, _I32[1], hi)
    return _num(lo, hi)


def _mul(a, b):
    cands = torch.stack(torch.broadcast_tensors(a[1] * b[1], a[1] * b[2], a[2] * b[1], a[2] * b[2]))
    unknown = torch.isnan(cands).any(0)  # inf * 0: no bound (and a NaN value possible)
    lo = torch.where(unknown, math.nan, torch.nan_to_num(cands, nan=0.0).amin(0))
    hi = torch.where(unknown, math.nan, torch.nan_to_num(cands, nan=0.0).amax(0))
    return lo, hi


def _div(a, b, floor: bool):
    """a / b (or floor of it) when b's interval excludes 0, else unknown."""
    safe = (b[1] > 0) | (b[2] < 0)
    bl = torch.where(safe, b[1], 1.0)
    bh = torch.where(safe, b[2], 1.0)
    cands = torch.stack(torch.broadcast_tensors(a[1] / bl, a[1] / bh, a[2] / bl, a[2] / bh))
    unknown = torch.isnan(cands).any(0) | ~safe
    lo, hi = cands.nan_to_num(0.0).amin(0), cands.nan_to_num(0.0).amax(0)
    if floor:
        lo, hi = torch.floor(lo), torch.floor(hi)
    return torch.where(unknown, math.nan, lo), torch.where(unknown, math.nan, hi)


def _shift(a, b, left: bool):
    """a << b, a >> b: exact for a single amount in [0, 62] (a times or floor-divided by 2**b);
    any other amount: unknown for <<, between a and 0 (or -1) for >>."""
    point = (b[1] == b[2]) & (b[1] >= 0) & (b[1] <= 62)
    p = torch.exp2(torch.where(point, b[1], 0.0))
    if left:
        return torch.where(point, a[1] * p, -INF), torch.where(point, a[2] * p, INF)
    lo, hi = torch.floor(a[1] / p), torch.floor(a[2] / p)
    return (torch.where(point, lo, torch.clamp(a[1], max=0.0)),
            torch.where(point, hi, torch.clamp(a[2], min=0.0)))


def _mod(a, b):
    """Python remainder by a positive constant-ish divisor; unknown otherwise."""
    c = b[1]
    point_pos = (b[1] == b[2]) & (b[1] > 0)
    cs = torch.where(point_pos, c, 1.0)
    same_period = torch.floor(a[1] / cs) == torch.floor(a[2] / cs)
    finite = torch.isfinite(a[1]) & torch.isfinite(a[2])
    exact = point_pos & same_period & finite
    lo = torch.where(exact, torch.remainder(torch.nan_to_num(a[1]), cs), 0.0)
    hi = torch.where(exact, torch.remainder(torch.nan_to_num(a[2]), cs), cs - 1)
    # a positive divisor that is a range: the result lies in [0, b.hi)
    pos_range = (b[1] > 0) & ~point_pos
    lo = torch.where(point_pos | pos_range, lo, -INF)
    hi = torch.where(point_pos, hi, torch.where(pos_range, b[2], INF))
    return lo, hi


# Non-decreasing on their domain (outside it they give NaN, which the rules carry).
_MONOTONE = {Op.EXP: torch.exp, Op.EXP2: torch.exp2, Op.LOG: torch.log, Op.LOG2: torch.log2,
             Op.TANH: torch.tanh, Op.SIGMOID: torch.sigmoid, Op.SQRT: torch.sqrt,
             Op.FLOOR: torch.floor, Op.CEIL: torch.ceil, Op.ROUND: torch.round, Op.TRUNC: torch.trunc,
             Op.ATAN: torch.atan, Op.SINH: torch.sinh, Op.ASIN: torch.asin, Op.LOG1P: torch.log1p,
             Op.EXPM1: torch.expm1, Op.ERF: torch.erf,
             Op.ROUND_F16: lambda x: x.to(torch.float16).double(),
             Op.ROUND_BF16: lambda x: x.to(torch.bfloat16).double()}


def _compare(op: Op, al, ah, bl, bh, outcome: bool):
    """Whether ``a op b`` can be ``outcome`` for a in [al, ah], b in [bl, bh] (no NaN)."""
    if op in (Op.EQ, Op.NE):
        overlap = (al <= bh) & (bl <= ah)
        same_point = (al == ah) & (bl == bh) & (al == bl)
        return overlap if (op is Op.EQ) == outcome else ~same_point
    if op in (Op.GT, Op.GE):  # a > b is b < a
        al, ah, bl, bh = bl, bh, al, ah
        op = Op.LT if op is Op.GT else Op.LE
    if op is Op.LT:
        return al < bh if outcome else ah >= bl
    return al <= bh if outcome else ah > bl  # LE


def _rule(n: Node, a: list, env: dict):
    op = n.op
    if op is Op.CONST:
        v = n.arg
        if n.dtype is DType.BOOL:
            return _bool(torch.tensor(not v), torch.tensor(bool(v)))
        return _num(torch.tensor(float(v), dtype=torch.float64), torch.tensor(float(v), dtype=torch.float64))
    if op is Op.SCALAR:
        v = float(env["scalars"][n.arg])
        t = torch.tensor(v, dtype=torch.float64)
        return _num(t, t)
    if op in env["leaves"]:
        return env["leaves"][op]
    if op is Op.SCORE:
        raise ValueError("a mask graph cannot use the score")
    if op is Op.LOAD:
        return _load(n, a[1:], env)
    if op is Op.NOT:
        if n.dtype is DType.BOOL:
            return _bool(a[0][2], a[0][1])
        return _unknown(n)
    if op in (Op.AND, Op.OR, Op.XOR):
        if n.dtype is DType.BOOL:
            (_, fa, ta), (_, fb, tb) = a
            if op is Op.AND:
                return _bool(fa | fb, ta & tb)
            if op is Op.OR:
                return _bool(fa & fb, ta | tb)
            return _bool((ta & tb) | (fa & fb), (ta & fb) | (fa & tb))
        return _exact_or_unknown(n, a)
    if op in ir.COMPARE:
        (_, al, ah), (_, bl, bh) = _as_num(a[0]), _as_num(a[1])
        nan = torch.isnan(al) | torch.isnan(ah) | torch.isnan(bl) | torch.isnan(bh)
        return _bool(_compare(op, al, ah, bl, bh, False) | nan, _compare(op, al, ah, bl, bh, True) | nan)
    if op is Op.WHERE:
        c = a[0]
        x, y = a[1], a[2]
        if n.dtype is DType.BOOL:
            f = (c[2] & x[1]) | (c[1] & y[1])
            t = (c[2] & x[2]) | (c[1] & y[2])
            return _bool(f, t)
        x, y = _as_num(x), _as_num(y)
        lo = torch.where(c[1], torch.where(c[2], torch.minimum(x[1], y[1]), y[1]), x[1])
        hi = torch.where(c[1], torch.where(c[2], torch.maximum(x[2], y[2]), y[2]), x[2])
        return _num(lo, hi)
    if op is Op.CAST:
        src = a[0]
        if n.dtype is DType.BOOL:
            _, lo, hi = _as_num(src)
            nan = torch.isnan(lo) | torch.isnan(hi)
            return _bool(((lo <= 0) & (hi >= 0)) | nan, ~((lo == 0) & (hi == 0)) | nan)
        _, lo, hi = _as_num(src)
        if n.dtype.is_int and n.src[0].dtype.is_float:
            lo, hi = torch.trunc(lo), torch.trunc(hi)
        return _clean(lo, hi, n.dtype)
    return _arith(n, [_as_num(x) for x in a])


def _arith(n: Node, a: list):
    op = n.op
    if op is Op.ADD:
        lo, hi = a[0][1] + a[1][1], a[0][2] + a[1][2]
    elif op is Op.SUB:
        lo, hi = a[0][1] - a[1][2], a[0][2] - a[1][1]
    elif op is Op.NEG:
        lo, hi = -a[0][2], -a[0][1]
    elif op is Op.MUL:
        lo, hi = _mul(a[0], a[1])
    elif op is Op.DIV:
        lo, hi = _div(a[0], a[1], floor=False)
    elif op is Op.FLOORDIV:
        lo, hi = _div(a[0], a[1], floor=True)
    elif op is Op.MOD and n.dtype.is_int:
        lo, hi = _mod(a[0], a[1])
    elif op in ir.SHIFT:
        lo, hi = _shift(a[0], a[1], op is Op.SHL)
    elif op is Op.ABS:
        l, h = a[0][1], a[0][2]
        lo = torch.where(l >= 0, l, torch.where(h <= 0, -h, torch.zeros_like(l)))
        hi = torch.where(l >= 0, h, torch.where(h <= 0, -l, torch.maximum(-l, h)))
    elif op is Op.MAX:
        lo, hi = torch.maximum(a[0][1], a[1][1]), torch.maximum(a[0][2], a[1][2])
    elif op is Op.MIN:
        lo, hi = torch.minimum(a[0][1], a[1][1]), torch.minimum(a[0][2], a[1][2])
    elif op in _MONOTONE:
        f = _MONOTONE[op]
        lo, hi = f(a[0][1]), f(a[0][2])
    elif op is Op.RSQRT:
        lo, hi = torch.rsqrt(a[0][2]), torch.rsqrt(a[0][1])
    elif op is Op.ACOS:  # non-increasing
        lo, hi = torch.acos(a[0][2]), torch.acos(a[0][1])
    elif op is Op.COSH:  # even: its minimum at 0
        l, h = a[0][1], a[0][2]
        lo = torch.where((l <= 0) & (h >= 0), 1.0, torch.minimum(torch.cosh(l), torch.cosh(h)))
        hi = torch.maximum(torch.cosh(l), torch.cosh(h))
    elif op in (Op.SIN, Op.COS):  # NaN at infinity
        finite = torch.isfinite(a[0][1]) & torch.isfinite(a[0][2])
        lo, hi = torch.where(finite, -1.0, math.nan), torch.where(finite, 1.0, math.nan)
    elif op is Op.ATAN2:
        lo, hi = _atan2(a[0], a[1])
    elif op in NO_CHEAP_RULE:
        return _unknown(n)
    else:
        raise NotImplementedError(f"no interval rule for {op.value}")
    if n.dtype.is_float:  # a NaN operand makes a NaN result (min/max too: they propagate NaN)
        nan = torch.zeros((), dtype=torch.bool)
        for x in a:
            nan = nan | torch.isnan(x[1]) | torch.isnan(x[2])
        lo, hi = torch.where(nan, math.nan, lo), torch.where(nan, math.nan, hi)
    return _clean(lo, hi, n.dtype)


# atan2's range, widened by more than float32's rounding of π (3.1415927 > π).
_PI_BOUND = math.pi + 1e-6


def _atan2(y, x):
    """atan2(y, x) over a box: in the open right half-plane (x > 0) the angle is continuous and
    its extremes lie at the box's corners; elsewhere the box may hold the origin or reach the
    branch cut on the negative x axis, and the bound is [-π, π]. Corners are widened by the
    float32 rounding of a libm atan2 (a few ulps)."""
    corners = torch.stack(torch.broadcast_tensors(*[torch.atan2(cy, cx) for cy in (y[1], y[2])
                                                    for cx in (x[1], x[2])]))
    right = x[1] > 0
    slack = 1e-6 * (1.0 + corners.abs())
    lo = torch.where(right, (corners - slack).amin(0), -_PI_BOUND)
    hi = torch.where(right, (corners + slack).amax(0), _PI_BOUND)
    return lo, hi


# Ops whose values the planner bounds by "unknown" (always sound; blocks using them are evaluated
# densely): no cheap sound rule. Every other op has one above (float MOD is unknown too).
NO_CHEAP_RULE = frozenset({Op.POW, Op.MOD, Op.FMOD, Op.TAN})


def _unknown(n: Node):
    if n.dtype is DType.BOOL:
        return _bool(torch.tensor(True), torch.tensor(True))
    if n.dtype.is_float:  # anything, NaN included
        return _num(torch.tensor(math.nan, dtype=torch.float64), torch.tensor(math.nan, dtype=torch.float64))
    return _num(torch.tensor(-INF, dtype=torch.float64), torch.tensor(INF, dtype=torch.float64))


def _exact_or_unknown(n: Node, a: list):
    """Bitwise int ops: exact where both operands are single points, else unknown."""
    (_, al, ah), (_, bl, bh) = _as_num(a[0]), _as_num(a[1])
    point = (al == ah) & (bl == bh) & torch.isfinite(al) & torch.isfinite(bl)
    x = torch.where(point, al, 0.0).long()
    y = torch.where(point, bl, 0.0).long()
    f = {Op.AND: torch.bitwise_and, Op.OR: torch.bitwise_or, Op.XOR: torch.bitwise_xor}[n.op]
    v = f(x, y).double()
    return _num(torch.where(point, v, -INF), torch.where(point, v, INF))


def _load(n: Node, idx: list, env: dict):
    slot, ndim, storage = n.src[0].arg
    bufs: _Buffers | None = env["buffers"]
    if bufs is None:  # over a whole call: the tensor's known extremes, or any value its dtype holds
        extremes = env.get("contents", {}).get(slot) or _STORAGE_RANGE.get(storage, (math.nan,) * 2)
        lo, hi = (torch.tensor(v, dtype=torch.float64) for v in extremes)
        if n.dtype is DType.BOOL:
            return _bool(lo <= 0, hi >= 1)
        return _clean(lo, hi, n.dtype)
    t = bufs.buffers[slot]
    glo, ghi = bufs.global_range(slot)
    if ndim == 0:
        v = torch.tensor(glo, dtype=torch.float64)
        out = _num(v, v)
    else:
        idx = [_as_num(i) for i in idx]
        shape = torch.broadcast_shapes(*[i[1].shape for i in idx])
        los = [i[1].expand(shape) for i in idx]
        his = [i[2].expand(shape) for i in idx]
        in_range = torch.ones(shape, dtype=torch.bool)
        for d, (l, h) in enumerate(zip(los, his)):
            in_range &= (l >= 0) & (h < t.shape[d]) & torch.isfinite(l) & torch.isfinite(h)
        point = in_range.clone()
        for l, h in zip(los, his):
            point &= l == h
        lo = torch.full(shape, glo, dtype=torch.float64)
        hi = torch.full(shape, ghi, dtype=torch.float64)
        if point.any():
            vals = t[tuple(l[point].long() for l in los)].to(torch.float64)
            lo[point] = vals
            hi[point] = vals
        # A range along the last dim with points elsewhere (doc_ids[b, q_idx]) is a contiguous
        # run of the flattened tensor: one range query.
        lead_points = torch.ones(shape, dtype=torch.bool)
        for l, h in zip(los[:-1], his[:-1]):
            lead_points &= l == h
        rng = in_range & lead_points & ~point
        if rng.any():
            base = torch.zeros(shape, dtype=torch.float64)
            stride = 1
            for d in range(ndim - 2, -1, -1):
                stride *= t.shape[d + 1]
                base = base + los[d] * stride
            mn, mx = bufs.range_flat(slot).query(base[rng] + los[-1][rng], base[rng] + his[-1][rng])
            lo[rng] = mn
            hi[rng] = mx
        out = _num(lo, hi)
    if n.dtype is DType.BOOL:
        return _bool(out[1] <= 0, out[2] >= 1)
    return _clean(out[1], out[2], n.dtype)


_STORAGE_RANGE = {"bool": (0.0, 1.0), "uint8": (0.0, 255.0), "int8": (-128.0, 127.0),
                  "int16": (-(2.0 ** 15), 2.0 ** 15 - 1), "int32": _I32, "int64": (-(2.0 ** 63), 2.0 ** 63)}


def domain(lengths: tuple[int, int, int, int], scalars, contents: dict | None = None) -> dict:
    """The environment of :func:`bound` over every position of one call: b, h, q_idx and kv_idx
    over [0, n - 1] for lengths (B, H, L, S), the score anything, the scalars at their values, a
    load of a captured tensor over its storage dtype's whole range (no tensor is read: its
    values may change), or over ``contents[slot]`` = (min, max) where the caller has read them
    (NaN: anything)."""
    f64 = torch.float64
    leaves = {op: _num(torch.tensor(0.0, dtype=f64), torch.tensor(float(max(n, 1) - 1), dtype=f64))
              for op, n in zip((Op.B, Op.H, Op.Q_IDX, Op.KV_IDX), lengths)}
    leaves[Op.SCORE] = _num(torch.tensor(math.nan, dtype=f64), torch.tensor(math.nan, dtype=f64))  # any
    return {"leaves": leaves, "scalars": scalars, "buffers": None, "contents": contents or {}}


def bound(n: Node, args: list, env: dict) -> tuple:
    """One node's interval from its operands' (None for a BUFFER operand): ("num", lo, hi) as
    float64 tensors, or ("bool", can_be_false, can_be_true). An int32 node's bounds are clamped
    to int32 (kernels wrap); evaluate its int64 twin to see whether the true value fits."""
    return _rule(n, args, env)


def classify(mask: Node, b: torch.Tensor, h: torch.Tensor, q_lo: torch.Tensor, q_hi: torch.Tensor,
             kv_lo: torch.Tensor, kv_hi: torch.Tensor, buffers, scalars):
    """(can_be_false, can_be_true) of ``mask`` per block, broadcast over the leaves' shapes.

    b, h: exact coordinates; q_lo/q_hi and kv_lo/kv_hi: inclusive valid ranges per block.
    All inputs are broadcastable tensors on the CPU.
    """
    f64 = torch.float64
    leaves = {Op.B: _num(b.to(f64), b.to(f64)), Op.H: _num(h.to(f64), h.to(f64)),
              Op.Q_IDX: _num(q_lo.to(f64), q_hi.to(f64)), Op.KV_IDX: _num(kv_lo.to(f64), kv_hi.to(f64))}
    env = {"leaves": leaves, "scalars": scalars, "buffers": _Buffers(buffers, "cpu")}
    values: dict[int, tuple] = {}
    for n in ir.toposort([mask]):
        if n.op is Op.BUFFER:
            continue
        values[id(n)] = _rule(n, [values.get(id(s)) for s in n.src], env)
    kind, can_false, can_true = values[id(mask)]
    assert kind == "bool"
    return can_false, can_true
