"""FP8 (float8_e4m3fn) inputs through the API and the reference backend, on the CPU.

* Semantics: the reference is dequantise → float32 attention → round to out_dtype. Against the
  float64 oracle on the dequantised values, err ≤ 2·err(the plain FP8 reference) + floor, for out
  and lse: scalar and per-(batch, kv head) descales, GQA (each query head uses its kv head's
  factor: a per-head table that broke that rule would show), FP8 and 16-bit queries, each
  out_dtype, descales left out (1.0).
* Accuracy: against the float64 attention of the unquantised data, error ≤ 1.1 × that of the
  plain FP8 reference, on random data and on data with a few large channels.
* Errors: each refused combination raises, saying what to pass instead.
* Gradients: a backward that reaches FP8 inputs raises, naming bf16 inputs.
* Dispatch: explain() names each backend's road for FP8; the call cache reads new descale
  values; the output follows the query's layout; under torch.compile the op reads FP8 as eager does.

Sizes: B 2, 4 query heads on 2 kv heads, L 40, S 100, D 32: several blocks of 32 each way (partial,
full and empty blocks), quick on the CPU.
"""
import pytest
import torch

import flexjit
from flexjit import create_block_mask, mods
from flexjit.api.attention import flex_attention
from flexjit.runtime import call_cache
from oracle import (FLOOR, assert_close_to_oracle, assert_fp8_accuracy, dense_attention,
                    dequantize_e4m3, fp8_reference, quantize_e4m3)

B, HQ, HKV, L, S, E = 2, 4, 2, 40, 100, 32
G = HQ // HKV
E4M3 = torch.float8_e4m3fn


def _data(seed, outliers=False):
    """Unquantised float64 q, k, v; ``outliers``: three key channels and two value channels 12×
    as large as the rest (the channels LLM keys concentrate their magnitude in)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, E, generator=g, dtype=torch.float64)
               for h, n in ((HQ, L), (HKV, S), (HKV, S)))
    if outliers:
        k[..., [3, 17, 30]] *= 12
        v[..., [5, 21]] *= 12
    return q, k, v


def _mods(name):
    """(score_mod, mask_mod): the queries are the last L of the S positions."""
    off = S - L

    def causal(b, h, q_idx, kv_idx):
        return q_idx + off >= kv_idx
    if name == "causal":
        return None, causal
    if name == "alibi":
        slopes = mods.alibi_slopes(HQ)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx - off)
        return alibi, causal
    if name == "softcap":
        return mods.softcap(4.0), None
    if name == "document":
        ids = torch.repeat_interleave(torch.arange(4), torch.tensor([30, 11, 40, 19]))

        def doc(b, h, q_idx, kv_idx):
            return (ids[q_idx + off] == ids[kv_idx]) & (q_idx + off >= kv_idx)
        return None, doc
    raise KeyError(name)


def _block_mask(mask_mod):
    return None if mask_mod is None else create_block_mask(mask_mod, None, None, L, S, device="cpu",
                                                           BLOCK_SIZE=32)


def _quantized(q, k, v, per_head=True, q8=True):
    """((q, k, v) stored, (q_descale, k_descale, v_descale)); ``q8`` False: a bf16 query."""
    groups = (G, 1) if per_head else (None, None)
    k8, kd = quantize_e4m3(k, groups[1])
    v8, vd = quantize_e4m3(v, groups[1])
    if not q8:
        return (q.to(torch.bfloat16), k8, v8), (None, kd, vd)
    qq, qd = quantize_e4m3(q, groups[0])
    return (qq, k8, v8), (qd, kd, vd)


def _check_semantics(stored, descales, score_mod, mask_mod, out_dtype=None, **kw):
    """flexjit's reference against the float64 oracle on the dequantised values."""
    q8, k8, v8 = stored
    want_dtype = out_dtype or (torch.bfloat16 if q8.dtype == E4M3 else q8.dtype)
    qd, kd, vd = descales
    out, lse = flex_attention(q8, k8, v8, score_mod=score_mod, block_mask=_block_mask(mask_mod),
                              enable_gqa=True, return_lse=True, backend="reference", q_descale=qd,
                              k_descale=kd, v_descale=vd, out_dtype=out_dtype, **kw)
    assert out.dtype == want_dtype and lse.dtype == torch.float32
    one = torch.ones((), dtype=torch.float32)
    real = [t.double() if t.dtype != E4M3 else dequantize_e4m3(t, one if d is None else d, groups=gr)
            for t, d, gr in zip(stored, descales, (G, 1, 1))]
    ref, ref_lse = dense_attention(*real, score_mod, mask_mod)
    plain, plain_lse = fp8_reference(q8, k8, v8, descales, score_mod, mask_mod, want_dtype)
    assert_close_to_oracle("out", out, ref, plain, FLOOR[want_dtype])
    assert_close_to_oracle("lse", lse, ref_lse, plain_lse, FLOOR[torch.float32])
    return out, lse


