"""The sm90 forward's tile table (pure Python: what shapes a compile).

* ``Tiling``: one configuration of the forward kernel's tile, warpgroups, stages and schedule.
* ``choose_tiling``: the tile table (a row per head-dim pair); ``smem_bytes``: what a config
  allocates.
"""
from dataclasses import dataclass
from typing import Optional

@dataclass(frozen=True)
class Tiling:
    tile_m: int
    tile_n: int
    num_stages: int
    num_mma_wgs: int
    pingpong: bool
    mma_regs: int
    load_regs: int
    # Persistent: min(num_tiles, num_SMs) CTAs each walk tiles block_idx, block_idx + grid, ...
    # in ``tile_scheduler.tile_coords``'s order; O gets its own smem buffer (see "Persistent variant").
    persistent: bool = False
    # Persistent only: after its first tile (block_idx) a CTA takes the next unclaimed tile of
    # the same order from a global atomic counter instead of striding by the grid size (see
    # "Dynamic tile scheduler").
    dynamic_schedule: bool = False
    # The PV GEMM reads P from shared memory (SS) instead of registers (RS): ``p_smem``.
    p_smem: bool = False


SMEM_CAPACITY = 227 * 1024  # sm90 opt-in maximum per CTA

# (head_dim, head_dim_v) pairs with a row in ``choose_tiling``'s table.
HEAD_DIMS = ((32, 32), (64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256))
# The pairs the FP8 (e4m3) forward serves: head dims that are multiples of the 32-wide k block.
FP8_HEAD_DIMS = ((64, 64), (128, 128), (256, 256))


def dynamic_schedule_default() -> bool:
    """Whether persistent tilings built without an explicit choice claim tiles dynamically: yes
    (docs/performance.md compares it with the static grid stride)."""
    return True


def choose_tiling(head_dim: int, head_dim_v: int, block_sparse: bool = True,
                  persistent: bool = False, dynamic_schedule: Optional[bool] = None,
                  tile_m: Optional[int] = None, fp8: bool = False) -> Tiling:
    """Tile table. With a block mask, tile_m is 128 = one mask-block row by default, so a CTA
    reads exactly one row of the BlockMask, and tile_n divides the 128-wide mask block for the
    same reason. ``tile_m=192`` (D = 64) takes dense D = 64's tile with a block mask too: the
    kernel then reads the lists merged per 192-row tile (``BlockSparseRows``).

    * D = 64, dense (no block mask): 192×128, 3 consumer warpgroups (FA3/FA4's choice): the
      K=64 GEMMs are short, so a third warpgroup keeps the tensor cores fed while two run their
      softmax. Registers 3×128×160 + 128×32 = 65536. Smem Q 24 KB + 3×(16+16) KB.
    * D = 64, block-sparse: 128×128, 2 warpgroups, 3 stages; or, with ``tile_m=192``, the dense
      row over merged list rows (a 192-row tile straddles two mask-block rows).
    * D = 128: 128×128, 2 warpgroups, 2 stages (32 + 2×(32+32) = 160 KB), both overlaps: FA3's
      best configuration.
    * D = 256: 128×64, 2 warpgroups, 2 stages (64 + 2×(32+32) = 192 KB). O alone is 128 fp32
      registers per thread; an S tile of 64 columns (32 regs) keeps the total under 240. FA4 uses
      tile_n = 80, which would not divide the mask block. No ping-pong (the long PV GEMM makes the
      two warpgroups' turns uneven).
    * D = 32: D = 64's block-sparse row, dense too (57 KB): the 192-row 3-warpgroup tile at 160
      registers spills 48 bytes with a gathered bias (relative_bias), 240 leaves room.
    * D = 96: D = 128's row (smem 24 + 2×(24+24) = 120 KB). FA3 runs 192×144 with 3 consumer
      warpgroups; here 192×128 at 160 registers with P in registers spills 144 bytes (O 48 +
      S 64 + P 32 per thread leaves too little for the rest), and 144 would not divide the mask
      block. ``tile_m=192`` takes 192×128 with three consumer warpgroups and P through shared
      memory (``p_smem``: Q 36 + 2×(24+24) + P 48 = 180 KB; persistent + O 36 = 216 KB).
    * D = 192, Dv = 192: 128×64, 2 stages (48 + 2×(24+24) = 144 KB). tile_n = 128 would need
      48 + 2×96 = 240 KB > 227 KB; FA3's 112 does not divide the mask block. Registers as
      D = 256's minus 32 (O 96 + S 32 + P 16); the GEMMs of a kv tile are of equal length
      (64×64×192 and 64×192×64), so ping-pong stays on.
    * D = 192, Dv = 128 (DeepSeek's MLA shapes): 128×128, 2 stages (Q 48 + 2×(K 48 + V 32)
      = 208 KB); the register picture is D = 128's (O 64 + S 64 + P 32); O (32 KB) fits in
      Q's buffer.
    Two consumer warpgroups: 2×128×240 + producer 128×24 = 64512 <= 65536 registers. Every row
    compiles without spills with the heaviest core mods (tests/test_cute_sm90_compile.py).

    ``persistent`` adds a separate O buffer (tile_m × Dv): D = 128 needs 192 KB, D = 64 128 KB
    (block-sparse) or 144 KB (dense), D = 96 145 KB, D = 32 65 KB; D = 256 would need
    256 KB > 227 KB and (192, 128) 240 KB, so they are refused; (192, 192) would fit (192 KB) but
    is refused as well until it is measured.

    ``dynamic_schedule`` (persistent only; None: ``FLEXJIT_CUTE_DYNAMIC_SCHEDULE``) picks the
    atomic-counter tile scheduler over the static grid stride; it is ignored without
    ``persistent``.
    """
    if fp8:
        return _fp8_tiling(head_dim, head_dim_v, block_sparse, persistent, tile_m)
    if dynamic_schedule is None:
        dynamic_schedule = dynamic_schedule_default()
    dyn = bool(persistent and dynamic_schedule)
    if (head_dim, head_dim_v) not in HEAD_DIMS:
        raise NotImplementedError(
            f"cute_sm90_fwd: head dims ({head_dim}, {head_dim_v}) not in {HEAD_DIMS}")
    if tile_m not in (None, 128) and not (tile_m == 192 and head_dim in (32, 64, 96)):
        raise NotImplementedError(
            f"cute_sm90_fwd: a {tile_m}-row query tile at head dim {head_dim} (192 rows are "
            "served at head dims 32, 64 and 96, else 128)")
    if persistent and head_dim == 256:
        raise NotImplementedError(
            "cute_sm90_fwd: the persistent variant does not support head_dim 256 (Q 64 KB + "
            "K/V 2x64 KB + a separate O buffer 64 KB = 256 KB > 227 KB of shared memory)")
    if persistent and head_dim == 192:
        raise NotImplementedError(
            f"cute_sm90_fwd: the persistent variant does not support head dims ({head_dim}, "
            f"{head_dim_v}) (no smem for a separate O buffer beside 2 K/V stages)")
    if head_dim == 64:
        if tile_m == 192 or (tile_m is None and not block_sparse):
            return Tiling(192, 128, 3, 3, True, 160, 32, persistent, dyn)
        return Tiling(128, 128, 3, 2, True, 240, 24, persistent, dyn)
    if head_dim == 32:
        if tile_m == 192:
            return Tiling(192, 128, 3, 3, True, 160, 32, persistent, dyn)
        return Tiling(128, 128, 3, 2, True, 240, 24, persistent, dyn)
    if head_dim == 96 and tile_m == 192:
        return Tiling(192, 128, 2, 3, True, 160, 32, persistent, dyn, p_smem=True)
    if head_dim in (96, 128):
        return Tiling(128, 128, 2, 2, True, 240, 24, persistent, dyn)
    if head_dim == 192 and head_dim_v == 128:
        return Tiling(128, 128, 2, 2, True, 240, 24)
    if head_dim == 192:
        return Tiling(128, 64, 2, 2, True, 240, 24)
    return Tiling(128, 64, 2, 2, False, 240, 24)  # 256


