"""P through shared memory: the forward's PV GEMM reading its A operand (P) from smem (SS wgmma).

With three consumer warpgroups a thread has 160 registers. At head dim 96 on a 192×128 tile,
O (48), S (64) and an in-flight P (32 bf16 pairs) leave too little for the rest and ptxas spills;
with P in smem no register holds P while PV(j-1) runs under the softmax of tile j.

* ``operand``: the PV GEMM's A descriptors over sP.
* ``store``: P (the softmax's output in the fp32 S accumulator) converted into sP.

Ordering: the forward writes P(j) only after ``wait_group(0)`` has retired PV(j-1), the last
reader of sP. The wgmma's 64 rows of a warpgroup are four 16-row slabs, one per warp, and each
warp writes its own slab, so a fence (generic proxy -> async proxy) and a warp barrier suffice
before the GEMM is issued.
"""
import cutlass.cute as cute
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp


def operand(wg_pv, sP: cute.Tensor) -> cute.Tensor:
    """PV's A fragment of smem descriptors over ``sP`` (tile_m, tile_n); ``wg_pv``: the PV
    MMA's slice for this thread's warpgroup."""
    return wg_pv.make_fragment_A(wg_pv.partition_A(sP))


@cute.jit
def store(sP: cute.Tensor, mma_qk: cute.TiledMma, acc_S: cute.Tensor, dtype):
    """acc_S (the QK accumulator holding P in fp32) -> ``dtype`` -> sP, visible to the next
    wgmma. The stmatrix copy follows the QK GEMM's accumulator
    layout, where P is computed; its addresses are formed here, at each store, rather than kept
    live through the kv loop (swizzled, they take registers the softmax needs)."""
    tidx = cute.arch.thread_idx()[0] - 128  # consumer threads follow the producer warpgroup
    st_atom = cute.make_copy_atom(StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    thr_st = cute.make_tiled_copy_C(st_atom, mma_qk).get_slice(tidx)
    tPsP = thr_st.partition_D(sP)
    rP = cute.make_rmem_tensor_like(acc_S, dtype)
    rP.store(acc_S.load().to(dtype))
    cute.copy(st_atom, thr_st.retile(rP), tPsP)
    cute.arch.fence_view_async_shared()
    cute.arch.sync_warp()
