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


def dense_attention(q, k, v, score_mod=None, mask_mod=None, scale=None, dtype=torch.float64):
    """out (B,Hq,L,Ev) and lse (B,Hq,L), computed in ``dtype`` with eager mods.

    GQA: query head h reads kv head h // (Hq // Hkv). A fully masked row gives 0 and -inf.
    Differentiable (autograd) in q, k, v and any captured tensor the mods use.
    """
    s = dense_scores(q, k, score_mod, mask_mod, scale, dtype)
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


def dense_scores(q, k, score_mod=None, mask_mod=None, scale=None, dtype=torch.float64):
    """The modded scores (B,Hq,L,S) in ``dtype``, -inf where the mask_mod is false: their row max
    is torch's ``max_scores``."""
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    kk = k.to(dtype).repeat_interleave(Hq // Hkv, dim=1)
    s = torch.matmul(q.to(dtype), kk.transpose(-1, -2)) * scale
    dev = q.device
    b = torch.arange(B, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(Hq, device=dev).view(1, -1, 1, 1)
    qi = torch.arange(L, device=dev).view(1, 1, -1, 1)
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


def assert_close_to_oracle(name, got, ref64, ref_lowp, floor):
    """err(got) <= 2 * err(same math in the test dtype) + floor, and no NaN."""
    assert not torch.isnan(got).any(), f"{name}: NaN in result"
    err = max_err(got, ref64)
    bound = 2 * max_err(ref_lowp, ref64) + floor
    assert err <= bound, f"{name}: error {err:.3g} exceeds bound {bound:.3g}"
    return err


FLOOR = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
