"""FP8 inputs of flex_attention: their validation and the ``Fp8`` part of a call.

``flex_attention(q, k, v, ..., q_descale=, k_descale=, v_descale=, out_dtype=)`` takes
float8_e4m3fn q, k and v (or a 16/32-bit query with FP8 key and value: an FP8 KV cache) with
FlashAttention-3's descales. ``check`` says what is wrong with a combination, ``fp8_of`` builds a
validated call's ``Fp8`` (also on a call_cache hit, whose signature holds ``signature``). The
meaning is ``backends/fp8.py``'s; docs/DESIGN.md, "FP8 inputs".
"""
from __future__ import annotations

import torch

from flexjit.backends.fp8 import E4M3, OUT_DTYPES, Fp8, is_fp8

_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # a query beside FP8 key/value


def given(q_descale, k_descale, v_descale, out_dtype) -> bool:
    return not (q_descale is None and k_descale is None and v_descale is None and out_dtype is None)


def involved(q, k, v, q_descale=None, k_descale=None, v_descale=None, out_dtype=None) -> bool:
    """Whether the call is one for this module: an FP8 tensor, a descale or out_dtype."""
    return any(isinstance(t, torch.Tensor) and is_fp8(t) for t in (q, k, v)) or \
        given(q_descale, k_descale, v_descale, out_dtype)


def check(q, k, v, q_descale, k_descale, v_descale, out_dtype) -> None:
    """Raise ``ValueError`` (``TypeError`` for a descale that is not a tensor) for a combination
    flex_attention does not serve, saying what to pass instead. q, k, v are 4-D tensors."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if is_fp8(t) and t.dtype != E4M3:
            raise ValueError(f"{name} is {t.dtype}; flex_attention serves FP8 as torch.float8_e4m3fn "
                             f"only: quantise to it (x / descale).to(torch.float8_e4m3fn), or pass "
                             f"bfloat16")
    if is_fp8(k) != is_fp8(v):
        raise ValueError(f"key is {k.dtype} and value is {v.dtype}; FP8 key and value go together: "
                         "quantise both to torch.float8_e4m3fn, or neither")
    if is_fp8(q) and not is_fp8(k):
        raise ValueError(f"query is {q.dtype} but key and value are {k.dtype}; an FP8 query needs "
                         "FP8 key and value (torch.float8_e4m3fn); or pass the query in "
                         f"{k.dtype} (dequantised: q.float() * q_descale)")
    if is_fp8(k) and not is_fp8(q) and q.dtype not in _QUERY_DTYPES:
        raise ValueError(f"query is {q.dtype}; beside FP8 key and value it must be float8_e4m3fn, "
                         "bfloat16, float16 or float32")
    B, Hkv = q.shape[0], k.shape[1]
    for name, d, t in (("q_descale", q_descale, q), ("k_descale", k_descale, k),
                       ("v_descale", v_descale, v)):
        if d is None:
            continue
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{name} must be a float32 tensor of shape () or (B, H_kv) = "
                            f"{(B, Hkv)}, got {type(d).__name__}; wrap a number as "
                            f"torch.tensor(x, dtype=torch.float32, device=...)")
        if not is_fp8(t):
            raise ValueError(f"{name} was given but {name[0]} is {t.dtype}, not FP8: a descale "
                             f"applies to a float8_e4m3fn tensor only; drop it, or multiply it in "
                             f"before the call")
        if d.dtype != torch.float32:
            raise ValueError(f"{name} is {d.dtype}; descales are float32 (pass "
                             f"{name}.to(torch.float32))")
        if tuple(d.shape) not in ((), (B, Hkv)):
            raise ValueError(f"{name} has shape {tuple(d.shape)}; a descale is one factor, shape (), "
                             f"or one per (batch, kv head), shape (B, H_kv) = {(B, Hkv)} (the "
                             f"query's too: each query head uses its kv head's factor)")
        if d.device != q.device:
            raise ValueError(f"{name} is on {d.device} but the inputs are on {q.device}; pass "
                             f"{name}.to({str(q.device)!r})")
        if d.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad, but flex_attention computes no gradient for "
                             f"descales; pass {name}.detach()")
    fp8 = is_fp8(k)
    if out_dtype is not None:
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, "
                             f"got {out_dtype}")
        if not fp8 and out_dtype != q.dtype:
            raise ValueError(f"out_dtype={out_dtype} applies to FP8 inputs; with {q.dtype} inputs "
                             f"the output is {q.dtype}: drop out_dtype or cast the output")


def fp8_of(q, k, q_descale, k_descale, v_descale, out_dtype) -> Fp8 | None:
    """The ``Fp8`` of a checked call, or None when key and value are not FP8. The output dtype
    defaults to bfloat16 for an FP8 query and to the query's dtype beside an FP8 KV cache."""
    if not is_fp8(k):
        return None
    q_fp8 = is_fp8(q)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if q_fp8 else q.dtype
    return Fp8(q_descale, k_descale, v_descale, out_dtype, q_fp8)


def signature(q_descale, k_descale, v_descale, out_dtype) -> tuple | None:
    """What a call_cache entry depends on in these arguments (what ``check`` reads); None where
    a descale is not a tensor (not cacheable: ``check`` refuses it)."""
    if any(d is not None and not isinstance(d, torch.Tensor) for d in (q_descale, k_descale, v_descale)):
        return None
    return tuple(None if d is None else (type(d), d.shape, d.dtype, d.device, d.requires_grad)
                 for d in (q_descale, k_descale, v_descale)) + (out_dtype,)
