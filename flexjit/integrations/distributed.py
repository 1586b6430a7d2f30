"""Context parallelism: one attention over a sequence sharded across ranks.

    import flexjit.integrations.distributed as cp
    q, k, v = (cp.shard(t) for t in (q_full, k_full, v_full))     # this rank's shards (dim 2)
    bm = flexjit.create_block_mask(mask_mod, B, H, S, S)           # the GLOBAL mask
    out = cp.flex_attention(q, k, v, score_mod, bm)               # this rank's output shard

The sequence is cut into ``W`` (``contiguous``) or ``2W`` (``zigzag``: rank r holds chunks r
and 2W-1-r, which balances causal work) chunks; key/value shards travel a ring of
``torch.distributed`` point-to-point ops (gloo or NCCL), the next step's exchange posted before
the current step's compute. Each (query chunk, key/value chunk) pair is an ordinary flexjit call
on the global mask's sub-rectangle, its mods seeing global indices through runtime offsets, and
partial results merge by their log-sum-exp. Pairs without a listed block are neither computed
nor sent (``last_stats()`` counts steps, pairs and bytes). The backward walks the same ring with
the global output and LSE; dK/dV travel home with their shard; captured tensors' gradients are
summed across ranks. Every rank must call the backward, as with any collective.
"""
from __future__ import annotations

import collections
import dataclasses
import math

import torch
import torch.distributed as dist

from flexjit.api import attention as api
from flexjit.runtime import dispatch
from flexjit.planner.block_mask import BlockMask, _dense_to_ordered
from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, check_arity

LAYOUTS = ("zigzag", "contiguous")
# Backends whose backward recomputes the softmax from (q, k, v) instead of reading the out and
# lse it is given (reference.backward): a pair's gradient then needs its own out/lse and the
# rescaled dO/dLSE of ``_pair_backward``. Every other backend reads out and lse.
_RECOMPUTES_SOFTMAX = frozenset({"reference"})
_TAG_KV, _TAG_ACC, _TAG_HOME = 17, 18, 19  # gloo matches by tag; NCCL by order (the same here)


# --------------------------------------------------------------------------- groups and layouts


def _group(group) -> tuple[int, int]:
    """(rank, world size) of this process in ``group``; a clear error without one."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("flexjit.distributed needs an initialised process group: call "
                         "torch.distributed.init_process_group(...) first (backend 'gloo' on the "
                         "CPU, 'nccl' on GPUs), e.g. under torchrun")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group")
    return rank, dist.get_world_size(group)


def _check_layout(layout) -> int:
    """Chunks per rank of ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 2 if layout == "zigzag" else 1


def chunk_ids(rank: int, world: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The global chunks rank ``rank`` holds: (r, 2W-1-r) for zigzag, (r,) for contiguous."""
    _check_layout(layout)
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def shard(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` (differentiable, a copy).

    ``x.shape[dim]`` must split into W (contiguous) or 2W (zigzag) equal chunks."""
    per = _check_layout(layout)
    rank, world = _group(group)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"shard takes a tensor, got {type(x).__name__}")
    n, parts = x.shape[dim], per * world
    if n % parts:
        raise ValueError(f"a length of {n} along dim {dim} does not split into {parts} equal chunks "
                         f"({layout} layout over {world} ranks); pad it to a multiple of {parts}")
    c = n // parts
    return torch.cat([x.narrow(dim, i * c, c) for i in chunk_ids(rank, world, layout)], dim).contiguous()


