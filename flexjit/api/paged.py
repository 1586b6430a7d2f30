"""Paged KV cache for flex_attention (torch's experimental ``PagedAttention``, same methods).

The K/V of every sequence in a batch live in one shared pool of fixed-size pages: caches of shape
(1, H_kv, n_pages * page_size, D). A page table maps (batch entry, logical page) to a physical page
and ``physical_to_logical`` maps back. Attention never gathers a contiguous copy: the logical
BlockMask's kv block indices are rewritten to the physical blocks that hold those tokens
(``convert_logical_block_mask``), so every backend reads K and V through its block lists, and the
mods are wrapped (``get_mask_mod``/``get_score_mod``) to see logical kv positions again.

Contract of the converted BlockMask (what makes it safe where torch's is not):
  * A listed block always lies in a page the batch entry owns; a logical block with no page behind
    it is an error (no kv_len) or dropped (kv_len says it holds no live token).
  * A full block is full of live tokens: full blocks that reach past the entry's kv_len or the
    logical KV_LEN are demoted to partial, where the wrapped mask_mod bounds them.
  * The wrapped mods index the user's mod with a valid logical position (0 where masked), so a
    mod indexing a captured table by kv_idx never reads out of range.
The conversion reads the page table, the capacities and kv_len when it runs: convert again after
``reserve``/``erase`` or a kv_len change (torch's contract too).

An FP8 cache is a float8_e4m3fn pool: ``assign`` stores values already quantised, and
flex_attention takes the descales (``k_descale``/``v_descale``, () or (B, H_kv): each sequence's
own); the split-KV decode kernel reads the e4m3 pages as they are.
"""
from __future__ import annotations

from typing import Callable

import torch

from flexjit.planner.block_mask import BlockMask, from_torch_block_mask, noop_mask
from flexjit.ir.nodes import Op, uses
from flexjit.frontend.trace import MASK_MOD, trace_mod

__all__ = ["PagedAttention", "OutOfPagesError"]


class OutOfPagesError(RuntimeError):
    """``reserve`` asked for more pages than are free (a server can catch it and preempt)."""


