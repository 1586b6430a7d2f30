"""Triton backward, atomic-dQ schedule (kernel_options ``BWD_DQ_ATOMIC``): one role, 5 GEMMs.

``triton/bwd.py``'s launch runs two roles: the dK/dV programs compute S, dP, dV and dK per
(key tile, query sub-tile), and the dQ programs recompute S and dP to form dQ: 7 GEMM units
where 5 would do. Here the dK/dV programs also form ``dQ_sub = scale · dS K`` for each query
sub-tile they visit and add it into an fp32 accumulator (B, Hq, L, E) with ``tl.atomic_add``
(FlashAttention-2's original Triton form); no dQ programs are launched, and the caller converts
the accumulator to dq's dtype. The adds land in no fixed order, so dQ is reproducible only to
fp32 rounding: deterministic mode runs ``bwd.py``'s two-role launch instead
(``backends.triton.config.dq_atomic``).

This file is not a module of its own: the renderer appends its definitions (everything after
the imports) to the rendered ``bwd.py`` module, so ``_ds_tile`` (with its holes), ``_key_tile``,
the preprocess kernel and the shared helpers are the same code as the two-role launch's, and
the holes here (``# {{CAPTURE_PARAMS}}``, ``# {{GRAD_PARAMS}}``, their ARGS) are filled with
the same lines. Unrendered, it imports them.

The loop is ``bwd.py``'s ``_dkdv_loop`` with the dQ product and its atomic after dK (the
order the tile's values die in: ds_t is last read there); the kernel is ``flex_bwd``'s dK/dV
role with the accumulator's pointer and strides in place of dq's. Captured-tensor gradients are
the dK/dV role's, unchanged: every kept (b, h, q, kv) is still visited exactly once.
"""
import triton
import triton.language as tl

# Unrendered use only: the rendered module holds these definitions already.
from flexjit.templates.triton.bwd import _jit, _ds_tile, _key_tile
from flexjit.templates.triton.common import _dot, _load_rows, _load_tile, _n_tiles, _store_tile, _tile_start


