"""The sm90 backward's tile table and schedule variants (pure Python: what shapes a compile).

* ``BwdTiling``: one configuration of the main kernel's tile and schedule.
* ``choose_bwd_tiling``: the tile table (a row per head-dim pair), ``bwd_tiling``: that row with
  the schedule variants a ``BWD_CONFIG`` string names (the tuner's backward candidates).
* ``lpt_coords``: the longest-first launch order's arithmetic (``BwdTiling.lpt_section``).
"""
import dataclasses
from dataclasses import dataclass

from flexjit.templates.cute.common import MASK_BLOCK



# (head_dim, head_dim_v) pairs with a row in ``choose_bwd_tiling``'s table.
HEAD_DIMS = ((32, 32), (64, 64), (96, 96), (128, 128), (192, 192), (192, 128))


@dataclass(frozen=True)
class BwdTiling:
    tile_m: int  # query rows per iteration (the N of the swapped S GEMM): 64, 80 or 128
    tile_n: int  # keys per CTA (M of the swapped GEMMs): MASK_BLOCK, or half of it (D = 192)
    num_stages: int  # Q/dO (and dS) pipeline depth
    dq_split: str  # how the two warpgroups split the dQ tile: "cols" (D) or "rows" (tile_m)
    overlap_dp: bool  # issue dP with S and form P under it (needs Sᵀ and dPᵀ live together)
    mma_regs: int
    load_regs: int
    # dQᵀ = Kᵀ dSᵀ (head dims as M, the warpgroups split them): any tile_m that is a multiple
    # of 16 (80 is no wgmma M); the accumulator is then kept transposed, (B, Hq, D, Lpad).
    dq_swapped: bool = False
    # P converted to 16 bits only after dS is formed, the dV GEMM issued after dS (FA3's
    # order): P's 16-bit copy is not live across the dP wait. It is converted from the Sᵀ
    # accumulator, which must then hold P itself: no score_mod, captured gradients, or a
    # score_mod whose d score/d score is 1 (``BwdConfig.unit_dscore``: additive biases).
    p_late: bool = False
    # dV += Pᵀ dO issued once dS is formed, converted and stored to smem (behind the proxy
    # fence before the dS barrier: FlashAttention-4's order), not before the dPᵀ wait (or, with
    # p_late, right after dS is formed). Nothing is in flight while dS is formed, and ptxas
    # cannot hoist the dV wgmmas into the elementwise work: it schedules a wgmma as early as its
    # register operands allow (in order with the other wgmmas, never above a proxy fence), so
    # with p_late it interleaves dV with the forming of dS, where Sᵀ, dPᵀ and P are live. At
    # 128 rows (D = 64) both earlier issue points leave too few registers for the wgmma
    # pipeline, and ptxas serialises every wgmma (C7512).
    dv_after_ds: bool = False
    # lse2 and delta held one value in 8 per thread and fetched by warp shuffle at each use
    # (``bwd_rows.ShuffledRow``), instead of tile_m / 4 registers each read before the waits.
    shuffle_stats: bool = False
    # dK += dSᵀ Q reads dSᵀ from the smem tile the dQ GEMM reads (SS) instead of registers: dS
    # needs no 16-bit register copy past its store, which frees P's copy a block of its own.
    dk_smem: bool = False
    # dV += Pᵀ dO reads Pᵀ from smem (SS; P stored by stmatrix into an extra stage of the dS
    # buffer) instead of registers: P needs no 16-bit register copy across the dP wait.
    p_smem: bool = False
    # CTAs take their (kv tile, kv head, batch) longest first (``_lpt_order``), in sections of
    # this many (kv head, batch) pairs (0: the launch order): for masks whose work falls with the
    # kv tile (causal), where a GQA CTA's long loop would start late. The section bounds the Q
    # and dO bytes the running CTAs read: 8 pairs paid at D = 64 and lost at 128 (4 heads a kv
    # head, 8k: 64 against 128 MB), so the width is a variant of its own.
    lpt_section: int = 0
    # The dim split's S/dP GEMMs split by query rows instead of computed whole in each
    # warpgroup (``choose_bwd_tiling``'s D = 192 entry): each warpgroup forms Sᵀ and dPᵀ for its
    # tile_m / 2 queries, Pᵀ and dSᵀ go to smem, and the dV/dK GEMMs read them there (SS).
    q_split: bool = False
    # One CTA per (kv tile, QUERY head, batch) instead of per kv head looping over the group
    # (FlashAttention-4's GQA backward): g times the CTAs, so a causal launch's long CTAs no
    # longer start last behind a g-long loop. dK/dV are then sums over g CTAs: each adds its
    # fp32 accumulators into per-kv-head fp32 workspaces (TMA reduce-add, ``bwd_qhead``), which
    # a postprocess converts. The host keeps the head loop where it serves better or is needed:
    # Hq = Hkv, and deterministic mode (g unordered fp32 adds).
    q_head: bool = False

