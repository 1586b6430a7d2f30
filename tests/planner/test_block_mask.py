"""The block-sparsity planner against dense masks, and BlockMask's torch-compatible surface."""
import math
import resource
import subprocess
import sys
import warnings

import pytest
import torch

from flexjit.planner.block_mask import BlockMask, and_masks, create_mask, noop_mask, or_masks

from flexjit import StaleBlockMaskWarning, create_block_mask
from flexjit.api.attention import flex_attention
from flexjit import mods
from mods_catalog import CORE, make_case
from oracle import dense_attention


def expected_kinds(dense: torch.Tensor, bq: int, bkv: int) -> torch.Tensor:
    """Block kinds from a dense (B,H,L,S) mask: 0 empty, 1 partial, 2 full (valid positions only)."""
    B, H, L, S = dense.shape
    nq, nkv = -(-L // bq), -(-S // bkv)
    pad = torch.zeros(B, H, nq * bq, nkv * bkv, dtype=torch.bool)
    pad[..., :L, :S] = dense
    valid = torch.zeros_like(pad)
    valid[..., :L, :S] = True
    blk = pad.view(B, H, nq, bq, nkv, bkv)
    vblk = valid.view(B, H, nq, bq, nkv, bkv)
    any_true = blk.any(3).any(-1)
    all_true = (blk | ~vblk).all(3).all(-1)
    return torch.where(any_true, torch.where(all_true, 2, 1), 0).to(torch.int8)


MASKED = [n for n in CORE if make_case(n, 2, 3, 64, 64).mask_mod is not None]


@pytest.mark.parametrize("block_size", [32, 128, (64, 32), (32, 64)])
@pytest.mark.parametrize("name", MASKED)
def test_block_kinds_match_dense_mask(name, block_size):
    # 333 x 517: ragged against every block size, Q_LEN != KV_LEN
    B, H, L, S = 2, 3, 333, 517
    torch.manual_seed(1)
    case = make_case(name, B, H, L, S)
    bm = create_block_mask(case.mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block_size)
    dense = create_mask(case.mask_mod, B, H, L, S, device="cpu")
    bq, bkv = bm.BLOCK_SIZE
    assert torch.equal(bm.block_kinds(), expected_kinds(dense, bq, bkv))
    assert torch.equal(bm.to_dense(), (expected_kinds(dense, bq, bkv) > 0).to(torch.int32))


def test_layout_matches_torch_conventions():
    bm = create_block_mask(mods.causal(), 2, 3, 512, 512, device="cpu")
    assert bm.kv_num_blocks.shape == (2, 3, 4) and bm.kv_indices.shape == (2, 3, 4, 4)
    assert bm.kv_num_blocks.dtype == torch.int32 and bm.kv_indices.dtype == torch.int32
    # causal at 128: the diagonal block is partial, those left of it are full
    assert bm.kv_num_blocks[0, 0].tolist() == [1, 1, 1, 1]
    assert bm.full_kv_num_blocks[0, 0].tolist() == [0, 1, 2, 3]
    assert bm.kv_indices[0, 0, 2, 0].item() == 2
    assert bm.full_kv_indices[0, 0, 3, :3].tolist() == [0, 1, 2]
    # transposed lists for backward
    assert bm.q_num_blocks[0, 0].tolist() == [1, 1, 1, 1]
    assert bm.full_q_num_blocks[0, 0].tolist() == [3, 2, 1, 0]
    assert bm.full_q_indices[0, 0, 0, :3].tolist() == [1, 2, 3]
    assert bm.BLOCK_SIZE == (128, 128) and bm.seq_lengths == (512, 512) and bm.shape == (2, 3, 512, 512)
    assert bm.sparsity() == pytest.approx(100 * (1 - 10 / 16))
    assert bm.mean_kv_tokens() == pytest.approx(10 / 4 * 128)  # 10 listed blocks over 4 rows


def test_broadcast_none_and_torch_equivalence():
    bm = create_block_mask(mods.sliding_window(100), None, None, 700, 700, device="cpu", BLOCK_SIZE=64)
    assert bm.kv_num_blocks.shape[:2] == (1, 1)
    try:
        from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
    except ImportError:
        pytest.skip("torch flex_attention unavailable")
    tb = torch_cbm(lambda b, h, q, kv: (q >= kv) & (q - kv <= 100), None, None, 700, 700, device="cpu",
                   BLOCK_SIZE=64)
    # torch marks the ragged last blocks partial (it pads with False); we treat padding as
    # "don't care" since kernels bound-check anyway, so compare the union and the interior.
    assert torch.equal(bm.to_dense(), tb.to_dense())


def test_to_string_and_repr():
    bm = create_block_mask(mods.causal(), 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    s = bm.to_string()
    assert s.splitlines() == ["(0, 0)", "██      ", "████    ", "██████  ", "████████"]
    assert "BlockMask" in repr(bm) and "sparsity" in str(bm)


def test_to_device_copies():
    bm = create_block_mask(mods.causal(), 1, 1, 256, 256, device="cpu")
    moved = bm.to("cpu")
    assert moved is not bm and torch.equal(moved.kv_indices, bm.kv_indices)
    assert moved.mask_mod is bm.mask_mod


def test_slicing_keeps_a_working_mask_mod():
    # A batch- and head-dependent mask: slicing must keep the right mask_mod per element.
    B, H, L, S = 3, 4, 200, 200
    lengths = torch.tensor([50, 120, 199])

    def padded_window(b, h, q_idx, kv_idx):
        return (kv_idx < lengths[b]) & (q_idx - kv_idx <= 16 * (h + 1)) & (q_idx >= kv_idx)
    bm = create_block_mask(padded_window, B, H, L, S, device="cpu", BLOCK_SIZE=32)
    sub = bm[1:3, 2]
    assert sub.kv_num_blocks.shape == (2, 1, bm.kv_num_blocks.shape[2])
    q, k, v = [torch.randn(2, 1, n, 16, dtype=torch.float64) for n in (L, S, S)]
    out = flex_attention(q, k, v, block_mask=sub)
    ref, _ = dense_attention(q, k, v, mask_mod=lambda b, h, qi, ki: padded_window(b + 1, h + 2, qi, ki))
    assert torch.allclose(out, ref, atol=1e-10)


def test_query_block_slicing():
    bm = create_block_mask(mods.causal(), 1, 1, 300, 300, device="cpu", BLOCK_SIZE=64)
    last = bm[:, :, torch.tensor([4])]
    assert last.seq_lengths == (300 - 256, 300)
    q = torch.randn(1, 1, 44, 16, dtype=torch.float64)
    k, v = [torch.randn(1, 1, 300, 16, dtype=torch.float64) for _ in range(2)]
    out = flex_attention(q, k, v, block_mask=last)
    ref, _ = dense_attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi + 256 >= ki)
    assert torch.allclose(out, ref, atol=1e-10)
    with pytest.raises(IndexError, match="last"):
        bm[:, :, torch.tensor([4, 0])]


def test_indexing_selects_what_torchs_does():
    # 256 x 192 over 64-blocks: no ragged edge, so torch's lists and ours are the same and every
    # index form must select the same lists (an int keeps its dimension in both). None and ...
    # are refused: torch's lists do not survive them either, and a silent guess would pick
    # the wrong dimension.
    from torch.nn.attention import flex_attention as tflex
    lengths = torch.tensor([70, 256, 130])

    def padded_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx < lengths[b]) & (h <= q_idx % 4)
    ours = create_block_mask(padded_causal, 3, 4, 256, 192, device="cpu", BLOCK_SIZE=64)
    theirs = tflex.create_block_mask(padded_causal, 3, 4, 256, 192, device="cpu", BLOCK_SIZE=64)
    for index in (1, -1, slice(1, None), (0, 2), (-1, slice(None, None, 2)), ([2, 0],),
                  (torch.tensor([True, False, True]), 3), (slice(None), slice(None), torch.tensor([3, 1]))):
        got, want = ours[index], theirs[index]
        for a in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(got, a), getattr(want, a)), (index, a)
        assert torch.equal(got.to_dense(), want.to_dense()), index
    with pytest.raises(ValueError):
        theirs[..., 1]
    for index in ((Ellipsis, 1), (None,), (0, None)):
        with pytest.raises(IndexError, match="None and"):
            ours[index]


