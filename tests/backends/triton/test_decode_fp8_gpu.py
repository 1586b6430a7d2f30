"""The split-KV decode kernel reading an FP8 KV cache on CUDA (marked gpu), compiled for the GPU
it runs on: the same checks as test_decode_fp8.py's under the interpreter, at the decode
benchmark's head dim (D = 128) and a ragged KV_LEN of 4133 (33 kv blocks of 128, so splits fall
mid-block), GQA 4:1, bf16 / fp16 / e4m3 queries, every core mod (softcap's max_scores with FAST_MATH on and
off); accuracy against the
unquantised attention (≤ 1.1 × the plain FP8 reference's error) with and without outlier
channels; a bf16 query whose rows differ by 2^20 in magnitude (the kernel's per-row power-of-two
scaling into float16 must keep the small rows exact); the DECODE_CONFIG variants (prefetch,
kbits, vbits: the inline-assembly bit conversions run only here) through the same checks.
"""
import pytest
import torch

from flexjit import create_block_mask
from flexjit.api.attention import prepare_call
from flexjit.backends.triton import decode as td
from oracle import assert_fp8_accuracy, dense_attention, fp8_reference
from test_decode import _decode_mods
from test_decode_fp8 import _data, _quantize, check, check_config_accuracy

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("Triton's e4m3 loads need sm89 or newer", allow_module_level=True)

DEV = "cuda"
SHAPE = dict(B=2, Hq=8, Hkv=2, L=3, S=4133, E=128)


def _mask(mask_mod, L, S):
    return None if mask_mod is None else create_block_mask(mask_mod, None, None, L, S, device=DEV)


def _on_gpu(stored, descales):
    return (tuple(t.to(DEV) for t in stored),
            tuple(d.to(DEV) if d is not None else None for d in descales))


@pytest.mark.parametrize("name", ["full", "causal", "sliding_window", "alibi", "document"])
@pytest.mark.parametrize("q_kind", ["bf16", "e4m3"])
def test_core_mods(name, q_kind):
    s = dict(SHAPE, S=461) if name == "document" else SHAPE  # the id table covers 461 keys
    stored, descales = _on_gpu(*_quantize(*_data(*s.values(), seed=1), q_fp8=q_kind == "e4m3"))
    score_mod, mask_mod = _decode_mods(name, s["B"], s["Hq"], s["L"], s["S"], device=DEV)
    bm = _mask(mask_mod, s["L"], s["S"])
    for splits in (1, 5):
        check(stored, descales, score_mod, mask_mod, bm, splits)


@pytest.mark.parametrize("fast_math", [True, False])
def test_softcap_max_scores(fast_math):
    """max_scores through a tanh: with FAST_MATH (the default) the kernel's MUFU tanh errs up to
    2^-11 relative, so max_scores is held to bfloat16 math as the 16-bit decode kernel's is; with
    FAST_MATH off, libdevice's tanh, held to float32 math."""
    s = SHAPE
    stored, descales = _on_gpu(*_quantize(*_data(*s.values(), seed=1), q_fp8=False))
    score_mod, mask_mod = _decode_mods("softcap", s["B"], s["Hq"], s["L"], s["S"], device=DEV)
    check(stored, descales, score_mod, mask_mod, _mask(mask_mod, s["L"], s["S"]), 3,
          kernel_options={"FAST_MATH": fast_math},
          max_dtype=torch.bfloat16 if fast_math else torch.float32)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_queries(q_dtype):
    s = SHAPE
    (qb, k8, v8), descales = _on_gpu(*_quantize(*_data(*s.values(), seed=2), q_fp8=False))
    check((qb.to(q_dtype), k8, v8), descales, None, None, None, 4)


def test_rows_far_apart_in_magnitude():
    s = SHAPE
    q, k, v = _data(*s.values(), seed=3)
    q[:, 0::2] *= 2.0 ** -10  # heads 2^20 apart share a program (GQA packs them as rows)
    q[:, 1::2] *= 2.0 ** 10
    stored, descales = _on_gpu(*_quantize(q, k, v, q_fp8=False))
    check(stored, descales, None, None, None, 3)


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("q_fp8", [False, True])
def test_accuracy_against_the_unquantised_attention(outliers, q_fp8):
    s = SHAPE
    q, k, v = (t.to(DEV) for t in _data(*s.values(), seed=4, outliers=outliers))
    score_mod, mask_mod = _decode_mods("softcap", s["B"], s["Hq"], s["L"], s["S"], device=DEV)
    stored, descales = _quantize(q, k, v, q_fp8)
    call = prepare_call(*stored, score_mod, _mask(mask_mod, s["L"], s["S"]), None, True, None,
                        fp8=(*descales, None))
    out, lse, _ = td.forward(call, splits=3)
    true, true_lse = dense_attention(q, k, v, score_mod, mask_mod)
    plain, plain_lse = fp8_reference(*stored, descales, score_mod, mask_mod)
    assert_fp8_accuracy("out", out, true, plain)
    assert_fp8_accuracy("lse", lse, true_lse, plain_lse)


@pytest.mark.parametrize("config", ["prefetch", "kbits", "vbits", "prefetch+vbits", "prefetch+kbits+vbits"])
@pytest.mark.parametrize("name", ["causal", "alibi"])
def test_decode_config_variants(config, name):
    s = SHAPE
    stored, descales = _on_gpu(*_quantize(*_data(*s.values(), seed=5), q_fp8=False))
    score_mod, mask_mod = _decode_mods(name, s["B"], s["Hq"], s["L"], s["S"], device=DEV)
    bm = _mask(mask_mod, s["L"], s["S"])
    for splits, opts in ((1, {}), (5, {}), (3, {"BLOCK_N": 64, "num_stages": 4})):
        check(stored, descales, score_mod, mask_mod, bm, splits,
              kernel_options=dict(opts, DECODE_CONFIG=config))


@pytest.mark.parametrize("q_fp8", [False, True])
def test_decode_config_accuracy(q_fp8):
    check_config_accuracy([t.to(DEV) for t in _data(*SHAPE.values(), seed=6, outliers=True)], q_fp8,
                          splits=3)
