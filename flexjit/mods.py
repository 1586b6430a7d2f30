"""Ready-made score_mods and mask_mods, as factories.

Each factory returns a plain Python function written the way a user would
write it; flexjit traces these like any other mod (they get no special path).
Captured numbers (a window size, a cap) become run-time kernel arguments, so
``sliding_window(512)`` and ``sliding_window(1024)`` share one compiled kernel.

mask_mods: causal, sliding_window, prefix_lm, document
score_mods: alibi, softcap, relative_bias, t5_bias
"""
from __future__ import annotations

import math

import torch


def causal():
    """Each query sees itself and earlier keys."""
    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return causal_mask


def sliding_window(window: int, causal: bool = True):
    """Keys at most ``window`` positions away (and not in the future if ``causal``)."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if causal:
        def sliding_window_mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    else:
        def sliding_window_mask(b, h, q_idx, kv_idx):
            return torch.abs(q_idx - kv_idx) <= window
    return sliding_window_mask


def prefix_lm(prefix):
    """Bidirectional over the first ``prefix`` keys, causal after. ``prefix`` is an int,
    or a (B,) integer tensor of per-sequence prefix lengths."""
    if isinstance(prefix, torch.Tensor):
        if prefix.dim() != 1 or prefix.dtype.is_floating_point:
            raise ValueError("a per-batch prefix must be a 1-D integer tensor of shape (B,)")

        def prefix_lm_mask(b, h, q_idx, kv_idx):
            return (kv_idx < prefix[b]) | (q_idx >= kv_idx)
    else:
        def prefix_lm_mask(b, h, q_idx, kv_idx):
            return (kv_idx < prefix) | (q_idx >= kv_idx)
    return prefix_lm_mask


def document(doc_ids: torch.Tensor, causal: bool = True):
    """Attention only within a document. ``doc_ids``: (S,) or (B, S) integer ids per token
    (packed sequences). Causal inside each document unless ``causal=False``."""
    if doc_ids.dtype.is_floating_point or doc_ids.dim() not in (1, 2):
        raise ValueError("doc_ids must be an integer tensor of shape (S,) or (B, S)")
    if doc_ids.dim() == 1:
        def same_doc(b, q_idx, kv_idx):
            return doc_ids[q_idx] == doc_ids[kv_idx]
    else:
        def same_doc(b, q_idx, kv_idx):
            return doc_ids[b, q_idx] == doc_ids[b, kv_idx]
    if causal:
        def document_mask(b, h, q_idx, kv_idx):
            return same_doc(b, q_idx, kv_idx) & (q_idx >= kv_idx)
    else:
        def document_mask(b, h, q_idx, kv_idx):
            return same_doc(b, q_idx, kv_idx)
    return document_mask


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes (Press et al., 2022, §3), for any head count."""
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(num_heads).is_integer():
        slopes = power_of_2(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_2(closest) + power_of_2(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(slopes):
    """score + slope[h] · (kv_idx - q_idx). ``slopes``: a (H,) tensor (learnable if it
    requires grad) or the number of heads (standard slopes)."""
    if isinstance(slopes, int):
        slopes = alibi_slopes(slopes)
    if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1:
        raise ValueError("slopes must be a (H,) tensor or an int number of heads")

    def alibi_bias(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi_bias


def softcap(cap: float):
    """cap · tanh(score / cap): Gemma-2 style logit soft-capping."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap_score


def relative_bias(table: torch.Tensor, max_distance: int | None = None):
    """score + table[(h,) clamp(kv_idx - q_idx, ±max_distance) + max_distance].

    ``table``: (2·max_distance + 1,) or (H, 2·max_distance + 1); learnable if it requires grad.
    """
    n = table.shape[-1]
    if n % 2 != 1:
        raise ValueError("the table's last dim must be odd: 2*max_distance + 1")
    md = (n - 1) // 2 if max_distance is None else max_distance
    if 2 * md + 1 != n:
        raise ValueError(f"table has {n} entries, max_distance={md} needs {2 * md + 1}")
    if table.dim() == 1:
        def relative_bias_score(score, b, h, q_idx, kv_idx):
            return score + table[torch.clamp(kv_idx - q_idx, -md, md) + md]
    elif table.dim() == 2:
        def relative_bias_score(score, b, h, q_idx, kv_idx):
            return score + table[h, torch.clamp(kv_idx - q_idx, -md, md) + md]
    else:
        raise ValueError("table must be 1-D or 2-D (H, 2*max_distance+1)")
    return relative_bias_score


def t5_bucket(rel, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
    """T5's relative-position bucket of ``rel = kv_idx - q_idx`` (Raffel et al., 2020).
    Works on traced values and on tensors alike."""
    if bidirectional:
        num_buckets //= 2
        base = torch.where(rel > 0, num_buckets, 0)
        n = torch.abs(rel)
    else:
        base = 0
        n = -torch.minimum(rel, torch.zeros_like(rel))
    max_exact = num_buckets // 2
    scaled = torch.log(torch.clamp(n, min=1).float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (scaled * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return base + torch.where(n < max_exact, n, large)


def t5_bias(table: torch.Tensor, max_distance: int = 128, bidirectional: bool = True):
    """score + table[h, bucket(kv_idx - q_idx)] with T5's log-spaced buckets.
    ``table``: (H, num_buckets), learnable if it requires grad."""
    if table.dim() != 2:
        raise ValueError("table must be (H, num_buckets)")
    num_buckets = table.shape[1]

    def t5_bias_score(score, b, h, q_idx, kv_idx):
        return score + table[h, t5_bucket(kv_idx - q_idx, num_buckets, max_distance, bidirectional)]
    return t5_bias_score
