"""One op, one row in every table: an ``ir.Op`` without a rule in any of them fails here.

An op's meaning is spread over the tracer (a torch function that builds it), the interpreter,
the derivative, the sympy bridge, the interval rules and both renderers. Each op below has one
example mod, written as a user would (torch functions and operators on the traced arguments);
the test traces it, checks the op is in the traced graph, then takes the graph through every
table. Where a table declares that an op has no rule (``passes.NO_GRADIENT``,
``intervals.NO_CHEAP_RULE``), that declaration is the row.
"""
import pytest
import torch

from flexjit.ir import intervals, nodes as ir, passes
from flexjit.backends.cute import render as cute_render
from flexjit.backends.triton import render as triton_render
from flexjit.ir.interp import Env, evaluate
from flexjit.ir.nodes import Op
from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, trace_mod

TABLE = torch.arange(8, dtype=torch.float32) - 3.0  # a captured tensor (BUFFER, LOAD)
WINDOW = 5  # a captured Python number (SCALAR)


def _f(i):
    """A positive float of an index: the argument of the float ops."""
    return i.float() * 0.125 + 0.5


# op -> (kind, mod). Masks for every op a mask can hold (the planner's intervals see them too);
# the score leaf needs a score_mod.
EXAMPLES = {
    Op.SCORE: (SCORE_MOD, lambda s, b, h, q, kv: s * 2.0),
    Op.B: (MASK_MOD, lambda b, h, q, kv: b >= 0),
    Op.H: (MASK_MOD, lambda b, h, q, kv: h < 4),
    Op.Q_IDX: (MASK_MOD, lambda b, h, q, kv: q >= 1),
    Op.KV_IDX: (MASK_MOD, lambda b, h, q, kv: kv <= 6),
    Op.CONST: (MASK_MOD, lambda b, h, q, kv: q >= 3),
    Op.SCALAR: (MASK_MOD, lambda b, h, q, kv: q - kv <= WINDOW),
    Op.BUFFER: (MASK_MOD, lambda b, h, q, kv: TABLE[kv] > 0),
    Op.LOAD: (MASK_MOD, lambda b, h, q, kv: TABLE[q] < 2.0),
    Op.NEG: (MASK_MOD, lambda b, h, q, kv: -q < -kv),
    Op.ABS: (MASK_MOD, lambda b, h, q, kv: torch.abs(q - kv) < 3),
    Op.EXP: (MASK_MOD, lambda b, h, q, kv: torch.exp(_f(q)) > _f(kv)),
    Op.EXP2: (MASK_MOD, lambda b, h, q, kv: torch.exp2(_f(q)) > _f(kv)),
    Op.LOG: (MASK_MOD, lambda b, h, q, kv: torch.log(_f(q)) < _f(kv)),
    Op.LOG2: (MASK_MOD, lambda b, h, q, kv: torch.log2(_f(q)) < _f(kv)),
    Op.TANH: (MASK_MOD, lambda b, h, q, kv: torch.tanh(_f(q)) < _f(kv)),
    Op.SIGMOID: (MASK_MOD, lambda b, h, q, kv: torch.sigmoid(_f(q)) < _f(kv)),
    Op.SQRT: (MASK_MOD, lambda b, h, q, kv: torch.sqrt(_f(q)) < _f(kv)),
    Op.RSQRT: (MASK_MOD, lambda b, h, q, kv: torch.rsqrt(_f(q)) < _f(kv)),
    Op.SIN: (MASK_MOD, lambda b, h, q, kv: torch.sin(_f(q)) < _f(kv)),
    Op.COS: (MASK_MOD, lambda b, h, q, kv: torch.cos(_f(q)) < _f(kv)),
    Op.FLOOR: (MASK_MOD, lambda b, h, q, kv: torch.floor(_f(q)) <= _f(kv)),
    Op.CEIL: (MASK_MOD, lambda b, h, q, kv: torch.ceil(_f(q)) >= _f(kv)),
    Op.ROUND: (MASK_MOD, lambda b, h, q, kv: torch.round(_f(q)) >= _f(kv)),
    Op.TRUNC: (MASK_MOD, lambda b, h, q, kv: torch.trunc(_f(q) - 1.0) >= _f(kv) - 1.5),
    Op.TAN: (MASK_MOD, lambda b, h, q, kv: torch.tan(_f(q) * 0.1) < _f(kv)),
    Op.ATAN: (MASK_MOD, lambda b, h, q, kv: torch.atan(_f(q)) < _f(kv)),
    Op.SINH: (MASK_MOD, lambda b, h, q, kv: torch.sinh(_f(q) - 1.0) < _f(kv)),
    Op.COSH: (MASK_MOD, lambda b, h, q, kv: torch.cosh(_f(q) - 1.0) < _f(kv)),
    Op.ASIN: (MASK_MOD, lambda b, h, q, kv: torch.asin(_f(q) - 1.0) < _f(kv) - 1.0),  # NaN past 1
    Op.ACOS: (MASK_MOD, lambda b, h, q, kv: torch.acos(_f(q) - 1.0) < _f(kv)),
    Op.LOG1P: (MASK_MOD, lambda b, h, q, kv: torch.log1p(_f(q)) < _f(kv)),
    Op.EXPM1: (MASK_MOD, lambda b, h, q, kv: torch.expm1(_f(q)) > _f(kv)),
    Op.ERF: (MASK_MOD, lambda b, h, q, kv: torch.erf(_f(q) - 1.0) < _f(kv) - 1.0),
    Op.ATAN2: (MASK_MOD, lambda b, h, q, kv: torch.atan2(_f(q) - 1.0, _f(kv) - 1.0) < 0.5),
    Op.ROUND_F16: (MASK_MOD, lambda b, h, q, kv: (_f(q) * 1e-3).half() > (_f(kv) * 1e-3).float()),
    Op.ROUND_BF16: (MASK_MOD, lambda b, h, q, kv: (_f(q) / 3.0).bfloat16() < _f(kv) / 3.0),
    Op.FMOD: (MASK_MOD, lambda b, h, q, kv: torch.fmod(q - 4, 3) == torch.fmod(kv - 4, 3)),
    Op.NOT: (MASK_MOD, lambda b, h, q, kv: ~(q < kv)),
    Op.CAST: (MASK_MOD, lambda b, h, q, kv: q.float() * 0.5 < kv.float()),
    Op.ADD: (MASK_MOD, lambda b, h, q, kv: q + 1 > kv),
    Op.SUB: (MASK_MOD, lambda b, h, q, kv: q - kv > 0),
    Op.MUL: (MASK_MOD, lambda b, h, q, kv: q * 2 > kv),
    Op.DIV: (MASK_MOD, lambda b, h, q, kv: q / 2 > kv),
    Op.FLOORDIV: (MASK_MOD, lambda b, h, q, kv: q // 4 == kv // 4),
    Op.MOD: (MASK_MOD, lambda b, h, q, kv: q % 3 == kv % 3),
    Op.POW: (MASK_MOD, lambda b, h, q, kv: _f(q) ** 2.0 > _f(kv)),
    Op.MAX: (MASK_MOD, lambda b, h, q, kv: torch.maximum(q, kv) < 5),
    Op.MIN: (MASK_MOD, lambda b, h, q, kv: torch.minimum(q, kv) > 1),
    Op.AND: (MASK_MOD, lambda b, h, q, kv: (q > 1) & (kv > 1)),
    Op.OR: (MASK_MOD, lambda b, h, q, kv: (q > 5) | (kv > 5)),
    Op.XOR: (MASK_MOD, lambda b, h, q, kv: (q > 2) ^ (kv > 2)),
    Op.SHL: (MASK_MOD, lambda b, h, q, kv: (q << (kv % 3)) > kv),
    Op.SHR: (MASK_MOD, lambda b, h, q, kv: (q >> 2) == (kv >> (q % 3))),
    Op.LT: (MASK_MOD, lambda b, h, q, kv: q < kv),
    Op.LE: (MASK_MOD, lambda b, h, q, kv: q <= kv),
    Op.GT: (MASK_MOD, lambda b, h, q, kv: q > kv),
    Op.GE: (MASK_MOD, lambda b, h, q, kv: q >= kv),
    Op.EQ: (MASK_MOD, lambda b, h, q, kv: q == kv),
    Op.NE: (MASK_MOD, lambda b, h, q, kv: q != kv),
    Op.WHERE: (MASK_MOD, lambda b, h, q, kv: torch.where(q > 3, q, kv) > 2),
}


def test_every_op_has_an_example():
    assert set(EXAMPLES) == set(Op), set(Op) - set(EXAMPLES)


def _traced(op):
    kind, mod = EXAMPLES[op]
    traced = trace_mod(mod, kind)
    ops = {n.op for n in ir.walk(traced.out)}
    assert op in ops, f"tracing the {op.value} example built no {op.value} node: {sorted(o.value for o in ops)}"
    return kind, traced


def _program(kind, traced):
    return passes.lower(traced, None) if kind == SCORE_MOD else passes.lower(None, traced)


@pytest.mark.parametrize("op", list(Op), ids=lambda o: o.value)
def test_every_table_has_a_rule(op):
    kind, traced = _traced(op)
    out = traced.out
    # interpreter: over an 8x8 grid of positions
    grid = torch.arange(8, dtype=torch.int32)
    env = Env(b=torch.zeros(1, 1, 1, 1, dtype=torch.int32), h=torch.ones(1, 1, 1, 1, dtype=torch.int32),
              q_idx=grid.view(1, 1, -1, 1), kv_idx=grid.view(1, 1, 1, -1),
              score=torch.randn(1, 1, 8, 8), buffers=tuple(traced.buffers), scalars=tuple(traced.scalars))
    value = evaluate(out, env)
    assert value.dtype == (torch.bool if kind == MASK_MOD else torch.float32)
    # derivative: a rule for every node of the graph (or a declaration that none flows)
    g = ir.const(1.0)
    for n in ir.toposort([out]):
        grads = passes._local_grads(n, g)
        assert len(grads) == len(n.src)
        float_in = any(x.dtype.is_float for x in n.src)
        assert op in passes.NO_GRADIENT or op is not n.op or any(x is not None for x in grads) \
            or not float_in, f"{op.value}: an op of float operands with no gradient and no declaration"
    # sympy
    passes.to_sympy(out)
    # intervals: the planner's rules (masks), and the planner itself agrees with the interpreter
    if kind == MASK_MOD:
        lo = torch.arange(0, 8, 4).view(1, 1, -1, 1)
        klo = torch.arange(0, 8, 4).view(1, 1, 1, -1)
        can_false, can_true = intervals.classify(out, torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1),
                                                 lo, lo + 3, klo, klo + 3, traced.buffers, traced.scalars)
        can_false, can_true = (t.expand(1, 1, 2, 2).reshape(2, 2) for t in (can_false, can_true))
        dense = value.expand(1, 1, 8, 8).reshape(2, 4, 2, 4).permute(0, 2, 1, 3)  # (qb, kb, 4, 4)
        assert torch.all(can_true | ~dense.any(-1).any(-1)), "interval rule unsound (true)"
        assert torch.all(can_false | dense.all(-1).all(-1)), "interval rule unsound (false)"
    # both renderers
    program = _program(kind, traced)
    assert "def " in cute_render.render(program)
    triton_render.render(program, "fwd")
    triton_render.render(program, "bwd")


def test_a_missing_rule_is_caught():
    # The checks above can fail: an op the derivative does not know raises, it is not skipped.
    import types

    class FakeOp:  # an op no table knows
        value = "fake"
    fake = types.SimpleNamespace(op=FakeOp(), src=(), dtype=ir.DType.FLOAT32)
    with pytest.raises(NotImplementedError, match="no derivative rule for fake"):
        passes._local_grads(fake, ir.const(1.0))
