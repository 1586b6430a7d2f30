"""Tracing, the IR and the passes: CPU only, no kernels."""
import os
import subprocess
import sys

import pytest
import sympy as sp
import torch

from flexjit.ir import nodes as ir
from flexjit import mods
from flexjit.ir.interp import Env, evaluate
from flexjit.ir.nodes import Op
from flexjit.ir.passes import derivative, lower, simplify, to_sympy
from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, TraceError, trace_mod
from oracle import dense_attention


def _idx(L=7, S=9, B=2, H=3):
    return dict(b=torch.arange(B).view(-1, 1, 1, 1), h=torch.arange(H).view(1, -1, 1, 1),
                q_idx=torch.arange(L).view(1, 1, -1, 1), kv_idx=torch.arange(S).view(1, 1, 1, -1))


def _eval_vs_eager(fn, kind, float_dtype=torch.float32):
    """The interpreter on the traced IR equals the mod run eagerly on tensors (both in float32:
    eager torch rounds `.float()` and float32 buffers to float32, as the IR's float32 does)."""
    t = trace_mod(fn, kind)
    idx = _idx()
    score = torch.randn(2, 3, 7, 9, dtype=float_dtype)
    args = ([score] if kind == SCORE_MOD else []) + [idx["b"], idx["h"], idx["q_idx"], idx["kv_idx"]]
    eager = torch.as_tensor(fn(*args))
    got = evaluate(t.out, Env(**idx, score=score, buffers=tuple(t.buffers), scalars=tuple(t.scalars),
                              float_dtype=float_dtype))
    eager, got = torch.broadcast_tensors(eager, got)
    if eager.dtype == torch.bool:
        assert torch.equal(got, eager)
    else:
        assert torch.allclose(got.double(), eager.double(), rtol=1e-5, atol=1e-5), (got - eager).abs().max()
    return t


