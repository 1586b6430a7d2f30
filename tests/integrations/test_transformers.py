"""Hugging Face transformers with attn_implementation="flexjit", on the CPU.

Tiny random models (2 layers, 4 query / 2 KV heads, 200 tokens over 128-blocks: ragged, several
blocks) in float32 against the golden: the same weights in float64 with the test's own dense
attention ("golden" below: plain torch math on transformers' boolean mask, a fully masked row
giving 0). flexjit's error on the logits and on every parameter's gradient must be within twice
eager attention's (the models' own float32 path) plus a floor. Covers GQA, sliding-window layers
(Mistral), softcapping with alternating sliding layers (Gemma 2), left and right padding, and
packed sequences. (Not SDPA as the golden: transformers 5.24 refuses it for Gemma 2, and eager
attention in float64 turns a fully padded row into NaN that leaks into the next layer.)
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
import flexjit.integrations.transformers as fjt  # noqa: E402  (registers "flexjit")
from oracle import max_err  # noqa: E402
from transformers.masking_utils import sdpa_mask  # noqa: E402

L = 200


def golden_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     softcap=None, **kwargs):
    """Dense attention in the inputs' dtype (float64 here) on a (B, 1, L, S) keep-mask."""
    g = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    s = query @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if attention_mask is not None:
        s = s.masked_fill(~attention_mask[:, :, :, : key.shape[-2]], float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, 0))
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den == 0, 1, den)
    return (p @ value).transpose(1, 2).contiguous(), None


def golden_mask(*args, **kwargs):
    """transformers' boolean mask, always materialised, fully masked rows left masked."""
    return sdpa_mask(*args, **dict(kwargs, allow_is_causal_skip=False, allow_torch_fix=False))


transformers.AttentionInterface.register("golden", golden_attention)
transformers.masking_utils.AttentionMaskInterface.register("golden", golden_mask)


def _config(family: str):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, attention_dropout=0.0)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=64)
    if family == "gemma2":
        return transformers.Gemma2Config(**common, sliding_window=64, attn_logit_softcapping=5.0,
                                         query_pre_attn_scalar=16,
                                         layer_types=["sliding_attention", "full_attention"])
    raise ValueError(family)


def _models(family: str):
    torch.manual_seed(0)
    cfg = _config(family)
    make = transformers.AutoModelForCausalLM.from_config
    golden = make(copy.deepcopy(cfg), attn_implementation="golden")
    models = {impl: make(copy.deepcopy(cfg), attn_implementation=impl) for impl in ("eager", "flexjit")}
    for m in models.values():
        m.load_state_dict(golden.state_dict())
    return golden.double(), models


def _batch(kind: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, L), generator=g)
    kwargs, valid = {}, torch.ones(2, L, dtype=torch.bool)
    if kind in ("left_padding", "right_padding"):
        mask = torch.ones(2, L, dtype=torch.long)
        if kind == "left_padding":
            mask[0, :37] = 0
            mask[1, :150] = 0  # past the first 128-block: whole blocks of padding too
        else:
            mask[0, 163:] = 0
        kwargs["attention_mask"], valid = mask, mask.bool()
    elif kind == "packed":
        # Three documents in row 0, two in row 1: position_ids restart -> a document mask.
        pos = [torch.cat([torch.arange(70), torch.arange(60), torch.arange(70)]),
               torch.cat([torch.arange(129), torch.arange(71)])]
        kwargs["position_ids"] = torch.stack(pos)
    return ids, kwargs, valid


def _run(model, ids, kwargs, valid):
    """Logits and every parameter's gradient of the loss over the valid (unpadded) tokens."""
    model.zero_grad()
    logits = model(ids, **kwargs).logits
    labels = torch.where(valid, ids, -100)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).double(),
                                             labels[:, 1:].flatten(), ignore_index=-100)
    loss.backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family,kind", [
    ("llama", "plain"), ("llama", "left_padding"), ("llama", "right_padding"), ("llama", "packed"),
    ("mistral", "plain"), ("mistral", "left_padding"), ("gemma2", "plain"), ("gemma2", "left_padding")])
