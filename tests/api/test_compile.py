"""flexjit inside torch.compile(fullgraph=True) on the CPU: the reference backend
through the custom ops, with aot_eager and inductor.

Every check compares the compiled result with eager flexjit on the same inputs (eager flexjit
is itself checked against the float64 oracle in test_reference): the compiled graph runs the
same backend code on the same program, so outputs and gradients must be bit-identical.
Sizes: L = S = 200 over 64-blocks (ragged, several blocks each way), 4 heads, head dim 32:
small enough for the CPU, large enough for partial, full and empty blocks.
"""
import pytest
import torch

import flexjit
from flexjit import create_block_mask
from flexjit.api.attention import flex_attention
from flexjit import mods

B, H, L, E = 2, 4, 200, 32
BLOCK = 64


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(seed=0, Hkv=H, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, L, E, generator=g, dtype=dtype).requires_grad_(True) for h in (H, Hkv, Hkv)]


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * g).sum(), inputs)


def _assert_equal(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}[{i}]: max diff {(a - b).abs().max()}"


SLOPES = torch.nn.Parameter(torch.linspace(-0.5, 0.5, H))


def learnable_alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_forward_and_backward_equal_eager(backend):
    # A learnable captured Parameter (its gradient flows through the custom op), a block mask
    # made outside the graph, GQA.
    bm = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=learnable_alibi, block_mask=bm, enable_gqa=True)

    q, k, v = _qkv(Hkv=2)
    want = f(q, k, v)
    want_g = _grads(want, [q, k, v, SLOPES])
    got = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    _assert_equal([got], [want], "out")
    _assert_equal(_grads(got, [q, k, v, SLOPES]), want_g, "grads")


