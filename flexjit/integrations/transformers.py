"""Hugging Face transformers: ``attn_implementation="flexjit"``.

    import flexjit.transformers   # registers "flexjit"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexjit")

Importing this module registers two functions under the name "flexjit":

* ``flexjit_mask`` in transformers' ``AttentionMaskInterface``: the model's mask builders
  (``create_causal_mask``, ``create_sliding_window_causal_mask``, ...) hand it their mask
  function (causal, sliding window, the padding of a 2-D ``attention_mask``, the documents of
  packed sequences) and it returns a flexjit ``BlockMask``. Registering it is not optional:
  without a mask function of the same name, transformers passes ``attention_mask=None`` to the
  attention function and the padding is silently lost.
* ``flexjit_attention`` in ``AttentionInterface``: the layers call it with (B, H, L, D) query,
  key and value; softcapping (Gemma 2) becomes a score_mod, GQA runs without repeating heads.

A mask that captures no tensor (causal, sliding window: no padding, no packing) is planned once
per (mask, shape, device) and reused across layers and steps; one with a padding or document
tensor is planned once per forward (transformers builds it once for all layers of its kind).

Needs transformers >= 4.56 (``masking_utils.AttentionMaskInterface``): ``pip install
"flexjit[transformers]"``.
"""
from __future__ import annotations

import collections
import functools

import torch

from flexjit.api.attention import autocast_dtype, flex_attention
from flexjit.planner.block_mask import BlockMask, and_masks
from flexjit.api.masks import create_block_mask
from flexjit.frontend.trace import MASK_MOD, trace_mod
from flexjit import config
from flexjit.backends.base import capability
from flexjit.integrations import warmup
from flexjit.integrations.warmup import WarmupCall
from flexjit.runtime import compile_pool

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import (AttentionMaskInterface, causal_mask_function,
                                            sliding_window_causal_mask_function)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("flexjit.transformers needs transformers >= 4.56 (AttentionMaskInterface): "
                      "pip install 'flexjit[transformers]'") from e

NAME = "flexjit"
_PLANNED: "collections.OrderedDict[tuple, BlockMask]" = collections.OrderedDict()
_PLANNED_MAX = 64


def _padding(padding_mask: torch.Tensor):
    def padding_mask_mod(b, h, q_idx, kv_idx):
        return padding_mask[b, kv_idx]
    return padding_mask_mod


def _offset(mask_function, q_offset, kv_offset):
    def offset_mask_mod(b, h, q_idx, kv_idx):
        return mask_function(b, h, q_idx + q_offset, kv_idx + kv_offset)
    return offset_mask_mod


def flexjit_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                 kv_offset: int = 0, mask_function=causal_mask_function,
                 attention_mask: torch.Tensor | None = None, device="cpu", **kwargs) -> BlockMask:
    """transformers' mask interface: the BlockMask of ``mask_function`` over (q_length,
    kv_length), with the padding of the 2-D ``attention_mask`` (B, kv) if it has any."""
    compiling = torch.compiler.is_compiling()
    if attention_mask is not None and (compiling or not bool(attention_mask.all())):
        padding = attention_mask.to(device=device, dtype=torch.bool)
        if (pad := kv_length + kv_offset - padding.shape[-1]) > 0:
            padding = torch.nn.functional.pad(padding, (0, pad))
        mask_function = and_masks(mask_function, _padding(padding))
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int) or q_offset or kv_offset:
        mask_function = _offset(mask_function, q_offset, kv_offset)
    if compiling:
        return create_block_mask(mask_function, batch_size, None, q_length, kv_length, device=device)
    return _planned(mask_function, batch_size, q_length, kv_length, torch.device(device))


def _planned(mask_function, B: int, L: int, S: int, device: torch.device) -> BlockMask:
    """create_block_mask, remembered for masks that capture no tensor: transformers builds a new
    closure every forward, the same mask every time."""
    traced = trace_mod(mask_function, MASK_MOD)
    if traced.buffers:
        return create_block_mask(mask_function, B, None, L, S, device=device)
    key = (traced.out, tuple((type(s), s) for s in traced.scalars), B, L, S, str(device))
    bm = _PLANNED.get(key)
    if bm is None:
        bm = create_block_mask(mask_function, B, None, L, S, device=device)
        _PLANNED[key] = bm
        if len(_PLANNED) > _PLANNED_MAX:
            _PLANNED.popitem(last=False)
    else:
        _PLANNED.move_to_end(key)
    return bm


@functools.lru_cache(maxsize=64)
def _softcap(cap: float):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap


def _dense_mask(mask: torch.Tensor):
    """A 4-D mask a caller prepared by hand, (B or 1, 1, L, S): bool (keep) or additive."""
    if mask.dtype == torch.bool:
        def dense_bool_mask(score, b, h, q_idx, kv_idx):
            return torch.where(mask[b, 0, q_idx, kv_idx], score, float("-inf"))
        return dense_bool_mask

    def dense_additive_mask(score, b, h, q_idx, kv_idx):
        return score + mask[b, 0, q_idx, kv_idx]
    return dense_additive_mask


