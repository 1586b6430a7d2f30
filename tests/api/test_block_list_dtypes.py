"""Block lists in int64: what ``BlockMask.from_kv_blocks(torch.arange(...))`` holds.

torch's flex takes such a BlockMask; flexjit's kernels read int32 lists, so the API converts
them once per BlockMask and refuses what int32 cannot hold. Values against the float64 oracle
on the reference backend and the Triton kernels under the interpreter (forward and backward);
the CuTe sm90 kernel on a Hopper GPU (marker ``gpu``).
"""
import pytest
import torch

from flexjit import BlockMask, create_block_mask, flex_attention
from oracle import FLOOR, assert_close_to_oracle, dense_attention, random_qkv

# 3 query blocks x 4 kv blocks of 16 (the Triton tests' block), L and S ragged against them.
B, H, L, S, D, BS = 1, 2, 40, 60, 16, 16


def _banded(bs):
    def band(b, h, q_idx, kv_idx):
        return (kv_idx // bs - q_idx // bs >= 0) & (kv_idx // bs - q_idx // bs <= 1)
    return band


_band = _banded(BS)


def _int64_mask(full: bool, L=L, S=S, BS=BS) -> BlockMask:
    """The band mask's block lists built by hand with torch.arange (int64): query block i lists
    kv blocks i and i + 1 (those inside the kv blocks)."""
    nq, nkv = -(-L // BS), -(-S // BS)
    rows = torch.arange(nq).view(nq, 1) + torch.arange(2).view(1, 2)  # int64
    idx = torch.cat([rows, torch.zeros(nq, nkv - 2, dtype=torch.int64)], -1)
    num = (rows < nkv).sum(-1)
    idx, num = idx.expand(B, H, nq, nkv).clone(), num.expand(B, H, nq).clone()
    assert idx.dtype == num.dtype == torch.int64
    if full:  # every listed block full: the mask_mod is never evaluated, the lists alone decide
        return BlockMask.from_kv_blocks(torch.zeros_like(num), torch.zeros_like(idx), num, idx,
                                        BLOCK_SIZE=BS, seq_lengths=(L, S))
    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=BS, mask_mod=_banded(BS), seq_lengths=(L, S))


def _check(backend, full):
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=int(full))
    bm = _int64_mask(full)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, backend=backend)
    ref, ref_lse = dense_attention(q, k, v, mask_mod=_band)
    low, low_lse = dense_attention(q, k, v, mask_mod=_band, dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.float32])
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    lowg = torch.autograd.grad(low, (q, k, v), dout)
    for name, a, w, lw in zip(("dq", "dk", "dv"), got, want, lowg):
        assert_close_to_oracle(name, a, w, lw, FLOOR[torch.float32])
    assert bm.kv_indices.dtype == torch.int64  # the user's BlockMask is left as it was


@pytest.mark.parametrize("full", [False, True], ids=["partial", "full"])
def test_int64_lists_on_the_reference_backend(full):
    _check("reference", full)


@pytest.mark.parametrize("full", [False, True], ids=["partial", "full"])
def test_int64_lists_on_the_triton_kernels(full, monkeypatch):
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("the interpreter tests need triton >= 3.9")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLEXJIT_POISON", "1")
    _check("triton", full)


def test_the_int32_copy_is_made_once_and_follows_edits():
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=2)
    bm = _int64_mask(False)
    flex_attention(q, k, v, block_mask=bm, backend="reference")
    first = bm._remembered("int32_lists")
    assert first is not None and first.kv_indices.dtype == torch.int32
    flex_attention(q, k, v, block_mask=bm, backend="reference")
    assert bm._remembered("int32_lists") is first
    # An in-place edit of the user's lists is seen: drop every block of query block 0.
    with torch.no_grad():
        bm.kv_num_blocks[:, :, 0] = 0
    out = flex_attention(q, k, v, block_mask=bm, backend="reference")
    assert torch.all(out[:, :, :BS] == 0)
    assert bm._remembered("int32_lists") is not first


def test_lists_int32_cannot_hold_are_refused():
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=3)
    bm = _int64_mask(False)
    bm.kv_indices[0, 0, 0, 0] = 2 ** 32  # wraps to 0 in int32: a silent wrong block
    with pytest.raises(ValueError, match=r"kv_indices holds values in \[0, 4294967296\], outside int32"):
        flex_attention(q, k, v, block_mask=bm, backend="reference")
    floats = BlockMask.from_kv_blocks(torch.ones(B, H, 3), torch.zeros(B, H, 3, 4), BLOCK_SIZE=BS,
                                      seq_lengths=(L, S), compute_q_blocks=False)
    with pytest.raises(TypeError, match="kv_num_blocks has dtype torch.float32; block lists are integer"):
        flex_attention(q, k, v, block_mask=floats, backend="reference")


def test_int64_lists_inside_torch_compile():
    # In a graph the lists reach the custom op as given; its kernel converts them. The mask has
    # no full lists (None in the op's list argument), which the op's autograd must flatten as
    # torch does.
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=4)
    bm = _int64_mask(False)
    run = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=bm, backend="reference"),
                        fullgraph=True, backend="aot_eager")
    out = run(q, k, v)
    ref, _ = dense_attention(q, k, v, mask_mod=_band)
    low, _ = dense_attention(q, k, v, mask_mod=_band, dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    lowg = torch.autograd.grad(low, (q, k, v), dout)
    for name, a, w, lw in zip(("dq", "dk", "dv"), got, want, lowg):
        assert_close_to_oracle(name, a, w, lw, FLOOR[torch.float32])


def test_int32_lists_are_not_copied():
    bm = create_block_mask(_band, None, None, L, S, device="cpu", BLOCK_SIZE=BS)
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=5)
    flex_attention(q, k, v, block_mask=bm, backend="reference")
    assert bm._remembered("int32_lists") is None


@pytest.mark.gpu
def test_int64_lists_on_the_sm90_kernels():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    pytest.importorskip("cutlass")
    # 128-blocks (the sm90 kernels' tile): the band over 3 x 4 blocks, both lengths ragged.
    L, S, BS = 300, 500, 128
    band = _banded(BS)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, n, 64, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
               for n in (L, S, S))
    bm = _int64_mask(False, L, S, BS).to("cuda")
    out = flex_attention(q, k, v, block_mask=bm, backend="cute")
    ref, _ = dense_attention(q, k, v, mask_mod=band)
    low, _ = dense_attention(q, k, v, mask_mod=band, dtype=torch.bfloat16)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.bfloat16])
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    lowg = torch.autograd.grad(low, (q, k, v), dout)
    for name, a, w, lw in zip(("dq", "dk", "dv"), got, want, lowg):
        assert_close_to_oracle(name, a, w, lw, FLOOR[torch.bfloat16] * max(1.0, w.abs().max().item()))
