"""What the CuTeDSL kernels share on the device: the holes' contract (``Aux``, ``FloatIndices``),
smem and fragment layouts, the sm90 warpgroup GEMM, reductions over DSL scalars, constants.

The operands' layouts, one list for every kernel's ``__call__`` and ``kernel`` (their parameter
order is each kernel's argument layout, so each keeps its own list; the shapes are here):

- ``__call__`` (host): mQ (B, Hq, L, D), mK (B, Hkv, S, D), mV (B, Hkv, S, Dv), mO / mdO
  (B, Hq, L, Dv), dK / dV like K / V; mLSE (B, Hq, L) fp32; the backward's mLSE2 and mDelta
  (B, Hq, Lpad) fp32 (LSE2 in log2 units), mdQacc (B, Hq, Lpad, D) fp32 zeroed, mSem
  (B, Hq, >= Lpad / 128) int32 zeroed (deterministic mode, else None); mMax (B, Hq, L) fp32,
  the row max of the modded scores, or None. ``aux_tensors`` / ``aux_scalars`` /
  ``grad_accs`` are None when empty (empty tuples are not valid jit args).
- ``kernel`` (device): the same tensors with the sequence first and (head, batch) last:
  Q (L, D, Hq, B), K (S, D, Hkv, B), V (S, Dv, Hkv, B) (the sm100 forward's V view is
  (Dv, S, (Hkv, B))), O / dO (L, Dv, Hq, B), LSE (L, Hq, B), LSE2 / Delta (Lpad, Hq, B), dQacc
  (Lpad, D, Hq, B); TMA views where a ``tma_*`` atom goes with them (sm100: (head, batch)
  grouped as one mode).
"""

