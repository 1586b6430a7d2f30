"""Blackwell (sm_100a) FlashAttention forward template with two holes: ``score_mod`` and ``mask_mod``.

Status: compiles for sm_100a on the CPU (tests/test_cute_sm100_compile.py); it has NEVER RUN on a
Blackwell GPU. ``flexjit/backends/cute_sm100.py`` refuses every call until a first-use self-check
exists, so nothing here can produce an answer yet.

What this module holds
----------------------
* ``FwdConfig`` / ``HEAD_DIMS`` / ``smem_bytes`` / ``TMEM_COLUMNS``: the frozen compile-time
  configuration and its resource sums.
* ``FlexAttentionFwdSm100``: the CuTeDSL kernel class. ``__init__`` takes a ``FwdConfig``; the
  ``@cute.jit`` ``__call__`` builds the tcgen05 tiled MMAs, the smem layouts and the TMA atoms and
  launches; the ``@cute.kernel`` body splits the CTA's warps into roles, each a method:
  ``load`` (TMA), ``mma`` (tcgen05.mma issue), ``softmax`` (two warpgroups), ``correction``
  (rescale of O in tensor memory, then the epilogue).
* ``BlockSparse256``: the block lists of a 256-row query tile (see "Block sparsity").
* A host API like the sm90 template's: ``compile_fwd`` -> ``CompiledFwd`` (TVM-FFI placeholders,
  launched on torch's current stream; a DLPack path is not offered here).

Algorithm (FlashAttention-2 §3.1 online softmax; FA4's Blackwell pipeline, our own protocol)
----------------------------------------------------------------------------------------
A CTA computes 256 query rows (two 128-row sub-tiles, t = 0, 1) of one (batch, query head)
against 128-key tiles of its kv head (GQA: kv head = h // (Hq / Hkv)). Sixteen warps:

* warps 0-3: softmax of sub-tile 0, warps 4-7: softmax of sub-tile 1 (192 registers each);
* warps 8-11: correction + epilogue (96 registers); warp 8 allocates and frees tensor memory;
* warp 12: MMA issue, warp 13: TMA loads, warps 14-15: idle (32 registers; they only exist so
  that ``setmaxnreg`` acts on whole warpgroups: 2·128·192 + 128·96 + 128·32 = 65536).

Tensor memory (512 columns × 128 lanes of 32 bits; lane = query row of a sub-tile):
S_t at columns [128·t, 128·t + 128), O_t at [256 + Dv·t, 256 + Dv·(t + 1)). P_t (16-bit, two per
column) overwrites the first 64 columns of S_t once the softmax has read S_t into registers.

The kv loop, as the MMA warp issues it (tcgen05.mma from one thread executes in issue order)::

    S0 = Q0·K(0)ᵀ; S1 = Q1·K(0)ᵀ
    for j in 1..n-1:  O0 += P0·V(j-1); S0 = Q0·K(j)ᵀ; O1 += P1·V(j-1); S1 = Q1·K(j)ᵀ
    O0 += P0·V(n-1); O1 += P1·V(n-1)

Because PV_t(j-1) is issued before QK_t(j), the new S_t never overwrites P_t before the tensor
core has read it, and while softmax t works on S_t(j) the tensor core runs the other sub-tile's
PV and QK: the two sub-tiles ping-pong. The pipelines (mbarriers):

* ``pipe_q`` (2 stages: Q0, Q1), ``pipe_k``, ``pipe_v`` (``num_stages`` each): TMA -> MMA warp,
  released by tcgen05.commit when the MMAs reading the stage complete.
* ``pipe_s``: MMA -> softmax t, "S_t(j) is in tensor memory" (tcgen05.commit).
* ``pipe_vec``: softmax t -> correction, "P_t(j) is in tensor memory, and here are step j's
  rescale factor, running sum and max of the row" (in shared memory, ``sVec``).
* ``pipe_o``: correction -> MMA, "O_t is rescaled for step j (and P_t(j) is ready)"; its
  release by the MMA warp (tcgen05.commit after PV_t(j)) is what the correction's next acquire
  waits for, i.e. "PV_t(j) has completed".

These three have two stages, stage t belonging to sub-tile t: the MMA warp and the correction
warpgroup serve the sub-tiles in turn (their states advance by one), a softmax warpgroup only its
own stage (its states start at t and advance by two), so one copy of the softmax code serves both
sub-tiles with t a runtime value. Every hand-off is wrapped in tcgen05 fences
(``tcgen05_fence``): before_thread_sync ahead of the arrive, after_thread_sync behind the wait.

Softmax (one thread per row, so no shuffles): S_t is read from TMEM 16 columns at a time, each
chunk modded before the next is read; mask_mod (with the kv < S bound) is evaluated into four
32-bit words before S_t is waited for, so its loads overlap the QK GEMM. p = exp2(s·c − m·c) with
c = softmax_scale·log2(e) (log2(e) where a score_mod already produced natural-unit scores); O is
rescaled by the correction
warpgroup only where a row's max grew by more than ``rescale_threshold`` (log2 units, default 0),
skipped per warp by vote. Epilogue (correction warpgroup): O_t / rowsum -> 16-bit -> global memory
straight from registers (one row per thread, 16-byte vectors; rows >= L are not written); LSE =
(m·c + log2(Σp))·ln 2; a row with no kept key gives O = 0 and LSE = −inf.

Block sparsity
--------------
flexjit's BlockMask is 128×128 (partial and full lists per 128-row block); this CTA covers two
128-row blocks. The host (``cute_sm100.sm100_block_lists``) merges each pair of rows into one
list of kv blocks that at least one of the two visits, and gives each entry a kind per sub-tile:
0 = the sub-tile skips the block (its softmax stores P = 0), 1 = partial (mask_mod and the
kv < S bound apply), 2 = full (no mask_mod; only the bound where the block crosses S). ``kinds``
holds k0 | (k1 << 2). Without a block mask every kv tile is visited, partial with a mask_mod and
full without one.

The holes: the contract of ``sm90/fwd.py`` ("The holes"), unchanged: the same
rendered modules (``flexjit/backends/cute_render.py``) fill both kernels. ``aux`` is a
``common.Aux``; mods marked ``float_indices`` get ``common.FloatIndices`` arguments.

Shapes: q (B, Hq, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), o (B, Hq, L, Dv), lse (B, Hq, L) fp32;
last dim contiguous, 16-byte aligned, other strides multiples of 8 elements; bf16 or fp16.
Head dims: ``HEAD_DIMS``.
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_helpers
from cutlass.memory.smem import SmemAllocator
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

from flexjit.templates.cute import config, host, softmax
from flexjit.templates.cute.block_sparse import KIND_FULL, KIND_PARTIAL, KIND_SKIP, BlockSparse256, count_of, row_of
from flexjit.templates.cute.common import Aux, FloatIndices, bind, fadd, kernel_aux, permute, smem_buffer, tree, where
from flexjit.templates.cute.host import placeholder, tvm_ffi_enabled  # noqa: F401  (the template's API)
from flexjit.templates.cute.mask import kept, mask_word
from flexjit.templates.cute.pipeline import group_pipeline, thread_group, tma_pipelines
from flexjit.templates.cute.sm100.common import GPU_ARCH, LOAD_WARP, MMA_WARP, SMEM_CAPACITY, TMEM_COLUMNS, free_tmem, launch, tcgen05_fence, tma_operand, tmem_address, tmem_allocator

HEAD_DIMS = ((64, 64), (128, 128))
SUB_M = 128  # rows of one sub-tile (the tcgen05 M, one TMEM lane per row)
CTA_M = 2 * SUB_M  # query rows per CTA
TILE_N = 128  # keys per kv tile (= the mask block; _mask_bits assumes 4 words of 32)
S_CHUNK = 16  # S columns the softmax reads from TMEM (and mods) at a time

# Warp roles (and MMA_WARP, LOAD_WARP of sm100.common).
_SOFTMAX_WARPS = ((0, 1, 2, 3), (4, 5, 6, 7))
_CORRECTION_WARP0 = 8
_SOFTMAX_REGS, _CORRECTION_REGS, _OTHER_REGS = 208, 56, 40

# Named barriers (sm100.common's): BAR_TMEM_ALLOC, softmax ×2, correction and the MMA warp
# wait for the TMEM address; BAR_TMEM_FREE, the correction warpgroup, before warp 8 frees TMEM.

_VEC_SLOTS = 4  # per row in sVec: rescale factor, running sum, running max, true max


def num_stages(head_dim: int) -> int:
    """K and V ring depth: 3 at D = 64 (Q 32 KB + 3·(16 + 16) KB), 2 at D = 128 (Q 64 KB +
    2·(32 + 32) KB = 192 KB; 3 stages would need 256 KB)."""
    return 3 if head_dim <= 64 else 2


def smem_bytes(cfg: "FwdConfig") -> int:
    elem = 2
    q = CTA_M * cfg.head_dim * elem
    kv = num_stages(cfg.head_dim) * TILE_N * (cfg.head_dim + cfg.head_dim_v) * elem
    vec = 2 * _VEC_SLOTS * SUB_M * 4
    bars = 8 * (4 + 4 * num_stages(cfg.head_dim) + 2 * 2 * 3) + 8
    return 1024 + q + kv + vec + bars


@dataclass(frozen=True)
class FwdConfig(config.FwdConfig):
    """The sm100 forward's configuration: the shared fields and ``score_loads``."""

    # The score_mod loads per element (bias tables): the softmax takes two passes over S in
    # TMEM instead of holding 128 scores in registers beside those loads (see ``_step``).
    score_loads: bool = False

    def __post_init__(self):
        config.check_head_dims("cute_sm100_fwd", self.head_dim, self.head_dim_v, HEAD_DIMS)


