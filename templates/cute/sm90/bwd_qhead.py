"""The sm90 backward's dK/dV epilogue with one CTA per query head (``BwdTiling.q_head``).

g CTAs (the query heads of one kv head) produce partial dK and dV for the same kv tile; each adds
its fp32 accumulators into per-kv-head fp32 workspaces, (B, Hkv, Spad, D) and (B, Hkv, Spad, Dv),
zeroed by the host, with TMA reduce-add (``cp.reduce.async.bulk.tensor .add.f32``: the adds
happen in L2, no atomics issued by threads); the dQ postprocess's kernel then converts each
workspace into dK / dV (scale 1: dK is scaled here, where the loop's epilogue scales it).

Each MMA warpgroup owns 64 keys of the tile: its dK and dV are 64 × D fp32 boxes, stored in the
dQ boxes' permuted layout (``dq_box_view``: a thread's four values of an 8-column group form one
16-byte run) so that the dQ postprocess undoes it unchanged. A box is 256·D bytes, exactly one
bf16/fp16 operand tile that the Q-tile loop no longer needs: K and V (128 × D) hold warpgroup 0's
dK and dV boxes, Q and dO (2 stages × 64 × D) warpgroup 1's. No shared memory is added.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from flexjit.templates.cute.common import tma_tiles
from flexjit.templates.cute.opaque import opaque_thread_idx
from flexjit.templates.cute.sm90.dq import dq_box_view, dq_smem_layout, store_dq_acc

BOX_ROWS = 64  # keys per MMA warpgroup


def box_layout(dim: int):
    """One warpgroup's fp32 box, (64, dim): ``dq_smem_layout``'s first box."""
    return cute.select(dq_smem_layout(BOX_ROWS, dim), mode=[0, 1])


def reduce_atom(acc: cute.Tensor, dim: int):
    """The TMA reduce-add atom of one workspace, ``acc`` viewed (Spad, dim, Hkv, B) fp32."""
    op = cpasync.CopyReduceBulkTensorTileS2GOp(cute.ReductionKind.ADD)
    return cpasync.make_tiled_tma_atom(op, acc, box_layout(dim), (BOX_ROWS, dim))


@cute.jit
def _box(t0: cute.Tensor, t1: cute.Tensor, wg: Int32, dim: cutlass.Constexpr) -> cute.Tensor:
    """Warpgroup ``wg``'s fp32 box over the operand tile ``t0`` (wg 0) or ``t1`` (wg 1), each
    1024-byte aligned and 256·dim bytes long."""
    a0 = t0.iterator.toint()
    at = a0 + wg * (t1.iterator.toint() - a0)
    ptr = cute.make_ptr(Float32, at, cute.AddressSpace.smem, assumed_align=1024)
    return cute.make_tensor(ptr, box_layout(dim))


@cute.jit
def _store_box(acc: cute.Tensor, mma: cute.TiledMma, box: cute.Tensor, tidx: Int32, dim: cutlass.Constexpr):
    """The accumulator of thread ``tidx`` (0..255; its warpgroup's 64 rows) into its warpgroup's
    box: the tiled MMA's (128, dim) C tile with both 64-row halves on the same box."""
    rows, cols = dq_box_view(BOX_ROWS, dim)
    tile = cute.make_tensor(box.iterator, cute.make_layout(
        ((rows.shape, 2), cols.shape), stride=((rows.stride, 0), cols.stride)))
    store_dq_acc(acc, mma.get_slice(tidx).partition_C(tile))


@cute.jit
def reduce_epilogue(ctx, smem, mdKacc: cute.Tensor, mdVacc: cute.Tensor, tma_dk: cute.CopyAtom,
                    tma_dv: cute.CopyAtom, head_dim: cutlass.Constexpr,
                    head_dim_v: cutlass.Constexpr, bar_mma: cutlass.Constexpr,
                    bar_wg: cutlass.Constexpr):
    """dK ·= scale; each warpgroup's dK and dV boxes -> smem -> TMA reduce-add into the
    workspaces (``mdKacc``/``mdVacc``: (Spad, D, Hkv, B) views) at this CTA's kv head and batch.
    ``bar_mma``: the 256-thread named barrier, ``bar_wg``: the per-warpgroup one (id + wg)."""
    # A fresh thread index (0..255 over the MMA warpgroups), as the loop's epilogue takes: the
    # loop's index arithmetic is then not kept live across the Q-tile loop.
    tidx = opaque_thread_idx() - 128
    ctx.acc_dK.store(ctx.acc_dK.load() * ctx.softmax_scale)
    # Both warpgroups must be done reading K, V, Q and dO: their boxes overwrite them.
    cute.arch.barrier(barrier_id=bar_mma, number_of_threads=256)
    wg = ctx.wg
    dk_box = _box(smem.sK, smem.sQ, wg, head_dim)
    dv_box = _box(smem.sV, smem.sdO, wg, head_dim_v)
    _store_box(ctx.acc_dK, ctx.mma_dkv, dk_box, tidx, head_dim)
    _store_box(ctx.acc_dV, ctx.mma_dv, dv_box, tidx, head_dim_v)
    cute.arch.fence_view_async_shared()  # generic-proxy smem writes -> TMA (async proxy)
    cute.arch.barrier(barrier_id=bar_wg + wg, number_of_threads=128)
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp_idx % 4 == 0:  # the warpgroup's first warp (4 or 8) issues its two reduces
        sched = ctx.sched
        row = sched.n_block * 2 + wg  # this warpgroup's 64-key box of the workspace
        for which in cutlass.range_constexpr(2):
            mX = mdKacc if cutlass.const_expr(which == 0) else mdVacc
            sX = dk_box if cutlass.const_expr(which == 0) else dv_box
            atom = tma_dk if cutlass.const_expr(which == 0) else tma_dv
            dim = head_dim if cutlass.const_expr(which == 0) else head_dim_v
            gX = cute.local_tile(mX[None, None, sched.head_kv, sched.batch], (BOX_ROWS, dim), (row, 0))
            tXsX, tXgX = tma_tiles(atom, sX, gX)
            cute.copy(atom, tXsX, tXgX)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)
