"""The split-KV decode kernel reading an FP8 (float8_e4m3fn) KV cache, on the CPU under
TRITON_INTERPRET=1, and the Triton prefill kernel's road around FP8 (dequantised first).

* Numerics against the float64 oracle on the dequantised values: err ≤ 2·err(the same math in
  plain torch: dequantise, float32 attention with P rounded to the kernel's compute dtype before
  P·V, round to the output dtype) + floor, for out, lse and max_scores. Mods: none, causal, sliding window, ALiBi (a captured slope table), softcap,
  document (a captured id table); one split and several; bf16 queries with per-(batch, kv head)
  descales, e4m3 queries with scalar ones; fp16/fp32 outputs. Outputs are NaN-poisoned.
* Accuracy: against the float64 attention of the unquantised data, error ≤ 1.1 × the plain FP8
  reference's, on random data and on data with a few large channels (decode and prefill).
* A paged e4m3 cache (flexjit.PagedAttention) with per-sequence descales; a repeated call (the
  decode runner's relaunch path) reading new descale values, also where one descale tensor was
  passed twice before; the descales read in place (no table, a strided one made contiguous).
* Routing: explain() says the decode kernel reads the FP8 tiles, and the prefill road dequantises.
* Compile-only for sm_90 (no GPU): the FP8 kernel converts e4m3 pairs in registers and feeds
  tensor-core MMAs; the 16-bit launch passes no descales and has no FP8 instruction.
* DECODE_CONFIG variants (prefetch, kbits, vbits): the same numerics checks (the bit
  conversions' 2^-8 undone exactly); the tokens are checked; "kbits+vbits" builds for sm_90 with
  no e4m3 conversion instruction.

Sizes as tests/backends/triton/test_decode.py's: D = 32, KV_LEN 300 over 32-key mask blocks
(ragged; 10 kv tiles, so several splits each get partial and full tiles), GQA 4:1, Q_LEN 3.
"""
import re

import pytest
import torch

import flexjit
from flexjit import create_block_mask
from flexjit.api.attention import flex_attention, prepare_call
from flexjit.api.paged import PagedAttention
from flexjit.backends.fp8 import compute_dtype
from flexjit.backends.triton import decode as td
from flexjit.backends.triton import prefill as tb
from flexjit.runtime import call_cache
from oracle import (FLOOR, assert_close_to_oracle, assert_fp8_accuracy, dense_attention, dense_scores,
                    dequantize_e4m3, fp8_reference, quantize_e4m3)
from test_decode import _decode_mods, _mask

E4M3 = torch.float8_e4m3fn
SHAPE = dict(B=2, Hq=8, Hkv=2, L=3, S=300, E=32)


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEXJIT_POISON", "1")
        mp.setenv("FLEXJIT_CACHE_DIR", str(tmp_path_factory.mktemp("flexjit-cache")))
        yield


