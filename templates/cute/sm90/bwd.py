"""Hopper (sm_90a) FlashAttention backward template with two holes: ``score_mod_and_grad`` and ``mask_mod``.

What this module holds
----------------------
* ``BwdConfig`` / ``choose_bwd_tiling``: the frozen compile-time configuration and the tile table.
* Three kernels, run in this order on one stream:
  - ``FlexAttentionBwdPreSm90`` (preprocess): ``delta = rowsum(dO∘O) − dLSE`` and
    ``lse2 = LSE·log2 e`` (0 on a row with nothing kept), fp32, padded to whole mask blocks; it
    zeroes the fp32 dQ accumulator (and the dQ semaphores in deterministic mode).
  - ``FlexAttentionBwdSm90`` (main): one CTA per (kv tile, kv head, batch); dK and dV in
    registers, dQ partial sums added into the fp32 accumulator by TMA reduce-add. With
    ``BwdConfig.kv_batch_broadcast`` K/V have batch 1 and every batch's CTAs load entry 0; dK/dV
    stay per query batch (B, Hkv, S, ·), summed over the batch by the caller (autograd).
  - ``FlexAttentionBwdPostSm90`` (postprocess): ``dQ = accumulator · softmax_scale`` in the
    input dtype.
* The host half (compiling against placeholders, the workspaces, the argument checks and the
  launch: ``compile_bwd`` / ``CompiledBwd`` / ``load_bwd``) is ``bwd_host`` (on ``host``); this
  module holds what runs on the device and the configuration it is traced with. ``Lpad`` below
  is ``host.padded_len(L)``: whole mask blocks.

Gradients of captured tensors that require grad: ``captured_grads``, supported when those
derivatives and the indices do not depend on the score (else the Triton backward serves).
Out of scope: head dims other than 32, 64, 96, 128, 192, (192, 128) (``HEAD_DIMS``); sm100.

Algorithm (FlashAttention-2 §3.2 backward; FlashAttention-3 §3 Hopper pipelining)
--------------------------------------------------------------------------------
Math, with s = score_mod(q·k·scale) (natural units), P = softmax(s) recomputed from the saved LSE::

    P = exp2(s·c − lse2)          (c = scale·log2 e without a score_mod, log2 e with one)
    dP = dO Vᵀ      dS = P ∘ (dP − delta) ∘ dscore      dscore = d score_mod / d score
    dV = Σ Pᵀ dO    dK = scale · Σ dSᵀ Q                 dQ = scale · Σ dS K

Masked and out-of-range elements get P = dS = 0, never NaN (whatever dscore is there); a row with
nothing kept has lse2 = 0 and all scores −inf: zero gradients.

Roles (384 threads, ``min_blocks_per_mp=1`` so that ``setmaxnreg`` takes effect):
* warpgroup 0 (``setmaxnreg.dec`` to 24): warp 0 = TMA producer (K and V once, then Q + lse2 and
  dO + delta through two ``num_stages``-deep mbarrier pipelines); warps 1 and 2 = dQ writers,
  one per MMA warpgroup (TMA reduce-add of its dQ box into the fp32 accumulator; the
  semaphores of deterministic mode); warp 3 idles.
* warpgroups 1, 2 (``setmaxnreg.inc`` to 240): MMA. Each owns 64 of the tile's 128 keys (the
  dim split: both own its 64 keys and split the head dims; see Tiles).

Per Q tile, in each MMA warpgroup (the S/dP GEMMs are "swapped": keys are M, so that Pᵀ and dSᵀ
come out already in the A-operand layout of the dV/dK GEMMs, which read them from registers)::

    Sᵀ = K Qᵀ  [and dPᵀ = V dOᵀ when overlap_dp]       SS wgmma
    lse2 smem -> registers (before the wait: the loads land under the GEMMs)
    wait Sᵀ: score_mod_and_grad, mask_mod, bounds, P = exp2(..) -> P (bf16, registers), P∘dscore
    delta smem -> registers  ·  [dPᵀ = V dOᵀ when not overlap_dp]  ·  dV += Pᵀ dO (RS: needs only P)
    wait dPᵀ: dS = P∘dscore∘(dP − delta) (bf16, registers)
    dSᵀ → smem (stmatrix.trans) · named barrier: both halves of dS are needed by each dQ GEMM
    dQ = dS K (SS) · dK += dSᵀ Q (RS) · dQ → smem box · signal the warpgroup's dQ writer
``overlap_dp`` (``choose_bwd_tiling``) forms P while the dP GEMM runs; for D = 128 it fits the
registers only without mods or with light ones, so by default heavier mods issue dP after P.

Tiles (``choose_bwd_tiling``): Q tile × kv tile = 64 × 128 for head dims 32, 64, 96, 128.
The kv tile is one mask block, so a CTA reads exactly one column of the transposed block lists; a
listed q mask block is two Q tiles. Smem 194 KB (D = 128) / 153 KB (96) / 114 KB (64) / 73 KB (32).
D = 192 and (192, 128): the 96-key tile ("keys96", ``bwd_keys.FlexAttentionBwdKeysSm90``, a
subclass) where it serves; else 64 × 64, the "dim split" (``kv_per_block`` = 2: two CTAs per
mask block, the warpgroups split dK's, dV's and dQ's columns; ``bwd_tiling`` has the details,
``_q_tile_split`` the ``q_split`` form). Smem 209 KB (192) / 185 KB (192, 128).

dQ path: each MMA warpgroup writes its 64 × D/2 fp32 piece of dQ into its own smem box (no
swizzle: ``dq_smem_layout``) and signals its dQ writer (named barriers "full"/"empty", 160
threads), which reduce-adds the box into the accumulator (B, Hq, Lpad, D) by TMA and frees it
once read. The accumulator holds dQ permuted within each 16 × 8 block (``dq_box_view``) so that
a thread's values form 16-byte runs (STS.128); the postprocess undoes the permutation.

GQA: query head h reads kv head h // g. A CTA loops over the g query heads of its kv head,
accumulating dK/dV in registers (FlashAttention-2's choice): no fp32 accumulator, reduction or
atomics, deterministic for free, K and V loaded once for g heads; the price is g× fewer CTAs.
``BwdTiling.q_head`` launches one CTA per query head and sums dK/dV in fp32 (``bwd_qhead``).

Deterministic mode (``BwdConfig.deterministic``): each dQ box (b, h, q tile, half) receives one
reduce-add from every kv block that lists its q block, in DEcreasing kv-block order. A semaphore
per box counts the adds done; kv block n's dQ writer waits until it equals n's rank (the listed
kv blocks n' > n of that q block: ``flexjit.block_mask.dq_order``, once per BlockMask; nKV - 1 - n
without one), adds, waits for the add, and increments it (acquire/release at gpu scope,
async-proxy fences). The MMA warpgroups run on, one tile ahead at most. dK/dV: see GQA.
Order, chosen so that the waits do not chain: a kv block walks its partial and full q blocks as
ONE list in increasing q order (``dq_order`` merges them and flags the full entries, so the host
passes empty full lists), and the grid runs kv blocks last-first. On banded masks (causal,
sliding window, documents) kv block n's k-th q block is then kv block n+1's (k-1)-th, whose add
it waits for: every CTA of a head advances in lockstep, one tile behind its neighbour. (Increasing
kv order, partial list first, chained every CTA to its neighbour's last tile: 5x slower on an
8k sliding window.) No deadlock: a CTA waits only for CTAs of its (kv head, batch) with a larger
kv block, i.e. a smaller linear block index, dispatched earlier.

The holes
---------
``score_mod_and_grad(score, b, h, q_idx, kv_idx, aux) -> (modded, d modded / d score)`` and
``mask_mod(b, h, q_idx, kv_idx, aux) -> Boolean``, both compile-time callables (or None), inlined
per element exactly as in ``sm90.fwd`` (same ``Aux``; ``h`` is the QUERY head; rows q >= L
and columns kv >= S can reach them and their results are discarded).

Block lists (FlexAttention's BlockMask, mask block 128×128, int32, Bm ∈ {1, B}, Hm ∈ {1, Hq}):
``q_num_blocks`` (Bm, Hm, nKV) + ``q_indices`` (Bm, Hm, nKV, nQ) list the PARTIAL q blocks of
each kv block (mask_mod applied), ``full_q_*`` the FULL ones (mask_mod skipped; bounds still
checked on a tile that crosses L or S). The host API (``bwd_host``) takes all 8
BlockMask tensors (the kernel reads the q lists; deterministic mode reads ``dq_order``'s merged
ones). Without a block mask every q tile is visited (partial with a mask_mod, else full).

Shapes: q (B, Hq, L, D), k/v (B, Hkv, S, D), out/dout (B, Hq, L, D), lse/dlse (B, Hq, L) fp32;
dq/dk/dv like q/k/v. Last dims contiguous, other strides multiples of 8 elements (TMA), bf16 or
fp16, ragged L and S, L != S, Hq = g·Hkv.
"""

from collections import namedtuple
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp
from cutlass.memory.smem import SmemAllocator

