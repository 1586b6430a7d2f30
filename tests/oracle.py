"""The tests' independent oracle: dense attention in float64, mods called eagerly.

Nothing here goes through flexjit: the user's mods run as ordinary torch code on
broadcast index tensors (b (B,1,1,1), h (1,H,1,1), q_idx (1,1,L,1), kv_idx
(1,1,1,S)), exactly as a user would evaluate them by hand.

Tolerances come from the data (STYLE.md): the error of the implementation under
test against the float64 oracle must be at most twice the error of the same math
done in the test dtype with plain torch, plus a small floor.
"""
from __future__ import annotations

import math

import torch


# Score elements one oracle step holds at most where no gradient is taken (rows are independent):
# 2^26 float64 scores are 512 MiB, so large cases stay within a GPU shared by parallel workers.
CHUNK_SCORES = 1 << 26


def dense_attention(q, k, v, score_mod=None, mask_mod=None, scale=None, dtype=torch.float64):
    """out (B,Hq,L,Ev) and lse (B,Hq,L), computed in ``dtype`` with eager mods.

    GQA: query head h reads kv head h // (Hq // Hkv). A fully masked row gives 0 and -inf.
    Differentiable (autograd) in q, k, v and any captured tensor the mods use. Without a
    gradient to take, query rows go CHUNK_SCORES scores at a time (the same values: each row's
    softmax is its own).
    """
    B, Hq, L = q.shape[:3]
    rows = max(1, CHUNK_SCORES // (B * Hq * k.shape[2]))
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if L > rows and not grads:
        parts = [_dense_rows(q[:, :, r:r + rows], k, v, score_mod, mask_mod, scale, dtype, r)
                 for r in range(0, L, rows)]
        return torch.cat([o for o, _ in parts], dim=2), torch.cat([m for _, m in parts], dim=2)
    return _dense_rows(q, k, v, score_mod, mask_mod, scale, dtype, 0)


def _dense_rows(q, k, v, score_mod, mask_mod, scale, dtype, q_offset: int):
    s = dense_scores(q, k, score_mod, mask_mod, scale, dtype, q_offset)
    vv = v.to(dtype).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    empty = den == 0
    p = e / torch.where(empty, torch.ones_like(den), den)
    out = torch.matmul(p, vv)
    lse = torch.where(empty, torch.full_like(den, -math.inf),
                      torch.log(torch.where(empty, torch.ones_like(den), den)) + m).squeeze(-1)
    return out, lse


def dense_scores(q, k, score_mod=None, mask_mod=None, scale=None, dtype=torch.float64,
                 q_offset: int = 0):
    """The modded scores (B,Hq,L,S) in ``dtype``, -inf where the mask_mod is false: their row max
    is torch's ``max_scores``. ``q`` holds the query rows from ``q_offset`` on."""
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    kk = k.to(dtype).repeat_interleave(Hq // Hkv, dim=1)
    s = torch.matmul(q.to(dtype), kk.transpose(-1, -2)) * scale
    dev = q.device
    b = torch.arange(B, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(Hq, device=dev).view(1, -1, 1, 1)
    qi = torch.arange(q_offset, q_offset + L, device=dev).view(1, 1, -1, 1)
    ki = torch.arange(S, device=dev).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki).to(dtype).expand(B, Hq, L, S)
    if mask_mod is not None:
        keep = torch.as_tensor(mask_mod(b, h, qi, ki), device=dev).expand(B, Hq, L, S)
        s = torch.where(keep, s, torch.tensor(float("-inf"), dtype=dtype, device=dev))
    return s


def random_qkv(B, Hq, Hkv, L, S, E, Ev, dtype, seed):
    """Fresh random q (B,Hq,L,E), k (B,Hkv,S,E), v (B,Hkv,S,Ev) that require grad (CPU)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, E, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(B, Hkv, S, E, generator=g).to(dtype).requires_grad_(True)
    v = torch.randn(B, Hkv, S, Ev, generator=g).to(dtype).requires_grad_(True)
    return q, k, v


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference, treating matching infinities (e.g. lse = -inf) as equal."""
    a, b = a.double(), b.double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    d = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
    if torch.isnan(d).any():
        return math.inf
    return d.max().item() if d.numel() else 0.0


def half_ulp(t: torch.Tensor, dtype: torch.dtype) -> float:
    """Half a unit in the last place of ``dtype`` at ``t``'s largest finite magnitude: the error
    of storing the exact result in ``dtype``, below which no kernel can go."""
    finite = t[torch.isfinite(t)].abs()
    if not finite.numel() or not dtype.is_floating_point:
        return 0.0
    peak = finite.max().item()
    return 0.0 if peak == 0 else 0.5 * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(peak))


def assert_close_to_oracle(name, got, ref64, ref_lowp, floor):
    """err(got) <= 2 * err(same math in the test dtype) + floor, and no NaN. The same math's
    error counts as at least half an ulp of the result's dtype: where it rounds exactly by luck
    (a few elements, a large LSE in float32), the bound would otherwise ask for more than the
    format holds. ``ref_lowp`` may be a list of that math in several summation orders: its
    error is then the largest of theirs (no order is more correct than another)."""
    assert not torch.isnan(got).any(), f"{name}: NaN in result"
    err = max_err(got, ref64)
    lows = ref_lowp if isinstance(ref_lowp, (list, tuple)) else [ref_lowp]
    bound = 2 * max(*(max_err(low, ref64) for low in lows), half_ulp(ref64, got.dtype)) + floor
    assert err <= bound, f"{name}: error {err:.3g} exceeds bound {bound:.3g}"
    return err


FLOOR = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


# --------------------------------------------------------------------------- FP8 inputs

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_e4m3(x, groups: int | None = 1):
    """(x stored as float8_e4m3fn, its float32 descale): x ≈ stored.float() * descale, the scale
    mapping the largest magnitude to E4M3_MAX. ``groups``: heads sharing one factor (a query's
    heads share their kv head's: the GQA ratio), giving a (B, H // groups) descale; None: one
    factor for the whole tensor, shape ()."""
    if groups is None:
        descale = (x.abs().amax() / E4M3_MAX).float()
        return (x / descale.double()).to(torch.float8_e4m3fn), descale
    B, H, L, E = x.shape
    descale = (x.reshape(B, H // groups, groups * L * E).abs().amax(-1) / E4M3_MAX).float()
    d = descale.double().repeat_interleave(groups, 1)[:, :, None, None]
    return (x / d).to(torch.float8_e4m3fn), descale


def dequantize_e4m3(x8, descale, dtype=torch.float64, groups: int = 1):
    """The real values of ``x8``: stored × descale in ``dtype`` (a (B, Hkv) descale shared by
    ``groups`` heads of ``x8``)."""
    d = descale.to(dtype)
    if d.dim():
        d = d.repeat_interleave(groups, 1)[:, :, None, None]
    return x8.to(dtype) * d


def fp8_reference(q8, k8, v8, descales, score_mod=None, mask_mod=None, out_dtype=torch.bfloat16,
                  p_dtype=None):
    """The plain FP8 reference: dequantise in float32, attend in float32, round out to
    ``out_dtype`` (lse stays float32). ``descales``: (q, k, v), None for 1.0 or a 16-bit q.
    ``p_dtype``: round the softmax's unnormalised probabilities to it before P·V, as a kernel
    feeding them to a tensor-core MMA does (the same math as such a kernel, for its baseline)."""
    g = q8.shape[1] // k8.shape[1]
    one = torch.ones((), dtype=torch.float32)
    q, k, v = [t.float() if d is None and t.dtype != torch.float8_e4m3fn else
               dequantize_e4m3(t, one if d is None else d, torch.float32, gr)
               for t, d, gr in zip((q8, k8, v8), descales, (g, 1, 1))]
    if p_dtype is None:
        out, lse = dense_attention(q, k, v, score_mod, mask_mod, dtype=torch.float32)
        return out.to(out_dtype), lse
    s = dense_scores(q, k, score_mod, mask_mod, dtype=torch.float32)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    empty = den == 0
    den1 = torch.where(empty, torch.ones_like(den), den)
    out = torch.matmul(e.to(p_dtype).float(), v.repeat_interleave(g, dim=1)) / den1
    lse = torch.where(empty, torch.full_like(den, -math.inf), torch.log(den1) + m).squeeze(-1)
    return out.to(out_dtype), lse


def assert_fp8_accuracy(name, got, true64, plain):
    """FP8 accuracy: against the float64 attention of the unquantised data, ``got``'s error is
    at most 1.1 × that of the plain FP8 reference (``fp8_reference``); no NaN."""
    assert not torch.isnan(got).any(), f"{name}: NaN in result"
    err, base = max_err(got, true64), max_err(plain, true64)
    assert err <= 1.1 * base, f"{name}: error {err:.3g} > 1.1 × the plain FP8 reference's {base:.3g}"
    return err