class _Sched(NamedTuple):
    """Which kv tiles this CTA visits (trace-time container of DSL values)."""

    m_block: object  # the 256-row tile index
    head: object
    batch: object
    n: object  # kv tiles visited
    idx_row: object  # block-sparse: 1-D view of this tile's kv block indices, else None
    kind_row: object  # block-sparse: 1-D view of their kinds, else None
    seqlen_q: object
    seqlen_k: object


class FlexAttentionFwdSm100(config.Kernel):
    """Warp-specialised FA4-style forward for sm_100a with score/mask holes."""

    def __init__(self, cfg: FwdConfig):
        super().__init__(cfg)
        self.num_stages = num_stages(cfg.head_dim)
        self.rescale_threshold = float(cfg.rescale_threshold)
        self.write_max = bool(cfg.write_max)
        self.qk_tiler = (SUB_M, TILE_N, self.head_dim)
        self.pv_tiler = (SUB_M, self.head_dim_v, TILE_N)
        self.tmem_s = (0, TILE_N)
        self.tmem_o = (2 * TILE_N, 2 * TILE_N + self.head_dim_v)
        assert 2 * TILE_N + 2 * self.head_dim_v <= TMEM_COLUMNS
        assert smem_bytes(cfg) <= SMEM_CAPACITY, smem_bytes(cfg)
        # Each CTA allocates all 512 TMEM columns: a second resident CTA would wait in
        # tcgen05.alloc for the first to finish. The smem use keeps it to one CTA per SM.
        assert 2 * smem_bytes(cfg) > SMEM_CAPACITY, smem_bytes(cfg)

    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        softmax_scale: Float32, blocks: Optional[BlockSparse256],
        aux_tensors: Optional[tuple], aux_scalars: Optional[tuple], mMax: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        """The operands' layouts: ``common``'s docstring."""
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype):
            raise TypeError("q/k dtype does not match the config")
        # MMA views: Q (L, D, (Hq, B)) and K (S, D, (Hkv, B)) K-major, V (Dv, S, (Hkv, B)) MN-major.
        q = cute.group_modes(permute(mQ, [2, 3, 1, 0]), 2, 4)
        k = cute.group_modes(permute(mK, [2, 3, 1, 0]), 2, 4)
        v = cute.group_modes(permute(mV, [3, 2, 1, 0]), 2, 4)
        o = permute(mO, [2, 3, 1, 0])  # (L, Dv, Hq, B)
        lse = permute(mLSE, [2, 1, 0])  # (L, Hq, B)
        row_max = permute(mMax, [2, 1, 0]) if const_expr(mMax is not None) else None

        one_sm = tcgen05.CtaGroup.ONE
        K_MAJOR, MN_MAJOR = OperandMajorMode.K, OperandMajorMode.MN
        mma_qk = sm100_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, one_sm, self.qk_tiler[:2])
        mma_pv = sm100_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, one_sm, self.pv_tiler[:2],
            tcgen05.OperandSource.TMEM)

        sQ_layout = sm100_helpers.make_smem_layout_a(mma_qk, self.qk_tiler, self.dtype, 2)
        sK_layout = sm100_helpers.make_smem_layout_b(mma_qk, self.qk_tiler, self.dtype,
                                                     self.num_stages)
        sV_layout = sm100_helpers.make_smem_layout_b(mma_pv, self.pv_tiler, self.dtype,
                                                     self.num_stages)
        tP_layout = sm100_helpers.make_smem_layout_a(mma_pv, self.pv_tiler, self.dtype, 1)

        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (mma_qk.thr_id.shape,))
        g2s = cpasync.CopyBulkTensorTileG2SOp(one_sm)
        one_q = cute.select(sQ_layout, mode=[0, 1, 2])
        one_k = cute.select(sK_layout, mode=[0, 1, 2])
        one_v = cute.select(sV_layout, mode=[0, 1, 2])
        tma_q, tQ = cute.nvgpu.make_tiled_tma_atom_A(g2s, q, one_q, self.qk_tiler, mma_qk,
                                                     cluster_vmnk.shape)
        tma_k, tK = cute.nvgpu.make_tiled_tma_atom_B(g2s, k, one_k, self.qk_tiler, mma_qk,
                                                     cluster_vmnk.shape)
        tma_v, tV = cute.nvgpu.make_tiled_tma_atom_B(g2s, v, one_v, self.pv_tiler, mma_pv,
                                                     cluster_vmnk.shape)
        self.tx_q = cute.size_in_bytes(self.dtype, one_q)
        self.tx_k = cute.size_in_bytes(self.dtype, one_k)
        self.tx_v = cute.size_in_bytes(self.dtype, one_v)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            mbar_vec: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            mbar_o: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            tmem_addr: Int32
            sVec: cute.struct.Align[cute.struct.MemRange[Float32, 2 * _VEC_SLOTS * SUB_M], 16]
            sQ: smem_buffer(self.dtype, sQ_layout)
            sK: smem_buffer(self.dtype, sK_layout)
            sV: smem_buffer(self.dtype, sV_layout)

        self.shared_storage = SharedStorage

        num_m = cute.ceil_div(q.shape[0], CTA_M)
        kernel = self.kernel(
            mma_qk, mma_pv, tma_q, tQ, tma_k, tK, tma_v, tV, o, lse, row_max, softmax_scale,
            blocks, aux_tensors, aux_scalars, sQ_layout, sK_layout, sV_layout, tP_layout,
        )
        launch(kernel, [num_m, mQ.shape[1], mQ.shape[0]], stream)

    # -----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma,
        tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
        tma_v: cute.CopyAtom, mV: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mMax: Optional[cute.Tensor],
        softmax_scale: Float32, blocks: Optional[BlockSparse256],
        aux_tensors: Optional[tuple], aux_scalars: Optional[tuple],
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
    ):
        """The operands' layouts: ``common``'s docstring. Smem: sQ ((MMA), MMA_M, MMA_K, 2),
        sK and sV ((MMA), MMA_N, MMA_K, stages); tP: P as the PV A operand, in TMEM."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == LOAD_WARP:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(self.shared_storage)
        pipes = self._make_pipelines(storage)
        tmem = tmem_allocator(storage, _CORRECTION_WARP0, 32 * (3 * 4 + 1))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sVec = storage.sVec.get_tensor(cute.make_layout((SUB_M, _VEC_SLOTS, 2)))
        aux = kernel_aux(aux_tensors, aux_scalars)

        if warp_idx < _CORRECTION_WARP0:
            cute.arch.setmaxregister_increase(_SOFTMAX_REGS)
            t_ptr = tmem_address(tmem)
            # Each role computes the schedule itself: values live across setmaxnreg spill.
            sched = self._schedule(mO, mK, blocks)
            # One copy of the softmax code for both sub-tiles (t is a runtime value).
            t = cute.arch.make_warp_uniform(warp_idx // 4)
            self.softmax(t, mma_qk, mma_pv, t_ptr, tP_layout, pipes, sVec, sched, softmax_scale,
                         aux)
        elif warp_idx < MMA_WARP:
            cute.arch.setmaxregister_decrease(_CORRECTION_REGS)
            tmem.allocate(TMEM_COLUMNS)
            t_ptr = tmem_address(tmem)
            sched = self._schedule(mO, mK, blocks)
            self.correction(mma_pv, t_ptr, pipes, sVec, sched, mO, mLSE, mMax, softmax_scale)
            # The correction warpgroup is the last user of TMEM (the softmax's last P store and
            # the MMA warp's last PV completed before its final waits); all four of its warps
            # must be done reading O before warp 8 frees it.
            free_tmem(tmem, t_ptr, 128)
        else:
            cute.arch.setmaxregister_decrease(_OTHER_REGS)
            if warp_idx == MMA_WARP:
                t_ptr = tmem_address(tmem)
                sched = self._schedule(mO, mK, blocks)
                self.mma(mma_qk, mma_pv, t_ptr, tP_layout, sQ, sK, sV, pipes, sched)
            elif warp_idx == LOAD_WARP:
                sched = self._schedule(mO, mK, blocks)
                self.load(mma_qk, mma_pv, tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipes,
                          sched)

    def _make_pipelines(self, storage):
        """See the module docstring for what each pipeline's phases mean."""
        pipe_q, pipe_k, pipe_v = tma_pipelines(
            1, (storage.mbar_q, 2, self.tx_q), (storage.mbar_k, self.num_stages, self.tx_k),
            (storage.mbar_v, self.num_stages, self.tx_v), create=pipeline.PipelineTmaUmma.create)
        warp, wg = thread_group(1), thread_group(128)
        # One stage per sub-tile: stage t is sub-tile t's. The MMA warp and the correction
        # warpgroup serve the sub-tiles in turn (their states advance by one), each softmax
        # warpgroup only its own stage (its states start at t and advance by two).
        pipe_s = group_pipeline(pipeline.PipelineUmmaAsync.create, storage.mbar_s, 2, warp, wg)
        pipe_vec = group_pipeline(pipeline.PipelineAsync.create, storage.mbar_vec, 2, wg, wg)
        pipe_o = group_pipeline(pipeline.PipelineAsyncUmma.create, storage.mbar_o, 2, wg, warp)
        return _Pipes(pipe_q, pipe_k, pipe_v, pipe_s, pipe_vec, pipe_o)

    # -----------------------------------------------------------------------------------------
    # Scheduling
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def _schedule(self, mO: cute.Tensor, mK: cute.Tensor, blocks: Optional[BlockSparse256]):
        """This CTA's tile (grid: 256-row tiles × query heads × batch) and its kv tiles."""
        m_block, head, batch = cute.arch.block_idx()
        seqlen_k = mK.shape[0]
        n = cute.ceil_div(seqlen_k, TILE_N)
        idx_row = None
        kind_row = None
        if const_expr(self.sparse):
            n = count_of(blocks.num, batch, head, m_block)
            idx_row = row_of(blocks.indices, batch, head, m_block)
            kind_row = row_of(blocks.kinds, batch, head, m_block)
        return _Sched(m_block, head, batch, n, idx_row, kind_row, mO.shape[0], seqlen_k)

    @cute.jit
    def _kv_tile(self, sched: _Sched, j: Int32) -> Int32:
        tile = j
        if const_expr(self.sparse):
            tile = sched.idx_row[j]
        return tile

    # -----------------------------------------------------------------------------------------
    # Load warp
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def load(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, tma_q: cute.CopyAtom,
             tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, mQ: cute.Tensor, mK: cute.Tensor,
             mV: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, pipes: "_Pipes",
             sched: _Sched):
        """Q0, K(0), Q1, then K(j) and V(j-1) for j = 1..n-1, then V(n-1): the order the MMA
        warp consumes them. Nothing is loaded for an empty row of blocks (n = 0)."""
        thr_qk = mma_qk.get_slice(0)
        thr_pv = mma_pv.get_slice(0)
        n_hq = mQ.shape[2][0]
        hb_q = (sched.head, sched.batch)
        group = n_hq // mK.shape[2][0]
        hb_kv = (sched.head // group, sched.batch)
        tQsQ, tQgQ = tma_operand(tma_q, thr_qk.partition_A, mQ,
                                 cute.select(self.qk_tiler, mode=[0, 2]), sQ)
        tKsK, tKgK = tma_operand(tma_k, thr_qk.partition_B, mK,
                                 cute.select(self.qk_tiler, mode=[1, 2]), sK)
        tVsV, tVgV = tma_operand(tma_v, thr_pv.partition_B, mV,
                                 cute.select(self.pv_tiler, mode=[1, 2]), sV)
        tQgQ = tQgQ[None, None, 0, hb_q]  # (TMA, 128-row blocks)
        tKgK = tKgK[None, None, 0, hb_kv]  # (TMA, kv tiles)
        tVgV = tVgV[None, 0, None, hb_kv]  # (TMA, kv tiles)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        if sched.n > 0:
            for t in cutlass.range_constexpr(2):
                pipes.q.producer_acquire(q_state)
                cute.copy(tma_q, tQgQ[None, 2 * sched.m_block + t], tQsQ[None, q_state.index],
                          tma_bar_ptr=pipes.q.producer_get_barrier(q_state))
                q_state.advance()
                if const_expr(t == 0):
                    pipes.k.producer_acquire(k_state)
                    cute.copy(tma_k, tKgK[None, self._kv_tile(sched, Int32(0))],
                              tKsK[None, k_state.index],
                              tma_bar_ptr=pipes.k.producer_get_barrier(k_state))
                    k_state.advance()
            prev = self._kv_tile(sched, Int32(0))
            for j in cutlass.range(1, sched.n, unroll=1):
                tile = self._kv_tile(sched, j)
                pipes.k.producer_acquire(k_state)
                cute.copy(tma_k, tKgK[None, tile], tKsK[None, k_state.index],
                          tma_bar_ptr=pipes.k.producer_get_barrier(k_state))
                k_state.advance()
                pipes.v.producer_acquire(v_state)
                cute.copy(tma_v, tVgV[None, prev], tVsV[None, v_state.index],
                          tma_bar_ptr=pipes.v.producer_get_barrier(v_state))
                v_state.advance()
                prev = tile
            pipes.v.producer_acquire(v_state)
            cute.copy(tma_v, tVgV[None, prev], tVsV[None, v_state.index],
                      tma_bar_ptr=pipes.v.producer_get_barrier(v_state))

    # -----------------------------------------------------------------------------------------
    # MMA warp
    # -----------------------------------------------------------------------------------------
    def _tmem_views(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, t_ptr, tP_layout):
        """S_t (fp32 accumulator), O_t (fp32 accumulator) and P_t (16-bit PV A operand, over the
        first half of S_t's columns) for t = 0, 1."""
        thr_qk = mma_qk.get_slice(0)
        thr_pv = mma_pv.get_slice(0)
        s_layout = thr_qk.make_fragment_C(thr_qk.partition_shape_C(self.qk_tiler[:2])).layout
        o_layout = thr_pv.make_fragment_C(thr_pv.partition_shape_C(self.pv_tiler[:2])).layout
        tS = [cute.make_tensor(t_ptr + self.tmem_s[t], s_layout) for t in range(2)]
        tO = [cute.make_tensor(t_ptr + self.tmem_o[t], o_layout) for t in range(2)]
        p_frag = thr_pv.make_fragment_A(
            cute.make_tensor(t_ptr, tP_layout.outer))[None, None, None, 0]
        tP = [cute.make_tensor(cute.recast_ptr(t_ptr + self.tmem_s[t], dtype=self.dtype),
                               p_frag.layout) for t in range(2)]
        return tS, tO, tP

    @cute.jit
    def _gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
              accumulate):
        """One tcgen05 GEMM over all k-blocks (issued by one thread; asynchronous). A fresh
        atom: its ACCUMULATE field is mutated, and the caller's TiledMma is shared by the
        warp roles (a value set inside one role's branch must not leak into another's)."""
        atom = cute.make_mma_atom(tiled_mma.op)
        for kb in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            atom.set(tcgen05.Field.ACCUMULATE, accumulate or kb != 0)
            cute.gemm(atom, acc, tA[None, None, kb], tB[None, None, kb], acc)

    @cute.jit
    def mma(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, t_ptr, tP_layout,
            sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, pipes: "_Pipes", sched: _Sched):
        """Issue order of the module docstring. Completion is signalled with tcgen05.commit:
        on S_t's full barrier after QK_t, on O_t's empty barrier after PV_t, on the K/V/Q
        stages' empty barriers after their last reader."""
        tS, tO, tP = self._tmem_views(mma_qk, mma_pv, t_ptr, tP_layout)
        thr_qk = mma_qk.get_slice(0)
        thr_pv = mma_pv.get_slice(0)
        tSrQ = thr_qk.make_fragment_A(sQ)
        tSrK = thr_qk.make_fragment_B(sK)
        tOrV = thr_pv.make_fragment_B(sV)
        if sched.n > 0:
            self._mma_tile(mma_qk, mma_pv, tS, tO, tP, tSrQ, tSrK, tOrV, pipes, sched)

    @cute.jit
    def _mma_tile(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, tS, tO, tP,
                  tSrQ: cute.Tensor, tSrK: cute.Tensor, tOrV: cute.Tensor, pipes: "_Pipes",
                  sched: _Sched):
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        o_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        q_first = q_state.clone()
        pipes.q.consumer_wait(q_state)
        q_state.advance()
        pipes.k.consumer_wait(k_state)
        for t in cutlass.range_constexpr(2):
            if const_expr(t == 1):
                pipes.q.consumer_wait(q_state)
            qi = q_first.index + t
            pipes.s.producer_acquire(s_state)
            tcgen05_fence(after=True)
            self._gemm(mma_qk, tS[t], tSrQ[None, None, None, qi],
                       tSrK[None, None, None, k_state.index], False)
            pipes.s.producer_commit(s_state)
            s_state.advance()
        pipes.k.consumer_release(k_state)
        k_state.advance()
        for j in cutlass.range(1, sched.n, unroll=1):
            pipes.k.consumer_wait(k_state)
            pipes.v.consumer_wait(v_state)
            for t in cutlass.range_constexpr(2):
                pipes.o.consumer_wait(o_state)
                tcgen05_fence(after=True)
                self._gemm(mma_pv, tO[t], tP[t], tOrV[None, None, None, v_state.index],
                           j > 1)
                pipes.o.consumer_release(o_state)
                o_state.advance()
                pipes.s.producer_acquire(s_state)
                tcgen05_fence(after=True)
                self._gemm(mma_qk, tS[t], tSrQ[None, None, None, q_first.index + t],
                           tSrK[None, None, None, k_state.index], False)
                pipes.s.producer_commit(s_state)
                s_state.advance()
            pipes.k.consumer_release(k_state)
            k_state.advance()
            pipes.v.consumer_release(v_state)
            v_state.advance()
        pipes.v.consumer_wait(v_state)
        for t in cutlass.range_constexpr(2):
            pipes.o.consumer_wait(o_state)
            tcgen05_fence(after=True)
            self._gemm(mma_pv, tO[t], tP[t], tOrV[None, None, None, v_state.index],
                       sched.n > 1)
            pipes.o.consumer_release(o_state)
            o_state.advance()
        pipes.v.consumer_release(v_state)
        pipes.q.consumer_release(q_first)
        pipes.q.consumer_release(q_state)

    # -----------------------------------------------------------------------------------------
    # Softmax warpgroups
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def softmax(self, t: Int32, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, t_ptr,
                tP_layout, pipes: "_Pipes", sVec: cute.Tensor, sched: _Sched,
                softmax_scale: Float32, aux: Aux):
        """Sub-tile t's rows, one per thread: per kv tile, S_t from TMEM to registers, the holes,
        an online-softmax step, P_t back to TMEM, then the row's factors to the correction."""
        tidx = cute.arch.thread_idx()[0] % 128
        # This sub-tile's S: TMEM columns 128·t .. 128·t + 127.
        tS, _, _ = self._tmem_views(mma_qk, mma_pv, t_ptr + t * (self.tmem_s[1] - self.tmem_s[0]),
                                    tP_layout)
        thr_qk = mma_qk.get_slice(0)
        tScS = thr_qk.partition_C(cute.make_identity_tensor(self.qk_tiler[:2]))
        # S is read in S_CHUNK-column pieces, each waited for and modded before the next is
        # read: the waits bound how far the compiler can hoist the mods' temporaries (with all
        # 128 scores' mask predicates live at once ptxas spilled).
        chunk_layout = cute.make_layout((SUB_M, S_CHUNK))
        tS_chunk = cute.make_tensor(tS[0].iterator, cute.composition(tS[0].layout, chunk_layout))
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(S_CHUNK)),
                                Float32), tS_chunk).get_slice(tidx)
        tTtS = [ld.partition_S(cute.make_tensor(tS_chunk.iterator + S_CHUNK * h, tS_chunk.layout))
                for h in range(TILE_N // S_CHUNK)]
        tTcS = ld.partition_D(cute.composition(tScS, chunk_layout))
        st_s = tcgen05.make_tmem_copy(  # the modded scores back to S_t (two-pass softmax)
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(S_CHUNK)),
                                Float32), tS_chunk).get_slice(tidx)
        tTtS_st = [st_s.partition_D(cute.make_tensor(tS_chunk.iterator + S_CHUNK * h,
                                                     tS_chunk.layout))
                   for h in range(TILE_N // S_CHUNK)]
        # P: 16-bit values two to a 32-bit column, over S_t's first TILE_N / 2 columns, written
        # in pieces of 32 columns (64 scores) so that only 32 registers of P live beside S.
        p_cols = TILE_N * self.dtype.width // 32
        tStP = cute.make_tensor(tS[0].iterator,
                                cute.composition(tS[0].layout, cute.make_layout((SUB_M, 32))))
        st = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            tStP).get_slice(tidx)
        tScP = cute.composition(tScS, cute.make_layout((SUB_M, 32)))
        p_shape = st.partition_S(tScP).shape
        tTtP = [st.partition_D(cute.make_tensor(tStP.iterator + 32 * h, tStP.layout))
                for h in range(p_cols // 32)]

        c = softmax.exp2_multiplier(self.score_mod, softmax_scale)
        row = 2 * sched.m_block * SUB_M + t * SUB_M + tTcS[0][0]
        row_max = -Float32.inf
        row_sum = Float32(0.0)
        row_peak = -Float32.inf
        scale = Float32(1.0)
        # Stage t of the two-stage pipelines, every other position (see _make_pipelines).
        s_state = pipeline.PipelineState(2, Int32(0), t, Int32(0))  # consumer
        v_state = pipeline.PipelineState(2, Int32(0), t, Int32(1))  # producer
        for j in cutlass.range(0, sched.n, unroll=1):
            tile = self._kv_tile(sched, j)
            kind = Int32(KIND_FULL)
            if const_expr(self.sparse):
                kind = (sched.kind_row[j] >> (2 * t)) & 3
            elif const_expr(self.mask_mod is not None):
                kind = Int32(KIND_PARTIAL)
            # The mask as bits, before S is waited for: the mask's own loads (document ids)
            # run under the QK GEMM and never sit in registers beside the 128 scores.
            w0 = w1 = w2 = w3 = cutlass.Uint32(0)
            if const_expr(self.mask_mod is not None and self.sparse):
                if kind == KIND_PARTIAL:
                    w0, w1, w2, w3 = self._mask_bits(tile, row, sched, aux)
            elif const_expr(self.mask_mod is not None):
                w0, w1, w2, w3 = self._mask_bits(tile, row, sched, aux)
            pipes.s.consumer_wait(s_state)
            tcgen05_fence(after=True)
            # One branch per kind around the whole step, so that no branch join has to merge
            # the 128 scores (merging them made ptxas spill hundreds of bytes).
            step = (ld, tTtS, tTcS, st_s, tTtS_st, st, tTtP, p_shape, c, tile, row, sched,
                    softmax_scale, aux, (w0, w1, w2, w3))
            crosses = (tile + 1) * TILE_N > sched.seqlen_k
            if const_expr(not self.sparse and self.mask_mod is not None):
                scale, row_max, row_sum, row_peak = self._step(
                    "partial", step, row_max, row_sum, row_peak)
            elif const_expr(not self.sparse):
                scale, row_max, row_sum, row_peak = self._unmasked_step(
                    crosses, step, row_max, row_sum, row_peak)
            else:
                if kind == KIND_PARTIAL:
                    scale, row_max, row_sum, row_peak = self._step(
                        "partial", step, row_max, row_sum, row_peak)
                elif kind == KIND_SKIP:
                    scale, row_max, row_sum, row_peak = self._step(
                        "skip", step, row_max, row_sum, row_peak)
                else:
                    scale, row_max, row_sum, row_peak = self._unmasked_step(
                        crosses, step, row_max, row_sum, row_peak)
            pipes.s.consumer_release(s_state)
            s_state.advance(2)
            pipes.vec.producer_acquire(v_state)
            sVec[tidx, 0, t] = scale
            sVec[tidx, 1, t] = row_sum
            sVec[tidx, 2, t] = row_max
            sVec[tidx, 3, t] = row_peak
            pipes.vec.producer_commit(v_state)
            v_state.advance(2)

    @cute.jit
    def _unmasked_step(self, crosses, step: tuple, row_max: Float32, row_sum: Float32,
                       row_peak: Float32):
        """``_step`` on a tile without mask_mod work: "bounded" where it ``crosses`` S, "full"
        elsewhere (one branch around each whole step, as in the caller)."""
        scale = Float32(1.0)
        if crosses:
            scale, row_max, row_sum, row_peak = self._step("bounded", step, row_max, row_sum, row_peak)
        else:
            scale, row_max, row_sum, row_peak = self._step("full", step, row_max, row_sum, row_peak)
        return scale, row_max, row_sum, row_peak

    @cute.jit
    def _step(self, kind: cutlass.Constexpr, step: tuple, row_max: Float32, row_sum: Float32,
              row_peak: Float32):
        """One online-softmax step of one row over kv tile ``tile``; returns (the factor O must
        be rescaled by, new max, new sum, new true max). ``kind``: "partial" (score_mod,
        mask_mod and the kv < S bound), "bounded" (a full tile that crosses S: score_mod and the
        bound), "full" (score_mod only), "skip" (a block this sub-tile does not visit: P = 0)."""
        (ld, tTtS, tTcS, st_s, tTtS_st, st, tTtP, p_shape, c, tile, row, sched, softmax_scale,
         aux, bits) = step
        per_col = 32 // self.dtype.width
        scale = Float32(1.0)
        if const_expr(kind == "skip"):
            for h in cutlass.range_constexpr(len(tTtP)):
                rP32 = cute.make_rmem_tensor(p_shape, Float32)
                rP32.fill(0.0)  # two 16-bit zeros
                cute.copy(st, rP32, tTtP[h])
        elif const_expr(self.cfg.score_loads):
            scale, row_max, row_sum, row_peak = self._two_pass(kind, step, row_max, row_sum,
                                                               row_peak)
        else:
            chunks = []
            for h in cutlass.range_constexpr(len(tTtS)):
                rS = cute.make_rmem_tensor(tTcS.shape, Float32)
                cute.copy(ld, tTtS[h], rS)
                cute.arch.fence_view_async_tmem_load()
                if const_expr(kind != "full" or self.score_mod is not None):
                    use_bits = kind == "partial" and self.mask_mod is not None
                    self._apply(rS, tTcS, tile * TILE_N, S_CHUNK * h, row, sched,
                                softmax_scale, aux, bits if use_bits else None,
                                kind != "full" and not use_bits)
                chunks.append(rS)
            values = [x[i] for x in chunks for i in range(cute.size(x))]
            blk_max = tree(values, cute.arch.fmax)
            if const_expr(self.write_max):
                row_peak = cute.arch.fmax(row_peak, blk_max)
            scale, row_max = softmax.max_step(blk_max, row_max, c, self.rescale_threshold)
            bias = softmax.exp2_bias(row_max, c)
            for rS in chunks:
                for i in cutlass.range_constexpr(cute.size(rS)):
                    rS[i] = cute.math.exp2(cute.fma(rS[i], c, -bias), fastmath=True)
            row_sum = row_sum * scale + tree(
                [x[i] for x in chunks for i in range(cute.size(x))], fadd)
            # P piece h (32 columns) holds the scores of S chunks h·per_piece .. + per_piece - 1.
            per_piece = 32 * per_col // S_CHUNK
            for h in cutlass.range_constexpr(len(tTtP)):
                rP32 = cute.make_rmem_tensor(p_shape, Float32)
                rP = cute.recast_tensor(rP32, self.dtype)
                for q in cutlass.range_constexpr(per_piece):
                    part = cute.make_tensor(rP.iterator + S_CHUNK * q, cute.make_layout(S_CHUNK))
                    part.store(chunks[h * per_piece + q].load().to(self.dtype))
                cute.copy(st, rP32, tTtP[h])
        cute.arch.fence_view_async_tmem_store()
        tcgen05_fence(after=False)  # P and the reads of S, before the arrives that publish them
        return scale, row_max, row_sum, row_peak

    @cute.jit
    def _two_pass(self, kind: cutlass.Constexpr, step: tuple, row_max: Float32,
                  row_sum: Float32, row_peak: Float32):
        """``_step`` for a score_mod that loads per element. Pass 1, chunk by chunk: mods, the
        row max, the modded chunk written back to S_t. Pass 2: exp2, the row sum and P, each
        P piece written over S columns this pass has already read. Only a chunk of scores is
        live at a time, so the score_mod's loads (which ptxas hoists across chunks) fit."""
        (ld, tTtS, tTcS, st_s, tTtS_st, st, tTtP, p_shape, c, tile, row, sched, softmax_scale,
         aux, bits) = step
        per_col = 32 // self.dtype.width
        use_bits = kind == "partial" and self.mask_mod is not None
        blk_max = -Float32.inf
        for h in cutlass.range_constexpr(len(tTtS)):
            rS = cute.make_rmem_tensor(tTcS.shape, Float32)
            cute.copy(ld, tTtS[h], rS)
            cute.arch.fence_view_async_tmem_load()
            self._apply(rS, tTcS, tile * TILE_N, S_CHUNK * h, row, sched, softmax_scale, aux,
                        bits if use_bits else None, kind != "full" and not use_bits)
            blk_max = cute.arch.fmax(
                blk_max, tree([rS[i] for i in range(cute.size(rS))], cute.arch.fmax))
            cute.copy(st_s, rS, tTtS_st[h])
        cute.arch.fence_view_async_tmem_store()  # pass 2 reads what pass 1 wrote
        if const_expr(self.write_max):
            row_peak = cute.arch.fmax(row_peak, blk_max)
        scale, row_max = softmax.max_step(blk_max, row_max, c, self.rescale_threshold)
        bias = softmax.exp2_bias(row_max, c)
        blk_sum = Float32(0.0)
        per_piece = 32 * per_col // S_CHUNK
        for h in cutlass.range_constexpr(len(tTtP)):
            rP32 = cute.make_rmem_tensor(p_shape, Float32)
            rP = cute.recast_tensor(rP32, self.dtype)
            for q in cutlass.range_constexpr(per_piece):
                rS = cute.make_rmem_tensor(tTcS.shape, Float32)
                cute.copy(ld, tTtS[h * per_piece + q], rS)
                cute.arch.fence_view_async_tmem_load()
                for i in cutlass.range_constexpr(cute.size(rS)):
                    rS[i] = cute.math.exp2(cute.fma(rS[i], c, -bias), fastmath=True)
                blk_sum = blk_sum + tree([rS[i] for i in range(cute.size(rS))], fadd)
                part = cute.make_tensor(rP.iterator + S_CHUNK * q, cute.make_layout(S_CHUNK))
                part.store(rS.load().to(self.dtype))
            cute.copy(st, rP32, tTtP[h])
        return scale, row_max, row_sum * scale + blk_sum, row_peak

    @cute.jit
    def _mask_bits(self, tile: Int32, row: Int32, sched: _Sched, aux: Aux):
        """mask_mod and the kv < S bound of this row over kv tile ``tile``, as TILE_N / 32 words
        (``mask_word``): bit i of word w keeps column 32·w + i."""
        kv0 = tile * TILE_N
        w0 = w1 = w2 = w3 = cutlass.Uint32(0)
        for w in cutlass.range(TILE_N // 32, unroll=1):
            word = mask_word(self.mask_mod, sched.batch, sched.head, row, kv0 + 32 * w,
                             sched.seqlen_k, aux, True)
            w0 = word if w == 0 else w0
            w1 = word if w == 1 else w1
            w2 = word if w == 2 else w2
            w3 = word if w == 3 else w3
        return w0, w1, w2, w3

    @cute.jit
    def _apply(self, rS: cute.Tensor, tTcS: cute.Tensor, kv_base: Int32, col0: cutlass.Constexpr,
               row: Int32, sched: _Sched, softmax_scale: Float32, aux: Aux, bits,
               use_bound: cutlass.Constexpr):
        """The holes on one chunk of a row of S, columns col0 + tTcS[i][1] of the tile at
        kv_base: score_mod, then the mask from ``bits`` (``_mask_bits``; None: no mask_mod) or,
        with ``use_bound``, the kv < S bound alone, comparing each register's compile-time
        column with one limit (128 live kv_idx registers spilled the masked variants)."""
        indices = FloatIndices(row, kv_base + col0 + tTcS[0][1])
        neg_inf = -Float32.inf
        limit = sched.seqlen_k - kv_base
        score_mod = bind(self.score_mod, sched.batch, sched.head, aux)
        for i in cutlass.range_constexpr(cute.size(rS)):
            col = col0 + tTcS[i][1]
            s = rS[i]
            if const_expr(self.score_mod is not None):
                kv_idx = kv_base + col
                s = score_mod(s * softmax_scale, sched.batch, sched.head, row, kv_idx, aux,
                              *indices.args(self.score_mod, row, kv_idx))
            if const_expr(bits is not None):
                s = where(kept(bits, col), s, neg_inf)
            elif const_expr(use_bound):
                s = where(col < limit, s, neg_inf)
            rS[i] = s

    # -----------------------------------------------------------------------------------------
    # Correction warpgroup: O rescale in TMEM, then the epilogue
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def correction(self, mma_pv: cute.TiledMma, t_ptr, pipes: "_Pipes", sVec: cute.Tensor,
                   sched: _Sched, mO: cute.Tensor, mLSE: cute.Tensor, mMax: Optional[cute.Tensor],
                   softmax_scale: Float32):
        """Per kv step j and sub-tile t: take row j's factors from softmax t, wait until
        PV_t(j-1) has completed (the acquire of ``pipe_o[t]``), rescale O_t where a row's max
        moved, hand O_t to the MMA warp. After the last step: wait for the last PV_t, normalise
        and store."""
        tidx = cute.arch.thread_idx()[0] % 128
        thr_pv = mma_pv.get_slice(0)
        o_layout = thr_pv.make_fragment_C(thr_pv.partition_shape_C(self.pv_tiler[:2])).layout
        chunk = 16
        tO_chunk = [cute.make_tensor(t_ptr + self.tmem_o[t],
                                     cute.composition(o_layout, cute.make_layout((SUB_M, chunk))))
                    for t in range(2)]
        cO = cute.composition(thr_pv.partition_C(cute.make_identity_tensor(self.pv_tiler[:2])),
                              cute.make_layout((SUB_M, chunk)))
        ld = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(chunk)), Float32), tO_chunk[0]
        ).get_slice(tidx)
        st = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(chunk)), Float32), tO_chunk[0]
        ).get_slice(tidx)
        tTcO = ld.partition_D(cO)
        n_chunks = self.head_dim_v // chunk
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        o_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        for j in cutlass.range(0, sched.n, unroll=1):
            for t in cutlass.range_constexpr(2):
                pipes.vec.consumer_wait(v_state)
                scale = sVec[tidx, 0, t]
                pipes.vec.consumer_release(v_state)
                v_state.advance()
                pipes.o.producer_acquire(o_state)
                tcgen05_fence(after=True)
                if j > 0:
                    if cute.arch.vote_any_sync(scale < 1.0):
                        for ci in cutlass.range_constexpr(n_chunks):
                            src = cute.make_tensor(tO_chunk[t].iterator + ci * chunk,
                                                   tO_chunk[t].layout)
                            tTtO = ld.partition_S(src)
                            rO = cute.make_rmem_tensor(tTcO.shape, Float32)
                            cute.copy(ld, tTtO, rO)
                            cute.arch.fence_view_async_tmem_load()
                            for i in cutlass.range_constexpr(cute.size(rO)):
                                rO[i] = rO[i] * scale
                            cute.copy(st, rO, st.partition_D(src))
                        cute.arch.fence_view_async_tmem_store()
                tcgen05_fence(after=False)
                pipes.o.producer_commit(o_state)
                o_state.advance()
        for t in cutlass.range_constexpr(2):
            # The last step's running sum and max are the final ones (zero steps: the softmax
            # never wrote them, and the epilogue ignores them).
            row_sum = Float32(0.0)
            row_max = -Float32.inf
            row_peak = -Float32.inf
            if sched.n > 0:
                row_sum = sVec[tidx, 1, t]
                row_max = sVec[tidx, 2, t]
                row_peak = sVec[tidx, 3, t]
                pipes.o.producer_acquire(o_state)  # the last PV_t has completed
                o_state.advance()
                tcgen05_fence(after=True)
            self._epilogue(t, ld, tO_chunk[t], tTcO, n_chunks, chunk, row_sum, row_max,
                           row_peak, sched, mO, mLSE, mMax, softmax_scale, tidx)

    @cute.jit
    def _epilogue(self, t: cutlass.Constexpr, ld, tO_chunk: cute.Tensor, tTcO: cute.Tensor,
                  n_chunks: cutlass.Constexpr, chunk: cutlass.Constexpr, row_sum: Float32,
                  row_max: Float32, row_peak: Float32, sched: _Sched, mO: cute.Tensor,
                  mLSE: cute.Tensor, mMax: Optional[cute.Tensor], softmax_scale: Float32,
                  tidx: Int32):
        """O_t / rowsum to global memory from registers (this thread's row, 16-byte stores),
        LSE (and max_scores). Rows >= L are skipped; an empty row (n = 0, or every key masked)
        gives O = 0 and LSE = -inf."""
        c = softmax.exp2_multiplier(self.score_mod, softmax_scale)
        inv, lse = softmax.finalize(row_sum, row_max, c)
        row = 2 * sched.m_block * SUB_M + t * SUB_M + tTcO[0][0]
        in_bounds = row < sched.seqlen_q
        # tcgen05.ld is warp-collective (.sync.aligned): every lane loads, whatever its row;
        # only the global stores are predicated. A clamped row keeps the address valid.
        gO = mO[cutlass.max(cutlass.min(row, sched.seqlen_q - 1), 0), None, sched.head,
                sched.batch]  # (Dv,), contiguous
        for ci in cutlass.range_constexpr(n_chunks):
            rO = cute.make_rmem_tensor(tTcO.shape, Float32)
            if sched.n > 0:
                src = cute.make_tensor(tO_chunk.iterator + ci * chunk, tO_chunk.layout)
                cute.copy(ld, ld.partition_S(src), rO)
                cute.arch.fence_view_async_tmem_load()
            else:
                rO.fill(0.0)
            for i in cutlass.range_constexpr(cute.size(rO)):
                rO[i] = rO[i] * inv
            rOut = cute.make_rmem_tensor(cute.make_layout(chunk), self.dtype)
            rOut.store(rO.load().to(self.dtype))
            if in_bounds:
                cute.autovec_copy(rOut, cute.local_tile(gO, (chunk,), (ci,)))
        if in_bounds:
            mLSE[row, sched.head, sched.batch] = lse
            if const_expr(self.write_max):
                peak = row_peak
                if const_expr(self.score_mod is None):
                    peak = peak if peak == -Float32.inf else peak * softmax_scale
                mMax[row, sched.head, sched.batch] = peak


