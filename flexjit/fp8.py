"""Helpers for FP8 attention inputs that users call before quantising.

``hadamard_rotate(x)``: x times a normalised Hadamard matrix along the head dimension,
FlashAttention-3's incoherent processing (Shah et al. 2024, §3.3). An orthogonal R leaves every
score unchanged, (q R)·(k R) = q·k, so rotating q and k by the same R gives the same attention;
but R spreads a channel that is far larger than the rest (the outlier channels of LLM queries
and keys) over every channel, so the per-(batch, head) scale that e4m3 needs no longer follows
a few channels and each score's rounding error shrinks. Rotate before quantising:

    qr, kr = hadamard_rotate(q), hadamard_rotate(k)      # the same R for both
    # quantise qr, kr (and v, unrotated) to float8_e4m3fn with their descales, then
    out = flexjit.flex_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)

Only q and k: rotating v changes the output (out R), which the caller would have to rotate back.
"""
from __future__ import annotations

import math

import torch


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (diag(signs) · H / sqrt(D))`` along the last dimension D, a power of two; H is
    Sylvester's Hadamard matrix (entries ±1, H Hᵀ = D·I), so the rotation is orthogonal and
    the scores q·k of two tensors rotated alike are unchanged (up to float32 rounding).

    ``signs``: an optional (D,) tensor of ±1 applied to the channels first (a randomised
    Hadamard transform, for data whose outliers line up with H's pattern); pass the same
    ``signs`` for q and k. The result is float32 (float64 for float64 input), never rounded
    to x's dtype: the quantisation that follows is then the only rounding. A fast
    Walsh–Hadamard transform, log2(D) passes of adds and subtracts (no matmul: no TF32).
    """
    D = x.shape[-1]
    if D < 1 or D & (D - 1):
        raise ValueError(f"hadamard_rotate needs a power-of-two last dimension, got {D}; pad the "
                         f"head dimension of q and k alike with zeros to {1 << max(0, D - 1).bit_length()} "
                         f"first (zero channels leave q·k unchanged)")
    y = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    if signs is not None:
        if tuple(signs.shape) != (D,) or not bool(((signs == 1) | (signs == -1)).all()):
            raise ValueError(f"signs must be a ({D},) tensor of +1 and -1")
        y = y * signs.to(device=y.device, dtype=y.dtype)
    lead = y.shape[:-1]
    h = 1
    while h < D:  # butterflies between channel pairs h apart: (a, b) -> (a + b, a - b)
        pairs = y.reshape(*lead, D // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, D)
        h *= 2
    return y * (1.0 / math.sqrt(D))
