"""On the GPU: autocast, torch.compile (inductor, aot_eager, CUDA graphs), fp32 and
transformers through the cute and Triton backends.

Marker ``gpu``. Every result is compared with eager flexjit on the same inputs (itself checked
against float64 in the backends' GPU tests) or with float64 math, with tolerances from the data.
Shapes: B=2, 8 query / 4 KV heads, S=1000 (ragged against 128), D=128, bf16 unless stated: big
enough for full, partial and empty blocks in both kernels, small enough to compile quickly.
"""
import copy
import logging

import pytest
import torch

import flexjit
from flexjit import create_block_mask
from flexjit.api.attention import flex_attention
from flexjit import mods
from oracle import FLOOR, assert_close_to_oracle, dense_attention

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
HOPPER = torch.cuda.get_device_capability() == (9, 0)
BACKENDS = ["cute", "triton"] if HOPPER else ["triton"]
B, HQ, HKV, S, D = 2, 8, 4, 1000, 128
DEV = "cuda"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(seed, dtypes=(torch.bfloat16,) * 3):
    g = torch.Generator(device=DEV).manual_seed(seed)
    shapes = [(B, HQ, S, D), (B, HKV, S, D), (B, HKV, S, D)]
    return [torch.randn(s, device=DEV, generator=g).to(dt).requires_grad_(True) for s, dt in zip(shapes, dtypes)]


SLOPES = torch.nn.Parameter(torch.linspace(-0.3, 0.3, HQ, device=DEV))


