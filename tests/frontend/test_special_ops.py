"""atan2, hypot, logaddexp(2), xlogy, xlog1py, heaviside, logit and deg2rad/rad2deg at their edges:
zeros of both signs, infinities, NaN, the tiny and the huge, logit's eps bounds.

Each op is traced with its first argument the score and its second a captured tensor read at
kv_idx, so one evaluation covers every pair of edge values. Values go through the interpreter
(the reference's definition) and through the derivative pass, against torch's own op and its
autograd on the same pairs, in float32 and float64. Where flexjit's gradient departs from
torch's on purpose (a NaN of torch's where flexjit keeps a finite one; heaviside, which torch
does not differentiate) the test states flexjit's value.
"""
import math

import pytest
import torch

from flexjit.frontend.trace import SCORE_MOD, trace_mod
from flexjit.ir import nodes as ir
from flexjit.ir.interp import Env, evaluate
from flexjit.ir.passes import derivative, simplify

INF, NAN = math.inf, math.nan
# The pairs: every edge value against every other, plus ordinary values.
EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, 4.0, 1e-30, 1e-40, 3e38, -3e38, 1e30, INF, -INF, NAN,
         0.999, 1e-3, 0.1, 0.9]

FUNCS = {
    "atan2": (lambda s, y: torch.atan2(s, y), lambda x, y: torch.atan2(x, y)),
    "arctan2_method": (lambda s, y: s.arctan2(y), lambda x, y: torch.atan2(x, y)),
    "hypot": (lambda s, y: torch.hypot(s, y), lambda x, y: torch.hypot(x, y)),
    "logaddexp": (lambda s, y: torch.logaddexp(s, y), lambda x, y: torch.logaddexp(x, y)),
    "logaddexp2": (lambda s, y: s.logaddexp2(y), lambda x, y: torch.logaddexp2(x, y)),
    "xlogy": (lambda s, y: torch.xlogy(s, y), lambda x, y: torch.xlogy(x, y)),
    "special_xlogy": (lambda s, y: torch.special.xlogy(s, y), lambda x, y: torch.xlogy(x, y)),
    "xlog1py": (lambda s, y: torch.special.xlog1py(s, y), lambda x, y: torch.special.xlog1py(x, y)),
    "heaviside": (lambda s, y: torch.heaviside(s, y), lambda x, y: torch.heaviside(x, y)),
    "logit": (lambda s, y: torch.logit(s) + y * 0.0, lambda x, y: torch.logit(x) + y * 0.0),
    "logit_eps": (lambda s, y: torch.logit(s, eps=1e-3) + s.logit(0.1) + torch.special.logit(s, 0.25),
                  lambda x, y: torch.logit(x, eps=1e-3) + torch.logit(x, 0.1) + torch.logit(x, 0.25)),
    "logit_negative_eps": (lambda s, y: torch.logit(s, -1.0), lambda x, y: torch.logit(x)),
    "deg2rad": (lambda s, y: torch.deg2rad(s) + y.rad2deg(), lambda x, y: torch.deg2rad(x) + torch.rad2deg(y)),
}


def _grid(dtype):
    v = torch.tensor(EDGES, dtype=dtype)
    return v.view(1, 1, -1, 1).expand(1, 1, len(EDGES), len(EDGES)), v


def _traced(fn, table):
    return trace_mod(lambda s, b, h, q, kv: fn(s, table[kv]), SCORE_MOD)


def _env(traced, x, dtype):
    n = len(EDGES)
    return Env(b=torch.zeros(1, 1, 1, 1, dtype=torch.int32), h=torch.zeros(1, 1, 1, 1, dtype=torch.int32),
               q_idx=torch.arange(n, dtype=torch.int32).view(1, 1, -1, 1),
               kv_idx=torch.arange(n, dtype=torch.int32).view(1, 1, 1, -1), score=x,
               buffers=tuple(traced.buffers), float_dtype=dtype)