from flexjit.templates.cute import captured_grads, config, softmax
from flexjit.templates.cute.block_sparse import QBlockLists, QOrder, listed_tile, order_rows, q_lists
from flexjit.templates.cute.common import MASK_BLOCK, Aux, FloatIndices, bind, index_add, kernel_aux, launch, permute, plain_i32, register_offsets, smem_buffer, smem_layout, tma_tiles, transposed, wgmma_gemm, where
from flexjit.templates.cute.opaque import opaque_i32, opaque_smem, opaque_thread_idx
from flexjit.templates.cute.pipeline import tma_pipelines
from flexjit.templates.cute.sm90 import bwd_qhead
from flexjit.templates.cute.sm90.bwd_atoms import dq_atom, load_atoms
from flexjit.templates.cute.sm90.bwd_rows import row_values, shuffled_row
from flexjit.templates.cute.sm90.bwd_tiling import BwdTiling, choose_bwd_tiling, lpt_coords
from flexjit.templates.cute.sm90.dq import dq_box_view, dq_smem_layout, k_atom_cols, store_dq_acc

# Named barrier ids (0 is __syncthreads).
_BAR_MMA = 1  # the 256 MMA threads: dS tile complete in smem; epilogue
_BAR_DQ_EMPTY = 2  # + warpgroup: its dQ warp lets the warpgroup write its dQ box
_BAR_DQ_FULL = 4  # + warpgroup: the warpgroup's dQ box is written
_DQ_BAR_THREADS = 128 + 32
_BAR_WG = 6  # + warpgroup: the warpgroup's own dS rows are in smem (``BwdTiling.dk_smem``)


@dataclass(frozen=True)
class BwdConfig(config.BwdConfig):
    """The sm90 backward's configuration: the shared fields, its tiling and the K/V batch
    broadcast."""

    # Form P under the dP GEMM (faster, more registers). None: only when there are no mods;
    # the backend passes True for light mods (no loads, no transcendentals in the IR).
    overlap_dp: Optional[bool] = None
    tiling: BwdTiling = field(default=None)
    # K/V of batch extent 1 serve every query batch (torch's batch broadcast; the paged caches):
    # the main kernel loads them at batch 0 and still writes dK/dV per query batch, into
    # (B, Hkv, S, ·), which autograd's expand backward sums.
    kv_batch_broadcast: bool = False
    # d score/d score is the constant 1 (additive mods): P∘dscore is P (``BwdTiling.p_late``).
    unit_dscore: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.tiling is None:
            overlap = self.overlap_dp
            if overlap is None:
                overlap = self.score_mod_and_grad is None and self.mask_mod is None
            object.__setattr__(self, "tiling",
                               choose_bwd_tiling(self.head_dim, self.head_dim_v, overlap))


def _transposed_2d(s: cute.Tensor) -> cute.Tensor:
    """(rows, cols) smem tensor viewed as (cols, rows): Kᵀ for the dQ GEMM."""
    return cute.composition(s, cute.make_ordered_layout((s.shape[1], s.shape[0]), order=(1, 0)))


@cute.jit
def _copy_if(pred, atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor):
    """``cute.copy`` under a runtime predicate, in its own function: a branch in the caller
    would carry the caller's trace-time state (shapes included) through the branch as runtime
    values."""
    if pred:
        cute.copy(atom, src, dst)


def _as_acc_layout(frag_a: cute.Tensor, acc: cute.Tensor) -> cute.Tensor:
    """The RS A-operand fragment ``frag_a`` ((2, 2, 2), MMA_M, K/16) viewed with the accumulator
    layout ((2, 2, V), MMA_M, MMA_N) of ``acc``: both are compact and enumerate (column pair,
    row half, 8-column group) in the same order (the forward's ``acc_as_operand_a`` is a pure
    regrouping), so
    P and dS are written straight into the registers the dV/dK GEMMs read: no second copy."""
    return cute.make_tensor(frag_a.iterator, cute.make_layout(acc.shape))