@pytest.fixture
def interp(monkeypatch):
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("interpreter tests need triton >= 3.9")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _data(B, Hq, Hkv, L, S, E, seed, outliers=False):
    """Unquantised float64 q, k, v; ``outliers``: three key and two value channels 12× larger."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64)
               for shape in ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, E)))
    if outliers:
        k[..., [3, 17, 30]] *= 12
        v[..., [5, 21]] *= 12
    return q, k, v


def _quantize(q, k, v, q_fp8: bool, per_head: bool = True):
    """((q, k, v) as the call takes them, (q_descale, k_descale, v_descale))."""
    groups = q.shape[1] // k.shape[1]
    k8, kd = quantize_e4m3(k, 1 if per_head else None)
    v8, vd = quantize_e4m3(v, 1 if per_head else None)
    if not q_fp8:
        return (q.to(torch.bfloat16), k8, v8), (None, kd, vd)
    q8, qd = quantize_e4m3(q, groups if per_head else None)
    return (q8, k8, v8), (qd, kd, vd)


def _real(stored, descales):
    """The dequantised (real) q, k, v in float64."""
    g = stored[0].shape[1] // stored[1].shape[1]
    return [t.double() if t.dtype != E4M3 else dequantize_e4m3(t, d, groups=gr) if d is not None
            else t.double() for t, d, gr in zip(stored, descales, (g, 1, 1))]


def check(stored, descales, score_mod, mask_mod, bm, splits, out_dtype=None, oracle_kv=None,
          kernel_options=None, max_dtype=torch.float32):
    """The FP8 decode kernel against the float64 oracle on the dequantised values, with the
    plain FP8 reference as the baseline; ``oracle_kv``: the logical (k, v) stored and their
    descales for a paged cache; ``max_dtype``: the math max_scores is held to (the scores'
    own float32, or coarser where the kernel approximates a function). Returns (out, lse)."""
    q8, k8, v8 = stored
    call = prepare_call(q8, k8, v8, score_mod, bm, None, True, kernel_options, max_scores=True,
                        fp8=(*descales, out_dtype))
    ok, why = td.routes(call)
    assert ok, why
    out, lse, mx = td.forward(call, splits=splits)
    want = call.out_dtype
    assert out.dtype == want and lse.dtype == torch.float32 and mx.dtype == torch.float32
    ostored, odesc = (stored, descales) if oracle_kv is None else ((q8, *oracle_kv[0]), oracle_kv[1])
    real = _real(ostored, odesc)
    ref, ref_lse = dense_attention(*real, score_mod, mask_mod)
    plain, plain_lse = fp8_reference(*ostored, odesc, score_mod, mask_mod, want,
                                     p_dtype=compute_dtype(q8))  # P rounds as the kernel's does
    assert_close_to_oracle("out", out, ref, plain, FLOOR[want])
    assert_close_to_oracle("lse", lse, ref_lse, plain_lse, FLOOR[torch.float32])
    ref_max = dense_scores(real[0], real[1], score_mod, mask_mod).amax(-1)
    low_max = dense_scores(*(t.to(max_dtype) for t in real[:2]), score_mod, mask_mod,
                           dtype=max_dtype).amax(-1)
    assert_close_to_oracle("max_scores", mx, ref_max, low_max, FLOOR[torch.float32])
    return out, lse


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("name", ["full", "causal", "sliding_window", "alibi", "softcap", "document"])
@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_cache_with_bf16_queries(interp, name, splits):
    s = SHAPE
    stored, descales = _quantize(*_data(*s.values(), seed=1), q_fp8=False)
    score_mod, mask_mod = _decode_mods(name, s["B"], s["Hq"], s["L"], s["S"])
    check(stored, descales, score_mod, mask_mod, _mask(mask_mod, s["B"], s["Hq"], s["L"], s["S"]), splits)


@pytest.mark.parametrize("name,out_dtype", [("causal", None), ("alibi", torch.float16),
                                            ("document", torch.float32)])
def test_fp8_queries_scalar_descales(interp, name, out_dtype):
    """e4m3 q, k and v with () descales; the output dtypes bf16 (default), fp16, fp32."""
    s = SHAPE
    stored, descales = _quantize(*_data(*s.values(), seed=2), q_fp8=True, per_head=False)
    score_mod, mask_mod = _decode_mods(name, s["B"], s["Hq"], s["L"], s["S"])
    check(stored, descales, score_mod, mask_mod, _mask(mask_mod, s["B"], s["Hq"], s["L"], s["S"]),
          splits=3, out_dtype=out_dtype)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_queries(interp, q_dtype):
    """Beside an e4m3 cache the tiles convert to the query's dtype (fp32: fp32 dots)."""
    s = SHAPE
    (q, k8, v8), descales = _quantize(*_data(*s.values(), seed=9), q_fp8=False)
    score_mod, mask_mod = _decode_mods("sliding_window", s["B"], s["Hq"], s["L"], s["S"])
    out, _ = check((q.to(q_dtype), k8, v8), descales, score_mod, mask_mod,
                   _mask(mask_mod, s["B"], s["Hq"], s["L"], s["S"]), splits=2)
    assert out.dtype == q_dtype


