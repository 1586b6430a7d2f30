"""The block-sparsity planner: BlockMask and create_block_mask (torch-compatible).

A BlockMask lists, for every (batch, head, query block), the key/value blocks
that need mask_mod (partial) and, separately, those that are entirely allowed
(full): kernels skip full blocks' mask_mod and never visit unlisted blocks.
The transposed lists (q_*) serve the backward pass.

create_block_mask never holds the dense Q×KV mask: it classifies blocks by
interval analysis of the traced mask (``intervals.classify``), then evaluates
only the undecided blocks, a batch of blocks at a time, through the IR
interpreter. If the mask does not read b or h it is planned once and expanded.
"""
from __future__ import annotations

import itertools
import logging
import math
import operator
import time
import warnings
import weakref
from typing import Callable, Sequence

import torch

from flexjit import config
from flexjit.ir import bounds, intervals, nodes as ir
from flexjit.ir.interp import Env, evaluate
from flexjit.ir.nodes import Op
from flexjit.ir.passes import widen
from flexjit.frontend.captures import tensor_name
from flexjit.ir.program import Program
from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, check_arity, trace_mod

log = logging.getLogger("flexjit")
# Elements evaluated per dense batch: 16M int32 intermediates is ~64 MB each.
_DENSE_BATCH_ELEMS = 1 << 24


def _version(t) -> int | None:
    """A tensor's version counter (bumped by every in-place edit); None for None or an
    inference tensor (which keeps none)."""
    if t is None:
        return None
    try:
        return t._version
    except RuntimeError:
        return None


class StaleBlockMaskWarning(UserWarning):
    """A tensor the BlockMask's mask_mod captures was edited in place after the mask was
    planned: the block lists describe its old values (``BlockMask.warn_if_stale``)."""


def noop_mask(b, h, q_idx, kv_idx):
    """A mask_mod that allows everything: a 0-d True tensor like torch's (a constant when
    traced)."""
    return b.new_ones((), dtype=torch.bool)


def _identity(score, b, h, q_idx, kv_idx):
    """torch's default score_mod: the score unchanged."""
    return score


# torch's block size for create_block_mask, and its "one block spans everything" size.
_DEFAULT_SPARSE_BLOCK_SIZE = 128
_LARGE_SPARSE_BLOCK_SIZE = 1 << 30


def _check_mask_mods(mask_mods) -> None:
    if not all(callable(m) for m in mask_mods):
        raise RuntimeError(f"All inputs should be callable mask_mods: {mask_mods}")
    for m in mask_mods:
        check_arity(m, MASK_MOD)


def and_masks(*mask_mods: Callable) -> Callable:
    """The intersection of mask_mods."""
    _check_mask_mods(mask_mods)

    def and_mask(b, h, q_idx, kv_idx):
        result = b.new_ones((), dtype=torch.bool)  # a tensor, as torch's and_masks returns
        for m in mask_mods:
            result = result & m(b, h, q_idx, kv_idx)
        return result
    return and_mask


def or_masks(*mask_mods: Callable) -> Callable:
    """The union of mask_mods."""
    _check_mask_mods(mask_mods)

    def or_mask(b, h, q_idx, kv_idx):
        result = b.new_zeros((), dtype=torch.bool)
        for m in mask_mods:
            result = result | m(b, h, q_idx, kv_idx)
        return result
    return or_mask


# --------------------------------------------------------------------------- ordered <-> dense