def unshard(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The full tensor from every rank's shard ``x`` (an all_gather; every rank gets it, with
    no autograd history). The inverse of :func:`shard`."""
    per = _check_layout(layout)
    rank, world = _group(group)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"unshard takes a tensor, got {type(x).__name__}")
    if x.shape[dim] % per:
        raise ValueError(f"a {layout} shard holds {per} equal chunks, but its length along dim {dim} "
                         f"is {x.shape[dim]}")
    x = x.detach().contiguous()
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x, group=group)
    chunks = [None] * (per * world)
    for r, s in enumerate(shards):
        for i, piece in zip(chunk_ids(r, world, layout), s.chunk(per, dim)):
            chunks[i] = piece
    return torch.cat(chunks, dim)


# --------------------------------------------------------------------------- statistics


@dataclasses.dataclass
class RingStats:
    """What one pass (forward or backward) of :func:`flex_attention` did on this rank."""
    world: int = 0
    steps: int = 0            # ring steps run (at most W): the last one any shard travels to
    steps_computed: int = 0   # steps at which this rank computed at least one pair
    pairs_computed: int = 0   # (query chunk, key/value chunk) attention calls
    pairs_skipped: int = 0    # of this rank's query chunks x all W key/value chunks: no listed block
    messages_sent: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    backend: str = ""


_STATS = {"forward": RingStats(), "backward": RingStats()}


def last_stats() -> dict[str, RingStats]:
    """{"forward": RingStats, "backward": RingStats} of the last call's passes on this rank."""
    return {k: dataclasses.replace(v) for k, v in _STATS.items()}


# --------------------------------------------------------------------------- global indices


# Wrappers of a mod at (q offset, kv offset), kept so that their traces are reused (the trace
# cache is keyed by the function object). Bounded: a mod made anew every step costs a retrace,
# never unbounded memory.
_OFFSET_MODS: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_OFFSET_MODS_MAX = 512


def _at_offsets(mod, kind: str, q_off: int, kv_off: int):
    """``mod`` seeing global indices: its q_idx/kv_idx shifted by Python ints (runtime scalars in
    the tracer: one IR, one kernel for every pair)."""
    key = (id(mod), kind, q_off, kv_off)
    hit = _OFFSET_MODS.get(key)
    if hit is not None and hit[0] is mod:
        _OFFSET_MODS.move_to_end(key)
        return hit[1]
    if kind == SCORE_MOD:
        def at(score, b, h, q_idx, kv_idx):
            return mod(score, b, h, q_idx + q_off, kv_idx + kv_off)
    else:
        def at(b, h, q_idx, kv_idx):
            return mod(b, h, q_idx + q_off, kv_idx + kv_off)
    at.__name__ = at.__qualname__ = getattr(mod, "__name__", type(mod).__name__)
    _OFFSET_MODS[key] = (mod, at)
    if len(_OFFSET_MODS) > _OFFSET_MODS_MAX:
        _OFFSET_MODS.popitem(last=False)
    return at


def _kinds(bm: BlockMask) -> torch.Tensor:
    return bm.derived("cp_kinds", bm.block_kinds)


def _chunk_grid(bm: BlockMask | None, parts: int) -> list[list[bool]]:
    """grid[i][j]: whether query chunk i and key/value chunk j share a listed block (any batch,
    head). Remembered on the BlockMask; one host sync the first time."""
    if bm is None:
        return [[True] * parts for _ in range(parts)]

    def build():
        listed = (_kinds(bm) > 0).flatten(0, 1).any(0)  # (nQ, nKV)
        nq, nkv = listed.shape
        g = listed.view(parts, nq // parts, parts, nkv // parts).any(3).any(1)
        return g.cpu().tolist()
    return bm.derived(f"cp_grid:{parts}", build)


def _sub_mask(bm: BlockMask, parts: int, i: int, j: int) -> BlockMask:
    """The global mask's (query chunk i, key/value chunk j) rectangle as a BlockMask of the
    chunk lengths, its mask_mod at the chunk's offsets. Remembered on the BlockMask."""
    def build():
        kinds = _kinds(bm)
        nq, nkv = kinds.shape[-2:]
        rq, rk = nq // parts, nkv // parts
        sub = kinds[:, :, i * rq:(i + 1) * rq, j * rk:(j + 1) * rk]
        cq, ck = bm.seq_lengths[0] // parts, bm.seq_lengths[1] // parts
        mask_mod = bm.mask_mod
        if not api._is_noop(mask_mod):
            mask_mod = _at_offsets(mask_mod, MASK_MOD, i * cq, j * ck)
        num, idx = _dense_to_ordered(sub == 1)
        fnum, fidx = _dense_to_ordered(sub == 2)
        out = BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=bm.BLOCK_SIZE,
                                       mask_mod=mask_mod, seq_lengths=(cq, ck))
        out.mean_kv_tokens()  # its one sync now, not in the ring
        return bm.inherit_planning(out)
    return bm.derived(f"cp_sub:{parts}:{i}:{j}", build)


