"""Blackwell (sm_100a) FlashAttention backward template with two holes: ``score_mod_and_grad`` and ``mask_mod``.

Status: compiles for sm_100a on the CPU (tests/test_cute_sm100_bwd_compile.py); it has NEVER RUN on
a Blackwell GPU. Nothing dispatches to it: ``flexjit/backends/cute_sm100_bwd.py`` builds it, and
only the first-use self-check (built elsewhere) may let a call reach it.

What this module holds
----------------------
* ``BwdConfig`` / ``HEAD_DIMS`` / ``smem_bytes`` / ``TMEM_COLUMNS``: the frozen compile-time
  configuration and its resource sums.
* ``FlexAttentionBwdSm100``: the main kernel (tcgen05 MMAs, accumulators in tensor memory, TMA
  loads, warp roles). ``FlexAttentionBwdPostSm100``: dQ = accumulator · scale in the input dtype.
  The preprocess (delta = rowsum(dO∘O) − dLSE, lse2 = LSE·log2 e, the dQ accumulator and the
  semaphores zeroed) is the sm90 backward's ``FlexAttentionBwdPreSm90``: plain loads, stores and
  shuffles, no architecture in it, compiled here for sm_100a.
* The host half: ``compile_bwd`` -> ``CompiledBwd`` (``host``'s launch, pre → main → post).

Math: exactly the sm90 backward's (``sm90.bwd``, "Algorithm"), with s = score_mod(q·k·scale)::

    P = exp2(s·c − lse2)          (c = scale·log2 e without a score_mod, log2 e with one)
    dP = dO Vᵀ      dS = P ∘ (dP − delta) ∘ dscore      dscore = d score_mod / d score
    dV = Σ Pᵀ dO    dK = scale · Σ dSᵀ Q                 dQ = scale · Σ dS K

Masked and out-of-range elements get P = 0 and dS = 0 (dscore may be inf/NaN there: selected
away, never multiplied in); a row with nothing kept has lse2 = 0 and all scores −inf.

Tiles and tensor memory
-----------------------
One CTA per (128-key block, kv head, batch); it loops over the query heads of its GQA group and,
for each, over 128-row q tiles (one mask block each: a CTA reads one column of the transposed
block lists). Keys are the M of every MMA but dQ's ("swapped", as the sm90 backward): Sᵀ and dPᵀ
come out with one key per TMEM lane, which is the A-operand layout the dV/dK MMAs read from TMEM.
Tensor memory (512 columns × 128 lanes of 32 bits)::

    [0, 128)            Sᵀ = K Qᵀ (fp32); Pᵀ (16-bit) over it, see below
    [128, 256)          dPᵀ = V dOᵀ (fp32); dSᵀ (16-bit) over it; dQ = dS K (fp32, lane = query
                        row, D columns) over it once dS has been read
    [256, 256 + Dv)     dV += Pᵀ dO
    [256 + Dv, .. + D)  dK += dSᵀ Q

D = Dv = 128 fills the 512 columns exactly; D = 64 uses 384. The two compute warpgroups split a
tile's 128 queries: warpgroup h reads Sᵀ/dPᵀ columns [64h, 64h + 64) and writes its 64 16-bit
values over the first 32 of them ([64h, 64h + 32)): each thread overwrites only TMEM it has
already read itself, so no barrier between the warpgroups is needed. The dV/dK MMAs read
k-blocks 0-3 of Pᵀ/dSᵀ from columns 0-31 and k-blocks 4-7 from 64-95 (``_gemm_split``).

The dQ MMA reads dS from shared memory (MN-major: each thread stores its key's 64 queries as
16-byte runs) and K from shared memory viewed MN-major; its accumulator overwrites dPᵀ/dSᵀ. That
is safe because tcgen05.mma instructions of one thread execute in issue order (dK, which reads
dSᵀ from TMEM, is issued before dQ), and the next dPᵀ is issued only after the reduce warps have
read dQ out (``pipe_dq``). The same in-order rule lets the next Sᵀ overwrite Pᵀ after dV.

Warp roles (16 warps, ``setmaxnreg`` per warpgroup)
-------------------------------------------------
* warps 0-3 (dQ reduce, ``_REDUCE_REGS``): per tile, dQ from TMEM (one query row per thread),
  added into the fp32 accumulator (B, Hq, Lpad, D) by ``red.global.add.f32``; in deterministic
  mode ordered by a semaphore per (b, h, q tile) exactly as the sm90 backward orders its dQ
  boxes (last kv block first; ``flexjit.block_mask.dq_order``'s ranks when sparse). Warp 0
  allocates and frees tensor memory.
* warps 4-11 (compute, two warpgroups, ``_COMPUTE_REGS``): per tile, Sᵀ from TMEM in 16-column
  chunks, the holes, P (16-bit into TMEM) and P∘dscore kept in registers; then dPᵀ, dS (16-bit
  into TMEM and shared memory); the captured-tensor gradients (fp64 atomics, as sm90). After
  the last tile: warpgroup 0 stores dK·scale, warpgroup 1 dV (straight from TMEM, one key row
  per thread, 16-byte stores).
* warp 12: MMA issue; warp 13: TMA loads (K and V once; Q, dO per tile); warps 14-15 idle so
  that ``setmaxnreg`` acts on whole warpgroups.

Per tile j, the MMA warp issues (pipelines in brackets; Sᵀ(0) before the loop)::

    [dO full, dq empty] dPᵀ(j) = V dOᵀ → [dp full]
    [p full] dV += Pᵀ(j) dO → [p empty, dO empty]
    [Q(j+1) full, s empty] Sᵀ(j+1) = K Qᵀ → [s full]        (not after the last tile)
    [ds full] dK += dSᵀ(j) Q; dQ(j) = dS K → [dq full, ds empty, Q(j) empty]

so the next tile's Sᵀ runs while the compute warps form this tile's dS. Every hand-off is wrapped
in tcgen05 fences (``tcgen05_fence``), as in the forward.

Block lists (``block_sparse.QBlockLists``, ``QOrder``) and the holes: the sm90 backward's
contract; the same rendered module fills both backwards.

Shapes: q (B, Hq, L, D), k/v (B, Hkv, S, D / Dv), out/dout (B, Hq, L, Dv), lse/dlse (B, Hq, L)
fp32; dq/dk/dv like q/k/v. Last dims contiguous, 16-byte aligned, other strides multiples of 8
elements (TMA); bf16 or fp16; Hq = g·Hkv; ragged L and S.
"""

from collections import namedtuple
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_helpers
from cutlass.memory.smem import SmemAllocator
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

from flexjit.templates.cute import captured_grads, common, config, host, softmax
from flexjit.templates.cute.block_sparse import QBlockLists, QOrder, order_rows, q_lists
from flexjit.templates.cute.common import MASK_BLOCK, Aux, FloatIndices, bind, kernel_aux, permute, smem_buffer, where
from flexjit.templates.cute.host import PARTS, tvm_ffi_enabled  # noqa: F401  (the template's API)
from flexjit.templates.cute.mask import kept, mask_word
from flexjit.templates.cute.opaque import opaque_i32
from flexjit.templates.cute.pipeline import group_pipeline, thread_group, tma_pipelines
from flexjit.templates.cute.sm100.common import BAR_TMEM_FREE, GPU_ARCH, LOAD_WARP, MMA_WARP, SMEM_CAPACITY, TMEM_COLUMNS, free_tmem, launch, tcgen05_fence, tma_operand, tmem_address, tmem_allocator
from flexjit.templates.cute.sm90.bwd import BwdConfig as _Sm90BwdConfig
from flexjit.templates.cute.sm90.bwd_prepost import FlexAttentionBwdPreSm90

HEAD_DIMS = ((64, 64), (128, 128))
TILE_N = 128  # keys per CTA (the M of the swapped MMAs; one mask block)
TILE_M = 128  # queries per tile (one mask block)
CHUNK = 16  # TMEM columns the compute threads read (and mod) at a time
HALF = TILE_M // 2  # queries per compute warpgroup
DQ_CHUNK = 32  # dQ columns the reduce warps read at a time

# TMEM columns (32-bit).
_TMEM_S = 0
_TMEM_DP = TILE_M