def test_fp8_queries_per_kv_head_descales(interp):
    """Distinct (B, Hkv) factors for q, k and v: each packed query head must take its kv head's
    (a kernel indexing the table by query head, or by batch alone, would fail)."""
    s = SHAPE
    stored, (qd, kd, vd) = _quantize(*_data(*s.values(), seed=3), q_fp8=True)
    spread = torch.tensor([[0.5, 2.0], [4.0, 0.25]])
    descales = (qd * spread, kd * spread.flip(0), vd * spread.flip(1))
    score_mod, mask_mod = _decode_mods("alibi", s["B"], s["Hq"], s["L"], s["S"])
    check(stored, descales, score_mod, mask_mod, _mask(mask_mod, s["B"], s["Hq"], s["L"], s["S"]),
          splits=2)


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("q_fp8", [False, True])
def test_accuracy_against_the_unquantised_attention(interp, outliers, q_fp8):
    s = SHAPE
    q, k, v = _data(*s.values(), seed=4, outliers=outliers)
    score_mod, mask_mod = _decode_mods("softcap", s["B"], s["Hq"], s["L"], s["S"])
    stored, descales = _quantize(q, k, v, q_fp8)
    bm = _mask(mask_mod, s["B"], s["Hq"], s["L"], s["S"])
    call = prepare_call(*stored, score_mod, bm, None, True, None, fp8=(*descales, None))
    out, lse, _ = td.forward(call, splits=3)
    true, true_lse = dense_attention(q, k, v, score_mod, mask_mod)
    plain, plain_lse = fp8_reference(*stored, descales, score_mod, mask_mod)
    assert_fp8_accuracy("out", out, true, plain)
    assert_fp8_accuracy("lse", lse, true_lse, plain_lse)


