"""The sm90 backward's memory-bound kernels around the main one: the preprocess (delta, lse2,
the dQ accumulator zeroed) and the postprocesses (dQ from its fp32 accumulator, plain or, for
the swapped dQ GEMM, transposed). One 16-byte vector per thread per row chunk."""
import math
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.memory.smem import SmemAllocator

from flexjit.templates.cute.common import LOG2_E, DqPostprocess, launch


class FlexAttentionBwdPreSm90:
    """delta = rowsum(dO∘O) − dLSE, lse2 = LSE·log2 e (both 0 on a row with nothing kept and
    on padding rows), dQ accumulator (and semaphores) zeroed. A row is handled by Dv/8 lanes."""

    def __init__(self, cfg):
        self.dtype = cfg.dtype
        self.head_dim, self.head_dim_v = cfg.head_dim, cfg.head_dim_v
        self.tile_m = cfg.tiling.tile_m
        self.deterministic = cfg.deterministic
        self.lanes_per_row = _lanes_per_row(self.head_dim_v)
        self.rows_per_cta = 128 // self.lanes_per_row

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor,
                 has_dlse: Int32, mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor,
                 mSem: Optional[cute.Tensor], stream: cuda.CUstream):
        grid = [cute.ceil_div(mLSE2.shape[2], self.rows_per_cta), mO.shape[1], mO.shape[0]]
        launch(self.kernel(mO, mdO, mLSE, mdLSE, has_dlse, mLSE2, mDelta, mdQacc, mSem), grid, 128,
               stream, one_cta_per_sm=False)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor,
               has_dlse: Int32, mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor,
               mSem: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        lpr = self.lanes_per_row
        row = bx * self.rows_per_cta + tidx // lpr
        part = tidx % lpr
        seqlen_q = mO.shape[2]
        dot = Float32(0.0)
        chunk = self.head_dim_v // lpr  # elements per lane: 8, or 24 for Dv = 96
        if row < seqlen_q:
            rO = cute.make_rmem_tensor((chunk,), self.dtype)
            rdO = cute.make_rmem_tensor((chunk,), self.dtype)
            cute.autovec_copy(cute.local_tile(mO[batch, head, row, None], (chunk,), (part,)), rO)
            cute.autovec_copy(cute.local_tile(mdO[batch, head, row, None], (chunk,), (part,)), rdO)
            for i in cutlass.range_constexpr(chunk):
                dot += rO[i].to(Float32) * rdO[i].to(Float32)
        for off in cutlass.range_constexpr(int(math.log2(lpr))):
            dot += cute.arch.shuffle_sync_bfly(dot, offset=(lpr // 2) >> off)
        if row < mLSE2.shape[2]:
            if part == 0:
                lse2 = Float32(0.0)
                delta = Float32(0.0)
                if row < seqlen_q:
                    lse = mLSE[batch, head, row]
                    kept = lse != -Float32.inf
                    lse2 = lse * LOG2_E if kept else Float32(0.0)
                    delta = dot
                    if has_dlse != 0:
                        # d lse / d s = P, so an LSE gradient only shifts delta.
                        dlse = mdLSE[batch, head, row]
                        delta = delta - (dlse if kept else Float32(0.0))
                mLSE2[batch, head, row] = lse2
                mDelta[batch, head, row] = delta
                if const_expr(self.deterministic):
                    if row % self.tile_m == 0:  # one semaphore per dQ box: 2 per q tile
                        mSem[batch, head, 2 * (row // self.tile_m)] = Int32(0)
                        mSem[batch, head, 2 * (row // self.tile_m) + 1] = Int32(0)
            per = self.head_dim // lpr
            zeros = cute.make_rmem_tensor((per,), Float32)
            zeros.fill(0.0)
            cute.autovec_copy(zeros, cute.local_tile(mdQacc[batch, head, row, None], (per,), (part,)))


def _lanes_per_row(head_dim: int) -> int:
    """Lanes that share one row in the preprocess: one 16-byte vector (8 elements) each
    when head_dim / 8 is a power of two (32: 4, 64: 8, 128: 16), else the largest power of two
    dividing it, each lane taking several vectors (96: 4 lanes of 24 elements). A power of two
    dividing 32, so that a row's lanes sit in one warp and the butterfly reduction covers them
    exactly (12 lanes for 96 would straddle warps and leave 8 threads on the next CTA's rows)."""
    n = head_dim // 8
    return n & -n


class FlexAttentionBwdPostSm90(DqPostprocess):
    """dQ = accumulator · softmax_scale, converted to the input dtype (rows < L only).

    The accumulator is dQ permuted within 16-row × 8-column blocks (``dq_box_view``): a
    thread takes accumulator rows 16a + 2ρ + {0, 1}, columns 8g..8g+7 (two 16-byte loads per
    row), which hold dQ rows 16a + ρ + {0, 8}, columns 8g..8g+7 (one 16-byte store each)."""

    def grid(self, mdQ: cute.Tensor) -> list:
        # A work item (unit): 2 accumulator rows. D = 96: 12 lanes, 10 units; the 8 spare threads
        # redo the next CTA's first unit, writing the same values (no reduction here: benign).
        return [cute.ceil_div(cute.ceil_div(mdQ.shape[2], 16) * 8, self.per_cta),
                mdQ.shape[1], mdQ.shape[0]]

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        lpr = self.lanes_per_row
        unit = bx * self.per_cta + tidx // lpr  # = 8a + ρ
        g = tidx % lpr
        base = 16 * (unit // 8) + unit % 8  # dQ row 16a + ρ
        if base < mdQ.shape[2]:
            acc = [cute.make_rmem_tensor((8,), Float32) for _ in range(2)]  # acc. row 16a+2ρ+t1
            for t1 in cutlass.range_constexpr(2):
                cute.autovec_copy(
                    cute.local_tile(mdQacc[batch, head, 2 * unit + t1, None], (8,), (g,)), acc[t1])
            for h in cutlass.range_constexpr(2):
                row = base + 8 * h
                if row < mdQ.shape[2]:
                    out = cute.make_rmem_tensor((8,), self.dtype)
                    # dQ column 8g + 2t + e, t = t0 + 2·t1: accumulator column 8g + 4·t0 + 2h + e
                    for t in cutlass.range_constexpr(4):
                        for e in cutlass.range_constexpr(2):
                            out[2 * t + e] = (acc[t // 2][4 * (t % 2) + 2 * h + e]
                                              * softmax_scale).to(self.dtype)
                    cute.autovec_copy(out, cute.local_tile(mdQ[batch, head, row, None], (8,), (g,)))


class FlexAttentionBwdPostTransposedSm90:
    """dQ = accumulator · softmax_scale from the transposed accumulator of ``dq_swapped``,
    (B, Hq, D, Lpad) fp32, permuted within 16-dim × 8-row blocks (``dq_box_view`` with head
    dims as its rows), into dQ (B, Hq, L, D). One 128-thread CTA per 64 query rows: coalesced
    16-byte loads along the rows, each value un-permuted into a (row, dim) smem tile (rows
    padded by one word, so that a warp's scattered 2-byte stores fall in distinct banks), then
    each dQ row written from it."""

    ROWS = 64  # query rows per CTA

    def __init__(self, cfg):
        self.dtype = cfg.dtype
        self.head_dim = cfg.head_dim
        self.pitch = self.head_dim + 2  # elements per smem row

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32,
                 stream: cuda.CUstream):
        grid = [cute.ceil_div(mdQ.shape[2], self.ROWS), mdQ.shape[1], mdQ.shape[0]]
        launch(self.kernel(mdQacc, mdQ, softmax_scale), grid, 128, stream, one_cta_per_sm=False)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        D, R, pitch = self.head_dim, self.ROWS, self.pitch
        base = SmemAllocator().allocate_array(self.dtype, R * pitch, byte_alignment=16)
        tile = cute.make_tensor(base, cute.make_layout((R, pitch), stride=(pitch, 1)))
        q0 = bx * R
        vecs = R // 4  # 16-byte vectors per accumulator row and CTA
        for k in cutlass.range_constexpr(D * vecs // 128):
            v = tidx + 128 * k
            dp, j = v // vecs, v % vecs  # accumulator row (a permuted head dim), vector
            acc = cute.make_rmem_tensor((4,), Float32)
            cute.autovec_copy(cute.local_tile(mdQacc[batch, head, dp, None], (4,), (q0 // 4 + j,)), acc)
            # accumulator (dp, 4j + x) holds dQᵀ (16a + 8h + ρ, 8g + 2t + e): dp = 16a + 2ρ + t//2,
            # column 8g + 4(t%2) + 2h + e (``dq_box_view``).
            a, rho, t_hi = dp // 16, (dp % 16) // 2, dp % 2
            g, t_lo = j // 2, j % 2
            for x in cutlass.range_constexpr(4):
                h, e = x // 2, x % 2
                dim = 16 * a + 8 * h + rho
                row = 8 * g + 2 * (2 * t_hi + t_lo) + e
                tile[row, dim] = (acc[x] * softmax_scale).to(self.dtype)
        cute.arch.sync_threads()
        for k in cutlass.range_constexpr(R * D // 8 // 128):
            v = tidx + 128 * k
            row, c8 = v // (D // 8), v % (D // 8)
            if q0 + row < mdQ.shape[2]:
                out = cute.make_rmem_tensor((8,), self.dtype)
                for x in cutlass.range_constexpr(8):
                    out[x] = tile[row, 8 * c8 + x]
                cute.autovec_copy(out, cute.local_tile(mdQ[batch, head, q0 + row, None], (8,), (c8,)))
