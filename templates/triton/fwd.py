"""Triton forward template: block-sparse flex attention with online softmax.

What this module holds
----------------------
* ``flex_fwd``: the kernel. One program computes a BLOCK_M tile of query rows of one
  (batch, query head) and writes O (B, Hq, L, EV) and the natural-log LSE (B, Hq, L) fp32.
* ``_attend``: the loop over the key/value sub-tiles of one block list (partial or full).
* From ``triton_common.py`` (pasted at ``# {{COMMON}}``): ``_score_tile`` (the elementwise
  part, with the score_mod and mask_mod holes, filled after the paste), ``_tanh`` (the one op whose fast
  form needs a helper: inline PTX off the interpreter), ``_dot``, the reductions, the
  block-list walk (``_n_tiles``, ``_tile_start``) and the tile loads and stores.

Holes (filled by ``flexjit.backends.triton_render``; each hole is one marked line, replaced
whole):
  ``# {{CAPTURE_PARAMS}}``   the captured buffers (pointer, sizes, strides) and scalars
  ``# {{CAPTURE_ARGS}}``     the same names, passed down a call
  ``# {{SCORE_MOD}}``        statements reading ``score`` (natural units), b, h, q_idx, kv_idx and
                             assigning the new ``score``
  ``# {{MASK_MOD}}``         statements assigning the bool ``mask``
  ``# {{DO_NOT_SPECIALIZE}}`` the run-time arguments Triton must not specialise on (sizes,
                             strides and scalars: a new value must not recompile)
Unrendered, the template is a working kernel for the identity score_mod and no mask_mod.

Algorithm (FlashAttention-2 §3.1, online softmax in the exp2 domain)
--------------------------------------------------------------------
* Scores live in log2 units: without a score_mod ``s2 = qk · (scale·log2 e)`` is one multiply;
  with one, ``score = qk · scale`` (natural units, what the mod sees) and ``s2 = score · log2 e``.
* Per row: running max ``m`` (log2 units), running sum ``l``, fp32 accumulator ``acc``. A row that
  has seen only masked scores has ``m = -inf``; the exponent base is then 0 so nothing is NaN.
* The block lists are walked partial blocks first (mask_mod applied), then full blocks (mask_mod
  skipped). A mask block of SPARSE_KV keys is walked in SPARSE_KV // BLOCK_N sub-tiles; a query
  tile of BLOCK_M rows reads the list row of the mask block that contains it. Without a block
  mask every key tile is visited as a full block (dense mode).
* Query tiles are launched longest-first (the last tile first): under causal-like masks the
  rows near the end have the most blocks, and starting them first shortens the tail.
* Epilogue: ``out = acc / l`` (0 for a row with nothing kept) and
  ``lse = (m + log2 l) · ln 2`` (-inf for a row with nothing kept).

Index conventions: ``q_idx`` is (BLOCK_M, 1) and ``kv_idx`` (1, BLOCK_N) int32; ``off_b`` and
``off_h`` (the QUERY head) are scalars. Rows >= L and columns >= S reach the mods (their results
are discarded); the rendered loads clamp every index, so they never read out of bounds.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# Arguments that follow the sequence lengths but gain nothing from Triton's divisibility-by-16
# specialisation (block-list strides and tile counts, read once per program): specialised,
# S = 1024 vs 2048 (8 vs 16 mask blocks) compiled the kernels twice (seen on the H200). The
# lists' innermost strides (always 1) stay specialised. The renderer adds the captures' sizes,
# strides and scalars.
LENGTH_ARGS = ["stride_nb", "stride_nh", "stride_nm", "stride_ib", "stride_ih", "stride_im",
               "n_dense"]
DO_NOT_SPECIALIZE = LENGTH_ARGS + []  # {{DO_NOT_SPECIALIZE}}


def _jit(fn):
    """triton.jit that leaves captured sizes/strides/scalars unspecialised (a new value reuses
    the kernel), on every Triton version we run under."""
    return triton.jit(fn, do_not_specialize=DO_NOT_SPECIALIZE)


from flexjit.templates.triton.common import _dot, _load_tile, _max, _n_tiles, _score_tile, _store_tile, _sum, _tanh, _tile_start  # {{COMMON}}


@triton.jit
def _attend(acc, l_i, m_i, q, K, V, KD, VD, kv_row0, stride_kn, stride_kd, stride_vn, stride_vd,
            idx_ptr, stride_idx, n_listed, idx2_ptr, n_listed2, off_b, off_h, offs_m, S, sm_scale,
            qk_scale_log2,
            # {{CAPTURE_PARAMS}}
            E: tl.constexpr, EV: tl.constexpr, E_PAD: tl.constexpr, EV_PAD: tl.constexpr,
            BLOCK_N: tl.constexpr, SPARSE_KV: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr,
            APPLY_MASK: tl.constexpr, EVEN_N: tl.constexpr, HAS_SCORE_MOD: tl.constexpr,
            DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr, NUM_STAGES: tl.constexpr,
            USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, MERGED: tl.constexpr):
    """Online softmax over the key tiles of one block list; returns the updated (acc, l, m).
    USE_TMA: K and V tiles come through the (rows, dim) tensor descriptors KD/VD at row
    ``kv_row0 + start_n`` (one TMA copy each) instead of pointer loads. MERGED: one loop over
    the partial list (``idx_ptr``, masked) and then the full list (``idx2_ptr``, ``n_listed2``
    blocks; mask_mod still evaluated, its result overridden): Triton's Hopper warp specialiser
    takes a kernel with one loop only, not two in sequence."""
    offs_d = tl.arange(0, E_PAD)
    offs_dv = tl.arange(0, EV_PAD)
    n_iter = _n_tiles(n_listed, SPARSE_KV, BLOCK_N, HAS_BLOCK_MASK)
    n_first = n_iter
    if MERGED:
        n_iter += _n_tiles(n_listed2, SPARSE_KV, BLOCK_N, HAS_BLOCK_MASK)
    for it in tl.range(0, n_iter, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
        if MERGED:
            full_tile = it >= n_first
            start_n = _tile_start(tl.where(full_tile, it - n_first, it),
                                  tl.where(full_tile, idx2_ptr, idx_ptr), stride_idx, SPARSE_KV,
                                  BLOCK_N, HAS_BLOCK_MASK)
        else:
            full_tile = False
            start_n = _tile_start(it, idx_ptr, stride_idx, SPARSE_KV, BLOCK_N, HAS_BLOCK_MASK)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if USE_TMA:
            k = KD.load([kv_row0 + start_n, 0])
        else:
            k_ptrs = K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
            v_ptrs = V + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
            k = _load_tile(k_ptrs, offs_n, offs_d, S, E, EVEN_N, E == E_PAD)
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION)
        s2 = _score_tile(qk, off_b, off_h, offs_m[:, None], offs_n[None, :], S, sm_scale,
                         qk_scale_log2,
                         # {{CAPTURE_ARGS}}
                         APPLY_MASK, EVEN_N, HAS_SCORE_MOD, FAST_MATH, MERGED, full_tile)
        m_new = tl.maximum(m_i, _max(s2, 1))
        # A row with nothing kept yet has m = -inf: use 0 as the base so exp2 gives 0, not NaN.
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_base)
        p = tl.math.exp2(s2 - m_base[:, None])
        l_i = l_i * alpha + _sum(p, 1, False)
        if USE_TMA:
            v = VD.load([kv_row0 + start_n, 0])
        else:
            v = _load_tile(v_ptrs, offs_n, offs_dv, S, EV, EVEN_N, EV == EV_PAD)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@_jit
def flex_fwd(
    Q, K, V, O, LSE, MAXS,  # q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, EV), o like q/v,
                            # lse and (with OUTPUT_MAX) the row max of the modded scores (B, Hq, L)
    QD, KD, VD,  # USE_TMA: tensor descriptors of q, k, v viewed as (rows, dim) (contiguous inputs:
                 # row (b·H + h)·len + i), blocks (BLOCK_M, E_PAD) / (BLOCK_N, *); else q, k, v, unread
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX,  # int32 block lists (Bm, Hm, nQ[, nKV]); unused when dense
    stride_nb, stride_nh, stride_nm,  # strides of KV_NUM and FULL_NUM (0 on broadcast dims)
    stride_ib, stride_ih, stride_im, stride_ij,  # strides of KV_IDX and FULL_IDX (0 on broadcast dims)
    Hq, L, S, G, n_dense,  # G = Hq // Hkv; n_dense = key tiles in dense mode
    sm_scale, qk_scale_log2,
    # {{CAPTURE_PARAMS}}
    E: tl.constexpr, EV: tl.constexpr, E_PAD: tl.constexpr, EV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr,
    HAS_BLOCK_MASK: tl.constexpr, HAS_PARTIAL: tl.constexpr, HAS_FULL: tl.constexpr,
    HAS_MASK_MOD: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
    NUM_STAGES: tl.constexpr, OUTPUT_MAX: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr, MERGE_LISTS: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest-first under causal-like masks
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hkv = off_h // G
    b64 = off_b.to(tl.int64)
    Q += b64 * stride_qb + off_h.to(tl.int64) * stride_qh
    K += b64 * stride_kb + off_hkv.to(tl.int64) * stride_kh
    V += b64 * stride_vb + off_hkv.to(tl.int64) * stride_vh
    O += b64 * stride_ob + off_h.to(tl.int64) * stride_oh

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, E_PAD)
    kv_row0 = (off_b * (Hq // G) + off_hkv) * S  # K/V's first row in the descriptors' view
    if USE_TMA:
        q = QD.load([(off_b * Hq + off_h) * L + pid_m * BLOCK_M, 0])
    else:
        q_ptrs = Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
        q = _load_tile(q_ptrs, offs_m, offs_d, L, E, EVEN_M, E == E_PAD)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, EV_PAD], 0.0, tl.float32)

    if HAS_BLOCK_MASK:
        row = (pid_m * BLOCK_M) // SPARSE_Q
        num_off = off_b * stride_nb + off_h * stride_nh + row * stride_nm
        idx_off = off_b * stride_ib + off_h * stride_ih + row * stride_im
        if MERGE_LISTS:  # WARP_SPEC with both lists: one loop (see _attend)
            acc, l_i, m_i = _attend(
                acc, l_i, m_i, q, K, V, KD, VD, kv_row0, stride_kn, stride_kd, stride_vn, stride_vd,
                KV_IDX + idx_off, stride_ij, tl.load(KV_NUM + num_off), FULL_IDX + idx_off,
                tl.load(FULL_NUM + num_off), off_b, off_h, offs_m, S, sm_scale, qk_scale_log2,
                # {{CAPTURE_ARGS}}
                E, EV, E_PAD, EV_PAD, BLOCK_N, SPARSE_KV, True, HAS_MASK_MOD, EVEN_N,
                HAS_SCORE_MOD, DOT_PRECISION, FAST_MATH, NUM_STAGES, USE_TMA, WARP_SPEC, True)
        else:
            if HAS_PARTIAL:
                acc, l_i, m_i = _attend(
                    acc, l_i, m_i, q, K, V, KD, VD, kv_row0, stride_kn, stride_kd, stride_vn,
                    stride_vd, KV_IDX + idx_off, stride_ij, tl.load(KV_NUM + num_off), KV_IDX, 0,
                    off_b, off_h, offs_m, S, sm_scale, qk_scale_log2,
                    # {{CAPTURE_ARGS}}
                    E, EV, E_PAD, EV_PAD, BLOCK_N, SPARSE_KV, True, HAS_MASK_MOD, EVEN_N,
                    HAS_SCORE_MOD, DOT_PRECISION, FAST_MATH, NUM_STAGES, USE_TMA, WARP_SPEC, False)
            if HAS_FULL:
                acc, l_i, m_i = _attend(
                    acc, l_i, m_i, q, K, V, KD, VD, kv_row0, stride_kn, stride_kd, stride_vn,
                    stride_vd, FULL_IDX + idx_off, stride_ij, tl.load(FULL_NUM + num_off), KV_IDX,
                    0, off_b, off_h, offs_m, S, sm_scale, qk_scale_log2,
                    # {{CAPTURE_ARGS}}
                    E, EV, E_PAD, EV_PAD, BLOCK_N, SPARSE_KV, True, False, EVEN_N,
                    HAS_SCORE_MOD, DOT_PRECISION, FAST_MATH, NUM_STAGES, USE_TMA, WARP_SPEC, False)
    else:
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, K, V, KD, VD, kv_row0, stride_kn, stride_kd, stride_vn, stride_vd,
            KV_IDX, 0, n_dense, KV_IDX, 0, off_b, off_h, offs_m, S, sm_scale, qk_scale_log2,
            # {{CAPTURE_ARGS}}
            E, EV, E_PAD, EV_PAD, BLOCK_N, BLOCK_N, False, False, EVEN_N,
            HAS_SCORE_MOD, DOT_PRECISION, FAST_MATH, NUM_STAGES, USE_TMA, WARP_SPEC, False)

    empty = l_i == 0.0  # nothing kept in the row: out = 0, lse = -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    offs_dv = tl.arange(0, EV_PAD)
    o_ptrs = O + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    _store_tile(o_ptrs, out, offs_m, offs_dv, L, EV, EVEN_M, EV == EV_PAD)
    row = (off_b * Hq + off_h).to(tl.int64) * L + offs_m
    if EVEN_M:
        tl.store(LSE + row, lse)
    else:
        tl.store(LSE + row, lse, mask=offs_m < L)
    if OUTPUT_MAX:  # m is the log2-domain running max: -inf where nothing is kept
        if EVEN_M:
            tl.store(MAXS + row, m_i * LN2)
        else:
            tl.store(MAXS + row, m_i * LN2, mask=offs_m < L)
