"""FP8 inputs: what a descale means, shared by every backend and the dispatcher.

A call with float8_e4m3fn inputs carries an :class:`Fp8` beside its tensors: the descales
(FlashAttention-3's convention, real value = stored value × descale) and the output dtype. A
descale is a float32 tensor of shape () or (B, Hkv) on the inputs' device, or None for 1.0; the
query's is per kv head too, each query head using the factor of the kv head it reads.

* ``dequantize``: a stored tensor as the real values it stands for, in any float dtype (the
  reference computes on them in float32; a backend with no FP8 kernel runs on them in the output
  dtype, ``runtime.dispatch``'s road around it).
* ``compute_dtype``: the dtype a kernel that reads FP8 itself converts its tiles to.
* ``descale_table``: the three factors of every (batch, kv head) as one small tensor, the form the
  sm90 FP8 forward reads (a copy per call, negligible beside a prefill; the decode kernel reads
  the descales in place instead).
"""
from __future__ import annotations

import dataclasses

import torch

E4M3 = torch.float8_e4m3fn
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                              "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n))
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Fp8:
    """The FP8 part of a call: descales (float32, () or (B, Hkv), None for 1.0; None as well for a
    tensor that is not FP8) and the output dtype."""
    q_descale: torch.Tensor | None
    k_descale: torch.Tensor | None
    v_descale: torch.Tensor | None
    out_dtype: torch.dtype
    q_fp8: bool  # whether q is FP8 too (else only k and v: an FP8 KV cache)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """What a kernel reading FP8 itself converts q, k and v to before its dots (e4m3 converts to
    each exactly): float16 for an FP8 or 16-bit query (one conversion instruction a pair of e4m3
    values, where bfloat16 takes three; P rounds to 11 bits, against bfloat16's 8; a bfloat16
    query is scaled by a power of two per row into float16's range first), float32 for float32."""
    return torch.float32 if q.dtype == torch.float32 else torch.float16


def _per_head(descale: torch.Tensor, t: torch.Tensor, group: int) -> torch.Tensor:
    """``descale`` broadcastable over ``t`` (B, H, len, dim): (B, H, 1, 1), or () as it is.
    ``group``: query heads per kv head (the query's factor is its kv head's)."""
    if descale.dim() == 0:
        return descale
    if group > 1:
        descale = descale.repeat_interleave(group, dim=1)
    return descale[:, :, None, None]


def dequantize(t: torch.Tensor, descale: torch.Tensor | None, dtype: torch.dtype,
               group: int = 1) -> torch.Tensor:
    """The real values of stored ``t`` (B, H, len, dim) in ``dtype``: ``t.float() * descale``,
    rounded once to ``dtype``; a contiguous new tensor (an expanded input is materialised)."""
    real = t.to(torch.float32)
    if descale is not None:
        real = real * _per_head(descale, t, group)
    return real.to(dtype).contiguous()


def dequantize_inputs(q, k, v, f: Fp8, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v of a call with FP8 part ``f`` as real values in ``dtype`` (a 16/32-bit query is
    only cast); differentiable torch ops, so they also trace into a compiled graph."""
    group = q.shape[1] // k.shape[1]
    q = dequantize(q, f.q_descale, dtype, group) if f.q_fp8 else q.to(dtype)
    return q, dequantize(k, f.k_descale, dtype), dequantize(v, f.v_descale, dtype)


def descale_table(call) -> torch.Tensor:
    """(B, Hkv, 3) float32, contiguous: the (q, k, v) descales of every (batch, kv head), 1.0
    where none was given; one small copy."""
    f = call.fp8
    B, Hkv = call.q.shape[0], call.k.shape[1]
    dev = call.q.device
    one = torch.ones((), dtype=torch.float32, device=dev)
    parts = [one if d is None else d for d in (f.q_descale, f.k_descale, f.v_descale)]
    return torch.stack([p.expand(B, Hkv) for p in parts], dim=-1)