def _dense_to_ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks, indices): listed blocks first, in ascending order (torch's layout)."""
    d = dense.to(torch.int32)
    num = d.sum(-1).to(torch.int32)
    idx = torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def _ordered_to_dense(num: torch.Tensor, idx: torch.Tensor, n_cols: int) -> torch.Tensor:
    pos = torch.arange(idx.shape[-1], device=idx.device)
    valid = pos < num.unsqueeze(-1)
    dense = torch.zeros(*idx.shape[:-1], n_cols + 1, dtype=torch.int32, device=idx.device)
    target = torch.where(valid, idx.long(), n_cols)
    dense.scatter_(-1, target, 1)
    return dense[..., :n_cols]


def block_classes(kv_num, kv_idx, full_num, full_idx) -> torch.Tensor:
    """(B, H, nQ, nKV) int8 from the four lists: 0 skipped, 1 partial, 2 full; a block listed
    both partial and full counts as partial (mask_mod still applies). No full lists: None."""
    n = kv_idx.shape[-1]
    partial = _ordered_to_dense(kv_num, kv_idx, n).bool()
    classes = partial.to(torch.int8)
    if full_num is not None:
        full = _ordered_to_dense(full_num, full_idx, n).bool() & ~partial
        classes = classes + 2 * full.to(torch.int8)
    return classes


def _transpose_ordered(num, idx):
    dense = _ordered_to_dense(num, idx, idx.shape[-1])
    return _dense_to_ordered(dense.transpose(-2, -1))


def tile_q_lists(q_num, q_idx, full_num, full_idx, tile_n: int, block: int = 128) -> tuple:
    """The transposed (q) lists per kv tile of ``tile_n`` keys (at most ``block``), from those
    per mask block of ``block`` keys: (num, idx, full_num, full_idx), counts (Bm, Hm, nT),
    indices (Bm, Hm, nT, nQ) listed first in increasing q order, nT = ⌈nKV·block / tile_n⌉.

    A tile covers one or two mask blocks (96-key tiles: 4 tiles = 3 blocks). It lists a q block
    as full (mask_mod skipped) only if every covered mask block is full, skips it only if every
    one is empty, and lists it partial otherwise; a block listed both partial and full counts as
    partial (``block_classes``). Torch ops on the lists' device, no host sync."""
    assert tile_n <= block
    n_kv, n_q = q_idx.shape[-2], q_idx.shape[-1]
    part = _ordered_to_dense(q_num, q_idx, n_q).bool()  # (Bm, Hm, nKV, nQ)
    full = _ordered_to_dense(full_num, full_idx, n_q).bool() & ~part
    tiles = torch.arange(-(-n_kv * block // tile_n), device=q_idx.device)
    first = tiles * tile_n // block
    last = torch.clamp((tiles * tile_n + tile_n - 1) // block, max=n_kv - 1)
    listed = part | full
    all_full = full[..., first, :] & full[..., last, :]
    some = listed[..., first, :] | listed[..., last, :]
    return (*_dense_to_ordered(some & ~all_full), *_dense_to_ordered(all_full))


def dq_order(block_lists) -> tuple:
    """The deterministic sm90 backward's walk of the q blocks and its dQ accumulation order,
    from the 8 block lists (kv lists, then q lists; zeros for absent full lists), as
    ``(q_lists, (rank, full))``.

    ``q_lists`` replaces the four transposed lists: per kv block, its partial and full q blocks
    merged into one list in increasing q order (a block listed as both counts as partial), and
    empty full lists. ``rank[b, h, n, j]`` = how many kv blocks n' > n list that q block (partial
    or full), i.e. how many reduce-adds into its dQ tile come before kv block n's;
    ``full[b, h, n, j]`` = 1 where the entry was a full block. All int32, shaped like q_indices
    (Bm, Hm, nKV, nQ). Built from the q lists themselves (the sequence the kernel walks), so the
    ranks of every q block are exactly 0..count-1. Torch ops on the lists' device; the backend
    keeps it on the BlockMask (``BlockMask.derived``)."""
    q_num, q_idx, fq_num, fq_idx = block_lists[4:]
    n_q = q_idx.shape[-1]
    part, full = _ordered_to_dense(q_num, q_idx, n_q), _ordered_to_dense(fq_num, fq_idx, n_q)
    both = part | full  # (Bm, Hm, nKV, nQ) 0/1: kv block n lists q block m
    num, idx = _dense_to_ordered(both)  # listed q blocks first, in increasing order
    present = torch.arange(n_q, device=idx.device) < num.unsqueeze(-1)
    after = torch.flip(torch.cumsum(torch.flip(both, [-2]), -2, dtype=torch.int32), [-2]) - both
    rank = torch.where(present, torch.gather(after, -1, idx.long()), 0).to(torch.int32)
    flag = torch.where(present, torch.gather(full & (1 - part), -1, idx.long()), 0).to(torch.int32)
    q_lists = (num, idx, torch.zeros_like(num), torch.zeros_like(idx))
    return q_lists, (rank.contiguous(), flag.contiguous())


# --------------------------------------------------------------------------- BlockMask


def _hint_text(mean: float) -> str:
    """The schedule hint ``mean_kv_tokens`` as a compiled graph reads it: text (a constant, not a
    symbol, under dynamic=True), rounded to a power of two so that a graph is not recompiled for
    every new mask's density; it steers only the choice of schedule."""
    return repr(2.0 ** round(math.log2(mean))) if mean > 0 else "0.0"


class BlockMask:
    """Block-sparse attention mask, field-compatible with torch's BlockMask.

    kv_num_blocks (B, H, nQ) / kv_indices (B, H, nQ, nKV): partial blocks per query block.
    full_kv_num_blocks / full_kv_indices: full blocks (mask_mod skipped), or None.
    q_num_blocks / q_indices / full_q_*: the same, transposed (per key/value block).
    BLOCK_SIZE: (Q, KV). seq_lengths: (Q_LEN, KV_LEN). B or H of 1 broadcasts.
    """

    def __init__(self, seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                 q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
                 BLOCK_SIZE=(_DEFAULT_SPARSE_BLOCK_SIZE, _DEFAULT_SPARSE_BLOCK_SIZE), mask_mod=None,
                 *, dq_write_order=None, dq_write_order_full=None, dq_kv_order=None,
                 dq_kv_order_spt=None):
        _check_write_order(dq_write_order, dq_write_order_full, dq_kv_order)
        if kv_indices.dim() < 2:
            raise RuntimeError("BlockMask must have at least 2 dimensions")
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("full_kv_num_blocks and full_kv_indices must be both provided or omitted")
        if (full_q_num_blocks is None) != (full_q_indices is None):
            raise ValueError("full_q_num_blocks and full_q_indices must be both provided or omitted")
        self.seq_lengths = tuple(int(x) for x in seq_lengths)
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.q_num_blocks = q_num_blocks
        self.q_indices = q_indices
        self.full_q_num_blocks = full_q_num_blocks
        self.full_q_indices = full_q_indices
        self.BLOCK_SIZE = _block_size(BLOCK_SIZE)
        # BLOCK_SIZE as text: under torch.compile(dynamic=True) dynamo makes an input's integers
        # symbols, but a string stays a constant, guarded on its value (api/compiled.py)
        self._block_text = "{},{}".format(*self.BLOCK_SIZE)
        self.mask_mod = mask_mod if mask_mod is not None else noop_mask
        # The tensors mask_mod captured when the planner read them, and their version counters
        # then (``warn_if_stale``); empty for lists not planned here.
        self._planned_from: tuple[tuple[torch.Tensor, ...], tuple] = ((), ())

    _TENSOR_ATTRS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,
                       BLOCK_SIZE=_DEFAULT_SPARSE_BLOCK_SIZE, mask_mod=None, seq_lengths=None,
                       compute_q_blocks=True, *, dq_write_order=None, dq_write_order_full=None,
                       dq_kv_order=None):
        """Build a BlockMask from kv block lists; q lists are derived by transposing. torch's
        ``dq_write_order``/``dq_write_order_full``/``dq_kv_order`` (the order its deterministic
        backward writes dQ in) are accepted and not needed: flexjit's deterministic backward
        derives its own fixed order from the lists."""
        _check_write_order(dq_write_order, dq_write_order_full, dq_kv_order)
        if kv_indices.dim() < 2:
            raise RuntimeError("BlockMask must have at least 2 dimensions")
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("full_kv_num_blocks and full_kv_indices must be both provided or omitted")
        bs = _block_size(BLOCK_SIZE)
        q_num = q_idx = fq_num = fq_idx = None
        if compute_q_blocks:
            q_num, q_idx = _transpose_ordered(kv_num_blocks, kv_indices)
            if full_kv_num_blocks is not None:
                fq_num, fq_idx = _transpose_ordered(full_kv_num_blocks, full_kv_indices)
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * bs[0], kv_indices.shape[-1] * bs[1])
        return cls(seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                   q_num, q_idx, fq_num, fq_idx, BLOCK_SIZE=bs, mask_mod=mask_mod)

    @property
    def shape(self) -> tuple[int, ...]:
        *batch, _, _ = self.kv_indices.shape
        return tuple(batch) + self.seq_lengths

    def as_tuple(self, flatten: bool = True):
        """(Q_LEN, KV_LEN, the eight lists, BLOCK_SIZE, mask_mod), as torch's; ``flatten=False``
        keeps the two pairs as tuples."""
        lengths = tuple(self.seq_lengths) if flatten else (self.seq_lengths,)
        block = tuple(self.BLOCK_SIZE) if flatten else (self.BLOCK_SIZE,)
        return (*lengths, *[getattr(self, a) for a in self._TENSOR_ATTRS], *block, self.mask_mod)

    def numel(self) -> int:
        """Elements of the mask, B·H·Q_LEN·KV_LEN (sparsity not counted)."""
        return math.prod(self.shape)

    def sparsity(self) -> float:
        """Percentage of the Q×KV area not computed, as torch counts it: listed blocks times the
        block area against B·H·Q_LEN·KV_LEN (a ragged edge block counts whole)."""
        computed = int(self.kv_num_blocks.sum().item())
        if self.full_kv_num_blocks is not None:
            computed += int(self.full_kv_num_blocks.sum().item())
        return 100.0 * (1 - computed * self.BLOCK_SIZE[0] * self.BLOCK_SIZE[1] / max(self.numel(), 1))

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """The BlockMask for shorter (Q_LEN, KV_LEN): the lists cut to the blocks that remain
        (torch's ``_adjust``, which its error messages recommend)."""
        rows = -(-new_q_len // self.BLOCK_SIZE[0])
        cols = -(-new_kv_len // self.BLOCK_SIZE[1])

        def cut(num, idx):
            idx = idx[:, :, :rows, :cols]
            num = torch.clamp(num[:, :, :rows], max=cols)
            return (idx < num.unsqueeze(-1)).sum(-1).to(torch.int32), idx

        kv_num, kv_idx = cut(self.kv_num_blocks, self.kv_indices)
        fkv_num = fkv_idx = None
        if self.full_kv_num_blocks is not None:
            fkv_num, fkv_idx = cut(self.full_kv_num_blocks, self.full_kv_indices)
        return self.inherit_planning(BlockMask.from_kv_blocks(
            kv_num, kv_idx, fkv_num, fkv_idx, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod,
            seq_lengths=(new_q_len, new_kv_len), compute_q_blocks=self.q_indices is not None))

    def derived(self, name: str, build):
        """``build()``, remembered on this BlockMask while its list tensors are the same objects
        at the same version counters (what kernels derive from the lists: int32 copies,
        transposes, orders): assigning a new tensor to a list attribute, or editing one in
        place, rebuilds. (An inference tensor keeps no version counter: its in-place edits
        are not seen.)"""
        hit = self._remembered(name)
        if hit is not None:
            return hit
        value = build()
        text = _hint_text(value) if name == "mean_kv_tokens" else None
        self.__dict__.setdefault("_derived", {})[name] = (self._list_state(), value, text)
        return value

    def _list_state(self) -> tuple:
        return tuple((t, _version(t)) for t in (getattr(self, a) for a in self._TENSOR_ATTRS))

    def _remembered(self, name: str):
        """``derived``'s value for ``name`` if it is still valid, else None (nothing computed)."""
        hit = self.__dict__.get("_derived", {}).get(name)
        if hit is not None and all(a is b and va == vb for (a, va), (b, vb)
                                   in zip(hit[0], self._list_state())):
            return hit[1]
        return None

    def warn_if_stale(self) -> None:
        """Warn once (``StaleBlockMaskWarning``) if a tensor mask_mod captures has been edited in
        place since ``create_block_mask`` planned this mask. The lists were classified from the
        old values while kernels read the new ones in partial blocks, so the answer matches
        neither mask. Each call pays one tuple compare of version counters."""
        tensors, versions = self._planned_from
        if not tensors or tuple(_version(t) for t in tensors) == versions:
            return
        stale = next(t for t, v in zip(tensors, versions) if _version(t) != v)
        self._planned_from = ((), ())  # once per mask
        name = tensor_name(self.mask_mod, stale)
        what = f"`{name}`" if name else f"a captured tensor of shape {tuple(stale.shape)}"
        mod = getattr(self.mask_mod, "__name__", "mask_mod")
        warnings.warn(f"{what}, captured by mask_mod `{mod}`, was edited in place after "
                      f"create_block_mask planned this BlockMask: its block lists follow the old "
                      f"values, so attention with it matches neither the old mask nor the new one. "
                      f"Call create_block_mask again after editing {what}.",
                      StaleBlockMaskWarning, stacklevel=3)

    def inherit_planning(self, other: "BlockMask") -> "BlockMask":
        """``other``, a mask derived from this one's lists (a slice, a copy, a paged or ring
        conversion), given this one's planning record, so that it warns as this one would."""
        other._planned_from = self._planned_from
        return other

    def mean_kv_tokens(self) -> float:
        """Mean number of keys a query block visits (listed partial + full blocks × block width):
        how long a kernel's kv loop is, which picks its schedule. Remembered (``derived``);
        ``create_block_mask`` computes it on its CPU lists and ``to`` carries it, so only a
        BlockMask built by hand from device tensors pays one sync, on its first use."""
        def mean() -> float:
            if self.kv_num_blocks.numel() == 0:  # a mask of no query blocks visits nothing
                return 0.0
            blocks = self.kv_num_blocks.float().mean()
            if self.full_kv_num_blocks is not None:
                blocks = blocks + self.full_kv_num_blocks.float().mean()
            return float(blocks.item()) * self.BLOCK_SIZE[1]
        return self.derived("mean_kv_tokens", mean)

    def to_dense(self) -> torch.Tensor:
        """(B, H, nQ, nKV) int32: 1 where a block is listed (partial or full)."""
        dense = _ordered_to_dense(self.kv_num_blocks, self.kv_indices, self.kv_indices.shape[-1])
        if self.full_kv_num_blocks is not None:
            dense = dense | _ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices,
                                              self.full_kv_indices.shape[-1])
        return dense

    def block_kinds(self) -> torch.Tensor:
        """(B, H, nQ, nKV) int8: 0 skipped, 1 partial (mask_mod applies), 2 full."""
        n = self.kv_indices.shape[-1]
        kinds = _ordered_to_dense(self.kv_num_blocks, self.kv_indices, n).to(torch.int8)
        if self.full_kv_num_blocks is not None:
            full = _ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices, n).bool()
            kinds = torch.where(full, torch.tensor(2, dtype=torch.int8, device=kinds.device), kinds)
        return kinds

    def to_string(self, grid_size=(20, 20), limit: int = 4) -> str:
        """A picture of the block structure, as torch draws it: █ listed, ░ partly, blank
        skipped; one picture per (batch, head), at most ``limit`` of them. ``grid_size=-1``
        draws every block."""
        dense = self.to_dense()
        *batch, rows, cols = dense.shape
        if grid_size == -1:
            max_rows, max_cols = rows, cols
        elif isinstance(grid_size, int):
            max_rows = max_cols = grid_size
        else:
            max_rows, max_cols = grid_size
        rs, cs = max(1, -(-rows // max_rows)), max(1, -(-cols // max_cols))
        out = []
        for i, idx in enumerate(itertools.product(*[range(n) for n in batch])):
            if i == limit:
                out += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                        "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]
                break
            m = dense[idx].float()
            text = f"{idx}\n"
            for r in range(0, rows, rs):
                for c in range(0, cols, cs):
                    frac = m[r:r + rs, c:c + cs].mean().item()
                    text += ("█" if frac == 1 else " " if frac == 0 else "░") * 2
                text += "\n"
            out.append(text)
        return "\n".join(out)

    def __str__(self):
        return f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n{self.to_string().strip()}\n)"

    def __repr__(self):
        return (f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
                f"sparsity={self.sparsity():.2f}%, mask_mod={getattr(self.mask_mod, '__name__', self.mask_mod)})")

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def to(self, device) -> "BlockMask":
        """A copy with every tensor on ``device``."""
        moved = [None if getattr(self, a) is None else getattr(self, a).to(device) for a in self._TENSOR_ATTRS]
        out = BlockMask(self.seq_lengths, *moved, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod)
        mean = self._remembered("mean_kv_tokens")
        if mean is not None:  # same lists, same mean: no sync on the new device
            out.derived("mean_kv_tokens", lambda: mean)
        return self.inherit_planning(out)

    def __getitem__(self, index) -> "BlockMask":
        """Select batches, heads and query blocks; the mask_mod is remapped to match.

        An int keeps its dimension (as torch does). Unlike torch, the sliced mask
        keeps a working mask_mod: it reads the original coordinates through
        captured index tables, so a batch- or head-dependent mask stays right.
        """
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError("BlockMask supports indexing batch, head and query-block dimensions")
        if any(i is None or i is Ellipsis for i in index):  # each entry names its dimension
            raise IndexError("BlockMask indices are (batch, head, query-block) in order; None and "
                             "... are not supported: write slices, e.g. block_mask[:, :, 2]")
        index = tuple(index) + (slice(None),) * (3 - len(index))
        sizes = self.kv_num_blocks.shape[:3] if self.kv_num_blocks.dim() >= 3 else None
        if sizes is None:
            raise IndexError("BlockMask without batch and head dimensions cannot be indexed")
        maps = [_index_map(i, n, self.device) for i, n in zip(index, sizes)]
        bmap, hmap, qmap = maps
        sel = (bmap.view(-1, 1, 1), hmap.view(1, -1, 1), qmap.view(1, 1, -1))

        def pick(t):
            return None if t is None else t[sel].contiguous()
        kv_num, kv_idx = pick(self.kv_num_blocks), pick(self.kv_indices)
        fkv_num, fkv_idx = pick(self.full_kv_num_blocks), pick(self.full_kv_indices)
        q_len = self._sliced_q_len(qmap)
        mask_mod = _remapped_mask(self.mask_mod, bmap, hmap, qmap, self.BLOCK_SIZE[0], sizes)
        return self.inherit_planning(BlockMask.from_kv_blocks(
            kv_num, kv_idx, fkv_num, fkv_idx, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=mask_mod,
            seq_lengths=(q_len, self.seq_lengths[1]), compute_q_blocks=self.q_indices is not None))

    def _sliced_q_len(self, qmap: torch.Tensor) -> int:
        bq, n_q = self.BLOCK_SIZE[0], self.kv_num_blocks.shape[2]
        if torch.equal(qmap.cpu(), torch.arange(n_q)):
            return self.seq_lengths[0]
        last_ragged = self.seq_lengths[0] % bq != 0
        ragged_pos = (qmap == n_q - 1).nonzero().flatten().tolist() if last_ragged else []
        if ragged_pos and ragged_pos != [qmap.numel() - 1]:
            raise IndexError("the last (partial) query block can only be selected as the last block")
        tail = (self.seq_lengths[0] - (n_q - 1) * bq) if ragged_pos else bq
        return (qmap.numel() - 1) * bq + tail


_INT32_RANGE = (-(2 ** 31), 2 ** 31 - 1)


def with_int32_lists(bm):
    """``bm`` with its block lists in int32, the dtype every kernel reads them in.

    A BlockMask built by hand (``BlockMask.from_kv_blocks(torch.arange(...))``) may hold int64
    lists; they are copied to int32 once per BlockMask (``derived``: an edit of the user's lists
    copies again) and the user's object is left as it is. Lists that are not integers, or hold a
    value int32 cannot, are refused: a wrapped block index would be a silent wrong answer. The
    range check reads the lists' min and max, one sync on a GPU, and only for int64 lists."""
    if bm is None or not isinstance(bm, BlockMask):
        return bm
    lists = [(a, getattr(bm, a)) for a in BlockMask._TENSOR_ATTRS]
    if all(t is None or t.dtype == torch.int32 for _, t in lists):
        return bm
    for name, t in lists:
        if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            raise TypeError(f"BlockMask.{name} has dtype {t.dtype}; block lists are integer "
                            "tensors (int32, as create_block_mask makes them)")
    return bm.derived("int32_lists", lambda: _int32_copy(bm, lists))


def _int32_copy(bm, lists) -> "BlockMask":
    moved = []
    for name, t in lists:
        if t is not None and t.dtype != torch.int32:
            if t.numel():
                lo, hi = int(t.min().item()), int(t.max().item())
                if lo < _INT32_RANGE[0] or hi > _INT32_RANGE[1]:
                    raise ValueError(f"BlockMask.{name} holds values in [{lo}, {hi}], outside int32; "
                                     "block counts and indices must fit in int32")
            t = t.to(torch.int32)
        moved.append(t)
    out = BlockMask(bm.seq_lengths, *moved, BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod)
    mean = bm._remembered("mean_kv_tokens")
    if mean is not None:
        out.derived("mean_kv_tokens", lambda: mean)
    return out


_FROM_TORCH: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def from_torch_block_mask(bm):
    """flexjit's BlockMask for torch's (``torch.nn.attention.flex_attention.BlockMask``): the
    same lists, block size, lengths and mask_mod, made once per torch object; anything else is
    returned as it is. (torch lists a ragged edge block as partial where flexjit lists it full
    when every valid element is kept: both are right, the partial one evaluates mask_mod.)"""
    if bm is None or isinstance(bm, BlockMask) or type(bm).__name__ != "BlockMask" \
            or not type(bm).__module__.startswith("torch.nn.attention"):
        return bm
    hit = _FROM_TORCH.get(bm)
    if hit is not None and all(getattr(hit, a) is getattr(bm, a) for a in BlockMask._TENSOR_ATTRS):
        return hit
    ours = BlockMask(bm.seq_lengths, *[getattr(bm, a) for a in BlockMask._TENSOR_ATTRS],
                     BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod)
    try:
        _FROM_TORCH[bm] = ours
    except TypeError:  # not weak-referenceable: convert every call
        pass
    return ours


def _index_map(i, n: int, device) -> torch.Tensor:
    """The original indices an index expression selects along a dimension of size n."""
    base = torch.arange(n, device=device)
    if isinstance(i, int):
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for size {n}")
        return base[i:i + 1] if i >= 0 else base[n + i:n + i + 1]
    if isinstance(i, (list, tuple)):
        i = torch.tensor(i, device=device)
    out = base[i]
    return out.reshape(-1)


def _remapped_mask(mask_mod, bmap, hmap, qmap, bq, sizes):
    identity = all(torch.equal(m.cpu(), torch.arange(n)) for m, n in zip((bmap, hmap, qmap), sizes))
    if identity:
        return mask_mod
    # Broadcast dimensions (size 1) stay broadcast: the original mod sees the real b/h.
    bmap = bmap.cpu().to(torch.int32)
    hmap = hmap.cpu().to(torch.int32)
    qmap = qmap.cpu().to(torch.int32)
    remap_b, remap_h = sizes[0] > 1, sizes[1] > 1

    def sliced_mask(b, h, q_idx, kv_idx):
        ob = bmap[b] if remap_b else b
        oh = hmap[h] if remap_h else h
        oq = qmap[q_idx // bq] * bq + q_idx % bq
        return mask_mod(ob, oh, oq, kv_idx)
    sliced_mask.__name__ = f"{getattr(mask_mod, '__name__', 'mask')}_sliced"
    return sliced_mask


def _block_size(bs) -> tuple[int, int]:
    if isinstance(bs, int):
        bs = (bs, bs)
    bs = tuple(int(x) for x in bs)
    if len(bs) != 2 or min(bs) <= 0:
        raise ValueError(f"BLOCK_SIZE must be a positive int or a (Q, KV) pair, got {bs}")
    for x in bs:
        if x % 16:
            raise ValueError(f"BLOCK_SIZE entries must be multiples of 16 (kernels tile by 16), got {bs}")
    return bs


# --------------------------------------------------------------------------- create_block_mask


def _check_write_order(dq_write_order, dq_write_order_full, dq_kv_order) -> None:
    for name, v in (("dq_write_order", dq_write_order), ("dq_write_order_full", dq_write_order_full)):
        if v is not None and not isinstance(v, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(v).__name__}")
    if dq_kv_order is not None and not isinstance(dq_kv_order, (bool, torch.Tensor)):
        raise TypeError(f"dq_kv_order must be a bool, a tensor or None, got {type(dq_kv_order).__name__}")


def _default_device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def plan_args(Q_LEN, KV_LEN, device, BLOCK_SIZE) -> tuple[int, int, int, int, torch.device]:
    """(Q_LEN, KV_LEN, query block, kv block, device) of a ``create_block_mask`` call, checked.
    A length may be any integer torch takes (a numpy integer, a one-element integer tensor):
    it is returned as an int."""
    bq, bkv = _block_size(BLOCK_SIZE)
    lengths = []
    for name, v in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(v, int) and not isinstance(v, torch.SymInt):
            try:
                v = operator.index(v)
            except TypeError:
                pass
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        lengths.append(v)
    device = torch.device(device) if device is not None else _default_device()
    return lengths[0], lengths[1], bq, bkv, device


def plan_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                    device=None, BLOCK_SIZE=_DEFAULT_SPARSE_BLOCK_SIZE,
                    separate_full_blocks: bool = True) -> BlockMask:
    """Plan the block sparsity of ``mask_mod`` for (B, H, Q_LEN, KV_LEN), eagerly (the planner
    behind ``flexjit.create_block_mask``, which documents the arguments)."""
    Q_LEN, KV_LEN, bq, bkv, device = plan_args(Q_LEN, KV_LEN, device, BLOCK_SIZE)
    check_arity(mask_mod, MASK_MOD)
    traced = trace_mod(mask_mod, MASK_MOD)
    B_ = 1 if B is None else int(B)
    H_ = 1 if H is None else int(H)
    if min(B_, H_) < 0:
        raise ValueError(f"B and H must be non-negative ints or None, got B={B!r}, H={H!r}")
    t0 = time.perf_counter()
    if Q_LEN == 0 or KV_LEN == 0:  # no element to evaluate: every block list is empty (torch's
        # shapes: nQ or nKV of 0), for the empty inputs flex_attention serves
        kinds = torch.zeros(B_, H_, -(-Q_LEN // bq), -(-KV_LEN // bkv), dtype=torch.int8)
    else:
        mask = widen([traced.out], (B_, H_, Q_LEN, KV_LEN), traced.scalars)[0]
        # An index out of range raises here, as torch's dense evaluation of the mask would.
        bounds.check(Program(None, mask, None, (), tuple(traced.buffers), tuple(traced.scalars),
                             mask_name=traced.name), (B_, H_, Q_LEN, KV_LEN))
        kinds = plan_blocks(mask, traced.buffers, traced.scalars, B_, H_, Q_LEN, KV_LEN, bq, bkv)
    if not separate_full_blocks:
        kinds = torch.where(kinds == 2, torch.ones_like(kinds), kinds)
    kv_num, kv_idx = _dense_to_ordered(kinds == 1)
    fkv_num, fkv_idx = _dense_to_ordered(kinds == 2)
    if not separate_full_blocks:
        fkv_num = fkv_idx = None
    seconds = time.perf_counter() - t0
    if seconds >= 1.0:
        log.info("flexjit: planned the block mask of %s (B=%d, H=%d, %dx%d) in %.1f s",
                 traced.name, B_, H_, Q_LEN, KV_LEN, seconds)
    if config.settings.debug:
        print(f"[flexjit] planned {traced.name} B={B_} H={H_} {Q_LEN}x{KV_LEN} in {seconds:.3f}s")
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, fkv_num, fkv_idx, BLOCK_SIZE=(bq, bkv),
                                  mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))
    bm.mean_kv_tokens()  # on the CPU lists now: kernels choosing a schedule then never sync
    bm._planned_from = (tuple(traced.buffers), tuple(_version(t) for t in traced.buffers))
    return bm.to(device) if device.type != "cpu" else bm


def plan_blocks(mask, buffers: Sequence[torch.Tensor], scalars, B: int, H: int, Q_LEN: int, KV_LEN: int,
                bq: int, bkv: int) -> torch.Tensor:
    """(B, H, nQ, nKV) int8 block kinds: 0 empty, 1 partial, 2 full. Runs on the CPU."""
    n_q, n_kv = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    # A mask that ignores b (or h) is planned for one and expanded: identical rows.
    pb = B if ir.uses(mask, Op.B) else 1
    ph = H if ir.uses(mask, Op.H) else 1
    buffers = [t.detach().cpu() for t in buffers]
    q_lo = torch.arange(n_q) * bq
    q_hi = torch.clamp(q_lo + bq, max=Q_LEN) - 1
    kv_lo = torch.arange(n_kv) * bkv
    kv_hi = torch.clamp(kv_lo + bkv, max=KV_LEN) - 1
    can_false, can_true = intervals.classify(
        mask, torch.arange(pb).view(-1, 1, 1, 1), torch.arange(ph).view(1, -1, 1, 1),
        q_lo.view(1, 1, -1, 1), q_hi.view(1, 1, -1, 1), kv_lo.view(1, 1, 1, -1), kv_hi.view(1, 1, 1, -1),
        buffers, scalars)
    shape = (pb, ph, n_q, n_kv)
    can_false, can_true = can_false.expand(shape), can_true.expand(shape)
    kinds = torch.where(can_true, torch.where(can_false, 1, 2), 0).to(torch.int8)
    undecided = (can_false & can_true).nonzero()
    if undecided.numel():
        kinds[tuple(undecided.T)] = _dense_kinds(mask, buffers, scalars, undecided, Q_LEN, KV_LEN, bq, bkv)
    return kinds.expand(B, H, n_q, n_kv).contiguous()


def _dense_kinds(mask, buffers, scalars, blocks: torch.Tensor, Q_LEN, KV_LEN, bq, bkv) -> torch.Tensor:
    """Evaluate the mask element by element on the listed blocks, a batch at a time."""
    out = torch.empty(blocks.shape[0], dtype=torch.int8)
    per = max(1, _DENSE_BATCH_ELEMS // (bq * bkv))
    rq, rkv = torch.arange(bq).view(1, -1, 1), torch.arange(bkv).view(1, 1, -1)
    for s in range(0, blocks.shape[0], per):
        blk = blocks[s:s + per]
        q = blk[:, 2].view(-1, 1, 1) * bq + rq
        kv = blk[:, 3].view(-1, 1, 1) * bkv + rkv
        valid = (q < Q_LEN) & (kv < KV_LEN)
        env = Env(b=blk[:, 0].view(-1, 1, 1).to(torch.int32), h=blk[:, 1].view(-1, 1, 1).to(torch.int32),
                  q_idx=q.clamp(max=Q_LEN - 1).to(torch.int32), kv_idx=kv.clamp(max=KV_LEN - 1).to(torch.int32),
                  buffers=tuple(buffers), scalars=tuple(scalars))
        m = evaluate(mask, env).expand(valid.shape)
        any_true = (m & valid).flatten(1).any(1)
        all_true = (m | ~valid).flatten(1).all(1)
        out[s:s + per] = torch.where(any_true, torch.where(all_true, 2, 1), 0).to(torch.int8)
    return out


def create_mask(mod_fn: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                device=None) -> torch.Tensor:
    """The dense (B, H, Q_LEN, KV_LEN) mask of a mask_mod, or of a score_mod (where it is
    not -inf, evaluated at score 0). Dense by definition: use for small shapes and tests."""
    device = torch.device(device) if device is not None else _default_device()
    B_, H_ = (1 if B is None else B), (1 if H is None else H)
    try:
        check_arity(mod_fn, MASK_MOD)
        kind = MASK_MOD
    except TypeError:
        check_arity(mod_fn, SCORE_MOD)
        kind = SCORE_MOD
    traced = trace_mod(mod_fn, kind)
    env = Env(b=torch.arange(B_, device=device).view(-1, 1, 1, 1),
              h=torch.arange(H_, device=device).view(1, -1, 1, 1),
              q_idx=torch.arange(Q_LEN, device=device).view(1, 1, -1, 1),
              kv_idx=torch.arange(KV_LEN, device=device).view(1, 1, 1, -1),
              score=torch.zeros(B_, H_, Q_LEN, KV_LEN, device=device),
              buffers=tuple(traced.buffers), scalars=tuple(traced.scalars), device=device)
    out = evaluate(widen([traced.out], (B_, H_, Q_LEN, KV_LEN), traced.scalars)[0], env)
    if kind == SCORE_MOD:
        out = ~torch.isneginf(out)
    return out.expand(B_, H_, Q_LEN, KV_LEN).contiguous()
