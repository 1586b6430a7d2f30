"""Triton backward template: dQ, dK, dV and captured-tensor gradients of block-sparse flex attention.

What this module holds
----------------------
* ``flex_bwd_preprocess``: ``delta = rowsum(dO ∘ O) − dLSE`` and ``lse2 = lse · log2 e`` (0 on a
  row with nothing kept), both fp32 (B, Hq, L).
* ``flex_bwd``: one launch, two roles (FlashAttention-2 §3.2 split, deterministic):
  - programs ``pid < n_kv_tiles`` own a BLOCK_N1 tile of keys of one (batch, KV head). K and V
    stay on chip while the program walks, for every query head of the GQA group, the transposed
    block lists (partial, then full) in BLOCK_M1 sub-tiles, accumulating dK and dV in registers.
    These programs also add the captured tensors' gradients (atomics into fp64 accumulators:
    one table entry may take ~L·S/2 adds, which fp32 would round into the dominant error):
    every kept (b, h, q, kv) is visited exactly once here.
  - the other programs own a BLOCK_M2 tile of query rows of one (batch, query head) and walk the
    kv block lists in BLOCK_N2 sub-tiles, accumulating dQ in registers (no dQ atomics).
* ``_ds_tile``: the elementwise part, shared by both roles, with the holes; ``_key_tile``: the
  k and v rows one role holds and the other streams.
* From ``triton_common.py`` (pasted at ``# {{COMMON}}``): the block-list walk (``_n_tiles``,
  ``_tile_start``) and the tile loads and stores, shared by both roles and the forward.

Holes (filled by ``flexjit.backends.triton_render``; each hole is one marked line, replaced
whole):
  ``# {{CAPTURE_PARAMS}}`` / ``# {{CAPTURE_ARGS}}``  captured buffers and scalars (as forward)
  ``# {{GRAD_PARAMS}}`` / ``# {{GRAD_ARGS}}``        fp64 gradient accumulators of the captured
                                                   tensors that require grad (pointer, strides)
  ``# {{SCORE_BWD}}``   statements computing the new ``score`` and ``dscore`` = d score_mod/d score
                        (and the partials the gradient atomics need), sharing subexpressions
  ``# {{MASK_MOD}}``    statements assigning the bool ``mask``
  ``# {{GRAD_ATOMICS}}`` statements adding ``ds · d score_mod/d load`` into the accumulators
  ``# {{DO_NOT_SPECIALIZE}}`` as forward

Math (s = score_mod(q·k·scale), P = softmax(s), O = P V; log2 units as in the forward):
    P = exp2(s·log2 e − lse2)            dV = Pᵀ dO          dP = dO Vᵀ
    dS = P ∘ (dP − delta) · dscore       dQ = scale · dS K    dK = scale · dSᵀ Q
Masked and out-of-range positions get P = 0 and dS = 0 (a row with nothing kept has lse2 = 0 and
all scores -inf, so nothing is NaN). The same tile code serves both roles: role dK/dV works on
transposed tiles (kv along axis 0), role dQ on row-major ones; ``KV_AXIS`` says which.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)

# Arguments that follow the sequence lengths but gain nothing from Triton's divisibility-by-16
# specialisation (block-list strides and tile counts, read once per program): specialised,
# S = 1024 vs 2048 (8 vs 16 mask blocks) compiled the kernels twice (seen on the H200). The
# lists' innermost strides (always 1) stay specialised. The renderer adds the captures' sizes,
# strides and scalars.
LENGTH_ARGS = ["stride_kvnb", "stride_kvnh", "stride_kvnm", "stride_kvib", "stride_kvih",
               "stride_kvim", "stride_qnb", "stride_qnh", "stride_qnn", "stride_qib", "stride_qih",
               "stride_qin", "n_kv_tiles", "n_q_tiles", "n_dense_q", "n_dense_kv"]
DO_NOT_SPECIALIZE = LENGTH_ARGS + []  # {{DO_NOT_SPECIALIZE}}


def _jit(fn):
    """triton.jit that leaves captured sizes/strides/scalars unspecialised."""
    return triton.jit(fn, do_not_specialize=DO_NOT_SPECIALIZE)


from flexjit.templates.triton.common import _dot, _load_rows, _load_tile, _n_tiles, _store_tile, _sum, _tanh, _tile_start  # {{COMMON}}


@triton.jit
def flex_bwd_preprocess(O, DO, LSE, DLSE, DELTA, LSE2,
                        stride_ob, stride_oh, stride_om, stride_od,
                        stride_gb, stride_gh, stride_gm, stride_gd,
                        Hq, L,
                        EV: tl.constexpr, EV_PAD: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_DLSE: tl.constexpr):
    off_m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    offs_d = tl.arange(0, EV_PAD)
    valid = (off_m[:, None] < L) & (offs_d[None, :] < EV)
    o = tl.load(O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                + off_m[:, None] * stride_om + offs_d[None, :] * stride_od, mask=valid, other=0.0)
    do = tl.load(DO + off_b.to(tl.int64) * stride_gb + off_h.to(tl.int64) * stride_gh
                 + off_m[:, None] * stride_gm + offs_d[None, :] * stride_gd, mask=valid, other=0.0)
    delta = _sum(o.to(tl.float32) * do.to(tl.float32), 1, False)
    row = (off_b * Hq + off_h).to(tl.int64) * L + off_m
    lse = tl.load(LSE + row, mask=off_m < L, other=0.0)
    empty = lse == float("-inf")
    if HAS_DLSE:
        # d lse / d s = P, so an LSE gradient only shifts delta (zero on an empty row).
        dlse = tl.load(DLSE + row, mask=off_m < L, other=0.0)
        delta = delta - tl.where(empty, 0.0, dlse)
    tl.store(DELTA + row, delta, mask=off_m < L)
    tl.store(LSE2 + row, tl.where(empty, 0.0, lse * LOG2E), mask=off_m < L)


@triton.jit
def _ds_tile(qk, dp, lse2, delta, off_b, off_h, q_idx, kv_idx, L, S, sm_scale,
             # {{CAPTURE_PARAMS}}
             # {{GRAD_PARAMS}}
             APPLY_MASK: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
             HAS_SCORE_MOD: tl.constexpr, ACC_GRADS: tl.constexpr, KV_AXIS: tl.constexpr,
             FAST_MATH: tl.constexpr):
    """(P, dS) of one tile: dS = dL/d(q·k), already including d score_mod/d score; 0 where masked."""
    NEED_KEEP: tl.constexpr = APPLY_MASK or (not EVEN_M) or (not EVEN_N)
    if HAS_SCORE_MOD:
        score = qk * sm_scale
        dscore = 1.0
        # {{SCORE_BWD}}
        s2 = score * LOG2E
    else:
        s2 = qk * (sm_scale * LOG2E)
    if APPLY_MASK:
        mask = kv_idx >= 0  # {{MASK_MOD}}
    else:
        mask = kv_idx >= 0
    if not EVEN_M:
        mask = mask & (q_idx < L)
    if not EVEN_N:
        mask = mask & (kv_idx < S)
    if NEED_KEEP:
        s2 = tl.where(mask, s2, float("-inf"))
    p = tl.math.exp2(s2 - lse2)
    ds = p * (dp - delta)
    if ACC_GRADS:
        pass  # {{GRAD_ATOMICS}}
    if HAS_SCORE_MOD:
        ds = ds * dscore
        if NEED_KEEP:
            ds = tl.where(mask, ds, 0.0)
    return p, ds


@triton.jit
def _key_tile(K, V, offs_n, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, S,
              E: tl.constexpr, EV: tl.constexpr, E_PAD: tl.constexpr, EV_PAD: tl.constexpr,
              EVEN_N: tl.constexpr):
    """k (rows, E_PAD) and v (rows, EV_PAD) of key rows ``offs_n``, zero past S and the head
    dims: held by the dK/dV role, streamed by the dQ role."""
    k_ptrs = K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    k = _load_tile(k_ptrs, offs_n, offs_d, S, E, EVEN_N, E == E_PAD)
    v = _load_tile(v_ptrs, offs_n, offs_dv, S, EV, EVEN_N, EV == EV_PAD)
    return k, v


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q, DO, QD, DOD, q_row0, LSE2, DELTA, stride_qm, stride_qd,
               stride_dom, stride_dod, idx_ptr, stride_idx, n_listed, off_b, off_h, offs_n, L, S,
               sm_scale,
               # {{CAPTURE_PARAMS}}
               # {{GRAD_PARAMS}}
               E: tl.constexpr, EV: tl.constexpr, E_PAD: tl.constexpr, EV_PAD: tl.constexpr,
               BLOCK_M: tl.constexpr, SPARSE_Q: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr,
               APPLY_MASK: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
               HAS_SCORE_MOD: tl.constexpr, ACC_GRADS: tl.constexpr,
               DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr, NUM_STAGES: tl.constexpr,
               USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr):
    """Accumulate dK, dV of one key tile over the query tiles of one block list (transposed tiles).
    USE_TMA: q and dO tiles through the descriptors QD/DOD at row ``q_row0 + start_m``."""
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
        dk = _dot(ds_t.to(q.dtype), q, dk, DOT_PRECISION)
    return dk, dv


@triton.jit
def _dq_loop(dq, q, do, lse2, delta, K, V, KD, VD, kv_row0, stride_kn, stride_kd, stride_vn, stride_vd,
             idx_ptr, stride_idx, n_listed, off_b, off_h, offs_m, L, S, sm_scale,
             # {{CAPTURE_PARAMS}}
             # {{GRAD_PARAMS}}
             E: tl.constexpr, EV: tl.constexpr, E_PAD: tl.constexpr, EV_PAD: tl.constexpr,
             BLOCK_N: tl.constexpr, SPARSE_KV: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr,
             APPLY_MASK: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
             HAS_SCORE_MOD: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
             NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr):
    """Accumulate dQ of one query tile over the key tiles of one block list (USE_TMA: k and v
    through the descriptors KD/VD at row ``kv_row0 + start_n``)."""
    offs_d = tl.arange(0, E_PAD)
    offs_dv = tl.arange(0, EV_PAD)
    n_iter = _n_tiles(n_listed, SPARSE_KV, BLOCK_N, HAS_BLOCK_MASK)
    for it in tl.range(0, n_iter, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
        start_n = _tile_start(it, idx_ptr, stride_idx, SPARSE_KV, BLOCK_N, HAS_BLOCK_MASK)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if USE_TMA:
            k = KD.load([kv_row0 + start_n, 0])
            v = VD.load([kv_row0 + start_n, 0])
        else:
            k, v = _key_tile(K, V, offs_n, offs_d, offs_dv, stride_kn, stride_kd, stride_vn,
                             stride_vd, S, E, EV, E_PAD, EV_PAD, EVEN_N)
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION)
        dp = _dot(do, tl.trans(v), None, DOT_PRECISION)
        p, ds = _ds_tile(qk, dp, lse2[:, None], delta[:, None], off_b, off_h,
                         offs_m[:, None], offs_n[None, :], L, S, sm_scale,
                         # {{CAPTURE_ARGS}}
                         # {{GRAD_ARGS}}
                         APPLY_MASK, EVEN_M, EVEN_N, HAS_SCORE_MOD, False, 1, FAST_MATH)
        dq = _dot(ds.to(k.dtype), k, dq, DOT_PRECISION)
    return dq


@_jit
def flex_bwd(
    Q, K, V, DO, LSE2, DELTA, DQ, DK, DV,  # dq like q, dk like k, dv like v (B, H*, seq, dim)
    QD, KD, VD, DOD,  # USE_TMA: descriptors of q, k, v, dO as (rows, dim) (contiguous: row
                      # (b·H + h)·len + i), blocks BLOCK_M1 (q, dO) / BLOCK_N2 (k, v); else unread
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX,  # kv lists (Bm, Hm, nQ[, nKV]) for the dQ role
    Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX,  # transposed lists (Bm, Hm, nKV[, nQ]) for the dK/dV role
    stride_kvnb, stride_kvnh, stride_kvnm,  # strides of KV_NUM / FULL_KV_NUM (0 on broadcast dims)
    stride_kvib, stride_kvih, stride_kvim, stride_kvij,
    stride_qnb, stride_qnh, stride_qnn,  # strides of Q_NUM / FULL_Q_NUM
    stride_qib, stride_qih, stride_qin, stride_qij,
    Hq, L, S, G, n_kv_tiles, n_q_tiles, n_dense_q, n_dense_kv,
    sm_scale,
    # {{CAPTURE_PARAMS}}
    # {{GRAD_PARAMS}}
    E: tl.constexpr, EV: tl.constexpr, E_PAD: tl.constexpr, EV_PAD: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    SPARSE_Q: tl.constexpr, SPARSE_KV: tl.constexpr,
    HAS_BLOCK_MASK: tl.constexpr, HAS_PARTIAL: tl.constexpr, HAS_FULL: tl.constexpr,
    HAS_MASK_MOD: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, ACC_GRADS: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FAST_MATH: tl.constexpr, NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    pid = tl.program_id(0)
    off_hkv = tl.program_id(1)
    off_b = tl.program_id(2)
    b64 = off_b.to(tl.int64)
    offs_d = tl.arange(0, E_PAD)
    offs_dv = tl.arange(0, EV_PAD)
    K += b64 * stride_kb + off_hkv.to(tl.int64) * stride_kh
    V += b64 * stride_vb + off_hkv.to(tl.int64) * stride_vh
    if pid < n_kv_tiles:
        # ---- role dK/dV: one key tile, every query head of the group ----
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
            row0 = (b64 * Hq + h64) * L
            if HAS_BLOCK_MASK:
                num_off = off_b * stride_qnb + off_h * stride_qnh + col * stride_qnn
                idx_off = off_b * stride_qib + off_h * stride_qih + col * stride_qin
                if HAS_PARTIAL:
                    dk, dv = _dkdv_loop(
                        dk, dv, k, v, Qh, DOh, QD, DOD, row0.to(tl.int32), LSE2 + row0,
                        DELTA + row0, stride_qm, stride_qd, stride_dom, stride_dod,
                        Q_IDX + idx_off, stride_qij, tl.load(Q_NUM + num_off), off_b, off_h,
                        offs_n, L, S, sm_scale,
                        # {{CAPTURE_ARGS}}
                        # {{GRAD_ARGS}}
                        E, EV, E_PAD, EV_PAD, BLOCK_M1, SPARSE_Q, True, HAS_MASK_MOD,
                        EVEN_M, EVEN_N, HAS_SCORE_MOD, ACC_GRADS, DOT_PRECISION, FAST_MATH,
                        NUM_STAGES, USE_TMA, WARP_SPEC)
                if HAS_FULL:
                    dk, dv = _dkdv_loop(
                        dk, dv, k, v, Qh, DOh, QD, DOD, row0.to(tl.int32), LSE2 + row0,
                        DELTA + row0, stride_qm, stride_qd, stride_dom, stride_dod,
                        FULL_Q_IDX + idx_off, stride_qij, tl.load(FULL_Q_NUM + num_off), off_b,
                        off_h, offs_n, L, S, sm_scale,
                        # {{CAPTURE_ARGS}}
                        # {{GRAD_ARGS}}
                        E, EV, E_PAD, EV_PAD, BLOCK_M1, SPARSE_Q, True, False,
                        EVEN_M, EVEN_N, HAS_SCORE_MOD, ACC_GRADS, DOT_PRECISION, FAST_MATH,
                        NUM_STAGES, USE_TMA, WARP_SPEC)
            else:
                dk, dv = _dkdv_loop(
                    dk, dv, k, v, Qh, DOh, QD, DOD, row0.to(tl.int32), LSE2 + row0,
                    DELTA + row0, stride_qm, stride_qd, stride_dom, stride_dod,
                    Q_IDX, 0, n_dense_q, off_b, off_h, offs_n, L, S, sm_scale,
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
    else:
        # ---- role dQ: one query tile of one query head ----
        pid2 = pid - n_kv_tiles
        off_h = off_hkv * G + pid2 // n_q_tiles
        pid_m = n_q_tiles - 1 - pid2 % n_q_tiles  # longest-first, as in the forward
        h64 = off_h.to(tl.int64)
        offs_m = pid_m * BLOCK_M2 + tl.arange(0, BLOCK_M2)
        q_ptrs = Q + b64 * stride_qb + h64 * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
        do_ptrs = (DO + b64 * stride_dob + h64 * stride_doh
                   + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod)
        row0 = (b64 * Hq + h64) * L
        q = _load_tile(q_ptrs, offs_m, offs_d, L, E, EVEN_M, E == E_PAD)
        do = _load_tile(do_ptrs, offs_m, offs_dv, L, EV, EVEN_M, EV == EV_PAD)
        lse2 = _load_rows(LSE2 + row0, offs_m, L, EVEN_M)
        delta = _load_rows(DELTA + row0, offs_m, L, EVEN_M)
        dq = tl.full([BLOCK_M2, E_PAD], 0.0, tl.float32)
        kv_row0 = (off_b * (Hq // G) + off_hkv) * S  # K/V's first row in the descriptors' view
        if HAS_BLOCK_MASK:
            row = (pid_m * BLOCK_M2) // SPARSE_Q
            num_off = off_b * stride_kvnb + off_h * stride_kvnh + row * stride_kvnm
            idx_off = off_b * stride_kvib + off_h * stride_kvih + row * stride_kvim
            if HAS_PARTIAL:
                dq = _dq_loop(
                    dq, q, do, lse2, delta, K, V, KD, VD, kv_row0, stride_kn, stride_kd, stride_vn, stride_vd,
                    KV_IDX + idx_off, stride_kvij, tl.load(KV_NUM + num_off), off_b, off_h,
                    offs_m, L, S, sm_scale,
                    # {{CAPTURE_ARGS}}
                    # {{GRAD_ARGS}}
                    E, EV, E_PAD, EV_PAD, BLOCK_N2, SPARSE_KV, True, HAS_MASK_MOD, EVEN_M,
                    EVEN_N, HAS_SCORE_MOD, DOT_PRECISION, FAST_MATH, NUM_STAGES, USE_TMA, WARP_SPEC)
            if HAS_FULL:
                dq = _dq_loop(
                    dq, q, do, lse2, delta, K, V, KD, VD, kv_row0, stride_kn, stride_kd, stride_vn, stride_vd,
                    FULL_KV_IDX + idx_off, stride_kvij, tl.load(FULL_KV_NUM + num_off), off_b,
                    off_h, offs_m, L, S, sm_scale,
                    # {{CAPTURE_ARGS}}
                    # {{GRAD_ARGS}}
                    E, EV, E_PAD, EV_PAD, BLOCK_N2, SPARSE_KV, True, False, EVEN_M,
                    EVEN_N, HAS_SCORE_MOD, DOT_PRECISION, FAST_MATH, NUM_STAGES, USE_TMA, WARP_SPEC)
        else:
            dq = _dq_loop(
                dq, q, do, lse2, delta, K, V, KD, VD, kv_row0, stride_kn, stride_kd, stride_vn, stride_vd,
                KV_IDX, 0, n_dense_kv, off_b, off_h, offs_m, L, S, sm_scale,
                # {{CAPTURE_ARGS}}
                # {{GRAD_ARGS}}
                E, EV, E_PAD, EV_PAD, BLOCK_N2, BLOCK_N2, False, False, EVEN_M,
                EVEN_N, HAS_SCORE_MOD, DOT_PRECISION, FAST_MATH, NUM_STAGES, USE_TMA, WARP_SPEC)
        dq = dq * sm_scale
        dq_ptrs = (DQ + b64 * stride_dqb + h64 * stride_dqh
                   + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd)
        _store_tile(dq_ptrs, dq, offs_m, offs_d, L, E, EVEN_M, E == E_PAD)
