"""The sm100 first-use self-check gate, on the CPU by injection.

There is no Blackwell GPU here. ``cute_sm100.SEAM`` is replaced: its capability query says
(10, 0) for the CPU tensors, its compile returns a stand-in kernel and its launch runs that
stand-in, a computation in torch that writes the kernel's outputs. A correct stand-in computes
the attention as a flash kernel does (128-key tiles, online softmax, P rounded to the dtype
before P·V, fp32 accumulation); wrong ones perturb one output element, shift the LSE by ln 2
(torch's old bug), leave the last query row unwritten, or raise while compiling.

Where flexjit falls back: on a simulated sm100 the preference is (cute_sm100, triton,
reference). Triton runs on CPU tensors only under TRITON_INTERPRET=1, so the tests that need the
fallback to be Triton set it (the call is small for the interpreter: 200 x 200, D 64); the rest
leave it unset and the fallback is the reference backend. Every output is compared with the
float64 oracle (tests/oracle.py) with bounds from the data.

Sizes: L = S = 384 (three 128-row mask blocks, more than the check's 300, so the check's case
is smaller than the call), GQA 4:2, D 64 (a head dim the sm100 kernel takes), B 2.
"""
import dataclasses
import math
import warnings

import pytest
import torch

import flexjit
from flexjit.runtime.selfcheck import SelfCheckWarning
from flexjit import create_block_mask
from flexjit.api.attention import explain, flex_attention
from flexjit import mods
from flexjit.runtime import selfcheck
from flexjit.runtime import dispatch
from flexjit.api.attention import prepare_call
from flexjit.backends.cute import sm100 as cute_sm100
from flexjit.backends import reference
from mods_catalog import make_case
from oracle import FLOOR, assert_close_to_oracle, dense_attention, dense_scores