def _close(got, want, scale, count, dtype):
    """got equals want within ``count`` roundings of ``scale`` (infinities and NaN: exactly)."""
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN where torch has none, or none where it has"
    finite = torch.isfinite(want)
    assert torch.equal(got[~finite & ~torch.isnan(want)], want[~finite & ~torch.isnan(want)])
    tiny = torch.finfo(dtype).tiny
    ulp = torch.finfo(dtype).eps * scale[finite].clamp(min=tiny)
    err = (got[finite] - want[finite]).abs()
    assert torch.all(err <= count * ulp), f"max error {(err / ulp).max().item():.2f} roundings"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(FUNCS))
def test_values_at_the_edges_are_torchs(name, dtype):
    ours, theirs = FUNCS[name]
    x, y = _grid(dtype)
    traced = _traced(ours, y)
    for out in (traced.out, simplify(traced.out)):  # simplification keeps the values
        want = theirs(x, y.view(1, 1, 1, -1))
        got = evaluate(out, _env(traced, x, dtype)).expand_as(want)
        if name in ("hypot", "logaddexp", "logaddexp2"):
            # compositions that round a few times where torch rounds once (or fuses a
            # multiply-add): within two roundings of the largest magnitude involved
            both = torch.stack(torch.broadcast_tensors(x, y.view(1, 1, 1, -1), want)).abs()
            _close(got, want, torch.nan_to_num(both, posinf=0.0).amax(0), 2, dtype)
        else:  # torch's own formula: within one ulp (torch's vectorized and scalar libm differ)
            _close(got, want, want.abs(), 1, dtype)


def test_hypot_is_exact_where_the_squares_are():
    # Integer legs of a right triangle give its integer hypotenuse, which a mask's radius test
    # compares exactly; values past 2^50 and below 2^-50 neither overflow nor underflow.
    x, y = torch.tensor([3.0, 5.0, 8.0, 20.0, 3e30, 3e-30]), torch.tensor([4.0, 12.0, 15.0, 21.0, 4e30, 4e-30])
    traced = trace_mod(lambda s, b, h, q, kv: torch.hypot(s, y[kv]), SCORE_MOD)
    env = _env(traced, x.view(1, 1, 1, -1).expand(1, 1, len(EDGES), 6), torch.float32)
    env.kv_idx = torch.arange(6, dtype=torch.int32).view(1, 1, 1, -1)
    got = evaluate(traced.out, env)[0, 0, 0]
    assert got.tolist() == torch.tensor([5.0, 13.0, 17.0, 29.0, 5e30, 5e-30]).tolist()


# Points where flexjit's derivative departs from torch's autograd (x, y or None for any y) ->
# flexjit's (d/dx, d/dy). logaddexp(2) of two equal infinities: the branch torch.where does not
# take stays finite (torch_ops.py), where torch's gives NaN. xlogy at x = 0: d/dy is 0 (torch: x/y,
# NaN at y = 0; xlog1py's at y = -1); d/dx at y = inf is 0, the value being 0 (torch: log(inf)). hypot at (0, 0):
# abs's subgradient 0 (torch: 0/0). logit at 0 and 1 without eps: NaN (torch: ±inf; a score of
# ∓inf gives both a NaN gradient in attention, ds being 0 there).
OWN_GRADIENTS = {
    "logaddexp": [(INF, INF, 0.5, 0.5), (-INF, -INF, 0.5, 0.5)],
    "logaddexp2": [(INF, INF, 0.5, 0.5), (-INF, -INF, 0.5, 0.5)],
    "xlogy": [(z, w, 0.0, 0.0) for z in (0.0, -0.0) for w in (0.0, -0.0)] + [(0.0, INF, 0.0, 0.0),
                                                                           (-0.0, INF, 0.0, 0.0)],
    "xlog1py": [(0.0, INF, 0.0, 0.0), (-0.0, INF, 0.0, 0.0), (0.0, -1.0, 0.0, 0.0), (-0.0, -1.0, 0.0, 0.0)],
    "hypot": [(z, w, 0.0, 0.0) for z in (0.0, -0.0) for w in (0.0, -0.0)],
    "logit": [(0.0, None, NAN, 0.0), (-0.0, None, NAN, 0.0), (1.0, None, NAN, 0.0)],
    "logit_negative_eps": [(0.0, None, NAN, 0.0), (-0.0, None, NAN, 0.0), (1.0, None, NAN, 0.0)],
}
OWN_GRADIENTS["special_xlogy"] = OWN_GRADIENTS["xlogy"]


