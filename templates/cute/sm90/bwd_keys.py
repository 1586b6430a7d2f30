"""The sm90 backward for head dims (192, 192) and (192, 128) on a 96-key tile (``BWD_CONFIG``
"keys96"; FlashAttention-3's schedule for these head dims).

What this module holds
----------------------
``FlexAttentionBwdKeysSm90``: the main kernel, a ``bwd.FlexAttentionBwdSm90`` whose Q-tile body,
GEMM shapes and epilogue differ; the producer warp, the dQ writer warps and their boxes, the row
statistics, the mods' element loop (``_probabilities``, ``_form_ds``), the q-list walk and the
dK/dV stores are the base class's. The pre/postprocess kernels are the 64-key tile's.

Why 96 keys
-----------
The 64-key tile (``choose_bwd_tiling``'s D = 192 row) streams Q and dO once per 64 keys and
reduce-adds dQ once per 64 keys. A 128-key tile does not fit: a warpgroup's dKᵀ and dVᵀ for 64
keys would be D/2 + Dv/2 = 192 registers a thread before S and dP. 96 keys, split 48 a
warpgroup, hold dKᵀ 72 + dVᵀ 72 (48 at Dv = 128), S 24 and dP 24 registers a thread; dQ (48)
is formed once S and dP are dead.

Per Q tile of 64 rows, in MMA warpgroup w (keys 48w .. 48w + 47 of the tile)::

    S = Q Kᵀ        (m64n48, SS; not swapped: queries are M)      [dP = dO Vᵀ likewise]
    wait S: mods, P = exp2(..) -> P (bf16) -> sP[:, own keys] (stmatrix), named barrier
    dVᵀ += dOᵀ P    (M = Dv, N = own 48 keys, K = 64 rows; A = dO read MN-major, B = sP)
    wait dP: dS = P∘dscore∘(dP − delta) -> sdS[:, own keys], barrier of both warpgroups
    dQ = dS K       (M = 64 rows, N = the warpgroup's D/2 head dims, K = all 96 keys; SS)
    dKᵀ += Qᵀ dS    (as dV; A = Q read MN-major, B = sdS)
    wait dQ: -> the warpgroup's dQ box (the base class's writer warps reduce-add it) under dK

Stages: Q (+ lse2) ``BwdTiling.num_stages`` (2), dO (+ delta) one at Dv = 192 and two at 128
(``do_stages``), P and dS one each: Q 48 KB, dO 24 (2 × 16), K 36, V 36 (24), P 12, dS 12, dQ
boxes 48, the barriers and row statistics: 218 KB (214 KB at Dv = 128).
Why one dS stage suffices: a warpgroup writes tile m+1's dS only after the other one has
finished tile m (whose dQ GEMM read all of dS). With one dO stage, waiting for tile m+1's dO
says so: the producer loads it only once both warpgroups released tile m's dO, which each does
after its dQ GEMM completed. With two, the barrier before the dV GEMM spans both warpgroups
instead of one. P is read by its own warpgroup only, which waits for all of its GEMMs before
the next tile.

Smem atoms: K's are 32 columns (the dQ GEMM reads it MN-major split at D/2 = 96); sP and sdS
(64 × 96) take 16-column atoms (dK/dV read them MN-major split at 48 keys); Q, dO and V keep
the atoms of their full widths (the dKᵀ/dVᵀ GEMMs read Q and dO MN-major in 64-row M blocks).

Block lists: a 96-key tile straddles 128-key mask blocks (4 tiles = 3 blocks), so the host
passes q lists per 96-key tile (``flexjit.planner.block_mask.tile_q_lists``); the kernel reads
tile n's column as the 128-key kernel reads a mask block's. Deterministic mode and captured-
tensor gradients are the 64-key kernel's (the backend routes them there).
"""

from collections import namedtuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp

from flexjit.templates.cute import softmax
from flexjit.templates.cute.block_sparse import listed_tile
from flexjit.templates.cute.common import launch, permute, smem_buffer, smem_layout, wgmma_gemm
from flexjit.templates.cute.opaque import opaque_smem, opaque_thread_idx
from flexjit.templates.cute.sm90.bwd import (_BAR_MMA, _BAR_WG, BwdConfig, FlexAttentionBwdSm90,
                                             _transposed_2d)
from flexjit.templates.cute.sm90.bwd_atoms import dq_atom, load_atoms
from flexjit.templates.cute.sm90.bwd_rows import row_values
from flexjit.templates.cute.sm90.dq import dq_box_view, dq_smem_layout, k_atom_cols

# Keys per CTA (``BwdTiling.tile_n`` of the "keys96" variant).
KEY_TILE = 96
# The sdS buffer's stages: dS, then P.
_DS, _P = 0, 1


def _single_stage(state, first_phase: int):
    """The one-stage dO pipeline's state after as many tiles as ``state`` (the Q pipeline's)
    has counted: the only stage, the phase flipped once a tile (``first_phase``: 1 for the
    producer, 0 for the consumers, as ``make_pipeline_state`` starts them)."""
    return pipeline.PipelineState(1, state.count, Int32(0), Int32(first_phase) ^ (state.count % 2))


