"""What the CuTeDSL kernels share: the Hopper forward and backward today, Blackwell's next.

Imported normally by the kernel templates (``from flexjit.templates.cute_common import ...``);
nothing here is a template of its own.

* The holes' contract: ``Aux`` (what the generated mods receive as ``aux``) and
  ``FloatIndices`` (their float32 index arguments, see the forward template's "holes" section).
* Shared-memory and fragment layouts: ``smem_layout`` (swizzled K-major, optionally staged),
  ``permute``, ``transposed``; the sm90 accumulator views ``rows_cols_layout``/``rows_cols`` and
  ``acc_as_operand_a`` (Hopper wgmma fragments: an sm100 kernel keeps its accumulators in tensor
  memory and brings its own).
* ``wgmma_gemm``: one warpgroup GEMM over all k-blocks, committed as one group (sm90).
* Reductions over DSL scalars: ``tree`` (pairwise), ``quad_allreduce`` (the 4 threads of an
  accumulator row), ``fadd``.
* Host plumbing for the TVM-FFI launch path: ``tvm_ffi_enabled``, ``placeholder`` (compile-time
  stand-ins for torch tensors), ``aux_cutlass_dtype``, ``as_scalar``, ``ffi_function``,
  ``stream_context``, ``check_kv_batch`` (K/V's batch against the kernel's broadcast flag);
  for persistent kernels, ``scheduler_counter`` (the dynamic scheduler's zeroed
  per-stream counter, from a memory pool of its own) and ``device_num_sms``.
* Constants: ``MASK_BLOCK`` (the BlockMask's 128x128 granularity), ``LOG2_E``, ``LN_2``.
"""

import functools
import math
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

MASK_BLOCK = 128  # FlexAttention BlockMask granularity, rows and columns
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


class Aux(NamedTuple):
    """What the mods receive as ``aux``: captured global tensors and runtime scalars."""

    tensors: tuple = ()
    scalars: tuple = ()


class FloatIndices:
    """float32 copies of a thread's q_idx, kv_idx and kv_idx - q_idx for mods marked
    ``.float_indices``: each is the first register's value, converted once, plus the register's
    compile-time offset from it (the integer difference folds to a constant), so an element costs
    one FADD instead of an int->float conversion, which issues on the MUFU pipe beside exp2
    (ALiBi's float(kv) - float(q) is one FADD, not three). Exact: indices are below 2^22.
    The last argument, (base, offset) of kv_idx - q_idx, lets a mod scale the difference by a
    tile-uniform factor with one FFMA (see the holes' contract)."""

    def __init__(self, q0, kv0):
        self.q0, self.kv0 = q0, kv0
        self.q0_f, self.kv0_f = Float32(q0), Float32(kv0)
        self.d0_f = self.kv0_f - self.q0_f

    def args(self, mod, q_idx, kv_idx) -> tuple:
        if not getattr(mod, "float_indices", False):
            return ()
        dq, dkv = q_idx - self.q0, kv_idx - self.kv0
        offset = Float32(dkv - dq)
        return (self.q0_f + Float32(dq), self.kv0_f + Float32(dkv), self.d0_f + offset,
                (self.d0_f, offset))


def smem_layout(dtype, rows: int, cols: int, stages: Optional[int] = None,
                atom_cols: Optional[int] = None):
    """Swizzled K-major (row-major, `cols` contiguous) smem layout, optionally staged. The
    swizzle atom is the widest that divides ``atom_cols`` (default ``cols``) columns."""
    atom_kind = sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols)
    atom = warpgroup.make_smem_layout_atom(atom_kind, dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def permute(t: cute.Tensor, order) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=order))


def transposed(s: cute.Tensor) -> cute.Tensor:
    """(rows, cols, stages) smem tensor viewed as (cols, rows, stages): Vᵀ for the PV GEMM."""
    shape = (s.shape[1], s.shape[0], s.shape[2])
    return cute.composition(s, cute.make_ordered_layout(shape, order=(1, 0, 2)))


