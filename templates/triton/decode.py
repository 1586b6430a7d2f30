"""Triton split-KV decoding template (flash-decoding): few query rows against a long KV.

What this module holds
----------------------
* ``flex_decode``: the main kernel. The grid is (row tiles × splits, head programs, batch).
  A head program owns GP query heads that share one kv head (GP = Hq // Hkv, "GQA packed", or 1
  when the block lists differ per query head); its GP × L query rows are the M dimension of the
  tiles, row ``r`` being query position ``r // GP`` of query head ``hp·GP + r % GP``, so each K/V
  tile loaded serves every query head of the group. A split walks one contiguous part of the
  row's kv walk (the partial blocks, then the full blocks, as one list of kernel tiles) and
  writes its partial result: ``acc / l`` (fp32) and the log2-domain LSE and row max. With
  one split it writes the final out / lse / max itself.
* ``flex_decode_merge``: combines the splits of each (b, h, q) row: ``lse = log2 Σ 2^lse_s``,
  ``out = Σ 2^(lse_s − lse) · out_s`` (FlashDecoding's reduction), and the row max as the max
  of the splits' maxima.
* ``_score_tile`` (``triton_common.py``'s, with its holes, unmerged): here ``off_h`` and ``q_idx``
  are (BLOCK_M, 1) vectors (rows of one tile belong to several query heads), ``off_b`` a scalar.
* FP8 (``KV_FP8``, and ``Q_FP8`` for an e4m3 query): K/V tiles are loaded as e4m3 (half the
  bytes) and converted exactly to ``backends/fp8.py``'s compute dtype before the dots: float16
  for an e4m3 or 16-bit query (one conversion a pair; to bfloat16 it takes three, which made the
  kernel conversion-bound), float32 for a float32 one. A bfloat16 query is multiplied per row by
  a power of two that brings its largest value into [2^14, 2^15) before it rounds to float16
  (exact for every value within 2^-28 of that largest), undone in the score scale.
  A program serves one (batch, kv head), so its descales are scalars: q's and k's fold into the
  score scale, v's into the output. Each is read where the caller keeps it (``QD``/``KD``/``VD``:
  kind 0 absent, 1.0; 1 one factor; 2 one per (batch, kv head), contiguous), so a call builds no
  table (a table took two small kernels a call). Off the kernel is the 16-bit one.
* Variants (constexprs, all off in the default build; ``DECODE_CONFIG`` in the host module):
  ``PREFETCH`` tests ``kv_idx < S`` in every tile's scores (true there: no result changes).
  Triton's pipeliner gives a block-index load whose only use is the K/V addresses a stage of its
  own, leaving the K/V copies one stage, single-buffered: the next tile's copy starts after
  this tile's P·V. A use in the softmax keeps the index load in the copies' stage, and they get
  two tiles of lead in two buffers. ``K_BITS`` / ``V_BITS`` convert e4m3 to float16 by
  moving bits (``_e4m3_bits``: integer ops on four bytes at a time instead of two conversion
  instructions), giving 2^-8 × the value, undone in the score scale / the output.

Holes (filled by ``flexjit.backends.triton_render``, as for ``triton_fwd.py``):
``# {{CAPTURE_PARAMS}}``, ``# {{CAPTURE_ARGS}}``, ``# {{SCORE_MOD}}``, ``# {{MASK_MOD}}``,
``# {{DO_NOT_SPECIALIZE}}``.

Contract with the host (``flexjit.backends.triton_decode``): the rows of a program lie in one
query block of the block mask (QB = its Q block size; L without a block mask), so one list row
serves the tile; GP > 1 only when the lists broadcast over heads (their head stride is 0).
Axis 0 of the grid is (query block, row tile of MT, split).
K and V are read only through the block lists' indices (a paged cache's lists point at physical
pages), never by assuming the logical KV is contiguous.

Conventions as in ``triton_fwd.py``: scores in log2 units (scale·log2 e folded), a row with
nothing kept has m = -inf and yields out = 0, lse = -inf; indices past L / S reach the mods
(results discarded) and rendered loads clamp them.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# Read once per program, no gain from Triton's 16-divisibility specialisation; a new value must
# reuse the kernel (the split count changes with the batch). The renderer adds the captures'.
LENGTH_ARGS = ["stride_nb", "stride_nh", "stride_nm", "stride_ib", "stride_ih", "stride_im",
               "n_dense", "n_splits", "GP", "G", "QB", "MT"]
DO_NOT_SPECIALIZE = LENGTH_ARGS + []  # {{DO_NOT_SPECIALIZE}}


def _jit(fn):
    return triton.jit(fn, do_not_specialize=DO_NOT_SPECIALIZE)


from flexjit.templates.triton.common import _dot, _max, _n_tiles, _score_tile, _sum, _tanh, _tile_start  # {{COMMON}}


@triton.jit
def _e4m3_bits(x, ASM: tl.constexpr):
    """e4m3 ``x`` as float16 × 2^-8, exactly (normals and subnormals; e4m3's NaN becomes 1.875):
    the sign to bit 15, the 4 exponent and 3 mantissa bits to bits 13..7, whose float16 value is
    the e4m3 one shifted by the bias difference 15 - 7. ASM: four bytes a register (PRMT puts
    two in the high bytes of the halves, a shift and two LOP3s finish each pair); else the same
    on each element (the interpreter)."""
    u = x.to(tl.uint8, bitcast=True)
    if ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, s0, s1;
            prmt.b32 t0, $2, 0, 0x1404;
            prmt.b32 t1, $2, 0, 0x3424;
            and.b32 s0, t0, 0x7F007F00;
            and.b32 s1, t1, 0x7F007F00;
            shr.b32 s0, s0, 1;
            shr.b32 s1, s1, 1;
            and.b32 t0, t0, 0x80008000;
            and.b32 t1, t1, 0x80008000;
            or.b32 $0, t0, s0;
            or.b32 $1, t1, s1;
            }""",
            "=r,=r,r", [u], dtype=tl.float16, is_pure=True, pack=4)
    else:
        w = u.to(tl.uint16)
        return (((w & 0x80) << 8) | ((w & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _attend(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            idx_ptr, stride_idx, lo, hi, off_b, off_h, q_idx, S, sm_scale, qk_scale_log2,
            # {{CAPTURE_PARAMS}}
            E: tl.constexpr, EV: tl.constexpr, E_PAD: tl.constexpr, EV_PAD: tl.constexpr,
            BLOCK_N: tl.constexpr, SPARSE_KV: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr,
            APPLY_MASK: tl.constexpr, EVEN_N: tl.constexpr, HAS_SCORE_MOD: tl.constexpr,
            DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr, NUM_STAGES: tl.constexpr,
            KV_FP8: tl.constexpr, PREFETCH: tl.constexpr, K_BITS: tl.constexpr,
            V_BITS: tl.constexpr, ASM: tl.constexpr):
    """Online softmax (FlashAttention-2 §3.1) over tiles [lo, hi) of one block list's walk."""
    offs_d = tl.arange(0, E_PAD)
    offs_dv = tl.arange(0, EV_PAD)
    for it in tl.range(lo, hi, num_stages=NUM_STAGES):
        start_n = _tile_start(it, idx_ptr, stride_idx, SPARSE_KV, BLOCK_N, HAS_BLOCK_MASK)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = K + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = V + offs_n[:, None].to(tl.int64) * stride_vn + offs_dv[None, :] * stride_vd
        if EVEN_N and E == E_PAD:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=(offs_n[:, None] < S) & (offs_d[None, :] < E), other=0.0)
        if K_BITS:
            k = _e4m3_bits(k, ASM)
        elif KV_FP8:
            k = k.to(q.dtype)  # exact: every e4m3 value is a float16/bfloat16/float32 value
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION)
        s2 = _score_tile(qk, off_b, off_h, q_idx, offs_n[None, :], S, sm_scale, qk_scale_log2,
                         # {{CAPTURE_ARGS}}
                         APPLY_MASK, EVEN_N and not PREFETCH, HAS_SCORE_MOD, FAST_MATH, False,
                         False)
        m_new = tl.maximum(m_i, _max(s2, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing kept yet: exp2 gives 0
        alpha = tl.math.exp2(m_i - m_base)
        p = tl.math.exp2(s2 - m_base[:, None])
        l_i = l_i * alpha + _sum(p, 1, False)
        if EVEN_N and EV == EV_PAD:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < S) & (offs_dv[None, :] < EV), other=0.0)
        if V_BITS:
            v = _e4m3_bits(v, ASM)
        elif KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _descale(ptr, KIND: tl.constexpr, pair):
    """A descale of (batch, kv head) ``pair``: 1.0 (KIND 0), the one factor (1), its entry (2)."""
    if KIND == 0:
        return 1.0
    elif KIND == 1:
        return tl.load(ptr)
    else:
        return tl.load(ptr + pair)


@_jit
def flex_decode(
    Q, K, V, O, LSE, MAXS,  # q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, EV), o (B, Hq, L, EV),
                            # lse / max (B, Hq, L) fp32: written only with one split
    OP, LP, MP,  # partials: OP (B·Hq·L, n_splits, EV) fp32, LP / MP (B·Hq·L, n_splits) fp32 (log2)
    QD, KD, VD,  # KV_FP8: the q, k, v descales (fp32, QD_KIND/KD_KIND/VD_KIND); else None
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX,  # int32 block lists; only query block 0 is read
    stride_nb, stride_nh, stride_nm, stride_ib, stride_ih, stride_im, stride_ij,  # 0 if broadcast
    Hq, L, S, G, GP, QB, MT, n_dense, n_splits,  # G = Hq // Hkv; GP heads per program; QB query
                                                 # positions per query block, MT row tiles each
    sm_scale, qk_scale_log2,
    # {{CAPTURE_PARAMS}}
    E: tl.constexpr, EV: tl.constexpr, E_PAD: tl.constexpr, EV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_KV: tl.constexpr,
    HAS_BLOCK_MASK: tl.constexpr, HAS_PARTIAL: tl.constexpr, HAS_FULL: tl.constexpr,
    HAS_MASK_MOD: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr, NUM_STAGES: tl.constexpr,
    OUTPUT_MAX: tl.constexpr, SPLIT: tl.constexpr, Q_FP8: tl.constexpr, KV_FP8: tl.constexpr,
    Q_TO_F16: tl.constexpr, PREFETCH: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    QD_KIND: tl.constexpr, KD_KIND: tl.constexpr, VD_KIND: tl.constexpr, ASM: tl.constexpr,
):
    split = tl.program_id(0) % n_splits
    q_blk = (tl.program_id(0) // n_splits) // MT
    tile_m = (tl.program_id(0) // n_splits) % MT
    hp = tl.program_id(1)
    off_b = tl.program_id(2)
    h0 = hp * GP
    off_hkv = h0 // G
    b64 = off_b.to(tl.int64)
    K += b64 * stride_kb + off_hkv.to(tl.int64) * stride_kh
    V += b64 * stride_vb + off_hkv.to(tl.int64) * stride_vh

    q_lo = q_blk * QB
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (query position, head) rows
    row_ok = rows < GP * tl.minimum(QB, L - q_lo)
    q_pos = q_lo + rows // GP
    heads = h0 + rows % GP
    offs_d = tl.arange(0, E_PAD)
    q_ptrs = (Q + b64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh
              + q_pos[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < E), other=0.0)
    if Q_FP8:
        q = q.to(tl.float16)  # exact (backends/fp8.py, compute_dtype)
    if KV_FP8:
        pair = off_b * (Hq // G) + off_hkv
        qk_descale = _descale(QD, QD_KIND, pair) * _descale(KD, KD_KIND, pair)
        sm_scale = sm_scale * qk_descale
        qk_scale_log2 = qk_scale_log2 * qk_descale
        v_descale = _descale(VD, VD_KIND, pair)
        if K_BITS:  # the tiles hold 2^-8 × k
            sm_scale = sm_scale * 256.0
            qk_scale_log2 = qk_scale_log2 * 256.0
        if V_BITS:
            v_descale = v_descale * 256.0
        if Q_TO_F16:  # a bfloat16 query: float16 dots (module docstring)
            q32 = q.to(tl.float32)
            amax = _max(tl.abs(q32), 1)
            expo = tl.floor(tl.math.log2(tl.where(amax > 0.0, amax, 1.0)))  # 0: a masked row
            q = (q32 * tl.math.exp2(14.0 - expo)[:, None]).to(tl.float16)
            unshift = tl.math.exp2(expo - 14.0)[:, None]  # per row: (BLOCK_M, 1)
            sm_scale = sm_scale * unshift
            qk_scale_log2 = qk_scale_log2 * unshift

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, EV_PAD], 0.0, tl.float32)

    # This split's share of the row's walk: partial tiles first, then full ones, as one list.
    if HAS_BLOCK_MASK:
        num_off = off_b * stride_nb + h0 * stride_nh + q_blk * stride_nm
        idx_off = off_b * stride_ib + h0 * stride_ih + q_blk * stride_im
        n_part = 0
        n_full = 0
        if HAS_PARTIAL:
            n_part = _n_tiles(tl.load(KV_NUM + num_off), SPARSE_KV, BLOCK_N, True)
        if HAS_FULL:
            n_full = _n_tiles(tl.load(FULL_NUM + num_off), SPARSE_KV, BLOCK_N, True)
    else:
        n_part = 0
        n_full = n_dense
    total = n_part + n_full
    per = (total + n_splits - 1) // n_splits
    lo = tl.minimum(split * per, total)
    hi = tl.minimum(lo + per, total)
    if HAS_BLOCK_MASK:
        if HAS_PARTIAL:
            acc, l_i, m_i = _attend(
                acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                KV_IDX + idx_off, stride_ij, lo, tl.minimum(hi, n_part), off_b, heads[:, None],
                q_pos[:, None], S, sm_scale, qk_scale_log2,
                # {{CAPTURE_ARGS}}
                E, EV, E_PAD, EV_PAD, BLOCK_N, SPARSE_KV, True, HAS_MASK_MOD, EVEN_N,
                HAS_SCORE_MOD, DOT_PRECISION, FAST_MATH, NUM_STAGES, KV_FP8, PREFETCH, K_BITS, V_BITS,
                ASM)
        if HAS_FULL:
            acc, l_i, m_i = _attend(
                acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                FULL_IDX + idx_off, stride_ij, tl.maximum(lo, n_part) - n_part, hi - n_part,
                off_b, heads[:, None], q_pos[:, None], S, sm_scale, qk_scale_log2,
                # {{CAPTURE_ARGS}}
                E, EV, E_PAD, EV_PAD, BLOCK_N, SPARSE_KV, True, False, EVEN_N,
                HAS_SCORE_MOD, DOT_PRECISION, FAST_MATH, NUM_STAGES, KV_FP8, PREFETCH, K_BITS, V_BITS,
                ASM)
    else:
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
            KV_IDX, 0, lo, hi, off_b, heads[:, None], q_pos[:, None], S, sm_scale, qk_scale_log2,
            # {{CAPTURE_ARGS}}
            E, EV, E_PAD, EV_PAD, BLOCK_N, BLOCK_N, False, False, EVEN_N,
            HAS_SCORE_MOD, DOT_PRECISION, FAST_MATH, NUM_STAGES, KV_FP8, PREFETCH, K_BITS, V_BITS,
            ASM)

    empty = l_i == 0.0  # nothing kept (in this split): out = 0, lse = -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    if KV_FP8:
        out = out * v_descale
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    offs_dv = tl.arange(0, EV_PAD)
    flat = (off_b * Hq + heads).to(tl.int64) * L + q_pos  # the (b, h, q) row's index
    st_mask = row_ok[:, None] & (offs_dv[None, :] < EV)
    if SPLIT:
        part = flat * n_splits + split
        tl.store(OP + part[:, None] * EV + offs_dv[None, :], out, mask=st_mask)
        tl.store(LP + part, lse2, mask=row_ok)
        if OUTPUT_MAX:
            tl.store(MP + part, m_i, mask=row_ok)
    else:
        o_ptrs = (O + b64 * stride_ob + heads[:, None].to(tl.int64) * stride_oh
                  + q_pos[:, None].to(tl.int64) * stride_om + offs_dv[None, :] * stride_od)
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=st_mask)
        tl.store(LSE + flat, lse2 * LN2, mask=row_ok)
        if OUTPUT_MAX:
            tl.store(MAXS + flat, m_i * LN2, mask=row_ok)