# --------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("name", ["causal", "alibi", "softcap", "document"])
@pytest.mark.parametrize("per_head", [True, False])
def test_reference_dequantises_then_attends_in_float32(name, per_head):
    score_mod, mask_mod = _mods(name)
    stored, descales = _quantized(*_data(1), per_head=per_head)
    _check_semantics(stored, descales, score_mod, mask_mod)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_16_bit_query_with_an_fp8_cache(q_dtype):
    """The KV-cache case: the output has the query's dtype unless out_dtype says otherwise."""
    score_mod, mask_mod = _mods("alibi")
    (q, k8, v8), descales = _quantized(*_data(2), q8=False)
    _check_semantics((q.to(q_dtype), k8, v8), descales, score_mod, mask_mod)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_out_dtype(out_dtype):
    score_mod, mask_mod = _mods("causal")
    stored, descales = _quantized(*_data(3))
    _check_semantics(stored, descales, score_mod, mask_mod, out_dtype=out_dtype)


def test_the_query_descale_is_per_kv_head():
    """A (B, Hkv) q_descale of distinct factors: query head h uses factor [b, h // G]."""
    stored, (qd, kd, vd) = _quantized(*_data(4))
    qd = torch.tensor([[0.5, 2.0], [1.0, 0.25]]) * qd
    _check_semantics(stored, (qd, kd, vd), *_mods("causal"))


def test_a_missing_descale_means_one():
    stored, (qd, _, vd) = _quantized(*_data(5))
    one = torch.ones(B, HKV)
    kw = dict(enable_gqa=True, backend="reference")
    without = flex_attention(*stored, q_descale=qd, v_descale=vd, **kw)
    with_one = flex_attention(*stored, q_descale=qd, k_descale=one, v_descale=vd, **kw)
    assert torch.equal(without, with_one)
    _check_semantics(stored, (qd, None, vd), *_mods("causal"))


def test_max_scores_and_empty_inputs():
    stored, (qd, kd, vd) = _quantized(*_data(6))
    _, mask_mod = _mods("causal")
    out, aux = flex_attention(*stored, block_mask=_block_mask(mask_mod), enable_gqa=True,
                              q_descale=qd, k_descale=kd, v_descale=vd,
                              return_aux=flexjit.AuxRequest(lse=True, max_scores=True))
    real = [dequantize_e4m3(t, d, groups=g) for t, d, g in zip(stored, (qd, kd, vd), (G, 1, 1))]
    from oracle import dense_scores
    ref_max = dense_scores(real[0], real[1], None, mask_mod).amax(-1)
    low_max = dense_scores(*(t.float() for t in real[:2]), None, mask_mod, dtype=torch.float32).amax(-1)
    assert_close_to_oracle("max_scores", aux.max_scores, ref_max, low_max, FLOOR[torch.float32])
    q8, k8, v8 = stored
    out, lse = flex_attention(q8, k8[:, :, :0], v8[:, :, :0], enable_gqa=True, return_lse=True,
                              q_descale=qd, out_dtype=torch.float16)
    assert out.dtype == torch.float16 and torch.all(out == 0) and torch.all(lse == float("-inf"))


# --------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("name", ["causal", "alibi", "document"])
def test_accuracy_against_the_unquantised_attention(name, outliers):
    """Error against float64 attention of the data before quantisation: no worse than 1.1 × the
    plain FP8 reference's, for out and lse."""
    q, k, v = _data(7, outliers)
    score_mod, mask_mod = _mods(name)
    stored, descales = _quantized(q, k, v)
    out, lse = flex_attention(*stored, score_mod=score_mod, block_mask=_block_mask(mask_mod),
                              enable_gqa=True, return_lse=True, q_descale=descales[0],
                              k_descale=descales[1], v_descale=descales[2])
    true, true_lse = dense_attention(q, k, v, score_mod, mask_mod)
    plain, plain_lse = fp8_reference(*stored, descales, score_mod, mask_mod)
    assert_fp8_accuracy("out", out, true, plain)
    assert_fp8_accuracy("lse", lse, true_lse, plain_lse)


