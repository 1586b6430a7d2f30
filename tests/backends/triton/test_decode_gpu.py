"""The split-KV decode kernel on CUDA (marked gpu): every core mod at decode shapes, the decode
mods of a serving step at long KV, split counts, routing (decode without gradients, the prefill
kernels with them) and a paged KV cache through ``flexjit.PagedAttention`` (skipped while it
does not exist), each against the float64 oracle (tests/oracle.py) with tolerances from the data.

Sizes: Hq=8 on Hkv=2 (GQA 4:1), D=128, bf16, KV_LEN 4133 (ragged against the 128 block; 33 kv
blocks, so splits fall mid-block) for the core mods, 32k-128k for the serving mods; the oracle is
dense float64 on the GPU (at most 2·8·16·128k scores). About 40 Triton compiles: ~2 minutes cold.
"""
import math

import pytest
import torch

import flexjit
from flexjit import create_block_mask
from flexjit.api.attention import flex_attention
from flexjit.api.attention import prepare_call
from flexjit.backends.triton import decode as td
from flexjit.ir.nodes import Op, uses
from flexjit.frontend.trace import MASK_MOD, trace_mod
from mods_catalog import CORE, make_case
from oracle import FLOOR, assert_close_to_oracle, dense_attention, dense_scores
from test_decode import _decode_mods

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = "cuda"


def _qkv(B, Hq, Hkv, L, S, E=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(*s, device=DEV, generator=g).to(dtype)
                 for s in ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, E)))


def _mask(mask_mod, B, H, L, S):
    if mask_mod is None:
        return None
    traced = trace_mod(mask_mod, MASK_MOD).out
    return create_block_mask(mask_mod, B if uses(traced, Op.B) else None,
                             H if uses(traced, Op.H) else None, L, S, device=DEV)


def _check(q, k, v, score_mod, mask_mod, bm, oracle_kv=None):
    """flex_attention (auto backend, no gradient) against the oracle: out, lse, max_scores;
    asserts the decode kernel ran."""
    with torch.no_grad():  # (learnable captured tensors require grad: inference is no_grad)
        choice = flexjit.explain(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True)
        assert choice.name == "triton" and "split-KV decode kernel" in choice.reason, str(choice)
        out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                                  return_aux=flexjit.AuxRequest(lse=True, max_scores=True))
    ko, vo = oracle_kv or (k, v)
    with torch.no_grad():
        ref, ref_lse = dense_attention(q, ko, vo, score_mod, mask_mod, dtype=torch.float64)
        low, low_lse = dense_attention(q, ko, vo, score_mod, mask_mod, dtype=q.dtype)
        ref_max = dense_scores(q, ko, score_mod, mask_mod, dtype=torch.float64).amax(-1)
        low_max = dense_scores(q, ko, score_mod, mask_mod, dtype=q.dtype).amax(-1)
    floor = FLOOR[q.dtype]
    assert_close_to_oracle("out", out, ref, low, floor)
    assert_close_to_oracle("lse", aux.lse, ref_lse, low_lse, floor)
    assert_close_to_oracle("max_scores", aux.max_scores, ref_max, low_max, floor)
    return out


@pytest.mark.parametrize("L", [1, 16], ids=["L1", "L16"])
@pytest.mark.parametrize("name", CORE)
def test_core_mods(name, L):
    B, Hq, Hkv, S = 2, 8, 2, 4133
    torch.manual_seed(0)
    case = make_case(name, B, Hq, L, S, device=DEV)
    q, k, v = _qkv(B, Hq, Hkv, L, S, seed=1)
    _check(q, k, v, case.score_mod, case.mask_mod, _mask(case.mask_mod, B, Hq, L, S))


@pytest.mark.parametrize("S", [32768, 131072])
@pytest.mark.parametrize("name", ["full", "causal", "sliding_window", "alibi", "softcap", "document"])
def test_serving_mods_long_kv(name, S):
    """The queries at the end of the KV, as a decode step writes its mods; Q_LEN 1 at 32k,
    4 at 128k (a speculative step)."""
    B, Hq, Hkv = 2, 8, 2
    L = 1 if S == 32768 else 4
    score_mod, mask_mod = _decode_mods(name, B, Hq, L, S)
    if name == "document":  # _decode_mods' ids cover 461 positions: one document per 8k here
        ids = (torch.arange(S, device=DEV) // 8192)
        off = S - L

        def mask_mod(b, h, q_idx, kv_idx):
            return (ids[q_idx + off] == ids[kv_idx]) & (q_idx + off >= kv_idx)
    elif name == "alibi":
        slopes = flexjit.mods.alibi_slopes(Hq).to(DEV)
        off = S - L

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx - off)
    q, k, v = _qkv(B, Hq, Hkv, L, S, seed=2)
    _check(q, k, v, score_mod, mask_mod, _mask(mask_mod, B, Hq, L, S))


@pytest.mark.parametrize("splits", [1, 5, 40, 300])
def test_split_counts(splits):
    """300 splits > the 130 kv tiles: empty splits merge as nothing."""
    B, Hq, Hkv, L, S = 3, 8, 2, 2, 8290
    q, k, v = _qkv(B, Hq, Hkv, L, S, seed=3)
    score_mod, mask_mod = _decode_mods("softcap", B, Hq, L, S)
    bm = _mask(mask_mod, B, Hq, L, S)
    call = prepare_call(q, k, v, score_mod, bm, None, True, None, max_scores=True)
    out, lse, mx = td.forward(call, splits=splits)
    ref, ref_lse = dense_attention(q, k, v, score_mod, mask_mod, dtype=torch.float64)
    low, low_lse = dense_attention(q, k, v, score_mod, mask_mod, dtype=q.dtype)
    assert_close_to_oracle("out", out, ref, low, FLOOR[q.dtype])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[q.dtype])


