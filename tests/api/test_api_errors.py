"""Bad input gets a clear error, never a wrong answer."""
import warnings

import pytest
import torch

from flexjit.api.attention import AuxOutput, AuxRequest, explain, flex_attention
from flexjit import create_block_mask
from flexjit import mods
from oracle import FLOOR, assert_close_to_oracle, dense_attention


def qkv(B=1, Hq=2, Hkv=2, L=64, S=64, E=16, dtype=torch.float32):
    return (torch.randn(B, Hq, L, E, dtype=dtype), torch.randn(B, Hkv, S, E, dtype=dtype),
            torch.randn(B, Hkv, S, E, dtype=dtype))


@pytest.mark.parametrize("mutate,err,msg", [
    (lambda q, k, v: (q[0], k, v), ValueError, "must be 4-D"),
    (lambda q, k, v: (q.int(), k, v), TypeError, "dtype"),
    (lambda q, k, v: (q, k.double(), v), ValueError, "share a dtype.*torch.autocast"),
    (lambda q, k, v: (q, k, v.bfloat16()), ValueError, "share a dtype.*torch.autocast"),
    (lambda q, k, v: (q, k[:, :, :, :8], v), ValueError, "head dim"),
    (lambda q, k, v: (q, k, v[:, :, :32]), ValueError, "agree on heads and length"),
    (lambda q, k, v: (q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)), ValueError, "batch sizes differ"),
    (lambda q, k, v: (q, k[:, :1], v[:, :1]), ValueError, "enable_gqa=True"),
    (lambda q, k, v: ("q", k, v), TypeError, "torch.Tensor"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v), ValueError, "empty input"),  # head dim 0
])
def test_bad_tensors(mutate, err, msg):
    q, k, v = mutate(*qkv())
    with pytest.raises(err, match=msg):
        flex_attention(q, k, v)


def test_gqa_heads_must_divide():
    q, k, v = qkv(Hq=3, Hkv=2)
    with pytest.raises(ValueError, match="multiple"):
        flex_attention(q, k, v, enable_gqa=True)


def test_block_mask_for_other_lengths_is_refused():
    q, k, v = qkv(L=64, S=64)
    bm = create_block_mask(mods.causal(), 1, 1, 128, 128, device="cpu")
    with pytest.raises(ValueError, match=r"created for \(Q_LEN, KV_LEN\) = \(128, 128\)"):
        flex_attention(q, k, v, block_mask=bm)


def test_block_mask_with_wrong_batch_or_heads_is_refused():
    q, k, v = qkv(B=2)
    bm = create_block_mask(mods.causal(), 3, 1, 64, 64, device="cpu")
    with pytest.raises(ValueError, match="batch size 3"):
        flex_attention(q, k, v, block_mask=bm)


def test_broadcast_mask_that_depends_on_batch_is_refused():
    q, k, v = qkv(B=2)
    lengths = torch.tensor([10, 60])

    def pad(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]
    bm = create_block_mask(pad, None, None, 64, 64, device="cpu")
    with pytest.raises(ValueError, match="depends on the batch index"):
        flex_attention(q, k, v, block_mask=bm)


def test_torchs_block_mask_and_aux_request_are_accepted():
    # Code written for torch's flex keeps its BlockMask and AuxRequest objects.
    from torch.nn.attention import flex_attention as tflex
    q, k, v = qkv()
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    theirs = tflex.create_block_mask(causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=16)
    ours = create_block_mask(causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=16)
    want, want_aux = flex_attention(q, k, v, block_mask=ours, return_aux=AuxRequest(lse=True))
    got, got_aux = flex_attention(q, k, v, block_mask=theirs, return_aux=tflex.AuxRequest(lse=True))
    assert torch.equal(got, want) and torch.equal(got_aux.lse, want_aux.lse)
    assert explain(q, k, v, block_mask=theirs).name == "reference"
    with pytest.raises(TypeError, match="BlockMask"):
        flex_attention(q, k, v, block_mask=object())


def test_mod_arity_is_checked_before_running():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="must take 5 arguments"):
        flex_attention(q, k, v, score_mod=lambda b, h, q, kv: q >= kv)


def test_unknown_and_missing_backends():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="backend must be one of"):
        flex_attention(q, k, v, backend="cuda")
    # on a CPU tensor the GPU backends say plainly why they cannot run
    for name in ("cute", "triton"):
        with pytest.raises(NotImplementedError, match=f"backend='{name}' cannot run this call"):
            flex_attention(q, k, v, backend=name)


