"""flex_attention: torch's signature and semantics, our compiler underneath.

The call path is: validate the inputs -> trace the mods and lower them to a
:class:`~flexjit.passes.Program` -> pick a backend (``dispatch``) -> run it.
Every bad input raises here with a message that says how to fix it; nothing
reaches a kernel that could give a silently wrong answer. A repeated eager call
with the same signature skips the middle steps (``call_cache``: the signature,
the guards and what is not cached).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from flexjit import config
from flexjit.runtime import call_cache, dispatch, options, selfcheck
from flexjit.api import compiled, fp8 as fp8_inputs
from flexjit.backends.fp8 import FP8_DTYPES, is_fp8
from flexjit.planner.block_mask import BlockMask, from_torch_block_mask, noop_mask, with_int32_lists
from flexjit.ir.passes import FLOAT_INDEX_LIMIT, lower
from flexjit.ir.program import Program
from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, check_arity, trace_mod
from flexjit.ir.nodes import Op, uses
from flexjit.runtime.call import Call

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class AuxRequest(NamedTuple):
    """Which auxiliary outputs to return (torch's AuxRequest)."""
    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """Auxiliary outputs; a field is None unless requested."""
    lse: torch.Tensor | None = None
    max_scores: torch.Tensor | None = None


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Callable | None = None, block_mask: BlockMask | None = None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: dict | None = None, *, return_aux: AuxRequest | None = None,
                   backend: str = "auto", q_descale: torch.Tensor | None = None,
                   k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None):
    """Attention with a traced ``score_mod`` and a block-sparse ``block_mask``.

    query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev) -> out (B, Hq, L, Ev).
    ``scale`` defaults to 1/sqrt(E). Hq != Hkv needs ``enable_gqa=True``.
    With ``return_lse`` (or ``return_aux=AuxRequest(lse=True)``) the log-sum-exp
    over kv is returned too: float32 (float64 for float64 inputs), natural log,
    shape (B, Hq, L), -inf on a fully masked row (whose output is 0). With
    ``return_aux=AuxRequest(max_scores=True)`` the row max of the modded (scaled) scores is
    returned too, in the same dtype and shape, -inf on a fully masked row, without a gradient.
    ``backend``: "auto", "cute", "triton" or "reference"; see :func:`flexjit.explain`.

    FP8: q, k and v may be ``torch.float8_e4m3fn`` (or k and v alone, beside a bf16/fp16/fp32
    query: an FP8 KV cache), with FlashAttention-3's descales: ``x_descale`` a float32 tensor of
    positive factors (unchecked: their values stay on the device), shape () or (B, H_kv), real
    value = stored value × descale, 1.0 when not given; the query's is per kv head too (each
    query head uses its kv head's factor). The output is ``out_dtype`` (bfloat16, float16 or
    float32; default bfloat16, or the query's dtype beside an FP8 cache).
    No gradient flows through FP8 inputs: a backward raises, saying to train on bf16 inputs.
    """
    if return_aux is not None and return_lse:
        raise ValueError("pass either return_lse=True or return_aux=AuxRequest(lse=True), not both")
    query, key, value, block_mask, kernel_options, backend, return_aux = _normalize(
        query, key, value, block_mask, kernel_options, backend, return_aux)
    want_max = return_aux is not None and return_aux.max_scores
    fp8 = (q_descale, k_descale, v_descale, out_dtype)
    empty = _empty_result(query, key, value, enable_gqa, fp8)
    if empty is not None:
        if block_mask is not None:
            _check_block_mask(block_mask, query, key)
        out, lse = empty
        max_scores = lse.clone() if want_max else None  # -inf: no score is kept
    elif torch.compiler.is_compiling():
        out, lse, max_scores = _compiled(query, key, value, score_mod, block_mask, scale, enable_gqa,
                                         kernel_options, backend, want_max, fp8)
    else:
        if isinstance(block_mask, BlockMask):  # anything else is refused in prepare_call
            block_mask.warn_if_stale()
        call, choice = _prepared(query, key, value, score_mod, block_mask, scale, enable_gqa,
                                 kernel_options, backend, want_max, fp8)
        if config.settings.debug:
            print(f"[flexjit] {choice}")
        out, lse, max_scores = dispatch.run(choice, call)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None,
                              max_scores=max_scores if want_max else None)
    if return_lse:
        return out, lse
    return out