def _fp8_tiling(head_dim: int, head_dim_v: int, block_sparse: bool, persistent: bool,
                tile_m: Optional[int]) -> Tiling:
    """The FP8 forward's rows: the 16-bit tiles' shapes (the registers hold the same fp32 S and O;
    P takes half), one tile per CTA. Smem halves for Q, K and V, and O (16-bit) gets a buffer
    of its own: D = 128: Q 16 + 3×(16+16) + O 32 = 144 KB; D = 64: 8 + 3×(8+8) + 16 = 72 KB;
    D = 256: 32 + 2×(16+16) + 64 = 160 KB.
    D = 64 without a block mask takes the 16-bit row's 192 × 128 tile with three consumer
    warpgroups (160 registers: O 32 + S 64 + P 16), spill-free; with a block mask a partial
    tile's mask_mod spills there (28 bytes for causal), so 128 rows, as ``tile_m=128`` pins."""
    if (head_dim, head_dim_v) not in FP8_HEAD_DIMS:
        raise NotImplementedError(
            f"cute_sm90_fwd: FP8 head dims ({head_dim}, {head_dim_v}) not in {FP8_HEAD_DIMS}")
    if persistent:
        raise NotImplementedError("cute_sm90_fwd: the FP8 forward runs one tile per CTA")
    dense_64 = head_dim == 64 and not block_sparse
    if tile_m not in (None, 128) and not (tile_m == 192 and dense_64):
        raise NotImplementedError("cute_sm90_fwd: the FP8 forward runs 128-row tiles (192 at head "
                                  "dim 64 without a block mask)")
    if head_dim == 256:
        return Tiling(128, 64, 2, 2, False, 240, 24)
    if dense_64 and tile_m != 128:
        return Tiling(192, 128, 3, 3, True, 160, 32)
    return Tiling(128, 128, 3, 2, True, 240, 24)


def smem_bytes(cfg: "FwdConfig") -> int:
    """Shared memory the kernel allocates (operand buffers at 1 KB alignment + mbarriers)."""
    t = cfg.tiling
    fp8 = getattr(cfg, "fp8", False)
    elem = 1 if fp8 else 2  # e4m3, else bf16 / fp16 (O is 16-bit)
    q = t.tile_m * cfg.head_dim * elem
    o = t.tile_m * cfg.head_dim_v * 2
    kv = t.num_stages * t.tile_n * (cfg.head_dim + cfg.head_dim_v) * elem
    bars = 8 * (2 + 4 * t.num_stages)
    if t.dynamic_schedule:
        bars += 8  # the published tile index
    q_region = q + o if t.persistent or fp8 else max(q, o)
    p = t.tile_m * t.tile_n * elem if t.p_smem else 0
    return 1024 + q_region + kv + p + bars  # 1024: worst-case padding to the first aligned buffer