class FlexAttentionBwdKeysSm90(FlexAttentionBwdSm90):
    """The backward main kernel on 64 × 96 tiles (see the module docstring)."""

    def __init__(self, cfg: BwdConfig):
        super().__init__(cfg)
        assert self.tile_n == KEY_TILE and self.tile_m == 64 and self.head_dim == 192
        assert self.dq_split == "cols" and not self.dq_swapped and self.head_dim_v in (128, 192)
        # The backend routes these to the 64-key kernel (``backends.cute.sm90.keys96_refusal``).
        assert not self.deterministic and self.score_grads is None
        assert not (self.p_late or self.p_smem or self.dk_smem or self.shuffle_stats or self.lpt_section)
        # dO (+ delta) stages: two where they fit beside Q's two (Dv = 128: 214 KB), else one.
        self.do_stages = 2 if self.head_dim_v <= 128 else 1
        assert self.do_stages in (1, self.num_stages)

    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mLSE2, mDelta, mdQacc, mdK, mdV, softmax_scale: Float32,
                 q_per_kv: Int32, qblocks, qorder, mSem, aux_tensors, aux_scalars, grad_accs,
                 stream):
        """The base class's arguments (q lists per 96-key tile; ``qorder``, ``mSem`` and
        ``grad_accs`` unused)."""
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype):
            raise TypeError("q/k dtype does not match the config")
        q, k, v, do, dk, dv, dqacc = [permute(t, [2, 3, 1, 0])
                                      for t in (mQ, mK, mV, mdO, mdK, mdV, mdQacc)]
        lse2, delta = [permute(t, [2, 1, 0]) for t in (mLSE2, mDelta)]
        D, Dv, tm, tn, st = self.head_dim, self.head_dim_v, self.tile_m, self.tile_n, self.num_stages
        sQ_layout = smem_layout(self.dtype, tm, D, st)
        sdO_layout = smem_layout(self.dtype, tm, Dv, self.do_stages)
        sK_layout = smem_layout(self.dtype, tn, D, atom_cols=k_atom_cols(D, "cols"))
        sV_layout = smem_layout(self.dtype, tn, Dv)
        # dS and P (``_DS``, ``_P``), 16-column atoms: the dK/dV GEMMs split their keys at 48.
        sdS_layout = smem_layout(self.dtype, tm, tn, 2, atom_cols=tn // 2)
        sdQ_layout = dq_smem_layout(*self.dq_box)
        self.row_pitch = -(-tm // 32) * 32
        sRow_layout = cute.make_layout((tm, st), stride=(1, self.row_pitch))

        (tma_q, tQ), (tma_do, tdO), (tma_k, tK), (tma_v, tV), (tma_lse, tLSE), (tma_delta, tDelta) = \
            load_atoms(self, q, k, v, do, lse2, delta, sQ_layout, sdO_layout, sK_layout, sV_layout)
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        tma_dk, tdK = cpasync.make_tiled_tma_atom(s2g, dk, sK_layout, (tn, D))
        tma_dv, tdV = cpasync.make_tiled_tma_atom(s2g, dv, sV_layout, (tn, Dv))
        tma_dq, tdQ = dq_atom(dqacc, sdQ_layout, self.dq_box)

        K_MAJOR, MN_MAJOR = OperandMajorMode.K, OperandMajorMode.MN
        wg_tile = (64, tn // 2)  # one warpgroup's 48 keys
        # S = Q Kᵀ and dP = dO Vᵀ: queries along M, the warpgroups split the keys (N).
        mma_sdp = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, (1, 2, 1), wg_tile)
        # dKᵀ += Qᵀ dS, dVᵀ += dOᵀ P: head dims along M (64-row blocks), the warpgroup's keys
        # along N, the query rows along K; Qᵀ/dOᵀ and dS/P read MN-major from smem.
        mma_dkv = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (1, 2, 1), wg_tile)
        # dQ = dS K: all 96 keys along K, the warpgroups split the head dims (N).
        mma_dq = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (1, 2, 1), (64, self.dq_box[1]))

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * st]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.do_stages]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.row_pitch * st], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, self.row_pitch * st], 128]
            sQ: smem_buffer(self.dtype, sQ_layout)
            sdO: smem_buffer(self.dtype, sdO_layout)
            sK: smem_buffer(self.dtype, sK_layout)
            sV: smem_buffer(self.dtype, sV_layout)
            sdS: smem_buffer(self.dtype, sdS_layout)
            sdQ: smem_buffer(Float32, sdQ_layout)

        self.shared_storage = SharedStorage
        num_b = q.shape[3] if const_expr(self.kv_batch_broadcast) else k.shape[3]
        launch(self.kernel(
            tQ, tK, tV, tdO, tLSE, tDelta, tdQ, tdK, tdV,
            tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta, tma_dq, tma_dk, tma_dv,
            mma_sdp, mma_dkv, mma_dkv, mma_dq, softmax_scale, q_per_kv, qblocks, qorder, mSem,
            aux_tensors, aux_scalars, grad_accs,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout, sRow_layout,
        ), [self._num_kv_tiles(k.shape[0]), k.shape[2], num_b], self.num_threads, stream)

    def _do_state(self, state, first_phase: int):
        """The dO pipeline's state for the Q pipeline's ``state``: the same with as many
        stages, else the one stage's (``_single_stage``)."""
        if const_expr(self.do_stages == self.num_stages):
            return state
        return _single_stage(state, first_phase)

    # -----------------------------------------------------------------------------------------
    # MMA warpgroups
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def mma(self, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dv: cute.TiledMma,
            mma_dq: cute.TiledMma, mdK: cute.Tensor, mdV: cute.Tensor, smem, sdQ, sLSE, sDelta,
            tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom, pipe_kv, pipe_q, pipe_do,
            softmax_scale: Float32, sched, qblocks, qorder, aux, grad_accs: tuple):
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        tm, tn = self.tile_m, self.tile_n
        wg_sdp, wg_dkv, wg_dq = (t.get_slice(wg * 128) for t in (mma_sdp, mma_dkv, mma_dq))
        thr_sdp = mma_sdp.get_slice(tidx)
        acc_dV = cute.make_rmem_tensor(wg_dkv.partition_shape_C((self.head_dim_v, tn)), Float32)
        acc_dK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((self.head_dim, tn)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # Per-register (kv, q) coordinates of the S accumulator (the order ``_probabilities``
        # reads: an identity over (kv, q) viewed as (q, kv)), and lse2 / delta broadcast over
        # the keys.
        tScS = thr_sdp.partition_C(_transposed_2d(cute.make_identity_tensor((tn, tm))))
        bcast = cute.make_layout((tm, tn, self.num_stages), stride=(1, 0, self.row_pitch))
        tSsLSE = thr_sdp.partition_C(cute.make_tensor(sLSE.iterator, bcast))
        tSsDelta = thr_sdp.partition_C(cute.make_tensor(sDelta.iterator, bcast))
        # P and dS (registers, queries × keys) -> their smem tiles, keys contiguous.
        st = cute.make_copy_atom(StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_st = cute.make_tiled_copy_C(st, mma_sdp).get_slice(tidx)
        tSsPdS = thr_st.partition_D(smem.sdS)
        # dQ accumulator -> this warpgroup's fp32 box (16-byte runs per thread: dq_box_view).
        box_r, box_c = self.dq_box
        rows, cols = dq_box_view(box_r, box_c)
        sdQ_tile = cute.make_tensor(sdQ.iterator, cute.make_layout(
            (rows.shape, (cols.shape, 2)), stride=(rows.stride, (cols.stride, box_r * box_c))))
        tQsdQ = mma_dq.get_slice(tidx).partition_C(sdQ_tile)
        ctx = _KeysCtx(mma_sdp, mma_dkv, mma_dq, wg_sdp, wg_dkv, wg_dq, smem, acc_dV, acc_dK,
                       tScS, tSsLSE, tSsDelta, st, thr_st, tSsPdS, tQsdQ,
                       wg_sdp.partition_shape_C((tm, tn)), wg_dq.partition_shape_C((tm, self.head_dim)),
                       softmax.exp2_multiplier(self.score_mod, softmax_scale), softmax_scale, sched,
                       aux, wg)
        # K and V must have landed even when no q tile is listed: the epilogue overwrites them.
        pipe_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        self._walk_q_tiles(ctx, pipe_q, pipe_do, qblocks, qorder)
        self.epilogue(ctx, mdK, mdV, smem.sK, smem.sV, tma_dk, tma_dv, tidx)

    @cute.jit
    def _walk_q_tiles(self, ctx, pipe_q, pipe_do, qblocks, qorder):
        """The base class's walk; with block lists, each head's full-tile count is read after
        its partial tiles: read before them, it is live across their loop, and it was the one
        value ptxas spilled (4 bytes, the document mask at (192, 192))."""
        if const_expr(not self.sparse):
            FlexAttentionBwdSm90._walk_q_tiles(self, ctx, pipe_q, pipe_do, qblocks, qorder)
        else:
            sched, per = ctx.sched, self.tiles_per_mask_block
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            g = sched.group
            kv_ragged = (sched.n_block + 1) * self.tile_n > sched.seqlen_k
            for gi in cutlass.range(g, unroll=1):
                head = sched.head_kv * g + gi
                n_part, _, part_row, _ = self._q_lists(qblocks, sched, head)
                for j in cutlass.range(n_part, unroll=1):
                    state = self._q_tile(ctx, pipe_q, pipe_do, state, head,
                                         listed_tile(part_row, j, per), "partial")
                _, n_full, _, full_row = self._q_lists(qblocks, sched, head)
                for j in cutlass.range(n_full, unroll=1):
                    state = self._full_q_tile(ctx, pipe_q, pipe_do, state, head,
                                              listed_tile(full_row, j, per), kv_ragged)

    def _keys_operands(self, ctx, idx: Int32, do_idx: Int32) -> "_KeysOperands":
        """This tile's smem GEMM operands (each tile rebased on an opaque address, as
        ``_smem_operands``): Q at stage ``idx``, dO at ``do_idx``, dS and P at their one
        stage."""
        sm = ctx.smem
        sQ = opaque_smem(sm.sQ[None, None, idx], sm.swQ)
        sdO = opaque_smem(sm.sdO[None, None, do_idx], sm.swdO)
        sdS = opaque_smem(sm.sdS[None, None, _DS], sm.swdS)
        sP = opaque_smem(sm.sdS[None, None, _P], sm.swdS)
        sK, sV = opaque_smem(sm.sK, sm.swK), opaque_smem(sm.sV, sm.swV)
        sdp, dkv, dq = ctx.wg_sdp, ctx.wg_dkv, ctx.wg_dq
        return _KeysOperands(
            tSrQ=sdp.make_fragment_A(sdp.partition_A(sQ)),
            tSrK=sdp.make_fragment_B(sdp.partition_B(sK)),
            tPrdO=sdp.make_fragment_A(sdp.partition_A(sdO)),
            tPrV=sdp.make_fragment_B(sdp.partition_B(sV)),
            tVrdO=dkv.make_fragment_A(dkv.partition_A(_transposed_2d(sdO))),
            tVsP=dkv.make_fragment_B(dkv.partition_B(_transposed_2d(sP))),
            tKrQ=dkv.make_fragment_A(dkv.partition_A(_transposed_2d(sQ))),
            tKsdS=dkv.make_fragment_B(dkv.partition_B(_transposed_2d(sdS))),
            tQrA=dq.make_fragment_A(dq.partition_A(sdS)),
            tQrB=dq.make_fragment_B(dq.partition_B(_transposed_2d(sK))),
        )

    def _q_tile(self, ctx, pipe_q, pipe_do, state, head, m, kind):
        return self._q_tile_keys(ctx, pipe_q, pipe_do, state, head, m, kind)

    @cute.jit
    def _q_tile_keys(self, ctx, pipe_q: pipeline.PipelineAsync, pipe_do: pipeline.PipelineAsync,
                     state, head: Int32, m: Int32, kind: cutlass.Constexpr):
        """One Q tile (the module docstring's order). Branch-free between the waits. P is
        always formed under the dP GEMM: with 48 keys a warpgroup, S and dP are 24 registers
        each, and every core mod compiles spill-free so (the 128-key tile's heavy mods issue dP
        after P instead, ``BwdTiling.overlap_dp``)."""
        idx = state.index
        do_state = self._do_state(state, 0)
        ops = self._keys_operands(ctx, idx, do_state.index)
        pipe_q.consumer_wait(state)
        acc_S = cute.make_rmem_tensor(ctx.s_shape, Float32)
        wgmma_gemm(ctx.mma_sdp, acc_S, ops.tSrQ, ops.tSrK, zero_init=True)
        pipe_do.consumer_wait(do_state)
        acc_dP = cute.make_rmem_tensor(ctx.s_shape, Float32)
        wgmma_gemm(ctx.mma_sdp, acc_dP, ops.tPrdO, ops.tPrV, zero_init=True)
        # lse2 (2 distinct values a thread: its 2 query rows) read under the GEMMs.
        rLSE = row_values(ctx.tSsLSE[None, None, None, idx], ctx.s_shape)
        warpgroup.wait_group(1)  # S done; dP runs under P
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        self._probabilities(ctx, acc_S, rP, rLSE, head, m, kind)
        cute.copy(ctx.st, ctx.thr_st.retile(rP), ctx.tSsPdS[None, None, None, _P])
        cute.arch.fence_view_async_shared()
        if const_expr(self.do_stages == 1):
            # The dV GEMM reads the warpgroup's own 48 keys of P: its own stores.
            cute.arch.barrier(barrier_id=_BAR_WG + ctx.wg, number_of_threads=128)
        else:
            # Both warpgroups: past it, the other one has finished its last tile, whose dQ GEMM
            # read the dS tile this one writes next (with two dO stages, waiting for dO no
            # longer says so).
            cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=self.num_mma_threads)
        wgmma_gemm(ctx.mma_dkv, ctx.acc_dV, ops.tVrdO, ops.tVsP, zero_init=False)
        rDelta = row_values(ctx.tSsDelta[None, None, None, do_state.index], ctx.s_shape)
        warpgroup.wait_group(1)  # dP done (dV may still run)
        self._form_ds(ctx, acc_S, acc_dP, rDelta, head, m)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        cute.copy(ctx.st, ctx.thr_st.retile(rdS), ctx.tSsPdS[None, None, None, _DS])
        cute.arch.fence_view_async_shared()
        # The dQ GEMM reads all 96 keys of dS: both warpgroups' stores.
        cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=self.num_mma_threads)
        # dQ first: its box is written while dK runs.
        acc_dQ = cute.make_rmem_tensor(ctx.dq_shape, Float32)
        wgmma_gemm(ctx.mma_dq, acc_dQ, ops.tQrA, ops.tQrB, zero_init=True)
        wgmma_gemm(ctx.mma_dkv, ctx.acc_dK, ops.tKrQ, ops.tKsdS, zero_init=False)
        warpgroup.wait_group(1)  # dV and dQ done: dO is free (its release also frees dS: see above)
        pipe_do.consumer_release(do_state)
        self._publish_dq(ctx, acc_dQ)
        warpgroup.wait_group(0)  # dK done: Q is free
        pipe_q.consumer_release(state)
        state.advance()
        return state

    # -----------------------------------------------------------------------------------------
    @cute.jit
    def epilogue(self, ctx, mdK: cute.Tensor, mdV: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                 tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom, tidx: Int32):
        """dKᵀ ·= scale; dKᵀ, dVᵀ -> smem over K, V (stmatrix.trans: 8 head dims of one key
        contiguous, K's and V's own layout) -> gmem (TMA store; keys >= S clipped)."""
        # A fresh thread index (see the base class's epilogue).
        tidx = opaque_thread_idx() - 128
        rdK = cute.make_rmem_tensor_like(ctx.acc_dK, self.dtype)
        rdK.store((ctx.acc_dK.load() * ctx.softmax_scale).to(self.dtype))
        rdV = cute.make_rmem_tensor_like(ctx.acc_dV, self.dtype)
        rdV.store(ctx.acc_dV.load().to(self.dtype))
        # Both warpgroups must be done reading K and V (their last GEMMs were waited for).
        cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=self.num_mma_threads)
        st_t = cute.make_copy_atom(StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        thr_st = cute.make_tiled_copy_C(st_t, ctx.mma_dkv).get_slice(tidx)
        cute.copy(st_t, thr_st.retile(rdK), thr_st.partition_D(_transposed_2d(sK)))
        cute.copy(st_t, thr_st.retile(rdV), thr_st.partition_D(_transposed_2d(sV)))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=self.num_mma_threads)
        self._store_dkv(ctx.sched, mdK, mdV, sK, sV, tma_dk, tma_dv)


# One Q tile's smem wgmma fragments (``FlexAttentionBwdKeysSm90._keys_operands``): S = Q Kᵀ
# (tSrQ, tSrK), dP = dO Vᵀ (tPrdO, tPrV), dVᵀ += dOᵀ P (tVrdO, tVsP), dKᵀ += Qᵀ dS (tKrQ,
# tKsdS), dQ = dS K (tQrA, tQrB).
_KeysOperands = namedtuple("_KeysOperands", "tSrQ tSrK tPrdO tPrV tVrdO tVsP tKrQ tKsdS tQrA tQrB")

# Per-CTA MMA-warpgroup state (trace-time), named as the base class's ``_BwdCtx`` where the
# base class's helpers read it (``_probabilities``, ``_publish_dq``, ``_walk_q_tiles``).
# tSsPdS: the stmatrix partition of the dS/P buffer (both stages).
_KeysCtx = namedtuple("_KeysCtx", "mma_sdp mma_dkv mma_dq wg_sdp wg_dkv wg_dq smem acc_dV acc_dK "
                      "tScS tSsLSE tSsDelta st thr_st tSsPdS tQsdQ s_shape dq_shape c "
                      "softmax_scale sched aux wg")