def test_combinators():
    def glob(b, h, q_idx, kv_idx):
        return kv_idx < 8
    for fn, ref in [(and_masks(mods.causal(), mods.sliding_window(20, causal=False)),
                     lambda q, kv: (q >= kv) & ((q - kv).abs() <= 20)),
                    (or_masks(mods.causal(), glob), lambda q, kv: (q >= kv) | (kv < 8)),
                    (noop_mask, lambda q, kv: torch.ones_like(q - kv, dtype=torch.bool))]:
        dense = create_mask(fn, 1, 1, 64, 64, device="cpu")
        q, kv = torch.arange(64).view(-1, 1), torch.arange(64).view(1, -1)
        assert torch.equal(dense[0, 0], ref(q, kv).expand(64, 64))
    with pytest.raises(RuntimeError, match="callable"):
        and_masks(mods.causal(), 3)


def test_from_kv_blocks_roundtrip():
    bm = create_block_mask(mods.document(torch.tensor([0] * 100 + [1] * 156)), 1, 1, 256, 256, device="cpu",
                           BLOCK_SIZE=32)
    again = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                     BLOCK_SIZE=32, mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths)
    for a in BlockMask._TENSOR_ATTRS:
        assert torch.equal(getattr(again, a), getattr(bm, a)), a


