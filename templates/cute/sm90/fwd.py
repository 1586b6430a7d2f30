"""Hopper (sm_90a) FlashAttention forward template with two holes: ``score_mod`` and ``mask_mod``.

What this module holds
----------------------
* ``FwdConfig`` / ``choose_tiling``: the frozen compile-time configuration and the tile table.
* ``FlexAttentionFwdSm90(FwdConfig)``: ``__call__`` builds TMA atoms, smem layouts and MMAs and
  launches; the kernel's roles: ``load`` (producer), ``mma`` and ``epilogue`` (per consumer).
* The host API: ``compile_fwd`` returns a ``CompiledFwd`` (sequence lengths, batch, heads and
  strides are runtime values), launched on the current torch stream, by default through
  TVM-FFI with the torch tensors themselves (``CompiledFwd.export`` writes an object file).

Algorithm (FlashAttention-2 §3.1 online softmax; FlashAttention-3 §3 Hopper pipelining)
-------------------------------------------------------------------------------------
* One CTA computes a tile_m-row query tile (128; 192 at D ≤ 64, at D=96 where asked for) of one
  (batch, query head). Warpgroup 0, the producer, drops to ``load_regs`` registers; one warp
  issues TMA loads of Q (once), then K and V through two ``num_stages`` rings. Warpgroups 1..n,
  consumers at ``mma_regs``, own 64 query rows each (``min_blocks_per_mp=1``: the caps hold).
* S = Q Kᵀ and O += P V are wgmma; P stays in registers (RS form) as the A operand of PV,
  except on D=96's 192-row tile, where it goes through smem (SS form, ``sm90.p_smem``).
* Overlap, both kinds: (1) inside a warpgroup, iteration j issues QKᵀ(j) then PV(j-1) and waits
  only for the first, so the softmax of block j runs while PV(j-1) is in flight; (2) between the
  consumer warpgroups, a named-barrier ping-pong orders the GEMM issue so one warpgroup's
  softmax hides under the other's GEMMs (on for head_dim <= 128). Trap: the code between
  ``wait_group(1)`` and ``wait_group(0)`` must be branch-free; ptxas otherwise waits for the PV
  GEMM at the branch's join and the first overlap is lost (seen in SASS, cost ~5% end to end).
* Softmax (``softmax``): exp2 domain, one FFMA + one MUFU.EX2 per score; row max and row sum per
  thread, reduced over the 4 threads of a row with butterfly shuffles; O is rescaled only when
  some row's max grew by more than ``rescale_threshold`` (log2 units; default 0, which keeps the
  bf16 error at torch Flex-Triton's), skipped per warp by vote; at head dim <= 64 unmasked tiles
  rescale without the vote, interleaved with the exp2s (``interleave_rescale``).
* Epilogue: O normalised, to smem over Q (stmatrix), TMA store (rows >= L clipped). LSE (natural
  log) = (m·c + log2(Σp))·ln2. A row with no unmasked key gives O = 0 and LSE = -inf, never NaN.

Persistent variant (``Tiling.persistent``; the backend picks it for short kv loops)
-------------------------------------------------------------------------------
The grid is min(num_tiles, num_sms) CTAs (``num_sms``: a runtime argument); CTA i runs tiles i,
i + grid, ... in ``tile_scheduler.tile_coords``'s order (longest first, L2 sections). The producer
warp and each consumer warpgroup run that loop with their own ``_schedule`` per tile, carrying
their pipeline states (Q: one stage, K/V: a ring) across tiles, past V(last) of each.
* Overlap: the consumers release Q right after their last QK GEMM has completed (before the
  last PV GEMM; at once for an empty row), so the producer loads the next tile's Q, and its
  first K/V tiles as stages free up, under this tile's last PV GEMM and epilogue.
* O has its own smem buffer (the next Q may be landing in Q's; D=256 would need 256 KB: refused).
  Its TMA store is not waited for; before the next tile's stmatrix warp 4 (the storing warp)
  waits for its bulk group (read semantics), then the epilogue barrier releases the others.
* Ping-pong: each consumer warpgroup signals the next one's barrier once per steady kv tile
  (total − 1 times per tile), so the one token warpgroup 0 hands itself per CTA, before the tile
  loop, is back at its barrier at every tile boundary; the epilogue barriers join them per tile.

Dynamic tile scheduler (``Tiling.dynamic_schedule``, persistent only): ``tile_scheduler``'s
protocol, each tile's index published to the consumers with its Q (an 8-byte smem slot).

Block sparsity (FlexAttention's BlockMask, mask block 128×128)
--------------------------------------------------------------
``kv_num_blocks`` (Bm, Hm, nQB) + ``kv_indices`` (Bm, Hm, nQB, nKVB) list PARTIAL blocks (mask_mod
applied per element), ``full_kv_num_blocks`` + ``full_kv_indices`` list FULL blocks (mask_mod
skipped; only the kv < S bound on a ragged last block). Bm ∈ {1, B}, Hm ∈ {1, Hq}: size 1
broadcasts. All int32; the order inside a list is free. The CTA for q-tile m walks partial blocks
first, then full blocks; whether a full block crosses S is decided per block before its GEMMs are
issued. A 192-row tile reads ``BlockSparseRows``: the lists of its two mask-block rows merged
(full only where both are), each partial entry with both rows' kinds; a consumer warpgroup's 64
rows lie in one mask block, and it keeps all, none or mask_mod's scores as that block's kind
says (``_apply_mods``). Without a block mask every kv tile is visited: as partial tiles with a
mask_mod, else as full tiles (dense mode, the last/ragged tile first).

Scheduling: a 1-D grid of q-tiles. Block-sparse launches run the longest q-tiles first in sections
of (head, batch) pairs whose K/V fit in L2; dense ones walk a head's q-tiles together.

The holes: the score_mod / mask_mod contract
--------------------------------------------
Both are compile-time Python callables (``None`` allowed), traced inline for every element of the
S tile, so they must be ``@cute.jit`` functions (or plain Python on DSL values)::

    score_mod(score: Float32, b: Int32, h: Int32, q_idx: Int32, kv_idx: Int32, aux: Aux) -> Float32
    mask_mod(b: Int32, h: Int32, q_idx: Int32, kv_idx: Int32, aux: Aux) -> Boolean

A mod with the attribute ``float_indices = True`` takes four more arguments, ``q_idx_f``,
``kv_idx_f`` and ``kv_minus_q_f`` (Float32 copies of the indices and of their difference, formed
cheaply: ``FloatIndices``) and ``kv_minus_q_parts`` = (base, offset), the two terms of
``kv_minus_q_f`` (a per-tile base and a compile-time offset per register): ``X * kv_minus_q_f``
for an X uniform over the tile is ``cute.fma(X, offset, X * base)``, one FFMA per element once
``X * base`` is shared (ALiBi's bias). ``float_indices`` may instead name the ones the mod reads
(a tuple); the others arrive as None. A mod with a ``hoisted`` function takes ``hoisted=``, its
tile-uniform values (``common.bind`` computes them once per tile).

* ``score`` is q·k·softmax_scale in natural units (torch's FlexAttention semantics).
* ``b`` batch, ``h`` QUERY head, ``q_idx`` / ``kv_idx`` global positions. Rows q_idx >= L and
  columns kv_idx >= S can reach the mods (ragged tiles); their results are discarded, but a mod
  that indexes a buffer must clamp its indices (the code generator does).
* ``aux`` is an ``Aux`` NamedTuple: ``aux.tensors[i]`` is a ``cute.Tensor`` in global memory with the
  captured torch tensor's shape (runtime values) and dtype (bool arrives as ``cutlass.Boolean``),
  indexed ``aux.tensors[i][i0, i1, ...]`` with Int32 expressions; ``aux.scalars[j]`` is a runtime
  ``Float32`` or ``Int32`` kernel argument (a new value does not recompile).
* Masking is applied after score_mod (a masked element becomes -inf), as in torch.
* ``mask_mod.rows`` (optional): one kept interval of keys per row, (lo, hi) = rows(b, h, q_idx,
  ...), ``.bounds`` its sides; partial tiles test bits made from it (``mask.row_words``) instead.

Shapes: q (B, Hq, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), o (B, Hq, L, Dv), lse (B, Hq, L)
fp32 (k and v (1, Hkv, S, ·) with ``FwdConfig.kv_batch_broadcast``: one K/V for every query
batch, e.g. a paged KV cache; strides nonzero, see ``check_kv_batch``); the last dim of q/k/v/o
contiguous, 16-byte aligned; bf16 or fp16; Hq = g·Hkv (head h reads kv head h // g); ``HEAD_DIMS``.
"""