def _positions(v):
    """The grid positions of edge value v (None: all); -0.0 and 0.0 apart."""
    if v is None:
        return list(range(len(EDGES)))
    return [k for k, e in enumerate(EDGES) if e == v and math.copysign(1, e) == math.copysign(1, v)]


@pytest.mark.parametrize("name", [n for n in FUNCS if n != "heaviside"])
def test_gradients_at_the_edges_are_torchs(name):
    # The derivative pass's d/dscore and d/dload against torch autograd on the same pairs, in
    # float64. Where an input or the value is NaN (logit outside [0, 1]; hypot(NaN, inf) is inf)
    # the gradients are not compared (abs's rule gives 0 at NaN, torch's NaN). Within float32's rounding: the derivative pass folds
    # its constants in float32, as the kernels hold them.
    ours, theirs = FUNCS[name]
    x, y = _grid(torch.float64)
    traced = _traced(ours, y)
    out = simplify(traced.out)
    loads = [n for n in ir.walk(out) if n.op is ir.Op.LOAD]  # none where y is not read
    dx, *dy = derivative(out, [ir.node(ir.Op.SCORE, ir.DType.FLOAT32), *loads])
    env = _env(traced, x, torch.float64)
    got_x, got_y = (evaluate(d, env).expand(x.shape).clone() for d in (dx, *(dy or [ir.const(0.0)])))
    xs = x.clone().requires_grad_(True)
    ys = y.view(1, 1, 1, -1).expand(x.shape).clone().requires_grad_(True)
    want_x, want_y = torch.autograd.grad(theirs(xs, ys).sum(), (xs, ys), allow_unused=True,
                                         materialize_grads=True)
    for a, b, gx, gy in OWN_GRADIENTS.get(name, []):
        for i in _positions(a):
            for j in _positions(b):
                got = (got_x[0, 0, i, j].item(), got_y[0, 0, i, j].item())
                assert torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor((gx, gy), dtype=torch.float64),
                                      equal_nan=True), (a, EDGES[j], got)
                want_x[0, 0, i, j], want_y[0, 0, i, j] = gx, gy
    nan_out = torch.isnan(theirs(x, ys.detach())) | torch.isnan(x) | torch.isnan(ys.detach())
    for got, want in ((got_x, want_x), (got_y, want_y)):
        got[nan_out] = want[nan_out] = 0.0
        torch.testing.assert_close(got, want, rtol=torch.finfo(torch.float32).eps, atol=0.0, equal_nan=True)


def test_heaviside_steps_with_the_values_at_zero():
    # torch has no derivative for heaviside; flexjit's is the step's (0) for the input and 1 for
    # the values where the input is 0. Integer inputs keep their dtype.
    x, y = _grid(torch.float64)
    traced = _traced(lambda s, v: torch.heaviside(s, v), y)
    out = simplify(traced.out)
    load = next(n for n in ir.walk(out) if n.op is ir.Op.LOAD)
    dx, dy = derivative(out, [ir.node(ir.Op.SCORE, ir.DType.FLOAT32), load])
    env = _env(traced, x, torch.float64)
    assert torch.equal(evaluate(dx, env).expand(x.shape), torch.zeros_like(x))
    assert torch.equal(evaluate(dy, env).expand(x.shape), (x == 0).double())
    ints = trace_mod(lambda s, b, h, q, kv: torch.heaviside(q - kv, torch.tensor(7)) * 1.0, SCORE_MOD)
    got = evaluate(ints.out, _env(ints, x, torch.float64))
    qi, ki = torch.arange(len(EDGES)).view(-1, 1), torch.arange(len(EDGES)).view(1, -1)
    assert torch.equal(got[0, 0], torch.heaviside(qi - ki, torch.tensor(7)).double())
