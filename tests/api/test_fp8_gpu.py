"""FP8 prefill through flex_attention on CUDA (marked gpu), on whichever road the dispatcher takes:
an FP8 kernel of the chosen backend, or the dequantise-to-bf16 road before a bf16 kernel.

Every test draws random q, k, v (float64, then quantised to float8_e4m3fn with one descale per
(batch, kv head), amax / 448), runs ``flex_attention`` with backend "auto", and holds the output
to the float64 attention of the data *before* quantising, in two norms:

    rel(x) = ‖x − true‖₂ / ‖true‖₂ over the whole output,   max(x) = max |x − true|
    rel(flexjit) ≤ 1.1 · rel(plain) + max(0, rel(plain_P) − rel(plain))
    max(flexjit) ≤ 1.1 · max(plain) + max |plain_P − plain|

``plain``: the plain FP8 reference (dequantise, float32 attention, bf16 out; ``oracle``).
``plain_P``: the same with the unnormalised probabilities rounded, before P·V, to what the taken
road feeds its P·V MMA: e4m3 for an FP8 kernel (an e4m3 × e4m3 MMA needs P in e4m3), bf16 on the
dequantise road (the bf16 kernel's P). The floor is what that rounding alone adds on this data: in
the L2 norm the increase it causes (errors of independent roundings add in quadrature, so on the
dequantise road it is ~0 and the bound is the 1.1 ratio itself); elementwise the most it moves an
output (by the triangle inequality a kernel that rounds P the same way errs by at most that much
beyond the plain reference). Without the floor no e4m3-P kernel could pass: rounding P to e4m3
alone costs 10–14 % in the L2 norm on random data (``benchmarks.fp8_accuracy``'s ``plain_P``).

Cases: every core mod (full, causal, ALiBi, sliding window, document ids as a captured tensor,
softcap) at D 128 and GQA 8/2, ragged S = 1531 (11 whole 128-key blocks and a partial one); D 64
for causal and document; fewer queries than keys (a chunk of 333 queries at the end); MHA;
a random block-sparse mask (empty, full and partial blocks); a bf16 query beside FP8 K/V; ()
descales. About 20 forward compiles cold.
"""
import math

import pytest
import torch

import flexjit
from flexjit import mods
from flexjit import create_block_mask
from flexjit.api.attention import prepare_call
from flexjit.runtime import dispatch
from oracle import dense_attention, fp8_reference, quantize_e4m3

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = "cuda"
E4M3 = torch.float8_e4m3fn
S = 1531  # ragged: 11 whole blocks of 128 keys and one of 123
WINDOW = 300


def _data(B, Hq, Hkv, L, S, D, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(B, h, n, D, generator=g, device=DEV, dtype=torch.float64)
                 for h, n in ((Hq, L), (Hkv, S), (Hkv, S)))


def _mods(name, B, Hq, L, S, seed=0):
    """(score_mod, mask_mod); the L queries are the last L of the S positions."""
    off = S - L

    def causal(b, h, q_idx, kv_idx):
        return q_idx + off >= kv_idx
    if name == "full":
        return None, None
    if name == "causal":
        return None, causal
    if name == "alibi":
        slopes = mods.alibi_slopes(Hq).to(DEV)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx - off)
        return alibi, causal
    if name == "sliding_window":
        def window(b, h, q_idx, kv_idx):
            return (q_idx + off >= kv_idx) & (q_idx + off - kv_idx < WINDOW)
        return None, window
    if name == "document":  # the captured tensor: ids of packed documents, per batch row
        g = torch.Generator().manual_seed(seed)
        ids = torch.cumsum(torch.rand(B, S, generator=g) < 1 / 200, dim=1).to(torch.int32).to(DEV)

        def document(b, h, q_idx, kv_idx):
            return (ids[b, q_idx + off] == ids[b, kv_idx]) & (q_idx + off >= kv_idx)
        return None, document
    if name == "softcap":
        def softcap(score, b, h, q_idx, kv_idx):
            return 20.0 * torch.tanh(score / 20.0)
        return softcap, causal
    if name == "block_sparse":  # random 128×128 tiles kept, the diagonal ones causal inside
        g = torch.Generator().manual_seed(seed)
        n = math.ceil(S / 128)
        tiles = (torch.rand(n, n, generator=g) < 0.4) | torch.eye(n, dtype=torch.bool)
        tiles = tiles.to(DEV)

        def block_sparse(b, h, q_idx, kv_idx):
            qb, kb = (q_idx + off) // 128, kv_idx // 128
            return tiles[qb, kb] & ((qb != kb) | (q_idx + off >= kv_idx))
        return None, block_sparse
    raise KeyError(name)


def _quantised(q, k, v, q_fp8=True, per_head=True):
    g = q.shape[1] // k.shape[1]
    groups = (g, 1) if per_head else (None, None)
    k8, kd = quantize_e4m3(k, groups[1])
    v8, vd = quantize_e4m3(v, groups[1])
    if not q_fp8:
        return (q.to(torch.bfloat16), k8, v8), (None, kd, vd)
    q8, qd = quantize_e4m3(q, groups[0])
    return (q8, k8, v8), (qd, kd, vd)