@_jit
def flex_decode_merge(
    OP, LP, MP, O, LSE, MAXS,  # partials as flex_decode writes them; O (B·Hq·L, EV) contiguous
    n_splits,  # the grid is one program per row: B·Hq·L
    EV: tl.constexpr, EV_PAD: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS_PAD: tl.constexpr,
    OUTPUT_MAX: tl.constexpr,
):
    """Combine one row's split results (FlashDecoding's log-sum-exp reduction): one program per
    row, BLOCK_S splits' outputs per step. (A program per 16 rows looping over the splits one at
    a time was a chain of dependent loads: at batch 1, 2 programs walked 128 splits.)"""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < n_splits
    lp = tl.load(LP + row * n_splits + offs_s, mask=s_ok, other=float("-inf"))
    mx = _max(lp, 0)
    mx_base = tl.where(mx == float("-inf"), 0.0, mx)
    total = _sum(tl.math.exp2(lp - mx_base), 0, False)
    empty = total == 0.0
    lse2 = tl.where(empty, float("-inf"), mx_base + tl.math.log2(tl.where(empty, 1.0, total)))
    lse_base = tl.where(empty, 0.0, lse2)
    offs_dv = tl.arange(0, EV_PAD)
    dv_ok = offs_dv < EV
    offs_b = tl.arange(0, BLOCK_S)
    acc = tl.full([EV_PAD], 0.0, tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        ss = s0 + offs_b
        ok = ss < n_splits
        w = tl.math.exp2(tl.load(LP + row * n_splits + ss, mask=ok, other=float("-inf")) - lse_base)
        o_s = tl.load(OP + (row * n_splits + ss)[:, None] * EV + offs_dv[None, :],
                      mask=ok[:, None] & dv_ok[None, :], other=0.0)
        acc += _sum(w[:, None] * o_s, 0, False)
    tl.store(O + row * EV + offs_dv, acc.to(O.dtype.element_ty), mask=dv_ok)
    tl.store(LSE + row, lse2 * LN2)
    if OUTPUT_MAX:
        mp = tl.load(MP + row * n_splits + offs_s, mask=s_ok, other=float("-inf"))
        tl.store(MAXS + row, _max(mp, 0) * LN2)
