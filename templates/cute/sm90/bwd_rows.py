"""The sm90 backward's row statistics (lse2, delta) in registers: ``row_values`` reads a stage
whole, one register per accumulator element; held sparsely, ``shuffled_row`` keeps one value in 8
per thread and ``ShuffledRow`` fetches each by warp shuffle where the Sᵀ accumulator uses it
(``BwdTiling.shuffle_stats``), instead of tile_m / 4 registers read before the waits."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from flexjit.templates.cute.common import register_offsets


@cute.jit
def row_values(tRow: cute.Tensor, shape) -> cute.Tensor:
    """One stage of lse2 or delta (smem, broadcast over keys: the accumulator's ``shape``) read
    into registers here. In the 64 × 128 tile the 32 reads name 16 distinct addresses per thread
    (its accumulator covers 16 query columns); the compiler merges them into 8 LDS.64."""
    r = cute.make_rmem_tensor(shape, Float32)
    for i in cutlass.range_constexpr(cute.size(r)):
        r[i] = tRow[i]
    return r


@cute.jit
def shuffled_row(sRow: cute.Tensor, idx: Int32, tile_m: cutlass.Constexpr,
                 tScS: cute.Tensor) -> "ShuffledRow":
    """Stage ``idx`` of lse2 or delta (``sRow``: (tile_m, stages) smem), one value in 8 per
    thread; ``tScS``: the thread's (kv, q) coordinates of the Sᵀ accumulator. The accumulator
    gives lane 4ρ + t the query columns 8g + 2t + e (e ∈ {0, 1}, g < tile_m / 8), the same for
    the 8 lanes of one t: lane 4ρ + t holds the columns of the groups g ≡ ρ (mod 8), and a use
    of column 8g + 2t + e shuffles it from lane 4·(g % 8) + t."""
    lane = cute.arch.lane_idx()
    rho, t = lane // 4, lane % 4
    groups = tile_m // 8
    held = []
    for gg in cutlass.range_constexpr(-(-groups // 8)):
        pair = []
        for e in cutlass.range_constexpr(2):
            col = 8 * (8 * gg + rho) + 2 * t + e
            if const_expr((gg + 1) * 8 > groups):  # a partial last round: lanes past it idle
                col = cutlass.select_(8 * gg + rho < groups, col, Int32(0))
            pair.append(sRow[col, idx])
        held.append(pair)
    return ShuffledRow(held, register_offsets(tScS), t)


class ShuffledRow:
    """A row statistic indexed like the Sᵀ accumulator (``shuffled_row``): ``[i]`` shuffles
    register i's query column from the lane that holds it, once per column (the two registers
    of one column, rows h and h + 8, share the shuffle). Trace-time."""

    def __init__(self, held, offsets, t):
        self.held, self.offsets, self.t = held, offsets, t
        self.cache = {}

    def __getitem__(self, i):
        q_off = self.offsets[i][1]  # 8g + e past the thread's first column 2t
        g, e = q_off // 8, q_off % 8
        if (g, e) not in self.cache:
            self.cache[(g, e)] = cute.arch.shuffle_sync(self.held[g // 8][e], self.t + 4 * (g % 8))
        return self.cache[(g, e)]
