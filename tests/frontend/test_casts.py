"""Casts inside mods, as torch computes them: float16/bfloat16 round to nearest even, int8/int16/
uint8 wrap, floats truncate toward zero into integers, and what follows a cast has torch's dtype
(an op on float16 values rounds its result to float16, a number compared with one is rounded to
it, an index meeting one is converted to it). float64 is refused: a mod's floats are float32.

* The dtype rules, bit for bit: every mod traced and run by the interpreter in float32 equals the
  same mod run by torch as its flex_attention runs mods (vmapped over b, h, q_idx, kv_idx).
* Attention on the reference and the Triton kernels (interpreted): values against torch's own
  flex_attention (eager, CPU), gradients against the reference in float64. A cast's gradient is
  straight through (torch's also rounds the gradient to the narrow dtype; flexjit's kernels
  multiply the local derivatives instead), so the reference in float64 is the oracle here.
* The CuTe kernels compile for sm_90a with the roundings as cvt.rn instructions (slow).
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from torch.nn.attention import flex_attention as torch_flex
from torch.nn.attention.flex_attention import _vmap_for_bhqkv

from flexjit import TraceError, flex_attention
from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, trace_mod
from flexjit.ir import nodes as ir
from flexjit.ir.interp import Env, evaluate
from flexjit.ir.passes import lower, rewrite
from oracle import FLOOR, assert_close_to_oracle

# 24 queries and 40 keys, as tests/frontend/test_torch_ops.py: ragged against the Triton tests'
# blocks, and kv_idx past 32 so that kv * 2000 overflows float16.
B, H, L, S, D = 1, 2, 24, 40, 16
g = torch.Generator().manual_seed(0)
W2 = (torch.rand(H, generator=g) + 0.5).requires_grad_()  # a learnable factor rounded to float16

SCORE_MODS = {
    "half_arithmetic": lambda s, b, h, q, kv: (s.half() * 3 + 1).to(s.dtype) * 0.25
    + (s.half() / 3).to(s.dtype) + (s.half() - 0.1).to(s.dtype) + (-s.half()).abs().to(s.dtype),
    # (functions whose float32 kernels torch rounds correctly: its vectorized float32 sqrt is not,
    # so float32-then-round need not be torch's float16 sqrt in the last bit)
    "half_functions": lambda s, b, h, q, kv: torch.exp(s.half()).to(s.dtype) * 0.1
    + torch.tanh(s.half() * 2).to(s.dtype) + torch.floor(s.half() * 4).to(s.dtype) * 0.25
    + (1.5 / (s.half().abs() + 1)).to(s.dtype) + (s.half() ** 2).to(s.dtype),
    "bf16_and_mixed": lambda s, b, h, q, kv: (s.bfloat16() * 5).to(s.dtype) + s.half() * s
    + torch.where(q > kv, s.half(), 0.3).to(s.dtype) + (s.half() < 0.1) * 1.0
    + torch.maximum(s.half(), s.bfloat16()).to(s.dtype),
    "half_indices": lambda s, b, h, q, kv: s + (q - kv).half() * 0.01
    + torch.where(kv.half() * 2000 == float("inf"), -1.0, 0.0),
    "int_casts": lambda s, b, h, q, kv: s + (s * 3).int() * 0.5 + (s * 3).long() * 0.25 + s.to(torch.int32)
    - (kv + 100).to(torch.int8) * 0.01 + kv.byte() * 0.1 + (q * 2000).short() * 1e-4
    + (kv.to(torch.uint8) - 30) * 0.01 + (kv.char() * 5) * 0.001,
    "type_and_to": lambda s, b, h, q, kv: s.type(torch.float16).to(s.dtype) + s.to(torch.bfloat16).to(s.dtype)
    + s.to(dtype=torch.float16).type(s.dtype) + s.type("torch.HalfTensor").to(s.dtype) + (s * 4).to(q) * 0.5,
    "half_constants": lambda s, b, h, q, kv: s + (torch.tensor(0.1, dtype=torch.float16) * q).to(s.dtype)
    + torch.full_like(s.half(), 0.3).to(s.dtype) + (s.half() + torch.zeros_like(s.half())).to(s.dtype),
    "learnable_through_a_cast": lambda s, b, h, q, kv: (W2[h].half() * s.half()).to(s.dtype),
}
LEARNABLE = {"learnable_through_a_cast": (W2,)}

MASK_MODS = {
    "half_compare": lambda b, h, q, kv: (q.half() * 0.37 <= kv) & ((kv * 2000).half() != float("inf")),
    "int8_wrap": lambda b, h, q, kv: (kv + 100).to(torch.int8) > 0,
    "uint8_difference": lambda b, h, q, kv: (q.byte() - kv.byte()) < 200,
    "bf16_rounding": lambda b, h, q, kv: (q.float() / 3).bfloat16() < kv.float() / 3,
}


def _torch_runs(mod, score, s):
    """The mod over every (b, h, q, kv) as torch's flex_attention runs it: vmapped, indices
    int64. (torch's eager kernels on whole tensors keep a Python number at float32 in mul and
    div with a float16 tensor; under vmap, as in flex_attention, every op converts it first.)"""
    with TransformGetItemToIndex():
        fn = _vmap_for_bhqkv(mod, prefix=(0,) if score else ())
        idx = [torch.arange(n) for n in (B, H, L, S)]
        return fn(s, *idx) if score else fn(*idx)


@pytest.mark.parametrize("name", list(SCORE_MODS) + list(MASK_MODS))
def test_the_interpreter_computes_what_torch_does_bit_for_bit(name):
    score = name in SCORE_MODS
    mod = SCORE_MODS[name] if score else MASK_MODS[name]
    traced = trace_mod(mod, SCORE_MOD if score else MASK_MOD)
    program = lower(traced, None, lengths=(B, H, L, S)) if score else lower(None, traced, lengths=(B, H, L, S))
    s = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(5)) * 3
    with torch.no_grad():
        want = _torch_runs(mod, score, s)
    idx = [torch.arange(n, dtype=torch.int32).view(*[-1 if i == d else 1 for i in range(4)])
           for d, n in enumerate((B, H, L, S))]
    env = Env(*idx, score=s, buffers=tuple(b.detach() for b in program.buffers))
    for out in (traced.out, program.score if score else program.mask):  # as traced, and lowered
        got = evaluate(out, env).expand(B, H, L, S)
        assert got.dtype == (torch.float32 if score else torch.bool)
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0, equal_nan=True)
    # The check can fail: with the roundings taken out, the float16/bfloat16 mods differ.
    if any(n.op in ir.LOW_PRECISION for n in ir.walk(traced.out)):
        unrounded = rewrite([traced.out], lambda n, srcs: srcs[0] if n.op in ir.LOW_PRECISION
                            else ir.node(n.op, n.dtype, srcs, n.arg))[0]
        assert not torch.equal(evaluate(unrounded, env).expand(B, H, L, S), want.to(got.dtype))


def test_casts_build_the_rounding_ops_and_a_float_cast_is_straight_through():
    # A round trip through float16 is one ROUND_F16 (two casts to it are one), .float() of it
    # adds nothing; d/ds of the round trip is 1, of an integer cast 0.
    out = trace_mod(lambda s, b, h, q, kv: s.half().half().float() + s.int(), SCORE_MOD).out
    program = lower(trace_mod(lambda s, b, h, q, kv: s.half().half().float() + s.int(), SCORE_MOD), None)
    assert sum(n.op is ir.Op.ROUND_F16 for n in ir.walk(program.score)) == 1
    assert program.dscore.op is ir.Op.CONST and program.dscore.arg == 1.0
    assert any(n.op is ir.Op.CAST and n.dtype is ir.DType.INT32 for n in ir.walk(out))
    # a value already held exactly (a sign change, a select, a constant of the format) is not
    # rounded again
    kept = lower(trace_mod(lambda s, b, h, q, kv: torch.where(q > kv, -s.half(), 0.5).float(), SCORE_MOD), None)
    assert sum(n.op is ir.Op.ROUND_F16 for n in ir.walk(kept.score)) == 1


def test_what_cannot_be_kept_is_refused():
    cases = {
        r"cast to torch.float64: flexjit computes a mod's floating values in float32":
            lambda s, b, h, q, kv: s.double() * 2,
        r"cast to torch.float64": lambda s, b, h, q, kv: s.to(torch.float64),
        r"cast to torch.complex64 inside a mod is not supported": lambda s, b, h, q, kv: s.to(torch.complex64).real,
        r"cast to torch.float8_e4m3fn": lambda s, b, h, q, kv: s.to(torch.float8_e4m3fn).float(),
        r"Tensor.type\('torch.SparseTensor'\)": lambda s, b, h, q, kv: s.type("torch.SparseTensor"),
    }
    for why, mod in cases.items():
        with pytest.raises(TraceError, match=why):
            trace_mod(mod, SCORE_MOD)


# --------------------------------------------------------------------------- attention


def _grid_qkv(seed):
    """q, k, v on a grid of quarters: every score (q·k)/4 is a multiple of 1/64 below 2^8, exact
    in float32 and float64 alike, so a rounding to float16 or a truncation sees the same score in
    every run and precision."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.round(torch.randn(B, H, n, D, generator=gen) * 4) / 4 for n in (L, S, S))
    return [t.requires_grad_(True) for t in (q, k, v)]