def test_routing_and_explain():
    """No gradient: the decode kernel, its split count planned for this GPU's SMs; q requiring
    grad: the prefill forward (cute on Hopper), whose output matches the decode kernel's."""
    B, Hq, Hkv, L, S = 1, 32, 8, 1, 32768
    q, k, v = _qkv(B, Hq, Hkv, L, S, seed=4)
    score_mod, mask_mod = _decode_mods("causal", B, Hq, L, S)
    bm = _mask(mask_mod, B, Hq, L, S)
    choice = flexjit.explain(q, k, v, block_mask=bm, enable_gqa=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = td.make_plan(prepare_call(q, k, v, None, bm, None, True, None))
    assert choice.name == "triton" and f"{plan.splits} splits" in choice.reason
    assert f"for {sms} SMs" in choice.reason and plan.splits > 1
    dec = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    qg = q.clone().requires_grad_(True)
    choice = flexjit.explain(qg, k, v, block_mask=bm, enable_gqa=True)
    assert "split-KV" not in choice.reason and choice.backward is not None, str(choice)
    pre = flex_attention(qg, k, v, block_mask=bm, enable_gqa=True)
    ref, _ = dense_attention(q, k, v, None, mask_mod, dtype=torch.float64)
    low, _ = dense_attention(q, k, v, None, mask_mod, dtype=q.dtype)
    assert_close_to_oracle("decode", dec, ref, low, FLOOR[q.dtype])
    assert_close_to_oracle("prefill", pre.detach(), ref, low, FLOOR[q.dtype])


def _paged_pool(lens, page, Hkv, D, dtype):
    """A flexjit.PagedAttention pool whose entries' pages interleave (reserved a page at a time,
    round robin), caches garbage-filled, each entry's logical K/V assigned."""
    if not hasattr(flexjit, "PagedAttention"):
        pytest.skip("flexjit.PagedAttention does not exist on this branch yet")
    B = len(lens)
    n_pages = sum(-(-n // page) for n in lens) + 3
    pa = flexjit.PagedAttention(n_pages, page, B, device=DEV)
    grown = [0] * B
    while any(g < n for g, n in zip(grown, lens)):
        for b in range(B):
            if grown[b] < lens[b]:
                grown[b] = min(lens[b], grown[b] + page)
                pa.reserve(torch.tensor([b], device=DEV), torch.tensor([grown[b]], device=DEV))
    g = torch.Generator(device=DEV).manual_seed(5)
    k_cache = 1e3 * torch.randn(1, Hkv, n_pages * page, D, device=DEV, generator=g).to(dtype)
    v_cache = 1e3 * torch.randn(1, Hkv, n_pages * page, D, device=DEV, generator=g).to(dtype)
    S = max(lens)
    k = torch.randn(B, Hkv, S, D, device=DEV, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, device=DEV, generator=g).to(dtype)
    for b, n in enumerate(lens):
        pa.assign(torch.tensor([b], device=DEV), torch.arange(n, device=DEV)[None],
                  k[b:b + 1, :, :n], v[b:b + 1, :, :n], k_cache, v_cache)
    return pa, k_cache, v_cache, k, v


@pytest.mark.parametrize("name", ["full", "causal", "sliding_window", "alibi", "softcap"])
def test_paged(name):
    """Paged decode (Q_LEN 1 at the end of each entry, ragged entry lengths): the same answer as
    contiguous attention over each entry's own keys."""
    lens, page, Hq, Hkv, D = [5000, 129, 8192], 128, 8, 2, 128
    pa, kc, vc, k, v = _paged_pool(lens, page, Hkv, D, torch.bfloat16)
    B, S, L = len(lens), max(lens), 1
    q = _qkv(B, Hq, Hkv, L, 16, seed=6)[0]
    length = torch.tensor(lens, device=DEV)
    score_mod, base = _decode_mods(name, B, Hq, L, S, device=DEV)  # the oracle runs on DEV
    causal_end = base if base is not None else (lambda b, h, q_idx, kv_idx: kv_idx >= 0)

    def logical_mask(b, h, q_idx, kv_idx):  # each entry's query sits at its own last position
        return (kv_idx < length[b]) & causal_end(b, h, q_idx + (length[b] - S), kv_idx)
    logical_score = None
    if score_mod is not None:
        def logical_score(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, q_idx + (length[b] - S), kv_idx)
    logical_bm = create_block_mask(logical_mask, B, None, L, S, device=DEV, BLOCK_SIZE=page)
    bm = pa.convert_logical_block_mask(logical_bm)
    paged_score = pa.get_score_mod(logical_score) if logical_score is not None else None
    kx, vx = kc, vc
    choice = flexjit.explain(q, kx, vx, score_mod=paged_score, block_mask=bm, enable_gqa=True)
    assert choice.name == "triton" and "split-KV decode kernel" in choice.reason, str(choice)
    with torch.no_grad():
        out, lse = flex_attention(q, kx, vx, score_mod=paged_score, block_mask=bm, enable_gqa=True,
                                  return_lse=True)
        ref, ref_lse = dense_attention(q, k, v, logical_score, logical_mask, dtype=torch.float64)
        low, low_lse = dense_attention(q, k, v, logical_score, logical_mask, dtype=q.dtype)
    assert_close_to_oracle("out", out, ref, low, FLOOR[q.dtype])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[q.dtype])
