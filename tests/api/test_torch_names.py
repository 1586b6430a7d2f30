"""torch's names and small behaviours, as a user moving over by one import meets them.

The public and commonly imported private names of torch.nn.attention.flex_attention; mask
combinators that return tensors; torch's inductor-only kernel_options keys accepted and
ignored; out and gradients laid out like the inputs (torch gives out the query's stride order);
a BlockMask's ``seq_lengths`` override and ``_adjust``; torch's error types for mods that
cannot be traced and for its argument rules; the integer lengths torch's create_block_mask
takes. Values against the float64 oracle, errors against torch's own on the CPU.
"""
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexjit
from flexjit import BlockMask, and_masks, create_block_mask, flex_attention, noop_mask, or_masks
from oracle import FLOOR, assert_close_to_oracle, dense_attention, random_qkv

# 40 x 56 tokens over 16-blocks: ragged on both sides.
B, H, L, S, D, BS = 2, 2, 40, 56, 16, 16


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < 20


def test_torchs_names_import_from_flexjit():
    for name in torch_flex.__all__:
        assert hasattr(flexjit, name), name
    assert flexjit._DEFAULT_SPARSE_BLOCK_SIZE == torch_flex._DEFAULT_SPARSE_BLOCK_SIZE
    assert flexjit._LARGE_SPARSE_BLOCK_SIZE == torch_flex._LARGE_SPARSE_BLOCK_SIZE
    assert flexjit._score_mod_signature == torch_flex._score_mod_signature
    assert flexjit._mask_mod_signature == torch_flex._mask_mod_signature
    s = torch.randn(3)
    assert flexjit._identity(s, 0, 0, 0, 0) is s
    assert set(torch_flex.FlexKernelOptions.__annotations__) <= set(flexjit.FlexKernelOptions.__annotations__)
    assert flexjit.AuxRequest._fields == tuple(torch_flex.AuxRequest.__annotations__)
    assert flexjit.AuxOutput._fields == tuple(torch_flex.AuxOutput.__annotations__)


def test_mask_combinators_return_tensors_like_torchs():
    b = torch.arange(B).view(-1, 1, 1, 1)
    h = torch.arange(H).view(1, -1, 1, 1)
    q = torch.arange(L).view(1, 1, -1, 1)
    kv = torch.arange(S).view(1, 1, 1, -1)
    pairs = [(noop_mask, torch_flex.noop_mask), (and_masks(_causal, _window), torch_flex.and_masks(_causal, _window)),
             (or_masks(_causal, _window), torch_flex.or_masks(_causal, _window)),
             (and_masks(), torch_flex.and_masks()), (or_masks(), torch_flex.or_masks())]
    for ours, theirs in pairs:
        got, want = ours(b, h, q, kv), theirs(b, h, q, kv)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.bool
        assert got.shape == want.shape and torch.equal(got, want)
    # ... and they still plan and run (traced: the tensors are constants)
    for mask in (noop_mask, and_masks(_causal, _window), or_masks(_causal, _window)):
        bm = create_block_mask(mask, None, None, L, S, device="cpu", BLOCK_SIZE=BS)
        q_, k_, v_ = random_qkv(1, H, H, L, S, D, D, torch.float32, seed=0)
        out = flex_attention(q_, k_, v_, block_mask=bm, backend="reference")
        ref, _ = dense_attention(q_, k_, v_, mask_mod=mask)
        low, _ = dense_attention(q_, k_, v_, mask_mod=mask, dtype=torch.float32)
        assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])


def test_inductor_only_kernel_options_are_accepted_and_change_nothing():
    q, k, v = random_qkv(1, H, H, L, S, D, D, torch.float32, seed=1)
    plain = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5, backend="reference")
    tuned = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5, backend="reference",
                           kernel_options={"num_consumer_groups": 2, "num_buffers_warp_spec": 3,
                                           "IS_DIVISIBLE": False, "SPLIT_KV": 4, "PARTITION_SIZE": 64,
                                           "SAFE_N_BOUNDARY": True, "SKIP_MASK_SCORE": False,
                                           "fwd_num_consumer_groups": 2, "PRESCALE_QK": False})
    assert torch.equal(plain, tuned)
    with pytest.raises(ValueError, match="unknown kernel_options"):
        flex_attention(q, k, v, backend="reference", kernel_options={"NUM_CONSUMER_GROUPS": 2})