import functools
import math
from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import arith as _mlir_arith
from cutlass._mlir_helpers import arith as cutlass_arith
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

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
    tile-uniform factor with one FFMA (see the holes' contract). ``.float_indices`` names the
    arguments the mod reads (True: all); the others are passed as None, never computed."""

    def __init__(self, q0, kv0):
        self.q0, self.kv0 = q0, kv0
        self.q0_f, self.kv0_f = Float32(q0), Float32(kv0)
        self.d0_f = self.kv0_f - self.q0_f

    def args(self, mod, q_idx, kv_idx, at=None) -> tuple:
        """``at``: (q_idx - q0, kv_idx - kv0) as Python ints where the caller knows them
        (``register_offsets``), else they are computed (and folded by the compiler)."""
        uses = getattr(mod, "float_indices", False)
        if uses is False:  # a mod without the float parameters
            return ()
        if uses is True:
            uses = _FLOAT_ARGS
        dq, dkv = at if at is not None else (q_idx - self.q0, kv_idx - self.kv0)
        offset = Float32(dkv - dq) if "kv_minus_q_f" in uses or "kv_minus_q_parts" in uses else None
        return (self.q0_f + Float32(dq) if "q_idx_f" in uses else None,
                self.kv0_f + Float32(dkv) if "kv_idx_f" in uses else None,
                self.d0_f + offset if "kv_minus_q_f" in uses else None,
                (self.d0_f, offset) if "kv_minus_q_parts" in uses else None)


_FLOAT_ARGS = ("q_idx_f", "kv_idx_f", "kv_minus_q_f", "kv_minus_q_parts")


def bind(mod, b, h, aux):
    """``mod`` (a generated score_mod, mask_mod, ...) with its tile-uniform part
    (``mod.hoisted``) computed once, here, instead of once per register: call it at the start
    of a tile's unrolled loop, in the same region as the loop."""
    part = getattr(mod, "hoisted", None)
    if part is None:
        return mod
    return functools.partial(mod, hoisted=part(b, h, aux))


def where(cond, a: Float32, b: Float32) -> Float32:
    """``a if cond else b`` as one select: the ternary in a kernel becomes an ``scf.if`` with two
    regions per register, which the compiler turns back into this."""
    return Float32(cutlass.select_(cond, a, b))


def plain_i32(x) -> Int32:
    """``x`` as a plain i32. A value read from a coordinate tensor keeps cute's integer-tuple
    form, and every add on it builds tuple operations (three IR operations where one would do)
    that the MLIR passes fold back; per register and index that is compile time."""
    return Int32(cutlass_arith.ArithValue(Int32(x).ir_value(), True))


def index_add(x: Int32, offset: int) -> Int32:
    """``x + offset`` for an index, marked as never overflowing (as cute's own coordinate
    arithmetic is): LLVM may then fold ``q + a >= kv + b`` into one compare of ``q - kv``."""
    if offset == 0:
        return x
    v = _mlir_arith.addi(Int32(x).ir_value(), Int32(offset).ir_value(),
                         overflow_flags=_mlir_arith.IntegerOverflowFlags.nsw)
    return Int32(cutlass_arith.ArithValue(v, True))


def register_offsets(coords: cute.Tensor) -> list:
    """Each register's (row, col) offset from register 0 in a thread's partition of an identity
    tensor, as Python ints: the partition's layout is static, only its base depends on the
    thread. Indexing the coordinate tensor per register instead builds some twenty IR operations
    a register and index that the MLIR passes then fold back to one add; over the ~400
    registers a forward's mods visit, that was most of its IR and of its compile time."""
    lay = coords.layout
    first = lay(0)
    return [tuple(c - f for c, f in zip(lay(i), first)) for i in range(cute.size(lay))]


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


def fold_heads(t: cute.Tensor, group: int, head_mode: int) -> cute.Tensor:
    """A sequence-major view (L, ..., Hq, ...) with the query heads at ``head_mode``, seen as
    ((group, L), ..., Hq / group, ...): the ``group`` query heads that share a kv head folded
    into the rows, head fastest (row r is position r // group of head r % group), so one tile
    holds several heads' rows and one K/V tile serves them all (packed GQA)."""
    shape, stride = list(t.layout.shape), list(t.layout.stride)
    shape[0], stride[0] = (group, shape[0]), (stride[head_mode], stride[0])
    shape[head_mode] = shape[head_mode] // group
    stride[head_mode] = stride[head_mode] * group
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


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


def kernel_aux(aux_tensors, aux_scalars) -> Aux:
    """The captured tensors and scalars (None when empty: empty tuples are not jit arguments)
    as the rendered mods take them."""
    return Aux(tuple(aux_tensors) if const_expr(aux_tensors is not None) else (),
               tuple(aux_scalars) if const_expr(aux_scalars is not None) else ())


def tma_tiles(atom: cute.CopyAtom, s: cute.Tensor, g: cute.Tensor):
    """TMA partition of a 2-D tile (its two modes grouped into the TMA box mode): (smem, gmem)."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                 cute.group_modes(g, 0, 2))


def launch(kernel, grid, threads: int, stream, one_cta_per_sm: bool = True) -> None:
    """Launch a kernel body (``self.kernel(...)``) with ``threads`` threads per CTA.
    ``one_cta_per_sm``: ``min_blocks_per_mp=1``, without which ptxas caps every thread at
    65536 / threads registers and ignores setmaxnreg."""
    if one_cta_per_sm:
        kernel.launch(grid=grid, block=[threads, 1, 1], stream=stream, min_blocks_per_mp=1)
    else:
        kernel.launch(grid=grid, block=[threads, 1, 1], stream=stream)


def smem_buffer(dtype, layout, align: int = 1024):
    """A shared-storage field holding a tensor of ``layout`` (or that many elements), aligned
    to ``align`` bytes (1024: a swizzle atom, what TMA and the MMA descriptors need)."""
    n = layout if isinstance(layout, int) else cute.cosize(layout)
    return cute.struct.Align[cute.struct.MemRange[dtype, n], align]


def shared_storage(name: str, fields: dict):
    """A ``cute.struct`` of ``fields`` (name -> field type, in layout order): a kernel's shared
    memory, built from the fields its configuration needs."""
    return cute.struct(type(name, (), {"__annotations__": dict(fields)}))


class DqPostprocess:
    """A dQ postprocess kernel's base: dQ = accumulator · softmax_scale in the input dtype, one
    128-thread CTA per ``per_cta`` work items (a row or a unit of rows), ``lanes_per_row``
    threads (16-byte vectors) per row. A subclass says its ``grid`` and writes its ``kernel``."""

    def __init__(self, cfg):
        self.dtype = cfg.dtype
        self.head_dim = cfg.head_dim
        self.lanes_per_row = self.head_dim // 8
        self.per_cta = 128 // self.lanes_per_row

    def grid(self, mdQ: cute.Tensor) -> list:
        raise NotImplementedError

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32,
                 stream: cuda.CUstream):
        launch(self.kernel(mdQacc, mdQ, softmax_scale), self.grid(mdQ), 128, stream,
               one_cta_per_sm=False)