def _torch_flex(q, k, v, mod, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's advice to compile
        return torch_flex.flex_attention(*(t.detach().to(dtype) for t in (q, k, v)), score_mod=mod,
                                         return_lse=True)


def _summed(names):
    mods = [SCORE_MODS[n] for n in names]

    def every(s, b, h, q, kv):
        return sum(m(s, b, h, q, kv) for m in mods) * (1.0 / len(mods))
    return every


def _check(backend, mod, learnable, seed):
    q, k, v = _grid_qkv(seed)
    out, lse = flex_attention(q, k, v, score_mod=mod, return_lse=True, backend=backend)
    ref, ref_lse = _torch_flex(q, k, v, mod, torch.float64)
    low, low_lse = _torch_flex(q, k, v, mod, torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32] * max(1.0, ref.abs().max().item()))
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.float32] * max(1.0, ref_lse.abs().max().item()))
    inputs = (q, k, v, *learnable)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    got = torch.autograd.grad(out, inputs, dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = flex_attention(q64, k64, v64, score_mod=mod, backend="reference")
    want = torch.autograd.grad(ref, (q64, k64, v64, *learnable), dout.double())
    low = flex_attention(q, k, v, score_mod=mod, backend="reference")
    lowg = torch.autograd.grad(low, inputs, dout)
    names = ("dq", "dk", "dv") + tuple(f"dcapture{i}" for i in range(len(learnable)))
    for name, a, w, lw in zip(names, got, want, lowg):
        assert_close_to_oracle(name, a, w.double(), lw, FLOOR[torch.float32] * max(1.0, w.abs().max().item()))


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_reference_backend_matches_torch(name):
    _check("reference", SCORE_MODS[name], LEARNABLE.get(name, ()), seed=1)


def _interpreted(monkeypatch):
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("the interpreter tests need triton >= 3.9")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLEXJIT_POISON", "1")


def test_triton_kernels_match_torch(monkeypatch):
    _interpreted(monkeypatch)
    # One fwd and one bwd module for all but half_functions: a transcendental's float32 result
    # differs by an ulp between libms (torch's, libdevice, the interpreter's shims), which a
    # rounding to float16 can turn into a float16 ulp; the interpreter's bit-for-bit test and
    # the reference backend's cover it, and the roundings render as for the rest.
    names = [n for n in SCORE_MODS if n != "half_functions"]
    _check("triton", _summed(names), tuple(t for n in names for t in LEARNABLE.get(n, ())), seed=2)


def test_heaviside_of_the_score_matches_torch(monkeypatch):
    # Forward only: torch has no derivative for heaviside. The grid's scores hit 0 exactly, where
    # the values argument is taken.
    _interpreted(monkeypatch)

    def step(s, b, h, q, kv):
        return s + torch.heaviside(s, torch.full_like(s, 0.5)) - torch.heaviside(-s * 2, torch.full_like(s, 0.25))
    q, k, v = _grid_qkv(3)
    assert ((q @ k.transpose(-1, -2)) == 0).any(), "no score is exactly 0: the values argument is untested"
    ref, ref_lse = _torch_flex(q, k, v, step, torch.float64)
    low, low_lse = _torch_flex(q, k, v, step, torch.float32)
    for backend in ("reference", "triton"):
        out, lse = flex_attention(q, k, v, score_mod=step, return_lse=True, backend=backend)
        assert_close_to_oracle(f"{backend} out", out, ref, low, FLOOR[torch.float32])
        assert_close_to_oracle(f"{backend} lse", lse, ref_lse, low_lse, FLOOR[torch.float32])


@pytest.mark.slow
def test_cute_kernels_compile_with_the_new_ops_and_casts(tmp_path, monkeypatch):
    # The new IR ops (atan2, the roundings) and the compositions render through the CuTe op table
    # into the sm90 forward and backward; the roundings are cvt.rn conversions in the PTX.
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # read once, when cutlass is first imported
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    from flexjit.integrations.aot import compile_kernels

    def every(s, b, h, q, kv):
        return (torch.atan2(s, (q - kv).float() + 0.5) + torch.hypot(s, kv * 0.1) + torch.logaddexp(s, -s)
                + torch.xlogy(F.relu(s), s * s + 1) + torch.logit(torch.sigmoid(s), 0.01)
                + (s.half() * 3).float() + s.bfloat16().float() + (kv + 100).to(torch.int8))

    def mask(b, h, q, kv):
        return (q.half() * 0.37 <= kv) | (torch.hypot((q - kv).float(), 3.0 + q * 0) < 4)
    # AUTOTUNE off: the run's own kernels, not the tuner's other candidates
    kernels = compile_kernels(every, mask, arch="sm_90a", head_dim=64, seq_len=256, heads=2,
                              out=tmp_path / "ptx",
                              kernel_options={"AUTOTUNE": False})
    assert [(k.pass_, k.part) for k in kernels] == [("fwd", "main"), ("bwd", "pre"),
                                                    ("bwd", "main"), ("bwd", "post")]
    ptx = {p.parent.name: p.read_text() for p in (tmp_path / "ptx").rglob("*.ptx")}
    for part in ("fwd-main", "bwd-main"):
        text = next(t for name, t in ptx.items() if name.startswith(part))
        assert "cvt.rn.f16.f32" in text and "cvt.rn.bf16.f32" in text, f"{part}: no rounding to float16/bfloat16"