# Whether the D = 192 row splits the S/dP GEMMs by query rows (``BwdTiling.q_split``); the
# tokens "qsplit" and "sdpdup" pick either form whatever this says.
D192_Q_SPLIT = False


def choose_bwd_tiling(head_dim: int, head_dim_v: int, overlap_dp: bool = True) -> BwdTiling:
    """Tile table: a 64-row Q tile against a 128-key tile (one mask block) for D = 128 and 64.

    Per MMA warpgroup (64 keys) and thread, fp32 registers: Sᵀ and dPᵀ tile_m/2 = 32 each, dV
    and dK D/2 each, dQ D/4 (its 64 × D/2 half), plus bf16 P and dS 16 each.
    * D = 128, 64 × 128: dV + dK alone hold 128 registers for the whole CTA. With
      ``overlap_dp`` (P formed while the dP GEMM runs) the elementwise step has Sᵀ, dPᵀ, P live:
      208 + the mods' temporaries (+ 16 of lse2 or delta, read ahead of the waits) under the
      240 cap. Fine without mods or with light ones (comparisons: causal, windows); mods with
      loads or transcendentals (document ids, ALiBi slopes, softcap's tanh) spill 20-64 bytes
      there, so they issue dP after P instead (176
      live while the mods run; measured spill-free). An 80-row tile (FA3's non-causal choice)
      would not divide the 128-row mask block, so a CTA would straddle two rows of the block
      lists, and 80 is no wgmma M (the dQ GEMM would have to be swapped); 64 divides it.
      Smem: Q, dO, dS 2 stages × 16 KB, K, V 32 KB each, dQ boxes 32 KB = 192 KB.
    * D = 64, 64 × 128 too (dV + dK = 64 registers, so overlap always fits). FA3 uses 128 × 128
      here (longer Q tiles amortise the per-tile work of the short K=64 GEMMs); with it Sᵀ, dPᵀ
      (64 each), P (32) and dV, dK (32 each) reach the cap: ptxas serialises the wgmmas
      (advisory C7512: a wait after every wgmma), with or without overlap_dp
      (``BwdTiling(128, 128, 2, "rows", ..)`` builds), also with lse2/delta held one value in 8
      ("shuffle", FA4's). The wgmma that does not fit is dV's: issued before the dPᵀ wait it
      keeps P (bf16) and dV in flight beside Sᵀ/P, dPᵀ and dK (224 of 240); issued after dS is
      formed ("late"), ptxas hoists it back into the elementwise work. Issued once dS is
      stored, behind the proxy fence ("dvafter", FA4's order), the 128-row tile compiles
      clean with masks: "m128+shuffle+dvafter". Score mods spill there (ALiBi 264 bytes: ptxas
      forms the ~34 distinct biases of a thread in one batch after the Sᵀ wait, beside P's
      16-bit copy); with P converted after dS ("m128+shuffle+late+dvafter", for mods whose
      d score/d score is 1) ALiBi and T5's bucketed bias compile clean, a per-element bias
      table still spills (relative_bias 92 bytes). The rest of the room is dPᵀ's accumulator,
      in flight while P is formed: issued after P ("dpafter", the D = 128 row's order for heavy
      mods), "m128+shuffle+late+dvafter+dpafter" compiles relative_bias clean too, and with
      learnable_alibi's captured gradients "+dksmem"; mods whose d score/d score is not 1
      (softcap) keep P's 16-bit copy, which fits only from smem:
      "m128+psmem+dksmem+shuffle+dpafter" compiles clean with every core mod that spills
      above (learnable_bias's gradients included).
    * D = 32: D = 64's row (overlap always).
    * D = 96: D = 128's row, but overlap always: dV + dK = 96 registers leave room for every
      core mod's temporaries beside Sᵀ, dPᵀ and P (all 18 compile spill-free overlapped, heavy
      ones included). Smem 153 KB.
      K's swizzle atom is 32 bytes, not 64 (``k_atom_cols``: the dQ GEMM splits K's 96 columns
      at 48 between the warpgroups).
    * D = 192 and (192, 128): 64 × 64 with the head dims split between the warpgroups. With
      64 keys per warpgroup (the wgmma M) dK + dV alone are D/2 + Dv/2 = 192 (160) registers
      per thread, Sᵀ and dPᵀ 32 more each: over the cap. So both warpgroups take the same 64
      keys and split N of the dK/dV/dQ GEMMs: dK + dV = 96 (80) per thread, Sᵀ, dPᵀ 32 each,
      P, dS 16 each, dQ 48: ~176 at the elementwise step with P under dP, so overlap always.
      The price: each warpgroup computes the whole Sᵀ and dPᵀ (7 GEMM units of work for 5)
      and Q/dO are streamed once per 64 keys instead of 128. FA3 instead uses 64 × 96 tiles
      with swapped dK/dV GEMMs: the "keys96" variant (``KEYS96``, ``bwd_keys``), whose tiles
      straddle mask blocks (the host derives q lists per 96-key tile). Q, dO, K and V get
      32-column swizzle atoms at 192 (``k_atom_cols``: each half starts on an atom); V and dO
      keep 64-column atoms at Dv = 128.
      ``q_split`` ("qsplit") removes the duplicated GEMMs: each warpgroup forms Sᵀ and dPᵀ
      for its 32 of the 64 query rows (m64n32 wgmmas), stores Pᵀ and dSᵀ (stmatrix.trans) into
      smem, and after a named barrier reads both halves there for dV += Pᵀ dO and dK += dSᵀ Q
      over its half of the head dims (SS); dQ = dS K as before. Per thread: dK + dV 96 (80),
      Sᵀ, dPᵀ 16 each, P 8, dQ 48. Smem: Pᵀ takes a stage per Q stage beside dS (16 KB more:
      225 KB at 192, 201 KB at (192, 128)).
    Registers: 2 MMA warpgroups at 240 + the producer warpgroup at 24 = 64512 (the launch's
    168 per thread × 384): setmaxnreg.inc can only take what .dec released, so 240/24 is the
    largest split (240/32 would leave the MMA warpgroups waiting forever).
    """
    if (head_dim, head_dim_v) not in HEAD_DIMS:
        raise NotImplementedError(
            f"cute_sm90_bwd: head dims ({head_dim}, {head_dim_v}) not in {HEAD_DIMS}")
    if head_dim == 192:
        # Half a mask block per CTA, head dims split between the warpgroups (see above).
        return BwdTiling(64, 64, 2, "cols", True, 240, 24, q_split=D192_Q_SPLIT)
    return BwdTiling(64, 128, 2, "cols", overlap_dp or head_dim <= 96, 240, 24)