def _p_dtype(stored, descales, score_mod, bm):
    """(what the road flex_attention takes feeds P·V with, the backend and road in words)."""
    kw = dict(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    choice = flexjit.explain(*stored, score_mod=score_mod, block_mask=bm, enable_gqa=True, **kw)
    call = prepare_call(*stored, score_mod, bm, None, True, None, fp8=(*descales, None))
    native = dispatch.fp8_native(dispatch.module(choice.name), call)[0]
    return (E4M3 if native else torch.bfloat16), f"{choice.name}: {choice.reason}"


def _rel(x, true):
    return float(torch.linalg.vector_norm(x.double() - true) / torch.linalg.vector_norm(true))


def _max(x, true):
    return float((x.double() - true).abs().max())


def check(q, k, v, score_mod, mask_mod, q_fp8=True, per_head=True):
    """flex_attention on the quantised q, k, v against the float64 attention of q, k, v: the
    module docstring's bounds."""
    L, S_ = q.shape[2], k.shape[2]
    bm = None if mask_mod is None else create_block_mask(mask_mod, q.shape[0], None, L, S_, device=DEV)
    stored, descales = _quantised(q, k, v, q_fp8, per_head)
    p_dtype, road = _p_dtype(stored, descales, score_mod, bm)
    out = flexjit.flex_attention(*stored, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                                 q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    assert out.dtype == torch.bfloat16 and out.shape == (*q.shape[:3], v.shape[-1]), road
    assert not torch.isnan(out).any(), f"NaN in the output ({road})"
    true, _ = dense_attention(q, k, v, score_mod, mask_mod)
    plain, _ = fp8_reference(*stored, descales, score_mod, mask_mod, torch.bfloat16)
    plain_p, _ = fp8_reference(*stored, descales, score_mod, mask_mod, torch.bfloat16, p_dtype=p_dtype)
    rel, rel_plain, rel_p = _rel(out, true), _rel(plain, true), _rel(plain_p, true)
    bound = 1.1 * rel_plain + max(0.0, rel_p - rel_plain)
    assert rel <= bound, (f"relative L2 error {rel:.4g} > {bound:.4g} (plain FP8 reference "
                          f"{rel_plain:.4g}, with P in {p_dtype} {rel_p:.4g}); {road}")
    mx, max_plain = _max(out, true), _max(plain, true)
    bound = 1.1 * max_plain + float((plain_p.double() - plain.double()).abs().max())
    assert mx <= bound, (f"max error {mx:.4g} > {bound:.4g} (plain FP8 reference {max_plain:.4g}, "
                         f"P in {p_dtype}); {road}")
    return rel, rel_plain


@pytest.mark.parametrize("name", ["full", "causal", "alibi", "sliding_window", "document", "softcap"])
def test_core_mods(name):
    B, Hq, Hkv, D = 2, 8, 2, 128
    check(*_data(B, Hq, Hkv, S, S, D, seed=1), *_mods(name, B, Hq, S, S))


@pytest.mark.parametrize("name", ["causal", "document"])
def test_head_dim_64(name):
    B, Hq, Hkv, D = 2, 8, 2, 64
    check(*_data(B, Hq, Hkv, S, S, D, seed=2), *_mods(name, B, Hq, S, S))


@pytest.mark.parametrize("name", ["causal", "document"])
def test_fewer_queries_than_keys(name):
    """A prefill chunk: the last 333 queries against all 1531 keys."""
    B, Hq, Hkv, L, D = 2, 8, 2, 333, 128
    check(*_data(B, Hq, Hkv, L, S, D, seed=3), *_mods(name, B, Hq, L, S))


def test_mha():
    B, H, D = 2, 4, 128
    check(*_data(B, H, H, S, S, D, seed=4), *_mods("alibi", B, H, S, S))


def test_block_sparse_mask():
    B, Hq, Hkv, D = 2, 8, 2, 128
    score_mod, mask_mod = _mods("block_sparse", B, Hq, S, S, seed=5)
    bm = create_block_mask(mask_mod, None, None, S, S, device=DEV)
    kinds = {int(n.sum()) > 0 for n in (bm.kv_num_blocks, bm.full_kv_num_blocks)}
    assert kinds == {True}  # partial and full blocks both listed (and, at 40 %, empty ones)
    check(*_data(B, Hq, Hkv, S, S, D, seed=5), score_mod, mask_mod)


@pytest.mark.parametrize("name", ["causal", "alibi"])
def test_bf16_query_beside_fp8_kv(name):
    B, Hq, Hkv, D = 2, 8, 2, 128
    check(*_data(B, Hq, Hkv, S, S, D, seed=6), *_mods(name, B, Hq, S, S), q_fp8=False)


def test_scalar_descales():
    B, Hq, Hkv, D = 2, 8, 2, 128
    check(*_data(B, Hq, Hkv, S, S, D, seed=7), *_mods("causal", B, Hq, S, S), per_head=False)