def test_paged_fp8_cache(interp):
    """An e4m3 page pool (flexjit.PagedAttention) filled by several sequences, each quantised
    with its own (kv head) factors: the converted block mask walks physical pages, the kernel
    applies sequence b's descales to every key b reads. Unowned pages hold large finite values."""
    B, Hq, Hkv, L, E, page = 3, 4, 2, 1, 32, 32
    lens = [200, 77, 131]
    S = max(lens)
    q, k, v = _data(B, Hq, Hkv, L, S, E, seed=5)
    (qb, k8, v8), (_, kd, vd) = _quantize(q, k, v, q_fp8=False)
    pa = PagedAttention(n_pages=24, page_size=page, max_batch_size=B, device="cpu")
    garbage = torch.full((1, Hkv, pa.kv_len, E), 400.0).to(E4M3)
    k_cache, v_cache = garbage.clone(), garbage.clone()
    for step in range(1, S // page + 2):  # pages handed out interleaved between the sequences
        for b, n in enumerate(lens):
            pa.reserve(b, min(n, step * page))
    for b, n in enumerate(lens):
        pa.assign(torch.tensor([b]), torch.arange(n)[None], k8[b:b + 1, :, :n], v8[b:b + 1, :, :n],
                  k_cache, v_cache)
    off = torch.tensor(lens) - L

    def causal(b, h, q_idx, kv_idx):
        return q_idx + off[b] >= kv_idx
    kv_len = torch.tensor(lens)
    logical = create_block_mask(causal, B, None, L, S, device="cpu", BLOCK_SIZE=(16, 32))
    bm = pa.convert_logical_block_mask(logical, kv_len=kv_len)

    def live(b, h, q_idx, kv_idx):
        return (kv_idx < kv_len[b]) & causal(b, h, q_idx, kv_idx)
    for splits in (1, 4):
        check((qb, k_cache.expand(B, -1, -1, -1), v_cache.expand(B, -1, -1, -1)), (None, kd, vd),
              None, live, bm, splits, oracle_kv=((k8, v8), (None, kd, vd)))


def test_a_repeated_call_reads_new_descales(interp):
    """The second call of a signature relaunches the ready kernels with the new tensors (the
    descales among them): doubling v's factors doubles out exactly; lse is unchanged."""
    call_cache.clear()
    s = SHAPE
    (qb, k8, v8), (_, kd, vd) = _quantize(*_data(*s.values(), seed=6), q_fp8=False)
    kw = dict(enable_gqa=True, backend="triton", return_lse=True, k_descale=kd)
    out1, lse1 = flex_attention(qb, k8, v8, v_descale=vd, **kw)
    out2, lse2 = flex_attention(qb, k8, v8, v_descale=2 * vd, **kw)
    assert call_cache.STATS["hit"] == 1
    assert torch.equal(out2, 2 * out1) and torch.equal(lse1, lse2)
    out3, _ = flex_attention(qb, k8, v8, v_descale=vd, **dict(kw, k_descale=2 * kd))
    ref, _ = fp8_reference(qb, k8, v8, (None, 2 * kd, vd))
    real = _real((qb, k8, v8), (None, 2 * kd, vd))
    assert_close_to_oracle("out", out3, dense_attention(*real)[0], ref, FLOOR[torch.bfloat16])


def test_descales_are_read_in_place(interp):
    """The kernel reads each descale where the caller keeps it (kinds: absent, 1.0; one factor;
    one per (batch, kv head), a strided one made contiguous). A signature first called with one
    tensor as both k's and v's descale, then with two, reads both (the runner's slots follow
    identity)."""
    call_cache.clear()
    s = SHAPE
    (qb, k8, v8), (_, kd, vd) = _quantize(*_data(*s.values(), seed=7), q_fp8=False)
    kw = dict(enable_gqa=True, backend="triton", return_lse=True)
    both = kd.clone()
    flex_attention(qb, k8, v8, k_descale=both, v_descale=both, **kw)
    out, _ = flex_attention(qb, k8, v8, k_descale=kd, v_descale=vd, **kw)
    ref, _ = fp8_reference(qb, k8, v8, (None, kd, vd))
    real = _real((qb, k8, v8), (None, kd, vd))
    assert_close_to_oracle("out", out, dense_attention(*real)[0], ref, FLOOR[torch.bfloat16])
    wide = torch.stack([vd, 7 * vd], dim=-1)[..., 0]  # (B, Hkv) with strides (2·Hkv, 2)
    assert not wide.is_contiguous()
    for descales in ((None, kd[0, 0], None), (None, kd, wide)):
        out, _ = flex_attention(qb, k8, v8, k_descale=descales[1], v_descale=descales[2], **kw)
        ref, _ = fp8_reference(qb, k8, v8, descales)
        real = _real((qb, k8, v8), descales)
        assert_close_to_oracle("out", out, dense_attention(*real)[0], ref, FLOOR[torch.bfloat16])
    call = prepare_call(qb, k8, v8, None, None, None, True, None, fp8=(None, kd[0, 0], wide, None))
    main = td.launches_for(call, 90)[0]
    assert [main.constexprs[k] for k in ("QD_KIND", "KD_KIND", "VD_KIND")] == [0, 1, 2]


# --------------------------------------------------------------------------- DECODE_CONFIG

CONFIGS = ["prefetch", "kbits", "vbits", "prefetch+kbits+vbits"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", ["causal", "alibi"])
def test_decode_config_variants(interp, config, name):
    """Each variant against the float64 oracle, as the default kernel is (3 splits: partial and
    full tiles in several programs)."""
    s = SHAPE
    stored, descales = _quantize(*_data(*s.values(), seed=10), q_fp8=False)
    score_mod, mask_mod = _decode_mods(name, s["B"], s["Hq"], s["L"], s["S"])
    check(stored, descales, score_mod, mask_mod, _mask(mask_mod, s["B"], s["Hq"], s["L"], s["S"]), 3,
          kernel_options={"DECODE_CONFIG": config})


@pytest.mark.parametrize("q_fp8", [False, True])
def test_decode_config_accuracy(interp, q_fp8):
    """The bit conversions keep the unquantised attention's error within 1.1 x the plain FP8
    reference's (they are exact), e4m3 queries included; large channels as the worst case."""
    check_config_accuracy(_data(*SHAPE.values(), seed=11, outliers=True), q_fp8, splits=2)


def check_config_accuracy(qkv, q_fp8: bool, splits: int):
    """Every DECODE_CONFIG token at once on unquantised ``qkv``: error within 1.1 x the plain FP8
    reference's against their float64 attention (``assert_fp8_accuracy``)."""
    q, k, v = qkv
    stored, descales = _quantize(q, k, v, q_fp8)
    call = prepare_call(*stored, None, None, None, True, {"DECODE_CONFIG": "prefetch+kbits+vbits"},
                        fp8=(*descales, None))
    out, lse, _ = td.forward(call, splits=splits)
    true, true_lse = dense_attention(q, k, v)
    plain, plain_lse = fp8_reference(*stored, descales)
    assert_fp8_accuracy("out", out, true, plain)
    assert_fp8_accuracy("lse", lse, true_lse, plain_lse)


def test_decode_config_is_checked():
    s = SHAPE
    (qb, k8, v8), descales = _quantize(*_data(*s.values(), seed=12), q_fp8=False)
    with pytest.raises(ValueError, match="unknown"):
        td.make_plan(prepare_call(qb, k8, v8, None, None, None, True, {"DECODE_CONFIG": "prefetch+fast"},
                                  fp8=(*descales, None)))
    with pytest.raises(ValueError, match="need e4m3 K/V"):  # a 16-bit cache has nothing to convert
        td.make_plan(prepare_call(qb, qb[:, :2], qb[:, :2], None, None, None, True,
                                  {"DECODE_CONFIG": "vbits"}))
    with pytest.raises(ValueError, match="need e4m3 K/V"):  # float32 tiles beside a float32 query
        td.make_plan(prepare_call(qb.float(), k8, v8, None, None, None, True, {"DECODE_CONFIG": "kbits"},
                                  fp8=(*descales, None)))
    plan = td.make_plan(prepare_call(qb, k8, v8, None, None, None, True, {"DECODE_CONFIG": "vbits+prefetch"},
                                     fp8=(*descales, None)))
    assert plan.config == {"prefetch", "vbits"} and "prefetch+vbits" in plan.describe(s["B"])


def test_bit_conversions_compile_for_sm90():
    """kbits+vbits: no e4m3 conversion instruction is left, byte permutes take its place."""
    B, Hq, Hkv, L, S = 8, 32, 8, 1, 32768
    q = torch.empty(B, Hq, L, 128, dtype=torch.bfloat16)
    k8 = torch.empty(B, Hkv, S, 128, dtype=E4M3)
    call = prepare_call(q, k8, k8, None, None, None, True, {"DECODE_CONFIG": "prefetch+kbits+vbits"},
                        fp8=(None, torch.ones(B, Hkv), torch.ones(B, Hkv), None))
    main = td.launches_for(call, 90)[0]
    assert main.constexprs["K_BITS"] and main.constexprs["V_BITS"] and main.constexprs["PREFETCH"]
    ptx = tb.compile_launch(tb.make_plan(call, arch=90, interpret=False), main, 90).asm["ptx"]
    assert "e4m3" not in ptx and "prmt.b32" in ptx
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", ptx)


# --------------------------------------------------------------------------- prefill road


@pytest.mark.parametrize("outliers", [False, True])
def test_prefill_dequantises_first(interp, outliers):
    """Q_LEN = KV_LEN: the prefill kernel, on inputs dequantised to bf16 first."""
    B, Hq, Hkv, L, E = 1, 4, 2, 64, 32
    q, k, v = _data(B, Hq, Hkv, L, L, E, seed=7, outliers=outliers)
    stored, descales = _quantize(q, k, v, q_fp8=True)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    bm = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    kw = dict(block_mask=bm, enable_gqa=True, backend="triton", return_lse=True,
              q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    assert "FP8 inputs dequantised to bfloat16 on the device first" in flexjit.explain(
        *stored, **{k_: v_ for k_, v_ in kw.items() if k_ != "return_lse"}).reason
    out, lse = flex_attention(*stored, **kw)
    real = _real(stored, descales)
    ref, ref_lse = dense_attention(*real, None, causal)
    low, low_lse = dense_attention(*(t.to(torch.bfloat16) for t in real), None, causal,
                                   dtype=torch.bfloat16)  # the bf16 kernel's own baseline
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.bfloat16])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.bfloat16])
    true, true_lse = dense_attention(q, k, v, None, causal)
    plain, plain_lse = fp8_reference(*stored, descales, None, causal)
    assert_fp8_accuracy("out", out, true, plain)
    assert_fp8_accuracy("lse", lse, true_lse, plain_lse)


