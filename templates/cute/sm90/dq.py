"""The sm90 backward's dQ boxes: each MMA warpgroup's fp32 piece of dQ in smem, permuted so that
a thread's values form 16-byte runs, and K's swizzle atom for the dQ GEMM's column split."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32


@cute.jit
def store_dq_acc(acc: cute.Tensor, dst: cute.Tensor):
    """The dQ accumulator ((2, 2, V), MMA_M, MMA_N) -> its smem box partition ``dst`` (same
    shape, through ``dq_box_view``): the 4 values (e, h) of each 8-column group are adjacent
    in smem and 16-byte aligned (the box starts on 1024 bytes, the run on a multiple of 4
    fp32): one 128-bit store each."""
    for m in cutlass.range_constexpr(cute.size(acc, mode=[1])):
        for n in cutlass.range_constexpr(cute.size(acc, mode=[2])):
            for g in cutlass.range_constexpr(cute.size(acc.shape[0][2])):
                run = cute.make_rmem_tensor((4,), Float32)
                for h in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        run[2 * h + e] = acc[(e, h, g), m, n]
                at = dst.iterator + cute.crd2idx(((0, 0, g), m, n), dst.layout)
                ptr = cute.make_ptr(Float32, at.toint(), cute.AddressSpace.smem, assumed_align=16)
                cute.autovec_copy(run, cute.make_tensor(ptr, cute.make_layout(4)))


def dq_box_view(box_rows: int, box_cols: int):
    """(row, column) of dQ in one box -> smem offset in the box: (row layout, column layout).

    Row r = 16a + 8h + ρ, column c = 8g + 2t + e (the wgmma accumulator gives lane 4ρ + t of
    a warp rows ρ and ρ + 8 (h), columns 2t + e of every 8-column group g) is stored at box row
    16a + 2ρ + t // 2, box column 8g + 4·(t % 2) + 2h + e: a permutation within each
    16-row × 8-column block, the same for every box and kv block, that puts a thread's 4
    values (e, h) of group g (4 consecutive accumulator registers) in one 16-byte run: one
    STS.128 per 4 values instead of an STS.64 per 2, no register moves. A warp's store covers
    512 contiguous bytes (conflict-free). ``FlexAttentionBwdPostSm90`` reads it back. Box
    (row, column) sits at 8·row + (column % 8) + 8·rows·(column // 8) (``dq_smem_layout``)."""
    assert box_rows % 16 == 0
    rows = cute.make_layout((8, 2, box_rows // 16), stride=(16, 2, 128))
    cols = cute.make_layout((2, (2, 2), box_cols // 8), stride=(1, (4, 8), 8 * box_rows))
    return rows, cols


def k_atom_cols(head_dim: int, dq_split: str) -> int:
    """The column count K's smem swizzle atom is chosen for. The dQ GEMM reads K MN-major with
    each warpgroup's N = D/2 columns ("cols" split), and a warpgroup's columns must start on a
    swizzle-atom boundary unless all of D lies in one atom: D = 96 would get 32-column (64-byte)
    atoms and split at column 48, so it takes 16-column (32-byte) atoms instead; D = 192 takes
    32-column (64-byte) atoms (split at 96). Every other head dim keeps the atom of its full
    width (64 and 128: 128-byte, 32: 64-byte). In the dim split (D = 192) the dK/dV GEMMs read
    Q and dO MN-major split the same way, so Q, dO and V take this atom count too."""
    atom = next(a for a in (64, 32, 16, 8) if head_dim % a == 0)  # 16-bit elements per atom
    half = head_dim // 2
    return half if dq_split == "cols" and head_dim > atom and half % atom else head_dim


def dq_smem_layout(box_rows: int, box_cols: int):
    """Two box_rows × box_cols fp32 boxes (one per MMA warpgroup), each stored as column groups
    of (box_rows × 8 columns) row-major, no swizzle: (rows, (8, cols/8), 2) : (8, (1, 8·rows),
    rows·cols).

    Why not a swizzled 128-byte layout: a thread's accumulator pairs sit at several column
    groups × 2 row halves; with a swizzle their smem addresses differ by non-constant amounts,
    and the compiler hoists all of them (16 for D = 128) out of the Q-tile loop, live across it:
    spills at the 240-register cap. Here every address is one base + a constant, and a warp's
    STS.128 (dQ placed through ``dq_box_view``) covers 512 contiguous bytes, conflict-free. The
    TMA unit
    reduces the box as cols/8 boxes of 8 × rows (32-byte rows: the L2 sector size)."""
    return cute.make_layout((box_rows, (8, box_cols // 8), 2),
                            stride=(8, (1, 8 * box_rows), box_rows * box_cols))