from collections import namedtuple
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Union

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp
from cutlass.memory.smem import SmemAllocator

from flexjit.templates.cute import config, host, opaque, softmax, tile_scheduler
from flexjit.templates.cute.block_sparse import BlockSparse, BlockSparseRows, bcast, count_of, listed_tile, row_of
from flexjit.templates.cute.common import MASK_BLOCK, Aux, acc_as_operand_a, fadd, fold_heads, kernel_aux, launch, permute, quad_allreduce, rows_cols, rows_cols_layout, shared_storage, smem_buffer, smem_layout, tma_tiles, transposed, wgmma_gemm
from flexjit.templates.cute.host import as_scalar, placeholder, tvm_ffi_enabled  # noqa: F401  (the template's API)
from flexjit.templates.cute.pipeline import tma_pipelines
from flexjit.templates.cute.sm90 import fp8, p_smem
from flexjit.templates.cute.sm90.fwd_mods import FwdMods
from flexjit.templates.cute.sm90.fwd_tiling import (FP8_HEAD_DIMS, HEAD_DIMS, SMEM_CAPACITY, Tiling,  # noqa: F401  (the template's API)
                                                    choose_tiling, dynamic_schedule_default, smem_bytes)

# The block lists: one row per mask-block row (128-row tiles) or merged rows (192).
Lists = Union[BlockSparse, BlockSparseRows]

# Named barrier ids (0 is __syncthreads).
_BAR_EPILOGUE = 1
_BAR_PINGPONG_BASE = 2  # 2 + consumer warpgroup index


