"""The benchmark's attention variants, each written once.

A variant is a `score_mod(score, b, h, q_idx, kv_idx)` and/or a `mask_mod(b, h, q_idx, kv_idx)` in
plain torch-like Python: operators, comparisons, `&`, `|`, `torch.tanh`, and indexing a captured
tensor with an index. The *same function objects* go to torch FlexAttention (vmapped, eager or
compiled), to flexjit (traced), and to `reference.py`, which calls them on broadcast index grids.
Nobody writes a mod a second time.

Where FA4 or cuDNN has the variant built in, the variant also carries their keyword arguments;
`None` there means the library cannot express it and is reported as skipped.

Conventions shared with FA4 (`window_size=(left, right)` counts keys either side of the query):
- causal keeps `kv_idx <= q_idx` (the diagonal included);
- sliding window W keeps the W keys `q_idx - W < kv_idx <= q_idx`, i.e. FA4's `(W - 1, 0)`;
- softcap c maps the scaled score s to `c * tanh(s / c)`, FA4's `softcap=c` and Gemma-2's cap.
No variant leaves a query row fully masked: the diagonal is always kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

VARIANTS = ("full", "causal", "alibi", "sliding_window", "document", "softcap", "prefix_lm")

WINDOW = 1024
SOFTCAP = 30.0
DOC_LEN_RANGE = (256, 4096)  # uniform random document lengths, inclusive


@dataclass(frozen=True)
class Case:
    """One problem shape: B·S tokens, Hq query heads over Hkv key/value heads (GQA when fewer)."""

    B: int
    S: int
    Hq: int
    Hkv: int
    D: int
    dtype: torch.dtype = torch.bfloat16
    Dv: int | None = None  # v's head dim where it differs from q/k's (e.g. 192/128)

    @property
    def gqa(self) -> bool:
        return self.Hq != self.Hkv

    @property
    def dv(self) -> int:
        return self.D if self.Dv is None else self.Dv


@dataclass
class Variant:
    """One variant instantiated for a case (captured tensors live on the run's device)."""

    name: str
    score_mod: Callable | None
    mask_mod: Callable | None
    mask_uses_batch: bool  # build the block mask per batch element (B) instead of broadcast (None)
    fa4_kwargs: dict | None  # flash_attn.cute.flash_attn_func keyword arguments, None: not built in
    sdpa_kwargs: dict | None  # scaled_dot_product_attention keyword arguments for cuDNN


# ---- the mods -------------------------------------------------------------------------------


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make_sliding_window(window: int):
    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return sliding_window_mask


def make_alibi(slopes: torch.Tensor):
    """ALiBi (Press et al. 2022): a per-head linear penalty on distance; `slopes` is [Hq] fp32."""

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi_score


def make_document(doc_ids: torch.Tensor):
    """Packed documents, causal inside each; `doc_ids` is [B, S] int32."""

    def document_mask(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return document_mask


def make_softcap(cap: float):
    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap_score


def make_prefix_lm(prefix_len: int):
    """Bidirectional over the first `prefix_len` keys, causal after them."""

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (q_idx >= kv_idx)

    return prefix_lm_mask


# ---- captured data ----------------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The geometric slopes of the ALiBi paper, 2^(-8 i / n) for i = 1..n (n a power of two)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)])


def random_doc_ids(B: int, S: int, gen: torch.Generator, lengths=DOC_LEN_RANGE) -> torch.Tensor:
    """[B, S] int32 document ids; each row packs documents of uniform random length, the last cut."""
    lo, hi = lengths
    ids = torch.empty(B, S, dtype=torch.int32)
    for b in range(B):
        pos, doc = 0, 0
        while pos < S:
            n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
            ids[b, pos : pos + n] = doc
            pos, doc = pos + n, doc + 1
    return ids


def build(name: str, case: Case, device: torch.device, gen: torch.Generator) -> Variant:
    """The variant `name` for `case`, its captured tensors on `device` (drawn from `gen`)."""
    if name == "full":
        return Variant(name, None, None, False, {"causal": False}, {"is_causal": False})
    if name == "causal":
        return Variant(name, None, causal_mask, False, {"causal": True}, {"is_causal": True})
    if name == "alibi":
        slopes = alibi_slopes(case.Hq).to(device)
        return Variant(name, make_alibi(slopes), causal_mask, False, None, None)
    if name == "sliding_window":
        fa4 = {"causal": True, "window_size": (WINDOW - 1, 0)}
        return Variant(name, None, make_sliding_window(WINDOW), False, fa4, None)
    if name == "document":
        doc_ids = random_doc_ids(case.B, case.S, gen).to(device)
        return Variant(name, None, make_document(doc_ids), True, None, None)
    if name == "softcap":
        fa4 = {"causal": True, "softcap": SOFTCAP}
        return Variant(name, make_softcap(SOFTCAP), causal_mask, False, fa4, None)
    if name == "prefix_lm":
        # A quarter of the sequence is prefix: the mask stays between causal and full at every S.
        return Variant(name, None, make_prefix_lm(case.S // 4), False, None, None)
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")


def attention_flops(case: Case, density: float, pass_: str) -> float:
    """2·B·Hq·S²·(D + Dv)·density for the forward (QKᵀ and PV), 3.5× that for forward+backward."""
    fwd = 2.0 * case.B * case.Hq * case.S * case.S * (case.D + case.dv) * density
    return fwd if pass_ == "fwd" else 3.5 * fwd


def default_scale(case: Case) -> float:
    return 1.0 / math.sqrt(case.D)
