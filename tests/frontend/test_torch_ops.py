"""Torch ops in mods that torch's flex accepts: activations (relu, gelu, softplus, ...),
masked_fill, isin, nan_to_num, isnan/isinf, lerp, addcmul/addcdiv, rounding divisions,
constants made inside a mod (torch.tensor(c), torch.full, torch.zeros), bool arithmetic, clamp
with tensor bounds, sign, remainder/fmod on negatives.

Values against torch's own flex_attention (eager, CPU) in float64, with its float32 run as the
baseline of the tolerance; gradients against float64 autograd through the same mods
(tests/oracle.py: torch's flex has no CPU backward), on the reference backend for every op and
on the Triton kernels under the interpreter for groups of them. Mask mods through the planner
against torch's dense mask. The CuTe kernels compile for sm_90a (slow).
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

from flexjit import TraceError, create_block_mask, flex_attention
from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, trace_mod
from oracle import FLOOR, assert_close_to_oracle, dense_attention, random_qkv

# 24 queries and 40 keys: ragged against the Triton tests' 16- and 32-blocks; head dim 16 keeps
# the scores near N(0, 1), where the activations' kinks and thresholds are crossed.
B, H, L, S, D = 1, 2, 24, 40, 16

g = torch.Generator().manual_seed(0)
IDS = torch.tensor([1, 3, 5, 8, 13, 21, 34])  # an isin test set (int64, as torch.tensor makes it)
IDS_2D = torch.tensor([[2, 7], [11, 30]], dtype=torch.int32)
LO = (-0.6 + 0.1 * torch.rand(H, generator=g, dtype=torch.float64)).requires_grad_()  # clamp bounds
HI = (0.5 + 0.1 * torch.rand(H, generator=g, dtype=torch.float64)).requires_grad_()
BIG = torch.arange(100)  # too many for isin's comparisons
W = torch.rand(H, generator=g).requires_grad_()  # a learnable lerp weight
# learnable second arguments of atan2, hypot and logaddexp, away from 0
ATAN_X, HYPOT_Y, LAE_B = ((torch.rand(H, generator=g) + 0.5).requires_grad_() for _ in range(3))
XLOGY_Y = (torch.rand(H, generator=g) + 0.5).requires_grad_()
XLOGY_Z = torch.zeros(H, requires_grad=True)  # a learnable factor at 0: xlogy's d/dx there is log(y)


def _d(q_idx, kv_idx, like):
    return (q_idx - kv_idx).to(like.dtype)  # torch's lerp wants the score's dtype


SCORE_MODS = {
    "relu": lambda s, b, h, q, kv: torch.relu(s) + F.relu(-s) * 0.5 + s.relu() * 0.25,
    "gelu": lambda s, b, h, q, kv: F.gelu(s * 2),
    "gelu_tanh": lambda s, b, h, q, kv: F.gelu(s * 2, approximate="tanh"),
    "softplus": lambda s, b, h, q, kv: F.softplus(s) + F.softplus(s, beta=2.0, threshold=1.0),
    "leaky_relu": lambda s, b, h, q, kv: F.leaky_relu(s, 0.1) + F.leaky_relu(s),
    "elu_family": lambda s, b, h, q, kv: F.elu(s) + F.selu(s) + F.celu(s, 0.5),
    "hard": lambda s, b, h, q, kv: F.hardtanh(s, -0.5, 0.5) + F.relu6(s * 4) + F.hardsigmoid(s * 4)
    + F.hardswish(s * 4),
    "logsigmoid_mish": lambda s, b, h, q, kv: F.logsigmoid(s * 3) + F.mish(s),
    "masked_fill": lambda s, b, h, q, kv: s.masked_fill(q < kv, -1.0).masked_fill(q == kv, float("-inf")),
    "isin": lambda s, b, h, q, kv: torch.where(torch.isin(kv, IDS), s, -s)
    + torch.isin(q, IDS_2D, invert=True) * s,
    # (infinities put in by where, not made by x / 0: the zero gradient of a replaced element
    # times d(x/0) is NaN in torch too)
    "nan_to_num": lambda s, b, h, q, kv: torch.nan_to_num(torch.log(s), nan=0.5, neginf=-5.0)
    + torch.nan_to_num(torch.where(q == kv, float("inf"), s), posinf=2.0)
    + torch.nan_to_num(torch.where(q < kv - 3, -float("inf"), s), neginf=-3.0)
    + torch.nan_to_num(torch.where(kv == 3, float("nan"), s))
    + torch.nan_to_num(torch.where(q == kv + 1, float("inf"), s)) * 1e-38,
    "isnan_isinf": lambda s, b, h, q, kv: torch.where(torch.isnan(torch.log(s)), 0.0, s)
    + torch.where(torch.isinf(1.0 / _d(q, kv, s)), 1.0, 0.0) + torch.where(torch.isfinite(torch.log(s)), s, 0.0)
    + torch.isposinf(1.0 / _d(q, kv, s)) - torch.isneginf(1.0 / _d(q, kv, s)) * 0.5,
    "lerp": lambda s, b, h, q, kv: torch.lerp(s, _d(q, kv, s) * 0.1, 0.25) + torch.lerp(s, -s, 0.75)
    + torch.lerp(s, s * 2, W[h].to(s.dtype)),
    "addcmul_addcdiv": lambda s, b, h, q, kv: torch.addcmul(s, s, _d(q, kv, s), value=0.1)
    + torch.addcdiv(s, s, (q + 1).float(), value=0.5) + torch.addcmul(s, s, s),
    "rounding_div": lambda s, b, h, q, kv: s + torch.div(q - kv, 3, rounding_mode="trunc")
    + torch.div(q - kv, -4, rounding_mode="floor") + (q - kv) // 5 + torch.div(s, 0.3, rounding_mode="trunc")
    + torch.div(s, 0.3, rounding_mode="floor") + torch.floor_divide(kv - q, 7),
    "constants": lambda s, b, h, q, kv: s * torch.tensor(0.5) + torch.full((), -0.25)
    + torch.maximum(s, torch.zeros(())) + torch.where(q >= kv, s, torch.tensor(-1e9))
    + torch.ones(()) + torch.tensor(3) * (q > kv) + torch.tensor(2.0, dtype=torch.float64),
    "bools": lambda s, b, h, q, kv: torch.where((q > kv) + (q < 3), s, 0.0)
    + torch.where((q > kv) * (kv < 10), s, 0.0) + ((q > kv) + (q < 3)) * 2.0,
    "clamp_tensor_bounds": lambda s, b, h, q, kv: torch.clamp(s, LO[h], HI[h]) + s.clamp(min=LO[h])
    + torch.clamp(s, max=HI[h]),
    "sign": lambda s, b, h, q, kv: s * torch.sign(q - kv) + torch.sign(s) + torch.sgn(s) * 0.5,
    "remainder_fmod": lambda s, b, h, q, kv: s + torch.remainder(q - kv, 5) + torch.fmod(q - kv, 5)
    + (q - kv) % -3 + torch.fmod(kv - q, -3) + torch.remainder(s, 0.7) + torch.fmod(s, 0.7),
    "misc": lambda s, b, h, q, kv: torch.square(s) + torch.reciprocal(s + 10) + torch.rsub(s, 1.0)
    + torch.erfc(s),
    "atan2": lambda s, b, h, q, kv: torch.atan2(s, _d(q, kv, s) * 0.1 + 0.05) + s.arctan2(ATAN_X[h].to(s.dtype))
    + torch.atan2(q - kv, kv) * 0.1,
    "hypot": lambda s, b, h, q, kv: torch.hypot(s, _d(q, kv, s) * 0.2) + s.hypot(HYPOT_Y[h].to(s.dtype)),
    # (a -inf second argument where q < kv: the first wins, with its whole gradient)
    "logaddexp": lambda s, b, h, q, kv: torch.logaddexp(s, _d(q, kv, s) * 0.2) + torch.logaddexp2(s, -s)
    + torch.logaddexp(s, torch.where(q < kv, -float("inf"), s * 0.5)) + s.logaddexp(LAE_B[h].to(s.dtype)),
    # (x = 0 where relu cuts: d/dx is log(y) there, times relu's 0)
    "xlogy": lambda s, b, h, q, kv: torch.xlogy(F.relu(s), _d(q, kv, s).abs() + 0.5)
    + torch.special.xlogy(s, s * s + 1) + torch.special.xlog1py(F.relu(-s), s.abs())
    + s.xlogy(XLOGY_Y[h].to(s.dtype)) + torch.xlogy(XLOGY_Z[h].to(s.dtype), s * s + 2),
    # (torch has no derivative for heaviside: here of the indices only, the score's in a forward test)
    "heaviside": lambda s, b, h, q, kv: torch.heaviside(_d(q, kv, s), torch.full_like(s, 0.25)) * s
    + torch.heaviside(q - kv, torch.zeros_like(q)) * 0.5,
    "logit": lambda s, b, h, q, kv: torch.logit(torch.sigmoid(s)) + torch.special.logit(torch.sigmoid(s * 4), 0.05)
    + torch.sigmoid(s).logit(eps=0.2),
    "deg2rad": lambda s, b, h, q, kv: torch.deg2rad(s * 30) + s.rad2deg() * 0.01 + torch.deg2rad(q - kv),
}
LEARNABLE = {"lerp": (W,), "clamp_tensor_bounds": (LO, HI), "atan2": (ATAN_X,), "hypot": (HYPOT_Y,),
             "logaddexp": (LAE_B,), "xlogy": (XLOGY_Y, XLOGY_Z)}

# The Triton kernels under the interpreter run a few of these at a time: one fwd and bwd module
# per mod is what each costs.
GROUPS = {
    "activations": ["relu", "gelu", "gelu_tanh", "softplus", "leaky_relu", "elu_family", "hard",
                    "logsigmoid_mish", "misc"],
    "special values": ["masked_fill", "nan_to_num", "isnan_isinf", "isin", "constants", "bools"],
    "arithmetic": ["lerp", "addcmul_addcdiv", "rounding_div", "clamp_tensor_bounds", "sign",
                   "remainder_fmod"],
    "two-argument and special functions": ["atan2", "hypot", "logaddexp", "xlogy", "heaviside", "logit",
                                           "deg2rad"],
}


def test_every_mod_is_in_a_group():
    assert sorted(n for names in GROUPS.values() for n in names) == sorted(SCORE_MODS)


def _summed(names):
    mods = [SCORE_MODS[n] for n in names]

    def group(s, b, h, q, kv):
        return sum(m(s, b, h, q, kv) for m in mods) * (1.0 / len(mods))
    return group


def _torch_flex(q, k, v, mod, dtype, block_mask=None):
    """torch's own flex_attention (eager, CPU; forward only) in ``dtype``: out and lse."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's advice to compile
        out, lse = torch_flex.flex_attention(*(t.detach().to(dtype) for t in (q, k, v)), score_mod=mod,
                                             block_mask=block_mask, return_lse=True)
    return out, lse


