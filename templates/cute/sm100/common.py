"""What the Blackwell (sm_100a) forward and backward templates share.

What this module holds
----------------------
* The target and its budgets: ``GPU_ARCH`` (passed to every sm100 compile, whatever
  CUTE_DSL_ARCH says), ``TMEM_COLUMNS``, ``SMEM_CAPACITY``.
* The CTA shape both kernels use: 16 warps (``NUM_WARPS``), the MMA-issuing warp ``MMA_WARP``
  and the TMA warp ``LOAD_WARP``, the named barriers of the TMEM allocation
  (``BAR_TMEM_ALLOC``, ``BAR_TMEM_FREE``), and ``launch`` (one CTA per SM: each allocates all
  512 TMEM columns).
* Device helpers: ``tcgen05_fence``, ``thread_group`` (a pipeline's cooperative group),
  ``tmem_allocator``, ``tmem_address`` and ``free_tmem`` (the allocating warp's release after
  every reader), ``kernel_aux`` (the captured tensors and scalars as the mods take them).
* Host helpers: ``check_head_dims`` (the configs'), ``compile_options``, ``require_tvm_ffi``,
  ``launcher`` (the TVM-FFI function of a compile, or None where this process cannot launch
  sm_100a code).

Only trace-time Python lives here: each helper emits, at its call site, the operations the
kernel body wrote out before, so moving code here leaves the generated kernels unchanged (the
kernel classes stay in their templates: their qualified names are the PTX entry names).
"""

import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import Float32, const_expr, dsl_user_op
from cutlass._mlir.dialects import nvvm

# tvm_ffi_enabled: re-exported, the templates' API.
from flexjit.templates.cute.common import Aux, ffi_function, tvm_ffi_enabled  # noqa: F401

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
    kernel.launch(grid=grid, block=[32 * NUM_WARPS, 1, 1], stream=stream, min_blocks_per_mp=1)


def thread_group(threads: int):
    """A pipeline's producer or consumer: ``threads`` threads, each arriving."""
    return pipeline.CooperativeGroup(pipeline.Agent.Thread, threads)


def tmem_allocator(storage, allocator_warp: int, num_threads: int):
    """The CTA's TMEM allocator: warp ``allocator_warp`` allocates (and later frees), the
    ``num_threads`` threads that use TMEM wait on ``BAR_TMEM_ALLOC`` for the address it writes
    into ``storage.tmem_addr``."""
    return utils.TmemAllocator(
        storage.tmem_addr.ptr,
        barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=BAR_TMEM_ALLOC,
                                                   num_threads=num_threads),
        allocator_warp_id=allocator_warp,
        arch="sm_100",
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


def kernel_aux(aux_tensors, aux_scalars) -> Aux:
    """The captured tensors and scalars (None when empty: empty tuples are not jit arguments)
    as the rendered mods take them."""
    return Aux(tuple(aux_tensors) if const_expr(aux_tensors is not None) else (),
               tuple(aux_scalars) if const_expr(aux_scalars is not None) else ())


# ---------------------------------------------------------------------------------------------
# Host
# ---------------------------------------------------------------------------------------------
def check_head_dims(template: str, head_dim: int, head_dim_v: int, head_dims) -> None:
    """A config's head dims must be a pair the template has a tile for."""
    if (head_dim, head_dim_v) not in head_dims:
        raise NotImplementedError(
            f"{template}: head dims ({head_dim}, {head_dim_v}) not in {head_dims}")


def compile_options(options: str) -> str:
    """The caller's options, the target arch and the TVM-FFI launch path."""
    return f"{options} --gpu-arch {GPU_ARCH} --enable-tvm-ffi".strip()


def require_tvm_ffi(template: str) -> None:
    if not tvm_ffi_enabled():
        raise RuntimeError(f"{template} compiles through TVM-FFI only (tvm_ffi not importable "
                           ")")


def launcher(compiled):
    """The TVM-FFI function of a compile, or None: compiled for an arch this process cannot
    launch (CUTE_DSL_ARCH differs, or a CPU-only machine)."""
    try:
        return ffi_function(compiled)
    except RuntimeError:
        return None
