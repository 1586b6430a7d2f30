"""What the Blackwell (sm_100a) kernels share: the target and its budgets, the CTA's warp roles
and TMEM barriers, the one-CTA-per-SM launch, TMEM allocation (a CTA takes all 512 columns)."""

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, dsl_user_op
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import TmemAllocator

from flexjit.templates.cute import common

GPU_ARCH = "sm_100a"  # passed to every compile, whatever CUTE_DSL_ARCH says (B200/GB200)
TMEM_COLUMNS = 512
SMEM_CAPACITY = 227 * 1024  # sm100 opt-in maximum per CTA

# Warp roles both kernels share (the others are each kernel's own).
MMA_WARP = 12
LOAD_WARP = 13
NUM_WARPS = 16

# Named barriers (0 is __syncthreads).
BAR_TMEM_ALLOC = 1  # the TMEM users wait for the address the allocating warp writes
BAR_TMEM_FREE = 2  # every TMEM reader is done before the allocating warp frees it


@dsl_user_op
def tcgen05_fence(after: bool, *, loc=None, ip=None) -> None:
    """``tcgen05.fence::after_thread_sync`` (after a wait, before this thread's tcgen05 ops) or
    ``::before_thread_sync`` (after its tcgen05 ops, before the arrive that publishes them):
    the PTX memory model orders tcgen05 operations of different threads only through these
    fences around the mbarrier synchronisation."""
    kind = (nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC if after
            else nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)
    nvvm.tcgen05_fence(kind, loc=loc, ip=ip)


def launch(kernel, grid, stream) -> None:
    """Launch a kernel body (``self.kernel(...)``) with ``NUM_WARPS`` warps and one CTA per SM
    (``min_blocks_per_mp=1``: setmaxnreg needs it, and a second resident CTA would wait in
    tcgen05.alloc for the first)."""
    common.launch(kernel, grid, 32 * NUM_WARPS, stream)


def tmem_allocator(storage, allocator_warp: int, num_threads: int):
    """The CTA's TMEM allocator: warp ``allocator_warp`` allocates (and later frees), the
    ``num_threads`` threads that use TMEM wait on ``BAR_TMEM_ALLOC`` for the address it writes
    into ``storage.tmem_addr``."""
    return TmemAllocator(
        storage.tmem_addr.ptr,
        barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=BAR_TMEM_ALLOC,
                                                   num_threads=num_threads),
        allocator_warp_id=allocator_warp,
    )


def tmem_address(tmem):
    """This thread's view of the CTA's TMEM base (fp32 columns), once the allocating warp has
    written it."""
    tmem.wait_for_alloc()
    return tmem.retrieve_ptr(Float32)


def free_tmem(tmem, t_ptr, num_threads: int) -> None:
    """The allocating warpgroup's release: wait on ``BAR_TMEM_FREE`` until all ``num_threads``
    threads (its own and those that arrive there after their last TMEM read) are done, then
    free the columns. The fences order the tcgen05 reads before the barrier, the free after."""
    tcgen05_fence(after=False)
    cute.arch.barrier(barrier_id=BAR_TMEM_FREE, number_of_threads=num_threads)
    tcgen05_fence(after=True)
    tmem.relinquish_alloc_permit()
    tmem.free(t_ptr)


def tma_operand(atom: cute.CopyAtom, partition, m: cute.Tensor, tile, s: cute.Tensor):
    """TMA partition of ``m``'s ``tile``-tiles as an MMA operand (``partition``: the MMA slice's
    ``partition_A`` or ``partition_B``) against its smem buffer ``s``: (smem, gmem)."""
    g = partition(cute.flat_divide(m, tile))
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 3),
                                 cute.group_modes(g, 0, 3))
