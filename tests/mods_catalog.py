"""The core test list of mods, shared by every backend's tests.

Each entry builds (score_mod, mask_mod, learnable tensors) for a shape, with
fresh random captured tensors. The mods are plain Python, written as a user
would; the oracle calls them eagerly and flexjit traces them.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from flexjit.planner.block_mask import and_masks, or_masks
from flexjit import mods


@dataclasses.dataclass
class Case:
    score_mod: Callable | None
    mask_mod: Callable | None
    learnable: tuple = ()  # captured tensors that require grad


def _doc_ids(S, device, lo=8, hi=80):
    lengths = []
    while sum(lengths) < S:
        lengths.append(int(torch.randint(lo, hi, ()).item()))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:S]
    return ids.to(device)


def _natten(L, S):
    # 2-D neighbourhood attention over an image of W columns: tokens are pixels in
    # row-major order; each pixel sees a (2r+1)x(2r+1) window clamped at the borders.
    W, r = 8, 2
    Hgt_q, Hgt_kv = -(-L // W), -(-S // W)

    def natten_mask(b, h, q_idx, kv_idx):
        qr, qc = q_idx // W, q_idx % W
        kr, kc = kv_idx // W, kv_idx % W
        cr = torch.clamp(qr, r, Hgt_kv - 1 - r)
        cc = torch.clamp(qc, r, W - 1 - r)
        return (torch.abs(kr - cr) <= r) & (torch.abs(kc - cc) <= r)
    return natten_mask


def _make(name: str, B: int, H: int, L: int, S: int, device, dt) -> Case:
    if name == "full":
        return Case(None, None)
    if name == "causal":
        return Case(None, mods.causal())
    if name == "sliding_window":
        return Case(None, mods.sliding_window(max(8, S // 5)))
    if name == "prefix_lm":
        return Case(None, mods.prefix_lm(S // 3))
    if name == "prefix_lm_per_batch":
        return Case(None, mods.prefix_lm(torch.randint(1, S, (B,), device=device)))
    if name == "document":
        return Case(None, mods.document(_doc_ids(max(L, S), device)))
    if name == "alibi":
        return Case(mods.alibi(mods.alibi_slopes(H).to(device, dt)), mods.causal())
    if name == "softcap":
        return Case(mods.softcap(0.5 + 20 * torch.rand(()).item()), mods.causal())
    if name == "relative_bias":
        return Case(mods.relative_bias(torch.randn(H, 2 * 16 + 1, device=device).to(dt)), None)
    if name == "t5_bias":
        # max_distance=100 keeps bucket boundaries off exact float ties (log ratios of powers of 2)
        return Case(mods.t5_bias(torch.randn(H, 32, device=device).to(dt), max_distance=100), None)
    if name == "head_dependent":
        def head_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= 8 + 16 * h)
        return Case(None, head_window)
    if name == "batch_dependent":
        lengths = torch.randint(1, S + 1, (B,), device=device)

        def padding_mask(b, h, q_idx, kv_idx):
            return kv_idx < lengths[b]
        return Case(None, padding_mask)
    if name == "causal_or_global":
        def global_tokens(b, h, q_idx, kv_idx):
            return kv_idx < 4
        return Case(None, or_masks(mods.causal(), global_tokens))
    if name == "dilated_window":
        def dilated(b, h, q_idx, kv_idx):
            d = q_idx - kv_idx
            return (d >= 0) & (d <= 64) & (d % 3 == 0)
        return Case(None, dilated)
    if name == "natten_2d":
        return Case(None, _natten(L, S))
    if name == "learnable_bias":
        table = torch.randn(H, 2 * 16 + 1, device=device).mul_(0.5).to(dt).requires_grad_(True)
        return Case(mods.relative_bias(table), mods.causal(), (table,))
    if name == "learnable_alibi":
        slopes = torch.rand(H, device=device).to(dt).requires_grad_(True)
        return Case(mods.alibi(slopes), mods.causal(), (slopes,))
    if name == "softcap_alibi_window":
        slopes = mods.alibi_slopes(H).to(device, dt)

        def softcap_alibi(score, b, h, q_idx, kv_idx):
            s = 20.0 * torch.tanh(score / 20.0)
            return s + slopes[h] * (kv_idx - q_idx)
        return Case(softcap_alibi, and_masks(mods.causal(), mods.sliding_window(S // 4)))
    raise KeyError(name)


CORE = ["full", "causal", "sliding_window", "prefix_lm", "prefix_lm_per_batch", "document", "alibi",
        "softcap", "relative_bias", "t5_bias", "head_dependent", "batch_dependent", "causal_or_global",
        "dilated_window", "natten_2d", "learnable_bias", "learnable_alibi", "softcap_alibi_window"]


def make_case(name: str, B: int, H: int, L: int, S: int, device="cpu", dtype=torch.float32) -> Case:
    """``dtype``: of captured floating tensors (float64 for a float64 end-to-end test, where
    eager torch would otherwise round a float32 bias product before adding it). Random
    captured values are drawn in float32 and then converted, so one seed gives the same values
    in every dtype."""
    return _make(name, B, H, L, S, device, dtype)


def case_and_oracle(name: str, B: int, H: int, L: int, S: int, device="cpu", seed=0):
    """(case, its twin with float64 captured tensors, same values) for the float64 oracle:
    autograd sums a captured float32 tensor's gradient in float32 (one scatter-add over every
    score), an error as large as the kernel's, so the oracle differentiates the twin."""
    torch.manual_seed(seed)
    case = make_case(name, B, H, L, S, device)
    torch.manual_seed(seed)
    return case, make_case(name, B, H, L, S, device, torch.float64)