# --------------------------------------------------------------------------- errors


def _bad(**over):
    (q8, k8, v8), (qd, kd, vd) = _quantized(*_data(8))
    args = dict(query=q8, key=k8, value=v8, q_descale=qd, k_descale=kd, v_descale=vd)
    args.update(over)
    return args


@pytest.mark.parametrize("over,exc,match", [
    (dict(key=torch.zeros(B, HKV, S, E, dtype=torch.float8_e5m2), value=torch.zeros(
        B, HKV, S, E, dtype=torch.float8_e5m2)), ValueError, "float8_e4m3fn only"),
    (dict(value=torch.zeros(B, HKV, S, E, dtype=torch.bfloat16), v_descale=None), ValueError,
     "FP8 key and value go together"),
    (dict(key=torch.zeros(B, HKV, S, E, dtype=torch.bfloat16), value=torch.zeros(
        B, HKV, S, E, dtype=torch.bfloat16), k_descale=None, v_descale=None), ValueError,
     "an FP8 query needs FP8 key and value"),
    (dict(query=torch.zeros(B, HQ, L, E, dtype=torch.bfloat16)), ValueError,
     "q_descale was given but q is torch.bfloat16"),
    (dict(query=torch.zeros(B, HQ, L, E, dtype=torch.float64), q_descale=None), ValueError,
     "must be float8_e4m3fn, bfloat16, float16 or float32"),
    (dict(k_descale=torch.ones(B, HQ)), ValueError, r"shape \(B, H_kv\) = \(2, 2\)"),
    (dict(k_descale=torch.ones(1)), ValueError, "has shape"),
    (dict(v_descale=torch.ones(B, HKV, dtype=torch.bfloat16)), ValueError, "descales are float32"),
    (dict(v_descale=0.5), TypeError, "must be a float32 tensor"),
    (dict(out_dtype=torch.float64), ValueError, "out_dtype must be"),
    (dict(k_descale=torch.ones(B, HKV, requires_grad=True)), ValueError, "no gradient for descales"),
])
def test_bad_combinations_raise(over, exc, match):
    for entry in (flex_attention, flexjit.explain):  # explain validates the same way
        args = _bad(**over)
        with pytest.raises(exc, match=match):
            entry(args.pop("query"), args.pop("key"), args.pop("value"), enable_gqa=True, **args)


def test_out_dtype_and_descales_need_fp8_inputs():
    q, k, v = (t.to(torch.bfloat16) for t in _data(9))
    with pytest.raises(ValueError, match="out_dtype=torch.float32 applies to FP8 inputs"):
        flex_attention(q, k, v, enable_gqa=True, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="k_descale was given but k is torch.bfloat16"):
        flex_attention(q, k, v, enable_gqa=True, k_descale=torch.ones(()))
    out = flex_attention(q, k, v, enable_gqa=True, out_dtype=torch.bfloat16)  # its own dtype: fine
    ref, _ = dense_attention(q, k, v)
    low, _ = dense_attention(q, k, v, dtype=torch.bfloat16)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.bfloat16])


# --------------------------------------------------------------------------- gradients