# The schedule variants a backward may be asked for by name (``bwd_tiling``), each a change to
# the tile table's row: "late" (``BwdTiling.p_late``), "dksmem" (``dk_smem``), "psmem"
# (``p_smem``), "lpt" / "lpt2" (``lpt_section`` 8 / 2), "shuffle" (``shuffle_stats``), "swapdq"
# (``dq_swapped``), "dvafter" (``dv_after_ds``), "m80" (80-row tiles, dense launches only, with the
# dQ GEMM swapped), "m128" (128-row tiles, head dims up to 64, dQ split by rows), "dpafter"
# (``overlap_dp`` off: the dP GEMM issued once P is formed, for mods too heavy to form P beside
# dPᵀ's accumulator), "qhead" (``q_head``: one CTA per query head, head dims up to 128); for the dim
# split (D = 192) only: "qsplit" / "sdpdup" (the S/dP GEMMs split by query rows,
# ``BwdTiling.q_split``, or computed whole in each warpgroup), and "keys96": 64 × 96 tiles instead
# (``KEYS96``, the kernel ``bwd_keys.FlexAttentionBwdKeysSm90``).
BWD_CONFIG_TOKENS = ("late", "dksmem", "psmem", "lpt", "lpt2", "shuffle", "swapdq", "dvafter", "m80",
                     "m128", "qsplit", "sdpdup", "qhead", "keys96", "dpafter")