def _prepared(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options,
              backend: str, want_max: bool, fp8=(None,) * 4) -> tuple[Call, "dispatch.Choice"]:
    """(call, choice) for a normalised eager call: from ``call_cache`` when a call of the same
    signature was prepared before and its guards hold, else validated, traced, lowered and
    selected afresh (and remembered). ``fp8``: (q_descale, k_descale, v_descale, out_dtype)."""
    if isinstance(scale, torch.Tensor):  # keyed by its value now: the cache keeps floats
        scale = _tensor_scale(scale)
    sig = call_cache.signature(query, key, value, score_mod, block_mask, scale, enable_gqa,
                               kernel_options, backend, want_max)
    qd, kd, vd, od = fp8
    if sig is not None and (qd is not None or kd is not None or vd is not None or od is not None):
        fsig = fp8_inputs.signature(*fp8)
        sig = None if fsig is None else sig + fsig
    if sig is not None:
        entry = call_cache.lookup(sig, score_mod, block_mask)
        if entry is not None:  # the signature holds everything fp8_inputs.check reads
            f = fp8_inputs.fp8_of(query, key, *fp8) if key.dtype in FP8_DTYPES else None
            return Call(query, key, value, entry.program, block_mask, entry.scale, entry.kernel_options,
                        max_scores=entry.max_scores, memo=entry.memo, fp8=f), entry.choice
    call = prepare_call(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options,
                        max_scores=want_max, fp8=fp8)
    choice = dispatch.select(backend, call)
    if sig is None:
        call_cache.STATS["uncached"] += 1
    else:
        call_cache.store(sig, score_mod, block_mask, call, choice)
    return call, choice


def _compiled(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options, backend,
              want_max: bool, fp8=(None,) * 4):
    """flex_attention inside a graph dynamo traces (``flexjit.api.compiled``): the same validation,
    minus what needs the traced mods (the HOP's wrapper checks that at AOT time). FP8 inputs
    reach the op as they are (a backend without an FP8 kernel dequantises them there, as in
    eager mode), and are refused where autograd tracks them: a compiled graph's backward is
    built with its forward, so it cannot refuse later."""
    _check_tensors(query, key, value, enable_gqa, fp8=fp8)
    f = fp8_inputs.fp8_of(query, key, *fp8)
    if f is not None and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise ValueError(dispatch.FP8_NO_GRAD)
    if block_mask is not None:
        _check_block_mask(block_mask, query, key)
    if scale is not None:  # the default 1/sqrt(E) is formed in the graph (E may be a symbol)
        scale = _scale(scale, query)
    dispatch.check_backend(backend)  # kernel_options: checked by options.validate already
    mask_mod = None
    if block_mask is not None and not _is_noop(block_mask.mask_mod):
        mask_mod = block_mask.mask_mod
    return compiled.flex_attention(query, key, value, score_mod, block_mask, scale, kernel_options,
                                   backend, mask_mod, want_max, f)


def _scale(scale, query) -> float:
    if scale is None:
        return 1.0 / math.sqrt(query.shape[-1])
    if isinstance(scale, torch.Tensor):
        return _tensor_scale(scale)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float (or a one-element tensor), got {type(scale).__name__}")
    return float(scale)


