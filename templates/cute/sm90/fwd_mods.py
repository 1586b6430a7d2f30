"""The sm90 forward's holes: score_mod, mask_mod and the kv < S bound applied to one S tile.

A mixin of ``FlexAttentionFwdSm90``. An interval mask's row words are made before the tile's
GEMMs (``_mask_setup``): between the wait for S and the wait for the PV GEMM the code must not
wait on a load, or ptxas places the PV wait right after the S wait and the masking and softmax
no longer overlap the PV GEMM. The masking itself is branch-free (``_apply_mods``).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from flexjit.templates.cute import mask
from flexjit.templates.cute.block_sparse import KIND_FULL, KIND_PARTIAL
from flexjit.templates.cute.common import MASK_BLOCK, FloatIndices, bind, index_add, plain_i32, register_offsets, where


class FwdMods:
    """Needs of the kernel class: ``tile_m``, ``tile_n``, ``score_mod``, ``mask_mod``,
    ``merged_rows``, ``p_smem``; ``ctx``: ``sched``, ``thr_qk``, ``aux``, ``softmax_scale``."""

    def _mask_setup(self, ctx, tile: Int32, j: Int32, kind: cutlass.Constexpr):
        """Before the GEMMs of partial tile ``j`` (kv tile ``tile``): with an interval mask
        (``mask_mod.rows``) its row words, so any tensor the limits read and the merged rows'
        kinds are loaded under the S GEMM; else the entry j, whose merged kinds ``_apply_mods``
        reads after the S wait (read before the GEMMs, hand-written masks spilled on the 192-row
        tile). None on other tiles."""
        if const_expr(kind != "partial"):
            return None
        if const_expr(getattr(self.mask_mod, "rows", None) is not None):
            kinds = ctx.sched.kind_row[j] if const_expr(self.merged_rows) else None
            return self._row_words(ctx, tile, kinds)
        return j

    def _coords(self, ctx, tile: Int32):
        """The thread's identity tensor over the S tile, the tile's first row, and the (q, kv)
        of the thread's first accumulator element."""
        tScS = ctx.thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        first_row = ctx.sched.m_block * self.tile_m
        q0 = plain_i32(first_row + tScS[0][0])
        kv0 = plain_i32(tile * self.tile_n + tScS[0][1])
        if const_expr(self.p_smem):
            # The same (row, col) from the (uniform) warp and the lane: a wgmma accumulator's warp
            # holds rows 16·warp + l/4, columns from 2·(l%4). From tidx, their terms were kept from
            # the setup through the loops and spilled on this tile; the lane ptxas re-reads.
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) - 4
            q0 = plain_i32(first_row + warp * 16 + cute.arch.lane_idx() // 4)
            kv0 = plain_i32(tile * self.tile_n + cute.arch.lane_idx() % 4 * 2)
        return tScS, first_row, q0, kv0

    def _sub_kinds(self, first_row: Int32, q0: Int32, kinds):
        """Merged rows: whether this warpgroup's mask block is full, and whether it is partial,
        for the kv block whose two rows' kinds are ``kinds`` (two bits a row)."""
        sub = q0 // MASK_BLOCK - first_row // MASK_BLOCK
        sub_kind = (kinds >> (sub * 2)) & 3
        return sub_kind == KIND_FULL, sub_kind == KIND_PARTIAL

    def _row_words(self, ctx, tile: Int32, kinds):
        """An interval mask's limits for each of the thread's rows of kv tile ``tile``, as bit
        words over the row's accumulator elements (``mask.row_words``), merged kinds and bound
        folded in."""
        tScS, first_row, q0, kv0 = self._coords(ctx, tile)
        sub_full, sub_partial = self._sub_kinds(first_row, q0, kinds) if const_expr(self.merged_rows) else (None, None)
        rows = self.mask_mod.rows
        batch, head = ctx.sched.batch, ctx.sched.head
        bound_rows = bind(rows, batch, head, ctx.aux)  # its tile-uniform part once, not per row
        offsets = register_offsets(tScS)
        words = {}
        for r in sorted({at[0] for at in offsets}):
            words[r] = mask.row_words(mask.row_limits(
                bound_rows, batch, head, index_add(q0, r), kv0, ctx.sched.seqlen_k, ctx.aux,
                sub_full, sub_partial), [c for q, c in offsets if q == r], rows.bounds)
        return words

    @cute.jit
    def _mods(self, ctx, acc_S: cute.Tensor, tile: Int32, kind: cutlass.Constexpr, setup=None):
        """Branch-free application of the holes to one S tile. kind: "partial" = score_mod,
        mask_mod and the kv < S bound; "bounded" = a full tile that crosses S: score_mod and the
        bound; "full" = score_mod only (nothing at all without one); ``setup``: _mask_setup's."""
        if const_expr(kind == "partial"):
            self._apply_mods(ctx, acc_S, tile, use_mask=True, use_bound=True, setup=setup)
        elif const_expr(kind == "bounded"):
            self._apply_mods(ctx, acc_S, tile, use_mask=False, use_bound=True)
        else:
            if const_expr(self.score_mod is not None):
                self._apply_mods(ctx, acc_S, tile, use_mask=False, use_bound=False)

    @cute.jit
    def _apply_mods(self, ctx, acc_S: cute.Tensor, tile: Int32, use_mask: cutlass.Constexpr,
                    use_bound: cutlass.Constexpr, setup=None):
        """Unrolled over the thread's S registers; (q_idx, kv_idx) per register come from an
        identity tensor partitioned like the accumulator (compile-time offsets + one base).

        An interval mask tests each score's bit in its row's word (``setup``), in place of
        mask_mod, merged kinds and bound; scores go row by row, so that ptxas fills predicates
        from one word at a time (R2P). Merged rows otherwise (a query tile over two mask-block
        rows): a warpgroup's 64 rows lie in one mask block, whose kind for this kv block
        (entry ``setup`` of ``sched.kind_row``) decides per warpgroup: full keeps every score, skip none,
        partial applies mask_mod, exactly as the 128-row tile reading that block would."""
        tScS, first_row, q0, kv0 = self._coords(ctx, tile)
        neg_inf = -Float32.inf
        indices = FloatIndices(q0, kv0)
        rows = getattr(self.mask_mod, "rows", None) if const_expr(use_mask) else None
        sub_full = None
        sub_partial = None
        if const_expr(use_mask and self.merged_rows and rows is None):
            sub_full, sub_partial = self._sub_kinds(first_row, q0, ctx.sched.kind_row[setup])
        batch, head = ctx.sched.batch, ctx.sched.head
        score_mod = bind(self.score_mod, batch, head, ctx.aux)
        mask_mod = bind(self.mask_mod, batch, head, ctx.aux) if const_expr(use_mask) else None
        offsets = register_offsets(tScS)
        words = setup if const_expr(rows is not None) else {}
        for i in sorted(range(len(offsets)), key=lambda i: offsets[i] if words else i):
            at = offsets[i]
            q_idx = index_add(q0, at[0])
            kv_idx = index_add(kv0, at[1])
            s = acc_S[i]
            if const_expr(self.score_mod is not None):
                s = score_mod(s * ctx.softmax_scale, batch, head, q_idx, kv_idx, ctx.aux,
                              *indices.args(self.score_mod, q_idx, kv_idx, at))
            if const_expr(rows is not None):
                s = where(mask.in_row(words[at[0]], at[1], rows.bounds), s, neg_inf)
            elif const_expr(use_mask and self.merged_rows):
                masked = s
                if const_expr(self.mask_mod is not None):
                    keep = mask_mod(batch, head, q_idx, kv_idx, ctx.aux,
                                    *indices.args(self.mask_mod, q_idx, kv_idx, at))
                    masked = where(keep, s, neg_inf)
                s = where(sub_full, s, where(sub_partial, masked, neg_inf))
            elif const_expr(use_mask and self.mask_mod is not None):
                keep = mask_mod(batch, head, q_idx, kv_idx, ctx.aux,
                                *indices.args(self.mask_mod, q_idx, kv_idx, at))
                s = where(keep, s, neg_inf)
            if const_expr(use_bound and rows is None):
                s = where(kv_idx < ctx.sched.seqlen_k, s, neg_inf)
            acc_S[i] = s