def _check_values(out, lse, q, k, v, mod):
    ref, ref_lse = _torch_flex(q, k, v, mod, torch.float64)
    low, low_lse = _torch_flex(q, k, v, mod, torch.float32)
    floor = FLOOR[torch.float32] * max(1.0, ref.abs().max().item())
    assert_close_to_oracle("out", out, ref, low, floor)
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.float32] * max(1.0, ref_lse.abs().max().item()))


def _check_grads(out, q, k, v, mod, learnable):
    inputs = (q, k, v, *learnable)
    ref, _ = dense_attention(q, k, v, mod, dtype=torch.float64)
    low, _ = dense_attention(q, k, v, mod, dtype=torch.float32)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    got = torch.autograd.grad(out, inputs, dout)
    want = torch.autograd.grad(ref, inputs, dout.double())
    lowg = torch.autograd.grad(low, inputs, dout)
    names = ("dq", "dk", "dv") + tuple(f"dcapture{i}" for i in range(len(learnable)))
    for name, a, w, lw in zip(names, got, want, lowg):
        assert_close_to_oracle(name, a, w, lw, FLOOR[torch.float32] * max(1.0, w.abs().max().item()))


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_reference_backend_matches_torch(name):
    mod = SCORE_MODS[name]
    learnable = LEARNABLE.get(name, ())
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=1)
    out, lse = flex_attention(q, k, v, score_mod=mod, return_lse=True, backend="reference")
    _check_values(out, lse, q, k, v, mod)
    _check_grads(out, q, k, v, mod, learnable)