@dataclass(frozen=True)
class FwdConfig(config.FwdConfig):
    """The sm90 forward's configuration: the shared fields, its tiling (``choose_tiling``'s row
    by default) and the K/V batch broadcast."""

    tiling: Tiling = field(default=None)
    # K/V of batch extent 1 serve every query batch (torch's batch broadcast; the paged caches):
    # their TMA loads take batch coordinate 0. Off: K/V have the query's batch.
    kv_batch_broadcast: bool = False
    # q, k and v are float8_e4m3fn (``dtype`` is then the output's): e4m3 wgmma for both GEMMs,
    # V passed as its permuted transpose and the descales as a table (``sm90.fp8``).
    fp8: bool = False
    # Packed GQA: the query heads sharing a kv head (this many, Hq / Hkv) folded into the query
    # tile's rows (``common.fold_heads``), so one K/V tile serves them all. 1: one head per tile.
    # Plain attention only (no score_mod, mask_mod or block mask: nothing reads a row's head
    # or position), and tile_m a multiple of it.
    pack_gqa: int = 1

    def __post_init__(self):
        if self.tiling is None:
            object.__setattr__(self, "tiling", choose_tiling(self.head_dim, self.head_dim_v,
                                                             self.has_block_mask, fp8=self.fp8))


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------
class FlexAttentionFwdSm90(FwdMods, config.TiledKernel):
    """Warp-specialised FlashAttention-3 style forward for sm_90a with score/mask holes."""

    def __init__(self, cfg: FwdConfig):
        t = cfg.tiling
        super().__init__(cfg, 128 * t.num_mma_wgs)
        self.num_mma_wgs = t.num_mma_wgs
        self.pingpong = t.pingpong and t.num_mma_wgs >= 2
        # FP8: q, k, v (Vᵀ) are e4m3; ``dtype`` stays the output's. O gets its own smem buffer
        # (16-bit O is twice an e4m3 Q tile).
        self.fp8 = bool(getattr(cfg, "fp8", False))
        self.in_dtype = cutlass.Float8E4M3FN if self.fp8 else self.dtype
        self.rescale_threshold = float(cfg.rescale_threshold)
        self.write_max = bool(cfg.write_max)
        # O's rescale interleaved with the exp2s (``softmax.online_softmax``), no warp vote on
        # unmasked tiles: at head dim 64, 32 multiplies a row pay (8k window 270 -> 315 TFLOP/s);
        # at 128, skipping 64 by the vote is worth more (full 8k 650-660 vs 620-630).
        self.interleave_rescale = self.rescale_threshold == 0.0 and self.head_dim_v <= 64
        # P reaches the PV GEMM through shared memory (``p_smem``) rather than registers.
        self.p_smem = bool(getattr(t, "p_smem", False))
        # A query tile taller than a mask block reads merged list rows (``BlockSparseRows``).
        self.merged_rows = self.sparse and self.tile_m != MASK_BLOCK
        if self.sparse:
            assert MASK_BLOCK % self.tile_n == 0
            assert self.tile_m == MASK_BLOCK or self.tile_m == 192, self.tile_m
        self.tiles_per_mask_block = max(1, MASK_BLOCK // self.tile_n)
        # Which loop bodies exist: partial tiles (mask_mod + bound), full tiles (bound if ragged).
        self.has_partial = self.sparse or self.mask_mod is not None
        self.has_full = self.sparse or self.mask_mod is None
        self.pack_gqa = int(getattr(cfg, "pack_gqa", 1))
        if self.pack_gqa > 1 and (self.score_mod is not None or self.mask_mod is not None or
                                  self.sparse or self.write_max or self.fp8 or
                                  self.tile_m % self.pack_gqa):
            raise NotImplementedError(
                f"cute_sm90_fwd: packed GQA takes plain attention (no score_mod, mask_mod, block "
                f"mask, max_scores or FP8) on a tile of a multiple of {self.pack_gqa} rows")
        self.persistent = bool(getattr(t, "persistent", False))
        self.dynamic = self.persistent and bool(getattr(t, "dynamic_schedule", False))
        if self.persistent and smem_bytes(cfg) > SMEM_CAPACITY:
            raise NotImplementedError(
                f"cute_sm90_fwd: the persistent variant needs {smem_bytes(cfg)} bytes of shared "
                f"memory for this tiling (> {SMEM_CAPACITY}); use persistent=False")

    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        softmax_scale: Float32, hb_per_section: Int32, blocks: Optional[Lists],
        aux_tensors: Optional[tuple], aux_scalars: Optional[tuple], num_sms: Int32,
        tile_counter: Optional[cute.Tensor], mMax: Optional[cute.Tensor],
        descale: Optional[cute.Tensor], stream: cuda.CUstream,
    ):
        """The operands' layouts: ``common``'s docstring. ``hb_per_section``: the L2 swizzle's
        (head, batch) pairs per scheduling section; ``num_sms``: the persistent grid's size cap
        (runtime: not baked into the kernel); ``tile_counter``: (2,) int32, the dynamic
        scheduler's only (else None). FP8: ``mV`` is Vᵀ with its keys permuted, (B, Hkv, Dv,
        S padded to 128) (``sm90.fp8``), and ``descale`` the (B, Hkv, 3) float32 table of the
        q, k and v descales (else None)."""
        if const_expr(mQ.element_type != self.in_dtype or mK.element_type != self.in_dtype):
            raise TypeError("q/k dtype does not match the config")
        # Sequence-major views: (L, D, Hq, B), (S, D, Hkv, B), (S, Dv, Hkv, B), (L, Hq, B).
        q, k, v, o = [permute(t, [2, 3, 1, 0]) for t in (mQ, mK, mV, mO)]
        lse = permute(mLSE, [2, 1, 0])
        if const_expr(self.pack_gqa > 1):  # ((g, L), D, Hkv, B) and ((g, L), Hkv, B)
            q, o = (fold_heads(t, self.pack_gqa, 2) for t in (q, o))
            lse = fold_heads(lse, self.pack_gqa, 1)
        row_max = permute(mMax, [2, 1, 0]) if const_expr(mMax is not None) else None

        D, Dv, tm, tn = self.head_dim, self.head_dim_v, self.tile_m, self.tile_n
        dt = self.in_dtype
        sQ_layout = smem_layout(dt, tm, D)
        sK_layout = smem_layout(dt, tn, D, self.num_stages)
        v_tile = (Dv, tn) if const_expr(self.fp8) else (tn, Dv)  # FP8: Vᵀ, keys contiguous
        sV_layout = smem_layout(dt, *v_tile, self.num_stages)
        sO_layout = smem_layout(self.dtype, tm, Dv)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, q, sQ_layout, (tm, D))
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, k, cute.select(sK_layout, mode=[0, 1]), (tn, D))
        tma_v, tV = cpasync.make_tiled_tma_atom(g2s, v, cute.select(sV_layout, mode=[0, 1]), v_tile)
        tma_o, tO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), o, sO_layout, (tm, Dv)
        )
        self.tx_q = cute.size_in_bytes(dt, sQ_layout)
        self.tx_k = cute.size_in_bytes(dt, cute.select(sK_layout, mode=[0, 1]))
        self.tx_v = cute.size_in_bytes(dt, cute.select(sV_layout, mode=[0, 1]))

        K_MAJOR, MN_MAJOR = OperandMajorMode.K, OperandMajorMode.MN
        mma_qk = sm90_helpers.make_trivial_tiled_mma(
            dt, dt, K_MAJOR, K_MAJOR, Float32, (self.num_mma_wgs, 1, 1), (64, tn)
        )
        # FP8 wgmma takes both operands K-major: Vᵀ is stored so.
        mma_pv = sm90_helpers.make_trivial_tiled_mma(
            dt, dt, K_MAJOR, K_MAJOR if const_expr(self.fp8) else MN_MAJOR, Float32,
            (self.num_mma_wgs, 1, 1), (64, Dv),
            warpgroup.OperandSource.SMEM if const_expr(self.p_smem) else warpgroup.OperandSource.RMEM,
        )

        # O reuses Q's buffer with one tile per CTA; persistent, the producer may load the next
        # tile's Q while this tile's O is staged, so O has a buffer of its own. The dynamic
        # scheduler adds the int32 slot the producer publishes each tile index through.
        Int64 = cutlass.Int64
        fields = {"mbar_q": cute.struct.MemRange[Int64, 2],
                  "mbar_k": cute.struct.MemRange[Int64, 2 * self.num_stages],
                  "mbar_v": cute.struct.MemRange[Int64, 2 * self.num_stages]}
        if const_expr(self.dynamic):
            fields["tile_idx"] = cute.struct.MemRange[Int32, 2]
        name, q_elems = "SharedStorage", max(cute.cosize(sQ_layout), cute.cosize(sO_layout))
        if const_expr(self.persistent or self.fp8):
            name, q_elems = "SharedStorageOwnO", cute.cosize(sQ_layout)
        if const_expr(self.dynamic):
            name = "SharedStorageDynamic"
        if const_expr(self.fp8):
            name = "SharedStorageFp8"
        fields["sQ"] = smem_buffer(dt, q_elems)
        fields["sK"] = smem_buffer(dt, sK_layout)
        fields["sV"] = smem_buffer(dt, sV_layout)
        if const_expr(self.persistent or self.fp8):
            fields["sO"] = smem_buffer(self.dtype, sO_layout)
        if const_expr(self.p_smem):
            name += "P"
            fields["sP"] = smem_buffer(dt, smem_layout(dt, tm, tn))
        self.shared_storage = shared_storage(name, fields)

        num_m_blocks = cute.ceil_div(cute.size(q, mode=[0]), tm)
        num_tiles = num_m_blocks * q.shape[2] * q.shape[3]
        num_ctas = num_tiles
        if const_expr(self.persistent):
            num_ctas = cutlass.min(num_tiles, cutlass.max(num_sms, 1))
        launch(self.kernel(
            tQ, tK, tV, tO, lse, tma_q, tma_k, tma_v, tma_o, mma_qk, mma_pv,
            softmax_scale, hb_per_section, blocks, aux_tensors, aux_scalars,
            sQ_layout, sK_layout, sV_layout, sO_layout, tile_counter, row_max, descale,
        ), [num_ctas, 1, 1], self.num_threads, stream)

    # -----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, tma_o: cute.CopyAtom,
        mma_qk: cute.TiledMma, mma_pv: cute.TiledMma,
        softmax_scale: Float32, hb_per_section: Int32, blocks: Optional[Lists],
        aux_tensors: Optional[tuple], aux_scalars: Optional[tuple],
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
        tile_counter: Optional[cute.Tensor], mMax: Optional[cute.Tensor],
        descale: Optional[cute.Tensor],
    ):
        """The operands' layouts: ``common``'s docstring (mQ, mK, mV, mO: TMA views)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)
        # First, so that its global loads (block counts, first indices) overlap the setup.
        # (Persistent: each role computes it per tile inside its tile loop.)
        sched = None
        if const_expr(not self.persistent):
            sched = self._schedule(mQ, mK, hb_per_section, blocks, None)

        storage = SmemAllocator().allocate(self.shared_storage)
        pipe_q, pipe_k, pipe_v = self._make_pipelines(storage)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(self.persistent or self.fp8):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sP = None  # (tile_m, tile_n): P, the PV GEMM's A operand, with ``p_smem`` only
        if const_expr(self.p_smem):
            sP_layout = smem_layout(self.dtype, self.tile_m, self.tile_n)
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sTile = None
        if const_expr(self.dynamic):
            sTile = storage.tile_idx.get_tensor(cute.make_layout(2))

        aux = kernel_aux(aux_tensors, aux_scalars)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                ld = _Loads(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v)
                self.load(ld, hb_per_section, blocks, sched, sTile, tile_counter)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            sVt = sV if const_expr(self.fp8) else transposed(sV)
            self.mma(mma_qk, mma_pv, mQ, mK, mO, mLSE, sQ, sK, sVt, sO, tma_o, pipe_q,
                     pipe_k, pipe_v, softmax_scale, hb_per_section, blocks, aux, sched, sTile, mMax,
                     descale, sP)

    def _make_pipelines(self, storage):
        """Q: one stage; K and V: ``num_stages`` each; consumers arrive once per warp
        (PipelineTmaAsync releases from lane 0 of each consumer warp)."""
        return tma_pipelines(self.num_mma_threads // 32, (storage.mbar_q, 1, self.tx_q),
                             (storage.mbar_k, self.num_stages, self.tx_k),
                             (storage.mbar_v, self.num_stages, self.tx_v))

    # -----------------------------------------------------------------------------------------
    # Scheduling: which tile, which kv tiles
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def _schedule(self, mQ: cute.Tensor, mK: cute.Tensor, hb_per_section: Int32,
                  blocks: Optional[Lists], tile: Optional[Int32]):
        """Everything per tile about which kv tiles to visit, computed once: the tile coordinates,
        the number of partial and full kv TILES (a mask block is 128/tile_n tiles) and, with a
        block mask, 1-D views of this q-tile's two index lists (broadcast dims resolved here, so
        the mainloops index a plain row)."""
        m_block, head, batch = tile_scheduler.tile_coords(mQ, self.tile_m, hb_per_section, tile)
        n_dense = cute.ceil_div(mK.shape[0], self.tile_n)
        n_partial = Int32(0)
        n_full = Int32(0)
        part_row = None
        full_row = None
        kind_row = None
        first = n_dense - 1
        if const_expr(self.sparse):
            per = self.tiles_per_mask_block
            n_partial = count_of(blocks.kv_num_blocks, batch, head, m_block) * per
            part_row = row_of(blocks.kv_indices, batch, head, m_block)
            n_full = count_of(blocks.full_kv_num_blocks, batch, head, m_block) * per
            full_row = row_of(blocks.full_kv_indices, batch, head, m_block)
            # The first tile's index is read from both lists at once (entry 0 always exists)
            # instead of after the counts: one dependent global load less before K(0).
            first_partial = part_row[0] * per
            first_full = full_row[0] * per
            first = first_partial if n_partial > 0 else first_full
            if const_expr(self.merged_rows):
                kind_row = row_of(blocks.kv_kinds, batch, head, m_block)
        else:
            if const_expr(self.mask_mod is not None):
                n_partial = n_dense
            else:
                n_full = n_dense
        return _Schedule(m_block, head, batch, n_partial, n_full, n_dense, mK.shape[0], part_row,
                         full_row, first, kind_row, blocks.full_kv_indices if const_expr(self.sparse) else None)

    @cute.jit
    def _kv_tile(self, sched, j: Int32, which: cutlass.Constexpr) -> Int32:
        """The j-th kv tile this CTA visits. Partial tiles come first (j < n_partial); ``which``
        says which list j is known to fall in ("partial", "full") or "any" (runtime choice).
        Dense mode walks the tiles from the last (the ragged one) to the first."""
        tile = Int32(0)
        if const_expr(not self.sparse):
            tile = sched.n_dense - 1 - j
        else:
            per = self.tiles_per_mask_block
            if const_expr(which == "partial"):
                tile = listed_tile(sched.part_row, j, per)
            elif const_expr(which == "full"):
                tile = listed_tile(sched.full_row, cutlass.max(j - sched.n_partial, 0), per)
            else:
                if j < sched.n_partial:
                    tile = listed_tile(sched.part_row, j, per)
                else:
                    tile = listed_tile(sched.full_row, j - sched.n_partial, per)
        return tile

    # -----------------------------------------------------------------------------------------
    # Producer warp
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def load(
        self,
        ld: "_Loads",  # the tensors, TMA atoms and pipelines the producer uses
        hb_per_section: Int32,
        blocks: Optional[Lists],
        cta_sched,  # one tile per CTA: this CTA's tile; else None
        sTile: Optional[cute.Tensor],  # dynamic: (2,) int32 smem, [0] the published tile index
        tile_counter: Optional[cute.Tensor],  # dynamic: (2,) int32 gmem, [0] claims, [1] done CTAs
    ):
        """The producer warp, in one of three schedules.

        * One tile per CTA: fresh pipeline states.
        * Persistent: the same tile sequence as the consumers (block_idx, +grid_dim, ...), the
          Q and K/V pipeline states carried from one tile to the next. Nothing waits for a
          tile's epilogue: the next tile's Q is issued as soon as the consumers release Q (after
          their last QK GEMM) and its K/V as soon as stages free up, so these loads overlap the
          current tile's last PV GEMM and epilogue.
        * Dynamic scheduler (``tile_scheduler``'s protocol): the first tile is block_idx; each
          tile's index is published with its Q, and right after that tile's Q load the next one
          is claimed, so the atomic's latency hides under this tile's K/V loads. A claim >=
          num_tiles ends the loop: it is published as the sentinel, then the CTA retires."""
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        if const_expr(not self.persistent):
            self._load_tile(ld, cta_sched, q_state, kv)
        elif const_expr(not self.dynamic):
            num_tiles = tile_scheduler.num_tiles(ld.mQ, self.tile_m)
            first_tile = cute.arch.block_idx()[0]
            step = cute.arch.grid_dim()[0]
            for tile_id in cutlass.range(first_tile, num_tiles, step, unroll=1):
                sched = self._schedule(ld.mQ, ld.mK, hb_per_section, blocks, tile_id)
                kv, _ = self._load_tile(ld, sched, q_state, kv)
                q_state.advance()
        else:
            num_tiles = tile_scheduler.num_tiles(ld.mQ, self.tile_m)
            grid = Int32(cute.arch.grid_dim()[0])
            tile_id = Int32(cute.arch.block_idx()[0])  # < num_tiles: grid = min(num_tiles, SMs)
            while tile_id < num_tiles:
                sched = self._schedule(ld.mQ, ld.mK, hb_per_section, blocks, tile_id)
                kv, claimed = self._load_tile(ld, sched, q_state, kv, sTile, tile_id, tile_counter)
                q_state.advance()
                tile_id = cute.arch.shuffle_sync(claimed, 0) + grid
            # The sentinel: consumers waiting for the next Q learn that there is none.
            tile_scheduler.publish_tile(ld.pipe_q, q_state, sTile, tile_id, self.tx_q, with_q=False)
            tile_scheduler.retire(tile_counter, grid)  # the counter is zero again

    @cute.jit
    def _load_tile(
        self,
        ld: "_Loads",
        sched,
        q_state,
        kv,
        sTile: Optional[cute.Tensor] = None,
        tile_id: Optional[Int32] = None,
        tile_counter: Optional[cute.Tensor] = None,
    ):
        """Q first (it does not depend on the block lists), then K(0), then K(j) / V(j-1)
        pairs, then V(last): the order in which the consumers use them. ``kv`` is the state of
        K(0)'s stage; returned (persistent) advanced past V(last), unchanged for an empty row.
        Dynamic scheduler (``sTile``/``tile_counter`` given): ``tile_id`` is published with Q
        and the next tile is claimed right after Q's load; returns (kv, claim) where claim is
        lane 0's counter value (None without the dynamic scheduler)."""
        mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v = ld
        head_kv = sched.head  # packed GQA: the tile's head is the kv head
        if const_expr(self.pack_gqa == 1):
            head_kv = sched.head // (mQ.shape[2] // mK.shape[2])
        # A K/V batch broadcast over the query's (``FwdConfig.kv_batch_broadcast``): K and V have
        # batch extent 1 and every batch reads entry 0, as GQA maps a query head to its kv head.
        kv_batch = 0 if const_expr(self.kv_batch_broadcast) else sched.batch
        gQ = cute.local_tile(mQ[None, None, sched.head, sched.batch],
                             (self.tile_m, self.head_dim), (sched.m_block, 0))
        gK = cute.local_tile(mK[None, None, head_kv, kv_batch], (self.tile_n, self.head_dim), (None, 0))
        if const_expr(self.fp8):  # Vᵀ: (Dv, S) tiles of (Dv, tile_n)
            gV = cute.local_tile(mV[None, None, head_kv, kv_batch], (self.head_dim_v, self.tile_n), (0, None))
        else:
            gV = cute.local_tile(mV[None, None, head_kv, kv_batch], (self.tile_n, self.head_dim_v), (None, 0))
        tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)
        tKsK, tKgK = tma_tiles(tma_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_v, sV, gV)

        if const_expr(sTile is None):
            pipe_q.producer_acquire(q_state)
        else:
            tile_scheduler.publish_tile(pipe_q, q_state, sTile, tile_id, self.tx_q, with_q=True)
        cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        claimed = None
        if const_expr(tile_counter is not None):
            claimed = tile_scheduler.claim_tile(tile_counter)

        total = sched.n_partial + sched.n_full
        if total > 0:
            tile = sched.first_tile
            nxt = self._kv_tile(sched, cutlass.min(Int32(1), total - 1), "any")
            pipe_k.producer_acquire(kv)
            cute.copy(tma_k, tKgK[None, tile], tKsK[None, kv.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(kv))
            prev_tile = tile
            for j in cutlass.range(1, total, unroll=1):
                tile = nxt  # index loads run one iteration ahead of their use
                nxt = self._kv_tile(sched, cutlass.min(j + 1, total - 1), "any")
                kv_prev = kv.clone()
                kv.advance()
                pipe_k.producer_acquire(kv)
                cute.copy(tma_k, tKgK[None, tile], tKsK[None, kv.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(kv))
                pipe_v.producer_acquire(kv_prev)
                cute.copy(tma_v, tVgV[None, prev_tile], tVsV[None, kv_prev.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(kv_prev))
                prev_tile = tile
            pipe_v.producer_acquire(kv)
            cute.copy(tma_v, tVgV[None, prev_tile], tVsV[None, kv.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(kv))
            if const_expr(self.persistent):
                kv.advance()  # the next tile's K(0) goes to the following stage
        return kv, claimed

    # -----------------------------------------------------------------------------------------
    # Consumer warpgroups
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def mma(
        self,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        mQ: cute.Tensor,  # (L, D, Hq, B), shapes only
        mK: cute.Tensor,  # (S, D, Hkv, B), shapes only
        mO: cute.Tensor,  # TMA view (L, Dv, Hq, B)
        mLSE: cute.Tensor,  # (L, Hq, B)
        sQ: cute.Tensor,  # (tile_m, D)
        sK: cute.Tensor,  # (tile_n, D, stages)
        sVt: cute.Tensor,  # (Dv, tile_n, stages)
        sO: cute.Tensor,  # (tile_m, Dv): aliases sQ with one tile per CTA, else its own buffer
        tma_o: cute.CopyAtom,
        pipe_q: pipeline.PipelineAsync,
        pipe_k: pipeline.PipelineAsync,
        pipe_v: pipeline.PipelineAsync,
        softmax_scale: Float32,
        hb_per_section: Int32,
        blocks: Optional[Lists],
        aux: Aux,
        cta_sched,  # one tile per CTA: this CTA's tile; else None
        sTile: Optional[cute.Tensor],  # dynamic: (2,) int32 smem, [0] the published tile index
        mMax: Optional[cute.Tensor],  # (L, Hq, B) or None
        descale: Optional[cute.Tensor],  # FP8: (B, Hkv, 3) float32; else None
        sP: Optional[cute.Tensor] = None,  # (tile_m, tile_n) with ``p_smem``; else None
    ):
        """A consumer warpgroup, in the producer's schedule (``load``). Persistent: Q and K/V
        consumer states carried across tiles; the ping-pong token is handed out once per CTA
        (see "Persistent variant" in ``_mainloop``). Dynamic scheduler: the tile sequence comes
        from the producer: wait for the next Q, read the tile index published with it, stop at
        the sentinel (>= num_tiles); ``_mainloop`` then skips its own Q wait."""
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        (thr_qk, tSrQ, tSrK, tOrVt, tOrP, acc_O, s_shape, row_max, row_sum,
         c) = self._consumer_setup(mma_qk, mma_pv, sQ, sK, sVt, softmax_scale, tidx, wg, sP)
        row_peak = None  # the true row max (row_max may lag it by rescale_threshold)
        if const_expr(self.write_max):
            row_peak = cute.make_rmem_tensor(cute.size(row_max), Float32)
            row_peak.fill(-Float32.inf)
        if const_expr(not self.persistent):
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            if const_expr(self.fp8):
                softmax_scale, c = self._fp8_scales(cta_sched, mQ, descale, softmax_scale, sQ,
                                                    pipe_q, q_state, tidx)
            ctx = _MmaCtx(mma_qk, mma_pv, thr_qk, tSrQ, tSrK, tOrVt, tOrP, acc_O, s_shape,
                          row_max, row_sum, c, softmax_scale, cta_sched, aux, wg, row_peak, mMax,
                          descale)
            kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            self._mainloop(ctx, q_state, kv, pipe_q, pipe_k, pipe_v)
            self.epilogue(ctx, mma_pv, mQ, mO, mLSE, sO, tma_o, tidx)
        else:
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            if const_expr(self.pingpong):
                # The one token of the ping-pong ring starts at warpgroup 0's barrier, once per CTA:
                # every tile passes it round the ring (total − 1) times and leaves it there again.
                if wg == 0:
                    cute.arch.barrier_arrive(barrier_id=_BAR_PINGPONG_BASE,
                                             number_of_threads=2 * 128)
            num_tiles = tile_scheduler.num_tiles(mQ, self.tile_m)
            setup = (mma_qk, mma_pv, thr_qk, tSrQ, tSrK, tOrVt, tOrP, acc_O, s_shape, row_max,
                     row_sum, c, softmax_scale, aux, wg, row_peak)
            out = (mQ, mK, mO, mLSE, sO, tma_o, pipe_q, pipe_k, pipe_v, hb_per_section, blocks, tidx,
                   mMax)
            if const_expr(not self.dynamic):
                first_tile = cute.arch.block_idx()[0]
                step = cute.arch.grid_dim()[0]
                for tile_id in cutlass.range(first_tile, num_tiles, step, unroll=1):
                    q_state, kv = self._consumer_tile(setup, out, tile_id, q_state, kv)
            else:
                pipe_q.consumer_wait(q_state)
                tile_id = tile_scheduler.read_tile(sTile)
                while tile_id < num_tiles:
                    q_state, kv = self._consumer_tile(setup, out, tile_id, q_state, kv)
                    pipe_q.consumer_wait(q_state)
                    tile_id = tile_scheduler.read_tile(sTile)
            # The last TMA store must finish reading sO before the CTA's shared memory goes away.
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp_idx == 4:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _consumer_tile(self, setup: tuple, out: tuple, tile_id: Int32, q_state, kv):
        """One tile of a persistent consumer warpgroup: fresh softmax state, the mainloop, the
        epilogue. Returns the advanced (Q state, K/V state): the caller's loop must reassign
        them, or the DSL does not carry them from one iteration to the next."""
        (mma_qk, mma_pv, thr_qk, tSrQ, tSrK, tOrVt, tOrP, acc_O, s_shape, row_max, row_sum, c,
         softmax_scale, aux, wg, row_peak) = setup
        mQ, mK, mO, mLSE, sO, tma_o, pipe_q, pipe_k, pipe_v, hb_per_section, blocks, tidx, mMax = out
        sched = self._schedule(mQ, mK, hb_per_section, blocks, tile_id)
        self._reset_tile_state(acc_O, row_max, row_sum, row_peak)
        ctx = _MmaCtx(mma_qk, mma_pv, thr_qk, tSrQ, tSrK, tOrVt, tOrP, acc_O, s_shape,
                      row_max, row_sum, c, softmax_scale, sched, aux, wg, row_peak, mMax)
        kv = self._mainloop(ctx, q_state, kv, pipe_q, pipe_k, pipe_v)
        q_state.advance()
        self.epilogue(ctx, mma_pv, mQ, mO, mLSE, sO, tma_o, tidx)
        return q_state, kv

    @cute.jit
    def _consumer_setup(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, sQ: cute.Tensor,
                        sK: cute.Tensor, sVt: cute.Tensor, softmax_scale: Float32, tidx: Int32,
                        wg: Int32, sP: Optional[cute.Tensor] = None):
        """Operand fragments (smem descriptors) and the register state of one consumer thread:
        O accumulator (zeroed), row max (-inf) and row sum (0). With ``p_smem``, tOrP is sP."""
        wg_qk = mma_qk.get_slice(wg * 128)
        wg_pv = mma_pv.get_slice(wg * 128)
        thr_qk = mma_qk.get_slice(tidx)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        tOrP = sP  # p_smem: the descriptors are formed at each PV GEMM (``_p_operand``)
        if const_expr(not self.p_smem):
            tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_O = cute.make_rmem_tensor(wg_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32)
        acc_O.fill(0.0)
        s_shape = wg_qk.partition_shape_C((self.tile_m, self.tile_n))
        n_rows = cute.size(rows_cols_layout(cute.make_layout(s_shape)), mode=[0])
        row_max = cute.make_rmem_tensor(n_rows, Float32)
        row_sum = cute.make_rmem_tensor(n_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        # exp2 multiplier: scores are raw q·k without a score_mod, natural units with one.
        c = softmax.exp2_multiplier(self.score_mod, softmax_scale)
        return thr_qk, tSrQ, tSrK, tOrVt, tOrP, acc_O, s_shape, row_max, row_sum, c

    @cute.jit
    def _reset_tile_state(self, acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                          row_peak: Optional[cute.Tensor]):
        """Per-tile reset of the consumer registers (persistent). Called through ``self`` so the
        DSL does not carry the register tensors through the tile loop."""
        acc_O.fill(0.0)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        if const_expr(row_peak is not None):
            row_peak.fill(-Float32.inf)

    @cute.jit
    def _mainloop(self, ctx, q_state, kv, pipe_q: pipeline.PipelineAsync,
                  pipe_k: pipeline.PipelineAsync, pipe_v: pipeline.PipelineAsync):
        """One tile's kv loop: wait for Q, first tile, steady tiles (partial, then full), last
        PV GEMM. Returns the K/V consumer state.

        Persistent variant: ``kv`` enters as the stage of this tile's K(0) and leaves advanced
        past its V(last) (unchanged for an empty row), matching ``_load_tile``. Q is released
        once no QK GEMM can still read it (right before the last PV GEMM; at once for an empty
        row), so the producer can load the next tile's Q under this tile's last PV GEMM and
        epilogue. Ping-pong: each warpgroup waits on its barrier and signals the next one once
        per steady tile, the same number of times per tile for all warpgroups, so the token
        handed to warpgroup 0 once per CTA is back at warpgroup 0's barrier after each tile.
        (Per-CTA mode hands it out after the first tile of the only tile instead.)"""
        sched = ctx.sched
        wg = ctx.wg
        # Always wait for Q: the producer issues it even for an empty row, and the epilogue writes
        # O over it (non-persistent); the dynamic scheduler waited already, for the tile index.
        if const_expr(not self.dynamic):
            pipe_q.consumer_wait(q_state)
        n_partial = sched.n_partial
        total = n_partial + sched.n_full
        if total > 0:
            self._first_tile(ctx, kv, pipe_k)
            if const_expr(self.pingpong and not self.persistent):
                if wg == 0:  # warpgroup 0 issues its GEMMs first
                    cute.arch.barrier_arrive(barrier_id=_BAR_PINGPONG_BASE,
                                             number_of_threads=2 * 128)
            if const_expr(self.has_partial):
                for j in cutlass.range(1, n_partial, unroll=1):
                    tile = self._kv_tile(sched, j, "partial")
                    kv = self._steady_tile(ctx, j, kv, tile, pipe_k, pipe_v, "partial")
            if const_expr(self.has_full):
                start = cutlass.max(n_partial, 1)
                if const_expr(self.sparse):
                    # Any full tile may be the ragged last one. The check happens BEFORE the
                    # GEMMs are issued: a branch between wait_group(1) and wait_group(0) makes
                    # ptxas wait for the PV GEMM at the join, which kills the overlap. The
                    # index of tile j+1 is prefetched one iteration ahead.
                    fsched, t = sched, sched.full_list
                    if const_expr(self.p_smem):  # the row's address formed anew: kept from the
                        # setup, ptxas spilled it in the partial loop (192 rows). Selects for
                        # row_of's modulos (equal for Bm, Hm ∈ {1, full}): no folding back into it.
                        fsched = sched._replace(full_row=t[bcast(sched.batch, t.shape[0]),
                                                           bcast(sched.head, t.shape[1]), sched.m_block, None])
                    tile = self._kv_tile(fsched, start, "full")
                    for j in cutlass.range(start, total, unroll=1):
                        nxt = self._kv_tile(fsched, cutlass.min(j + 1, total - 1), "full")
                        if (tile + 1) * self.tile_n > sched.seqlen_k:
                            kv = self._steady_tile(ctx, j, kv, tile, pipe_k, pipe_v, "bounded")
                        else:
                            kv = self._steady_tile(ctx, j, kv, tile, pipe_k, pipe_v, "full")
                        tile = nxt
                else:
                    # Dense: tiles run from the last (the only ragged one, done by _first_tile)
                    # down to 0, so no steady tile needs the bound.
                    for j in cutlass.range(start, total, unroll=1):
                        kv = self._steady_tile(ctx, j, kv, sched.n_dense - 1 - j, pipe_k, pipe_v,
                                               "full")
            if const_expr(self.persistent):
                # Every QK GEMM of this tile has completed (the last one was waited for with
                # wait_group(0) by _first_tile or the last _steady_tile): sQ is free.
                pipe_q.consumer_release(q_state)
            # Last PV GEMM.
            pipe_v.consumer_wait(kv)
            wgmma_gemm(ctx.mma_pv, ctx.acc_O, self._p_operand(ctx), ctx.tOrVt[None, None, None, kv.index],
                       zero_init=False)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(kv)
            if const_expr(self.persistent):
                kv.advance()  # the next tile's K(0) is in the following stage
        if const_expr(self.persistent):
            if total == 0:
                pipe_q.consumer_release(q_state)  # an empty row never reads Q
        return kv

    @cute.jit
    def _first_tile(self, ctx, kv, pipe_k: pipeline.PipelineAsync):
        """S(0) = Q K(0)ᵀ, mods, first softmax step, P(0) into registers (no PV yet). Nothing
        else is in flight here, so runtime branches cost nothing."""
        sched = ctx.sched
        tile = sched.first_tile
        setup = self._mask_setup(ctx, tile, Int32(0), "partial")  # (a kinds row is never empty)
        pipe_k.consumer_wait(kv)
        acc_S = cute.make_rmem_tensor(ctx.s_shape, Float32)
        wgmma_gemm(ctx.mma_qk, acc_S, ctx.tSrQ, ctx.tSrK[None, None, None, kv.index], zero_init=True)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(kv)
        if sched.n_partial > 0:
            if const_expr(self.has_partial):
                self._mods(ctx, acc_S, tile, "partial", setup)
        else:
            if const_expr(self.has_full):
                if (tile + 1) * self.tile_n > sched.seqlen_k:
                    self._mods(ctx, acc_S, tile, "bounded")
                else:
                    self._mods(ctx, acc_S, tile, "full")
        self._online_softmax(ctx, acc_S, True)
        self._store_p(ctx, acc_S)

    @cute.jit
    def _steady_tile(self, ctx, j: Int32, kv, tile: Int32, pipe_k: pipeline.PipelineAsync,
                     pipe_v: pipeline.PipelineAsync, kind: cutlass.Constexpr):
        """Intra-warpgroup overlap: issue S(j) = Q K(j)ᵀ and O += P(j-1) V(j-1), wait for S(j)
        only, run the softmax of tile j under the PV GEMM, then wait for PV and rescale O.
        Between the two waits the code must stay branch-free (see ``mma``)."""
        kv_v = kv.clone()
        kv.advance()
        setup = self._mask_setup(ctx, tile, j, kind)
        pipe_k.consumer_wait(kv)
        self._pingpong_wait(ctx.wg)
        acc_S = cute.make_rmem_tensor(ctx.s_shape, Float32)
        wgmma_gemm(ctx.mma_qk, acc_S, ctx.tSrQ, ctx.tSrK[None, None, None, kv.index], zero_init=True)
        pipe_v.consumer_wait(kv_v)
        wgmma_gemm(ctx.mma_pv, ctx.acc_O, self._p_operand(ctx), ctx.tOrVt[None, None, None, kv_v.index],
                   zero_init=False)
        self._pingpong_signal(ctx.wg)
        warpgroup.wait_group(1)
        pipe_k.consumer_release(kv)
        self._mods(ctx, acc_S, tile, kind, setup)
        row_scale = self._online_softmax(ctx, acc_S, False)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(kv_v)
        if const_expr(self.p_smem):
            # O rescaled first: row_scale then dies before P's conversion and stmatrix, whose
            # registers beside O's 48 took causal and softcap past 160 (ptxas spilled 4-8 bytes).
            softmax.rescale_rows(ctx.acc_O, row_scale)
            self._store_p(ctx, acc_S)
        else:
            self._store_p(ctx, acc_S, pin=kind != "partial")
            softmax.rescale_rows(ctx.acc_O, row_scale,
                                 vote=kind == "partial" or not self.interleave_rescale)
        return kv

    @cute.jit
    def _store_p(self, ctx, acc_S: cute.Tensor, pin: cutlass.Constexpr = False):
        """P (the softmax's output in acc_S) into the PV GEMM's A fragment, converted.

        ``pin``: the conversions are tied to this point by a volatile use of P's registers.
        Left free, LLVM sinks them past the next tile's K wait (a loop ptxas does not schedule
        across), so they ran after the last exp2, each waiting on the one before; pinned here,
        ptxas interleaves them with the exp2s. Not on partial tiles: pinned there, masked
        kernels failed their spill and overlap checks (``test_cute_sm90_compile``)."""
        if const_expr(self.fp8):
            src, dst = fp8.acc_as_fp8_operand_a(acc_S, ctx.tOrP)
            dst.store(src.load().to(self.in_dtype))
        elif const_expr(self.p_smem):
            p_smem.store(ctx.tOrP, ctx.mma_qk, acc_S, self.dtype)
        else:
            ctx.tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
            if const_expr(pin):
                opaque.use_all(cute.recast_tensor(ctx.tOrP, Int32))

    def _p_operand(self, ctx) -> cute.Tensor:
        """The PV GEMM's A operand: P's registers, or with ``p_smem`` sP's descriptors, formed
        here rather than kept live through the softmax."""
        if const_expr(self.p_smem):
            return p_smem.operand(ctx.mma_pv.get_slice(ctx.wg * 128), ctx.tOrP)
        return ctx.tOrP

    @cute.jit
    def _fp8_scales(self, sched, mQ: cute.Tensor, descale: cute.Tensor, softmax_scale: Float32,
                    sQ: cute.Tensor, pipe_q, q_state, tidx: Int32):
        """(score scale, exp2 multiplier) of an FP8 tile: the scale times |q_descale · k_descale|
        of its (batch, kv head). A negative product negates the Q tile in smem first
        (``fp8.negate_fp8``; waits for Q), so that raw products keep their order. (The v
        descale is read by the epilogue: no register carries it through the mainloop.)"""
        qk = self._descale(sched, mQ, descale, 0) * self._descale(sched, mQ, descale, 1)
        if qk < Float32(0.0):
            pipe_q.consumer_wait(q_state)  # waited for again (at once) by _mainloop
            fp8.negate_fp8(sQ, tidx, self.num_mma_threads)
            cute.arch.fence_view_async_shared()  # generic-proxy smem writes -> wgmma (async proxy)
            cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
            qk = -qk
        scale = softmax_scale * qk
        return scale, softmax.exp2_multiplier(self.score_mod, scale)

    @cute.jit
    def _descale(self, sched, mQ: cute.Tensor, descale: cute.Tensor, i: int) -> Float32:
        """Descale ``i`` (0 q, 1 k, 2 v) of this tile's (batch, kv head) from the (B, Hkv, 3)
        table: the query head's kv head under GQA."""
        head_kv = sched.head // (mQ.shape[2] // descale.shape[1])
        return descale[sched.batch, head_kv, i]

    @cute.jit
    def _pingpong_wait(self, wg: Int32):
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=_BAR_PINGPONG_BASE + wg, number_of_threads=2 * 128)

    @cute.jit
    def _pingpong_signal(self, wg: Int32):
        if const_expr(self.pingpong):
            nxt = wg + 1
            if nxt == self.num_mma_wgs:
                nxt = Int32(0)
            cute.arch.barrier_arrive(barrier_id=_BAR_PINGPONG_BASE + nxt, number_of_threads=2 * 128)

    # -----------------------------------------------------------------------------------------
    # The holes, masking, softmax
    # -----------------------------------------------------------------------------------------
    def _online_softmax(self, ctx, acc_S: cute.Tensor, first: bool):
        """One online-softmax step over S (in place -> P); the per-row factor O is rescaled by."""
        return softmax.online_softmax(acc_S, ctx.row_max, ctx.row_sum,
                                      ctx.row_peak if self.write_max else None, ctx.c,
                                      self.rescale_threshold, first, self.interleave_rescale)

    # -----------------------------------------------------------------------------------------
    # Epilogue
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def epilogue(self, ctx, mma_pv: cute.TiledMma, mQ: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, sO: cute.Tensor, tma_o: cute.CopyAtom, tidx: Int32):
        """Normalise O, LSE in natural log, O -> smem (stmatrix; over Q, or into O's own buffer
        when persistent) -> gmem (TMA store)."""
        if const_expr(self.p_smem):
            # From the warp and the lane, as in ``_apply_mods`` (from tidx: a term kept, spilled).
            tidx = (cute.arch.make_warp_uniform(cute.arch.warp_idx()) - 4) * 32 + cute.arch.lane_idx()
        acc_O = ctx.acc_O
        o_rc = rows_cols(acc_O)
        n_rows = cute.size(o_rc, mode=[0])
        lse = cute.make_rmem_tensor(n_rows, Float32)
        v_descale = None
        if const_expr(self.fp8):
            v_descale = self._descale(ctx.sched, mQ, ctx.descale, 2)
        for r in cutlass.range_constexpr(n_rows):
            total = quad_allreduce(ctx.row_sum[r], fadd)
            inv, lse[r] = softmax.finalize(total, ctx.row_max[r], ctx.c)
            if const_expr(self.fp8):
                inv = inv * v_descale
            for k in cutlass.range_constexpr(cute.size(o_rc, mode=[1])):
                o_rc[r, k] = o_rc[r, k] * inv

        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        if const_expr(self.persistent):
            # sO is reused tile after tile: the previous tile's TMA store (issued and committed
            # by warp 4, not waited for then) must have finished READING sO before anyone
            # overwrites it. Warp 4 waits for its bulk group, the barrier below releases the
            # others. (A no-op on a CTA's first tile: no group is outstanding.)
            warp_idx_w = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp_idx_w == 4:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # Non-persistent: every consumer warpgroup must be done reading Q before O overwrites
        # it. Persistent: the previous tile's O store has finished reading sO (above).
        cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        st_atom = cute.make_copy_atom(StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_st = cute.make_tiled_copy_C(st_atom, mma_pv).get_slice(tidx)
        cute.copy(st_atom, thr_st.retile(rO), thr_st.partition_D(sO))
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes -> TMA (async proxy)
        cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=self.num_mma_threads)

        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 4:
            gO = cute.local_tile(mO[None, None, ctx.sched.head, ctx.sched.batch],
                                 (self.tile_m, self.head_dim_v), (ctx.sched.m_block, 0))
            tOsO, tOgO = tma_tiles(tma_o, sO, gO)
            cute.copy(tma_o, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(not self.persistent):
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            # Persistent: waited for before the next tile's stmatrix, or after the tile loop.

        # LSE: the thread holding column 0 of a row writes it (rows >= L are skipped).
        thr_pv = mma_pv.get_slice(tidx)
        cO = rows_cols(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        if cO[0, 0][1] == 0:
            seqlen_q = cute.size(mQ, mode=[0])  # packed GQA: group × L rows
            for r in cutlass.range_constexpr(n_rows):
                row = ctx.sched.m_block * self.tile_m + cO[r, 0][0]
                if row < seqlen_q:
                    mLSE[row, ctx.sched.head, ctx.sched.batch] = lse[r]
                    if const_expr(self.write_max):
                        # In the scores' units: raw q·k without a score_mod (scale it), the modded
                        # score with one. -inf (nothing kept) stays -inf.
                        peak = ctx.row_peak[r]
                        if const_expr(self.score_mod is None):
                            peak = peak if peak == -Float32.inf else peak * ctx.softmax_scale
                        ctx.mMax[row, ctx.sched.head, ctx.sched.batch] = peak


class _Schedule(NamedTuple):
    """Per-CTA work description (trace-time container of DSL values)."""

    m_block: object
    head: object
    batch: object
    n_partial: object  # partial kv tiles (mask_mod applies)
    n_full: object  # full kv tiles
    n_dense: object  # ceil(S / tile_n)
    seqlen_k: object
    part_row: object  # 1-D view of this q-tile's partial block indices (block mask only)
    full_row: object  # 1-D view of this q-tile's full block indices (block mask only)
    first_tile: object  # the kv tile visited first
    # Merged rows only: 1-D view of the partial entries' kinds (k0 | k1 << 2, ``BlockSparseRows``)
    kind_row: object = None
    full_list: object = None  # the full_kv_indices tensor (block mask only)


# What the producer warp loads from and into: global tensors (TMA views), their smem buffers, the
# TMA atoms and the three pipelines. mQ: (L, D, Hq, B); mK: (S, D, Hkv, B); mV: (S, Dv, Hkv, B);
# sQ: (tile_m, D); sK: (tile_n, D, stages); sV: (tile_n, Dv, stages).
_Loads = namedtuple("_Loads", "mQ mK mV sQ sK sV tma_q tma_k tma_v pipe_q pipe_k pipe_v")


# Per-CTA consumer state threaded through the mainloop helpers (trace-time container). row_peak:
# the true row max, write_max only; mMax: (L, Hq, B), write_max only.
# descale: FP8 only, the (B, Hkv, 3) table.
_MmaCtx = namedtuple("_MmaCtx", "mma_qk mma_pv thr_qk tSrQ tSrK tOrVt tOrP acc_O s_shape row_max "
                     "row_sum c softmax_scale sched aux wg row_peak mMax descale",
                     defaults=(None, None, None))


# ---------------------------------------------------------------------------------------------
# Host API. Two launch paths, one kernel:
# * TVM-FFI (default when ``import tvm_ffi`` works; ``FLEXJIT_TVM_FFI=0`` turns it off): compiled
#   once against placeholder tensors, then called with the torch tensors themselves; the
#   generated C wrapper checks every argument and launches on torch's current stream, and the
#   function can be exported to an object file another process loads.
# * DLPack (the fallback): ``from_dlpack(...).mark_layout_dynamic(...)`` per tensor per call,
#   checks in Python, and an explicit CUstream.
# ---------------------------------------------------------------------------------------------
def _as_cute(t, align: int = 16):
    """torch tensor -> cute tensor with dynamic shape/strides, last dim the static stride-1 dim."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.ndim - 1)


def _placeholder_args(cfg: FwdConfig, aux_tensors, aux_scalars) -> tuple:
    """The compile-time arguments of the TVM-FFI path, in ``FlexAttentionFwdSm90.__call__``'s
    order (without the stream)."""
    in_dtype = cutlass.Float8E4M3FN if cfg.fp8 else cfg.dtype
    q, k, v = [placeholder(in_dtype, 4, 16, 16 // in_dtype.width * 8) for _ in range(3)]  # TMA: 16 B
    o = placeholder(cfg.dtype, 4, 16, 8)
    lse = placeholder(Float32, 3, 4)
    blocks = None
    if cfg.has_block_mask:
        kind = BlockSparseRows if cfg.tiling.tile_m != MASK_BLOCK else BlockSparse
        blocks = kind(*[placeholder(Int32, n, 4) for n in (3, 4, 3, 4, 4)[:len(kind._fields)]])
    counter = placeholder(Int32, 1, 4) if cfg.tiling.dynamic_schedule else None
    row_max = placeholder(Float32, 3, 4) if cfg.write_max else None
    descale = placeholder(Float32, 3, 4) if cfg.fp8 else None
    return (q, k, v, o, lse, Float32(1.0), Int32(1), blocks,
            *host.aux_placeholders(aux_tensors, aux_scalars),
            Int32(tile_scheduler.CPU_NUM_SMS), counter, row_max, descale)


class CompiledFwd(host.CompiledFwd):
    """A compiled sm90 forward; ``ffi_fn`` is set on the TVM-FFI path, else ``compiled`` is
    called through DLPack."""

    def __call__(self, q, k, v, o, lse, softmax_scale: float, block_mask=None, aux_tensors=(),
                 aux_scalars=(), stream=None, hb_per_section: Optional[int] = None,
                 num_sms: Optional[int] = None, max_scores=None, descale=None):
        """``num_sms`` caps the persistent grid (default: the device's SM count); tests pass a
        small value to make each CTA run many tiles. Ignored by the non-persistent kernel.
        ``max_scores``: lse's shape and dtype, written by a ``write_max`` kernel (which needs it).
        FP8: ``v`` is the permuted Vᵀ (``sm90.fp8``), ``descale`` the (B, Hkv, 3) table."""
        self.check_max_scores(max_scores)
        if (descale is not None) != bool(self.cfg.fp8):
            raise ValueError("an FP8 forward takes a descale table, a 16-bit one none")
        args = (self.cfg, q, k, v, o, lse, softmax_scale, block_mask, aux_tensors, aux_scalars,
                hb_per_section, num_sms, max_scores, descale)
        if self.ffi_fn is None:
            import torch

            if stream is None:
                stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
                self.compiled(*_launch_args(*args), stream)
            else:
                with host.stream_context(stream):  # the tile counter belongs to the launch stream
                    self.compiled(*_launch_args(*args), stream)
        elif stream is None:
            self.ffi_fn(*_ffi_launch_args(*args))
        else:
            with host.stream_context(stream):  # the tile counter too belongs to the launch stream
                self.ffi_fn(*_ffi_launch_args(*args))
        return o, lse


def _lists_kind(cfg: FwdConfig):
    """The block-list tuple the kernel takes: one row per mask-block row, or merged rows."""
    return BlockSparseRows if cfg.tiling.tile_m != MASK_BLOCK else BlockSparse


def _ffi_launch_args(cfg, q, k, v, o, lse, softmax_scale, block_mask, aux_tensors, aux_scalars,
                     hb_per_section=None, num_sms=None, max_scores=None, descale=None) -> tuple:
    """TVM-FFI call arguments: the torch tensors themselves (the C wrapper checks alignment,
    strides, dtypes and block-mask presence); only the copies that make block lists / aux
    buffers contiguous happen here. The tile counter is the current stream's."""
    host.check_kv_batch(cfg.kv_batch_broadcast, q, k, v)
    blocks = None
    if block_mask is not None:
        blocks = _lists_kind(cfg)(*[t if t.is_contiguous() else t.contiguous() for t in block_mask])
    if hb_per_section is None:
        hb_per_section = tile_scheduler.default_hb_per_section(cfg, q, k, block_mask)
    counter = tile_scheduler.scheduler_counter(q.device) if cfg.tiling.dynamic_schedule else None
    return (q, k, v, o, lse, float(softmax_scale), int(hb_per_section), blocks,
            *host.aux_args(aux_tensors, aux_scalars), tile_scheduler.num_sms(cfg, q, num_sms),
            counter, max_scores, descale)


def _launch_args(cfg, q, k, v, o, lse, softmax_scale, block_mask, aux_tensors, aux_scalars,
                 hb_per_section=None, num_sms=None, max_scores=None, descale=None):
    """DLPack-path call arguments (the fallback): cute tensors built per call (16-bit only)."""
    host.check_kv_batch(cfg.kv_batch_broadcast, q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 != 0:
            raise ValueError(f"{name}: last dim must be contiguous and the base 16-byte aligned")
        if any(s % 8 for s in t.stride()[:-1]):
            raise ValueError(f"{name}: strides must be multiples of 8 elements (TMA alignment)")
    if (block_mask is not None) != cfg.has_block_mask:
        raise ValueError("block_mask presence must match FwdConfig.has_block_mask")
    blocks = None
    if block_mask is not None:
        blocks = _lists_kind(cfg)(*[_as_cute(t.contiguous(), align=4) for t in block_mask])
    if hb_per_section is None:
        hb_per_section = tile_scheduler.default_hb_per_section(cfg, q, k, block_mask)
    tensors = tuple(_as_cute(t.contiguous(), align=t.element_size()) for t in aux_tensors)
    scalars = tuple(as_scalar(x) for x in aux_scalars)
    counter = None
    if cfg.tiling.dynamic_schedule:
        counter = _as_cute(tile_scheduler.scheduler_counter(q.device), align=4)
    return (_as_cute(q), _as_cute(k), _as_cute(v), _as_cute(o), _as_cute(lse, align=4),
            Float32(softmax_scale), Int32(hb_per_section), blocks, tensors or None,
            scalars or None, Int32(tile_scheduler.num_sms(cfg, q, num_sms)), counter,
            None if max_scores is None else _as_cute(max_scores, align=4), None)


def compile_fwd(cfg: FwdConfig, q, k, v, o, lse, block_mask=None, aux_tensors=(),
                aux_scalars=(), options: str = "", use_tvm_ffi: Optional[bool] = None) -> CompiledFwd:
    """Compile for the given example tensors (their dtypes/ranks matter, their sizes and strides
    do not: those stay runtime values). Works on a CPU-only machine with CUTE_DSL_ARCH=sm_90a and
    CPU tensors; read ``result.compiled.__ptx__`` with ``options='--keep-ptx'``.
    ``use_tvm_ffi``: None picks TVM-FFI when available (``tvm_ffi_enabled()``)."""
    if use_tvm_ffi is None:
        use_tvm_ffi = tvm_ffi_enabled()
    if cfg.fp8:
        host.require_tvm_ffi("cute_sm90_fwd (FP8)")
        use_tvm_ffi = True
    signature = host.aux_signature(aux_tensors, aux_scalars)
    kernel = FlexAttentionFwdSm90(cfg)
    if not use_tvm_ffi:
        args = _launch_args(cfg, q, k, v, o, lse, 1.0, block_mask, aux_tensors, aux_scalars,
                            max_scores=lse.new_empty(lse.shape) if cfg.write_max else None)
        compiled = cute.compile(kernel, *args, cuda.CUstream(0), options=options)
        return CompiledFwd(cfg, compiled, signature)
    if cfg.fp8:
        if str(q.dtype) != "torch.float8_e4m3fn" or k.dtype != q.dtype or v.dtype != q.dtype or \
                host.cutlass_dtype(o.dtype, "cute_sm90_fwd") is not cfg.dtype:
            raise TypeError("an FP8 forward takes float8_e4m3fn q/k/v and an output of the config's dtype")
    elif host.cutlass_dtype(q.dtype, "cute_sm90_fwd") is not cfg.dtype or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError("q/k/v dtype does not match the config")
    if (block_mask is not None) != cfg.has_block_mask:
        raise ValueError("block_mask presence must match FwdConfig.has_block_mask")
    compiled = cute.compile(kernel, *_placeholder_args(cfg, aux_tensors, aux_scalars),
                            host.env_stream(), options=host.compile_options(options))
    return CompiledFwd(cfg, compiled, signature, ffi_fn=host.ffi_function(compiled))