def lowered(score_mod, mask_mod):
    """The Program of these mods as ``flex_attention`` builds it for lengths below
    ``FLOAT_INDEX_LIMIT`` (lowered, then float indices), for tests that drive a backend or a
    template directly."""
    from flexjit.ir.passes import lower
    from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, trace_mod
    return lower(trace_mod(score_mod, SCORE_MOD) if score_mod else None,
                 trace_mod(mask_mod, MASK_MOD) if mask_mod else None, float_index=True)


# The pointwise ops, each in a score_mod on bounded arguments (asin/acos read tanh's
# (-1, 1)); the float64 oracle evaluates the same mods eagerly with torch (integer terms are cast
# to the score's dtype, so that it stays float64).
POINTWISE = {
    "tan": lambda s, b, h, q, kv: s + torch.tan(torch.tanh(s)),
    "atan": lambda s, b, h, q, kv: torch.atan(s) * 2.0,
    "sinh_cosh": lambda s, b, h, q, kv: torch.sinh(s * 0.5) + torch.cosh(s * 0.25),
    "asin_acos": lambda s, b, h, q, kv: torch.asin(torch.tanh(s)) + torch.acos(torch.tanh(s * 0.5)),
    "log1p_expm1": lambda s, b, h, q, kv: torch.log1p(torch.abs(s)) + torch.expm1(s * 0.25),
    "erf": lambda s, b, h, q, kv: s + torch.erf(s),
    "round_trunc_sign": lambda s, b, h, q, kv: s + torch.round(s) * 0.5 + torch.trunc(s * 2) * 0.25 + torch.sign(s),
    "fmod": lambda s, b, h, q, kv: s + torch.fmod(s * 3.0, 1.5) + torch.fmod(q - kv, 5).to(s.dtype) * 0.1,
    "silu": lambda s, b, h, q, kv: torch.nn.functional.silu(s) + torch.sigmoid(s) * s,
    "pow_float": lambda s, b, h, q, kv: torch.pow(torch.abs(s) + 1.0, 1.5),
    "logical_ints": lambda s, b, h, q, kv: s + torch.logical_and(q % 3, kv % 2).to(s.dtype)
    + torch.logical_not(q % 4).to(s.dtype) + torch.logical_xor(q % 2, kv % 3).to(s.dtype),
    # amounts past the width and negative ones (torch: 0, or -1 for a negative >>); << by up to
    # 39 leaves int32 (so it runs in int64, as torch's int64 indices do)
    "shifts": lambda s, b, h, q, kv: s + ((q - kv) >> (kv % 5 - 1)).to(s.dtype) * 0.1
    + ((kv << (q % 40)) % 7).to(s.dtype) * 0.05 + ((q - 30) >> 40).to(s.dtype),
}


def past_int32():
    """(score_mod, mask_mod) whose index math leaves int32 at 64 or more positions:
    q_idx * 50000000, kv_idx * 100000000, and a captured int32 offset near the top of int32 plus
    kv_idx; torch's eager mods (int64 indices) compute them exactly, int32 would wrap."""
    offset = torch.tensor([2 ** 31 - 20, 3], dtype=torch.int32)

    def big_bias(score, b, h, q_idx, kv_idx):
        return score + ((q_idx * 50000000 - kv_idx * 70000000) % 1000).float() * 0.001

    def big_mask(b, h, q_idx, kv_idx):
        return ((kv_idx * 100000000) > q_idx) & (offset[b] + kv_idx >= 0)
    return big_bias, big_mask