def _stride_order(t):
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def _bthd(seed):
    """q, k, v made as (B, seq, H, D) and viewed as (B, H, seq, D): a projection's layout."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, H, D, generator=g).transpose(1, 2).requires_grad_() for n in (L, S, S)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_out_and_gradients_follow_the_inputs_layout(backend, monkeypatch):
    if backend == "triton":
        triton = pytest.importorskip("triton")
        if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
            pytest.skip("the interpreter tests need triton >= 3.9")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _bthd(2)
    bm = create_block_mask(_causal, None, None, L, S, device="cpu", BLOCK_SIZE=BS)
    out = flex_attention(q, k, v, block_mask=bm, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch_flex.flex_attention(*(t.detach() for t in (q, k, v)))
    assert out.stride() == theirs.stride() and _stride_order(out) == _stride_order(q)
    ref, _ = dense_attention(q, k, v, mask_mod=_causal)
    low, _ = dense_attention(q, k, v, mask_mod=_causal, dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for name, t, gr, w, lw in zip(("dq", "dk", "dv"), (q, k, v), grads,
                                  torch.autograd.grad(ref, (q, k, v), dout.double()),
                                  torch.autograd.grad(low, (q, k, v), dout)):
        assert gr.stride() == t.stride(), name
        assert_close_to_oracle(name, gr, w, lw, FLOOR[torch.float32])


def test_contiguous_inputs_get_contiguous_results_without_a_copy():
    q, k, v = random_qkv(1, H, H, L, S, D, D, torch.float32, seed=3)
    out = flex_attention(q, k, v, backend="reference")
    assert out.is_contiguous()
    assert all(g.is_contiguous() for g in torch.autograd.grad(out.sum(), (q, k, v)))


def test_the_layout_inside_torch_compile():
    # The op's fake kernel promises the layout the real one gives.
    q, k, v = _bthd(4)
    run = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 2,
                                                       backend="reference"),
                        fullgraph=True, backend="aot_eager")
    out = run(q, k, v)
    assert _stride_order(out) == _stride_order(q)
    ref, _ = dense_attention(q, k, v, lambda s, b, h, qi, ki: s * 2)
    low, _ = dense_attention(q, k, v, lambda s, b, h, qi, ki: s * 2, dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    dq, = torch.autograd.grad(out.sum(), (q,))
    assert dq.stride() == q.stride()


def test_seq_lengths_override_and_adjust():
    # A mask planned for 64 x 64 serves 40 x 56 through _adjust, as torch's error messages advise;
    # from_kv_blocks takes the real lengths through seq_lengths.
    big = create_block_mask(_causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=BS)
    small = big._adjust(L, S)
    assert small.seq_lengths == (L, S) and small.mask_mod is _causal
    planned = create_block_mask(_causal, None, None, L, S, device="cpu", BLOCK_SIZE=BS)
    assert torch.equal(small.to_dense(), planned.to_dense())
    by_hand = BlockMask.from_kv_blocks(small.kv_num_blocks, small.kv_indices, small.full_kv_num_blocks,
                                       small.full_kv_indices, BLOCK_SIZE=BS, mask_mod=_causal,
                                       seq_lengths=(L, S))
    q, k, v = random_qkv(1, H, H, L, S, D, D, torch.float32, seed=5)
    ref, _ = dense_attention(q, k, v, mask_mod=_causal)
    low, _ = dense_attention(q, k, v, mask_mod=_causal, dtype=torch.float32)
    for bm in (small, by_hand):
        out = flex_attention(q, k, v, block_mask=bm, backend="reference")
        assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    with pytest.raises(ValueError, match=r"created for \(Q_LEN, KV_LEN\) = \(64, 64\)"):
        flex_attention(q, k, v, block_mask=big, backend="reference")


def _torch_eager(fn, *args, **kwargs):
    """torch's eager flex call, without its one-time performance warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def test_a_mod_that_cannot_be_traced_raises_a_runtime_error_as_torchs():
    # torch raises RuntimeError (vmap's, or dynamo's Unsupported) for such mods, and for a
    # sliced BlockMask's placeholder mask_mod: code catching that catches flexjit's TraceError.
    def branchy(b, h, q_idx, kv_idx):
        if q_idx > kv_idx:  # data-dependent Python control flow
            return q_idx >= kv_idx
        return q_idx < kv_idx

    def scalar_out(score, b, h, q_idx, kv_idx):
        return score.item()
    q, k, v = (t.detach() for t in random_qkv(1, H, H, L, S, D, D, torch.float32, seed=6))
    sliced = torch_flex.create_block_mask(_causal, 2, H, L, S, device="cpu", BLOCK_SIZE=BS)[1:]
    calls = [lambda m: m.create_block_mask(branchy, 1, 1, L, S, device="cpu", BLOCK_SIZE=BS),
             lambda m: m.flex_attention(q, k, v, score_mod=scalar_out),
             lambda m: m.flex_attention(q, k, v, block_mask=sliced)]
    for call in calls:
        with pytest.raises(RuntimeError):
            _torch_eager(call, torch_flex)
        with pytest.raises(flexjit.TraceError) as err:
            call(flexjit)
        assert isinstance(err.value, RuntimeError)
    assert "sliced BlockMask" in str(err.value)