def _doc_ids(cut):
    return torch.cat([torch.zeros(B, cut), torch.ones(B, L - cut)], 1).long()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_mask_and_block_mask_made_inside_the_graph(backend):
    # A document mask whose ids are a graph input, planned by create_block_mask inside the
    # compiled function: new ids on the next call must give a new plan, not a stale one.
    def f(q, k, v, doc):
        def doc_causal(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
        bm = create_block_mask(doc_causal, B, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
        return flex_attention(q, k, v, block_mask=bm)

    cf = torch.compile(f, fullgraph=True, backend=backend)
    q, k, v = _qkv(2)
    for cut in (70, 150):
        doc = _doc_ids(cut)
        want = f(q, k, v, doc)
        got = cf(q, k, v, doc)
        _assert_equal([got], [want], f"out cut={cut}")
        _assert_equal(_grads(got, [q, k, v]), _grads(want, [q, k, v]), f"grads cut={cut}")


class _Block(torch.nn.Module):
    """A transformer block's attention: projections, a score_mod over a learnable table."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(H * E, 3 * H * E)
        self.bias = torch.nn.Parameter(torch.zeros(H, 2 * L) + 0.01 * torch.randn(H, 2 * L))

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, L, 3, H, E).permute(2, 0, 3, 1, 4)
        bias = self.bias

        def rel_bias(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx - kv_idx + L]
        bm = create_block_mask(mods.causal(), None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
        return flex_attention(q, k, v, score_mod=rel_bias, block_mask=bm).sum()


def test_no_graph_breaks():
    x = torch.randn(B, L, H * E)
    explained = torch._dynamo.explain(_Block())(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_training_steps_do_not_recompile_and_match_eager():
    # 20 optimizer steps compiled and eager from the same start: the same losses (bit for bit:
    # aot_eager runs the same ops), and no recompile after the first step.
    xs = [torch.randn(B, L, H * E, generator=torch.Generator().manual_seed(i)) for i in range(20)]

    def train(model, step):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        losses = []
        for i, x in enumerate(xs):
            loss = step(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if i == 0:
                torch._dynamo.config.error_on_recompile = True
        torch._dynamo.config.error_on_recompile = False
        return torch.stack(losses)

    eager_model = _Block()
    want = train(eager_model, eager_model)
    model = _Block()
    try:
        got = train(model, torch.compile(model, fullgraph=True, backend="aot_eager"))
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert torch.equal(got, want), (got - want).abs().max()


def test_a_captured_scalar_that_changes_gives_the_right_answer():
    # Dynamo specialises the cap on first sight, then makes it a graph input: one recompile, after
    # which each new value reaches the kernel as a runtime scalar (same program, no recompile).
    def f(x, cap):
        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
        return flex_attention(x, x, x, score_mod=softcap)  # one tensor as q, k and v

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = _qkv(3)[0].detach()
    for i, cap in enumerate((20.0, 30.0, 7.5, 50.0, 3.0)):
        _assert_equal([cf(x, cap)], [f(x, cap)], f"cap={cap}")
        if i == 1:
            torch._dynamo.config.error_on_recompile = True
    torch._dynamo.config.error_on_recompile = False


def test_the_compiled_graph_runs_the_eager_program(programs_run):
    # Same IR, same Program.key: the compiled graph runs the kernels eager mode compiled. A mod
    # capturing a number differs on the first compile only, where dynamo specialises the number
    # into a constant; once it has changed it is a graph input, hence a runtime scalar as in eager.
    seen = programs_run
    bm = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)

    def f(q, k, v, cap):
        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(learnable_alibi(score, b, h, q_idx, kv_idx) / cap)
        return flex_attention(q, k, v, score_mod=softcap, block_mask=bm)

    def g(q, k, v):
        return flex_attention(q, k, v, score_mod=learnable_alibi, block_mask=bm)

    q, k, v = [t.detach() for t in _qkv(4)]
    for fn, args in ((g, ()), (f, (20.0,)), (f, (30.0,))):
        seen.clear()
        fn(q, k, v, *args)
        torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, *args)
        if args != (20.0,):
            assert len(seen) == 2 and seen[0] == seen[1], (fn.__name__, args, seen)


def test_autocast_inside_the_compiled_function():
    def f(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return flex_attention(q, k, v, score_mod=mods.alibi(H), enable_gqa=True)

    q, k, v = _qkv(5, Hkv=2)
    want = f(q, k, v)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert got.dtype == torch.bfloat16
    _assert_equal([got], [want], "out")
    _assert_equal(_grads(got.float(), [q, k, v]), _grads(want.float(), [q, k, v]), "grads")


def test_compiling_flex_attention_itself():
    # What transformers does with torch's flex_attention: compile the function, pass mods in.
    compiled = torch.compile(flexjit.flex_attention, fullgraph=True, backend="aot_eager")
    bm = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    q, k, v = _qkv(6)
    want, want_lse = flex_attention(q, k, v, score_mod=mods.softcap(20.0), block_mask=bm, return_lse=True)
    got, got_lse = compiled(q, k, v, score_mod=mods.softcap(20.0), block_mask=bm, return_lse=True)
    _assert_equal([got, got_lse], [want, want_lse], "out, lse")


def test_a_mod_flexjit_cannot_trace_fails_the_compile_with_its_reason():
    # The same refusal as in eager mode (a reduction over the traced score), raised when the graph
    # is compiled.
    def f(q, k, v):
        def reduces(score, b, h, q_idx, kv_idx):
            return score - score.sum()
        return flex_attention(q, k, v, score_mod=reduces)

    q, k, v = [t.detach() for t in _qkv(7)]
    with pytest.raises(flexjit.TraceError, match="reduction"):
        f(q, k, v)
    with pytest.raises(Exception, match="cannot trace score_mod `reduces`(.|\n)*reduction"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_max_scores_inside_the_graph(backend):
    # AuxRequest(max_scores=True) through the custom op, with mods and without: the same row max
    # and lse as eager mode, and gradients through out as before (the max has none).
    from flexjit.api.attention import AuxRequest
    bm = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)

    def with_mods(q, k, v):
        out, aux = flex_attention(q, k, v, score_mod=learnable_alibi, block_mask=bm, enable_gqa=True,
                                  return_aux=AuxRequest(lse=True, max_scores=True))
        return out, aux.lse, aux.max_scores

    def plain(q, k, v):
        out, aux = flex_attention(q, k, v, enable_gqa=True, return_aux=AuxRequest(max_scores=True))
        assert aux.lse is None
        return out, aux.max_scores

    q, k, v = _qkv(8, Hkv=2)
    for f in (with_mods, plain):
        want = f(q, k, v)
        got = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
        _assert_equal(got, want, f.__name__)
        assert not got[-1].requires_grad and got[-1].shape == (B, H, L)
        _assert_equal(_grads(got[0], [q, k, v]), _grads(want[0], [q, k, v]), f"{f.__name__} grads")