# --------------------------------------------------------------------------- the ring's plan


@dataclasses.dataclass
class _Ring:
    """Who computes what at which step, and what travels: the same on every rank."""
    group: object
    rank: int
    world: int
    layout: str
    per: int                      # chunks per rank
    cq: int                       # query chunk length
    ck: int                       # key/value chunk length
    pairs: dict                   # (rank, owner) -> [(local q chunk a, local kv chunk c)], computed
    last: list                    # last[o]: the last step shard o is needed at (-1: never)
    calls: dict                   # (a, global kv chunk) -> Call template (tensors None)
    choice: object = None         # dispatch.Choice of the pairs
    buffers: tuple = ()
    first: object = None          # a prepared Call (while preparing: the choice is made on it)

    @property
    def steps(self) -> int:
        return max(self.last) + 1 if self.last else 0

    def owner(self, s: int) -> int:
        return (self.rank - s) % self.world

    def travels(self, o: int, s: int) -> bool:
        """Whether shard o goes on from step s to step s + 1."""
        return s < self.last[o]

    def peer(self, delta: int) -> int:
        r = (self.rank + delta) % self.world
        return r if self.group is None else dist.get_global_rank(self.group, r)


def _plan(grid, world: int, layout: str) -> tuple[dict, list]:
    """(pairs, last): pairs[(r, o)] the (local q chunk, local kv chunk) pairs rank r computes
    with shard o (those with a listed block); last[o] the last step shard o is needed at."""
    pairs = {}
    for r in range(world):
        for o in range(world):
            pairs[(r, o)] = [(a, c) for a, gq in enumerate(chunk_ids(r, world, layout))
                             for c, gk in enumerate(chunk_ids(o, world, layout)) if grid[gq][gk]]
    last = []
    for o in range(world):
        steps = [s for s in range(world) if pairs[((o + s) % world, o)]]
        last.append(max(steps) if steps else -1)
    return pairs, last


# --------------------------------------------------------------------------- the entry point