# ---------------------------------------------------------------------------------------------
# Main kernel
# ---------------------------------------------------------------------------------------------
class FlexAttentionBwdSm90(config.TiledKernel):
    """Warp-specialised FlashAttention-3 style backward for sm_90a with score/mask holes."""

    def __init__(self, cfg: BwdConfig):
        super().__init__(cfg, 256)
        t = cfg.tiling
        self.dq_split = t.dq_split
        self.overlap_dp = t.overlap_dp
        self.deterministic = cfg.deterministic
        self.score_grads, self.grad_offsets = cfg.score_grads, cfg.grad_offsets
        assert (self.score_grads is None) == (self.grad_offsets is None)
        assert self.score_grads is None or self.score_mod is not None
        self.dq_swapped, self.p_late, self.shuffle_stats = t.dq_swapped, t.p_late, t.shuffle_stats
        self.dk_smem, self.p_smem, self.lpt_section = t.dk_smem, t.p_smem, t.lpt_section
        self.dv_after_ds = t.dv_after_ds
        self.q_split, self.q_head = t.q_split, t.q_head
        self.do_stages = self.num_stages  # dO(+delta) stages (``bwd_keys`` may take one)
        # q_head: g CTAs add into each dK/dV box, in no fixed order; its fp32 boxes reuse the
        # operand tiles (``bwd_qhead``), which needs two Q stages of 64 rows or more.
        assert not self.q_head or not (self.deterministic or self.dq_swapped)
        assert not self.q_head or (t.tile_n == MASK_BLOCK and t.tile_m * t.num_stages >= 128)
        assert not (self.p_smem and (self.p_late or self.dv_after_ds))
        assert not self.p_smem or t.tile_n == MASK_BLOCK  # not with the dim split
        assert not self.dk_smem or t.tile_n == MASK_BLOCK  # not with the dim split
        # p_late converts P from the fp32 it leaves in the Sᵀ accumulator: that is P itself
        # only without a score_mod, with captured gradients, or with d score/d score = 1.
        assert not self.p_late or self.score_mod is None or self.score_grads is not None \
            or cfg.unit_dscore
        # 96 keys: ``bwd_keys.FlexAttentionBwdKeysSm90`` (its own q lists per kv tile).
        assert self.tile_n in (MASK_BLOCK, MASK_BLOCK // 2, 96) and self.tile_m % 16 == 0
        # Block lists name 128-row q blocks: a tile must be a whole fraction of one. A tile
        # that is not (80 rows) serves dense launches only.
        assert MASK_BLOCK % self.tile_m == 0 or not self.sparse
        assert self.tile_m % 64 == 0 or self.dq_swapped  # the dQ GEMM's M is then the head dim
        self.tiles_per_mask_block = max(1, MASK_BLOCK // self.tile_m)
        # kv tiles per mask block. 2 (tile_n = 64, D = 192): "dim split": both MMA warpgroups
        # hold all 64 keys and split the head dims of dK/dV (and dQ) between them; each one
        # computes the whole Sᵀ and dPᵀ (the same 64 × tile_m tile, redundantly).
        self.kv_per_block = MASK_BLOCK // self.tile_n
        self.dim_split = self.kv_per_block > 1
        # ``BwdTiling.q_split``: the dim split without the duplicated Sᵀ/dPᵀ (each warpgroup
        # half of the query rows; P and dS reach dV/dK through smem). dup_sdp: both warpgroups
        # hold the whole Sᵀ/dPᵀ.
        assert not self.q_split or (self.dim_split and self.tile_m == 64)
        self.dup_sdp = self.dim_split and not self.q_split
        # Each MMA warpgroup owns one fp32 dQ box: half the columns or half the rows; swapped,
        # half the head dims of dQᵀ (its rows) by all of the tile's query rows.
        assert self.head_dim % 16 == 0
        if self.dq_swapped:
            self.dq_box = (self.head_dim // 2, self.tile_m)
        elif self.dq_split == "cols":
            self.dq_box = (self.tile_m, self.head_dim // 2)
        else:
            self.dq_box = (self.tile_m // 2, self.head_dim)
        assert self.dq_box[0] == 64

    # -----------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Hq, L, D)
        mK: cute.Tensor,  # (B, Hkv, S, D); (1, Hkv, S, D) with kv_batch_broadcast
        mV: cute.Tensor,  # (B, Hkv, S, Dv); (1, Hkv, S, Dv) with kv_batch_broadcast
        mdO: cute.Tensor,  # (B, Hq, L, Dv)
        mLSE2: cute.Tensor,  # (B, Hq, Lpad) fp32, log2 units
        mDelta: cute.Tensor,  # (B, Hq, Lpad) fp32
        mdQacc: cute.Tensor,  # (B, Hq, Lpad, D) fp32, zeroed; (B, Hq, D, Lpad) if dq_swapped
        mdK: cute.Tensor,  # (B, Hkv, S, D); q_head: (B, Hkv, Spad, D) fp32, zeroed
        mdV: cute.Tensor,  # (B, Hkv, S, Dv); q_head: (B, Hkv, Spad, Dv) fp32, zeroed
        softmax_scale: Float32,
        q_per_kv: Int32,  # Hq // Hkv (a kernel parameter: read from the constant bank, no register)
        qblocks: Optional[QBlockLists],
        qorder: Optional[QOrder],  # deterministic block-sparse launches only
        mSem: Optional[cute.Tensor],  # (B, Hq, 2·Lpad/tile_m) int32 per dQ box, zeroed (deterministic)
        aux_tensors: Optional[tuple],
        aux_scalars: Optional[tuple],
        grad_accs: Optional[tuple],  # one flat fp64 accumulator per learnable tensor, zeroed
        stream: cuda.CUstream,
    ):
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype):
            raise TypeError("q/k dtype does not match the config")
        # Sequence-major views: (seq, dim, head, batch) and (Lpad, head, batch).
        q, k, v, do, dk, dv, dqacc = [permute(t, [2, 3, 1, 0])
                                      for t in (mQ, mK, mV, mdO, mdK, mdV, mdQacc)]
        lse2, delta = [permute(t, [2, 1, 0]) for t in (mLSE2, mDelta)]

        D, Dv, tm, tn, st = self.head_dim, self.head_dim_v, self.tile_m, self.tile_n, self.num_stages
        if const_expr(self.dim_split):
            # dK/dV read Q and dO MN-major split at D/2 and Dv/2: whole swizzle atoms per half.
            sQ_layout = smem_layout(self.dtype, tm, D, st, atom_cols=k_atom_cols(D, "cols"))
            sdO_layout = smem_layout(self.dtype, tm, Dv, st, atom_cols=k_atom_cols(Dv, "cols"))
        else:
            sQ_layout = smem_layout(self.dtype, tm, D, st)
            sdO_layout = smem_layout(self.dtype, tm, Dv, st)
        sK_layout = smem_layout(self.dtype, tn, D, atom_cols=k_atom_cols(D, self.dq_split))
        sV_layout = smem_layout(self.dtype, tn, Dv, atom_cols=(
            k_atom_cols(Dv, "cols") if const_expr(self.dim_split) else None))
        # dS stages, then Pᵀ's: one (``p_smem``: read by its own warpgroup only) or one per Q
        # stage (``q_split``: both warpgroups read all of it, as dS).
        p_stages = st if const_expr(self.q_split) else (1 if const_expr(self.p_smem) else 0)
        sdS_layout = smem_layout(self.dtype, tm, tn, st + p_stages)
        sdQ_layout = dq_smem_layout(*self.dq_box)
        # lse2 / delta stages, each starting on 128 bytes (a TMA destination's alignment: an
        # 80-row tile's 320-byte stage would not)
        self.row_pitch = -(-tm // 32) * 32
        sRow_layout = cute.make_layout((tm, st), stride=(1, self.row_pitch))

        (tma_q, tQ), (tma_do, tdO), (tma_k, tK), (tma_v, tV), (tma_lse, tLSE), (tma_delta, tDelta) = \
            load_atoms(self, q, k, v, do, lse2, delta, sQ_layout, sdO_layout, sK_layout, sV_layout)
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        if const_expr(self.q_head):
            (tma_dk, tdK), (tma_dv, tdV) = bwd_qhead.reduce_atom(dk, D), bwd_qhead.reduce_atom(dv, Dv)
        else:
            tma_dk, tdK = cpasync.make_tiled_tma_atom(s2g, dk, sK_layout, (tn, D))
            tma_dv, tdV = cpasync.make_tiled_tma_atom(s2g, dv, sV_layout, (tn, Dv))
        tma_dq, tdQ = dq_atom(dqacc, sdQ_layout, self.dq_box)

        K_MAJOR, MN_MAJOR = OperandMajorMode.K, OperandMajorMode.MN
        RMEM = warpgroup.OperandSource.RMEM
        if const_expr(self.q_split):
            # Sᵀ = K Qᵀ, dPᵀ = V dOᵀ: the warpgroups split N (the query rows) in halves.
            mma_sdp = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, (1, 2, 1), (64, tm // 2))
            # dK += dSᵀ Q, dV += Pᵀ dO: Pᵀ and dSᵀ (all query rows) read MN-major from smem,
            # the warpgroups split N (D, Dv) in halves.
            mma_dkv = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (1, 2, 1), (64, D // 2))
            mma_dv = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (1, 2, 1), (64, Dv // 2))
        elif const_expr(self.dim_split):
            # Sᵀ = K Qᵀ, dPᵀ = V dOᵀ: one warpgroup's tile (each computes all of it).
            mma_sdp = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (64, tm))
            # dK += dSᵀ Q, dV += Pᵀ dO: the warpgroups split N (D, Dv) in halves.
            mma_dkv = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (1, 2, 1), (64, D // 2), RMEM)
            mma_dv = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (1, 2, 1), (64, Dv // 2), RMEM)
        else:
            # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: keys along M, the two warpgroups 64 keys each.
            mma_sdp = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, (2, 1, 1), (64, tm))
            # dV += Pᵀ dO, dK += dSᵀ Q: A from registers (the Sᵀ/dPᵀ accumulators' own rows).
            mma_dkv = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (2, 1, 1), (64, D), RMEM)
            mma_dv = mma_dkv
            if const_expr(self.p_smem):  # Pᵀ from its smem tile: A MN-major
                mma_dv = sm90_helpers.make_trivial_tiled_mma(
                    self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (2, 1, 1), (64, Dv))
            if const_expr(self.dk_smem):  # dSᵀ from the dS tile: A MN-major in smem
                mma_dkv = sm90_helpers.make_trivial_tiled_mma(
                    self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (2, 1, 1), (64, D))
        # dQ = dS K: each warpgroup one dq_box piece. Swapped: dQᵀ = Kᵀ dSᵀ, A = Kᵀ (K read
        # MN-major), B = dS (the smem tile as the unswapped A), warpgroups split the head dims.
        if const_expr(self.dq_swapped):
            mma_dq = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_MAJOR, K_MAJOR, Float32, (2, 1, 1), (64, tm))
        else:
            dq_atoms = (1, 2, 1) if const_expr(self.dq_split == "cols") else (2, 1, 1)
            mma_dq = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, dq_atoms, (64, self.dq_box[1]))

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * st]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * st]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.row_pitch * st], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, self.row_pitch * st], 128]
            sQ: smem_buffer(self.dtype, sQ_layout)
            sdO: smem_buffer(self.dtype, sdO_layout)
            sK: smem_buffer(self.dtype, sK_layout)
            sV: smem_buffer(self.dtype, sV_layout)
            sdS: smem_buffer(self.dtype, sdS_layout)
            sdQ: smem_buffer(Float32, sdQ_layout)

        self.shared_storage = SharedStorage

        # Grid (kv tile, kv head (q_head: query head), batch): kv tile fastest, last kv tile first
        # in deterministic mode, so that every CTA a CTA waits for has a smaller linear index
        # (dispatched earlier).
        # With two kv tiles per mask block: both tiles of the last block, even past S (that CTA
        # finds every key out of bounds: P = dS = 0, it adds zeros to dQ and its dK/dV stores are
        # clipped), so that every listed mask block adds into dQ exactly kv_per_block times
        # (the deterministic ranks count on it).
        num_n = self._num_kv_tiles(k.shape[0])
        # The batch extent: K's, or the query's (and dK's) when K/V are broadcast over it.
        num_b = q.shape[3] if const_expr(self.kv_batch_broadcast) else k.shape[3]
        launch(self.kernel(
            tQ, tK, tV, tdO, tLSE, tDelta, tdQ, tdK, tdV,
            tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta, tma_dq, tma_dk, tma_dv,
            mma_sdp, mma_dkv, mma_dv, mma_dq, softmax_scale, q_per_kv, qblocks, qorder, mSem,
            aux_tensors, aux_scalars, grad_accs,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout, sRow_layout,
        ), [num_n, q.shape[2] if const_expr(self.q_head) else k.shape[2], num_b], self.num_threads, stream)

    # -----------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
        mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
        mdV: cute.Tensor,
        tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, tma_do: cute.CopyAtom,
        tma_lse: cute.CopyAtom, tma_delta: cute.CopyAtom, tma_dq: cute.CopyAtom,
        tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom,
        mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dv: cute.TiledMma,
        mma_dq: cute.TiledMma, softmax_scale: Float32, q_per_kv: Int32,
        qblocks: Optional[QBlockLists], qorder: Optional[QOrder], mSem: Optional[cute.Tensor],
        aux_tensors: Optional[tuple], aux_scalars: Optional[tuple], grad_accs: Optional[tuple],
        sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout, sdQ_layout: cute.Layout, sRow_layout: cute.Layout,
    ):
        """The operands' layouts: ``common``'s docstring (every tensor here a TMA view)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta):
                cpasync.prefetch_descriptor(atom)
        if warp_idx == 1:
            cpasync.prefetch_descriptor(tma_dq)  # (warps 1 and 2 issue the dQ reduces)

        storage = SmemAllocator().allocate(self.shared_storage)
        pipe_kv, pipe_q, pipe_do = self._make_pipelines(storage)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Each GEMM operand tile's swizzle (``opaque_smem`` rebuilds the tiles with them: one
        # 128-byte swizzle for D = 64 and 128; 32 and 96 have narrower atoms for Q, dO, K, V);
        # each tile and stage is whole swizzle atoms, so every start is 1024-byte aligned.
        swizzles = tuple(layout.inner for layout in
                         (sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout))
        for layout in (sQ_layout, sdO_layout, sdS_layout):
            assert cute.size_in_bytes(self.dtype, cute.select(layout, mode=[0, 1])) % 1024 == 0
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout)
        sLSE = storage.sLSE.get_tensor(sRow_layout)
        sDelta = storage.sDelta.get_tensor(sRow_layout)

        aux = kernel_aux(aux_tensors, aux_scalars)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.load_regs)
            sched = self._schedule(mQ, mK, q_per_kv)  # per role: nothing crosses the setmaxnreg boundary
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, mLSE2, mDelta, sQ, sK, sV, sdO, sLSE, sDelta,
                          tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta,
                          pipe_kv, pipe_q, pipe_do, sched, qblocks)
            if warp_idx == 1:
                self.dq_writer(mdQacc, sdQ, tma_dq, sched, qblocks, qorder, mSem, 0)
            if warp_idx == 2:
                self.dq_writer(mdQacc, sdQ, tma_dq, sched, qblocks, qorder, mSem, 1)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            sched = self._schedule(mQ, mK, q_per_kv)
            self.mma(mma_sdp, mma_dkv, mma_dv, mma_dq, mdK, mdV, _SmemTiles(sQ, sdO, sK, sV, sdS, *swizzles),
                     sdQ, sLSE, sDelta,
                     tma_dk, tma_dv, pipe_kv, pipe_q, pipe_do, softmax_scale, sched, qblocks, qorder, aux,
                     tuple(grad_accs) if const_expr(grad_accs is not None) else ())

    def _num_kv_tiles(self, seqlen_k):
        """The grid's x extent: ceil(S / tile_n), or whole mask blocks of kv tiles."""
        if const_expr(self.dim_split):
            return cute.ceil_div(seqlen_k, MASK_BLOCK) * self.kv_per_block
        return cute.ceil_div(seqlen_k, self.tile_n)

    @cute.jit
    def _schedule(self, mQ: cute.Tensor, mK: cute.Tensor, q_per_kv: Int32):
        n_block, head_kv, batch = cute.arch.block_idx()
        n_kv_tiles = self._num_kv_tiles(mK.shape[0])
        if const_expr(self.deterministic):
            n_block = n_kv_tiles - 1 - n_block  # last kv tile first (see Deterministic mode)
        elif const_expr(self.lpt_section):
            n_block, head_kv, batch = self._lpt_order(n_block, head_kv, batch)
        mask_block = n_block
        if const_expr(self.dim_split):
            mask_block = n_block // self.kv_per_block
        if const_expr(self.q_head):  # y is the query head; the head loop runs once
            return _BwdSchedule(n_block, head_kv // q_per_kv, batch, 1, mQ.shape[0], mK.shape[0],
                                cute.ceil_div(mQ.shape[0], self.tile_m), n_kv_tiles, mask_block, head_kv)
        return _BwdSchedule(n_block, head_kv, batch, q_per_kv, mQ.shape[0], mK.shape[0],
                            cute.ceil_div(mQ.shape[0], self.tile_m), n_kv_tiles, mask_block)

    @cute.jit
    def _lpt_order(self, x: Int32, y: Int32, z: Int32):
        """(kv tile, kv head, batch) of the CTA launched ``r``-th (r = x + nx·(y + ny·z), the
        launch order), longest first where kv tile n's work falls with n (causal masks: n
        visits the q blocks from n on): sections of ``lpt_section`` (kv head, batch) pairs,
        each walked kv tile by kv tile, so that the CTAs running together read the Q and dO of
        a few heads (an L2-sized working set) and a section's long CTAs start first. In the
        launch order (kv tile fastest) the long CTAs of the last heads start last: a GQA CTA
        loops over its group's heads, and those tails cost a tenth at D = 64, 4 query heads a kv
        head."""
        nx, ny, nz = cute.arch.grid_dim()
        return lpt_coords(x + nx * (y + ny * z), nx, ny, nz, self.lpt_section,
                          lambda a, b: cutlass.min(Int32(a), b))

    def _head(self, sched, gi):
        """The query head of step ``gi`` of the head loop (``q_head``: the CTA's one head)."""
        return sched.q_head if const_expr(self.q_head) else sched.head_kv * sched.group + gi

    def _make_pipelines(self, storage):
        """K+V: one stage, used once. Q(+lse2): ``num_stages``; dO(+delta): ``do_stages``;
        consumers arrive once per MMA warp."""
        return tma_pipelines(self.num_mma_threads // 32, (storage.mbar_kv, 1, self.tx_kv),
                             (storage.mbar_q, self.num_stages, self.tx_q),
                             (storage.mbar_do, self.do_stages, self.tx_do))

    # -----------------------------------------------------------------------------------------
    # Scheduling: which q tiles, in which order. Every role walks the same sequence:
    # for each query head of the group, the partial list, then the full list (dense: 0..nQ-1;
    # deterministic: one merged list, the full lists empty).
    # -----------------------------------------------------------------------------------------
    def _q_lists(self, qblocks: QBlockLists, sched, head: Int32):
        """(partial tile count, full tile count, partial row, full row) of this kv block."""
        return q_lists(qblocks, sched.batch, head, sched.mask_block, self.tiles_per_mask_block)

    # -----------------------------------------------------------------------------------------
    # Producer warp
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSE2, mDelta, sQ, sK, sV, sdO, sLSE, sDelta,
             tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta,
             pipe_kv: pipeline.PipelineAsync, pipe_q: pipeline.PipelineAsync,
             pipe_do: pipeline.PipelineAsync, sched, qblocks):
        """K and V once, then per q tile: Q + lse2 on the Q pipeline, dO + delta on the dO
        pipeline (separate barriers so the S GEMM can start before dO lands)."""
        one = cute.make_layout(1)
        kv_batch = 0 if const_expr(self.kv_batch_broadcast) else sched.batch  # see BwdConfig
        gK = cute.local_tile(mK[None, None, sched.head_kv, kv_batch], (self.tile_n, self.head_dim),
                             (sched.n_block, 0))
        gV = cute.local_tile(mV[None, None, sched.head_kv, kv_batch], (self.tile_n, self.head_dim_v),
                             (sched.n_block, 0))
        tKsK, tKgK = tma_tiles(tma_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_v, sV, gV)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_k, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_v, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        g = sched.group
        for gi in cutlass.range(g, unroll=1):
            head = self._head(sched, gi)
            b, tm = sched.batch, self.tile_m
            gQ = cute.local_tile(mQ[None, None, head, b], (tm, self.head_dim), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, b], (tm, self.head_dim_v), (None, 0))
            gL = cute.local_tile(mLSE2[None, head, b], (tm,), (None,))
            gD = cute.local_tile(mDelta[None, head, b], (tm,), (None,))
            tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)
            tOsO, tOgO = tma_tiles(tma_do, sdO, gdO)
            tLsL, tLgL = cpasync.tma_partition(tma_lse, 0, one, sLSE, gL)
            tDsD, tDgD = cpasync.tma_partition(tma_delta, 0, one, sDelta, gD)
            tiles = (tQsQ, tQgQ, tOsO, tOgO, tLsL, tLgL, tDsD, tDgD)
            if const_expr(self.sparse):
                n_part, n_full, part_row, full_row = self._q_lists(qblocks, sched, head)
                for j in cutlass.range(n_part, unroll=1):
                    state = self._load_q_tile(tiles, tma_q, tma_do, tma_lse, tma_delta, pipe_q,
                                              pipe_do, state, listed_tile(part_row, j, self.tiles_per_mask_block))
                if const_expr(not self.deterministic):
                    for j in cutlass.range(n_full, unroll=1):
                        state = self._load_q_tile(tiles, tma_q, tma_do, tma_lse, tma_delta, pipe_q,
                                                  pipe_do, state, listed_tile(full_row, j, self.tiles_per_mask_block))
            else:
                for m in cutlass.range(sched.n_q_tiles, unroll=1):
                    state = self._load_q_tile(tiles, tma_q, tma_do, tma_lse, tma_delta, pipe_q,
                                              pipe_do, state, m)

    @cute.jit
    def _load_q_tile(self, tiles, tma_q, tma_do, tma_lse, tma_delta, pipe_q, pipe_do, state,
                     m: Int32):
        tQsQ, tQgQ, tOsO, tOgO, tLsL, tLgL, tDsD, tDgD = tiles
        pipe_q.producer_acquire(state)
        bar = pipe_q.producer_get_barrier(state)
        cute.copy(tma_q, tQgQ[None, m], tQsQ[None, state.index], tma_bar_ptr=bar)
        cute.copy(tma_lse, tLgL[None, m], tLsL[None, state.index], tma_bar_ptr=bar)
        do_state = self._do_state(state, 1)
        pipe_do.producer_acquire(do_state)
        bar = pipe_do.producer_get_barrier(do_state)
        cute.copy(tma_do, tOgO[None, m], tOsO[None, do_state.index], tma_bar_ptr=bar)
        cute.copy(tma_delta, tDgD[None, m], tDsD[None, do_state.index], tma_bar_ptr=bar)
        state.advance()
        return state

    def _do_state(self, state, first_phase: int):
        """The dO pipeline's state for the Q pipeline's ``state`` (the same: as many stages;
        ``bwd_keys`` overrides it for one)."""
        return state

    # -----------------------------------------------------------------------------------------
    # dQ writer warp
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def dq_writer(self, mdQacc: cute.Tensor, sdQ: cute.Tensor, tma_dq: cute.CopyAtom, sched,
                  qblocks, qorder, mSem, box: cutlass.Constexpr):
        """Warp 1 + ``box`` serves MMA warpgroup ``box``. Per q tile: free its box (once the
        previous bulk reduce from it has read it), wait for the warpgroup to fill it, add it into
        the fp32 accumulator by TMA reduce-add. One warp per box halves each warp's TMA issue
        and keeps it within the producer warpgroup's 24 registers.
        Deterministic mode: the box's semaphore orders the adds by kv block (rank = how many kv
        blocks add before this one: all larger ones when dense, the table when sparse)."""
        g = sched.group
        per = self.tiles_per_mask_block
        for gi in cutlass.range(g, unroll=1):
            head = self._head(sched, gi)
            gdQ = cute.local_tile(mdQacc[None, None, head, sched.batch], self.dq_box, (None, None))
            tSs, tSg = tma_tiles(tma_dq, sdQ, gdQ)
            sem_row = mSem[sched.batch, head, None] if const_expr(self.deterministic) else None
            if const_expr(self.sparse):
                n_part, n_full, part_row, full_row = self._q_lists(qblocks, sched, head)
                if const_expr(self.deterministic):
                    rank_row, _ = order_rows(qorder, sched.batch, head, sched.mask_block)
                    for j in cutlass.range(n_part, unroll=1):
                        rank = rank_row[j // per]
                        if const_expr(self.dim_split):
                            # The mask blocks' ranks in kv tiles: kv_per_block adds per listed
                            # block, its last tile first (decreasing kv order).
                            kvp = self.kv_per_block
                            rank = rank * kvp + (kvp - 1 - sched.n_block % kvp)
                        self._store_dq_box(tma_dq, tSs, tSg, listed_tile(part_row, j, self.tiles_per_mask_block), box,
                                           sem_row, rank)
                else:
                    for j in cutlass.range(n_part, unroll=1):
                        self._store_dq_box(tma_dq, tSs, tSg, listed_tile(part_row, j, self.tiles_per_mask_block), box,
                                           sem_row, None)
                    for j in cutlass.range(n_full, unroll=1):
                        self._store_dq_box(tma_dq, tSs, tSg, listed_tile(full_row, j, self.tiles_per_mask_block), box,
                                           sem_row, None)
            else:
                rank = sched.n_kv_tiles - 1 - sched.n_block if const_expr(self.deterministic) else None
                for m in cutlass.range(sched.n_q_tiles, unroll=1):
                    self._store_dq_box(tma_dq, tSs, tSg, m, box, sem_row, rank)
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _store_dq_box(self, tma_dq, tSs, tSg, m: Int32, box: cutlass.Constexpr, sem_row, rank):
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last reduce has read the box
        cute.arch.barrier_arrive(barrier_id=_BAR_DQ_EMPTY + box, number_of_threads=_DQ_BAR_THREADS)
        sem_ptr = None
        if const_expr(self.deterministic):
            sem_ptr = sem_row.iterator + (2 * m + box)
            if cute.arch.lane_idx() == 0:
                seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
                while seen != rank:
                    seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
            cute.arch.sync_warp()
            # The generic-proxy acquire must be ordered before our async-proxy reduce.
            cute.arch.fence_proxy("async.global")
        cute.arch.barrier(barrier_id=_BAR_DQ_FULL + box, number_of_threads=_DQ_BAR_THREADS)
        if const_expr(self.dq_swapped):  # (head dims, q rows) boxes of the transposed dQ
            cute.copy(tma_dq, tSs[None, box], tSg[None, box, m])
        elif const_expr(self.dq_split == "cols"):
            cute.copy(tma_dq, tSs[None, box], tSg[None, m, box])
        else:
            cute.copy(tma_dq, tSs[None, box], tSg[None, 2 * m + box, 0])
        cute.arch.cp_async_bulk_commit_group()
        if const_expr(self.deterministic):
            # Full completion (not just the smem read), then publish it to the next kv block.
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            cute.arch.fence_proxy("async.global")
            if cute.arch.lane_idx() == 0:
                cute.arch.atomic_add(sem_ptr, Int32(1), sem="release", scope="gpu")
            cute.arch.sync_warp()

    # -----------------------------------------------------------------------------------------
    # MMA warpgroups
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def mma(self, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dv: cute.TiledMma,
            mma_dq: cute.TiledMma, mdK: cute.Tensor, mdV: cute.Tensor, smem: "_SmemTiles", sdQ, sLSE, sDelta,
            tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom, pipe_kv: pipeline.PipelineAsync,
            pipe_q: pipeline.PipelineAsync, pipe_do: pipeline.PipelineAsync,
            softmax_scale: Float32, sched, qblocks, qorder, aux: Aux, grad_accs: tuple):
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_dkv = mma_dkv.get_slice(wg * 128)
        wg_dv = mma_dv.get_slice(wg * 128)
        wg_dq = mma_dq.get_slice(wg * 128)
        if const_expr(self.dup_sdp):
            # One warpgroup's Sᵀ/dPᵀ MMA: each warpgroup is its thread range 0..127.
            wg_sdp = mma_sdp.get_slice(0)
            thr_sdp = mma_sdp.get_slice(tidx % 128)
        else:
            wg_sdp = mma_sdp.get_slice(wg * 128)
            thr_sdp = mma_sdp.get_slice(tidx)
        tm, tn = self.tile_m, self.tile_n
        # Register operands (the smem ones are made per tile: ``_smem_operands``).
        # P and dS as the RS dV/dK GEMMs' A operands (None where that GEMM reads smem: P and dS
        # are then converted into fresh registers for their stores only).
        tVrP = None if const_expr(self.p_smem or self.q_split) else wg_dv.make_fragment_A(
            wg_dv.partition_shape_A((tn, tm)))
        tKrdS = None if const_expr(self.dk_smem or self.q_split) else wg_dkv.make_fragment_A(
            wg_dkv.partition_shape_A((tn, tm)))
        acc_dV = cute.make_rmem_tensor(wg_dv.partition_shape_C((tn, self.head_dim_v)), Float32)
        acc_dK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tn, self.head_dim)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # Per-register (kv, q) coordinates and lse2 / delta (smem rows broadcast over keys).
        tScS = thr_sdp.partition_C(cute.make_identity_tensor((tn, tm)))
        bcast = cute.make_layout((tn, tm, self.num_stages), stride=(0, 1, self.row_pitch))
        tSsLSE = thr_sdp.partition_C(cute.make_tensor(sLSE.iterator, bcast))
        tSsDelta = thr_sdp.partition_C(cute.make_tensor(sDelta.iterator, bcast))
        # dS (registers, transposed) -> smem as the dQ GEMM's K-major A operand.
        st_t = cute.make_copy_atom(StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        thr_st_t = cute.make_tiled_copy_C(st_t, mma_sdp).get_slice(
            tidx % 128 if const_expr(self.dup_sdp) else tidx)
        tSsdS = thr_st_t.partition_D(transposed(smem.sdS))
        # dQ accumulator -> this warpgroup's fp32 box, viewed as the whole (tm, D) tile.
        # Rows and columns through dq_box_view (16-byte runs per thread).
        box_r, box_c = self.dq_box
        rows, cols = dq_box_view(box_r, box_c)
        box_stride = box_r * box_c
        if const_expr(self.dq_split == "cols" and not self.dq_swapped):
            # (64, (cols, 2)): D = 128 split by columns
            sdQ_tile = cute.make_tensor(sdQ.iterator, cute.make_layout(
                (rows.shape, (cols.shape, 2)), stride=(rows.stride, (cols.stride, box_stride))))
        else:
            # ((64, 2), cols): D = 64 split by rows; swapped, dQᵀ's head dims split the same way
            sdQ_tile = cute.make_tensor(sdQ.iterator, cute.make_layout(
                ((rows.shape, 2), cols.shape), stride=((rows.stride, box_stride), cols.stride)))
        tQsdQ = mma_dq.get_slice(tidx).partition_C(sdQ_tile)

        c = softmax.exp2_multiplier(self.score_mod, softmax_scale)
        ctx = _BwdCtx(mma_sdp, mma_dkv, mma_dv, mma_dq, wg_sdp, wg_dkv, wg_dv, wg_dq, smem, tVrP, tKrdS, acc_dV,
                      acc_dK, tScS, tSsLSE, tSsDelta, sLSE, sDelta, thr_st_t, st_t, tSsdS, tQsdQ,
                      wg_sdp.partition_shape_C((tn, tm)),
                      wg_dq.partition_shape_C((self.head_dim, tm) if const_expr(self.dq_swapped)
                                              else (tm, self.head_dim)),
                      c, softmax_scale, sched, aux, wg,
                      grad_accs)

        # K and V must have landed even when no q tile is listed: the epilogue overwrites them.
        pipe_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        self._walk_q_tiles(ctx, pipe_q, pipe_do, qblocks, qorder)
        if const_expr(self.q_head):
            bwd_qhead.reduce_epilogue(ctx, smem, mdK, mdV, tma_dk, tma_dv, self.head_dim,
                                      self.head_dim_v, _BAR_MMA, _BAR_WG)
        else:
            self.epilogue(ctx, mdK, mdV, smem.sK, smem.sV, tma_dk, tma_dv, tidx)

    @cute.jit
    def _walk_q_tiles(self, ctx, pipe_q, pipe_do, qblocks, qorder):
        """Every q tile of the group's heads, in the order the producer loads them."""
        sched, tn = ctx.sched, self.tile_n
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        g = sched.group
        kv_ragged = (sched.n_block + 1) * tn > sched.seqlen_k
        for gi in cutlass.range(g, unroll=1):
            head = self._head(sched, gi)
            if const_expr(self.sparse and self.deterministic):
                # One merged list; full entries flagged (see Deterministic mode).
                n_part, _, part_row, _ = self._q_lists(qblocks, sched, head)
                _, full_row = order_rows(qorder, sched.batch, head, sched.mask_block)
                per = self.tiles_per_mask_block
                for j in cutlass.range(n_part, unroll=1):
                    m = listed_tile(part_row, j, self.tiles_per_mask_block)
                    if full_row[j // per] != 0:
                        state = self._full_q_tile(ctx, pipe_q, pipe_do, state, head, m, kv_ragged)
                    else:
                        state = self._q_tile(ctx, pipe_q, pipe_do, state, head, m, "partial")
            elif const_expr(self.sparse):
                n_part, n_full, part_row, full_row = self._q_lists(qblocks, sched, head)
                for j in cutlass.range(n_part, unroll=1):
                    state = self._q_tile(ctx, pipe_q, pipe_do, state, head,
                                         listed_tile(part_row, j, self.tiles_per_mask_block), "partial")
                for j in cutlass.range(n_full, unroll=1):
                    state = self._full_q_tile(ctx, pipe_q, pipe_do, state, head,
                                              listed_tile(full_row, j, self.tiles_per_mask_block), kv_ragged)
            else:
                for m in cutlass.range(sched.n_q_tiles, unroll=1):
                    if const_expr(self.mask_mod is not None):
                        state = self._q_tile(ctx, pipe_q, pipe_do, state, head, m, "partial")
                    else:
                        state = self._full_q_tile(ctx, pipe_q, pipe_do, state, head, m, kv_ragged)

    @cute.jit
    def _full_q_tile(self, ctx, pipe_q, pipe_do, state, head: Int32, m: Int32, kv_ragged):
        """A full tile skips mask_mod; it checks bounds only when it crosses L or S. Decided
        before any GEMM is issued (a branch between the waits would serialise the GEMMs)."""
        if kv_ragged or (m + 1) * self.tile_m > ctx.sched.seqlen_q:
            state = self._q_tile(ctx, pipe_q, pipe_do, state, head, m, "bounded")
        else:
            state = self._q_tile(ctx, pipe_q, pipe_do, state, head, m, "full")
        return state

    def _q_tile(self, ctx, pipe_q, pipe_do, state, head, m, kind):
        """One Q tile: ``_q_tile_split`` with ``q_split``, else ``_q_tile_regs``."""
        if self.q_split:
            return self._q_tile_split(ctx, pipe_q, pipe_do, state, head, m, kind)
        return self._q_tile_regs(ctx, pipe_q, pipe_do, state, head, m, kind)

    @cute.jit
    def _q_tile_split(self, ctx, pipe_q: pipeline.PipelineAsync, pipe_do: pipeline.PipelineAsync,
                      state, head: Int32, m: Int32, kind: cutlass.Constexpr):
        """One Q tile with ``q_split``: each warpgroup forms Sᵀ, P, dPᵀ and dS for its half of
        the query rows and stores Pᵀ and dSᵀ into their smem stages; after a named barrier
        (both halves in) it runs dV, dK and dQ for its half of the head dims over all rows, A
        from smem. Every GEMM is computed once. The stages follow the Q stage's index: a
        warpgroup passes this tile's Pᵀ barrier only once the other has waited for all of its
        previous tile's GEMMs, the last readers of the other stage."""
        idx = state.index
        ops = self._smem_operands(ctx, idx)
        pipe_q.consumer_wait(state)
        acc_S = cute.make_rmem_tensor(ctx.s_shape, Float32)
        wgmma_gemm(ctx.mma_sdp, acc_S, ops.tSrK, ops.tSrQ, zero_init=True)
        pipe_do.consumer_wait(state)
        acc_dP = cute.make_rmem_tensor(ctx.s_shape, Float32)
        wgmma_gemm(ctx.mma_sdp, acc_dP, ops.tPrV, ops.tPrdO, zero_init=True)
        # lse2 and delta (16 registers each here) read under the GEMMs, as in ``_q_tile_regs``.
        rLSE = row_values(ctx.tSsLSE[None, None, None, idx], ctx.s_shape)
        rDelta = row_values(ctx.tSsDelta[None, None, None, idx], ctx.s_shape)
        warpgroup.wait_group(1)  # Sᵀ done; dPᵀ runs under P
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        self._probabilities(ctx, acc_S, rP, rLSE, head, m, kind)
        cute.copy(ctx.st_t, ctx.thr_st_t.retile(rP), ctx.tSsdS[None, None, None, self._p_stage(idx)])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=self.num_mma_threads)
        # dV += Pᵀ dO needs only Pᵀ: issued before the dPᵀ wait, it runs under dS's forming.
        wgmma_gemm(ctx.mma_dv, ctx.acc_dV, ops.tVsP, ops.tVrdO, zero_init=False)
        warpgroup.wait_group(1)  # dPᵀ done
        sums = self._form_ds(ctx, acc_S, acc_dP, rDelta, head, m)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        cute.copy(ctx.st_t, ctx.thr_st_t.retile(rdS), ctx.tSsdS[None, None, None, idx])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=self.num_mma_threads)
        acc_dQ = cute.make_rmem_tensor(ctx.dq_shape, Float32)
        wgmma_gemm(ctx.mma_dq, acc_dQ, ops.tQrA, ops.tQrB, zero_init=True)
        wgmma_gemm(ctx.mma_dkv, ctx.acc_dK, ops.tKsdS, ops.tKrQ, zero_init=False)
        warpgroup.wait_group(2)  # dV done: dO is free
        pipe_do.consumer_release(state)
        warpgroup.wait_group(1)  # dQ done
        self._publish_dq(ctx, acc_dQ)
        warpgroup.wait_group(0)  # dK done: Q is free
        pipe_q.consumer_release(state)
        if const_expr(self.score_grads is not None):
            self._flush_uniform_grads(ctx, sums, head, m)
        state.advance()
        return state

    @cute.jit
    def _q_tile_regs(self, ctx, pipe_q: pipeline.PipelineAsync, pipe_do: pipeline.PipelineAsync,
                     state, head: Int32, m: Int32, kind: cutlass.Constexpr):
        """One Q tile (see the module docstring for the order). The dS smem buffer uses the Q
        stage's index: both warpgroups pass this tile's barrier only after finishing the
        previous tile, whose dQ GEMM was the last reader of the other buffer."""
        idx = state.index
        ops = self._smem_operands(ctx, idx)
        pipe_q.consumer_wait(state)
        acc_S = cute.make_rmem_tensor(ctx.s_shape, Float32)
        wgmma_gemm(ctx.mma_sdp, acc_S, ops.tSrK, ops.tSrQ, zero_init=True)
        acc_dP = cute.make_rmem_tensor(ctx.s_shape, Float32)
        if const_expr(self.overlap_dp):
            pipe_do.consumer_wait(state)
            wgmma_gemm(ctx.mma_sdp, acc_dP, ops.tPrV, ops.tPrdO, zero_init=True)
        # lse2 into registers before the Sᵀ wait: the loads land under the GEMMs instead of
        # stalling the first exp2 right behind the wait (the wait is a memory fence to ptxas:
        # it does not hoist shared loads above it). Not with kv_batch_broadcast: its 16 more
        # live registers across the waits spill there (4 bytes), for no measurable gain: that
        # kernel reads them after the waits.
        if const_expr(self.shuffle_stats):
            rLSE = shuffled_row(ctx.sLSE, idx, self.tile_m, ctx.tScS)
        elif const_expr(not self.kv_batch_broadcast):
            rLSE = row_values(ctx.tSsLSE[None, None, None, idx], ctx.s_shape)
        if const_expr(self.overlap_dp):
            warpgroup.wait_group(1)  # Sᵀ done; dPᵀ runs under the elementwise work below
        else:
            warpgroup.wait_group(0)
        # Branch-free from here to the dPᵀ wait (a branch would make ptxas wait at its join).
        if const_expr(self.kv_batch_broadcast and not self.shuffle_stats):
            rLSE = ctx.tSsLSE[None, None, None, idx]
        if const_expr(self.p_smem):
            rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        else:
            rP = _as_acc_layout(ctx.tVrP, acc_S)
        self._probabilities(ctx, acc_S, None if const_expr(self.p_late) else rP, rLSE, head, m, kind)
        if const_expr(self.p_smem):
            # Pᵀ -> its smem stage (read by this warpgroup's own dV GEMM only), then dV.
            cute.copy(ctx.st_t, ctx.thr_st_t.retile(rP), ctx.tSsdS[None, None, None, self.num_stages])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=_BAR_WG + ctx.wg, number_of_threads=128)
            if const_expr(not self.overlap_dp):
                pipe_do.consumer_wait(state)  # dV reads dO: waited here when dP did not
            wgmma_gemm(ctx.mma_dv, ctx.acc_dV, ops.tVsP, ops.tVrdO, zero_init=False)
        if const_expr(not self.overlap_dp and not self.p_smem):
            pipe_do.consumer_wait(state)
        # delta likewise before the dPᵀ wait (and before the dV GEMM, whose issue covers them).
        if const_expr(self.shuffle_stats):
            rDelta = shuffled_row(ctx.sDelta, idx, self.tile_m, ctx.tScS)
        elif const_expr(not self.kv_batch_broadcast):
            rDelta = row_values(ctx.tSsDelta[None, None, None, idx], ctx.s_shape)
        if const_expr(self.p_late or self.dv_after_ds):
            if const_expr(not self.overlap_dp):
                wgmma_gemm(ctx.mma_sdp, acc_dP, ops.tPrV, ops.tPrdO, zero_init=True)
            warpgroup.wait_group(0)  # dPᵀ done; dV is issued once dS is formed (or stored)
        elif const_expr(self.p_smem):
            if const_expr(self.overlap_dp):
                warpgroup.wait_group(1)  # dPᵀ done (issued before dV)
            else:
                wgmma_gemm(ctx.mma_sdp, acc_dP, ops.tPrV, ops.tPrdO, zero_init=True)
                warpgroup.wait_group(0)
        elif const_expr(self.overlap_dp):
            # dV += Pᵀ dO needs only P: issue it before waiting for dPᵀ.
            wgmma_gemm(ctx.mma_dv, ctx.acc_dV, ctx.tVrP, ops.tVrdO, zero_init=False)
            warpgroup.wait_group(1)  # dPᵀ done (dV may still run)
        else:
            wgmma_gemm(ctx.mma_dv, ctx.acc_dV, ctx.tVrP, ops.tVrdO, zero_init=False)
            # After dV, which reads P: ptxas keeps wgmmas in order, so it cannot hoist this one
            # above the elementwise work (it does hoist a dP GEMM issued right after P, and
            # the register peak comes back: 44 bytes of spills for softcap at D = 128).
            wgmma_gemm(ctx.mma_sdp, acc_dP, ops.tPrV, ops.tPrdO, zero_init=True)
            warpgroup.wait_group(0)
        if const_expr(self.kv_batch_broadcast and not self.shuffle_stats):
            rDelta = ctx.tSsDelta[None, None, None, idx]
        sums = self._form_ds(ctx, acc_S, acc_dP, rDelta, head, m)
        if const_expr(self.p_late):
            rP.store(acc_S.load().to(self.dtype))
            if const_expr(not self.dv_after_ds):
                wgmma_gemm(ctx.mma_dv, ctx.acc_dV, ctx.tVrP, ops.tVrdO, zero_init=False)
        if const_expr(self.dk_smem):
            rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        else:
            rdS = _as_acc_layout(ctx.tKrdS, acc_dP)
        rdS.store(acc_dP.load().to(self.dtype))
        # Identity moves on the packed dS: otherwise the compiler converts dS to bf16 a second
        # time for the dK GEMM (after the barrier) instead of keeping what the stmatrix used.
        if const_expr(not self.dk_smem):
            rdS_words = cute.recast_tensor(rdS, Int32)
            for i in cutlass.range_constexpr(cute.size(rdS_words)):
                rdS_words[i] = opaque_i32(rdS_words[i])
        # dSᵀ -> smem; both warpgroups' halves are needed by each dQ GEMM.
        if const_expr(self.dup_sdp):
            # Both warpgroups hold all of dS: one stores it.
            _copy_if(ctx.wg == 0, ctx.st_t, ctx.thr_st_t.retile(rdS), ctx.tSsdS[None, None, None, idx])
        else:
            cute.copy(ctx.st_t, ctx.thr_st_t.retile(rdS), ctx.tSsdS[None, None, None, idx])
        cute.arch.fence_view_async_shared()
        if const_expr(self.dv_after_ds):
            # Behind the proxy fence, which ptxas does not move a wgmma above (``dv_after_ds``).
            wgmma_gemm(ctx.mma_dv, ctx.acc_dV, ctx.tVrP, ops.tVrdO, zero_init=False)
        acc_dQ = cute.make_rmem_tensor(ctx.dq_shape, Float32)
        if const_expr(self.dk_smem):
            # dK reads only this warpgroup's keys of the dS tile: issued once the warpgroup's
            # own stores are in, before the barrier that waits for the other half. dV is then
            # waited for before the dQ GEMM, so P's registers are free for dQ's accumulator.
            cute.arch.barrier(barrier_id=_BAR_WG + ctx.wg, number_of_threads=128)
            wgmma_gemm(ctx.mma_dkv, ctx.acc_dK, ops.tKsdS, ops.tKrQ, zero_init=False)
            cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=self.num_mma_threads)
            warpgroup.wait_group(1)  # dV done: dO is free
            pipe_do.consumer_release(state)
            wgmma_gemm(ctx.mma_dq, acc_dQ, ops.tQrA, ops.tQrB, zero_init=True)
            warpgroup.wait_group(1)  # dK done: Q is free
            pipe_q.consumer_release(state)
            warpgroup.wait_group(0)  # dQ done
        else:
            cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=self.num_mma_threads)
            wgmma_gemm(ctx.mma_dq, acc_dQ, ops.tQrA, ops.tQrB, zero_init=True)
            warpgroup.wait_group(1)  # dV done: dO is free
            pipe_do.consumer_release(state)
            wgmma_gemm(ctx.mma_dkv, ctx.acc_dK, ctx.tKrdS, ops.tKrQ, zero_init=False)
            warpgroup.wait_group(1)  # dQ done
        self._publish_dq(ctx, acc_dQ)
        if const_expr(not self.dk_smem):
            warpgroup.wait_group(0)  # dK done: Q is free
            pipe_q.consumer_release(state)
        if const_expr(self.score_grads is not None):
            self._flush_uniform_grads(ctx, sums, head, m)
        state.advance()
        return state

    @cute.jit
    def _publish_dq(self, ctx, acc_dQ: cute.Tensor):
        """This warpgroup's dQ piece into its smem box for the dQ writer: wait until the writer
        has emptied the box, store, fence, signal it full."""
        cute.arch.barrier(barrier_id=_BAR_DQ_EMPTY + ctx.wg, number_of_threads=_DQ_BAR_THREADS)
        store_dq_acc(acc_dQ, ctx.tQsdQ)
        cute.arch.fence_view_async_shared()  # generic-proxy smem writes -> TMA (async proxy)
        cute.arch.barrier_arrive(barrier_id=_BAR_DQ_FULL + ctx.wg, number_of_threads=_DQ_BAR_THREADS)

    def _p_stage(self, idx: Int32):
        """The smem stage of the dS buffer that holds Pᵀ (``p_smem``, ``q_split``)."""
        return self.num_stages + idx if const_expr(self.q_split) else self.num_stages

    def _smem_operands(self, ctx, idx: Int32) -> "_SmemOperands":
        """This tile's smem GEMM operands: K, V and stage ``idx`` of Q, dO, dS, each rebased on
        an opaque address (``opaque_smem``: shorter descriptor arithmetic, same descriptors).
        The B operands of dV/dK/dQ are the same smem viewed transposed (MN-major)."""
        sm = ctx.smem
        sQ, sdO, sdS = [opaque_smem(t[None, None, idx], sw)
                        for t, sw in ((sm.sQ, sm.swQ), (sm.sdO, sm.swdO), (sm.sdS, sm.swdS))]
        sK, sV = [opaque_smem(t, sw) for t, sw in ((sm.sK, sm.swK), (sm.sV, sm.swV))]
        sdp, dkv, dv, dq = ctx.wg_sdp, ctx.wg_dkv, ctx.wg_dv, ctx.wg_dq
        return _SmemOperands(
            tSrK=sdp.make_fragment_A(sdp.partition_A(sK)),
            tSrQ=sdp.make_fragment_B(sdp.partition_B(sQ)),
            tPrV=sdp.make_fragment_A(sdp.partition_A(sV)),
            tPrdO=sdp.make_fragment_B(sdp.partition_B(sdO)),
            tVrdO=dv.make_fragment_B(dv.partition_B(_transposed_2d(sdO))),
            tKrQ=dkv.make_fragment_B(dkv.partition_B(_transposed_2d(sQ))),
            tKsdS=(dkv.make_fragment_A(dkv.partition_A(_transposed_2d(sdS)))
                   if const_expr(self.dk_smem or self.q_split) else None),
            tVsP=(dv.make_fragment_A(dv.partition_A(_transposed_2d(
                opaque_smem(sm.sdS[None, None, self._p_stage(idx)], sm.swdS))))
                  if const_expr(self.p_smem or self.q_split) else None),
            tQrA=(dq.make_fragment_A(dq.partition_A(_transposed_2d(sK))) if const_expr(self.dq_swapped)
                  else dq.make_fragment_A(dq.partition_A(sdS))),
            tQrB=(dq.make_fragment_B(dq.partition_B(sdS)) if const_expr(self.dq_swapped)
                  else dq.make_fragment_B(dq.partition_B(_transposed_2d(sK)))),
        )

    @cute.jit
    def _probabilities(self, ctx, acc_S: cute.Tensor, rP: cute.Tensor, tLSE: cute.Tensor,
                       head: Int32, m: Int32, kind: cutlass.Constexpr):
        """In place: Sᵀ -> P ∘ dscore (fp32, for dS), and P (bf16) into ``rP`` (for dV; None:
        the caller converts P later, ``BwdTiling.p_late``).
        kind: "partial" = mask_mod and bounds; "bounded" = bounds; "full" = neither."""
        use_mask = kind == "partial" and self.mask_mod is not None
        use_bound = kind != "full"
        sched = ctx.sched
        q_first = plain_i32(m * self.tile_m + ctx.tScS[0][1])
        kv_first = plain_i32(sched.n_block * self.tile_n + ctx.tScS[0][0])
        neg_inf = -Float32.inf
        indices = FloatIndices(q_first, kv_first)
        score_mod = bind(self.score_mod, sched.batch, head, ctx.aux)
        mask_mod = bind(self.mask_mod, sched.batch, head, ctx.aux) if const_expr(use_mask) else None
        offsets = register_offsets(ctx.tScS)  # (kv, q) per register
        for i in cutlass.range_constexpr(len(offsets)):
            at = (offsets[i][1], offsets[i][0])
            q_idx = index_add(q_first, at[0])
            kv_idx = index_add(kv_first, at[1])
            s = acc_S[i]
            ds = Float32(1.0)
            if const_expr(self.score_mod is not None):
                s, ds = score_mod(s * ctx.softmax_scale, sched.batch, head, q_idx, kv_idx, ctx.aux,
                                  *indices.args(self.score_mod, q_idx, kv_idx, at))
            ok = None
            if const_expr(use_mask):
                ok = mask_mod(sched.batch, head, q_idx, kv_idx, ctx.aux,
                              *indices.args(self.mask_mod, q_idx, kv_idx, at))
            if const_expr(use_bound):
                inb = cutlass.and_(q_idx < sched.seqlen_q, kv_idx < sched.seqlen_k)
                ok = inb if const_expr(ok is None) else cutlass.and_(ok, inb)
            if const_expr(ok is not None):
                s = where(ok, s, neg_inf)
            p = cute.math.exp2(cute.fma(s, ctx.c, -tLSE[i]), fastmath=True)
            if const_expr(self.score_grads is not None):
                # Keep P: the captured gradients need P∘(dP − delta) before d score/d score
                # (``_captured_grads`` multiplies by it afterwards).
                if const_expr(rP is not None):
                    rP[i] = p.to(self.dtype)
                acc_S[i] = p
            elif const_expr(self.score_mod is not None and rP is not None):
                rP[i] = p.to(self.dtype)
                acc_S[i] = softmax.p_dscore(p, ds, ok)
            else:
                acc_S[i] = p  # no score_mod, or p_late's d score/d score = 1 (P∘dscore = P)
        if const_expr(self.score_mod is None and rP is not None):
            rP.store(acc_S.load().to(self.dtype))  # vectorised conversion

    @cute.jit
    def _form_ds(self, ctx, acc_S: cute.Tensor, acc_dP: cute.Tensor, rDelta, head: Int32, m: Int32):
        """dS into ``acc_dP``: P∘dscore (in ``acc_S``) ∘ (dP − delta), or, with learnable
        captured tensors, ``_captured_grads``' form; returns their uniform loads' sums (None
        without)."""
        sums = None
        if const_expr(self.score_grads is not None):
            sums = self._captured_grads(ctx, acc_S, acc_dP, rDelta, head, m)
        else:
            for i in cutlass.range_constexpr(cute.size(acc_dP)):
                acc_dP[i] = acc_S[i] * (acc_dP[i] - rDelta[i])
        return sums

    @cute.jit
    def _captured_grads(self, ctx, acc_P: cute.Tensor, acc_dP: cute.Tensor, tDelta: cute.Tensor,
                        head: Int32, m: Int32):
        """dS with captured-tensor gradients (``captured_grads``). ``acc_P`` holds P (not
        P∘dscore), ``acc_dP`` dPᵀ: g = P∘(dP − delta) (0 where masked or out of bounds, since P
        is); dS = g · d score/d score goes into ``acc_dP``; returns the uniform loads' sums."""
        sched = ctx.sched
        # The first register's (q, kv) through an opaque move: otherwise the compiler reuses the
        # per-element indices, float indices and load addresses that _probabilities computed
        # for the score_mod (the same expressions), keeping 32 of them live across the dP
        # GEMM's wait: spills at D = 128. Recomputing them costs a few integer adds.
        # And a data dependency on dPᵀ (0 unless it is NaN): ptxas sees through the opaque move
        # and would hoist the index arithmetic above the dPᵀ wait otherwise (152 bytes of
        # spills for ALiBi slopes at D = 128).
        after_dp = Int32(cutlass.select_(acc_dP[0] != acc_dP[0], Int32(1), Int32(0)))
        qb = plain_i32(opaque_i32(m * self.tile_m + ctx.tScS[0][1]) + after_dp)
        kb = plain_i32(opaque_i32(sched.n_block * self.tile_n + ctx.tScS[0][0]) + after_dp)
        indices = FloatIndices(qb, kb)
        offsets = register_offsets(ctx.tScS)  # (kv, q) per register
        uniform = self.grad_offsets.uniform
        n_loads = len(uniform)
        sums = [Float32(0.0) for _ in range(n_loads)]
        wg0 = None  # the dim split: both warpgroups hold the same elements
        if const_expr(self.dup_sdp):
            wg0 = ctx.wg
        for i in cutlass.range_constexpr(len(offsets)):
            at = (offsets[i][1], offsets[i][0])
            q_idx = index_add(qb, at[0])
            kv_idx = index_add(kb, at[1])
            g = acc_P[i] * (acc_dP[i] - tDelta[i])
            acc_dP[i] = captured_grads.element(g, sched.batch, head, q_idx, kv_idx, ctx.aux, indices,
                                               sums, self.score_grads, self.grad_offsets,
                                               ctx.grad_accs, wg0, False, at)
        return sums

    @cute.jit
    def _flush_uniform_grads(self, ctx, sums, head: Int32, m: Int32):
        """The uniform loads' sums, flushed at the end of the tile, when dS is no longer in
        registers (right after dS was formed, ptxas spilled at D = 128)."""
        if const_expr(any(self.grad_offsets.uniform)):
            sched = ctx.sched
            qb = m * self.tile_m + ctx.tScS[0][1]
            kb = sched.n_block * self.tile_n + ctx.tScS[0][0]
            indices = FloatIndices(qb, kb)
            # Any element's indices serve: the offset varies with neither.
            offsets = self.grad_offsets(sched.batch, head, qb, kb, ctx.aux,
                                        *indices.args(self.grad_offsets, qb, kb))
            captured_grads.flush_uniform(sums, offsets, self.grad_offsets, ctx.grad_accs, False)

    # -----------------------------------------------------------------------------------------
    # Epilogue
    # -----------------------------------------------------------------------------------------
    @cute.jit
    def epilogue(self, ctx, mdK: cute.Tensor, mdV: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                 tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom, tidx: Int32):
        """dK ·= scale; dK, dV -> smem over K, V (stmatrix) -> gmem (TMA store; rows >= S are
        clipped by the TMA unit)."""
        # A fresh thread index the compiler cannot merge with the loop's: otherwise the index
        # arithmetic shared with the prologue stays live across the whole Q-tile loop.
        tidx = opaque_thread_idx() - 128
        rdK = cute.make_rmem_tensor_like(ctx.acc_dK, self.dtype)
        rdK.store((ctx.acc_dK.load() * ctx.softmax_scale).to(self.dtype))
        rdV = cute.make_rmem_tensor_like(ctx.acc_dV, self.dtype)
        rdV.store(ctx.acc_dV.load().to(self.dtype))
        # Both warpgroups must be done reading K and V (their last GEMMs were waited for).
        cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=self.num_mma_threads)
        st_atom = cute.make_copy_atom(StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_st = cute.make_tiled_copy_C(st_atom, ctx.mma_dkv).get_slice(tidx)
        cute.copy(st_atom, thr_st.retile(rdK), thr_st.partition_D(sK))
        thr_st = cute.make_tiled_copy_C(st_atom, ctx.mma_dv).get_slice(tidx)
        cute.copy(st_atom, thr_st.retile(rdV), thr_st.partition_D(sV))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BAR_MMA, number_of_threads=self.num_mma_threads)
        self._store_dkv(ctx.sched, mdK, mdV, sK, sV, tma_dk, tma_dv)

    @cute.jit
    def _store_dkv(self, sched, mdK, mdV, sK, sV, tma_dk, tma_dv):
        """dK and dV (in smem over K and V) -> gmem by one warp's TMA stores."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 4:
            for which in cutlass.range_constexpr(2):
                mX = mdK if const_expr(which == 0) else mdV
                sX = sK if const_expr(which == 0) else sV
                atom = tma_dk if const_expr(which == 0) else tma_dv
                dim = self.head_dim if const_expr(which == 0) else self.head_dim_v
                gX = cute.local_tile(mX[None, None, sched.head_kv, sched.batch],
                                     (self.tile_n, dim), (sched.n_block, 0))
                tXsX, tXgX = tma_tiles(atom, sX, gX)
                cute.copy(atom, tXsX, tXgX)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


class _BwdSchedule(NamedTuple):
    """Per-CTA work description (trace-time container of DSL values)."""

    n_block: object  # kv tile = kv mask block
    head_kv: object
    batch: object
    group: object  # query heads per kv head
    seqlen_q: object
    seqlen_k: object
    n_q_tiles: object  # ceil(L / tile_m): dense launches
    n_kv_tiles: object  # the grid's x extent (``_num_kv_tiles``)
    mask_block: object  # the kv mask block (= n_block unless kv_per_block > 1): block-list column
    q_head: object = None  # the CTA's one query head (``BwdTiling.q_head``)


# The GEMM operands' smem (trace-time): Q, dO, dS (tile, D or kv, stage), K and V (kv tile, D),
# all K-major, and the swizzle of each.
_SmemTiles = namedtuple("_SmemTiles", "sQ sdO sK sV sdS swQ swdO swK swV swdS")


# One Q tile's smem wgmma fragments (``FlexAttentionBwdSm90._smem_operands``). tSrK: Sᵀ = K Qᵀ;
# tPrV: dPᵀ = V dOᵀ; tVrdO: dV += Pᵀ dO (B); tKrQ: dK += dSᵀ Q (B); tKsdS: its A from smem
# (``dk_smem``, else None); tVsP: dV's Pᵀ from smem (``p_smem``); tQrA, tQrB: dQ = dS K (or
# swapped, dQᵀ = Kᵀ dSᵀ).
_SmemOperands = namedtuple("_SmemOperands", "tSrK tSrQ tPrV tPrdO tVrdO tKrQ tKsdS tVsP tQrA tQrB")


# Per-CTA MMA-warpgroup state threaded through the per-tile helpers (trace-time). mma_dv: =
# mma_dkv unless the head dims are split between the warpgroups; wg_sdp: the warpgroup's slices of
# the tiled MMAs; smem: _SmemTiles; grad_accs: fp64 accumulators of the captured tensors'
# gradients (or ()).
_BwdCtx = namedtuple("_BwdCtx", "mma_sdp mma_dkv mma_dv mma_dq wg_sdp wg_dkv wg_dv wg_dq smem tVrP "
                     "tKrdS acc_dV acc_dK tScS tSsLSE tSsDelta sLSE sDelta thr_st_t st_t tSsdS tQsdQ "
                     "s_shape dq_shape c softmax_scale sched aux wg grad_accs")