# Warp roles.
_REDUCE_WARP0 = 0
_COMPUTE_WARP0 = 4  # and MMA_WARP, LOAD_WARP of sm100.common
# 128 · (reduce + 2 · compute + other) = 65536: setmaxnreg only moves registers between warpgroups.
# Measured with ptxas (sm_100a): 56/200/56 is the split where every core mod compiles without
# spills at D = 64 and 128 (72/184/72 spilled t5_bias; 88/184/56 and 80/192/48 spilled the MMA
# warp before its k-block loops were rolled).
_REDUCE_REGS, _COMPUTE_REGS, _OTHER_REGS = 56, 200, 56

# Named barriers (0 is __syncthreads; 1 and 2 are sm100.common's: BAR_TMEM_ALLOC, reduce,
# compute ×2 and the MMA warp wait for the TMEM address; BAR_TMEM_FREE, reduce + compute: every
# TMEM read done before warp 0 frees it).
_BAR_REDUCE = 3  # the reduce warpgroup: semaphore acquired / adds issued (deterministic)


@dataclass(frozen=True)
class BwdConfig(config.BwdConfig):
    """The sm100 backward's configuration: the shared fields, no more."""

    def __post_init__(self):
        config.check_head_dims("cute_sm100_bwd", self.head_dim, self.head_dim_v, HEAD_DIMS)
        super().__post_init__()


def stages(head_dim: int) -> tuple:
    """(Q stages, dO stages): (2, 1) at D = 128 (K, V, Q×2, dO, dS = 5 × 32 KB = 160 KB; a second
    dO stage would still fit but leaves no slack), (2, 2) at D = 64."""
    return (2, 1) if head_dim > 64 else (2, 2)


def smem_bytes(cfg: BwdConfig) -> int:
    elem = 2
    qs, ds = stages(cfg.head_dim)
    k = TILE_N * cfg.head_dim * elem
    v = TILE_N * cfg.head_dim_v * elem
    q = qs * TILE_M * cfg.head_dim * elem
    do = ds * TILE_M * cfg.head_dim_v * elem
    dS = TILE_M * TILE_N * elem
    bars = 8 * (2 + 2 * qs + 2 * ds + 2 * 6) + 8
    return 5 * 1024 + k + v + q + do + dS + bars


def tmem_columns(cfg: BwdConfig) -> int:
    return 2 * TILE_M + cfg.head_dim + cfg.head_dim_v


# Per-CTA work description (trace-time container of DSL values). n_block: kv block; group: query
# heads per kv head.
_Sched = namedtuple("_Sched", "n_block head_kv batch group seqlen_q seqlen_k n_q_tiles n_kv_tiles")


@dataclass(frozen=True)
class _Pipes:
    kv: object
    q: object
    do: object
    s: object  # MMA -> compute: Sᵀ in TMEM
    dp: object  # MMA -> compute: dPᵀ in TMEM
    p: object  # compute -> MMA: Pᵀ in TMEM
    ds: object  # compute -> MMA: dSᵀ in TMEM and dS in smem
    dq: object  # MMA -> reduce: dQ in TMEM
    dkv: object  # MMA -> compute: the last dK/dV MMA has completed