@pytest.mark.parametrize("group", list(GROUPS))
def test_triton_kernels_match_torch(group, monkeypatch):
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("the interpreter tests need triton >= 3.9")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLEXJIT_POISON", "1")
    names = GROUPS[group]
    mod = _summed(names)
    learnable = tuple(t for n in names for t in LEARNABLE.get(n, ()))
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=2)
    out, lse = flex_attention(q, k, v, score_mod=mod, return_lse=True, backend="triton")
    _check_values(out, lse, q, k, v, mod)
    _check_grads(out, q, k, v, mod, learnable)


# --------------------------------------------------------------------------- mask mods

MASK_MODS = {
    "bool_or_and": lambda b, h, q, kv: ((q >= kv) + (kv < 4)) * (q - kv < 20),
    "isin": lambda b, h, q, kv: torch.isin(kv // 8, IDS) | (q == kv),
    "trunc_div": lambda b, h, q, kv: torch.div(q - kv, 8, rounding_mode="trunc") == 0,
    "constants": lambda b, h, q, kv: (q - kv) <= torch.tensor(6) + torch.full((), 2, dtype=torch.int32),
    "nan_free": lambda b, h, q, kv: ~torch.isnan(torch.log((q - kv).float())),
    "remainder": lambda b, h, q, kv: torch.remainder(q - kv, 5) == torch.fmod(kv - q, -5).abs(),
    # (a radius of 10 around (12, 20): its rim holds the 6-8-10 triangles, hypot exact there)
    "hypot_radius": lambda b, h, q, kv: torch.hypot((q - 12).float(), (kv - 20).float()) <= 10,
    "atan2_cone": lambda b, h, q, kv: torch.atan2((q - kv).float(), kv * 0.0 + 8.0).abs() < 0.9,
    "logaddexp": lambda b, h, q, kv: torch.logaddexp(q * 0.1, kv * 0.1) < 3.5,
    # int8 wraps past 127; a float16 product and its comparison with an index, in float16
    "narrow_dtypes": lambda b, h, q, kv: ((kv + 100).to(torch.int8) > 0) & (q.half() * 0.37 <= kv),
}


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_mask_mods_plan_and_run_as_torch(name):
    mask = MASK_MODS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = torch_flex.create_mask(mask, B, H, L, S, device="cpu")
        tbm = torch_flex.create_block_mask(mask, B, H, L, S, device="cpu", BLOCK_SIZE=16)
    bm = create_block_mask(mask, B, H, L, S, device="cpu", BLOCK_SIZE=16)
    listed = bm.to_dense().repeat_interleave(16, -2).repeat_interleave(16, -1)[..., :L, :S].bool()
    assert torch.all(listed | ~dense), "a block holding a kept element is not listed"
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=3)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, backend="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, ref_lse = torch_flex.flex_attention(*(t.detach().double() for t in (q, k, v)), block_mask=tbm,
                                                 return_lse=True)
        low, low_lse = torch_flex.flex_attention(*(t.detach() for t in (q, k, v)), block_mask=tbm,
                                                 return_lse=True)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.float32])