_DIM_SPLIT_TOKENS = ("qsplit", "sdpdup", "keys96")

# D = 192's 96-key tile (FlashAttention-3's): S and dP not swapped, the warpgroups split the keys
# 48 each; dKᵀ, dVᵀ swapped (head dims as M); Q (+ lse2) two stages, dO one at Dv = 192 and two
# at 128 (``bwd_keys``).
# The tile_n of 96 is what selects that kernel.
KEYS96 = BwdTiling(64, 96, 2, "cols", True, 240, 24)


def keys96(tiling) -> bool:
    """Whether ``tiling`` is the 96-key tile's (the ``bwd_keys`` kernel, q lists per 96 keys)."""
    return tiling is not None and tiling.tile_n == KEYS96.tile_n


def bwd_tiling(head_dim: int, head_dim_v: int, overlap_dp: bool = True, config: str = "") -> BwdTiling:
    """``choose_bwd_tiling``'s row with the variants ``config`` names ("+"-joined
    ``BWD_CONFIG_TOKENS``; "" is the row itself)."""
    base = choose_bwd_tiling(head_dim, head_dim_v, overlap_dp)
    tokens = [t for t in config.split("+") if t]
    unknown = [t for t in tokens if t not in BWD_CONFIG_TOKENS]
    if unknown:
        raise ValueError(f"unknown backward variant(s) {unknown}; known: {BWD_CONFIG_TOKENS}")
    split = [t for t in tokens if t in _DIM_SPLIT_TOKENS]
    if base.tile_n != MASK_BLOCK:
        if len(split) != len(tokens) or len(split) > 1:
            raise ValueError(f"head dims ({head_dim}, {head_dim_v}) take one of "
                             f"{_DIM_SPLIT_TOKENS} as their only backward variant")
        if split == ["keys96"]:
            return KEYS96  # P always under dP (``bwd_keys``), whatever overlap_dp says
        return dataclasses.replace(base, q_split=split == ["qsplit"]) if split else base
    if split:
        raise ValueError(f"{split} serve head dim 192 only")
    fields = dict(p_late="late" in tokens, dk_smem="dksmem" in tokens, p_smem="psmem" in tokens,
                  lpt_section=8 if "lpt" in tokens else 2 if "lpt2" in tokens else 0,
                  shuffle_stats="shuffle" in tokens, dq_swapped="swapdq" in tokens,
                  dv_after_ds="dvafter" in tokens, q_head="qhead" in tokens)
    if "dpafter" in tokens:
        # Whatever the table's row says (head dims up to 96 always overlap there).
        fields.update(overlap_dp=False)
    if "m80" in tokens:
        fields.update(tile_m=80, dq_swapped=True)
    if "m128" in tokens:
        if head_dim > 64:
            raise ValueError("128-row backward tiles serve head dims up to 64")
        fields.update(tile_m=128, dq_split="rows")
    if fields["dv_after_ds"] and fields["p_smem"]:
        raise ValueError("'dvafter' orders the dV GEMM that reads P from registers, not 'psmem'")
    if fields["dq_swapped"] and head_dim != 128:
        raise ValueError("the swapped dQ GEMM serves head dim 128 (64 head dims per warpgroup)")
    if fields["q_head"] and fields["dq_swapped"]:
        # The dK/dV workspaces share the plain dQ postprocess, which the swapped one replaces.
        raise ValueError("'qhead' does not combine with the swapped dQ GEMM ('swapdq', 'm80')")
    return dataclasses.replace(base, **fields)


def lpt_coords(r, nx, ny, nz, section: int, minimum=min):
    """``FlexAttentionBwdSm90._lpt_order``'s arithmetic (plain ints too, for the tests): launch
    index r of an (nx, ny, nz) grid -> (kv tile, kv head, batch), a bijection; ``section``
    (kv head, batch) pairs walked together, kv tile by kv tile."""
    per_section = nx * section
    sec = r // per_section
    width = minimum(section, ny * nz - sec * section)
    j = r - sec * per_section
    pair = sec * section + j % width
    return j // width, pair % ny, pair // ny