def _tensor_scale(scale: torch.Tensor) -> float:
    """A one-element tensor ``scale`` (torch's eager flex_attention broadcasts it) as the float
    kernels take; read on every call (a device tensor syncs), so an in-place edit is seen."""
    if scale.numel() != 1 or scale.dtype == torch.bool or scale.is_complex():
        raise TypeError(f"a tensor scale must hold one real number, got shape {tuple(scale.shape)} "
                        f"and dtype {scale.dtype}")
    if scale.device.type == "meta":
        raise ValueError("scale is a meta tensor, which holds no value; pass a float")
    if scale.requires_grad:
        raise NotImplementedError(
            "scale requires grad, but flex_attention computes no gradient for scale; for a "
            "learnable scale pass scale=1.0 and multiply in a score_mod, where captured tensors "
            "get gradients: lambda score, b, h, q_idx, kv_idx: score * scale_tensor")
    return float(scale.item())


def explain(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
            kernel_options=None, *, return_aux: AuxRequest | None = None,
            backend: str = "auto", q_descale=None, k_descale=None, v_descale=None,
            out_dtype=None) -> "dispatch.Choice":
    """Which backend flex_attention would run for these arguments, why, and why every other
    backend was passed over (``Choice.passed_over``), on any device, and the kernel
    configuration each pass runs on (``Choice.config``, ``runtime.autotune``). Runs nothing: on a Blackwell
    GPU it says whether the call's sm100 kernel has passed its first-use self-check, failed it
    (and why), or has not run it yet (it runs on the first call). The FP8 arguments are
    flex_attention's; the reason says whether a backend reads FP8 itself or runs dequantised."""
    query, key, value, block_mask, kernel_options, backend, return_aux = _normalize(
        query, key, value, block_mask, kernel_options, backend, return_aux)
    call = prepare_call(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options,
                        max_scores=return_aux is not None and return_aux.max_scores,
                        fp8=(q_descale, k_descale, v_descale, out_dtype))
    with selfcheck.dry_run():
        return dispatch.with_configs(dispatch.select(backend, call), call)


def _normalize(query, key, value, block_mask, kernel_options, backend, return_aux):
    """The arguments as every backend sees them: autocast applied, a kv batch of 1 broadcast,
    torch's BlockMask and AuxRequest converted, the block lists in int32, kernel_options
    checked (and BACKEND read). Inside a compiled graph the lists reach the custom op as they
    are, and its real kernel converts them (``compiled._block_mask``): no sync while tracing."""
    _check_not_meta({"query": query, "key": key, "value": value})
    query, key, value = autocast_inputs(query, key, value)
    key, value = _broadcast_batch(query, key, value)
    kernel_options, backend = options.validate(kernel_options, backend)
    block_mask = from_torch_block_mask(block_mask)
    if not torch.compiler.is_compiling():
        block_mask = with_int32_lists(block_mask)
    return (query, key, value, block_mask, kernel_options, backend, _aux_request(return_aux))


def _aux_request(req):
    """flexjit's AuxRequest for ``return_aux``: ours, torch's (the same fields), or None."""
    if req is None or isinstance(req, AuxRequest):
        return req
    if type(req).__name__ == "AuxRequest" and hasattr(req, "lse") and hasattr(req, "max_scores"):
        return AuxRequest(lse=bool(req.lse), max_scores=bool(req.max_scores))
    raise TypeError(f"return_aux must be an AuxRequest (flexjit's or torch's), got {type(req).__name__}")


def _check_not_meta(tensors: dict) -> None:
    """Meta tensors hold shapes and no data: no backend can compute on them (torch's
    flex_attention refuses them too)."""
    meta = [name for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_meta]
    if meta:
        raise ValueError(f"{', '.join(meta)} {'is' if len(meta) == 1 else 'are'} on the meta "
                         "device, which holds shapes and no data (a model built under "
                         "torch.device('meta') and not yet materialised); flex_attention needs "
                         "real tensors: materialise the module (module.to_empty(device=...), then "
                         "initialise it) or move the tensors to a real device")