def test_mask_mods_on_the_triton_kernels(monkeypatch):
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("the interpreter tests need triton >= 3.9")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLEXJIT_POISON", "1")
    mods = list(MASK_MODS.values())

    def every(b, h, q, kv):  # kept where an odd number of the masks keep it: each one matters
        out = mods[0](b, h, q, kv)
        for m in mods[1:]:
            out = out ^ m(b, h, q, kv)
        return out
    bm = create_block_mask(every, B, H, L, S, device="cpu", BLOCK_SIZE=16)
    q, k, v = random_qkv(B, H, H, L, S, D, D, torch.float32, seed=4)
    out = flex_attention(q, k, v, block_mask=bm, backend="triton")
    ref, _ = dense_attention(q, k, v, mask_mod=every)
    low, _ = dense_attention(q, k, v, mask_mod=every, dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    dout = torch.randn_like(out)
    for name, a, w, lw in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout),
                              torch.autograd.grad(ref, (q, k, v), dout.double()),
                              torch.autograd.grad(low, (q, k, v), dout)):
        assert_close_to_oracle(name, a, w, lw, FLOOR[torch.float32])


# --------------------------------------------------------------------------- the IR they build


def test_bool_arithmetic_is_logic_and_counts_stay_counts():
    # bool + bool is or, bool * bool is and (torch keeps them bool); a bool and an int count.
    assert trace_mod(lambda b, h, q, kv: (q > kv) + (kv > 2), MASK_MOD).out is \
        trace_mod(lambda b, h, q, kv: (q > kv) | (kv > 2), MASK_MOD).out
    assert trace_mod(lambda b, h, q, kv: (q > kv) * (kv > 2), MASK_MOD).out is \
        trace_mod(lambda b, h, q, kv: (q > kv) & (kv > 2), MASK_MOD).out
    counted = trace_mod(lambda s, b, h, q, kv: s + ((q > kv) + 1), SCORE_MOD).out
    assert counted is trace_mod(lambda s, b, h, q, kv: s + ((q > kv).int() + 1), SCORE_MOD).out