def test_explain_answers_without_running():
    q, k, v = qkv()
    choice = explain(q, k, v, score_mod=mods.softcap(20.0))
    assert choice.name == "reference" and "pure torch" in choice.reason


def test_explain_says_why_every_other_backend_was_passed_over(monkeypatch):
    # On the CPU auto tries only the reference; cute and triton still get their reasons, in
    # the Choice and in its text, and what explain names is what runs.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv()
    choice = explain(q, k, v, score_mod=mods.softcap(20.0))
    why = dict(choice.passed_over)
    assert set(why) == {"cute", "triton"}
    assert "needs a CUDA tensor" in why["cute"] and "TRITON_INTERPRET=1" in why["triton"]
    assert all(f"not {name}: {reason}" in str(choice) for name, reason in why.items())
    assert torch.equal(flex_attention(q, k, v, score_mod=mods.softcap(20.0)),
                       flex_attention(q, k, v, score_mod=mods.softcap(20.0), backend="reference"))
    # the interpreter could run it, but auto leaves it to be asked for
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton = dict(explain(q, k, v).passed_over)["triton"]
    assert "backend='triton'" in triton or "not installed" in triton, triton
    # a backend asked for by name: the others were not tried
    asked = explain(q, k, v, backend="reference")
    assert dict(asked.passed_over) == {n: "backend='reference' was asked for" for n in ("cute", "triton")}


def test_explain_names_the_backward_when_training():
    q, k, v = qkv()
    assert explain(q, k, v).backward is None
    choice = explain(q.requires_grad_(True), k, v)
    assert choice.backward == "reference" and "autograd" in choice.backward_reason
    assert "backward: reference" in str(choice)


def test_backward_is_chosen_as_a_pair_with_the_forward(monkeypatch):
    # The sm90 forward trains on the Triton backward when its own backward refuses the call, and
    # a forward whose every backward refuses is passed over (on a GPU: to Triton).
    from flexjit.runtime import dispatch
    from flexjit.api.attention import prepare_call

    q, k, v = qkv()
    call = prepare_call(q.requires_grad_(True), k, v, None, None, None, False, None)
    answers = {("cute", "supports"): (True, "fwd ok"), ("cute", "backward_supports"): (False, "no D=96"),
               ("triton", "supports"): (True, "triton fwd"), ("triton", "backward_supports"): (True, "tri bwd")}
    monkeypatch.setattr(dispatch, "_supports", lambda name, c, what="supports": answers[(name, what)])
    monkeypatch.setattr(dispatch, "_preference", lambda device: ("cute", "triton", "reference"))
    choice = dispatch.select("auto", call)
    assert (choice.name, choice.backward) == ("cute", "triton")
    assert "tri bwd" in choice.backward_reason and "no D=96" in choice.backward_reason
    answers[("triton", "backward_supports")] = (False, "tri no")
    answers[("triton", "supports")] = (False, "tri no")
    answers[("reference", "supports")] = (True, "ref")
    answers[("reference", "backward_supports")] = (True, "ref bwd")
    choice = dispatch.select("auto", call)
    assert (choice.name, choice.backward) == ("reference", "reference")
    assert "no backward can train it" in dict(choice.passed_over)["cute"]
    with pytest.raises(NotImplementedError, match="no backward can train it"):
        dispatch.select("cute", call)


def test_kernel_options_take_torchs_keys_and_refuse_unknown_ones():
    q, k, v = qkv()
    want = flex_attention(q, k, v)
    # torch's keys (with fwd_/bwd_ prefixes) are accepted; these tune torch's own template
    for opts in ({"PRESCALE_QK": True}, {"fwd_num_warps": 4, "bwd_BLOCK_M1": 16}, {"USE_TMA": False},
                 {"BACKEND": "AUTO"}):
        assert torch.equal(flex_attention(q, k, v, kernel_options=opts), want), opts
    with pytest.raises(ValueError, match="unknown kernel_options \\['BLOCK_X'\\].*PRESCALE_QK"):
        flex_attention(q, k, v, kernel_options={"BLOCK_X": 64})
    with pytest.raises(ValueError, match="BACKEND"):
        flex_attention(q, k, v, kernel_options={"BACKEND": "NOPE"})
    # BACKEND asks for a backend as torch's does: FLASH is flexjit's CuTeDSL kernel (no GPU here)
    with pytest.raises(NotImplementedError, match="backend='cute'"):
        flex_attention(q, k, v, kernel_options={"BACKEND": "FLASH"})