def test_explain_on_a_gpus_order(interp, monkeypatch):
    """The auto order of a GPU, faked: a decode call's FP8 goes to the decode kernel as it is; a
    prefill call's to CuTe dequantised (which refuses the CPU tensors), then Triton dequantised."""
    from flexjit.runtime import dispatch
    monkeypatch.setattr(dispatch, "_preference", lambda device: ("cute", "triton", "reference"))
    s = SHAPE
    stored, descales = _quantize(*_data(*s.values(), seed=8), q_fp8=True)
    kw = dict(enable_gqa=True, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    choice = flexjit.explain(*stored, **kw)
    assert choice.name == "triton" and "split-KV decode kernel reads the FP8 tiles" in choice.reason
    assert "converted to float16 in the kernel" in choice.reason
    stored, descales = _quantize(*_data(1, 4, 2, 64, 64, 32, seed=8), q_fp8=True)  # prefill
    kw = dict(enable_gqa=True, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    choice = flexjit.explain(*stored, **kw)
    assert choice.name == "triton" and "dequantised to bfloat16 on the device first" in choice.reason
    assert dict(choice.passed_over)["cute"] == ("needs a CUDA tensor, got cpu (with the FP8 inputs "
                                                "dequantised to bfloat16)")


# --------------------------------------------------------------------------- compile-only


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, E4M3])
def test_compiles_for_sm90(q_dtype):
    """The FP8 decode kernel for a named sm_90 target, without a GPU (Triton's e4m3 type needs
    sm89+): K/V loaded as bytes, converted two at a time (cvt.rn.f16x2.e4m3x2) and nothing more
    (no per-element float16 → bfloat16 step: three conversions a pair made the kernel
    conversion-bound), float16 tensor-core MMAs for a bfloat16 query too; a softcap over a causal mask, GQA 4:1, D=128 (the decode benchmark's
    shape). The bf16 call's launch of the same template takes no table and converts nothing."""
    B, Hq, Hkv, L, S = 8, 32, 8, 1, 32768
    q = torch.empty(B, Hq, L, 128, dtype=q_dtype)
    k8 = torch.empty(B, Hkv, S, 128, dtype=E4M3)
    score_mod, mask_mod = _decode_mods("softcap", B, Hq, L, S)
    bm = create_block_mask(mask_mod, None, None, L, S, device="cpu")
    call = prepare_call(q, k8, k8, score_mod, bm, None, True, None, max_scores=True,
                        fp8=(torch.ones(B, Hkv) if q_dtype == E4M3 else None, torch.ones(()), None, None))
    main = td.launches_for(call, 90)[0]
    assert main.constexprs["KV_FP8"] and main.constexprs["Q_FP8"] == (q_dtype == E4M3)
    ptx = tb.compile_launch(tb.make_plan(call, arch=90, interpret=False), main, 90).asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.bf16.f16" not in ptx
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", ptx) or "wgmma" in ptx
    bf16 = prepare_call(q.to(torch.bfloat16), k8.to(torch.bfloat16), k8.to(torch.bfloat16), score_mod, bm,
                        None, True, None, max_scores=True)
    main16 = td.launches_for(bf16, 90)[0]
    assert not main16.constexprs["KV_FP8"] and None in main16.args  # descales: None, compiled out
    ptx16 = tb.compile_launch(tb.make_plan(bf16, arch=90, interpret=False), main16, 90).asm["ptx"]
    assert "e4m3" not in ptx16


def test_long_fp8_caches_default_to_the_integer_v_conversion():
    """Without DECODE_CONFIG an FP8 cache of VBITS_MIN_KEYS keys or more plans "vbits"; a shorter
    one, a bf16 cache and an explicit "" plan the plain kernel (plans only: no kernel runs)."""
    from flexjit.api.attention import prepare_call

    def plan(S, fp8=True, options=None):
        q = torch.empty(1, 8, 1, 64, dtype=torch.bfloat16)
        kv = torch.empty(1, 2, S, 64, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        call = prepare_call(q, kv, kv, None, None, None, True, options,
                            fp8=(None, None, None, None))
        return td._config(call)
    assert plan(td.VBITS_MIN_KEYS) == {"vbits"}
    assert plan(td.VBITS_MIN_KEYS - 1) == frozenset()
    assert plan(td.VBITS_MIN_KEYS, fp8=False) == frozenset()
    assert plan(td.VBITS_MIN_KEYS, options={"DECODE_CONFIG": ""}) == frozenset()