B, HQ, HKV, L, S, D = 2, 4, 2, 384, 384, 64
SLOPES = mods.alibi_slopes(HQ)


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flash_standin(call, o, lse, max_scores, *, tile=128):
    """A correct kernel's arithmetic: the reference's fp32 modded scores, walked in 128-key
    tiles with an online softmax; P (unnormalised, against the running max) rounded to the dtype
    for P·V; O and the row sum in fp32; O / sum rounded to the dtype at the end."""
    q, v = call.q, call.v
    s = reference.scores(call, q, call.k, torch.float32)
    vv = v.float().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    m = torch.full(s.shape[:-1] + (1,), -math.inf, device=q.device)
    acc = torch.zeros(*s.shape[:-1], v.shape[-1], device=q.device)
    den = torch.zeros(s.shape[:-1] + (1,), device=q.device)
    for j in range(0, s.shape[-1], tile):
        st = s[..., j:j + tile]
        m_new = torch.maximum(m, st.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        alpha = torch.where(torch.isfinite(m), torch.exp(m - safe), torch.zeros_like(m))
        p = torch.exp(st - safe)
        den = den * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p.to(q.dtype).float() @ vv[..., j:j + tile, :]
        m = m_new
    empty = den == 0
    o.copy_(torch.where(empty, torch.zeros_like(acc), acc / torch.where(empty, 1.0, den)).to(o.dtype))
    lse.copy_(torch.where(empty, -math.inf, torch.log(torch.where(empty, 1.0, den)) +
                          torch.where(empty, 0.0, m)).squeeze(-1))
    if max_scores is not None:
        max_scores.copy_(m.squeeze(-1))


class Blackwell:
    """The replaced seam: a simulated sm100 device, stand-in kernels, and what ran."""

    def __init__(self, wrong=None):
        self.wrong = wrong  # None (correct), "out", "lse", "unwritten", "raise"
        self.compiled = []  # kernel keys compiled, in order
        self.launched = []  # the q shape of each launch

    def capability(self, device):
        return (10, 0)

    def compile(self, call):
        self.compiled.append(cute_sm100.kernel_key(call))
        if self.wrong == "raise":
            raise RuntimeError("ptxas fatal: stand-in compile failure")
        return "stand-in"

    def launch(self, kernel, call, o, lse, max_scores):
        assert kernel == "stand-in"
        self.launched.append(tuple(call.q.shape))
        if self.wrong == "unwritten":  # the last query row stays as the caller left it
            full = (torch.empty_like(o), torch.empty_like(lse),
                    None if max_scores is None else torch.empty_like(max_scores))
            flash_standin(call, *full)
            o[:, :, :-1] = full[0][:, :, :-1]
            lse[:, :, :-1] = full[1][:, :, :-1]
            if max_scores is not None:
                max_scores.copy_(full[2])
            return
        flash_standin(call, o, lse, max_scores)
        if self.wrong == "out":  # one element off by 0.25: above the check's bound (~0.04),
            o[0, 1, 37, 5] += 0.25  # below the tests' all-bf16 bound for ALiBi (~0.6 at 300)
        if self.wrong == "lse":
            lse += math.log(2.0)


@pytest.fixture
def blackwell(monkeypatch):
    """Make the CPU look like one sm_100 GPU with correct stand-in kernels; results reset."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("FLEXJIT_DISABLE", raising=False)
    sim = Blackwell()
    monkeypatch.setattr(cute_sm100, "SEAM", cute_sm100.Seam(sim.capability, sim.compile, sim.launch))
    selfcheck.forget()
    yield sim
    selfcheck.forget()


def inputs(seed=0, dtype=torch.bfloat16, grad=False, n=L):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(dtype).requires_grad_(grad)
               for h in (HQ, HKV, HKV))
    return q, k, v


def block_mask(n=L):
    return create_block_mask(causal, None, None, n, n, device="cpu")


def assert_matches_oracle(out, lse, q, k, v, backend=None):
    """out and lse against the float64 oracle (the suite's bound: the same math in the dtype);
    with ``backend``, also bit for bit what that backend gives when asked by name (which
    backend answered)."""
    with torch.no_grad():
        ref, ref_lse = dense_attention(q, k, v, alibi, causal, dtype=torch.float64)
        low, low_lse = dense_attention(q, k, v, alibi, causal, dtype=q.dtype)
    assert_close_to_oracle("out", out, ref, low, FLOOR[q.dtype])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[q.dtype])
    if backend is not None:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", SelfCheckWarning)
            o2, l2 = run(q, k, v, block_mask(q.shape[2]), backend=backend)
        assert torch.equal(out, o2) and torch.equal(lse, l2), f"not the {backend} backend's answer"


def run(q, k, v, bm, **kw):
    return flex_attention(q, k, v, alibi, bm, enable_gqa=True, return_lse=True, **kw)


# --------------------------------------------------------------------------- the three states


def test_not_yet_run_before_the_first_call_and_explain_runs_nothing(blackwell):
    q, k, v = inputs()
    choice = explain(q, k, v, alibi, block_mask(), enable_gqa=True)
    assert choice.name == "cute_sm100", str(choice)
    assert "self-check not yet run" in choice.reason and "first call" in choice.reason
    assert blackwell.compiled == [] and blackwell.launched == []
    assert selfcheck.results() == {}


def test_a_correct_kernel_passes_is_used_and_explain_says_self_checked(blackwell, programs_run):
    q, k, v = inputs()
    bm = block_mask()
    out, lse = run(q, k, v, bm)
    # The check's small case first (B 2, Hkv 2 x ratio 2, 300 rows), then the call itself.
    assert blackwell.launched == [(2, 4, 300, D), (B, HQ, L, D)]
    assert [name for name, _ in programs_run] == ["cute_sm100"]
    assert_matches_oracle(out, lse, q, k, v)
    choice = explain(q, k, v, alibi, bm, enable_gqa=True)
    assert choice.name == "cute_sm100" and "self-checked on this GPU (passed: out" in choice.reason
    # A second call of the same kernel: no second check, one more launch.
    q2, k2, v2 = inputs(seed=1)
    out2, lse2 = run(q2, k2, v2, bm)
    assert len(blackwell.launched) == 3
    assert_matches_oracle(out2, lse2, q2, k2, v2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [True, False])
def test_the_bound_accepts_a_flash_kernels_rounding(blackwell, dtype, masked):
    # The gate must not reject a correct kernel: the flash-style stand-in (P rounded to the
    # dtype, online softmax) passes in both 16-bit dtypes, with and without a block mask, and
    # with max_scores asked for.
    q, k, v = inputs(dtype=dtype)
    call = prepare_call(q, k, v, alibi, block_mask() if masked else None, None, True, None,
                        max_scores=True)
    res = selfcheck.check_forward(call, cute_sm100._checked_launch)
    assert res.passed, res.summary
    assert "max_scores" in res.summary


def test_an_explicit_cute_request_is_checked_first(blackwell):
    q, k, v = inputs()
    bm = block_mask()
    choice = explain(q, k, v, alibi, bm, enable_gqa=True, backend="cute")
    assert choice.name == "cute_sm100" and "requested" in choice.reason
    assert "not yet run" in choice.reason and blackwell.launched == []
    out, lse = run(q, k, v, bm, backend="cute")
    assert blackwell.launched == [(2, 4, 300, D), (B, HQ, L, D)]
    assert_matches_oracle(out, lse, q, k, v)
    assert "self-checked on this GPU" in explain(q, k, v, alibi, bm, enable_gqa=True, backend="cute").reason


def test_a_new_gqa_ratio_or_layout_is_checked_again_and_a_failure_disables_all(blackwell):
    # The kernel takes the GQA ratio and strides at run time, but the check's case copies them
    # from the call: a call that differs in them gets its own check. A failure in any of them
    # disables the kernel (its compiled-kernel key) for every call.
    q, k, v = inputs()
    bm = block_mask()
    run(q, k, v, bm)
    assert len(blackwell.launched) == 2
    run(q, k, v, bm)  # the same variant: no new check
    assert len(blackwell.launched) == 3
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    run(qt, kt, vt, bm)  # another layout: checked, then run
    assert [s[2] for s in blackwell.launched[3:]] == [300, L]
    blackwell.wrong = "lse"
    k1, v1 = k[:, :1].contiguous(), v[:, :1].contiguous()  # GQA 4:1
    with pytest.warns(SelfCheckWarning, match="lse: max abs error"):
        flex_attention(q, k1, v1, alibi, bm, enable_gqa=True)
    n = len(blackwell.launched)
    out, lse = run(q, k, v, bm)  # the passed variant is disabled too
    assert len(blackwell.launched) == n
    assert_matches_oracle(out, lse, q, k, v, backend="reference")


# --------------------------------------------------------------------------- wrong kernels


@pytest.mark.parametrize("wrong, expect", [
    ("out", r"out: max abs error 0\.2\d* at \(b=0, h=1, q=37, d=5\).*> tolerance 0\.0"),
    ("lse", r"lse: max abs error 0\.693.*> tolerance"),
    ("unwritten", r"out: max abs error inf at \(b=0, h=0, q=299"),
    ("raise", r"the check raised RuntimeError: ptxas fatal"),
])
def test_a_wrong_kernel_is_disabled_falls_back_and_warns_once(blackwell, wrong, expect):
    blackwell.wrong = wrong
    q, k, v = inputs()
    bm = block_mask()
    with pytest.warns(SelfCheckWarning, match=expect):
        out, lse = run(q, k, v, bm)
    # The wrong kernel ran on the small case only (or not at all), never on the call; the
    # answer came from the fallback (the reference here: no TRITON_INTERPRET) and is right.
    assert all(shape[2] == 300 for shape in blackwell.launched)
    assert_matches_oracle(out, lse, q, k, v, backend="reference")
    choice = explain(q, k, v, alibi, bm, enable_gqa=True)
    assert choice.name == "reference", str(choice)
    why = dict(choice.passed_over)["cute_sm100"]
    assert why.startswith("self-check failed on this GPU, disabled for this process")
    # Second call: no second warning, no second check, still the right answer.
    n = len(blackwell.compiled)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SelfCheckWarning)
        out2, lse2 = run(q, k, v, bm)
    assert len(blackwell.compiled) == n
    assert_matches_oracle(out2, lse2, q, k, v)
    # An explicit request never changes backend silently: it raises with the reason.
    with pytest.raises(NotImplementedError, match="backend='cute' cannot run this call: self-check failed"):
        run(q, k, v, bm, backend="cute")
    # The kernel's own entry refuses too.
    with pytest.raises(RuntimeError, match="may not run before it has passed"):
        cute_sm100.forward(prepare_call(q, k, v, alibi, bm, None, True, None))


def test_the_tolerance_is_tight_enough_for_alibi(blackwell):
    # Why the forward's baseline keeps the scores in float32 (flexjit's semantics for mods):
    # with the tests' all-bf16 math the bound on this small case (ALiBi over lists that keep
    # blocks far above the diagonal, scores ~150) would exceed the 0.25 error above; the
    # check's own bound stays below 0.1.
    q, k, v = inputs()
    small = selfcheck.small_call(prepare_call(q, k, v, alibi, block_mask(), None, True, None))
    qs, ks, vs = small.q, small.k, small.v
    with torch.no_grad():
        want = selfcheck._attention(small, qs.double(), ks.double(), vs.double(), torch.float64)
        low = selfcheck._attention(small, qs, ks, vs, torch.float32, dtype=torch.bfloat16)
        all16 = selfcheck._attention(small, qs, ks, vs, torch.bfloat16)
    ok, text = selfcheck.compare("out", want[0], want[0], low[0], FLOOR[torch.bfloat16])
    assert ok and float(text.split("<= ")[1]) < 0.1, text
    ok, text = selfcheck.compare("out", want[0], want[0], all16[0], FLOOR[torch.bfloat16])
    assert ok and float(text.split("<= ")[1]) > 0.25, text


# Every core mod passed when tried (about 50 s under the interpreter); CI runs one of each kind:
# no mods, masks of several shapes, additive biases large and small, a transcendental, a
# gathered table, learnable tensors.
ADMITTED = ["full", "causal", "document", "alibi", "softcap", "relative_bias", "natten_2d",
            "learnable_alibi", "softcap_alibi_window"]


@pytest.mark.parametrize("name", ADMITTED)
def test_the_bound_admits_the_triton_kernel(monkeypatch, name):
    # A real kernel, not a stand-in: Triton's forward (interpreted) on each mod's small case
    # passes the check (its errors were about half of each bound), so the gate does not turn a
    # correct kernel away for rounding. With max_scores, GQA and the call's mask.
    from flexjit.backends import triton as tb_entry
    from flexjit.backends.triton import prefill as tb

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = make_case(name, B, HQ, L, S)
    q, k, v = inputs()
    bm = create_block_mask(case.mask_mod, B, HQ, L, S, device="cpu") if case.mask_mod else None
    call = prepare_call(q, k, v, case.score_mod, bm, None, True, None, max_scores=True)
    res = selfcheck.check_forward(call, tb_entry.forward)
    assert res.passed, res.summary


@pytest.mark.parametrize("name", ["learnable_bias"])
def test_the_backward_bound_admits_the_triton_backward(monkeypatch, name):
    # The backward hook's bound, the same way: the Triton backward (interpreted) passes,
    # gradients of a learnable bias table included.
    from flexjit.backends import triton as tb_entry
    from flexjit.backends.triton import prefill as tb

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = make_case(name, B, HQ, L, S)
    q, k, v = inputs(grad=True)
    bm = create_block_mask(case.mask_mod, B, HQ, L, S, device="cpu") if case.mask_mod else None
    call = prepare_call(q, k, v, case.score_mod, bm, None, True, None)
    res = selfcheck.check_backward(call, tb_entry.backward)
    assert res.passed, res.summary
    assert ("grad of captured tensor" in res.summary) == (name == "learnable_bias")


def test_a_failing_kernel_falls_back_to_triton(blackwell, monkeypatch):
    # With the Triton interpreter the CPU can run the fallback the GPU would: Triton.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    blackwell.wrong = "lse"
    q, k, v = inputs(n=200)
    bm = block_mask(200)
    with pytest.warns(SelfCheckWarning, match="lse: max abs error"):
        out, lse = run(q, k, v, bm)
    choice = explain(q, k, v, alibi, bm, enable_gqa=True)
    assert choice.name == "triton", str(choice)
    assert "self-check failed" in dict(choice.passed_over)["cute_sm100"]
    assert_matches_oracle(out, lse, q, k, v, backend="triton")


# --------------------------------------------------------------------------- the switch


def test_disabling_cute_sm100_passes_over_the_sm100_kernels(blackwell, monkeypatch):
    monkeypatch.setenv("FLEXJIT_DISABLE", "cute_sm100")
    q, k, v = inputs()
    bm = block_mask()
    choice = explain(q, k, v, alibi, bm, enable_gqa=True)
    assert choice.name == "reference"
    assert dict(choice.passed_over)["cute_sm100"] == "FLEXJIT_DISABLE lists cute_sm100"
    out, lse = run(q, k, v, bm)
    assert blackwell.compiled == [] and blackwell.launched == []
    assert_matches_oracle(out, lse, q, k, v)
    with pytest.raises(NotImplementedError, match="FLEXJIT_DISABLE lists cute_sm100"):
        run(q, k, v, bm, backend="cute")


def test_off_blackwell_nothing_changes(monkeypatch):
    # The real seam: a CPU tensor is no sm100 device, so dispatch keeps its CPU order and the
    # sm100 backend refuses with the device reason.
    selfcheck.forget()
    q, k, v = inputs()
    call = prepare_call(q, k, v, alibi, block_mask(), None, True, None)
    assert dispatch._preference(q.device) == ("reference",)
    assert cute_sm100.supports(call) == (False, "needs a CUDA tensor, got cpu")
    sm103 = dataclasses.replace(cute_sm100.SEAM, capability=lambda d: (10, 3))
    monkeypatch.setattr(cute_sm100, "SEAM", sm103)
    ok, why = cute_sm100.supports(call)
    assert not ok and "sm_103" in why
    assert selfcheck.results() == {}


# --------------------------------------------------------------------------- the small case


def test_the_small_case_has_the_calls_program_and_kernel(blackwell):
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in inputs())  # (B, L, H, D) memory
    bm = block_mask()
    call = prepare_call(q, k, v, alibi, bm, None, True, None)
    small = selfcheck.small_call(call)
    assert small.program is call.program  # same traced mods, captured buffers, scalars
    assert any(b is SLOPES for b in small.program.buffers)
    assert cute_sm100.kernel_key(small) == cute_sm100.kernel_key(call)
    assert small.q.dtype == q.dtype and small.scale == call.scale
    assert (small.q.shape[-1], small.v.shape[-1]) == (D, D)
    assert small.q.shape[1] // small.k.shape[1] == HQ // HKV
    assert tuple(small.q.shape[2:3]) + tuple(small.k.shape[2:3]) == (300, 300)
    assert small.q.stride(2) > small.q.stride(1)  # the call's layout (heads inside rows)
    # The lists visit every kind of block, ragged last row/column included, and some rows are
    # empty; each head's row pair has blocks one sub-tile skips while the other visits.
    kinds = small.block_mask.block_kinds()
    assert kinds.shape == (1, 2 * HQ // HKV, 3, 3)
    assert {0, 1, 2} <= set(kinds[0, 0].flatten().tolist())
    assert {1, 2} <= set(kinds[0, :, 2, :].flatten().tolist())  # the ragged last block row
    assert {1, 2} <= set(kinds[0, :, :, 2].flatten().tolist())  # the ragged last block column
    assert (kinds[0, 1, 1] == 0).all()
    assert ((kinds[0, 0, 0] == 0) != (kinds[0, 0, 1] == 0)).any()
    # The kernel compiled for the check is the call's: one compile, under the call's key.
    out, lse = run(q, k, v, bm)
    assert blackwell.compiled == [cute_sm100.kernel_key(call)] * 2  # check, then the call
    assert_matches_oracle(out, lse, q, k, v)


def test_the_check_compares_with_the_reference_on_the_small_case(blackwell):
    # The check's expected values are the float64 oracle of the small case's own inputs and
    # lists, the mods called eagerly: a stand-in that is right on the call's mask but wrong on the
    # small case's synthetic lists (it ignores the lists, applies causal) fails.
    q, k, v = inputs()
    call = prepare_call(q, k, v, alibi, block_mask(), None, True, None)

    def ignores_lists(small):
        s = dense_scores(small.q, small.k, alibi, causal, small.scale, torch.float64)
        p = torch.softmax(s, -1)
        vv = small.v.double().repeat_interleave(HQ // HKV, 1)
        return (p @ vv).to(small.q.dtype), torch.logsumexp(s, -1).float()

    res = selfcheck.check_forward(call, ignores_lists)
    assert not res.passed and "out: max abs error" in res.summary


@pytest.mark.parametrize("wrong", [None, "out"])
def test_the_gate_holds_inside_torch_compile(blackwell, programs_run, wrong):
    # flexjit.compile's custom op selects at run time, with real tensors: the check runs there,
    # and a failing kernel falls back (here to the reference) inside the compiled graph too.
    torch._dynamo.reset()
    blackwell.wrong = wrong
    q, k, v = inputs()
    bm = block_mask()
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, alibi, bm, enable_gqa=True,
                                                      return_lse=True),
                       backend="aot_eager", fullgraph=True)
    if wrong:
        with pytest.warns(SelfCheckWarning, match="out: max abs error"):
            out, lse = fn(q, k, v)
    else:
        out, lse = fn(q, k, v)
    assert [name for name, _ in programs_run] == ["reference" if wrong else "cute_sm100"]
    assert_matches_oracle(out, lse, q, k, v)


# --------------------------------------------------------------------------- training


def test_training_pairs_the_checked_forward_with_the_triton_backward(blackwell, monkeypatch):
    # Where the sm100 backward refuses a call: the forward's saved LSE is the natural-log LSE the
    # Triton backward reads (the check compares it), so training runs the sm100 forward + the
    # Triton backward.
    refusal = "the sm100 backward does not serve this call (stand-in refusal)"
    monkeypatch.setattr(cute_sm100.sm100_bwd, "backward_supports", lambda call: (False, refusal))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = inputs(grad=True, n=200)
    bm = block_mask(200)
    choice = explain(q, k, v, alibi, bm, enable_gqa=True)
    assert (choice.name, choice.backward) == ("cute_sm100", "triton"), str(choice)
    assert refusal in choice.backward_reason
    out, lse = run(q, k, v, bm)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = dense_attention(q64, k64, v64, alibi, causal, dtype=torch.float64)
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    q16, k16, v16 = (t.detach().requires_grad_(True) for t in (q, k, v))
    low, _ = dense_attention(q16, k16, v16, alibi, causal, dtype=torch.bfloat16)
    lows = torch.autograd.grad(low, (q16, k16, v16), dout)
    for name, g, w, lw in zip(("dq", "dk", "dv"), got, want, lows):
        assert_close_to_oracle(name, g.double(), w, lw.double(), FLOOR[torch.bfloat16])
    assert_matches_oracle(out.detach(), lse.detach(), q.detach(), k.detach(), v.detach())


def test_the_real_sm100_backward_is_offered_only_behind_its_own_check(blackwell):
    # The real module (templates/cute_sm100_bwd.py, never run on Blackwell) serves this call's
    # head dim and dtype; explain, which runs nothing, names it with its check not yet run.
    q, k, v = inputs(grad=True, n=200)
    bm = block_mask(200)
    choice = explain(q, k, v, alibi, bm, enable_gqa=True)
    assert (choice.name, choice.backward) == ("cute_sm100", "cute_sm100"), str(choice)
    assert selfcheck.NOT_RUN in choice.backward_reason
    assert blackwell.compiled == []  # a dry run compiles nothing


class _FakeBackward:
    """A stand-in ``cute_sm100_bwd`` module: the reference backward, or a wrong one."""

    def __init__(self, wrong=False):
        self.wrong, self.ran = wrong, 0

    def backward_supports(self, call):
        return True, "the sm100 backward (stand-in)"

    def kernel_key(self, call):
        return ("stand-in bwd", call.program.key, call.q.dtype)

    def backward(self, call, q, k, v, out, lse, dout, dlse):
        self.ran += 1
        dq, dk, dv, *rest = reference.backward(call, q, k, v, out, lse, dout, dlse)
        if self.wrong:
            dk = dk.clone()
            dk[0, 0, 3, 0] += 10.0  # gross: the hook keeps the suite's loose bf16 bound (ALiBi dk ~2)
        return (dq, dk, dv, *rest)


@pytest.mark.parametrize("wrong", [False, True])
def test_a_future_sm100_backward_is_gated_too(blackwell, monkeypatch, wrong):
    fake = _FakeBackward(wrong)
    monkeypatch.setattr(cute_sm100, "sm100_bwd", fake)
    q, k, v = inputs(grad=True, n=200)  # 200: the check's case is the call's size
    bm = block_mask(200)
    choice = explain(q, k, v, alibi, bm, enable_gqa=True)
    assert (choice.name, choice.backward) == ("cute_sm100", "cute_sm100")
    assert "self-check not yet run" in choice.backward_reason and fake.ran == 0
    if wrong:
        expect = r"sm100 backward.*dk: max abs error 1\d(\.\d+)? at \(b=0, h=0, kv=3, d=0\)"
        with pytest.warns(SelfCheckWarning, match=expect):
            out, lse = run(q, k, v, bm)
    else:
        out, lse = run(q, k, v, bm)
    choice = explain(q, k, v, alibi, bm, enable_gqa=True)
    if wrong:
        # The failed backward is passed over; no other backward runs a CPU call here (no
        # TRITON_INTERPRET), so the whole call moved to the reference. Its checked
        # forward stays enabled.
        assert choice.name == "reference"
        assert "self-check failed" in dict(choice.passed_over)["cute_sm100"]
        fwd = prepare_call(q, k, v, alibi, bm, None, True, None)
        assert selfcheck.outcome(("sm100 forward", cute_sm100.kernel_key(fwd)),
                                 cute_sm100.variant(fwd)).passed
    else:
        assert (choice.name, choice.backward) == ("cute_sm100", "cute_sm100")
        assert "self-checked on this GPU (passed: dq" in choice.backward_reason
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert fake.ran == (1 if wrong else 2)  # the check (and, when it passed, the call)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = dense_attention(q64, k64, v64, alibi, causal, dtype=torch.float64)
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert (g.double() - w).abs().max() < 0.05, name


def test_the_check_cannot_run_during_graph_capture(blackwell, monkeypatch):
    # While a CUDA graph is being captured the check cannot run: auto passes over the kernel
    # (nothing recorded, so the next eager call checks it); explain still says "not yet run".
    monkeypatch.setattr(selfcheck, "blocked", lambda: "the current stream is capturing a CUDA graph")
    q, k, v = inputs()
    bm = block_mask()
    out, lse = run(q, k, v, bm)
    assert blackwell.compiled == [] and selfcheck.results() == {}
    assert "self-check not yet run" in explain(q, k, v, alibi, bm, enable_gqa=True).reason
    assert_matches_oracle(out, lse, q, k, v)
    with pytest.raises(NotImplementedError, match="cannot run now"):
        run(q, k, v, bm, backend="cute")


def test_selfcheck_warning_is_exported():
    assert flexjit.SelfCheckWarning is SelfCheckWarning and issubclass(SelfCheckWarning, RuntimeWarning)


# --------------------------------------------------------------------------- on a real GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_simulated_as_blackwell(blackwell):
    # On the H200 (no Blackwell exists here): CUDA tensors, the capability said to be 10.0,
    # stand-in kernels. Checks what the CPU cannot: the check's generator and outputs on the GPU,
    # the fallback to the real Triton kernels, and CUDA graph capture (the check cannot run
    # there: the call is passed over to Triton and nothing is recorded). Sizes as the CPU tests'.
    dev = "cuda"
    q, k, v = (t.to(dev) for t in inputs())
    bm = create_block_mask(causal, None, None, L, L, device=dev)
    slopes = SLOPES.to(dev)

    def alibi_gpu(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def check(out, lse):
        with torch.no_grad():
            ref, ref_lse = dense_attention(q, k, v, alibi_gpu, causal, dtype=torch.float64)
            low, low_lse = dense_attention(q, k, v, alibi_gpu, causal, dtype=q.dtype)
        assert_close_to_oracle("out", out, ref, low, FLOOR[q.dtype])
        assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[q.dtype])

    def call(**kw):
        return flex_attention(q, k, v, alibi_gpu, bm, enable_gqa=True, return_lse=True, **kw)

    # CUDA graph capture before any check: passed over, Triton captured and replayed (Triton
    # compiled first, outside the capture).
    flex_attention(q, k, v, alibi_gpu, bm, enable_gqa=True, return_lse=True, backend="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = call()
    graph.replay()
    torch.cuda.synchronize()
    assert blackwell.compiled == [] and selfcheck.results() == {}
    check(g_out, g_lse)
    # A correct stand-in passes on the GPU and answers.
    out, lse = call()
    assert blackwell.launched == [(2, 4, 300, D), (B, HQ, L, D)]
    assert explain(q, k, v, alibi_gpu, bm, enable_gqa=True).name == "cute_sm100"
    check(out, lse)
    # A wrong one (another kernel key: max_scores asked) is disabled; the fallback is Triton.
    blackwell.wrong = "lse"
    with pytest.warns(SelfCheckWarning, match="lse: max abs error"):
        out, aux = flex_attention(q, k, v, alibi_gpu, bm, enable_gqa=True,
                                  return_aux=flexjit.AuxRequest(lse=True, max_scores=True))
    choice = explain(q, k, v, alibi_gpu, bm, enable_gqa=True,
                     return_aux=flexjit.AuxRequest(lse=True, max_scores=True))
    assert choice.name == "triton", str(choice)
    check(out, aux.lse)
