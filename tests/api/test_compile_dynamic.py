"""flex_attention under torch.compile with dynamic shapes: one graph serves every length.

``dynamic=True`` (and the automatic dynamic shapes a changed length turns on) make the lengths
and the head dim symbols while dynamo traces; the HOP's static arguments hold only constants,
and what depends on the shapes (the default scale, the float-index choice) is formed by its
wrapper. A BlockMask's block size and schedule hint reach the graph as constants (dynamo would
make its numbers symbols), and create_block_mask's lengths as the shape of an empty tensor.
Values and gradients against the float64 oracle at each length; inductor compiles on the CPU
(its C++ backend), aot_eager elsewhere for speed.
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from flexjit import create_block_mask, flex_attention
from oracle import FLOOR, assert_close_to_oracle, dense_attention, random_qkv

# Lengths that share no block divisibility (32: whole blocks; 48, 40: ragged).
LENGTHS = (32, 48, 40)
SLOPE = torch.tensor([0.02, -0.03])  # a captured tensor: one per head


def _alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPE[h] * (q_idx - kv_idx)


def _check(run, L, seed):
    q, k, v = random_qkv(1, 2, 2, L, L, 16, 16, torch.float32, seed=seed)
    out = run(q, k, v)
    ref, _ = dense_attention(q, k, v, _alibi)
    low, _ = dense_attention(q, k, v, _alibi, dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    dout = torch.randn_like(out)
    for name, a, w, lw in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout),
                              torch.autograd.grad(ref, (q, k, v), dout.double()),
                              torch.autograd.grad(low, (q, k, v), dout)):
        assert_close_to_oracle(name, a, w, lw, FLOOR[torch.float32])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_dynamic_true_compiles_once_for_every_length(backend):
    counter = CompileCounterWithBackend(backend)
    run = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=_alibi, backend="reference"),
                        dynamic=True, fullgraph=True, backend=counter)
    for i, L in enumerate(LENGTHS):
        _check(run, L, seed=i)
    assert counter.frame_count == 1


def test_a_changed_length_turns_on_dynamic_shapes():
    # dynamic=None (the default): the first length specialises, the second recompiles with
    # symbolic lengths, and the third reuses that graph.
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=_alibi, backend="reference"),
                        fullgraph=True, backend=counter)
    for i, L in enumerate(LENGTHS):
        _check(run, L, seed=10 + i)
    assert counter.frame_count == 2


def test_an_explicit_scale_under_dynamic_shapes():
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(lambda q, k, v: flex_attention(q, k, v, scale=0.3, backend="reference"),
                        dynamic=True, fullgraph=True, backend=counter)
    for L in LENGTHS[:2]:
        q, k, v = random_qkv(1, 2, 2, L, L, 16, 16, torch.float32, seed=L)
        out = run(q, k, v)
        ref, _ = dense_attention(q, k, v, scale=0.3)
        low, _ = dense_attention(q, k, v, scale=0.3, dtype=torch.float32)
        assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    assert counter.frame_count == 1


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


# Lengths whose 16-blocks count 3, 5 and 4: never the head count 2, which duck sizing would tie
# to it (a guard of its own, and a recompile that is not the block mask's).
MASK_LENGTHS = (48, 80, 72)


def _check_masked(run, L, seed, **kw):
    q, k, v = random_qkv(1, 2, 2, L, L, 16, 16, torch.float32, seed=seed)
    out = run(q, k, v, **kw)
    ref, _ = dense_attention(q, k, v, _alibi, _causal)
    low, _ = dense_attention(q, k, v, _alibi, _causal, dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    dout = torch.randn_like(out)
    for name, a, w, lw in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout),
                              torch.autograd.grad(ref, (q, k, v), dout.double()),
                              torch.autograd.grad(low, (q, k, v), dout)):
        assert_close_to_oracle(name, a, w, lw, FLOOR[torch.float32])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_block_mask_made_inside_the_graph_under_dynamic_shapes(backend):
    # create_block_mask of the symbolic length: one graph for every length.
    counter = CompileCounterWithBackend(backend)

    def fn(q, k, v):
        L = q.shape[2]
        bm = create_block_mask(_causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)
        return flex_attention(q, k, v, score_mod=_alibi, block_mask=bm, backend="reference")
    run = torch.compile(fn, dynamic=True, fullgraph=True, backend=counter)
    for i, L in enumerate(MASK_LENGTHS):
        _check_masked(run, L, seed=20 + i)
    assert counter.frame_count == 1


def test_a_block_mask_made_outside_the_graph_under_dynamic_shapes():
    # A BlockMask argument: its block size guards; its schedule hint (mean kv tokens per query
    # block, rounded to a power of two) too, so a mask twice as dense compiles once more.
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(lambda q, k, v, bm: flex_attention(q, k, v, score_mod=_alibi, block_mask=bm,
                                                           backend="reference"),
                        dynamic=True, fullgraph=True, backend=counter)
    hints = set()
    for i, L in enumerate(MASK_LENGTHS):
        bm = create_block_mask(_causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)
        hints.add(bm._derived["mean_kv_tokens"][2])
        _check_masked(run, L, seed=30 + i, bm=bm)
    assert counter.frame_count == len(hints) == 2
    bm = create_block_mask(_causal, None, None, 48, 48, device="cpu", BLOCK_SIZE=(16, 32))
    _check_masked(run, 48, seed=40, bm=bm)  # a new block size: a new graph
    assert counter.frame_count == 3