def _broadcast_batch(q, k, v):
    """A key/value batch of 1 broadcasts over the query's batch (a view: no copy)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return k, v  # _check_tensors says what is wrong
    B = q.shape[0]
    if B != 1 and k.shape[0] == 1 and v.shape[0] == 1:
        return k.expand(B, *k.shape[1:]), v.expand(B, *v.shape[1:])
    return k, v


def _empty_result(q, k, v, enable_gqa: bool, fp8=(None,) * 4):
    """(out, lse) for inputs with no queries or no keys (B, H, L or S of 0), or None. No keys:
    every row is fully masked, so out is 0 and lse -inf; gradients are zeros (none for FP8)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None  # prepare_call says what is wrong
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    if min(B, Hq, L, S) > 0:
        return None
    _check_tensors(q, k, v, enable_gqa, allow_empty=True, fp8=fp8)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    f = fp8_inputs.fp8_of(q, k, *fp8)
    if f is not None:
        out = torch.zeros(B, Hq, L, v.shape[-1], dtype=f.out_dtype, device=q.device)
        return out, torch.full((B, Hq, L), float("-inf"), dtype=lse_dtype, device=q.device)
    zero = (q.sum() + k.sum() + v.sum()) * 0  # ties the outputs to the inputs for autograd
    out = torch.zeros(B, Hq, L, v.shape[-1], dtype=q.dtype, device=q.device) + zero.to(q.dtype)
    lse = torch.full((B, Hq, L), float("-inf"), dtype=lse_dtype, device=q.device)
    return out, lse


def autocast_inputs(q, k, v):
    """q, k, v as autocast hands them to attention: under ``torch.autocast(device, dtype)``
    every float16/bfloat16/float32 input is cast to ``dtype`` (float64 is left alone), the
    policy of torch's ``scaled_dot_product_attention``. The casts are differentiable, so
    gradients reach the original tensors in their own dtypes; captured buffers are untouched.
    Outside autocast the inputs are returned as they are."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return q, k, v
    return tuple(t.to(autocast_dtype(t)) for t in (q, k, v))


def autocast_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype ``autocast_inputs`` gives ``t``."""
    device = t.device.type
    if t.dtype in _AUTOCAST_ELIGIBLE and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype


_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def prepare_call(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options,
                 max_scores: bool = False, fp8=(None,) * 4) -> Call:
    """The validated Call; ``fp8``: (q_descale, k_descale, v_descale, out_dtype)."""
    _check_tensors(query, key, value, enable_gqa, fp8=fp8)
    if score_mod is not None:
        check_arity(score_mod, SCORE_MOD)
    if block_mask is not None:
        _check_block_mask(block_mask, query, key)
    scale = _scale(scale, query)
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError("kernel_options must be a dict")
    traced_score = trace_mod(score_mod, SCORE_MOD) if score_mod is not None else None
    traced_mask = None
    if block_mask is not None and not _is_noop(block_mask.mask_mod):
        traced_mask = trace_mod(block_mask.mask_mod, MASK_MOD)
    lengths = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    program = lower(traced_score, traced_mask, float_index=max(lengths) < FLOAT_INDEX_LIMIT,
                    lengths=lengths)
    if block_mask is not None and program.mask is not None:
        _check_broadcast(block_mask, program, query)
    _check_not_meta({f"the captured tensor of shape {tuple(t.shape)}": t for t in program.buffers})
    return Call(query, key, value, program, block_mask, float(scale), dict(kernel_options or {}),
                max_scores=max_scores, fp8=fp8_inputs.fp8_of(query, key, *fp8))


def _is_noop(fn) -> bool:
    return fn is noop_mask or getattr(fn, "__name__", "") == "noop_mask" and \
        getattr(fn, "__module__", "").startswith("torch.nn.attention")