@torch.compiler.disable
def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None,
                   block_mask: BlockMask | None = None, *, group=None, layout: str = "zigzag",
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: dict | None = None, return_aux: api.AuxRequest | None = None,
                   backend: str = "auto"):
    """Attention over a sequence sharded along dim 2 across the ranks of ``group``.

    query (B, Hq, L/W, E), key (B, Hkv, S/W, E), value (B, Hkv, S/W, Ev): this rank's shards in
    ``layout`` (see :func:`shard`); ``block_mask``: the GLOBAL mask, made at (L, S). Returns this
    rank's output shard (B, Hq, L/W, Ev), with the LSE shard (B, Hq, L/W) on ``return_lse`` (or
    ``return_aux=AuxRequest(lse=..., max_scores=...)``), as :func:`flexjit.flex_attention`.
    Autograd gives this rank's dq, dk, dv; captured tensors get gradients summed over ranks.
    Every rank must call it with the same arguments (shapes, mods, mask, layout) and run the
    backward. Not traced by torch.compile (a graph break)."""
    if return_aux is not None and return_lse:
        raise ValueError("pass either return_lse=True or return_aux=AuxRequest(lse=True), not both")
    per = _check_layout(layout)
    rank, world = _group(group)
    query, key, value, block_mask, kernel_options, backend, return_aux = api._normalize(
        query, key, value, block_mask, kernel_options, backend, return_aux)
    want_max = return_aux is not None and return_aux.max_scores
    ring, needs_grad = _prepare(query, key, value, score_mod, block_mask, scale, enable_gqa,
                                kernel_options, backend, want_max, group, rank, world, layout, per)
    buffers = ring.buffers
    if needs_grad:
        res = _RingAttention.apply(ring, want_max, query, key, value, *buffers)
    else:
        with torch.no_grad():
            res = _ring_forward(ring, query, key, value, want_max)
    out, lse = res[0], res[1]
    max_scores = res[2] if want_max else None
    if return_aux is not None:
        return out, api.AuxOutput(lse=lse if return_aux.lse else None, max_scores=max_scores)
    if return_lse:
        return out, lse
    return out


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _local_problem(q, k, v, block_mask, world, per, enable_gqa) -> str | None:
    """What is wrong with this rank's inputs by themselves (None if nothing), checked before the
    ranks compare notes so that every rank raises, never only one while the others wait."""
    try:
        api._check_tensors(q, k, v, enable_gqa)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    L, S = q.shape[2], k.shape[2]
    if L % per or S % per:
        return (f"ValueError: the zigzag layout splits each shard into 2 chunks (rank r holds global "
                f"chunks r and {2 * world}-1-r), so local lengths must be even; got query {L}, key {S}")
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockMask):
        return (f"TypeError: block_mask must be a BlockMask (flexjit.create_block_mask, or torch's), "
                f"got {type(block_mask).__name__}")
    if tuple(block_mask.seq_lengths) != (world * L, world * S):
        return (f"ValueError: block_mask was created for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)}, "
                f"but the shards make ({world * L}, {world * S}) ({world} ranks x ({L}, {S})); "
                f"create the GLOBAL mask at the full lengths")
    bq, bkv = block_mask.BLOCK_SIZE
    cq, ck = L // per, S // per
    if cq % bq or ck % bkv:
        return (f"ValueError: chunks of ({cq}, {ck}) tokens ({per} per rank, {world} ranks) do not fall on "
                f"the block mask's BLOCK_SIZE={block_mask.BLOCK_SIZE} boundaries; use a BLOCK_SIZE "
                f"that divides the chunk length, or pad the sequence to a multiple of "
                f"{per * world} x the block size")
    nq, nkv = world * L // bq, world * S // bkv
    if block_mask.kv_num_blocks.dim() != 3 or block_mask.kv_indices.shape[-2:] != (nq, nkv):
        return (f"ValueError: block_mask's lists are not those of {nq}x{nkv} blocks of "
                f"{block_mask.BLOCK_SIZE} over ({world * L}, {world * S})")
    if block_mask.kv_num_blocks.device != q.device:
        return (f"ValueError: block_mask is on {block_mask.kv_num_blocks.device} but query is on "
                f"{q.device}; call block_mask.to({str(q.device)!r})")
    return None


def _prepare(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, backend, want_max,
             group, rank, world, layout, per) -> tuple[_Ring, bool]:
    """The ring's plan and its pairs' calls, after the ranks compared notes (one small all_gather
    on the CPU): every rank raises, or none does."""
    error = None
    problem = _local_problem(q, k, v, block_mask, world, per, enable_gqa)
    ring, needs_grad, meta = None, False, [-1] * 10
    if problem is not None:
        error = _error(problem)
    else:
        try:
            if score_mod is not None:
                check_arity(score_mod, SCORE_MOD)
            grid = _chunk_grid(block_mask, per * world)
            ring = _build(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, want_max,
                          group, rank, world, layout, per, grid)
            needs_grad = torch.is_grad_enabled() and (any(t.requires_grad for t in (q, k, v)) or
                                                      any(b.requires_grad for b in ring.buffers))
            grid_hash = hash(tuple(map(tuple, grid))) & (2 ** 62 - 1)  # its size: the layout
            meta = [*q.shape, k.shape[1], k.shape[2], v.shape[3], _DTYPES.index(q.dtype), grid_hash,
                    int(needs_grad)]
        except Exception as e:  # a TraceError, a refused backend...: raised below, on every rank
            error = e
    everyone = _gather([int(error is not None), *meta], group, world)
    if error is not None:
        raise error
    bad = [r for r, m in enumerate(everyone) if m[0]]
    if bad:
        raise ValueError(f"rank(s) {bad} got invalid inputs (their own error says why); every rank "
                         "must call flexjit.distributed.flex_attention with valid shards")
    names = ("batch", "query heads", "query length", "head dim", "key/value heads", "key length",
             "value head dim", "dtype")
    for pos, name in enumerate(names):
        seen = [m[1 + pos] for m in everyone]
        if len(set(seen)) > 1:
            if name == "dtype":
                seen = [_DTYPES[i] for i in seen]
            raise ValueError(f"the ranks' shards differ in {name}: {seen} (rank order); every rank "
                             "must hold an equal shard (flexjit.distributed.shard cuts them)")
    if len({m[-2] for m in everyone}) > 1:
        raise ValueError("the ranks' block masks (or layouts) differ; pass the same GLOBAL block_mask "
                         "(made at the full lengths) and layout on every rank")
    if len({m[-1] for m in everyone}) > 1:  # every rank takes part in the backward, or none
        raise ValueError(f"ranks {[r for r, m in enumerate(everyone) if m[-1]]} need gradients and the "
                         "others do not; every rank must run the backward of the same call")
    calls = list(ring.calls.values())
    for call in [ring.first, *calls]:
        call.grad = needs_grad
    ring.choice = dispatch.select(backend, ring.first)
    for key_, call in ring.calls.items():  # templates: the ring supplies the tensors
        ring.calls[key_] = dataclasses.replace(call, q=None, k=None, v=None)
    ring.first = None
    return ring, needs_grad