def test_bad_block_size_and_lengths():
    with pytest.raises(ValueError, match="multiples of 16"):
        create_block_mask(mods.causal(), 1, 1, 256, 256, device="cpu", BLOCK_SIZE=100)
    with pytest.raises(ValueError, match="Q_LEN must be a non-negative int"):
        create_block_mask(mods.causal(), 1, 1, -1, 256, device="cpu")
    with pytest.raises(TypeError, match="4 arguments"):
        create_block_mask(lambda s, b, h, q, kv: s, 1, 1, 64, 64, device="cpu")


# The child's own peak: VmHWM (its address space's high-water mark, new at exec). Linux's
# ru_maxrss keeps the forking process's peak across exec, so under a test worker that had grown
# to 3 GiB it read the worker's memory, not the planner's.
_BIG = """
import resource, time, torch
from flexjit import create_block_mask, mods

def peak_gib():
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

S = 131072
t = time.time()
causal = create_block_mask(mods.causal(), None, None, S, S, device="cpu")
doc = torch.repeat_interleave(torch.arange(S // 1024), 1024)
docs = create_block_mask(mods.document(doc), None, None, S, S, device="cpu")
print(time.time() - t, peak_gib(),
      causal.full_kv_num_blocks.sum().item(), docs.kv_num_blocks.sum().item() + docs.full_kv_num_blocks.sum().item())
"""


def test_128k_masks_build_in_bounded_memory():
    # The dense 128k x 128k bool mask alone is 16 GiB; we require the whole process to peak
    # under 3 GiB (torch itself takes a few hundred MB) and the result to be exact.
    out = subprocess.run([sys.executable, "-c", _BIG], capture_output=True, text=True, check=True)
    secs, peak_gib, causal_full, doc_blocks = out.stdout.split()
    assert float(peak_gib) < 3.0, out.stdout
    n = 131072 // 128
    assert int(causal_full) == n * (n - 1) // 2  # every block strictly below the diagonal is full
    assert int(doc_blocks) == (n // 8) * (8 * 9 // 2)  # 128 documents of 8 blocks, causal inside


def test_mean_kv_tokens_is_known_without_a_device_sync():
    # create_block_mask computes it from its CPU plan; .to() carries it, so kernels that pick a
    # schedule by it (cute persistent forward, Triton short-loop tiles) never wait on the GPU.
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 512, 512, device="cpu")
    assert bm._remembered("mean_kv_tokens") == pytest.approx(10 / 4 * 128)
    moved = bm.to("cpu")
    assert moved._remembered("mean_kv_tokens") == bm._remembered("mean_kv_tokens")
    # A BlockMask made by hand computes it on first use (and remembers it).
    hand = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices)
    assert hand._remembered("mean_kv_tokens") is None
    assert hand.mean_kv_tokens() == pytest.approx(4 / 4 * 128)
    assert hand._remembered("mean_kv_tokens") == pytest.approx(4 / 4 * 128)


def test_derived_values_follow_the_list_tensors():
    # What a kernel derives from the lists is remembered per BlockMask, and rebuilt when a list
    # attribute is given a new tensor (never a stale derivation).
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=128)
    builds = []
    total = lambda: builds.append(1) or int(bm.kv_num_blocks.sum())  # noqa: E731
    partial = 2  # causal over 2 x 2 blocks: the diagonal ones
    assert bm.derived("total", total) == partial and bm.derived("total", total) == partial
    assert len(builds) == 1
    bm.kv_num_blocks = torch.zeros_like(bm.kv_num_blocks)
    assert bm.derived("total", total) == 0 and len(builds) == 2
    assert bm.to("cpu").derived("total", total) == 0 and len(builds) == 3  # a new BlockMask