def learnable_alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed))
    return torch.autograd.grad((out.float() * g).sum(), inputs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_mixed_dtypes_run_the_16_bit_kernel(backend):
    # RoPE under autocast: fp32 q/k, bf16 v. The call must run the bf16 kernel of `backend` (not
    # an fp32 path), return bf16, and send fp32 gradients to q/k and bf16 ones to v.
    q, k, v = _qkv(2, (torch.float32, torch.float32, torch.bfloat16))
    bm = create_block_mask(causal, None, None, S, S, device=DEV)
    alibi = mods.alibi(mods.alibi_slopes(HQ).to(DEV))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        choice = flexjit.explain(q, k, v, alibi, bm, enable_gqa=True, backend=backend)
        out = flex_attention(q, k, v, alibi, bm, enable_gqa=True, backend=backend)
    assert out.dtype == torch.bfloat16 and choice.name == backend
    cast = [t.detach().bfloat16() for t in (q, k, v)]
    ref = dense_attention(*cast, alibi, causal, dtype=torch.float64)[0]
    low = dense_attention(*cast, alibi, causal, dtype=torch.bfloat16)[0]
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.bfloat16])
    dq, dk, dv = _grads(out, [q, k, v])
    assert (dq.dtype, dk.dtype, dv.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize("compile_backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_equals_eager_and_runs_the_same_program(backend, compile_backend, programs_run):
    seen = programs_run
    bm = create_block_mask(causal, None, None, S, S, device=DEV)

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=learnable_alibi, block_mask=bm, enable_gqa=True,
                              backend=backend)

    q, k, v = _qkv(3)
    want = f(q, k, v)
    want_g = _grads(want, [q, k, v, SLOPES])
    got = torch.compile(f, fullgraph=True, backend=compile_backend)(q, k, v)
    assert torch.equal(got, want)
    for a, b_ in zip(_grads(got, [q, k, v, SLOPES]), want_g):
        # The same kernels on the same inputs; dQ and the slopes' gradient sum atomics in any
        # order, so those agree to rounding, not bit for bit.
        torch.testing.assert_close(a, b_, rtol=1e-2, atol=1e-3)
    assert seen[0] == seen[-1] and seen[0][0] == backend, seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_overhead_cuda_graphs(backend):
    # mode="reduce-overhead": the attention launches are captured in a CUDA graph; replays with new
    # input values must give the new answers (no host sync or allocation breaks the capture).
    bm = create_block_mask(mods.sliding_window(256), None, None, S, S, device=DEV)

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=mods.softcap(30.0), block_mask=bm, enable_gqa=True,
                              backend=backend)

    cf = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    for seed in range(4, 8):
        q, k, v = [t.detach() for t in _qkv(seed)]
        with torch.no_grad():
            got = cf(q, k, v).clone()
            want = f(q, k, v)
        assert torch.equal(got, want), f"replay {seed}: {(got.float() - want.float()).abs().max()}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_overhead_training_step(backend):
    # Forward and backward both captured: gradients from the replays equal eager's.
    bm = create_block_mask(causal, None, None, S, S, device=DEV)

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=mods.softcap(30.0), block_mask=bm, enable_gqa=True,
                              backend=backend)

    cf = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    for seed in (11, 12, 13):
        q, k, v = _qkv(seed)
        got = [g.clone() for g in _grads(cf(q, k, v), [q, k, v])]
        want = _grads(f(q, k, v), [q, k, v])
        for a, b_ in zip(got, want):
            torch.testing.assert_close(a, b_, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_mask_made_inside_the_compiled_graph(backend):
    # create_block_mask inside torch.compile(fullgraph=True): document ids are a graph input; new
    # ids give a new plan.
    def f(q, k, v, doc):
        def doc_causal(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
        bm = create_block_mask(doc_causal, B, None, S, S, device=DEV)
        return flex_attention(q, k, v, block_mask=bm, enable_gqa=True, backend=backend)

    cf = torch.compile(f, fullgraph=True)
    q, k, v = [t.detach() for t in _qkv(14)]
    for cut in (300, 700):
        doc = (torch.arange(S, device=DEV) >= cut).long().expand(B, S).contiguous()
        assert torch.equal(cf(q, k, v, doc), f(q, k, v, doc)), cut


def test_fp32_follows_the_matmul_precision():
    # fp32 inputs: IEEE dots by default, TF32 under set_float32_matmul_precision("high"); each
    # within twice the error of torch's own fp32 math at that precision (against float64).
    q, k, v = [t.detach() for t in _qkv(9, (torch.float32,) * 3)]
    bm = create_block_mask(causal, None, None, S, S, device=DEV)
    ref = dense_attention(q, k, v, mods.softcap(20.0), causal, dtype=torch.float64)[0]
    before = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high"):
            torch.set_float32_matmul_precision(precision)
            got = flex_attention(q, k, v, mods.softcap(20.0), bm, enable_gqa=True)
            low = dense_attention(q, k, v, mods.softcap(20.0), causal, dtype=torch.float32)[0]
            err = (got.double() - ref).abs().max().item()
            bound = 2 * (low.double() - ref).abs().max().item() + 1e-5
            assert err <= bound, f"{precision}: {err:.3g} > {bound:.3g}"
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_compile_logs_one_line(caplog):
    # Every compile longer than about a second logs the kernel, the mod and the time.
    def fresh(score, b, h, q_idx, kv_idx):  # a mod no other test compiles
        return score * 0.75 + (q_idx - kv_idx) * 0.0009765625
    q, k, v = [t.detach() for t in _qkv(10)]
    with caplog.at_level(logging.INFO, logger="flexjit"):
        flex_attention(q, k, v, score_mod=fresh, enable_gqa=True, backend="triton")
    lines = [r.getMessage() for r in caplog.records if "fresh" in r.getMessage()]
    assert lines and ("compiled in" in lines[0] or "ready in" in lines[0]), caplog.text


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_transformers_training_step_under_autocast(family):
    transformers = pytest.importorskip("transformers")
    import flexjit.integrations.transformers  # noqa: F401

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, attention_dropout=0.0)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common)
    else:
        cfg = transformers.Gemma2Config(**common, attn_logit_softcapping=50.0, sliding_window=256,
                                        query_pre_attn_scalar=D, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    models = {impl: transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl).to(DEV)
              for impl in ("eager", "flexjit")}
    models["flexjit"].load_state_dict(models["eager"].state_dict())
    ids = torch.randint(0, 512, (2, S), device=DEV)
    mask = torch.ones(2, S, dtype=torch.long, device=DEV)
    mask[0, :300] = 0  # left padding across whole 128-blocks
    labels = torch.where(mask.bool(), ids, -100)
    golden = models["eager"](input_ids=ids, attention_mask=mask, labels=labels).loss.item()  # fp32
    losses = {}
    for impl, m in models.items():
        m.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        losses[impl] = out.loss.item()
        assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    # Under autocast, flexjit's loss is within twice eager attention's distance from fp32 eager.
    assert abs(losses["flexjit"] - golden) <= 2 * abs(losses["eager"] - golden) + 1e-3, (golden, losses)