def test_logits_and_gradients_match_the_golden_model(family, kind):
    golden, models = _models(family)
    ids, kwargs, valid = _batch(kind)
    want_logits, want_grads = _run(golden, ids, kwargs, valid)
    eager_logits, eager_grads = _run(models["eager"], ids, kwargs, valid)
    got_logits, got_grads = _run(models["flexjit"], ids, kwargs, valid)
    floor = 1e-5
    err, bound = max_err(got_logits[valid], want_logits[valid]), max_err(eager_logits[valid], want_logits[valid])
    assert err <= 2 * bound + floor, f"logits: {err:.3g} vs eager's {bound:.3g}"
    for name, want in want_grads.items():
        scale = max(1.0, want.abs().max().item())
        err, bound = max_err(got_grads[name], want), max_err(eager_grads[name], want)
        assert err <= 2 * bound + floor * scale, f"d{name}: {err:.3g} vs eager's {bound:.3g}"


def test_padding_reaches_the_kernel():
    # The trap: without a mask function registered under the same name, transformers
    # hands the attention function attention_mask=None and the padding is silently lost. The
    # padded run must differ from the unpadded one where padding matters, and match the golden.
    golden, models = _models("llama")
    ids, kwargs, valid = _batch("left_padding")
    plain = models["flexjit"](ids).logits
    padded = models["flexjit"](ids, **kwargs).logits
    want = golden(ids, **kwargs).logits
    rows = valid[0]
    assert max_err(plain[0][rows], want[0][rows]) > 1e-2  # the padding changes these logits
    assert max_err(padded[0][rows], want[0][rows]) < 1e-4


def test_an_unpadded_mask_is_planned_once_and_reused(monkeypatch):
    # transformers makes a new mask closure every forward; the plan of a mask without tensors is
    # reused across layers and steps, one per (mask, shape).
    _, models = _models("mistral")
    fjt._PLANNED.clear()
    planned = []
    real = fjt.create_block_mask
    monkeypatch.setattr(fjt, "create_block_mask", lambda *a, **k: planned.append(a[1:5]) or real(*a, **k))
    seen = []
    real_attention = fjt.flexjit_attention

    def spy(module, q, k, v, mask, *a, **kw):
        seen.append(mask)
        return real_attention(module, q, k, v, mask, *a, **kw)
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "flexjit", spy)
    ids, _, _ = _batch("plain")
    for _ in range(3):
        models["flexjit"](ids)
    assert len(planned) == 1, planned  # Mistral: one sliding-window mask for every layer
    assert len(seen) == 6 and all(m is seen[0] for m in seen)
    # a padded batch captures its padding tensor: planned per forward, never from the cache
    ids, kwargs, _ = _batch("right_padding")
    models["flexjit"](ids, **kwargs)
    models["flexjit"](ids, **kwargs)
    assert len(planned) == 3


def test_dropout_and_sinks_are_refused_clearly():
    golden, models = _models("llama")
    m = models["flexjit"].train()
    attn = m.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="attention_dropout"):
        fjt.flexjit_attention(attn, q, kv, kv, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="sinks"):
        fjt.flexjit_attention(attn, q, kv, kv, None, s_aux=torch.zeros(4))


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_hand_made_4d_mask_is_applied(kind):
    # A caller may hand the attention function its own (B, 1, L, S) mask instead of a BlockMask:
    # keep/drop booleans or an additive float mask, wider than the keys (it is cut to S).
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 40, 16, generator=g)
    k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(2))
    keep = torch.rand(2, 1, 40, 48, generator=g) > 0.3
    keep[..., 0] = True  # no fully masked row
    mask = keep if kind == "bool" else torch.where(keep, 0.0, float("-inf")) + 0.1 * torch.randn(2, 1, 40, 48, generator=g)
    module = torch.nn.Module()
    got, _ = fjt.flexjit_attention(module, q, k, v, mask, scaling=0.3)
    if kind == "bool":
        want, _ = golden_attention(module, q.double(), k.double(), v.double(), mask, scaling=0.3)
    else:
        want, _ = _additive_golden(q, k, v, mask, 0.3)
    assert max_err(got, want) < 1e-5  # float32 math against float64: rounding only


def _additive_golden(q, k, v, mask, scaling):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ kk.transpose(-1, -2) * scaling + mask[..., : k.shape[-2]].double()
    return (torch.softmax(s, -1) @ vv).transpose(1, 2), None