def _check_tensors(q, k, v, enable_gqa: bool, allow_empty: bool = False, fp8=(None,) * 4) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, seq, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES and not is_fp8(t):
            raise TypeError(f"{name} has dtype {t.dtype}; flex_attention takes float16, bfloat16, "
                            "float32 or float64 (or float8_e4m3fn with descales)")
    if not (q.dtype == k.dtype == v.dtype) and not any(is_fp8(t) for t in (q, k, v)):
        raise ValueError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
                         "cast them to one (e.g. .to(torch.bfloat16)), or run under torch.autocast, "
                         "which casts them as it does for scaled_dot_product_attention")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, L, E = q.shape
    Bk, Hkv, S, Ek = k.shape
    Bv, Hv, Sv, _ = v.shape
    if not (B == Bk == Bv):
        raise ValueError(f"batch sizes differ: query {B}, key {Bk}, value {Bv}")
    if Hkv != Hv or S != Sv:
        raise ValueError(f"key {tuple(k.shape)} and value {tuple(v.shape)} must agree on heads and length")
    if E != Ek:
        raise ValueError(f"query head dim {E} != key head dim {Ek}")
    if min(E, v.shape[-1]) == 0 or (not allow_empty and min(L, S, B, Hq, Hkv) == 0):
        raise ValueError(f"empty input: query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}")
    if Hq != Hkv and Hkv > 0:
        if not enable_gqa:
            raise ValueError(f"query has {Hq} heads but key/value have {Hkv}; pass enable_gqa=True "
                             "for grouped-query attention")
        if Hq % Hkv:
            raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if fp8_inputs.involved(q, k, v, *fp8):  # FP8 dtypes, descales, out_dtype
        fp8_inputs.check(q, k, v, *fp8)


def _check_block_mask(bm, q, k) -> None:
    if not isinstance(bm, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask (flexjit.create_block_mask, or torch's), "
                        f"got {type(bm).__module__}.{type(bm).__name__}")
    L, S = q.shape[2], k.shape[2]
    if tuple(bm.seq_lengths) != (L, S):
        raise ValueError(f"block_mask was created for (Q_LEN, KV_LEN) = {tuple(bm.seq_lengths)} but the "
                         f"inputs have ({L}, {S}); create it with Q_LEN={L}, KV_LEN={S}")
    if bm.kv_num_blocks.dim() != 3:
        raise ValueError(f"block_mask must have (batch, head, query-block) dims, got kv_num_blocks of "
                         f"shape {tuple(bm.kv_num_blocks.shape)}")
    bq, bkv = bm.BLOCK_SIZE
    nq, nkv = -(-L // bq), -(-S // bkv)
    if bm.kv_num_blocks.shape[2] != nq or bm.kv_indices.shape[3] != nkv:
        raise ValueError(f"block_mask has {bm.kv_num_blocks.shape[2]}x{bm.kv_indices.shape[3]} blocks, but "
                         f"BLOCK_SIZE={bm.BLOCK_SIZE} over ({L}, {S}) needs {nq}x{nkv}")
    Bm, Hm = bm.kv_num_blocks.shape[:2]
    B, Hq = q.shape[:2]
    if Bm not in (1, B):
        raise ValueError(f"block_mask batch size {Bm} must be 1 or the query's {B}")
    if Hm not in (1, Hq):
        raise ValueError(f"block_mask head count {Hm} must be 1 or the query's {Hq}")
    if bm.kv_num_blocks.device != q.device:
        raise ValueError(f"block_mask is on {bm.kv_num_blocks.device} but query is on {q.device}; "
                         f"call block_mask.to({str(q.device)!r})")


def _check_broadcast(bm: BlockMask, program: Program, q) -> None:
    """A mask planned for one batch/head must not depend on b/h when it is broadcast."""
    Bm, Hm = bm.kv_num_blocks.shape[:2]
    if Bm == 1 and q.shape[0] > 1 and uses(program.mask, Op.B):
        raise ValueError(f"mask_mod `{program.mask_name}` depends on the batch index b, but the block_mask "
                         f"was created with B=1/None; create it with B={q.shape[0]}")
    if Hm == 1 and q.shape[1] > 1 and uses(program.mask, Op.H):
        raise ValueError(f"mask_mod `{program.mask_name}` depends on the head index h, but the block_mask "
                         f"was created with H=1/None; create it with H={q.shape[1]}")