def test_a_constant_made_inside_a_mod_is_a_number():
    # torch.tensor(c) and friends are constants of the IR: the same graph as the Python number.
    same = [lambda s, b, h, q, kv: s * torch.tensor(0.5), lambda s, b, h, q, kv: s * torch.full((), 0.5),
            lambda s, b, h, q, kv: s * torch.scalar_tensor(0.5),
            lambda s, b, h, q, kv: s * 0.5]
    assert len({trace_mod(m, SCORE_MOD).out for m in same}) == 1
    # an integer constant is weakly typed, as a Python int: index arithmetic stays int32
    out = trace_mod(lambda b, h, q, kv: q - kv < torch.tensor(3), MASK_MOD).out
    assert out is trace_mod(lambda b, h, q, kv: q - kv < 3, MASK_MOD).out


def test_what_cannot_be_one_element_is_refused():
    cases = {
        "subtracting two bools": lambda s, b, h, q, kv: torch.where((q > kv) - (kv > 2), s, 0.0),
        r"a tensor is created inside the mod \(torch.tensor of shape \(3,\)\)":
            lambda s, b, h, q, kv: s + torch.tensor([1.0, 2.0, 3.0]).sum(),
        r"torch.full of shape \(2, 2\)": lambda s, b, h, q, kv: s + torch.full((2, 2), s),
        "at most 64 are compared per element": lambda s, b, h, q, kv: torch.where(
            torch.isin(kv, BIG), s, 0.0),
        "masked_fill needs a bool mask": lambda s, b, h, q, kv: s.masked_fill(q - kv, 0.0),
        "an in-place relu": lambda s, b, h, q, kv: F.relu(s, inplace=True),
        "gelu with approximate='sigmoid'": lambda s, b, h, q, kv: F.gelu(s, approximate="sigmoid"),
        "a \\*_like of a captured tensor": lambda s, b, h, q, kv: s + torch.zeros_like(IDS)[q],
    }
    for why, mod in cases.items():
        with pytest.raises(TraceError, match=why):
            trace_mod(mod, SCORE_MOD)


@pytest.mark.slow
def test_cute_kernels_compile_for_the_new_ops(tmp_path, monkeypatch):
    # The compositions render through the CuTe op table like any mod: the sm90 forward and
    # backward build (values are checked on the GPU, tests/backends/cute).
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # read once, when cutlass is first imported
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path))
    from flexjit.integrations.aot import compile_kernels
    # The compositions whose IR shapes are new to the CuTe kernels (NaN and infinity tests,
    # unrolled isin loads, rounding divisions, erf, log1p); the others are built of the same ops,
    # whose rendering tests/ir/test_op_registry.py checks one by one. (~100 s on the CPU.)
    names = ["gelu", "softplus", "nan_to_num", "isnan_isinf", "isin", "bools", "rounding_div"]
    # AUTOTUNE off: the run's own kernels, not the tuner's other candidates
    kernels = compile_kernels(_summed(names), MASK_MODS["bool_or_and"], arch="sm_90a", head_dim=64,
                              seq_len=256, heads=2,
                              kernel_options={"AUTOTUNE": False})
    assert [(k.pass_, k.part) for k in kernels] == [("fwd", "main"), ("bwd", "pre"),
                                                    ("bwd", "main"), ("bwd", "post")]