class FlexAttentionBwdSm100(config.Kernel):
    """Warp-specialised FA4-style backward for sm_100a with score/mask holes."""

    def __init__(self, cfg: BwdConfig):
        super().__init__(cfg)
        self.q_stages, self.do_stages = stages(cfg.head_dim)
        self.deterministic = cfg.deterministic
        self.score_grads, self.grad_offsets = cfg.score_grads, cfg.grad_offsets
        self.tmem_dv = 2 * TILE_M
        self.tmem_dk = 2 * TILE_M + self.head_dim_v
        self.tmem_dq = _TMEM_DP
        assert tmem_columns(cfg) <= TMEM_COLUMNS
        assert self.head_dim <= TILE_M  # dQ fits over dPᵀ
        assert smem_bytes(cfg) <= SMEM_CAPACITY, smem_bytes(cfg)
        # One CTA per SM: each allocates all 512 TMEM columns, and a second resident CTA would
        # wait in tcgen05.alloc for the first (in deterministic mode the first may be waiting
        # for a later CTA's dQ adds: a deadlock). The smem use keeps it to one.
        assert 2 * smem_bytes(cfg) > SMEM_CAPACITY, smem_bytes(cfg)
        assert TILE_M == MASK_BLOCK and TILE_N == MASK_BLOCK

    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
        mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
        mdV: cute.Tensor, softmax_scale: Float32, q_per_kv: Int32,
        qblocks: Optional[QBlockLists], qorder: Optional[QOrder], mSem: Optional[cute.Tensor],
        aux_tensors: Optional[tuple], aux_scalars: Optional[tuple], grad_accs: Optional[tuple],
        stream: cuda.CUstream,
    ):
        """The operands' layouts: ``common``'s docstring."""
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype):
            raise TypeError("q/k dtype does not match the config")
        D, Dv = self.head_dim, self.head_dim_v
        # MMA views (seq, dim, (head, batch)); the other tensors (seq, dim, head, batch).
        q = cute.group_modes(permute(mQ, [2, 3, 1, 0]), 2, 4)
        k = cute.group_modes(permute(mK, [2, 3, 1, 0]), 2, 4)
        v = cute.group_modes(permute(mV, [2, 3, 1, 0]), 2, 4)
        do = cute.group_modes(permute(mdO, [2, 3, 1, 0]), 2, 4)
        dk, dv, dqacc = [permute(t, [2, 3, 1, 0]) for t in (mdK, mdV, mdQacc)]
        lse2, delta = [permute(t, [2, 1, 0]) for t in (mLSE2, mDelta)]

        one_sm = tcgen05.CtaGroup.ONE
        K_MAJOR, MN_MAJOR = OperandMajorMode.K, OperandMajorMode.MN
        TMEM = tcgen05.OperandSource.TMEM
        # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: (keys, queries), both operands K-major.
        mma_s = sm100_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, one_sm, (TILE_N, TILE_M))
        # dV += Pᵀ dO, dK += dSᵀ Q: A from TMEM, B (dO, Q) read MN-major.
        mma_dv = sm100_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, one_sm, (TILE_N, Dv), TMEM)
        mma_dk = sm100_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, one_sm, (TILE_N, D), TMEM)
        # dQ = dS K: (queries, D); dS and K both MN-major in smem.
        mma_dq = sm100_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, one_sm, (TILE_M, D))

        s_tiler = (TILE_N, TILE_M, D)
        dp_tiler = (TILE_N, TILE_M, Dv)
        dv_tiler = (TILE_N, Dv, TILE_M)
        dk_tiler = (TILE_N, D, TILE_M)
        dq_tiler = (TILE_M, D, TILE_N)
        qs, dos = self.q_stages, self.do_stages
        # One buffer, two views where an operand serves two MMAs: the K-major and the MN-major
        # layouts of one tile coincide (atoms of 8 rows × 64 columns, rows fastest); asserted
        # below through their sizes and swizzles.
        sK_layout = sm100_helpers.make_smem_layout_a(mma_s, s_tiler, self.dtype, 1)
        sKt_layout = sm100_helpers.make_smem_layout_b(mma_dq, dq_tiler, self.dtype, 1)
        sV_layout = sm100_helpers.make_smem_layout_a(mma_s, dp_tiler, self.dtype, 1)
        sQ_layout = sm100_helpers.make_smem_layout_b(mma_s, s_tiler, self.dtype, qs)
        sQt_layout = sm100_helpers.make_smem_layout_b(mma_dk, dk_tiler, self.dtype, qs)
        sdO_layout = sm100_helpers.make_smem_layout_b(mma_s, dp_tiler, self.dtype, dos)
        sdOt_layout = sm100_helpers.make_smem_layout_b(mma_dv, dv_tiler, self.dtype, dos)
        sdS_layout = sm100_helpers.make_smem_layout_a(mma_dq, dq_tiler, self.dtype, 1)
        tP_layout = sm100_helpers.make_smem_layout_a(mma_dv, dv_tiler, self.dtype, 1)
        tdS_layout = sm100_helpers.make_smem_layout_a(mma_dk, dk_tiler, self.dtype, 1)
        for a, b in ((sK_layout, sKt_layout), (sQ_layout, sQt_layout), (sdO_layout, sdOt_layout)):
            assert cute.cosize(a.outer) == cute.cosize(b.outer)
            assert str(a.inner) == str(b.inner)

        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (mma_s.thr_id.shape,)).shape
        g2s = cpasync.CopyBulkTensorTileG2SOp(one_sm)
        one_k = cute.select(sK_layout, mode=[0, 1, 2])
        one_v = cute.select(sV_layout, mode=[0, 1, 2])
        one_q = cute.select(sQ_layout, mode=[0, 1, 2])
        one_do = cute.select(sdO_layout, mode=[0, 1, 2])
        tma_k, tK = cute.nvgpu.make_tiled_tma_atom_A(g2s, k, one_k, s_tiler, mma_s, cluster)
        tma_v, tV = cute.nvgpu.make_tiled_tma_atom_A(g2s, v, one_v, dp_tiler, mma_s, cluster)
        tma_q, tQ = cute.nvgpu.make_tiled_tma_atom_B(g2s, q, one_q, s_tiler, mma_s, cluster)
        tma_do, tdO = cute.nvgpu.make_tiled_tma_atom_B(g2s, do, one_do, dp_tiler, mma_s, cluster)
        self.tx_kv = cute.size_in_bytes(self.dtype, one_k) + cute.size_in_bytes(self.dtype, one_v)
        self.tx_q = cute.size_in_bytes(self.dtype, one_q)
        self.tx_do = cute.size_in_bytes(self.dtype, one_do)

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * qs]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * dos]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dp: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_p: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_ds: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dq: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dkv: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_addr: Int32
            sK: smem_buffer(self.dtype, sK_layout)
            sV: smem_buffer(self.dtype, sV_layout)
            sQ: smem_buffer(self.dtype, sQ_layout)
            sdO: smem_buffer(self.dtype, sdO_layout)
            sdS: smem_buffer(self.dtype, sdS_layout)

        self.shared_storage = SharedStorage

        num_n = cute.ceil_div(k.shape[0], TILE_N)
        kernel = self.kernel(
            mma_s, mma_dv, mma_dk, mma_dq, tma_k, tK, tma_v, tV, tma_q, tQ, tma_do, tdO,
            lse2, delta, dqacc, dk, dv, softmax_scale, q_per_kv, qblocks, qorder, mSem,
            aux_tensors, aux_scalars, grad_accs,
            sK_layout, sKt_layout, sV_layout, sQ_layout, sQt_layout, sdO_layout, sdOt_layout,
            sdS_layout, tP_layout, tdS_layout,
        )
        launch(kernel, [num_n, mK.shape[1], mK.shape[0]], stream)

    # -----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self, mma_s: cute.TiledMma, mma_dv: cute.TiledMma, mma_dk: cute.TiledMma,
        mma_dq: cute.TiledMma,
        tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
        tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
        mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
        mdV: cute.Tensor, softmax_scale: Float32, q_per_kv: Int32,
        qblocks: Optional[QBlockLists], qorder: Optional[QOrder], mSem: Optional[cute.Tensor],
        aux_tensors: Optional[tuple], aux_scalars: Optional[tuple], grad_accs: Optional[tuple],
        sK_layout: cute.ComposedLayout, sKt_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
        sQt_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
        sdOt_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
        tP_layout: cute.ComposedLayout, tdS_layout: cute.ComposedLayout,
    ):
        """The operands' layouts: ``common``'s docstring (mdK / mdV are plain views)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == LOAD_WARP:
            for atom in (tma_k, tma_v, tma_q, tma_do):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(self.shared_storage)
        pipes = self._make_pipelines(storage)
        tmem = tmem_allocator(storage, _REDUCE_WARP0, 32 * (4 + 8 + 1))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sKt = storage.sK.get_tensor(sKt_layout.outer, swizzle=sKt_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sQt = storage.sQ.get_tensor(sQt_layout.outer, swizzle=sQt_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sdOt = storage.sdO.get_tensor(sdOt_layout.outer, swizzle=sdOt_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        aux = kernel_aux(aux_tensors, aux_scalars)
        accs = tuple(grad_accs) if const_expr(grad_accs is not None) else ()

        if warp_idx < _COMPUTE_WARP0:
            cute.arch.setmaxregister_decrease(_REDUCE_REGS)
            tmem.allocate(TMEM_COLUMNS)
            t_ptr = tmem_address(tmem)
            sched = self._schedule(mQ, mK, q_per_kv)
            self.reduce(mma_dq, t_ptr, pipes, sched, mdQacc, qblocks, qorder, mSem)
            # The compute warps' epilogue reads of dK/dV are the other last TMEM users.
            free_tmem(tmem, t_ptr, 32 * 12)
        elif warp_idx < MMA_WARP:
            cute.arch.setmaxregister_increase(_COMPUTE_REGS)
            t_ptr = tmem_address(tmem)
            sched = self._schedule(mQ, mK, q_per_kv)
            self.compute(mma_s, mma_dv, mma_dk, t_ptr, pipes, sched, sdS, mLSE2, mDelta, mdK,
                         mdV, softmax_scale, qblocks, qorder, aux, accs)
            tcgen05_fence(after=False)
            cute.arch.barrier_arrive(barrier_id=BAR_TMEM_FREE, number_of_threads=32 * 12)
        else:
            cute.arch.setmaxregister_decrease(_OTHER_REGS)
            if warp_idx == MMA_WARP:
                t_ptr = tmem_address(tmem)
                sched = self._schedule(mQ, mK, q_per_kv)
                smem = _Smem(*[(t, layout.inner) for t, layout in (
                    (sK, sK_layout), (sKt, sKt_layout), (sV, sV_layout), (sQ, sQ_layout),
                    (sQt, sQt_layout), (sdO, sdO_layout), (sdOt, sdOt_layout),
                    (sdS, sdS_layout))])
                self.mma(mma_s, mma_dv, mma_dk, mma_dq, t_ptr, tP_layout, tdS_layout, smem,
                         pipes, sched, qblocks)
            elif warp_idx == LOAD_WARP:
                sched = self._schedule(mQ, mK, q_per_kv)
                self.load(mma_s, tma_k, tma_v, tma_q, tma_do, mK, mV, mQ, mdO, sK, sV, sQ, sdO,
                          pipes, sched, qblocks)

    def _make_pipelines(self, storage) -> _Pipes:
        warp, compute, reduce_wg = thread_group(1), thread_group(256), thread_group(128)
        kv, q, do = tma_pipelines(
            1, (storage.mbar_kv, 1, self.tx_kv), (storage.mbar_q, self.q_stages, self.tx_q),
            (storage.mbar_do, self.do_stages, self.tx_do), create=pipeline.PipelineTmaUmma.create)
        to_threads, to_mma = pipeline.PipelineUmmaAsync.create, pipeline.PipelineAsyncUmma.create
        s, dp, p, ds, dq, dkv = (
            group_pipeline(create, bars, 1, producer, consumer)
            for create, bars, producer, consumer in (
                (to_threads, storage.mbar_s, warp, compute),
                (to_threads, storage.mbar_dp, warp, compute),
                (to_mma, storage.mbar_p, compute, warp),
                (to_mma, storage.mbar_ds, compute, warp),
                (to_threads, storage.mbar_dq, warp, reduce_wg),
                (to_threads, storage.mbar_dkv, warp, compute)))
        return _Pipes(kv, q, do, s, dp, p, ds, dq, dkv)

    # -----------------------------------------------------------------------------------------
    # Scheduling: every role walks the same q tiles in the same order (sm90's walk): for each
    # query head of the group, the partial list then the full list (dense: 0..nQ-1;
    # deterministic + sparse: dq_order's merged list, full lists empty).
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def _schedule(self, mQ: cute.Tensor, mK: cute.Tensor, q_per_kv: Int32) -> _Sched:
        n_block, head_kv, batch = cute.arch.block_idx()
        n_kv = cute.ceil_div(mK.shape[0], TILE_N)
        if const_expr(self.deterministic):
            n_block = n_kv - 1 - n_block  # last kv block first (see sm90.bwd)
        return _Sched(n_block, head_kv, batch, q_per_kv, mQ.shape[0], mK.shape[0],
                      cute.ceil_div(mQ.shape[0], TILE_M), n_kv)

    def _q_lists(self, qblocks: QBlockLists, sched: _Sched, head: Int32):
        return q_lists(qblocks, sched.batch, head, sched.n_block, 1)

    @cute.jit
    def _num_tiles(self, sched: _Sched, qblocks) -> Int32:
        """How many q tiles this CTA visits over its whole group (0: dK = dV = 0)."""
        total = Int32(0)
        g = sched.group
        for gi in cutlass.range(g, unroll=1):
            head = sched.head_kv * g + gi
            if const_expr(self.sparse):
                n_part, n_full, _, _ = self._q_lists(qblocks, sched, head)
                total = total + n_part
                if const_expr(not self.deterministic):
                    total = total + n_full
            else:
                total = total + sched.n_q_tiles
        return total

    # -----------------------------------------------------------------------------------------
    # Load warp
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def load(self, mma_s: cute.TiledMma, tma_k, tma_v, tma_q, tma_do, mK, mV, mQ, mdO,
             sK, sV, sQ, sdO, pipes: _Pipes, sched: _Sched, qblocks):
        """K and V once, then Q(m) and dO(m) per tile in the walk's order; nothing at all for a
        kv block that no q tile visits (no TMA may be left in flight at exit)."""
        thr = mma_s.get_slice(0)
        D, Dv = self.head_dim, self.head_dim_v
        tKsK, tKgK = tma_operand(tma_k, thr.partition_A, mK, (TILE_N, D), sK)
        tVsV, tVgV = tma_operand(tma_v, thr.partition_A, mV, (TILE_N, Dv), sV)
        tQsQ, tQgQ = tma_operand(tma_q, thr.partition_B, mQ, (TILE_M, D), sQ)
        tOsO, tOgO = tma_operand(tma_do, thr.partition_B, mdO, (TILE_M, Dv), sdO)
        hb_kv = (sched.head_kv, sched.batch)
        total = self._num_tiles(sched, qblocks)
        if total > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipes.kv.producer_acquire(kv_state)
            bar = pipes.kv.producer_get_barrier(kv_state)
            cute.copy(tma_k, tKgK[None, sched.n_block, 0, hb_kv], tKsK[None, 0], tma_bar_ptr=bar)
            cute.copy(tma_v, tVgV[None, sched.n_block, 0, hb_kv], tVsV[None, 0], tma_bar_ptr=bar)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                   self.q_stages)
            do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                    self.do_stages)
            g = sched.group
            for gi in cutlass.range(g, unroll=1):
                head = sched.head_kv * g + gi
                tiles = (tQsQ, tQgQ[None, None, 0, (head, sched.batch)], tOsO,
                         tOgO[None, None, 0, (head, sched.batch)])
                if const_expr(self.sparse):
                    n_part, n_full, part_row, full_row = self._q_lists(qblocks, sched, head)
                    for j in cutlass.range(n_part, unroll=1):
                        q_state, do_state = self._load_tile(tma_q, tma_do, tiles, pipes, q_state,
                                                            do_state, part_row[j])
                    if const_expr(not self.deterministic):
                        for j in cutlass.range(n_full, unroll=1):
                            q_state, do_state = self._load_tile(tma_q, tma_do, tiles, pipes,
                                                                q_state, do_state, full_row[j])
                else:
                    for m in cutlass.range(sched.n_q_tiles, unroll=1):
                        q_state, do_state = self._load_tile(tma_q, tma_do, tiles, pipes, q_state,
                                                            do_state, m)

    @cute.jit
    def _load_tile(self, tma_q, tma_do, tiles, pipes: _Pipes, q_state, do_state, m: Int32):
        tQsQ, tQgQ, tOsO, tOgO = tiles
        pipes.q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ[None, m], tQsQ[None, q_state.index],
                  tma_bar_ptr=pipes.q.producer_get_barrier(q_state))
        q_state.advance()
        pipes.do.producer_acquire(do_state)
        cute.copy(tma_do, tOgO[None, m], tOsO[None, do_state.index],
                  tma_bar_ptr=pipes.do.producer_get_barrier(do_state))
        do_state.advance()
        return q_state, do_state

    # -----------------------------------------------------------------------------------------
    # MMA warp
    # -----------------------------------------------------------------------------------------
    def _tmem_tensors(self, mma_s, mma_dv, mma_dk, mma_dq, t_ptr, tP_layout, tdS_layout):
        """Sᵀ, dPᵀ, dV, dK, dQ accumulators; Pᵀ and dSᵀ (16-bit MMA A operands) as (low, high)
        halves: k-blocks 0-3 at the region's column 0, 4-7 at column 64 (``_gemm_split``)."""
        def acc(tiled, shape, col):
            thr = tiled.get_slice(0)
            layout = thr.make_fragment_C(thr.partition_shape_C(shape)).layout
            return cute.make_tensor(t_ptr + col, layout)

        tS = acc(mma_s, (TILE_N, TILE_M), _TMEM_S)
        tdP = acc(mma_s, (TILE_N, TILE_M), _TMEM_DP)
        tdV = acc(mma_dv, (TILE_N, self.head_dim_v), self.tmem_dv)
        tdK = acc(mma_dk, (TILE_N, self.head_dim), self.tmem_dk)
        tdQ = acc(mma_dq, (TILE_M, self.head_dim), self.tmem_dq)

        def operand(tiled, layout, col):
            frag = tiled.get_slice(0).make_fragment_A(
                cute.make_tensor(t_ptr, layout.outer))[None, None, None, 0]
            # The high half's base is 32 columns on, so that its k-block kb (4..7) lands at
            # column 32 + 8·kb = 64 + 8·(kb − 4).
            return tuple(cute.make_tensor(cute.recast_ptr(t_ptr + col + off, dtype=self.dtype),
                                          frag.layout) for off in (0, HALF // 2))

        tP = operand(mma_dv, tP_layout, _TMEM_S)
        tdS = operand(mma_dk, tdS_layout, _TMEM_DP)
        return tS, tdP, tdV, tdK, tdQ, tP, tdS

    @cute.jit
    def _gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
              accumulate):
        """One tcgen05 GEMM over all k-blocks (a fresh atom: its ACCUMULATE field is mutated).
        A runtime loop over the k-blocks: unrolled, every k-block's 64-bit smem descriptor of
        every operand was precomputed before the tile loop and kept live across it (the MMA
        warp spilled them); rolled, each operand keeps one base and adds the k-block's offset."""
        atom = cute.make_mma_atom(tiled_mma.op)
        for kb in cutlass.range(cute.size(tA, mode=[2]), unroll=1):
            atom.set(tcgen05.Field.ACCUMULATE, accumulate or kb != 0)
            cute.gemm(atom, acc, tA[None, None, kb], tB[None, None, kb], acc)

    @cute.jit
    def _gemm_split(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tA_lo: cute.Tensor,
                    tA_hi: cute.Tensor, tB: cute.Tensor, accumulate):
        """``_gemm`` with A from TMEM in two halves: k-blocks below 4 from ``tA_lo``, the rest
        from ``tA_hi`` (each compute warpgroup's 64 queries of Pᵀ/dSᵀ)."""
        atom = cute.make_mma_atom(tiled_mma.op)
        half = cute.size(tA_lo, mode=[2]) // 2
        for kb in cutlass.range(half, unroll=1):
            atom.set(tcgen05.Field.ACCUMULATE, accumulate or kb != 0)
            cute.gemm(atom, acc, tA_lo[None, None, kb], tB[None, None, kb], acc)
        for kb in cutlass.range(half, 2 * half, unroll=1):
            atom.set(tcgen05.Field.ACCUMULATE, True)
            cute.gemm(atom, acc, tA_hi[None, None, kb], tB[None, None, kb], acc)

    def _smem_operands(self, mma_s, mma_dv, mma_dk, mma_dq, smem: "_Smem") -> "_MmaOps":
        """The smem MMA operands (descriptor-backed fragments; stage modes kept for Q and dO)."""
        thr_s, thr_dv = mma_s.get_slice(0), mma_dv.get_slice(0)
        thr_dk, thr_dq = mma_dk.get_slice(0), mma_dq.get_slice(0)
        sK, sKt, sV, sQ, sQt, sdO, sdOt, sdS = [t for t, _ in smem]
        return _MmaOps(
            tSrK=thr_s.make_fragment_A(sK)[None, None, None, 0],
            tSrQ=thr_s.make_fragment_B(sQ),
            tPrV=thr_s.make_fragment_A(sV)[None, None, None, 0],
            tPrdO=thr_s.make_fragment_B(sdO),
            tVrdO=thr_dv.make_fragment_B(sdOt),
            tKrQ=thr_dk.make_fragment_B(sQt),
            tQrdS=thr_dq.make_fragment_A(sdS)[None, None, None, 0],
            tQrK=thr_dq.make_fragment_B(sKt)[None, None, None, 0],
        )

    @cute.jit
    def mma(self, mma_s, mma_dv, mma_dk, mma_dq, t_ptr, tP_layout, tdS_layout, smem: "_Smem",
            pipes: _Pipes, sched: _Sched, qblocks):
        tS, tdP, tdV, tdK, tdQ, tP, tdS = self._tmem_tensors(mma_s, mma_dv, mma_dk, mma_dq,
                                                             t_ptr, tP_layout, tdS_layout)
        acc = (tS, tdP, tdV, tdK, tdQ, tP, tdS)
        ops = self._smem_operands(mma_s, mma_dv, mma_dk, mma_dq, smem)
        total = self._num_tiles(sched, qblocks)
        dkv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        if total > 0:
            pipes.kv.consumer_wait(pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, 1))
            Cons, Prod = pipeline.PipelineUserType.Consumer, pipeline.PipelineUserType.Producer
            # Sᵀ of the first tile, then per tile: its dPᵀ, dV, the NEXT tile's Sᵀ (so that
            # the tensor core has it done while the compute warps form this tile's dS), dK, dQ.
            # The last tile is peeled (no next Sᵀ): no pipeline state changes under a runtime
            # branch.
            q_next = pipeline.make_pipeline_state(Cons, self.q_stages)
            s_state = pipeline.make_pipeline_state(Prod, 1)
            s_state = self._issue_s(mma_s, tS, ops, pipes, q_next, s_state)
            q_cur = q_next.clone()
            q_next.advance()
            st = (q_cur, q_next, pipeline.make_pipeline_state(Cons, self.do_stages), s_state,
                  pipeline.make_pipeline_state(Prod, 1), pipeline.make_pipeline_state(Cons, 1),
                  pipeline.make_pipeline_state(Cons, 1), pipeline.make_pipeline_state(Prod, 1))
            for done in cutlass.range(total - 1, unroll=1):
                st = self._mma_tile(mma_s, mma_dv, mma_dk, mma_dq, acc, ops, pipes, st,
                                    done > 0, True)
            st = self._mma_tile(mma_s, mma_dv, mma_dk, mma_dq, acc, ops, pipes, st, total > 1,
                                False)
            pipes.dkv.producer_acquire(dkv_state)
            pipes.dkv.producer_commit(dkv_state)  # arrives when every MMA above has completed

    @cute.jit
    def _issue_s(self, mma_s, tS, ops: "_MmaOps", pipes: _Pipes, q_state, s_state):
        """Wait for a tile's Q, issue its Sᵀ = K Qᵀ, signal the compute warps."""
        pipes.q.consumer_wait(q_state)
        pipes.s.producer_acquire(s_state)  # the compute warps are done with the last Sᵀ / Pᵀ
        tcgen05_fence(after=True)
        self._gemm(mma_s, tS, ops.tSrK, ops.tSrQ[None, None, None, q_state.index], False)
        pipes.s.producer_commit(s_state)
        s_state.advance()
        return s_state

    @cute.jit
    def _mma_tile(self, mma_s, mma_dv, mma_dk, mma_dq, acc, ops: "_MmaOps", pipes: _Pipes, st,
                  accumulate, next_s: cutlass.Constexpr):
        """One q tile (its Sᵀ already issued) in the order of the module docstring; with
        ``next_s``, the next tile's Sᵀ after this tile's dV. The MMA warp does not need the
        tiles' indices: the load warp put Q(m) and dO(m) into the stages in walk order.
        The next Sᵀ overwrites this tile's Pᵀ after dV (issued earlier: in order) and only once
        the compute warps have released Sᵀ; Q has two stages, so the next tile's Q is loaded
        while this tile's dK still reads its own."""
        tS, tdP, tdV, tdK, tdQ, tP, tdS = acc
        q_cur, q_next, do_state, s_state, dp_state, p_state, ds_state, dq_state = st
        pipes.do.consumer_wait(do_state)
        pipes.dq.producer_acquire(dq_state)  # the last dQ was read out: dPᵀ overwrites it
        pipes.dp.producer_acquire(dp_state)
        tcgen05_fence(after=True)
        self._gemm(mma_s, tdP, ops.tPrV, ops.tPrdO[None, None, None, do_state.index], False)
        pipes.dp.producer_commit(dp_state)
        dp_state.advance()
        pipes.p.consumer_wait(p_state)
        tcgen05_fence(after=True)
        self._gemm_split(mma_dv, tdV, tP[0], tP[1], ops.tVrdO[None, None, None, do_state.index],
                         accumulate)
        pipes.p.consumer_release(p_state)
        p_state.advance()
        pipes.do.consumer_release(do_state)
        do_state.advance()
        if const_expr(next_s):
            s_state = self._issue_s(mma_s, tS, ops, pipes, q_next, s_state)
            q_next.advance()
        pipes.ds.consumer_wait(ds_state)
        tcgen05_fence(after=True)
        self._gemm_split(mma_dk, tdK, tdS[0], tdS[1], ops.tKrQ[None, None, None, q_cur.index],
                         accumulate)
        self._gemm(mma_dq, tdQ, ops.tQrdS, ops.tQrK, False)
        pipes.dq.producer_commit(dq_state)
        dq_state.advance()
        pipes.ds.consumer_release(ds_state)
        ds_state.advance()
        pipes.q.consumer_release(q_cur)
        q_cur.advance()
        return q_cur, q_next, do_state, s_state, dp_state, p_state, ds_state, dq_state

    # -----------------------------------------------------------------------------------------
    # Compute warpgroups
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def compute(self, mma_s, mma_dv, mma_dk, t_ptr, pipes: _Pipes, sched: _Sched, sdS,
                mLSE2, mDelta, mdK, mdV, softmax_scale: Float32, qblocks, qorder, aux: Aux,
                accs: tuple):
        tidx = cute.arch.thread_idx()[0] % 128  # the key row (TMEM lane)
        wg = cute.arch.make_warp_uniform((cute.arch.warp_idx() - _COMPUTE_WARP0) // 4)
        thr_s = mma_s.get_slice(0)
        s_layout = thr_s.make_fragment_C(thr_s.partition_shape_C((TILE_N, TILE_M))).layout
        chunk = cute.make_layout((TILE_N, CHUNK))
        # This warpgroup's columns of Sᵀ and dPᵀ: [64·wg, 64·wg + 64).
        col0 = wg * HALF
        tS_chunk = cute.make_tensor(t_ptr + _TMEM_S + col0, cute.composition(s_layout, chunk))
        tdP_chunk = cute.make_tensor(t_ptr + _TMEM_DP + col0, cute.composition(s_layout, chunk))
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(CHUNK)), Float32),
            tS_chunk).get_slice(tidx)
        tTtS = [ld.partition_S(cute.make_tensor(tS_chunk.iterator + CHUNK * c, tS_chunk.layout))
                for c in range(HALF // CHUNK)]
        tTtdP = [ld.partition_S(cute.make_tensor(tdP_chunk.iterator + CHUNK * c,
                                                 tdP_chunk.layout))
                 for c in range(HALF // CHUNK)]
        tTcS = ld.partition_D(cute.composition(
            thr_s.partition_C(cute.make_identity_tensor((TILE_N, TILE_M))), chunk))
        # 16-bit Pᵀ / dSᵀ: this warpgroup's 64 values in 32 columns over what it read, written
        # a chunk (16 values, 8 columns) at a time right after the chunk is formed: writing all
        # 64 at the end kept 32 packed registers live beside the next phase's loads (spills).
        cols = CHUNK * self.dtype.width // 32
        w_layout = cute.composition(s_layout, cute.make_layout((TILE_N, cols)))
        st = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(cols)),
                                Float32), cute.make_tensor(t_ptr + _TMEM_S + col0, w_layout)
        ).get_slice(tidx)
        tTtP = [st.partition_D(cute.make_tensor(t_ptr + _TMEM_S + col0 + cols * ci, w_layout))
                for ci in range(HALF // CHUNK)]
        tTtdS = [st.partition_D(cute.make_tensor(t_ptr + _TMEM_DP + col0 + cols * ci, w_layout))
                 for ci in range(HALF // CHUNK)]
        w_shape = st.partition_S(cute.composition(
            thr_s.partition_C(cute.make_identity_tensor((TILE_N, TILE_M))),
            cute.make_layout((TILE_N, cols)))).shape

        c = softmax.exp2_multiplier(self.score_mod, softmax_scale)
        cx = _ComputeCtx(ld, tTtS, tTtdP, tTcS, st, tTtP, tTtdS, w_shape, sdS, c,
                         softmax_scale, sched, aux, accs, tidx, col0, wg, mLSE2, mDelta)
        Cons, Prod = pipeline.PipelineUserType.Consumer, pipeline.PipelineUserType.Producer
        states = (pipeline.make_pipeline_state(Cons, 1), pipeline.make_pipeline_state(Cons, 1),
                  pipeline.make_pipeline_state(Prod, 1), pipeline.make_pipeline_state(Prod, 1))
        kv_ragged = (sched.n_block + 1) * TILE_N > sched.seqlen_k
        g = sched.group
        for gi in cutlass.range(g, unroll=1):
            head = sched.head_kv * g + gi
            if const_expr(self.sparse and self.deterministic):
                n_part, _, part_row, _ = self._q_lists(qblocks, sched, head)
                _, full_row = order_rows(qorder, sched.batch, head, sched.n_block)
                for j in cutlass.range(n_part, unroll=1):
                    m = part_row[j]
                    if full_row[j] != 0:
                        states = self._full_tile(cx, pipes, states, head, m, kv_ragged)
                    else:
                        states = self._tile(cx, pipes, states, head, m, "partial")
            elif const_expr(self.sparse):
                n_part, n_full, part_row, full_row = self._q_lists(qblocks, sched, head)
                for j in cutlass.range(n_part, unroll=1):
                    states = self._tile(cx, pipes, states, head, part_row[j], "partial")
                for j in cutlass.range(n_full, unroll=1):
                    states = self._full_tile(cx, pipes, states, head, full_row[j], kv_ragged)
            else:
                for m in cutlass.range(sched.n_q_tiles, unroll=1):
                    if const_expr(self.mask_mod is not None):
                        states = self._tile(cx, pipes, states, head, m, "partial")
                    else:
                        states = self._full_tile(cx, pipes, states, head, m, kv_ragged)
        self.epilogue(cx, t_ptr, mma_dv, mma_dk, pipes, wg, mdK, mdV, qblocks)

    @cute.jit
    def _full_tile(self, cx, pipes, states, head: Int32, m: Int32, kv_ragged):
        if kv_ragged or (m + 1) * TILE_M > cx.sched.seqlen_q:
            states = self._tile(cx, pipes, states, head, m, "bounded")
        else:
            states = self._tile(cx, pipes, states, head, m, "full")
        return states

    @cute.jit
    def _tile(self, cx: "_ComputeCtx", pipes: _Pipes, states, head: Int32, m: Int32,
              kind: cutlass.Constexpr):
        """One q tile for this thread's key and its warpgroup's 64 queries: P (16-bit, to TMEM)
        and P∘dscore (registers) from Sᵀ; then dS from dPᵀ, to TMEM and smem."""
        s_state, dp_state, p_state, ds_state = states
        sched = cx.sched
        q0 = m * TILE_M + cx.col0  # this warpgroup's first query
        lse_row = cx.mLSE2[None, head, sched.batch]
        delta_row = cx.mDelta[None, head, sched.batch]
        n_chunks = HALF // CHUNK
        bits = None
        if const_expr(kind == "partial" and self.mask_mod is not None):
            # mask_mod (and the bounds) as bits before Sᵀ is waited for: its loads and index
            # math run under the MMAs and never sit in registers beside P∘dscore.
            bits = self._mask_bits(cx, head, q0)
        pipes.s.consumer_wait(s_state)
        tcgen05_fence(after=True)
        pipes.p.producer_acquire(p_state)  # the last dV has read Pᵀ
        kept = []
        for ci in cutlass.range_constexpr(n_chunks):
            rS, rL = self._load_chunk(cx, cx.tTtS, lse_row, q0, ci)
            rP32 = cute.make_rmem_tensor(cx.w_shape, Float32)
            self._probabilities(cx, rS, rL, cute.recast_tensor(rP32, self.dtype), head,
                                q0, CHUNK * ci, kind, bits)
            cute.copy(cx.st, rP32, cx.tTtP[ci])  # over S columns this thread has read
            kept.append(rS)
        cute.arch.fence_view_async_tmem_store()
        tcgen05_fence(after=False)
        pipes.p.producer_commit(p_state)
        p_state.advance()
        pipes.s.consumer_release(s_state)
        s_state.advance()

        pipes.dp.consumer_wait(dp_state)
        tcgen05_fence(after=True)
        sums = None
        if const_expr(self.score_grads is not None):
            sums = [Float32(0.0) for _ in range(len(self.grad_offsets.uniform))]
        pipes.ds.producer_acquire(ds_state)  # the last dK/dQ MMAs have read dSᵀ and dS
        # dS (queries × keys, MN-major) in smem: this thread's key column, 16-byte runs of 8
        # queries. Addressed from opaque indices: hoisted out of the tile loop, the swizzled
        # addresses stayed live across it and spilled. (The warpgroup's 64 queries are one
        # 64-row column of swizzle atoms: HALF = 64.)
        sdS_rows = cute.make_tensor(cx.sdS.iterator, cute.make_layout(
            (HALF, TILE_M // HALF, TILE_N), stride=(1, HALF * TILE_N, HALF)))
        my_dS = sdS_rows[None, opaque_i32(cx.wg), opaque_i32(cx.tidx)]  # this key's 64 queries
        for ci in cutlass.range_constexpr(n_chunks):
            rdP, rD = self._load_chunk(cx, cx.tTtdP, delta_row, q0, ci)
            if const_expr(self.score_grads is not None):
                sums = self._captured_grads(cx, kept[ci], rdP, rD, head, q0 + CHUNK * ci, sums)
            else:
                for i in cutlass.range_constexpr(CHUNK):
                    rdP[i] = kept[ci][i] * (rdP[i] - rD[i])
            rdS32 = cute.make_rmem_tensor(cx.w_shape, Float32)
            rdS = cute.recast_tensor(rdS32, self.dtype)
            rdS.store(rdP.load().to(self.dtype))
            cute.copy(cx.st, rdS32, cx.tTtdS[ci])  # over dPᵀ columns this thread has read
            for r in cutlass.range_constexpr(CHUNK // 8):
                run = cute.make_tensor(rdS.iterator + 8 * r, cute.make_layout(8))
                cute.autovec_copy(run, cute.local_tile(my_dS, (8,), (ci * (CHUNK // 8) + r,)))
        cute.arch.fence_view_async_tmem_store()
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes -> the MMA (async proxy)
        tcgen05_fence(after=False)
        pipes.ds.producer_commit(ds_state)
        ds_state.advance()
        pipes.dp.consumer_release(dp_state)
        dp_state.advance()
        if const_expr(self.score_grads is not None):
            self._flush_uniform_grads(cx, sums, head, q0)
        return s_state, dp_state, p_state, ds_state

    @cute.jit
    def _probabilities(self, cx, rS: cute.Tensor, rL: cute.Tensor, rP: cute.Tensor, head: Int32,
                       q0: Int32, col0: cutlass.Constexpr, kind: cutlass.Constexpr, bits):
        """In place on one chunk (this thread's key, queries q0 + col0 + i): Sᵀ -> P ∘ dscore
        (fp32, for dS; P alone with captured gradients), and P (16-bit) into ``rP``.
        kind: "partial" = mask_mod and bounds (from ``bits``, ``_mask_bits``); "bounded" =
        bounds; "full" = neither. The sm90 backward's ``_probabilities``, element for element."""
        use_bound = kind != "full"
        sched = cx.sched
        kv_idx = sched.n_block * TILE_N + cx.tidx
        neg_inf = -Float32.inf
        q_first = q0 + col0
        indices = FloatIndices(q_first, kv_idx)
        kv_in = kv_idx < sched.seqlen_k
        score_mod = bind(self.score_mod, sched.batch, head, cx.aux)
        for i in cutlass.range_constexpr(CHUNK):
            q_idx = q_first + i
            s = rS[i]
            ds = Float32(1.0)
            if const_expr(self.score_mod is not None):
                s, ds = score_mod(s * cx.softmax_scale, sched.batch, head, q_idx, kv_idx,
                                  cx.aux, *indices.args(self.score_mod, q_idx, kv_idx, (i, 0)))
            ok = None
            if const_expr(bits is not None):
                col = col0 + i
                ok = kept(bits, col)
            elif const_expr(use_bound):
                ok = cutlass.and_(q_idx < sched.seqlen_q, kv_in)
            if const_expr(ok is not None):
                s = where(ok, s, neg_inf)
            p = cute.math.exp2(cute.fma(s, cx.c, -rL[i]), fastmath=True)
            rP[i] = p.to(self.dtype)
            if const_expr(self.score_grads is not None):
                rS[i] = p  # P∘(dP − delta) comes first (``_captured_grads``)
            elif const_expr(self.score_mod is not None):
                rS[i] = softmax.p_dscore(p, ds, ok)
            else:
                rS[i] = p

    def _load_chunk(self, cx, tTt, row: cute.Tensor, q0: Int32, ci: int):
        """Chunk ``ci`` of this thread's TMEM column ``tTt`` (Sᵀ or dPᵀ, by chunk) into registers,
        and the matching CHUNK of the per-query vector ``row`` (LSE2 or Delta) from query ``q0``
        on: (column, vector)."""
        r = cute.make_rmem_tensor(cx.tTcS.shape, Float32)
        cute.copy(cx.ld, tTt[ci], r)
        cute.arch.fence_view_async_tmem_load()
        rv = cute.make_rmem_tensor((CHUNK,), Float32)
        cute.autovec_copy(cute.local_tile(row, (CHUNK,), (q0 // CHUNK + ci,)), rv)
        return r, rv

    @cute.jit
    def _mask_bits(self, cx, head: Int32, q0: Int32):
        """mask_mod and both bounds for this thread's key over the warpgroup's 64 queries, as
        two 32-bit words (bit i of word w keeps query q0 + 32·w + i). A runtime loop over the
        words, as the forward's ``_mask_bits``: unrolled, ptxas kept every query's index math
        live at once."""
        sched = cx.sched
        kv_idx = sched.n_block * TILE_N + cx.tidx
        w0 = w1 = cutlass.Uint32(0)
        for w in cutlass.range(HALF // 32, unroll=1):
            word = mask_word(self.mask_mod, sched.batch, head, kv_idx, q0 + 32 * w,
                             sched.seqlen_q, cx.aux, False)
            w0 = word if w == 0 else w0
            w1 = word if w == 1 else w1
        if kv_idx >= sched.seqlen_k:
            w0 = cutlass.Uint32(0)
            w1 = cutlass.Uint32(0)
        return w0, w1

    @cute.jit
    def _captured_grads(self, cx, rP: cute.Tensor, rdP: cute.Tensor, rD: cute.Tensor,
                        head: Int32, q_first: Int32, sums):
        """dS with captured-tensor gradients (the sm90 backward's ``_captured_grads``): per
        element g = P∘(dP − delta); for every learnable load j, acc_j[offset_j] += g · d score /
        d load_j in fp64 (uniform loads summed per thread, flushed per warp at the tile's end);
        dS = g · d score / d score into ``rdP``."""
        sched = cx.sched
        # The indices through opaque moves plus a data dependency on dPᵀ (0 unless it is NaN),
        # as the sm90 backward's ``_captured_grads``: otherwise the compiler reuses the index
        # math, float indices and load addresses of the score_mod's evaluation in
        # ``_probabilities`` (the same expressions), keeping them live across the dPᵀ wait.
        after_dp = Int32(cutlass.select_(rdP[0] != rdP[0], Int32(1), Int32(0)))
        kv_idx = opaque_i32(sched.n_block * TILE_N + cx.tidx) + after_dp
        q_first = opaque_i32(q_first) + after_dp
        head_o = opaque_i32(head)
        indices = FloatIndices(q_first, kv_idx)
        sums = list(sums)
        for i in cutlass.range_constexpr(CHUNK):
            q_idx = q_first + i
            g = rP[i] * (rdP[i] - rD[i])
            rdP[i] = captured_grads.element(g, sched.batch, head_o, q_idx, kv_idx, cx.aux, indices,
                                            sums, self.score_grads, self.grad_offsets, cx.accs,
                                            None, True, (i, 0))
        return sums

    @cute.jit
    def _flush_uniform_grads(self, cx, sums, head: Int32, q_first: Int32):
        """The uniform loads' per-thread sums: a warp butterfly, then one fp64 add by lane 0."""
        if const_expr(any(self.grad_offsets.uniform)):
            sched = cx.sched
            kv_idx = sched.n_block * TILE_N + cx.tidx
            indices = FloatIndices(q_first, kv_idx)
            offsets = self.grad_offsets(sched.batch, head, q_first, kv_idx, cx.aux,
                                        *indices.args(self.grad_offsets, q_first, kv_idx))
            captured_grads.flush_uniform(sums, offsets, self.grad_offsets, cx.accs, True)

    @cute.jit
    def epilogue(self, cx, t_ptr, mma_dv, mma_dk, pipes: _Pipes, wg: Int32, mdK, mdV, qblocks):
        """Warpgroup 0: dK · scale, warpgroup 1: dV, from TMEM (one key row per thread) to
        global memory (16-byte stores; rows >= S skipped). No q tile visited: zeros."""
        sched = cx.sched
        total = self._num_tiles(sched, qblocks)
        if total > 0:
            pipes.dkv.consumer_wait(pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, 1))
            tcgen05_fence(after=True)
        row = sched.n_block * TILE_N + cx.tidx
        in_bounds = row < sched.seqlen_k
        safe_row = cutlass.max(cutlass.min(row, sched.seqlen_k - 1), 0)
        if wg == 0:
            self._store_rows(cx, t_ptr + self.tmem_dk, mma_dk, self.head_dim,
                             mdK[safe_row, None, sched.head_kv, sched.batch], cx.softmax_scale,
                             total > 0, in_bounds)
        else:
            self._store_rows(cx, t_ptr + self.tmem_dv, mma_dv, self.head_dim_v,
                             mdV[safe_row, None, sched.head_kv, sched.batch], Float32(1.0),
                             total > 0, in_bounds)

    @cute.jit
    def _store_rows(self, cx, t_acc, tiled, dim: cutlass.Constexpr, gX: cute.Tensor, factor,
                    has_work, in_bounds):
        thr = tiled.get_slice(0)
        layout = thr.make_fragment_C(thr.partition_shape_C((TILE_N, dim))).layout
        chunk = cute.make_layout((TILE_N, CHUNK))
        t_chunk = cute.make_tensor(t_acc, cute.composition(layout, chunk))
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(CHUNK)), Float32),
            t_chunk).get_slice(cx.tidx)
        shape = ld.partition_D(cute.composition(
            thr.partition_C(cute.make_identity_tensor((TILE_N, dim))), chunk)).shape
        for ci in cutlass.range_constexpr(dim // CHUNK):
            r = cute.make_rmem_tensor(shape, Float32)
            if has_work:
                src = cute.make_tensor(t_chunk.iterator + CHUNK * ci, t_chunk.layout)
                cute.copy(ld, ld.partition_S(src), r)
                cute.arch.fence_view_async_tmem_load()
            else:
                r.fill(0.0)
            out = cute.make_rmem_tensor(cute.make_layout(CHUNK), self.dtype)
            out.store((r.load() * factor).to(self.dtype))
            if in_bounds:
                cute.autovec_copy(out, cute.local_tile(gX, (CHUNK,), (ci,)))

    # -----------------------------------------------------------------------------------------
    # dQ reduce warpgroup
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def reduce(self, mma_dq, t_ptr, pipes: _Pipes, sched: _Sched, mdQacc, qblocks, qorder,
               mSem):
        """Per tile: dQ (this thread's query row, D columns) from TMEM, added into the fp32
        accumulator. Deterministic mode: the tile's semaphore is waited for (it must equal this
        kv block's rank) before the adds and incremented after them (release, gpu scope)."""
        tidx = cute.arch.thread_idx()[0] % 128
        thr = mma_dq.get_slice(0)
        layout = thr.make_fragment_C(thr.partition_shape_C((TILE_M, self.head_dim))).layout
        chunk = cute.make_layout((TILE_M, DQ_CHUNK))
        t_chunk = cute.make_tensor(t_ptr + self.tmem_dq, cute.composition(layout, chunk))
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(DQ_CHUNK)),
                                Float32), t_chunk).get_slice(tidx)
        tTt = [ld.partition_S(cute.make_tensor(t_chunk.iterator + DQ_CHUNK * c, t_chunk.layout))
               for c in range(self.head_dim // DQ_CHUNK)]
        shape = ld.partition_D(cute.composition(
            thr.partition_C(cute.make_identity_tensor((TILE_M, self.head_dim))), chunk)).shape
        rx = _ReduceCtx(ld, tTt, shape, tidx, sched, mdQacc, mSem)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        g = sched.group
        for gi in cutlass.range(g, unroll=1):
            head = sched.head_kv * g + gi
            if const_expr(self.sparse):
                n_part, n_full, part_row, full_row = self._q_lists(qblocks, sched, head)
                if const_expr(self.deterministic):
                    rank_row, _ = order_rows(qorder, sched.batch, head, sched.n_block)
                    for j in cutlass.range(n_part, unroll=1):
                        state = self._reduce_tile(rx, pipes, state, head, part_row[j],
                                                  rank_row[j])
                else:
                    for j in cutlass.range(n_part, unroll=1):
                        state = self._reduce_tile(rx, pipes, state, head, part_row[j], None)
                    for j in cutlass.range(n_full, unroll=1):
                        state = self._reduce_tile(rx, pipes, state, head, full_row[j], None)
            else:
                rank = None
                if const_expr(self.deterministic):
                    rank = sched.n_kv_tiles - 1 - sched.n_block
                for m in cutlass.range(sched.n_q_tiles, unroll=1):
                    state = self._reduce_tile(rx, pipes, state, head, m, rank)

    @cute.jit
    def _reduce_tile(self, rx: "_ReduceCtx", pipes: _Pipes, state, head: Int32, m: Int32, rank):
        sched = rx.sched
        row = m * TILE_M + rx.tidx
        in_bounds = row < sched.seqlen_q  # rows >= L add zeros: skipped
        gdQ = rx.mdQacc[row, None, head, sched.batch]  # (D,) row < Lpad always
        sem_ptr = None
        if const_expr(self.deterministic):
            sem_ptr = rx.mSem[sched.batch, head, None].iterator + m
            if rx.tidx == 0:
                seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                while seen != rank:
                    seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
            cute.arch.barrier(barrier_id=_BAR_REDUCE, number_of_threads=128)
        pipes.dq.consumer_wait(state)
        tcgen05_fence(after=True)
        for ci in cutlass.range_constexpr(self.head_dim // DQ_CHUNK):
            r = cute.make_rmem_tensor(rx.shape, Float32)
            cute.copy(rx.ld, rx.tTt[ci], r)
            cute.arch.fence_view_async_tmem_load()
            if const_expr(ci == self.head_dim // DQ_CHUNK - 1):
                tcgen05_fence(after=False)
                pipes.dq.consumer_release(state)  # dQ is in registers: dPᵀ may overwrite it
            if in_bounds:
                for i in cutlass.range_constexpr(DQ_CHUNK):
                    cute.arch.red(gdQ.iterator + (DQ_CHUNK * ci + i), r[i], op="add", dtype="f32",
                                  sem="relaxed", scope="gpu")
        state.advance()
        if const_expr(self.deterministic):
            # Every thread's adds, then one release increment (cumulative through the barrier).
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=_BAR_REDUCE, number_of_threads=128)
            if rx.tidx == 0:
                cute.arch.atomic_add(sem_ptr, Int32(1), sem="release", scope="gpu")
        return state


# The MMA warp's smem operands, each a (tile, swizzle) pair.
_Smem = namedtuple("_Smem", "sK sKt sV sQ sQt sdO sdOt sdS")


# The MMA warp's smem operand fragments, per MMA: Sᵀ (K, Q), dPᵀ (V, dO), dV (dO), dK (Q), dQ (dS, K).
_MmaOps = namedtuple("_MmaOps", "tSrK tSrQ tPrV tPrdO tVrdO tKrQ tQrdS tQrK")


# A compute warpgroup's state threaded through the per-tile helpers (trace-time).
_ComputeCtx = namedtuple("_ComputeCtx", "ld tTtS tTtdP tTcS st tTtP tTtdS w_shape sdS c "
                         "softmax_scale sched aux accs tidx col0 wg mLSE2 mDelta")


# The dQ reduce warpgroup's state (trace-time).
_ReduceCtx = namedtuple("_ReduceCtx", "ld tTt shape tidx sched mdQacc mSem")


# ---------------------------------------------------------------------------------------------
# Postprocess: dQ = accumulator · scale (row-major accumulator, 16-byte vectors)
# ---------------------------------------------------------------------------------------------
class FlexAttentionBwdPostSm100(common.DqPostprocess):
    """dq[b, h, row] = dqacc[b, h, row] · softmax_scale in the input dtype, rows < L (one row a
    work item)."""

    def grid(self, mdQ: cute.Tensor) -> list:
        return [cute.ceil_div(mdQ.shape[2], self.per_cta), mdQ.shape[1], mdQ.shape[0]]

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        row = bx * self.per_cta + tidx // self.lanes_per_row
        part = tidx % self.lanes_per_row
        if row < mdQ.shape[2]:
            acc = cute.make_rmem_tensor((8,), Float32)
            cute.autovec_copy(cute.local_tile(mdQacc[batch, head, row, None], (8,), (part,)), acc)
            out = cute.make_rmem_tensor((8,), self.dtype)
            out.store((acc.load() * softmax_scale).to(self.dtype))
            cute.autovec_copy(out, cute.local_tile(mdQ[batch, head, row, None], (8,), (part,)))


# ---------------------------------------------------------------------------------------------
# Host API (TVM-FFI only)
# ---------------------------------------------------------------------------------------------
def _pre_config(cfg: BwdConfig) -> _Sm90BwdConfig:
    """The sm90 preprocess's configuration: it reads the dtype, head dims, its semaphore tile
    (2 semaphores per 64 rows, a superset of this kernel's one per 128) and determinism."""
    return _Sm90BwdConfig(cfg.head_dim, cfg.head_dim_v, cfg.dtype, deterministic=cfg.deterministic)


def _sem_len(cfg: BwdConfig, lpad: int) -> int:
    """Semaphores per (b, h) that the sm90 preprocess zeroes (2 per its 64-row q tile); this
    kernel uses the first lpad / 128 (one per 128-row q tile)."""
    n = 2 * (lpad // _pre_config(cfg).tiling.tile_m)
    assert n >= lpad // TILE_M
    return n


class CompiledBwd(host.CompiledBwd):
    """The three compiled kernels of one sm100 backward (never launched: no Blackwell GPU has
    run them), launched by ``host.CompiledBwd`` with this kernel's semaphore count and checks."""

    NAME = "cute_sm100_bwd"

    def sem_len(self, lpad: int) -> int:
        return _sem_len(self.cfg, lpad)

    def check_operands(self, q, k, v, dq, dk, dv) -> None:
        """No K/V batch broadcast (its dK/dV are shaped like k/v), and TMA-ready operands."""
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"{self.NAME}: inconsistent shapes")
        for name, t in (("q", q), ("k", k), ("v", v), ("dq", dq), ("dk", dk), ("dv", dv)):
            if not host.tma_ready(t):
                raise ValueError(f"cute_sm100_bwd: {name} needs a contiguous last dim, a 16-byte "
                                 "aligned base and 16-byte multiple strides")

    def __call__(self, *args, **kwargs):
        if any(p.ffi_fn is None for p in self.parts.values()):
            raise RuntimeError(f"this sm100 backward was compiled for {GPU_ARCH} in a process "
                               "that cannot launch it: compile-only")
        return super().__call__(*args, **kwargs)


def compile_bwd(cfg: BwdConfig, aux_tensors=(), aux_scalars=(), options: str = "",
                parts=PARTS) -> CompiledBwd:
    """Compile the backward's kernels for sm_100a (whatever CUTE_DSL_ARCH says); sizes, strides,
    batch and heads stay runtime values. With ``options='--keep-ptx --dump-dir X'`` each part's
    ``compiled.__ptx__`` names its PTX."""
    host.require_tvm_ffi("cute_sm100_bwd")
    kernels = {
        "pre": lambda: (FlexAttentionBwdPreSm90(_pre_config(cfg)), host.placeholder_pre_args(cfg)),
        "main": lambda: (FlexAttentionBwdSm100(cfg),
                         host.placeholder_main_args(cfg, aux_tensors, aux_scalars)),
        "post": lambda: (FlexAttentionBwdPostSm100(cfg), host.placeholder_post_args(cfg)),
    }
    built = host.compile_parts(kernels, host.compile_options(options, GPU_ARCH), parts,
                               host.launcher)
    return CompiledBwd(cfg, built, host.aux_signature(aux_tensors, aux_scalars))


def load_bwd(cfg: BwdConfig, ffi_fns: dict, signature=()) -> CompiledBwd:
    """A ``CompiledBwd`` from functions loaded from the disk cache ({part: tvm_ffi.Function}):
    nothing in it was compiled in this process (``Part.compiled`` is None)."""
    return CompiledBwd(cfg, host.load_parts(ffi_fns), signature)