@triton.jit
def _dkdv_dq_loop(dk, dv, k, v, Q, DO, QD, DOD, q_row0, LSE2, DELTA, DQA, stride_qm, stride_qd,
                  stride_dom, stride_dod, stride_dqam, stride_dqad, idx_ptr, stride_idx, n_listed,
                  off_b, off_h, offs_n, L, S, sm_scale,
                  # {{CAPTURE_PARAMS}}
                  # {{GRAD_PARAMS}}
                  E: tl.constexpr, EV: tl.constexpr, E_PAD: tl.constexpr, EV_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, SPARSE_Q: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr,
                  APPLY_MASK: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                  HAS_SCORE_MOD: tl.constexpr, ACC_GRADS: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr, NUM_STAGES: tl.constexpr,
                  USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr):
    """Accumulate dK, dV of one key tile over the query tiles of one block list, and add each
    sub-tile's scaled dQ into the fp32 accumulator ``DQA`` (rows of this query head)."""
    offs_d = tl.arange(0, E_PAD)
    offs_dv = tl.arange(0, EV_PAD)
    n_iter = _n_tiles(n_listed, SPARSE_Q, BLOCK_M, HAS_BLOCK_MASK)
    for it in tl.range(0, n_iter, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
        start_m = _tile_start(it, idx_ptr, stride_idx, SPARSE_Q, BLOCK_M, HAS_BLOCK_MASK)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        if USE_TMA:
            q = QD.load([q_row0 + start_m, 0])
            do = DOD.load([q_row0 + start_m, 0])
        else:
            q_ptrs = Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
            do_ptrs = DO + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod
            q = _load_tile(q_ptrs, offs_m, offs_d, L, E, EVEN_M, E == E_PAD)
            do = _load_tile(do_ptrs, offs_m, offs_dv, L, EV, EVEN_M, EV == EV_PAD)
        lse2 = _load_rows(LSE2, offs_m, L, EVEN_M)
        delta = _load_rows(DELTA, offs_m, L, EVEN_M)
        qk_t = _dot(k, tl.trans(q), None, DOT_PRECISION)
        dp_t = _dot(v, tl.trans(do), None, DOT_PRECISION)
        p_t, ds_t = _ds_tile(qk_t, dp_t, lse2[None, :], delta[None, :], off_b, off_h,
                             offs_m[None, :], offs_n[:, None], L, S, sm_scale,
                             # {{CAPTURE_ARGS}}
                             # {{GRAD_ARGS}}
                             APPLY_MASK, EVEN_M, EVEN_N, HAS_SCORE_MOD, ACC_GRADS, 0, FAST_MATH)
        dv = _dot(p_t.to(do.dtype), do, dv, DOT_PRECISION)
        ds_lo = ds_t.to(q.dtype)  # the operand precision dK and dQ both take (as the dQ role's)
        dk = _dot(ds_lo, q, dk, DOT_PRECISION)
        # Scaled here, not in the conversion after the launch: one multiply per element of the
        # tile on chip, and the conversion becomes a plain dtype cast (none for fp32 inputs).
        dq = _dot(tl.trans(ds_lo), k, None, DOT_PRECISION) * sm_scale
        dq_ptrs = DQA + offs_m[:, None] * stride_dqam + offs_d[None, :] * stride_dqad
        if EVEN_M and E == E_PAD:
            tl.atomic_add(dq_ptrs, dq, sem="relaxed")
        else:  # rows past L belong to the next head (or past the buffer); padded dims to nothing
            tl.atomic_add(dq_ptrs, dq, mask=(offs_m[:, None] < L) & (offs_d[None, :] < E),
                          sem="relaxed")
    return dk, dv


@_jit
def flex_bwd_dq_atomic(
    Q, K, V, DO, LSE2, DELTA, DQA, DK, DV,  # DQA: fp32 (B, Hq, L, E) accumulator, zero on entry
    QD, DOD,  # USE_TMA: descriptors of q and dO as (rows, dim), blocks BLOCK_M1; else unread
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqab, stride_dqah, stride_dqam, stride_dqad,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX,  # transposed lists (Bm, Hm, nKV[, nQ])
    stride_qnb, stride_qnh, stride_qnn,  # strides of Q_NUM / FULL_Q_NUM (0 on broadcast dims)
    stride_qib, stride_qih, stride_qin, stride_qij,
    Hq, L, S, G, n_dense_q,
    sm_scale,
    # {{CAPTURE_PARAMS}}
    # {{GRAD_PARAMS}}
    E: tl.constexpr, EV: tl.constexpr, E_PAD: tl.constexpr, EV_PAD: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr,
    HAS_BLOCK_MASK: tl.constexpr, HAS_PARTIAL: tl.constexpr, HAS_FULL: tl.constexpr,
    HAS_MASK_MOD: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, ACC_GRADS: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FAST_MATH: tl.constexpr, NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    # ---- one key tile of one (batch, kv head), every query head of the group ----
    pid = tl.program_id(0)
    off_hkv = tl.program_id(1)
    off_b = tl.program_id(2)
    b64 = off_b.to(tl.int64)
    offs_d = tl.arange(0, E_PAD)
    offs_dv = tl.arange(0, EV_PAD)
    K += b64 * stride_kb + off_hkv.to(tl.int64) * stride_kh
    V += b64 * stride_vb + off_hkv.to(tl.int64) * stride_vh
    offs_n = pid * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    k, v = _key_tile(K, V, offs_n, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd,
                     S, E, EV, E_PAD, EV_PAD, EVEN_N)
    dk = tl.full([BLOCK_N1, E_PAD], 0.0, tl.float32)
    dv = tl.full([BLOCK_N1, EV_PAD], 0.0, tl.float32)
    col = (pid * BLOCK_N1) // SPARSE_KV
    for g in range(0, G):
        off_h = off_hkv * G + g
        h64 = off_h.to(tl.int64)
        Qh = Q + b64 * stride_qb + h64 * stride_qh
        DOh = DO + b64 * stride_dob + h64 * stride_doh
        DQAh = DQA + b64 * stride_dqab + h64 * stride_dqah
        row0 = (b64 * Hq + h64) * L
        if HAS_BLOCK_MASK:
            num_off = off_b * stride_qnb + off_h * stride_qnh + col * stride_qnn
            idx_off = off_b * stride_qib + off_h * stride_qih + col * stride_qin
            if HAS_PARTIAL:
                dk, dv = _dkdv_dq_loop(
                    dk, dv, k, v, Qh, DOh, QD, DOD, row0.to(tl.int32), LSE2 + row0,
                    DELTA + row0, DQAh, stride_qm, stride_qd, stride_dom, stride_dod,
                    stride_dqam, stride_dqad, Q_IDX + idx_off, stride_qij,
                    tl.load(Q_NUM + num_off), off_b, off_h, offs_n, L, S, sm_scale,
                    # {{CAPTURE_ARGS}}
                    # {{GRAD_ARGS}}
                    E, EV, E_PAD, EV_PAD, BLOCK_M1, SPARSE_Q, True, HAS_MASK_MOD,
                    EVEN_M, EVEN_N, HAS_SCORE_MOD, ACC_GRADS, DOT_PRECISION, FAST_MATH,
                    NUM_STAGES, USE_TMA, WARP_SPEC)
            if HAS_FULL:
                dk, dv = _dkdv_dq_loop(
                    dk, dv, k, v, Qh, DOh, QD, DOD, row0.to(tl.int32), LSE2 + row0,
                    DELTA + row0, DQAh, stride_qm, stride_qd, stride_dom, stride_dod,
                    stride_dqam, stride_dqad, FULL_Q_IDX + idx_off, stride_qij,
                    tl.load(FULL_Q_NUM + num_off), off_b, off_h, offs_n, L, S, sm_scale,
                    # {{CAPTURE_ARGS}}
                    # {{GRAD_ARGS}}
                    E, EV, E_PAD, EV_PAD, BLOCK_M1, SPARSE_Q, True, False,
                    EVEN_M, EVEN_N, HAS_SCORE_MOD, ACC_GRADS, DOT_PRECISION, FAST_MATH,
                    NUM_STAGES, USE_TMA, WARP_SPEC)
        else:
            dk, dv = _dkdv_dq_loop(
                dk, dv, k, v, Qh, DOh, QD, DOD, row0.to(tl.int32), LSE2 + row0,
                DELTA + row0, DQAh, stride_qm, stride_qd, stride_dom, stride_dod,
                stride_dqam, stride_dqad, Q_IDX, 0, n_dense_q, off_b, off_h, offs_n, L, S,
                sm_scale,
                # {{CAPTURE_ARGS}}
                # {{GRAD_ARGS}}
                E, EV, E_PAD, EV_PAD, BLOCK_M1, BLOCK_M1, False, False,
                EVEN_M, EVEN_N, HAS_SCORE_MOD, ACC_GRADS, DOT_PRECISION, FAST_MATH,
                NUM_STAGES, USE_TMA, WARP_SPEC)
    dk = dk * sm_scale
    dk_ptrs = (DK + b64 * stride_dkb + off_hkv.to(tl.int64) * stride_dkh
               + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd)
    dv_ptrs = (DV + b64 * stride_dvb + off_hkv.to(tl.int64) * stride_dvh
               + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd)
    _store_tile(dk_ptrs, dk, offs_n, offs_d, S, E, EVEN_N, E == E_PAD)
    _store_tile(dv_ptrs, dv, offs_n, offs_dv, S, EV, EVEN_N, EV == EV_PAD)