def _chain(first, second):
    if first is None:
        return second

    def chained(score, b, h, q_idx, kv_idx):
        return second(first(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)
    return chained


def flexjit_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask, scaling: float | None = None,
                      dropout: float = 0.0, softcap: float | None = None, **kwargs):
    """transformers' attention interface: (B, H, L, D) inputs -> ((B, L, H, D) output, None)."""
    if dropout and module.training:
        raise ValueError(f"attn_implementation='flexjit' has no attention dropout (got {dropout}); "
                         "set the config's attention_dropout to 0.0")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attn_implementation='flexjit' does not support attention sinks (s_aux)")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("attn_implementation='flexjit' does not take position_bias; "
                                  "write it as a score_mod with flexjit.flex_attention")
    block_mask, score_mod = None, None
    if isinstance(attention_mask, BlockMask):
        block_mask = attention_mask
    elif isinstance(attention_mask, torch.Tensor):
        score_mod = _dense_mask(attention_mask[:, :, :, : key.shape[-2]])
    elif attention_mask is not None:
        raise TypeError(f"attn_implementation='flexjit' got a {type(attention_mask).__name__} mask; "
                        "expected a flexjit BlockMask (from its mask interface) or a 4-D tensor")
    if softcap:
        score_mod = _chain(score_mod, _softcap(float(softcap)))
    _compile_other_layers(module, query, key, value, score_mod, block_mask)
    out = flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask,
                         scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


_STARTED: set = set()


def _compile_other_layers(module, query, key, value, score_mod, block_mask) -> None:
    """At a model's first call of a shape, send the compiles its other layer kinds will need
    (forward, and backward when training) to the compile pool's workers, so that the kinds
    (Gemma 2's sliding and full layers) compile side by side instead of each layer's forward
    waiting for the previous one's. Only where the model's calls are the plain ones
    ``warmup_calls`` describes (no padding, no packed documents): this call's own forward must
    be one of them. This call's own kernels go the usual way (its forward here, its backward
    ahead of need)."""
    cfg = getattr(module, "config", None)
    B, _, L, _ = query.shape
    if cfg is None or torch.compiler.is_compiling() or key.shape[2] != L or block_mask is None:
        return
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    dtype = autocast_dtype(query)  # what the call runs in (Gemma 2's q is float32 under autocast)
    seen = (id(cfg), B, L, dtype, grad, str(query.device))
    if seen in _STARTED:
        return
    _STARTED.add(seen)  # decided once a shape: later calls return above
    if not _pool_serves(query.device):
        return
    try:
        own, _ = warmup.jobs(WarmupCall.like(query, key, value, score_mod, block_mask))
        others = [job for call in warmup_calls(cfg, [L], B, dtype, grad)
                  for job in warmup.jobs(call)[0]]
    except Exception:  # noqa: BLE001 -- a config this cannot read: the layers compile as they come
        return
    if not own or own[0].ident not in {job.ident for job in others}:
        return
    for job in others:
        if job.ident != own[0].ident:
            compile_pool.start(job)


def _pool_serves(device: torch.device) -> bool:
    """Whether the pool's kernels (sm90 CuTe, compiled in workers) are what calls on
    ``device`` run."""
    return (device.type == "cuda" and compile_pool.enabled() and capability(device) == (9, 0)
            and "cute" not in config.settings.disabled)


def warmup_calls(model_or_config, seq_lens, batch: int = 1, dtype: torch.dtype = torch.bfloat16,
                 requires_grad: bool = True) -> list[WarmupCall]:
    """The attention calls a decoder with this config makes under ``attn_implementation=
    "flexjit"`` (no padding, no packing) at each length: one per layer kind, with the masks
    transformers builds for it (``causal_mask_function``, ``sliding_window_causal_mask_function``)
    planned as ``flexjit_mask`` plans them, and the softcap as ``flexjit_attention`` applies it.
    For ``flexjit.warmup_model``."""
    cfg = getattr(model_or_config, "config", model_or_config)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    cap = getattr(cfg, "attn_logit_softcapping", None)
    score_mod = _softcap(float(cap)) if cap else None
    calls = []
    for S in seq_lens:
        for kind in sorted(kinds):
            if kind == "full_attention":
                mask_function = causal_mask_function
            elif kind == "sliding_attention":
                mask_function = sliding_window_causal_mask_function(cfg.sliding_window)
            else:
                raise NotImplementedError(f"warmup_calls: layer type {kind!r}")
            bm = flexjit_mask(batch, S, S, mask_function=mask_function, device="cpu")
            calls.append(WarmupCall(batch, H, S, D, dtype, score_mod, None, Hkv, D, requires_grad,
                                    bm))
    return calls


def register() -> None:
    """Register ``flexjit`` with transformers (done on import; idempotent)."""
    AttentionInterface.register(NAME, flexjit_attention)
    AttentionMaskInterface.register(NAME, flexjit_mask)


register()