@cute.jit
def wgmma_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
               zero_init: cutlass.Constexpr):
    """Issue one warpgroup GEMM over all k-blocks and commit it as one wgmma group (shared by
    the forward and the backward)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom: its ACCUMULATE field is mutated
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for kb in cutlass.range_constexpr(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, kb], tB[None, None, kb], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def rows_cols_layout(frag_layout: cute.Layout) -> cute.Layout:
    """An sm90 accumulator fragment is ((2, 2, V), MMA_M, MMA_N): (column pair, row half,
    8-column groups). Return a layout over the same registers indexed (row, col) =
    ((2, MMA_M), (2, V, MMA_N))."""
    dense = cute.make_layout(frag_layout.shape)
    (c2, r2, v), mm, mn = dense.shape
    (sc2, sr2, sv), smm, smn = dense.stride
    rc = cute.make_layout(((r2, mm), (c2, v, mn)), stride=((sr2, smm), (sc2, sv, smn)))
    return cute.composition(frag_layout, rc)


def rows_cols(frag: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(frag.iterator, rows_cols_layout(frag.layout))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View the fp32 S accumulator ((2, 2, V), MMA_M, MMA_N) as the PV A-operand fragment
    ((2, 2, 2), MMA_M, V/2 · MMA_N): two adjacent 8-column groups form one 16-wide k-block."""
    dense = cute.make_layout(acc.layout.shape)
    (c2, r2, v), mm, mn = dense.shape
    (sc2, sr2, sv), smm, smn = dense.stride
    assert v % 2 == 0
    if const_expr(mn == 1):
        k_mode = cute.make_layout(v // 2, stride=2 * sv)
    else:
        k_mode = cute.make_layout((v // 2, mn), stride=(2 * sv, smn))
    frag = cute.make_layout(
        ((c2, r2, 2), mm, k_mode.shape), stride=((sc2, sr2, sv), smm, k_mode.stride)
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, frag))


def tree(values, op):
    """Pairwise reduction of a Python list of DSL scalars (keeps the dependency chains short)."""
    while len(values) > 1:
        nxt = [op(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
        if len(values) % 2:
            nxt.append(values[-1])
        values = nxt
    return values[0]


def quad_allreduce(x, op):
    """Reduce over the 4 threads (lane % 4) that hold one accumulator row."""
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return x


def fadd(a, b):
    return a + b


def as_scalar(x):
    if isinstance(x, (Float32, Int32)):
        return x
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"aux scalar must be a Python int or float, got {type(x)}")
    return Int32(x) if isinstance(x, int) else Float32(x)


def tvm_ffi_enabled() -> bool:
    """Whether compiles use the TVM-FFI launch path (``tvm_ffi`` importable and the DSL has the
    placeholder API)."""
    try:
        import tvm_ffi  # noqa: F401  (importable: the launch path exists)
    except ImportError:
        return False
    return all(hasattr(cute.runtime, n) for n in ("make_fake_tensor", "make_fake_stream"))


def aux_cutlass_dtype(torch_dtype):
    import torch

    table = {torch.float32: Float32, torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16,
             torch.float64: cutlass.Float64, torch.int32: Int32, torch.int64: cutlass.Int64,
             torch.int16: cutlass.Int16, torch.int8: cutlass.Int8, torch.uint8: cutlass.Uint8,
             torch.bool: cutlass.Boolean}
    if torch_dtype not in table:
        raise TypeError(f"cute_sm90_fwd: unsupported aux tensor dtype {torch_dtype}")
    return table[torch_dtype]


def placeholder(dtype, ndim: int, align: int, stride_div: int = 1):
    """A compile-time stand-in for a torch tensor of this dtype and rank: every size is a runtime
    Int32, every stride a runtime Int64 (divisible by ``stride_div``) but the last, which is 1 —
    the same type ``from_dlpack(t).mark_layout_dynamic(leading_dim=ndim - 1)`` gives a CUDA
    tensor (global memory), plus the divisibility the TMA contract already requires."""
    shape = tuple(cute.sym_int32() for _ in range(ndim))
    stride = tuple(cute.sym_int64(divisibility=stride_div) for _ in range(ndim - 1)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=align)


def check_kv_batch(kv_batch_broadcast: bool, q, k, v) -> None:
    """K/V's batch against the query's: equal, or 1 for a kernel compiled with
    ``kv_batch_broadcast`` (whose K/V batch stride must then be nonzero: a TMA descriptor is
    built over it). Neither kernel reads another batch entry than these allow: an unflagged
    kernel given a K/V batch of 1 would read past it (zeros from the TMA unit, a silent wrong
    answer), hence the check on the host."""
    want = 1 if kv_batch_broadcast else q.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != want:
            raise ValueError(f"{name} has batch {t.shape[0]}, the kernel takes {want} "
                             f"(query batch {q.shape[0]}, kv_batch_broadcast={kv_batch_broadcast})")
        if t.stride(0) == 0 and (t.shape[0] > 1 or kv_batch_broadcast):
            raise ValueError(f"{name}: a zero batch stride; pass the un-expanded (1, H, S, D) "
                             "tensor to a kv_batch_broadcast kernel")


def ffi_function(compiled):
    """The bare ``tvm_ffi.Function`` of a TVM-FFI compile: positional arguments, no stream (the
    environment stream is implicit), no Python wrapper. A function loaded from an exported
    object file is already one."""
    get = getattr(compiled, "__tvm_ffi_object__", None)
    fn = get() if get is not None else compiled
    if fn is None:
        raise RuntimeError("the TVM-FFI function was not created (compiled for another arch?)")
    return fn


def stream_context(stream):
    """Run under ``stream`` (a torch stream, a CUstream or a raw handle) as torch's current
    stream, which the TVM-FFI wrapper launches on."""
    import torch

    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return torch.cuda.stream(torch.cuda.ExternalStream(int(stream)))


# Dynamic scheduler counters, one (2,) int32 tensor per (device, stream): [0] tiles claimed
# beyond the first grid_dim, [1] CTAs finished. Zeroed once when allocated (on the launch
# stream, so stream-ordered before the first launch); each launch leaves them at zero again
# (the last CTA to finish resets them), and launches on one stream are serialised, so no
# per-launch memset is needed. A different stream gets its own counter (concurrent launches
# must not share one). Dropping entries is safe: the caching allocator reuses a freed block
# only in stream order after the kernels of the stream it was allocated on.
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
    import contextlib

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