def test_create_block_mask_takes_the_integer_lengths_torch_takes():
    # numpy integers and one-element integer tensors (lengths read off arrays or tensors): the
    # same lists and seq_lengths as Python ints, and the same attention as torch's mask gives.
    import numpy as np
    planned = create_block_mask(_window, None, None, L, S, device="cpu", BLOCK_SIZE=BS)
    theirs = torch_flex.create_block_mask(_window, None, None, L, S, device="cpu", BLOCK_SIZE=BS)
    q, k, v = (t.detach() for t in random_qkv(1, H, H, L, S, D, D, torch.float32, seed=7))
    want = _torch_eager(torch_flex.flex_attention, q, k, v, block_mask=theirs)
    ref, _ = dense_attention(q, k, v, mask_mod=_window)
    for lengths in ((np.int64(L), np.int32(S)), (torch.tensor(L), torch.tensor([S]))):
        bm = create_block_mask(_window, None, None, *lengths, device="cpu", BLOCK_SIZE=BS)
        assert bm.seq_lengths == (L, S) and all(type(n) is int for n in bm.seq_lengths)
        assert torch.equal(bm.to_dense(), planned.to_dense()) and torch.equal(bm.to_dense(), theirs.to_dense())
        for a in BlockMask._TENSOR_ATTRS:
            assert torch.equal(getattr(bm, a), getattr(planned, a)), a
        out = flex_attention(q, k, v, block_mask=bm, backend="reference")
        assert_close_to_oracle("out", out, ref, want, FLOOR[torch.float32])
    for bad in (float(L), np.float64(L), torch.tensor(float(L))):
        with pytest.raises(ValueError, match="Q_LEN must be a non-negative int"):
            create_block_mask(_window, None, None, bad, S, device="cpu", BLOCK_SIZE=BS)
    # torch fails on a negative batch or head count too (inside torch.arange); flexjit says which
    with pytest.raises(RuntimeError):
        _torch_eager(torch_flex.create_block_mask, _window, -1, None, L, S, device="cpu", BLOCK_SIZE=BS)
    for b, h in ((-1, None), (None, -2)):
        with pytest.raises(ValueError, match="B and H must be non-negative"):
            create_block_mask(_window, b, h, L, S, device="cpu", BLOCK_SIZE=BS)


def test_torchs_argument_rules_for_backend_and_dq_kv_order():
    # BACKEND beside FORCE_USE_FLEX_ATTENTION=True is a RuntimeError in torch, whichever
    # BACKEND; create_block_mask's dq_kv_order must be a bool (a ValueError). A False
    # FORCE_USE_FLEX_ATTENTION beside BACKEND is fine in both.
    q, k, v = (t.detach() for t in random_qkv(1, H, H, L, S, D, D, torch.float32, seed=8))
    for backend in ("AUTO", "TRITON"):
        opts = {"BACKEND": backend, "FORCE_USE_FLEX_ATTENTION": True}
        with pytest.raises(RuntimeError, match="FORCE_USE_FLEX_ATTENTION"):
            _torch_eager(torch_flex.flex_attention, q, k, v, kernel_options=opts)
        with pytest.raises(RuntimeError, match="FORCE_USE_FLEX_ATTENTION"):
            flex_attention(q, k, v, kernel_options=opts)
    opts = {"BACKEND": "AUTO", "FORCE_USE_FLEX_ATTENTION": False}
    want = _torch_eager(torch_flex.flex_attention, q, k, v, kernel_options=opts)
    ref, _ = dense_attention(q, k, v)
    assert_close_to_oracle("out", flex_attention(q, k, v, kernel_options=opts), ref, want,
                           FLOOR[torch.float32])
    for m in (torch_flex, flexjit):
        with pytest.raises(ValueError, match="dq_kv_order must be a bool"):
            _torch_eager(m.create_block_mask, _causal, 1, 1, L, S, device="cpu", BLOCK_SIZE=BS,
                         dq_kv_order=torch.arange(-(-S // BS)))