def test_a_backward_through_fp8_inputs_raises_naming_bf16():
    """torch lets an FP8 tensor require grad (a cast from one that does); the forward answers,
    the backward says how to train."""
    stored, (qd, kd, vd) = _quantized(*_data(10))
    k8 = stored[1].clone().requires_grad_(True)
    out = flex_attention(stored[0], k8, stored[2], enable_gqa=True, q_descale=qd, k_descale=kd,
                         v_descale=vd)
    ref = flex_attention(*stored, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(out.detach(), ref)
    with pytest.raises(RuntimeError, match="no gradients through FP8.*pass bfloat16"):
        out.float().sum().backward()
    qb = stored[0].float().requires_grad_(True)  # a 16-bit query that requires grad: the same
    out = flex_attention(qb, k8.detach(), stored[2], enable_gqa=True, k_descale=kd, v_descale=vd)
    with pytest.raises(RuntimeError, match="no gradients through FP8"):
        out.sum().backward()
    with torch.no_grad():  # inference: no graph, no error
        out = flex_attention(stored[0], k8, stored[2], enable_gqa=True, q_descale=qd,
                             k_descale=kd, v_descale=vd)
    assert not out.requires_grad and torch.equal(out, ref)


# --------------------------------------------------------------------------- dispatch


def test_explain_names_each_backends_fp8_road(monkeypatch):
    from flexjit.runtime import dispatch
    stored, (qd, kd, vd) = _quantized(*_data(11))
    kw = dict(enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd)
    choice = flexjit.explain(*stored, **kw)
    assert choice.name == "reference" and "dequantises FP8 inputs to float32 itself" in choice.reason
    refusals = dict(choice.passed_over)
    assert "dequantised to bfloat16" in refusals["cute"]
    assert choice.backward is None
    # A GPU's order, faked: the CuTe backend is asked about the dequantised call (and refuses the
    # CPU tensors for that reason, not for their dtype).
    monkeypatch.setattr(dispatch, "_preference", lambda device: ("cute", "triton", "reference"))
    choice = flexjit.explain(*stored, **kw)
    assert choice.name == "reference"
    assert dict(choice.passed_over)["cute"] == ("needs a CUDA tensor, got cpu (with the FP8 inputs "
                                                "dequantised to bfloat16)")


def test_the_call_cache_reads_new_descales():
    """A repeated call (a cache hit) with new descale values, then descales of another shape."""
    call_cache.clear()
    stored, (qd, kd, vd) = _quantized(*_data(12))
    kw = dict(enable_gqa=True, backend="reference")
    first = flex_attention(*stored, q_descale=qd, k_descale=kd, v_descale=vd, **kw)
    second = flex_attention(*stored, q_descale=qd, k_descale=kd, v_descale=vd * 2, **kw)
    assert call_cache.STATS == {"hit": 1, "miss": 1, "uncached": 0}
    assert torch.equal(second, 2 * first)  # doubling v's factor doubles out exactly
    flex_attention(*stored, q_descale=qd, k_descale=kd, v_descale=vd[0, 0], **kw)
    assert call_cache.STATS["miss"] == 2  # a () descale is another signature


def test_the_output_follows_the_querys_layout():
    """A (B, L, H, D) query buffer viewed as (B, H, L, D) gives an output that is such a view."""
    stored, (qd, kd, vd) = _quantized(*_data(13))
    q8 = stored[0].transpose(1, 2).contiguous().transpose(1, 2)
    out = flex_attention(q8, *stored[1:], enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.transpose(1, 2).is_contiguous()
    ref = flex_attention(*stored, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("name", ["causal", "alibi"])
def test_inside_torch_compile(q8, name):
    """The FP8 inputs and their descales reach the custom op as they are (the backend that runs
    reads them, or dequantises, as in eager mode): the compiled call equals the eager one, with
    a mask only (no HOP) and with a score_mod (the HOP's path); out_dtype is honoured; refused
    where autograd would track FP8 inputs."""
    torch._dynamo.reset()
    stored, (qd, kd, vd) = _quantized(*_data(14), q8=q8)
    score_mod, mask_mod = _mods(name)
    bm = _block_mask(mask_mod)
    kw = dict(out_dtype=torch.float16) if q8 else {}

    def f(q, k, v, qd, kd, vd):
        return flex_attention(q, k, v, score_mod, block_mask=bm, enable_gqa=True, q_descale=qd,
                              k_descale=kd, v_descale=vd, **kw)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*stored, qd, kd, vd)
    want = f(*stored, qd, kd, vd)
    assert got.dtype == want.dtype == (torch.float16 if q8 else torch.bfloat16)
    assert torch.equal(got, want)
    k8 = stored[1].clone().requires_grad_(True)  # a compiled backward is built with its forward
    with pytest.raises(Exception, match="no gradients through FP8"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(stored[0], k8, stored[2], qd, kd, vd)
    torch._dynamo.reset()


def test_paged_assign_into_an_fp8_cache_says_to_quantise():
    pa = flexjit.PagedAttention(n_pages=4, page_size=16, max_batch_size=1, device="cpu")
    pa.reserve(0, 20)
    cache = torch.zeros(1, HKV, pa.kv_len, E, dtype=E4M3)
    k = torch.randn(1, HKV, 20, E)
    with pytest.raises(TypeError, match=r"quantise them first, \(k_val / k_descale\)"):
        pa.assign(torch.tensor([0]), torch.arange(20)[None], k, k.to(E4M3), cache, cache.clone())
    k8, _ = quantize_e4m3(k.double(), None)
    v_cache = cache.clone()
    pa.assign(torch.tensor([0]), torch.arange(20)[None], k8, k8, cache, v_cache)
    pos = torch.arange(20)
    addr = pa.page_table[0, pos // 16] * 16 + pos % 16
    assert torch.equal(cache[0, :, addr].view(torch.uint8), k8[0].view(torch.uint8))
