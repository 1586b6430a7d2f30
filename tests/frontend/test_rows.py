"""Rows of captured tensors in mods: ``pos[q_idx]`` with ``pos`` of shape (S, 3), reduced over
its last dimension (torch's flex serves these; they unroll into scalar code here).

Values and gradients against the float64 oracle (tests/oracle.py: the mods run eagerly on
broadcast index tensors, as torch computes them) on the reference backend and on the Triton
kernels under the interpreter; the CuTe kernels compile for sm_90a.
"""
import pytest
import torch

from flexjit import TraceError, flex_attention
from flexjit.frontend.trace import SCORE_MOD, trace_mod
from flexjit.ir.nodes import Op, walk
from oracle import FLOOR, assert_close_to_oracle, dense_attention, random_qkv

# 80 keys (ragged against the Triton tests' 32-blocks), 3-D positions: the AlphaFold-style
# pairwise distance bias torch's tests use.
B, H, L, S, D = 1, 2, 48, 80, 16


def _positions(seed=0, grad=False, n=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(max(L, S) if n is None else n, 3, generator=g).requires_grad_(grad)


def _distance(pos):
    # (+ 1e-3: sqrt's derivative at a zero distance, q_idx == kv_idx, is infinite, in torch too)
    def distance_bias(score, b, h, q_idx, kv_idx):
        return score - ((pos[q_idx] - pos[kv_idx]).pow(2).sum(-1) + 1e-3).sqrt()
    return distance_bias


def _reductions(pos, table):
    # Written so that it also runs on the oracle's broadcast index tensors (dims explicit).
    def many(score, b, h, q_idx, kv_idx):
        x, y = pos[q_idx], pos[kv_idx]
        out = score + 0.1 * torch.linalg.vector_norm(x - y, dim=-1) + (x * y).sum(-1) / 4
        out = out - x.amax(-1) + x[..., 0] - torch.where(y > 0, y, 0.0).mean(-1)
        return out + table[h].prod(-1) + torch.abs(x - y).norm(p=1, dim=-1) * 0.01
    return many


def test_row_reductions_trace_to_scalar_code():
    # torch's mods see rows as 1-D tensors (vmap): sum() and dot() of a row reduce it.
    pos = _positions()

    def summed(score, b, h, q_idx, kv_idx):
        return score + (pos[q_idx] * pos[kv_idx]).sum(-1)

    def dotted(score, b, h, q_idx, kv_idx):
        return score + torch.dot(pos[q_idx], pos[kv_idx])

    def whole(score, b, h, q_idx, kv_idx):
        return score + (pos[q_idx] * pos[kv_idx]).sum()
    outs = {trace_mod(f, SCORE_MOD).out for f in (summed, dotted, whole)}
    assert len(outs) == 1  # the same interned graph


def _check_grads(out, ref, low, inputs, names):
    """Every gradient of out·dout against the float64 oracle's (floor scaled to its magnitude)."""
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, dout)
    want = torch.autograd.grad(ref, inputs, dout.double())
    lowg = torch.autograd.grad(low, inputs, dout)
    for name, a, w, lw in zip(names, got, want, lowg):
        assert_close_to_oracle(name, a, w, lw, FLOOR[torch.float32] * max(1.0, w.abs().max().item()))


def test_a_row_unrolls_into_loads_of_its_elements():
    pos = _positions()
    out = trace_mod(_distance(pos), SCORE_MOD).out
    loads = {n for n in walk(out) if n.op is Op.LOAD}
    # pos[q_idx, j] and pos[kv_idx, j] for j = 0, 1, 2: six loads, each a constant column
    assert len(loads) == 6
    assert {n.src[2].arg for n in loads} == {0, 1, 2}


@pytest.mark.parametrize("grad", [False, True])
def test_reference_backend_matches_the_oracle(grad):
    pos = _positions(grad=grad)
    table = torch.rand(H, 4) + 0.5
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=1)
    for mod in (_distance(pos), _reductions(pos, table)):
        out, lse = flex_attention(q, k, v, score_mod=mod, return_lse=True, backend="reference")
        ref, ref_lse = dense_attention(q, k, v, mod, dtype=torch.float64)
        low, low_lse = dense_attention(q, k, v, mod, dtype=torch.float32)
        assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
        assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.float32])
        if grad:
            _check_grads(out, ref, low, (q, pos), ("dq", "dpos"))


def test_triton_kernels_match_the_oracle(monkeypatch):
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("the interpreter tests need triton >= 3.9")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLEXJIT_POISON", "1")
    pos = _positions(grad=True)
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=2)
    mod = _distance(pos)
    out, lse = flex_attention(q, k, v, score_mod=mod, return_lse=True, backend="triton")
    ref, ref_lse = dense_attention(q, k, v, mod, dtype=torch.float64)
    low, low_lse = dense_attention(q, k, v, mod, dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.float32])
    _check_grads(out, ref, low, (q, k, v, pos), ("dq", "dk", "dv", "dpos"))


@pytest.mark.slow
def test_cute_kernels_compile_for_a_row_mod(tmp_path, monkeypatch):
    # The generated holes are scalar code over the unrolled loads: the sm90 forward and backward
    # build (a kernel's values are checked on the GPU, tests/backends/cute).
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # read once, when cutlass is first imported
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path))
    from flexjit.integrations.aot import compile_kernels
    # AUTOTUNE off: the run's own kernels, not the tuner's other candidates
    kernels = compile_kernels(_distance(_positions(n=256, grad=True)), None, arch="sm_90a",
                              head_dim=64, seq_len=256, heads=2,
                              kernel_options={"AUTOTUNE": False})
    assert [(k.pass_, k.part) for k in kernels] == [("fwd", "main"), ("bwd", "pre"),
                                                    ("bwd", "main"), ("bwd", "post")]


def test_rows_are_checked():
    pos, wide, four = _positions(), torch.randn(S, 100), torch.randn(S, 4)
    ids, table = torch.randint(0, 4, (S, 2)), torch.randn(8)
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=3)
    cases = {
        "returned a row of 3 values": lambda s, b, h, qi, ki: s + pos[qi],
        "rows of different lengths": lambda s, b, h, qi, ki: s + (pos[qi] * four[ki]).sum(),
        "or to a row of at most 64 values": lambda s, b, h, qi, ki: s + wide[qi].sum(-1),
        "over dim 1 of a row": lambda s, b, h, qi, ki: s + pos[qi].sum(1),
        "returned a row of 2 values": lambda s, b, h, qi, ki: s + table[ids[qi]],  # a gather
        "control flow or a number conversion on a row": lambda s, b, h, qi, ki: s if pos[qi] * 2 else s,
        "control flow or a number conversion on a captured tensor": lambda s, b, h, qi, ki: s if pos[qi] else s,
    }
    for why, mod in cases.items():
        with pytest.raises(TraceError, match=why.replace("(", r"\(")):
            flex_attention(q, k, v, score_mod=mod, backend="reference")


def test_rows_inside_torch_compile():
    # The compiled path retraces dynamo's graph of the mod with the same tracer: the same rows.
    pos = _positions(grad=True)
    mod = _distance(pos)
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=4)
    run = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=mod, backend="reference"),
                        fullgraph=True, backend="aot_eager")
    out = run(q, k, v)
    ref, _ = dense_attention(q, k, v, mod, dtype=torch.float64)
    low, _ = dense_attention(q, k, v, mod, dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    _check_grads(out, ref, low, (q, pos), ("dq", "dpos"))