def test_every_supported_op_matches_eager():
    table = torch.randn(3, 16)
    doc = torch.randint(0, 3, (9,))

    def everything(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        x = torch.exp(score) + torch.exp2(score) * 0.5 + torch.log(torch.abs(score) + 1)
        x = x + torch.tanh(score) - torch.sigmoid(score) + torch.sqrt(score * score + 1)
        x = x + torch.rsqrt(score * score + 2) + torch.sin(score) * torch.cos(score) + torch.log2(score.abs() + 2)
        x = torch.where(d > 0, x, -x) + torch.minimum(score, d.float()) - torch.maximum(score, torch.zeros_like(score))
        x = x + torch.clamp(score, -0.5, 0.5) + (d // 3).float() + (d % 4).float() + (-d // 3).float()
        x = x + ((d & 3) | 1).float() + (~(d > 2)).float() + (d ^ 5).float() + score ** 2 + abs(d)
        x = x + table[h, (q_idx * 2 + kv_idx) % 16] + table[doc[q_idx], kv_idx]
        x = x + torch.floor(score * 3) + torch.ceil(score * 3) + (score / 7.0) + d.to(torch.float32) / 3
        x = x + score.float() * (1 - (b == 1).int()) + math_pi
        return x
    _eval_vs_eager(everything, SCORE_MOD)


math_pi = 3.141592653589793


def test_floor_division_and_remainder_follow_python():
    def signs(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx  # negative and positive values
        return ((d // 4) * 4 + d % 4 == d) & (d % -3 <= 0) & ((d // -3) * -3 + d % -3 == d)
    t = _eval_vs_eager(signs, MASK_MOD)
    got = evaluate(t.out, Env(**_idx()))
    assert got.all()


def test_nested_indexing_and_partial_views():
    # Chained indexing (bias[h][q][kv]) has per-element meaning in a mod (as under torch's
    # vmap), which eager broadcasting does not share; compare with the tuple form.
    bias = torch.randn(3, 7, 9)
    doc = torch.randint(0, 3, (7,))

    def nested(score, b, h, q_idx, kv_idx):
        return score + bias[doc[q_idx]][q_idx, kv_idx] + bias[h][q_idx][kv_idx]

    def flat(score, b, h, q_idx, kv_idx):
        return score + bias[doc[q_idx], q_idx, kv_idx] + bias[h, q_idx, kv_idx]
    t = trace_mod(nested, SCORE_MOD)
    assert t.out is trace_mod(flat, SCORE_MOD).out
    assert len(t.buffers) == 2  # bias captured once, doc once
    _eval_vs_eager(flat, SCORE_MOD)


def test_captured_scalars_are_runtime_arguments():
    def make(w):
        def window(b, h, q_idx, kv_idx):
            return q_idx - kv_idx <= w
        return window
    a, b = trace_mod(make(16), MASK_MOD), trace_mod(make(1024), MASK_MOD)
    assert a.out is b.out  # same IR node: same compiled kernel
    assert a.scalars == [16] and b.scalars == [1024]
    pa = lower(None, a)
    pb = lower(None, b)
    assert pa.key == pb.key and pa.scalars != pb.scalars


def test_global_scalars_and_softcap_factory():
    t1, t2 = trace_mod(mods.softcap(30.0), SCORE_MOD), trace_mod(mods.softcap(50.0), SCORE_MOD)
    assert t1.out is t2.out and t1.scalars == [30.0] and t2.scalars == [50.0]


def test_python_control_flow_on_captured_scalars_resolves_each_trace():
    def make(w):
        def m(b, h, q_idx, kv_idx):
            if w > 0:
                return q_idx - kv_idx <= w
            return q_idx >= kv_idx
        return m
    assert trace_mod(make(5), MASK_MOD).out is not trace_mod(make(0), MASK_MOD).out


def test_interning_and_stable_digest_across_processes():
    t = trace_mod(mods.sliding_window(64), MASK_MOD)
    t2 = trace_mod(mods.sliding_window(64), MASK_MOD)
    assert t.out is t2.out
    here = ir.digest([t.out])
    code = ("from flexjit import mods; from flexjit.ir import nodes as ir; from flexjit.frontend.trace import trace_mod; "
            "print(ir.digest([trace_mod(mods.sliding_window(7), 'mask_mod').out]))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert other.stdout.strip() == here


@pytest.mark.parametrize("fn,needle", [
    (lambda b, h, q, kv: True if q > kv else False, "Python control flow"),
    (lambda b, h, q, kv: q.item() > 0, "`.item()`"),
    (lambda b, h, q, kv: torch.arange(4)[q] > 0, "a tensor is created inside the mod"),
    (lambda b, h, q, kv: (q + kv).sum() > 0, "reduction"),
    (lambda b, h, q, kv: q.add_(1) > 0, "in-place"),
    (lambda b, h, q, kv: q, "must return a bool"),
    (lambda b, h, q, kv: min(q, kv) > 0, "Python control flow"),
    (lambda b, h, q, kv: torch.zeros(3)[q:] > 0, "indexing a captured tensor with slice"),
    (lambda b, h, q, kv: torch.max(q) > 0, "reduction"),
])
def test_untraceable_mods_name_the_reason(fn, needle):
    with pytest.raises(TraceError, match=None) as info:
        trace_mod(fn, MASK_MOD)
    assert needle in str(info.value), str(info.value)


def test_trace_error_names_mod_and_user_line():
    def my_mask(b, h, q_idx, kv_idx):
        if q_idx > kv_idx:  # the offending line
            return True
        return False
    with pytest.raises(TraceError) as info:
        trace_mod(my_mask, MASK_MOD)
    msg = str(info.value)
    assert "`my_mask`" in msg and "test_trace.py" in msg and "if q_idx > kv_idx:  # the offending line" in msg
    assert "hint: use torch.where" in msg


def test_math_function_on_traced_value_suggests_torch():
    import math

    def bad(score, b, h, q_idx, kv_idx):
        return math.tanh(score)
    with pytest.raises(TraceError, match="use torch functions"):
        trace_mod(bad, SCORE_MOD)


def test_hints_for_partial_indexing_and_python_lists():
    # T[h] on a 2-D tensor points at t[h, i] (not t[i]); a Python list indexed by a
    # traced value says to use a tensor (not the math.* hint of other conversions).
    table = torch.randn(4, 8)

    def partial(score, b, h, q_idx, kv_idx):
        return score + table[h]
    with pytest.raises(TraceError, match=r"(?s)2 dimensions was indexed with 1.*t\[h, i\]"):
        trace_mod(partial, SCORE_MOD)
    values = [0.5, 0.25, 0.125, 0.0625]

    def from_list(score, b, h, q_idx, kv_idx):
        return score + values[h]
    with pytest.raises(TraceError, match=r"(?s)Python list.*torch.tensor\(values\)") as info:
        trace_mod(from_list, SCORE_MOD)
    assert "math" not in str(info.value)


def test_wrong_arity_is_a_type_error_with_advice():
    with pytest.raises(TypeError, match="must take 5 arguments.*looks like a mask_mod"):
        trace_mod(lambda b, h, q, kv: q >= kv, SCORE_MOD)
    with pytest.raises(TypeError, match="must take 4 arguments"):
        trace_mod(lambda b, h, q: q >= 0, MASK_MOD)


def test_score_mod_returning_bool_is_refused():
    with pytest.raises(TraceError, match="returns a bool"):
        trace_mod(lambda s, b, h, q, kv: q >= kv, SCORE_MOD)


def test_debug_prints_ir(capsys, monkeypatch):
    monkeypatch.setenv("FLEXJIT_DEBUG", "1")
    trace_mod(mods.softcap(20.0), SCORE_MOD)
    out = capsys.readouterr().out
    assert "tanh(" in out and "scalar0" in out


# ------------------------------------------------------------------ passes


def test_simplify_folds_constants_and_identities():
    def m(score, b, h, q_idx, kv_idx):
        return (score * 1.0 + 0.0) * (2.0 * 3.0) + torch.where(q_idx >= 0 * kv_idx + q_idx, 0.0, 1.0) * 0.0
    t = trace_mod(m, SCORE_MOD)
    s = simplify(t.out)
    nodes = list(ir.walk(s))
    assert not any(n.op is Op.MUL and any(x.op is Op.CONST and x.arg == 1.0 for x in n.src) for n in nodes)
    assert any(n.op is Op.CONST and n.arg == 6.0 for n in nodes)
    # and it still computes the same function
    idx = _idx()
    score = torch.randn(2, 3, 7, 9)
    a = evaluate(t.out, Env(**idx, score=score))
    b = evaluate(s, Env(**idx, score=score))
    assert torch.allclose(a, b)


@pytest.mark.parametrize("mod", [
    mods.softcap(30.0),
    lambda s, b, h, q, kv: torch.sigmoid(s) * torch.exp(-s * s / 7.0) + torch.log(1 + s * s),
    lambda s, b, h, q, kv: torch.sqrt(s * s + 1) / (2 + torch.tanh(s)) + s ** 3,
    lambda s, b, h, q, kv: torch.exp2(s) - torch.rsqrt(s * s + 4) + torch.sin(s) * torch.cos(2 * s),
])
def test_derivative_matches_sympy(mod):
    t = trace_mod(mod, SCORE_MOD)
    score = ir.node(Op.SCORE, ir.DType.FLOAT32)
    (d,) = derivative(t.out, [score])
    sym = sp.Symbol("score", real=True)
    want = sp.diff(to_sympy(t.out), sym)
    got = to_sympy(d)
    # compare numerically at several points (sympy's simplify on tanh/exp forms is slow)
    for x in (-1.7, -0.3, 0.4, 2.2):
        subs = {sym: x}
        subs.update({s: 30.0 for s in got.free_symbols if s.name.startswith("scalar")})
        subs.update({s: 30.0 for s in want.free_symbols if s.name.startswith("scalar")})
        assert abs(float(want.subs(subs)) - float(got.subs(subs))) < 1e-9


def test_derivative_of_where_max_and_loads():
    slopes = torch.rand(3, requires_grad=True)

    def m(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, torch.maximum(score, 0.5 * score) * slopes[h], -score)
    p = lower(trace_mod(m, SCORE_MOD), None)
    assert p.dscore is not None and len(p.grad_loads) == 1
    # check against autograd on the interpreter
    idx = _idx()
    score = torch.randn(2, 3, 7, 9, dtype=torch.float64, requires_grad=True)
    sl = slopes.detach().double().requires_grad_(True)
    out = evaluate(p.score, Env(**idx, score=score, buffers=(sl,), float_dtype=torch.float64))
    gs, gsl = torch.autograd.grad(out.sum(), [score, sl])
    env = Env(**idx, score=score.detach(), buffers=(sl.detach(),), float_dtype=torch.float64)
    ds = evaluate(p.dscore, env).expand_as(score)
    assert torch.allclose(ds, gs)
    dl = evaluate(p.grad_loads[0].grad, env).expand_as(score)
    hidx = idx["h"].expand_as(score)
    acc = torch.zeros(3, dtype=torch.float64).index_add_(0, hidx.reshape(-1), dl.reshape(-1))
    assert torch.allclose(acc, gsl)


def test_identity_score_and_noop_mask_lower_to_nothing():
    p = lower(trace_mod(lambda s, b, h, q, kv: s, SCORE_MOD), trace_mod(lambda b, h, q, kv: True, MASK_MOD))
    assert p.score is None and p.mask is None and p.dscore is None


def test_mask_captures_follow_score_captures():
    bias = torch.randn(4)
    doc = torch.randint(0, 2, (8,))
    p = lower(trace_mod(lambda s, b, h, q, kv: s + bias[h], SCORE_MOD),
              trace_mod(lambda b, h, q, kv: doc[q] == doc[kv], MASK_MOD))
    assert p.buffers[0] is bias and p.buffers[1] is doc
    slots = {n.src[0].arg[0] for n in ir.walk(p.mask) if n.op is Op.LOAD}
    assert slots == {1}


# ------------------------------------------------------------------ trace cache

WINDOW = 5


def test_trace_cache_follows_globals_closures_and_tensors():
    global WINDOW

    def by_global(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= WINDOW
    first = trace_mod(by_global, MASK_MOD)
    assert trace_mod(by_global, MASK_MOD) is first  # unchanged: the cached trace
    WINDOW = 7
    try:
        again = trace_mod(by_global, MASK_MOD)
        assert again is not first and again.scalars == [7]
    finally:
        WINDOW = 5

    table = [torch.randn(4)]
    flag = [True]

    def by_closure(score, b, h, q_idx, kv_idx):
        return score + table[0][h] if flag[0] else score
    t1 = trace_mod(by_closure, SCORE_MOD)
    assert t1.buffers[0] is table[0]
    table[0] = torch.randn(4)  # a new tensor object: traced again, capturing it
    t2 = trace_mod(by_closure, SCORE_MOD)
    assert t2.buffers[0] is table[0]
    flag[0] = False  # Python control flow on a captured value: traced again
    assert trace_mod(by_closure, SCORE_MOD).out.op is Op.SCORE


def test_unfingerprintable_captures_are_traced_every_call():
    class Holder:
        scale = 2.0
    holder = Holder()

    def by_attribute(score, b, h, q_idx, kv_idx):
        return score * holder.scale
    a = trace_mod(by_attribute, SCORE_MOD)
    holder.scale = 3.0
    b = trace_mod(by_attribute, SCORE_MOD)
    assert a is not b and any(n.op is Op.CONST and n.arg == 3.0 for n in ir.walk(b.out))


@pytest.mark.parametrize("name", ["element plus a number", "row mean", "row sigmoid element"])
def test_values_computed_from_captures_follow_their_updates(name):
    # Ops on captured tensors that involve no traced argument are traced too, not computed once:
    # the trace is reused while the tensor's values change in place (an optimizer step).
    from flexjit import flex_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    table = torch.randn(19, generator=g)
    value = {"element plus a number": lambda t: t[3] + 1.0, "row mean": lambda t: t.mean(),
             "row sigmoid element": lambda t: t.sigmoid()[5]}[name]

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * value(table)
    for _ in range(3):
        got = flex_attention(q, k, v, score_mod=score_mod, backend="reference")
        want, _ = dense_attention(q, k, v, lambda s, *_: s * value(table).double())
        assert (got.double() - want).abs().max() < 1e-5
        with torch.no_grad():
            table.add_(0.5)


def test_a_learnable_capture_through_trace_time_math_trains():
    from flexjit import flex_attention
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    table = torch.randn(19, generator=g).requires_grad_()
    opt = torch.optim.SGD([table], lr=0.1)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * (table[3] + 1.0)
    for _ in range(3):
        flex_attention(q, k, v, score_mod=score_mod, backend="reference").sum().backward()
        ref = table.detach().double().requires_grad_()
        dense_attention(q, k, v, lambda s, *_: s * (ref[3] + 1.0))[0].sum().backward()
        assert torch.allclose(table.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)
        opt.step()
        opt.zero_grad()


def test_a_low_precision_element_widens_with_a_constant_index_too():
    # DESIGN: captured float16 values widen on load, so t[11] + 1.0 is a float32 sum whether the
    # index is a number or traced (eager torch would round the sum to float16).
    table = torch.full((19,), -0.168701171875, dtype=torch.float16)  # + 1.0 is no float16 value
    idx = _idx()
    values = []
    for fn in (lambda s, b, h, q_idx, kv_idx: s / (table[11] + 1.0),
               lambda s, b, h, q_idx, kv_idx: s / (table[q_idx * 0 + 11] + 1.0)):
        t = trace_mod(fn, SCORE_MOD)
        score = torch.ones(2, 3, 7, 9)
        values.append(evaluate(t.out, Env(**idx, score=score, buffers=tuple(t.buffers),
                                          scalars=tuple(t.scalars), float_dtype=torch.float64)))
    wide, rounded = 1.0 / (table[11].double() + 1.0), 1.0 / (table[11] + 1.0).double()
    for got in values:
        assert torch.allclose(got, wide, rtol=1e-6, atol=0)
        assert not torch.allclose(got, rounded, rtol=1e-5, atol=0)


@pytest.mark.parametrize("fn, shape", [
    (lambda s, b, h, q_idx, kv_idx: s + torch.sigmoid(BIG_ROW)[q_idx], "(1000,)"),
    (lambda s, b, h, q_idx, kv_idx: s + (GRID * 2)[q_idx, kv_idx], "(8, 8)"),
    (lambda s, b, h, q_idx, kv_idx: s + BIG_ROW.mean(), "(1000,)"),
])
def test_whole_tensor_math_on_a_capture_names_the_element_form(fn, shape):
    with pytest.raises(TraceError, match=rf"whole captured tensor of shape \{shape[:-1]}\).*element by"):
        trace_mod(fn, SCORE_MOD)


BIG_ROW = torch.randn(1000)
GRID = torch.randn(8, 8)


def test_an_in_place_op_on_a_capture_is_refused_before_it_runs():
    table = torch.zeros(4)

    def by_method(score, b, h, q_idx, kv_idx):
        return score + table.add_(1.0)[0]

    def by_assignment(score, b, h, q_idx, kv_idx):
        table[0] = 5.0
        return score
    for fn, name in ((by_method, "add_"), (by_assignment, "__setitem__")):
        with pytest.raises(TraceError, match=f"in-place op `{name}` on a captured tensor"):
            trace_mod(fn, SCORE_MOD)
    assert torch.equal(table, torch.zeros(4))


@pytest.mark.parametrize("read, how", [
    (lambda t: t[0].item(), r"\.item\(\)"),
    (lambda t: float(t[0]), r"float\(\)"),
    (lambda t: int(t[1]), r"int\(\)"),
    (lambda t: t.tolist()[0], r"\.tolist\(\)"),
    (lambda t: [1.0, 2.0][PICK[1]], "as an index"),
])
def test_reading_a_captured_tensor_into_python_is_refused(read, how):
    # The trace is reused while the tensor's values change, so a number read at trace time
    # would be the first call's forever: flexjit computed with 1.0 after the table held 3.0.
    table = torch.tensor([1.0, 1.0])

    def scaled(score, b, h, q_idx, kv_idx):
        return score * read(table)
    with pytest.raises(TraceError, match=how + ".*captured tensor's value"):
        trace_mod(scaled, SCORE_MOD)


def test_a_mask_reading_a_captured_length_into_python_is_refused_when_planned():
    from flexjit import create_block_mask
    lengths = torch.tensor([40, 100])

    def padding(b, h, q_idx, kv_idx):
        return kv_idx < lengths[0].item()
    with pytest.raises(TraceError, match=r"(?s)mask_mod `padding`.*`\.item\(\)` reads"):
        create_block_mask(padding, None, None, 128, 128, device="cpu")


PICK = torch.tensor([0, 1])


def test_a_captured_element_used_as_a_tensor_follows_its_changes():
    from flexjit import flex_attention
    table = torch.tensor([1.0, 1.0])
    q, k, v = (torch.randn(1, 1, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def scaled(score, b, h, q_idx, kv_idx):
        return score * table[0]
    for value in (1.0, 3.0):
        table[0] = value
        want, _ = dense_attention(q, k, v, lambda s, *_: s * value, dtype=torch.float64)
        got = flex_attention(q, k, v, score_mod=scaled)
        assert (got.double() - want).abs().max().item() < 1e-5


# --------------------------------------------------------------------------- float indices


def _casts_of_sums(p):
    """CAST-to-float nodes whose operand is not an index leaf (what the float-index rewrite
    removes)."""
    roots = [r for r in (p.score, p.mask, p.dscore) if r is not None]
    return [n for n in ir.toposort(roots)
            if n.op is Op.CAST and n.dtype.is_float and n.src[0].op not in ir.INDEX_LEAVES]


def test_float_indices_moves_casts_onto_the_leaves():
    from flexjit.ir.passes import lower
    slopes = torch.rand(4)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx + 3)

    p = lower(trace_mod(alibi, SCORE_MOD), None)
    assert len(_casts_of_sums(p)) == 1
    f = lower(trace_mod(alibi, SCORE_MOD), None, float_index=True)
    assert _casts_of_sums(f) == [] and f.key != p.key
    # The same values, element for element, as the integer form (exact below the limit).
    q, kv = torch.meshgrid(torch.arange(300), torch.arange(300), indexing="ij")
    s = torch.randn(300, 300)
    for h in range(4):
        env = Env(b=torch.tensor(0), h=torch.tensor(h), q_idx=q, kv_idx=kv, score=s,
                  buffers=tuple(p.buffers))
        assert torch.equal(evaluate(p.score, env), evaluate(f.score, env))


def test_float_indices_leaves_other_integer_math_alone():
    from flexjit.ir.passes import lower

    def products(score, b, h, q_idx, kv_idx):  # a product, a floor division: not index sums
        return score + (q_idx * kv_idx) * 1e-6 + (q_idx // 7) * 0.5

    def three_terms(score, b, h, q_idx, kv_idx):  # three index terms could pass 2**24
        return score + (q_idx + kv_idx + q_idx) * 0.1

    for mod in (products, three_terms):
        p = lower(trace_mod(mod, SCORE_MOD), None)
        f = lower(trace_mod(mod, SCORE_MOD), None, float_index=True)
        assert (f.score, f.mask, f.dscore, f.grad_loads) == (p.score, p.mask, p.dscore, p.grad_loads)


def test_long_sequences_keep_integer_index_math():
    from flexjit.api.attention import prepare_call
    from flexjit.ir.passes import FLOAT_INDEX_LIMIT

    def alibi(score, b, h, q_idx, kv_idx):
        return score + 0.5 * (kv_idx - q_idx)

    short = torch.zeros(1, 1, 8, 8)
    long_q = torch.zeros(1, 1, 1, 8).expand(1, 1, FLOAT_INDEX_LIMIT, 8)
    assert _casts_of_sums(prepare_call(short, short, short, alibi, None, None, False, None).program) == []
    long_call = prepare_call(long_q, short, short, alibi, None, None, False, None)
    assert len(_casts_of_sums(long_call.program)) == 1


def _int_dtypes(p, op):
    return {n.dtype for root in (p.score, p.mask) if root is not None for n in ir.walk(root) if n.op is op}


def test_index_math_that_overflows_int32_is_computed_in_int64():
    # Int32 arithmetic that can leave int32 at the call's lengths (with the scalars'
    # values, and a captured int32 tensor holding anything int32 holds) is int64, as torch's
    # eager mods compute it; where it cannot, the program is untouched (int32 kernel indices).
    def product(b, h, q_idx, kv_idx):
        return (q_idx * 100000000) > kv_idx

    mask = trace_mod(product, MASK_MOD)
    assert _int_dtypes(lower(None, mask, lengths=(1, 1, 16, 16)), Op.MUL) == {ir.DType.INT32}
    wide = lower(None, mask, lengths=(1, 1, 256, 256))
    assert _int_dtypes(wide, Op.MUL) == {ir.DType.INT64}
    q, kv = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    got = evaluate(wide.mask, Env(b=torch.tensor(0), h=torch.tensor(0), q_idx=q.int(), kv_idx=kv.int()))
    assert torch.equal(got, product(0, 0, q, kv))  # eager torch: int64 aranges

    factor = 3

    def scaled(b, h, q_idx, kv_idx):
        return q_idx * factor + kv_idx < 1000
    for value, want in [(3, ir.DType.INT32), (10 ** 7, ir.DType.INT64)]:
        factor = value
        p = lower(None, trace_mod(scaled, MASK_MOD), lengths=(1, 1, 512, 512))
        assert _int_dtypes(p, Op.ADD) == {want}, value

    offsets = torch.tensor([5, 9], dtype=torch.int32)
    small = torch.tensor([5, 9], dtype=torch.int8)

    def shifted(score, b, h, q_idx, kv_idx):
        return score + (offsets[b] + q_idx).float() + (small[b] + kv_idx).float()
    p = lower(trace_mod(shifted, SCORE_MOD), None, lengths=(2, 1, 64, 64))
    # int32 + index can pass 2**31 - 1; an int8 table's value + index cannot.
    adds = sorted(n.dtype.value for n in ir.walk(p.score) if n.op is Op.ADD and n.dtype.is_int)
    assert adds == ["int32", "int64"]



def test_shifts_follow_torch_and_refuse_floats():
    # << and >> (and torch.bitwise_*_shift, on captured tensors too): torch's results for amounts
    # past the width and negative ones; a float operand is refused with the reason.
    table = torch.tensor([1, 2, 3, 40, -7], dtype=torch.int32)

    def shifts(b, h, q_idx, kv_idx):
        x = (q_idx - kv_idx) << (kv_idx % 7)
        y = torch.bitwise_right_shift(q_idx - 8, kv_idx % 6 - 1) + (table[q_idx % 5] >> table[kv_idx % 5])
        return (x + y + (3 << (q_idx % 4))) % 3 == 0
    p = lower(None, trace_mod(shifts, MASK_MOD), lengths=(1, 1, 16, 16))
    q, kv = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    got = evaluate(p.mask, Env(b=torch.tensor(0), h=torch.tensor(0), q_idx=q.int(), kv_idx=kv.int(),
                               buffers=(table,)))
    assert torch.equal(got, shifts(0, 0, q, kv))
    with pytest.raises(TraceError, match="floating"):
        trace_mod(lambda score, b, h, q_idx, kv_idx: score << 1, SCORE_MOD)