@dataclass(frozen=True)
class _Pipes:
    """The kernel's pipelines (a frozen dataclass: the DSL does not carry it through loops)."""

    q: object
    k: object
    v: object
    s: object  # 2 stages: stage t is sub-tile t's
    vec: object
    o: object


# ---------------------------------------------------------------------------------------------
# Host API (TVM-FFI only: compile against placeholders, call with torch tensors)
# ---------------------------------------------------------------------------------------------
def _placeholder_args(cfg: FwdConfig, aux_tensors, aux_scalars) -> tuple:
    q, k, v, o = [placeholder(cfg.dtype, 4, 16, 8) for _ in range(4)]  # TMA: 16 B, 8 elems
    lse = placeholder(Float32, 3, 4)
    blocks = None
    if cfg.has_block_mask:
        blocks = BlockSparse256(*[placeholder(Int32, n, 4) for n in (3, 4, 4)])
    row_max = placeholder(Float32, 3, 4) if cfg.write_max else None
    return (q, k, v, o, lse, Float32(1.0), blocks, *host.aux_placeholders(aux_tensors, aux_scalars),
            row_max)


class CompiledFwd(host.CompiledFwd):
    """A compiled sm100 forward; ``__call__`` launches it through TVM-FFI on torch's current
    stream (never exercised: no Blackwell GPU has run it)."""

    def __call__(self, q, k, v, o, lse, softmax_scale: float, blocks=None, aux_tensors=(),
                 aux_scalars=(), max_scores=None):
        """``blocks``: the three tensors of ``cute_sm100.sm100_block_lists`` (or None)."""
        if self.ffi_fn is None:
            raise RuntimeError(f"this sm100 forward was compiled for {GPU_ARCH} in a process that "
                               "cannot launch it (CUTE_DSL_ARCH differs): compile-only")
        self.check_max_scores(max_scores)
        if (blocks is not None) != self.cfg.has_block_mask:
            raise ValueError("block lists must be given exactly when compiled with a block mask")
        lists = None if blocks is None else BlockSparse256(*[t.contiguous() for t in blocks])
        self.ffi_fn(q, k, v, o, lse, float(softmax_scale), lists,
                    *host.aux_args(aux_tensors, aux_scalars), max_scores)
        return o, lse


def compile_fwd(cfg: FwdConfig, q, aux_tensors=(), aux_scalars=(),
                options: str = "") -> CompiledFwd:
    """Compile for these input kinds (dtype from ``q``; sizes and strides stay runtime values).
    Always targets ``GPU_ARCH`` (a CPU-only machine needs no CUTE_DSL_ARCH); read
    ``result.compiled.__ptx__`` with ``options='--keep-ptx'`` (a path to the dumped file when
    ``--dump-dir`` is given)."""
    host.require_tvm_ffi("cute_sm100_fwd")
    if host.cutlass_dtype(q.dtype, "cute_sm100_fwd") is not cfg.dtype:
        raise TypeError("q dtype does not match the config")
    compiled = cute.compile(FlexAttentionFwdSm100(cfg),
                            *_placeholder_args(cfg, aux_tensors, aux_scalars), host.env_stream(),
                            options=host.compile_options(options, GPU_ARCH))
    return CompiledFwd(cfg, compiled, host.aux_signature(aux_tensors, aux_scalars),
                       host.launcher(compiled))