def test_empty_inputs_give_empty_outputs():
    # No queries (B, H or L of 0) is an empty output; no keys (S = 0) leaves every row
    # fully masked: out 0, lse -inf, zero gradients.
    for qs, ks in (((0, 2, 8, 16), (0, 2, 8, 16)), ((1, 2, 0, 16), (1, 2, 8, 16)),
                   ((1, 0, 8, 16), (1, 0, 8, 16)), ((1, 2, 8, 16), (1, 2, 0, 16))):
        q = torch.randn(qs, requires_grad=True)
        k, v = (torch.randn(ks, requires_grad=True) for _ in range(2))
        out, lse = flex_attention(q, k, v, return_lse=True)
        assert out.shape == (*qs[:3], 16) and lse.shape == qs[:3]
        assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
        out.sum().backward()
        for t in (q, k, v):
            assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()
    with pytest.raises(ValueError, match="empty input"):
        flex_attention(torch.randn(1, 2, 8, 0), torch.randn(1, 2, 8, 0), torch.randn(1, 2, 8, 16))


def test_a_key_value_batch_of_one_broadcasts():
    # K/v of batch 1 serve every query batch (a view); gradients sum over the batch.
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 2, 32, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 32, 16, generator=g, requires_grad=True) for _ in range(2))
    out = flex_attention(q, k, v, score_mod=mods.softcap(20.0))
    kk, vv = (t.detach().expand(3, -1, -1, -1).clone().requires_grad_(True) for t in (k, v))
    want = flex_attention(q.detach(), kk, vv, score_mod=mods.softcap(20.0))
    assert torch.allclose(out, want, atol=1e-6)
    out.sum().backward()
    want.sum().backward()
    assert torch.allclose(k.grad, kk.grad.sum(0, keepdim=True), atol=1e-5)
    assert torch.allclose(v.grad, vv.grad.sum(0, keepdim=True), atol=1e-5)


def test_return_aux_and_lse():
    q, k, v = qkv()
    out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True))
    assert isinstance(aux, AuxOutput) and aux.lse.shape == (1, 2, 64) and aux.lse.dtype == torch.float32
    out2, lse = flex_attention(q, k, v, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(aux.lse, lse)
    with pytest.raises(ValueError, match="not both"):
        flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))


def test_max_scores():
    # torch's AuxRequest(max_scores=True): the row max of the modded scores (-inf on a fully
    # masked row), with or without the lse, no gradient; out and its gradients are unchanged.
    from oracle import FLOOR, assert_close_to_oracle, dense_scores, random_qkv
    q, k, v = random_qkv(2, 4, 2, 64, 48, 16, 16, torch.float32, 3)
    score = mods.softcap(20.0)

    def mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx - 5  # rows 0-4 keep nothing
    bm = create_block_mask(mask, None, None, 64, 48, device="cpu", BLOCK_SIZE=32)
    out, aux = flex_attention(q, k, v, score, bm, enable_gqa=True,
                              return_aux=AuxRequest(lse=True, max_scores=True))
    got = aux.max_scores
    assert got.shape == (2, 4, 64) and got.dtype == torch.float32 and not got.requires_grad
    assert torch.isneginf(got[:, :, :5]).all() and torch.isfinite(got[:, :, 5:]).all()
    ref = dense_scores(q, k, score, mask).amax(-1)
    low = dense_scores(q, k, score, mask, dtype=torch.float32).amax(-1)
    assert_close_to_oracle("max_scores", got, ref, low, FLOOR[torch.float32])
    plain = flex_attention(q, k, v, score, bm, enable_gqa=True)
    assert torch.equal(out, plain)
    only = flex_attention(q, k, v, score, bm, enable_gqa=True, return_aux=AuxRequest(max_scores=True))[1]
    assert only.lse is None and torch.equal(only.max_scores, got)
    dq, = torch.autograd.grad(out.sum(), q)
    want_dq, = torch.autograd.grad(plain.sum(), q)
    assert torch.equal(dq, want_dq)
    torch_aux = pytest.importorskip("torch.nn.attention.flex_attention").AuxRequest
    assert torch.equal(flex_attention(q, k, v, score, bm, enable_gqa=True,
                                      return_aux=torch_aux(max_scores=True))[1].max_scores, got)
    empty = flex_attention(q[:, :, :0], k, v, enable_gqa=True, return_aux=AuxRequest(max_scores=True))[1]
    assert empty.max_scores.shape == (2, 4, 0)
    no_keys = flex_attention(q, k[:, :, :0], v[:, :, :0], enable_gqa=True,
                             return_aux=AuxRequest(max_scores=True))[1]
    assert torch.isneginf(no_keys.max_scores).all() and no_keys.max_scores.shape == (2, 4, 64)