def _error(problem: str) -> Exception:
    kind, _, text = problem.partition(": ")
    return {"TypeError": TypeError, "ValueError": ValueError}.get(kind, ValueError)(text)


def _build(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, want_max, group, rank,
           world, layout, per, grid) -> _Ring:
    """The plan and one prepared Call per pair this rank computes (its tensors: placeholders of
    the right shapes until the ring supplies them)."""
    L, S = q.shape[2], k.shape[2]
    cq, ck = L // per, S // per
    pairs, last = _plan(grid, world, layout)
    ring = _Ring(group, rank, world, layout, per, cq, ck, pairs, last, {})
    mine = chunk_ids(rank, world, layout)
    qs = q.split(cq, 2)
    ks, vs = k.split(ck, 2), v.split(ck, 2)
    for o in range(world):
        for a, c in pairs[(rank, o)]:
            gq, gk = mine[a], chunk_ids(o, world, layout)[c]
            sm = _at_offsets(score_mod, SCORE_MOD, gq * cq, gk * ck) if score_mod is not None else None
            bm = _sub_mask(block_mask, per * world, gq, gk) if block_mask is not None else None
            ring.calls[(a, gk)] = api.prepare_call(qs[a], ks[0], vs[0], sm, bm, scale, enable_gqa,
                                                   kernel_options, max_scores=want_max)
    first = next(iter(ring.calls.values()), None)
    if first is None:  # nothing is listed anywhere: one call for its buffers, checks and choice
        sm = _at_offsets(score_mod, SCORE_MOD, 0, 0) if score_mod is not None else None
        bm = _sub_mask(block_mask, per * world, mine[0], 0) if block_mask is not None else None
        first = api.prepare_call(qs[0], ks[0], vs[0], sm, bm, scale, enable_gqa, kernel_options,
                                 max_scores=want_max)
    ring.first = first
    ring.buffers = first.program.buffers
    for call in ring.calls.values():  # every pair traced the same mods: the same captures
        if len(call.program.buffers) != len(ring.buffers) or \
                any(a is not b for a, b in zip(call.program.buffers, ring.buffers)):
            raise ValueError("the mods captured different tensors for different chunks; a mod must "
                             "not depend on anything but its arguments and what it captures")
    return ring


_META_GROUPS: dict = {}


def _meta_group(group):
    """A gloo group over ``group``'s ranks for the ranks' notes: comparing them on the host
    costs no device sync (an NCCL all_gather read back would drain the GPU queue every call).
    Made on first use by the group's ranks only (``use_local_synchronization``)."""
    if dist.get_backend(group) == "gloo":
        return group
    key = group if group is not None else dist.group.WORLD
    hit = _META_GROUPS.get(key)
    if hit is None:
        ranks = dist.get_process_group_ranks(key)
        hit = _META_GROUPS[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return hit


def _gather(values: list[int], group, world) -> list[list[int]]:
    """Every rank's ``values`` (small ints), in rank order, over the host."""
    if world == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=_meta_group(group))
    return [o.tolist() for o in out]


# --------------------------------------------------------------------------- point to point


