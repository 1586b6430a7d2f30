"""Which output tile a CTA computes: the linear tile order (L2 sections, longest first), the
persistent kernels' dynamic scheduler (device side) and its per-stream counter (host side).

Dynamic scheduler: a CTA's first tile is block_idx, each further one ``grid + atomicAdd(
counter[0], 1)``, an index into the same order, so idle CTAs pick up the remaining tiles
greedily (FA3's dynamic persistent scheduler). The producer claims one tile ahead, right after
a tile's Q load, and publishes each tile index to the consumers with that tile's Q: it waits
for Q's empty barrier, writes the index to an smem slot and arrives on Q's full barrier (the
arrive releases the write, the consumers' wait acquires it). A claim >= num_tiles is the
sentinel, published with a plain arrive (no TMA). After its last claim every CTA adds 1 to
counter[1]; the last one zeroes both words, so launches on one stream need no memset.
"""

import contextlib
import functools

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr

CPU_NUM_SMS = 132  # H100/H200 SXM; what a compile (or a launch on CPU tensors) assumes


def num_tiles(mQ: cute.Tensor, tile_m: int):
    """q-tiles × query heads × batch of a (L, D, Hq, B) view (rows ((g, L)) and kv heads when
    packed GQA folds the heads): the non-persistent grid size."""
    return cute.ceil_div(cute.size(mQ, mode=[0]), tile_m) * mQ.shape[2] * mQ.shape[3]


@cute.jit
def tile_coords(mQ: cute.Tensor, tile_m: cutlass.Constexpr, hb_per_section: Int32, tile):
    """Linear tile index (the CTA id when ``tile`` is None, else the persistent loop's index)
    -> (m_block, head, batch). (head, batch) pairs are grouped in sections whose K/V fit in L2;
    inside a section the heads vary fastest and the q-tiles run from the last (longest under
    causal masks) to the first: longest-processing-time-first order."""
    num_m = cute.ceil_div(cute.size(mQ, mode=[0]), tile_m)
    num_hq = mQ.shape[2]
    num_hb = num_hq * mQ.shape[3]
    if const_expr(tile is None):
        tile, _, _ = cute.arch.block_idx()
    per_section = hb_per_section * num_m
    section = tile // per_section
    rest = tile - section * per_section
    hb_here = cutlass.min(hb_per_section, num_hb - section * hb_per_section)
    m_rev = rest // hb_here
    hb = section * hb_per_section + (rest - m_rev * hb_here)
    head = hb % num_hq
    batch = hb // num_hq
    return num_m - 1 - m_rev, head, batch


@cute.jit
def publish_tile(pipe_q: pipeline.PipelineAsync, q_state, sTile: cute.Tensor, tile_id: Int32,
                 tx_q: cutlass.Constexpr, with_q: cutlass.Constexpr):
    """Wait until Q's stage is free (every consumer warp has released the previous tile's Q,
    after reading that tile's index), write ``tile_id`` to the smem slot, then arrive on Q's
    full barrier from the same thread. ``with_q``: arrive.expect_tx(``tx_q`` bytes), the Q TMA
    follows; else (the sentinel) a plain arrive: no bytes expected, the phase completes."""
    pipe_q.sync_object_empty.wait(q_state.index, q_state.phase)
    with cute.arch.elect_one():
        sTile[0] = tile_id
        if const_expr(with_q):
            cute.arch.mbarrier_arrive_and_expect_tx(pipe_q.producer_get_barrier(q_state), tx_q)
        else:
            cute.arch.mbarrier_arrive(pipe_q.producer_get_barrier(q_state))


@cute.jit
def claim_tile(tile_counter: cute.Tensor) -> Int32:
    """Lane 0 claims the next tile: the counter's old value (the caller adds grid_dim and
    broadcasts it with a shuffle only when it needs it, so the atomic's latency hides)."""
    got = Int32(0)
    if cute.arch.lane_idx() == 0:
        got = cute.arch.atomic_add(tile_counter.iterator, Int32(1), sem="relaxed", scope="gpu")
    return got


@cute.jit
def read_tile(sTile: cute.Tensor) -> Int32:
    """The tile index published with the Q just waited for. The warp sync orders every lane's
    read before the warp's later release of Q, after which the producer may overwrite it."""
    tile_id = sTile[0]
    cute.arch.sync_warp()
    return tile_id