def _as_int(x, name: str) -> int:
    """A Python int from an int or a one-element integer tensor (torch's API passes shape-(1,))."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must be an int or a one-element integer tensor, "
                            f"got a {x.dtype} tensor of shape {tuple(x.shape)}")
        return int(x.item())
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int or a one-element integer tensor, got {type(x).__name__}")
    return x


def _int_tensor(x, name: str, dim: int, device) -> torch.Tensor:
    """An int64 tensor of ``dim`` dims on ``device`` from a tensor or a list."""
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {x.dtype}")
    if x.dim() != dim:
        raise ValueError(f"{name} must have {dim} dim(s), got shape {tuple(x.shape)}")
    return x.to(device=device, dtype=torch.int64)


class PagedAttention:
    """A page pool for a batch of up to ``max_batch_size`` sequences: ``n_pages`` pages of
    ``page_size`` tokens. Attributes as torch's: ``page_table`` (max_batch_size, n_pages) int64,
    -1 where unassigned; ``physical_to_logical`` (max_batch_size, n_pages) int64, -1 where the
    page is not the entry's; ``capacity`` (max_batch_size,) int64 tokens reserved; ``empty_pages``.

    ``page_size`` must be a multiple of the block mask's KV block size (16 at the least; 128 for the
    sm90 kernel). ``device`` defaults to CUDA when available, else the CPU.
    """

    def __init__(self, n_pages: int, page_size: int, max_batch_size: int, device=None) -> None:
        for name, v in (("n_pages", n_pages), ("page_size", page_size), ("max_batch_size", max_batch_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if page_size % 16:
            raise ValueError(f"page_size must be a multiple of 16 (a page holds whole KV blocks of a "
                             f"block mask, whose sizes are multiples of 16), got {page_size}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        # Resolved as tensors report it ("cuda" -> cuda:0), so device checks compare equal.
        self.device = torch.empty(0, device=device).device
        self.n_pages = n_pages
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.page_table = torch.full((max_batch_size, n_pages), -1, dtype=torch.int64, device=self.device)
        self.physical_to_logical = torch.full((max_batch_size, n_pages), -1, dtype=torch.int64,
                                              device=self.device)
        self.capacity = torch.zeros(max_batch_size, dtype=torch.int64, device=self.device)
        self.empty_pages = list(range(n_pages - 1, -1, -1))
        # Host mirror of the bookkeeping: checks and conversions never read the device tables back.
        self._pages: list[list[int]] = [[] for _ in range(max_batch_size)]
        # int32 twin of physical_to_logical that the mods read: with its values clamped to
        # [-1, n_pages) the index math stays int32 in the kernels (an int64 load would widen it).
        self._p2l32 = torch.full((max_batch_size, n_pages), -1, dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------------ bookkeeping

    @property
    def kv_len(self) -> int:
        """Length of the physical caches: ``n_pages * page_size``."""
        return self.n_pages * self.page_size

    def _batch(self, batch_idx, name: str = "batch_idx") -> int:
        b = _as_int(batch_idx, name)
        if not 0 <= b < self.max_batch_size:
            raise IndexError(f"{name} {b} is out of range for max_batch_size={self.max_batch_size}")
        return b

    def reserved(self, batch_idx) -> int:
        """Tokens reserved for one batch entry (a multiple of page_size)."""
        return len(self._pages[self._batch(batch_idx)]) * self.page_size

    def reserve(self, batch_idx, seq_len) -> None:
        """Grow batch entry ``batch_idx``'s capacity to hold at least ``seq_len`` tokens (no-op if it
        already does). Raises ``OutOfPagesError`` if not enough pages are free."""
        b = self._batch(batch_idx)
        n = _as_int(seq_len, "seq_len")
        if n < 0:
            raise ValueError(f"seq_len must be >= 0, got {n}")
        have = len(self._pages[b])
        need = -(-n // self.page_size) - have
        if need <= 0:
            return
        if need > len(self.empty_pages):
            raise OutOfPagesError(
                f"reserve({b}, {n}) needs {need} more page(s) of {self.page_size} tokens but only "
                f"{len(self.empty_pages)} of {self.n_pages} are free; erase finished sequences or "
                f"make the pool larger")
        pages = self.empty_pages[-need:]
        del self.empty_pages[-need:]
        self._pages[b].extend(pages)
        dev = self.device
        phys = torch.tensor(pages, dtype=torch.int64, device=dev)
        self.page_table[b, have:have + need] = phys
        self.physical_to_logical[b, phys] = torch.arange(have, have + need, dtype=torch.int64, device=dev)
        self._p2l32[b, phys] = torch.arange(have, have + need, dtype=torch.int32, device=dev)
        self.capacity[b] = (have + need) * self.page_size

    def erase(self, batch_idx) -> None:
        """Free every page of batch entry ``batch_idx`` (a no-op if it holds none)."""
        b = self._batch(batch_idx)
        pages = self._pages[b]
        if not pages:
            return
        self.empty_pages.extend(reversed(pages))
        phys = torch.tensor(pages, dtype=torch.int64, device=self.device)
        self.physical_to_logical[b, phys] = -1
        self._p2l32[b, phys] = -1
        self.page_table[b] = -1
        self.capacity[b] = 0
        self._pages[b] = []

    def _batch_rows(self, batch_idx, length: int | None, what: str) -> torch.Tensor:
        """``batch_idx`` as an int64 (B,) tensor on the pool's device, every entry reserved."""
        rows = _int_tensor(batch_idx, "batch_idx", 1, self.device)
        if length is not None and rows.shape[0] != length:
            raise ValueError(f"batch_idx has {rows.shape[0]} entries but {what} has batch {length}")
        for r in rows.tolist():
            if not 0 <= r < self.max_batch_size:
                raise IndexError(f"batch_idx {r} is out of range for max_batch_size={self.max_batch_size}")
            if not self._pages[r]:
                raise ValueError(f"batch entry {r} has no reservation; call reserve({r}, seq_len) first")
        return rows

    def assign(self, batch_idx, input_pos, k_val: torch.Tensor, v_val: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Write ``k_val``/``v_val`` (B, H, S, D) at logical positions ``input_pos`` (B, S) of the
        entries ``batch_idx`` (B,) into the page-backed caches (1, H, n_pages * page_size, D)."""
        for name, t in (("k_val", k_val), ("v_val", v_val), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        if k_val.requires_grad or v_val.requires_grad:
            raise ValueError("k_val and v_val must not require grad: the cache is not differentiable "
                             "(call assign under torch.no_grad() or pass .detach())")
        B, H, S, Dk = k_val.shape
        if v_val.shape[:3] != k_val.shape[:3]:
            raise ValueError(f"k_val {tuple(k_val.shape)} and v_val {tuple(v_val.shape)} must agree in "
                             f"(B, H, S)")
        for name, cache, val in (("k_cache", k_cache, k_val), ("v_cache", v_cache, v_val)):
            want = (1, H, self.kv_len, val.shape[3])
            if tuple(cache.shape) != want:
                raise ValueError(f"{name} must have shape {want} (1, heads, n_pages * page_size, head dim), "
                                 f"got {tuple(cache.shape)}")
            if cache.dtype != val.dtype:
                hint = (f"; quantise them first, ({name[0]}_val / {name[0]}_descale)"
                        f".to({cache.dtype}), and pass {name[0]}_descale to flex_attention"
                        if cache.dtype == torch.float8_e4m3fn else "")
                raise TypeError(f"{name} is {cache.dtype} but its values are {val.dtype}{hint}")
            if cache.device != self.device or val.device != self.device:
                raise ValueError(f"{name} ({cache.device}) and its values ({val.device}) must be on the "
                                 f"PagedAttention's device {self.device}")
        rows = self._batch_rows(batch_idx, B, "k_val")
        pos = _int_tensor(input_pos, "input_pos", 2, self.device)
        if tuple(pos.shape) != (B, S):
            raise ValueError(f"input_pos must have shape (B, S) = {(B, S)}, got {tuple(pos.shape)}")
        if pos.numel() == 0:
            return
        cap = self.capacity[rows].unsqueeze(1)
        bad = (pos < 0) | (pos >= cap)
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            p, r = int(pos[i, j]), int(rows[i])
            raise ValueError(f"input_pos[{i}, {j}] = {p} is outside batch entry {r}'s reserved capacity of "
                             f"{self.reserved(r)} tokens; call reserve({r}, {p + 1}) first")
        page = torch.gather(self.page_table[rows], 1, pos // self.page_size)
        addr = (page * self.page_size + pos % self.page_size).reshape(-1)  # (B*S,)
        k_cache[0, :, addr] = k_val.permute(1, 0, 2, 3).reshape(H, B * S, Dk)
        v_cache[0, :, addr] = v_val.permute(1, 0, 2, 3).reshape(H, B * S, v_val.shape[3])

    # ------------------------------------------------------------------ block masks

    def convert_logical_block_mask(self, block_mask, batch_idx=None, kv_len=None) -> BlockMask:
        """The BlockMask over the physical cache (KV_LEN = n_pages * page_size) that attends where
        ``block_mask`` does over each entry's logical positions.

        ``batch_idx`` (B,): the page-table row of each batch entry of the call (default 0..B-1); a
        block mask of batch 1 is expanded to it. ``kv_len`` (B,): live tokens per entry; positions at
        or past it are masked (and blocks that hold none are skipped). Without ``kv_len`` every block
        the mask lists must lie within the entry's reserved capacity.
        """
        bm = from_torch_block_mask(block_mask)
        if not isinstance(bm, BlockMask):
            raise TypeError(f"block_mask must be a BlockMask, got {type(block_mask).__name__}")
        bq, bkv = bm.BLOCK_SIZE
        if self.page_size % bkv:
            raise ValueError(f"page_size {self.page_size} must be a multiple of the block mask's KV block "
                             f"size {bkv}: a block must not straddle two pages. Create the block mask with "
                             f"BLOCK_SIZE=({bq}, {self.page_size}) or a divisor of it")
        if bm.kv_num_blocks.device != self.device:
            raise ValueError(f"block_mask is on {bm.kv_num_blocks.device} but the PagedAttention is on "
                             f"{self.device}; call block_mask.to({str(self.device)!r})")
        Bm, H, R, C = bm.kv_indices.shape
        Q_LEN, KV_LEN = bm.seq_lengths
        rows = self._batch_rows(torch.arange(Bm) if batch_idx is None else batch_idx, None, "")
        B = rows.shape[0]
        if Bm not in (1, B):
            raise ValueError(f"block_mask has batch {Bm} but batch_idx has {B} entries")
        if Bm == 1 and B > 1 and _reads_batch(bm.mask_mod):
            raise ValueError(f"mask_mod `{getattr(bm.mask_mod, '__name__', 'mask_mod')}` depends on the batch "
                             f"index b, but the block_mask was created with B=1/None, planned for b = 0 "
                             f"only; create it with B={B}")
        limit = torch.full((B,), KV_LEN, dtype=torch.int64, device=self.device)
        lens = None
        if kv_len is not None:
            lens = _int_tensor(kv_len, "kv_len", 1, self.device)
            if lens.shape[0] != B:
                raise ValueError(f"kv_len has {lens.shape[0]} entries but the batch has {B}")
            for i, (n, r) in enumerate(zip(lens.tolist(), rows.tolist())):
                if not 0 <= n <= self.reserved(r):
                    raise ValueError(f"kv_len[{i}] = {n} is outside batch entry {r}'s reserved capacity of "
                                     f"{self.reserved(r)} tokens")
            limit = torch.minimum(limit, lens)

        def expand(t):
            return t.expand(B, *t.shape[1:]) if Bm == 1 and B > 1 else t

        per_page = self.page_size // bkv
        table = self.page_table[rows]                                  # (B, n_pages)
        start = torch.arange(C, device=self.device) * bkv              # first token of a column

        def classify(num, idx):
            """(physical block, live, whole) of each list entry: live = listed and holding a token
            below the entry's limit; whole = every token of the block below it."""
            num, idx = expand(num), expand(idx).long()
            listed = torch.arange(C, device=self.device) < num.unsqueeze(-1)
            idx = torch.where(listed, idx, 0)                          # padding may hold anything
            first = start[idx]
            lim = limit.view(B, 1, 1, 1)
            lp = idx // per_page
            page = torch.gather(table.view(B, 1, 1, -1).expand(B, idx.shape[1], R, -1), 3,
                                lp.clamp(max=self.n_pages - 1))
            page = torch.where(lp < self.n_pages, page, -1)          # -1: no page behind the block
            missing = listed & (page < 0)
            if lens is None and bool(missing.any()):
                b, h, r, c = (int(x) for x in missing.nonzero()[0])
                j, row = int(idx[b, h, r, c]), int(rows[b])
                raise ValueError(
                    f"block_mask lists KV block {j} (tokens {j * bkv}..{j * bkv + bkv - 1}) for batch "
                    f"entry {row}, past its reserved capacity of {self.reserved(row)} tokens; reserve "
                    f"more, or pass kv_len to bound each entry's length")
            live = listed & (first < lim) & (page >= 0)
            whole = live & (first + bkv <= lim)
            return page * per_page + idx % per_page, live, whole

        pblk, plive, _ = classify(bm.kv_num_blocks, bm.kv_indices)
        if bm.full_kv_num_blocks is not None:
            fblk, flive, fwhole = classify(bm.full_kv_num_blocks, bm.full_kv_indices)
            # Partial: the listed partial blocks and the full ones reaching past the limit.
            blk = torch.cat([pblk, fblk], -1)
            keep = torch.cat([plive, flive & ~fwhole], -1)
            full = _compact(fblk, fwhole, self.n_pages * per_page)
        else:
            blk, keep, full = pblk, plive, None
        part = _compact(blk, keep, self.n_pages * per_page)
        identity = rows.tolist() == list(range(B))  # then the mods index the tables by b directly
        mask_mod = self.get_mask_mod(bm.mask_mod, kv_len=lens, batch_idx=None if identity else rows,
                                     _kv_limit=KV_LEN)
        out = BlockMask.from_kv_blocks(part[0], part[1], *(full or (None, None)), BLOCK_SIZE=(bq, bkv),
                                       mask_mod=mask_mod, seq_lengths=(Q_LEN, self.kv_len),
                                       compute_q_blocks=bm.q_indices is not None)
        out.mean_kv_tokens()  # remembered now, so a kernel choosing its schedule never syncs
        return bm.inherit_planning(out)

    # ------------------------------------------------------------------ mods

    def _to_logical(self, kv_len, batch_idx, kv_limit):
        """A traceable ``(b, physical_kv_idx) -> (logical_kv_idx, live)``. Captures tensors and
        numbers only (never ``self``), so traces are reused across calls."""
        p2l, size, top = self._p2l32, self.page_size, self.n_pages - 1
        # The caller's tensors are captured as they are (read when the kernel runs, as torch's
        # mods read them), so a kv_len updated in place reaches a mod made before the update.
        rows = None if batch_idx is None else self._live(batch_idx, "batch_idx")
        lens = None if kv_len is None else self._live(kv_len, "kv_len")
        limit = None if kv_limit is None else int(kv_limit)

        def to_logical(b, physical_kv_idx):
            row = b if rows is None else rows[b]
            block = torch.clamp(p2l[row, physical_kv_idx // size], -1, top)
            logical = block * size + physical_kv_idx % size
            live = block >= 0
            if lens is not None:
                live = live & (logical < lens[b])
            if limit is not None:
                live = live & (logical < limit)
            # A position the entry does not own reaches the user's mod as 0, a valid index.
            return torch.where(live, logical, 0), live
        return to_logical

    def _live(self, x, name: str) -> torch.Tensor:
        """``x`` itself if it is a 1-D integer tensor on the pool's device, else an int64 copy."""
        if isinstance(x, torch.Tensor) and x.device == self.device and x.dim() == 1 and \
                x.dtype in (torch.int32, torch.int64):
            return x
        return _int_tensor(x, name, 1, self.device)

    def get_mask_mod(self, mask_mod: Callable | None, kv_len=None, *, batch_idx=None,
                     _kv_limit: int | None = None) -> Callable:
        """``mask_mod`` over logical kv positions → one over the physical cache: False wherever the
        page is not the batch entry's or the position is at or past ``kv_len[b]``. ``batch_idx``
        (flexjit's addition) maps the call's batch index to page-table rows, as in
        ``convert_logical_block_mask``."""
        mask_mod = noop_mask if mask_mod is None else mask_mod
        to_logical = self._to_logical(kv_len, batch_idx, _kv_limit)

        def paged_mask(b, h, q_idx, physical_kv_idx):
            logical, live = to_logical(b, physical_kv_idx)
            return live & mask_mod(b, h, q_idx, logical)
        paged_mask.__name__ = f"paged_{getattr(mask_mod, '__name__', 'mask')}"
        return paged_mask

    def get_score_mod(self, score_mod: Callable | None, kv_len=None, *, batch_idx=None) -> Callable:
        """``score_mod`` over logical kv positions → one over the physical cache (-inf where the
        position is not live, as torch's). Pass the same ``batch_idx`` as to the conversion."""
        to_logical = self._to_logical(kv_len, batch_idx, None)

        if score_mod is None:
            def paged_score(score, b, h, q_idx, physical_kv_idx):
                return torch.where(to_logical(b, physical_kv_idx)[1], score, float("-inf"))
        else:
            def paged_score(score, b, h, q_idx, physical_kv_idx):
                logical, live = to_logical(b, physical_kv_idx)
                return torch.where(live, score_mod(score, b, h, q_idx, logical), float("-inf"))
        paged_score.__name__ = f"paged_{getattr(score_mod, '__name__', 'identity')}"
        return paged_score


def _reads_batch(mask_mod) -> bool:
    if mask_mod is noop_mask:
        return False
    return uses(trace_mod(mask_mod, MASK_MOD).out, Op.B)


def _compact(blk: torch.Tensor, keep: torch.Tensor, width: int):
    """Ordered lists (num (B,H,R) int32, idx (B,H,R,width) int32) of the kept entries of ``blk``,
    in their listed order."""
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
    idx = torch.gather(torch.where(keep, blk, 0), -1, order)
    num = keep.sum(-1).to(torch.int32)
    n = min(idx.shape[-1], width)
    out = torch.zeros(*idx.shape[:-1], width, dtype=torch.int32, device=idx.device)
    out[..., :n] = idx[..., :n].to(torch.int32)
    return num, out