def test_a_tensor_scale_is_taken_as_torch_takes_it():
    # torch's eager flex_attention multiplies by a one-element tensor scale; flexjit reads its
    # value on every call (an in-place edit is seen, not cached).
    q, k, v = qkv()
    scale = torch.tensor(0.3)
    for value in (0.3, 0.7):
        scale.fill_(value)
        got = flex_attention(q, k, v, score_mod=mods.softcap(20.0), scale=scale)
        assert torch.equal(got, flex_attention(q, k, v, score_mod=mods.softcap(20.0), scale=value))
        ref = dense_attention(q, k, v, mods.softcap(20.0), scale=value)[0]
        low = dense_attention(q, k, v, mods.softcap(20.0), scale=value, dtype=torch.float32)[0]
        assert_close_to_oracle("out", got, ref, low, FLOOR[torch.float32])
    tfa = pytest.importorskip("torch.nn.attention.flex_attention")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note that its eager path is unfused
        theirs = tfa.flex_attention(q, k, v, scale=torch.tensor(0.7, dtype=torch.float64))
    assert torch.allclose(flex_attention(q, k, v, scale=torch.tensor(0.7, dtype=torch.float64)),
                          theirs, atol=1e-6)
    assert torch.equal(flex_attention(q, k, v, scale=torch.tensor([0.7])), flex_attention(q, k, v, scale=0.7))
    with pytest.raises(TypeError, match="one real number"):
        flex_attention(q, k, v, scale=torch.tensor([0.1, 0.2]))
    with pytest.raises(TypeError, match="scale must be a float"):
        flex_attention(q, k, v, scale="0.1")
    # a gradient for scale would be silently missing: refused, with the way to get one
    with pytest.raises(NotImplementedError, match="scale=1.0 and multiply in a score_mod"):
        flex_attention(q, k, v, scale=torch.tensor(0.1, requires_grad=True))


def test_double_backward_is_refused_with_a_reason():
    # create_graph=True gives the same first gradients, and a term that only reuses them (a
    # penalty on another tensor's gradient) still works; differentiating flexjit's gradients
    # again names the limit instead of autograd's "does not require grad".
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g, requires_grad=True) for _ in range(3))
    want = torch.autograd.grad(flex_attention(q, k, v, score_mod=mods.softcap(20.0)).sum(), (q, k, v))
    out = flex_attention(q, k, v, score_mod=mods.softcap(20.0))
    got = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(RuntimeError, match="does not support double backward"):
        got[0].sum().backward()


def test_meta_tensors_are_refused_with_a_reason():
    # As torch's flex_attention, meta inputs (shapes, no data) are refused, here before any
    # backend: by name, with how to materialise them; a captured meta tensor too. The same
    # call on real tensors gives the reference's answer.
    q, k, v = qkv(L=32, S=32)
    with pytest.raises(ValueError, match="^key is on the meta device.*to_empty"):
        flex_attention(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="^query, key, value are on the meta device"):
        explain(q.to("meta"), k.to("meta"), v.to("meta"))
    with pytest.raises(ValueError, match="meta device"):  # the empty-input path too
        flex_attention(q[:, :, :0].to("meta"), k, v)
    bias = torch.randn(32)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    meta_bias = torch.empty(32, device="meta")
    with pytest.raises(ValueError, match=r"captured tensor of shape \(32,\) is on the meta device"):
        flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + meta_bias[kv_idx])
    ref = dense_attention(q, k, v, biased)[0]
    low = dense_attention(q, k, v, biased, dtype=torch.float32)[0]
    assert_close_to_oracle("out", flex_attention(q, k, v, score_mod=biased), ref, low, FLOOR[torch.float32])