@cute.jit
def retire(tile_counter: cute.Tensor, grid: Int32):
    """After a CTA's last claim: count it finished (acq_rel orders its claims before); the CTA
    that sees grid - 1 is the last, no claim can follow, and it zeroes the counter for the next
    launch on this stream."""
    if cute.arch.lane_idx() == 0:
        done = cute.arch.atomic_add(tile_counter.iterator + 1, Int32(1), sem="acq_rel",
                                    scope="gpu")
        if done == grid - 1:
            tile_counter[0] = Int32(0)
            tile_counter[1] = Int32(0)


# ---------------------------------------------------------------------------------------------
# Host
# ---------------------------------------------------------------------------------------------
def hb_per_section(seqlen_k: int, head_dim: int, head_dim_v: int, elem_bytes: int,
                   num_hb: int, q_per_kv: int, l2_budget: int = 40 * 1024 * 1024) -> int:
    """How many (head, batch) pairs to schedule together so their K/V stay in L2."""
    kv_bytes = max(1, seqlen_k * (head_dim + head_dim_v) * elem_bytes)
    kv_heads = max(1, l2_budget // kv_bytes)
    n = 1 << (kv_heads.bit_length() - 1)  # power of two
    return int(max(1, min(num_hb, n * q_per_kv)))


def default_hb_per_section(cfg, q, k, block_mask) -> int:
    """Dense: 1 (every q-tile costs the same, so one head's q-tiles run together and stream the
    same K/V in lockstep). Block-sparse: L2-sized sections, longest first."""
    if block_mask is None:
        return 1
    b, hq = q.shape[0], q.shape[1]
    return hb_per_section(k.shape[2], cfg.head_dim, cfg.head_dim_v, q.element_size(), b * hq,
                          hq // k.shape[1])


def num_sms(cfg, q, given=None) -> int:
    """The persistent grid cap: the device's SM count (cached per device) unless given. A
    non-persistent kernel ignores it (1, no device query)."""
    if given is not None:
        return int(given)
    if not cfg.tiling.persistent:
        return 1
    if q.device.type != "cuda":
        return CPU_NUM_SMS
    index = q.device.index
    if index is None:
        import torch

        index = torch.cuda.current_device()
    return device_num_sms(index)


# Dynamic scheduler counters, one (2,) int32 tensor per (device, stream): [0] tiles claimed
# beyond the first grid_dim, [1] CTAs finished. Zeroed once when allocated (on the launch
# stream, so stream-ordered before the first launch); each launch leaves them at zero again,
# and launches on one stream are serialised. A different stream gets its own counter
# (concurrent launches must not share one). Dropping entries is safe: the caching allocator
# reuses a freed block only in stream order after the kernels of the stream it was allocated on.
_TILE_COUNTERS = {}
_MAX_TILE_COUNTERS = 64


def scheduler_counter(device):
    """A persistent kernel's dynamic-scheduler counter for ``device`` and torch's current stream
    there (the launch stream: callers switch to it first)."""
    import torch

    if device.type != "cuda":  # compile-only (CPU example tensors)
        return torch.zeros(2, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        if len(_TILE_COUNTERS) >= _MAX_TILE_COUNTERS:
            _TILE_COUNTERS.clear()
        # Counters live for the process: they come from a pool of their own, never from a CUDA
        # graph's (torch.compile's mode="reduce-overhead" warms up in its graph pool and refuses
        # tensors there that outlive the call).
        with torch.cuda.device(index), _counter_pool(index):
            counter = torch.zeros(2, dtype=torch.int32, device=device)
        _TILE_COUNTERS[key] = counter
    return counter


_COUNTER_POOLS: dict = {}


def _counter_pool(index: int):
    import torch

    if not hasattr(torch.cuda, "use_mem_pool"):  # torch < 2.6: no pools of one's own
        return contextlib.nullcontext()
    pool = _COUNTER_POOLS.get(index)
    if pool is None:
        pool = _COUNTER_POOLS[index] = torch.cuda.MemPool()
    return torch.cuda.use_mem_pool(pool, device=index)


@functools.lru_cache(maxsize=None)
def device_num_sms(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count