def test_block_mask_surface_matches_torchs():
    # Against torch's own BlockMask on the CPU: sparsity on ragged lengths (counted
    # over B·H·Q_LEN·KV_LEN), str(), _adjust, as_tuple, the full_q pair's validation, and the
    # create_block_mask keyword arguments torch has.
    from torch.nn.attention import flex_attention as tflex

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    ours = create_block_mask(causal, 1, 1, 1000, 999, device="cpu")
    theirs = tflex.create_block_mask(causal, 1, 1, 1000, 999, device="cpu")
    assert ours.sparsity() == pytest.approx(theirs.sparsity()) and round(ours.sparsity(), 2) == 40.96
    ours = create_block_mask(causal, 3, 2, 512, 384, device="cpu", compute_dq_write_order=True,
                             dq_kv_order=True)
    theirs = tflex.create_block_mask(causal, 3, 2, 512, 384, device="cpu")
    assert str(ours) == str(theirs)
    small, small_t = ours._adjust(300, 200), theirs._adjust(300, 200)
    assert small.seq_lengths == (300, 200) == tuple(small_t.seq_lengths)
    for a in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(small, a), getattr(small_t, a)), a
    flat = ours.as_tuple()
    assert flat[:2] == (512, 384) and flat[-3:-1] == (128, 128) and flat[-1] is ours.mask_mod
    nested = ours.as_tuple(flatten=False)
    assert nested[0] == (512, 384) and nested[-2] == (128, 128)
    assert ours.numel() == 3 * 2 * 512 * 384
    with pytest.raises(ValueError, match="full_q"):
        BlockMask(ours.seq_lengths, ours.kv_num_blocks, ours.kv_indices, ours.full_kv_num_blocks,
                  ours.full_kv_indices, ours.q_num_blocks, ours.q_indices, ours.full_q_num_blocks, None)


_NAN_TABLE = torch.tensor([float("nan") if i % 7 == 3 else float(i % 5) - 2 for i in range(300)])


@pytest.mark.parametrize("mask", [
    lambda b, h, q, kv: torch.log(q.float() - 100.0) < 10.0,  # NaN (False) below q = 100
    lambda b, h, q, kv: torch.maximum(torch.sqrt(q.float() - kv.float()), torch.zeros_like(q.float())) >= 0,
    lambda b, h, q, kv: torch.maximum(_NAN_TABLE[kv], torch.zeros_like(q.float())) > -1.0,  # NaN entries
    lambda b, h, q, kv: (torch.sqrt(kv.float() - 150.0) * 0.0) == 0.0,
    lambda b, h, q, kv: torch.abs(torch.log(q.float() - kv.float())) >= 0,
], ids=["log", "max_sqrt", "nan_table", "sqrt_times_zero", "abs_log"])
def test_planner_is_sound_where_a_mask_is_nan(mask):
    # A NaN in a mask's arithmetic compares False: a block where some element is NaN is never
    # full, however the NaN is hidden (max, abs, * 0). The intervals carry "may be NaN".
    B, H, L, S = 1, 1, 300, 300
    bm = create_block_mask(mask, B, H, L, S, device="cpu", BLOCK_SIZE=64)
    dense = create_mask(mask, B, H, L, S, device="cpu")
    assert torch.equal(bm.block_kinds(), expected_kinds(dense, 64, 64))


def test_index_math_past_int32_matches_torch():
    # Q_idx * 100000000 leaves int32 at these lengths; the planner, create_mask and the
    # attention all compute it in int64, as torch's eager create_mask does (it gave 33,536 True
    # entries, torch 65,280).
    from torch.nn.attention.flex_attention import create_mask as torch_create_mask

    def product(b, h, q_idx, kv_idx):
        return (q_idx * 100000000) > kv_idx
    want = torch_create_mask(product, 1, 1, 256, 256, device="cpu")
    assert want.sum().item() == 65280
    assert torch.equal(create_mask(product, 1, 1, 256, 256, device="cpu"), want)
    bm = create_block_mask(product, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    assert torch.equal(bm.block_kinds(), expected_kinds(want, 64, 64))
    q, k, v = (torch.randn(1, 1, 256, 16, dtype=torch.float64) for _ in range(3))
    ref = dense_attention(q, k, v, None, product)[0]
    got = flex_attention(q, k, v, block_mask=bm, backend="reference")
    assert (got - ref).abs().max().item() < 1e-12


def test_a_mask_whose_captured_tensor_was_edited_in_place_warns_once():
    # Document ids edited in place after planning: the lists describe the old documents while
    # partial blocks read the new ids, so the answer matches neither mask. One warning names
    # the tensor; a rebuilt mask is silent and right. 96 tokens in blocks of 32: three blocks,
    # the edit moves a document boundary across one.
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 96, 16, generator=g) for _ in range(3))
    doc_ids = torch.tensor([0] * 40 + [1] * 56)
    mask = mods.document(doc_ids)
    bm = create_block_mask(mask, None, None, 96, 96, device="cpu", BLOCK_SIZE=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleBlockMaskWarning)
        fresh = flex_attention(q, k, v, block_mask=bm)  # nothing edited: no warning
    assert torch.allclose(fresh.double(), dense_attention(q, k, v, mask_mod=mask)[0], atol=1e-5)
    doc_ids[:] = torch.tensor([0] * 8 + [1] * 88)
    want = dense_attention(q, k, v, mask_mod=mask)[0]
    with pytest.warns(StaleBlockMaskWarning, match=r"`doc_ids`.*create_block_mask again"):
        stale = flex_attention(q, k, v, block_mask=bm)
    assert (stale.double() - want).abs().max() > 0.1  # why it warns: the old lists are wrong
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleBlockMaskWarning)
        flex_attention(q, k, v, block_mask=bm)  # once per mask
        rebuilt = create_block_mask(mask, None, None, 96, 96, device="cpu", BLOCK_SIZE=32)
        assert torch.allclose(flex_attention(q, k, v, block_mask=rebuilt).double(), want, atol=1e-5)
    # a mask derived from a stale one (sliced, moved) is stale too
    bm2 = create_block_mask(mask, 1, 2, 96, 96, device="cpu", BLOCK_SIZE=32)
    doc_ids[0] = 1
    with pytest.warns(StaleBlockMaskWarning, match="`doc_ids`"):
        flex_attention(q, k, v, block_mask=bm2[:, 1:].to("cpu"))