class _Exchange:
    """One step's posted sends/receives (batch_isend_irecv), counted into a RingStats."""

    def __init__(self, ring: _Ring, stats: RingStats):
        self.ring, self.stats, self.ops = ring, stats, []

    def send(self, tensors, tag):
        for t in tensors:
            self.ops.append(dist.P2POp(dist.isend, t, self.ring.peer(+1), self.ring.group, tag))
            self.stats.messages_sent += 1
            self.stats.bytes_sent += t.numel() * t.element_size()

    def recv(self, tensors, src_delta, tag):
        for t in tensors:
            self.ops.append(dist.P2POp(dist.irecv, t, self.ring.peer(src_delta), self.ring.group, tag))
            self.stats.bytes_received += t.numel() * t.element_size()

    def send_to(self, tensors, dst, tag):
        peer = dst if self.ring.group is None else dist.get_global_rank(self.ring.group, dst)
        for t in tensors:
            self.ops.append(dist.P2POp(dist.isend, t, peer, self.ring.group, tag))
            self.stats.messages_sent += 1
            self.stats.bytes_sent += t.numel() * t.element_size()

    def recv_from(self, tensors, src, tag):
        peer = src if self.ring.group is None else dist.get_global_rank(self.ring.group, src)
        for t in tensors:
            self.ops.append(dist.P2POp(dist.irecv, t, peer, self.ring.group, tag))
            self.stats.bytes_received += t.numel() * t.element_size()

    def start(self) -> list:
        return dist.batch_isend_irecv(self.ops) if self.ops else []


def _wait(works: list) -> None:
    """Wait for each posted op once (the list empties: a gloo work waited twice can hang)."""
    while works:
        works.pop(0).wait()


def _post_kv(ring: _Ring, stats: RingStats, s: int, cur: tuple | None, like: tuple):
    """Post step s's key/value exchange: send the shard held on while someone further needs it,
    receive the next one if this rank or one after it needs it. -> (works, next shard or None)."""
    ex = _Exchange(ring, stats)
    if cur is not None and ring.travels(ring.owner(s), s):
        ex.send(cur, _TAG_KV)
    nxt = None
    if s + 1 < ring.steps and ring.travels(ring.owner(s + 1), s):
        nxt = tuple(torch.empty_like(t) for t in like)
        ex.recv(nxt, -1, _TAG_KV)
    return ex.start(), nxt


# --------------------------------------------------------------------------- forward


def _new_stats(ring: _Ring, which: str) -> RingStats:
    stats = RingStats(world=ring.world, steps=ring.steps,
                      backend=ring.choice.name if which == "forward" else (ring.choice.backward or ""))
    total = ring.per * ring.per * ring.world
    stats.pairs_computed = sum(len(ring.pairs[(ring.rank, o)]) for o in range(ring.world))
    stats.pairs_skipped = total - stats.pairs_computed
    _STATS[which] = stats
    return stats


def _ring_forward(ring: _Ring, q, k, v, want_max: bool):
    """(out, lse, max_scores or None, per-chunk outs, per-chunk lses) for this rank's queries."""
    stats = _new_stats(ring, "forward")
    B, Hq, L, _ = q.shape
    Ev = v.shape[-1]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qs = [c.contiguous() for c in q.split(ring.cq, 2)]
    acc = [torch.zeros(B, Hq, ring.cq, Ev, dtype=lse_dtype, device=q.device) for _ in qs]
    lse = [torch.full((B, Hq, ring.cq), -math.inf, dtype=lse_dtype, device=q.device) for _ in qs]
    mx = [torch.full_like(x, -math.inf) for x in lse] if want_max else None
    cur = (k.contiguous(), v.contiguous())
    like = cur
    for s in range(ring.steps):
        o = ring.owner(s)
        works, nxt = _post_kv(ring, stats, s, cur, like)  # the next step's shard flies meanwhile
        pairs = ring.pairs[(ring.rank, o)]
        if pairs:
            stats.steps_computed += 1
            ks, vs = cur[0].split(ring.ck, 2), cur[1].split(ring.ck, 2)
            kv_ids = chunk_ids(o, ring.world, ring.layout)
            for a, c in pairs:
                call = dataclasses.replace(ring.calls[(a, kv_ids[c])], q=qs[a], k=ks[c], v=vs[c])
                o_, l_, m_ = dispatch.forward(ring.choice.name, call)
                _merge(acc[a], lse[a], o_, l_)
                if want_max:
                    torch.maximum(mx[a], m_.to(lse_dtype), out=mx[a])
        _wait(works)
        cur = nxt
    outs = [a.to(q.dtype) for a in acc]
    lses = [x if q.dtype == torch.float64 else x.float() for x in lse]
    out = torch.cat(outs, 2) if len(outs) > 1 else outs[0]
    lse_all = torch.cat(lses, 2) if len(lses) > 1 else lses[0]
    max_all = (torch.cat(mx, 2) if len(mx) > 1 else mx[0]) if want_max else None
    return out, lse_all, max_all, outs, lses