@pytest.mark.parametrize("L,S", [(0, 300), (300, 0), (0, 0)])
def test_a_zero_length_mask_is_empty_and_serves_empty_inputs(L, S):
    # torch's create_block_mask takes a length of 0: every list is empty, in torch's shapes
    # (nQ or nKV of 0). 300: three ragged 128-blocks on the other side.
    tfa = pytest.importorskip("torch.nn.attention.flex_attention")
    causal = mods.causal()
    bm = create_block_mask(causal, 2, None, L, S, device="cpu")
    theirs = tfa.create_block_mask(causal, 2, None, L, S, device="cpu")
    for name in BlockMask._TENSOR_ATTRS:
        assert torch.equal(getattr(bm, name), getattr(theirs, name)), name
    assert bm.seq_lengths == (L, S) and bm.mean_kv_tokens() == 0.0
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, L, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 3, S, 16, generator=g, requires_grad=True) for _ in range(2))
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    # no keys: every row fully masked (out 0, lse -inf); no queries: nothing
    assert torch.equal(out, torch.zeros(2, 3, L, 16)) and torch.equal(lse, torch.full((2, 3, L), -math.inf))
    out.sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in (q, k, v))
    with pytest.raises(ValueError, match="create it with Q_LEN"):  # still checked when empty
        flex_attention(q, k, v, block_mask=create_block_mask(causal, 2, None, L + 1, S + 1,
                                                             device="cpu"))


def test_torchs_deterministic_order_arguments_are_accepted():
    # torch's BlockMask takes the order its deterministic backward writes dQ in; flexjit's
    # derives its own from the lists, so the arguments change nothing here, and a call that
    # passes them builds the same mask as torch's (and a wrong type raises).
    from torch.nn.attention import flex_attention as tflex
    theirs = tflex.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 2, 256, 256, device="cpu",
                                     BLOCK_SIZE=64)
    args = (theirs.kv_num_blocks, theirs.kv_indices, theirs.full_kv_num_blocks,
            theirs.full_kv_indices)
    plain = BlockMask.from_kv_blocks(*args, BLOCK_SIZE=64)
    ordered = BlockMask.from_kv_blocks(*args, BLOCK_SIZE=64, dq_write_order=None,
                                       dq_write_order_full=None, dq_kv_order=True)
    for name in ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices", "full_q_indices"):
        assert torch.equal(getattr(ordered, name), getattr(plain, name))
        assert torch.equal(getattr(ordered, name), getattr(theirs, name))
    again = BlockMask(*ordered.as_tuple(flatten=False)[:-2], BLOCK_SIZE=(64, 64),
                      dq_kv_order=None, dq_kv_order_spt=True)
    assert torch.equal(again.q_indices, plain.q_indices)
    with pytest.raises(TypeError, match="dq_write_order must be a tensor"):
        BlockMask.from_kv_blocks(*args, BLOCK_SIZE=64, dq_write_order=[0, 1])
    with pytest.raises(TypeError, match="dq_kv_order must be a bool"):
        BlockMask.from_kv_blocks(*args, BLOCK_SIZE=64, dq_kv_order="yes")