def _merge(acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """acc, lse <- the softmax-weighted union of (acc, lse) and (out, part_lse), in place.
    Rows empty in both stay (0, -inf)."""
    part_lse = part_lse.to(lse.dtype)
    new = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    acc.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(out.to(acc.dtype) * torch.exp(part_lse - safe).unsqueeze(-1))
    lse.copy_(new)


# --------------------------------------------------------------------------- backward


def _pair_backward(name: str, call, q, k, v, out, lse, dout, dlse):
    """(dq, dk, dv, *captured grads) of one pair's share of the global attention, given the
    GLOBAL out and lse of its query rows.

    A backend that reads (out, lse) gets them as they are: its P = exp(s - lse) and
    delta = rowsum(dO∘O) - dLSE are then the global ones. One that recomputes the pair's own
    softmax (out_p, lse_p) gets dO scaled by w = exp(lse_p - lse) and
    dLSE_p = w·(rowsum(dO∘out_p) - rowsum(dO∘O) + dLSE), which makes its score gradient
    P_p·w·(dP - delta) = P·(dP - delta), the same thing."""
    if name not in _RECOMPUTES_SOFTMAX:
        return dispatch.backward(name, call, q, k, v, out, lse, dout, dlse)
    out_p, lse_p, _ = dispatch.forward(name, call)
    lse_p = lse_p.to(lse.dtype)
    live = torch.isfinite(lse_p) & torch.isfinite(lse)
    w = torch.where(live, torch.exp(lse_p - torch.where(live, lse, torch.zeros_like(lse))), torch.zeros_like(lse))
    d = dout.to(lse.dtype)
    corr = (d * out_p.to(lse.dtype)).sum(-1) - (d * out.to(lse.dtype)).sum(-1)
    if dlse is not None:
        corr = corr + dlse.to(lse.dtype)
    dout_p = (d * w.unsqueeze(-1)).to(dout.dtype)
    return dispatch.backward(name, call, q, k, v, out_p, lse_p, dout_p, w * corr)


def _ring_backward(ring: _Ring, q, k, v, outs, lses, dout, dlse, buffers):
    stats = _new_stats(ring, "backward")
    name = ring.choice.backward
    acc_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    qs = [c.contiguous() for c in q.split(ring.cq, 2)]
    if dout is None:
        dout = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    douts = [c.contiguous() for c in dout.split(ring.cq, 2)]
    dlses = [c.contiguous() for c in dlse.split(ring.cq, 2)] if dlse is not None else [None] * len(qs)
    dq = [torch.zeros(c.shape, dtype=acc_dtype, device=q.device) for c in qs]
    dbufs: dict[int, torch.Tensor] = {}
    cur = (k.contiguous(), v.contiguous())
    like = cur
    acc = None          # (dk, dv) of the shard held now, as it arrived
    acc_works = []      # the last step's (dk, dv) exchange: its send, and this step's receive
    finished = {}       # owner -> (dk, dv) that this rank sends home at the end
    mine_final = None
    for s in range(ring.steps):
        o = ring.owner(s)
        works, nxt = _post_kv(ring, stats, s, cur, like)
        held = s <= ring.last[o]
        pairs = ring.pairs[(ring.rank, o)]
        local = None
        if pairs:
            stats.steps_computed += 1
            ks, vs = cur[0].split(ring.ck, 2), cur[1].split(ring.ck, 2)
            local = (torch.zeros(cur[0].shape, dtype=acc_dtype, device=q.device),
                     torch.zeros(cur[1].shape, dtype=acc_dtype, device=q.device))
            kv_ids = chunk_ids(o, ring.world, ring.layout)
            for a, c in pairs:
                call = dataclasses.replace(ring.calls[(a, kv_ids[c])], q=qs[a], k=ks[c], v=vs[c])
                g = _pair_backward(name, call, qs[a], ks[c], vs[c], outs[a], lses[a], douts[a], dlses[a])
                dq[a] += g[0]
                local[0].narrow(2, c * ring.ck, ring.ck).add_(g[1])
                local[1].narrow(2, c * ring.ck, ring.ck).add_(g[2])
                for i, gb in enumerate(g[3:]):
                    if gb is not None:
                        gb = gb.to(torch.float64 if gb.dtype == torch.float64 else torch.float32)
                        dbufs[i] = dbufs[i] + gb if i in dbufs else gb.clone()
        _wait(acc_works)  # after this step's compute: the transfer had that long
        if held:
            if s == 0:
                acc = local if local is not None else tuple(
                    torch.zeros(t.shape, dtype=acc_dtype, device=q.device) for t in cur)
            elif local is not None:
                acc[0].add_(local[0])
                acc[1].add_(local[1])
        ex = _Exchange(ring, stats)
        if held and ring.travels(o, s):
            ex.send(acc, _TAG_ACC)
        nxt_acc = None
        if s + 1 < ring.steps and ring.travels(ring.owner(s + 1), s):
            nxt_acc = tuple(torch.empty(t.shape, dtype=acc_dtype, device=q.device) for t in like)
            ex.recv(nxt_acc, -1, _TAG_ACC)
        acc_works = ex.start()
        if held and s == ring.last[o]:
            if s == 0:
                mine_final = acc
            else:
                finished[o] = acc
        _wait(works)
        cur, acc = nxt, nxt_acc
    _wait(acc_works)
    # dK/dV home: from the last rank that needed a shard straight to its owner.
    ex = _Exchange(ring, stats)
    for o, grads in sorted(finished.items()):
        ex.send_to(grads, o, _TAG_HOME)
    if ring.last[ring.rank] > 0:
        mine_final = tuple(torch.empty(t.shape, dtype=acc_dtype, device=q.device) for t in like)
        ex.recv_from(mine_final, (ring.rank + ring.last[ring.rank]) % ring.world, _TAG_HOME)
    _wait(ex.start())
    if mine_final is None:  # nobody attends to this shard
        mine_final = tuple(torch.zeros(t.shape, dtype=acc_dtype, device=q.device) for t in like)
    dbuf_out = []
    for i, b in enumerate(buffers):
        if not (b.requires_grad and b.is_floating_point()):
            dbuf_out.append(None)
            continue
        g = dbufs.get(i)
        if g is None:
            g = torch.zeros(b.shape, dtype=torch.float64 if b.dtype == torch.float64 else torch.float32,
                            device=b.device)
        if ring.world > 1:
            dist.all_reduce(g, group=ring.group)
        dbuf_out.append(g.to(b.dtype))
    dq_all = torch.cat(dq, 2) if len(dq) > 1 else dq[0]
    return (dq_all.to(q.dtype), mine_final[0].to(k.dtype), mine_final[1].to(v.dtype), *dbuf_out)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ring, want_max, q, k, v, *buffers):
        out, lse, mx, outs, lses = _ring_forward(ring, q, k, v, want_max)
        ctx.ring = ring
        ctx.n_chunks = len(outs)
        ctx.save_for_backward(q, k, v, *outs, *lses, *buffers)
        ctx.set_materialize_grads(False)
        if mx is None:
            return out, lse
        ctx.mark_non_differentiable(mx)
        return out, lse, mx

    @staticmethod
    def backward(ctx, dout, dlse, dmax=None):
        q, k, v, *rest = ctx.saved_tensors
        n = ctx.n_chunks
        outs, lses, buffers = rest[:n], rest[n:2 * n], rest[2 * n:]
        grads = _ring_backward(ctx.ring, q, k, v, outs, lses, dout, dlse, buffers)
        dq, dk, dv, *dbufs = grads
        wanted = ctx.needs_input_grad[5:]
        return (None, None, dq, dk, dv, *[g if w else None for g, w in zip(dbufs, wanted)])
