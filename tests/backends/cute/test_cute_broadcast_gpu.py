"""A key/value batch of 1 broadcast over the query's batch, on the sm90 kernels.

    python -m pytest -q -m gpu tests/backends/cute/test_cute_broadcast_gpu.py

torch's batch broadcast: ``flex_attention(q (B, ...), k (1, ...), v (1, ...))``. The API expands
K/V to the batch (stride 0); the sm90 backend passes the (1, H, S, D) storage to kernels built
with ``kv_batch_broadcast`` (K/V loaded at batch 0) and the backward writes dK/dV per query batch,
summed by autograd's expand backward into the (1, ...) leaves. Checked, through the API and
autograd as a user calls it:

* out, lse and every gradient (dq, the summed dk/dv, a learnable table's) against the float64
  oracle (``tests/oracle.py``: dense attention on the expanded K/V); tolerance err <= 2·err(the
  same math in bf16 with plain torch) + a floor scaled by the gradient's magnitude;
* that the sm90 forward and backward ran, with the broadcast flag (``passes_run``, a spy on
  dispatch), never a fallback;
* mods that read ``b`` (per-batch masks and lists): query batch b must see its own b while all
  of them read the one K/V.

Shapes: B = 3 (odd, so a kernel reading K/V at the query's batch would read past the extent-1
tensor: zeros, caught), L = S = 1000 (ragged against 128), GQA 8/2, head dims 128 (two
consumers), 64 (the dense three-consumer tile) and 192 (the backward's 64-key dim-split tile).
Each case compiles a forward and a backward (2-6 s each on the H200 host).
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper GPU", allow_module_level=True)

from flexjit import create_block_mask  # noqa: E402
from flexjit.api.attention import flex_attention
from flexjit.backends.cute import sm90 as cute_sm90  # noqa: E402
from flexjit.ir.nodes import Op, uses  # noqa: E402
from flexjit.frontend.trace import MASK_MOD, trace_mod  # noqa: E402
from mods_catalog import case_and_oracle  # noqa: E402
from oracle import FLOOR, assert_close_to_oracle, dense_attention  # noqa: E402

DEV = "cuda"


def _ran(passes_run):
    """(pass, backend, K/V broadcast?) of every forward and backward dispatched so far."""
    return [(p, name, cute_sm90.kv_broadcast(call)) for p, name, call in passes_run]


def _block_mask(mask_mod, B, H, L, S):
    if mask_mod is None:
        return None
    traced = trace_mod(mask_mod, MASK_MOD).out
    return create_block_mask(mask_mod, B if uses(traced, Op.B) else None,
                             H if uses(traced, Op.H) else None, L, S, device=DEV)


def _losses(out, lse, dout, dlse):
    finite = torch.isfinite(lse)
    return (out.double() * dout.double()).sum() + \
        (torch.where(finite, lse, torch.zeros_like(lse)).double() * dlse.double()).sum()


def _oracle(case, q, k, v, dout, dlse, dtype):
    """(out, lse, dq, dk, dv, *captured grads) of dense attention in ``dtype`` on K/V expanded
    to the query's batch; dk/dv are the (1, ...) leaves' (autograd sums the expansion)."""
    B = q.shape[0]
    qq, kk, vv = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = dense_attention(qq, kk.expand(B, -1, -1, -1), vv.expand(B, -1, -1, -1),
                               case.score_mod, case.mask_mod, dtype=dtype)
    grads = torch.autograd.grad(_losses(out, lse, dout, dlse), (qq, kk, vv, *case.learnable))
    return (out.detach(), lse.detach(), *grads)


def _inputs(B, Hq, Hkv, L, S, D, Dv, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    bf = torch.bfloat16
    q = torch.randn(B, Hq, L, D, generator=g, device=DEV).to(bf).requires_grad_(True)
    k = torch.randn(1, Hkv, S, D, generator=g, device=DEV).to(bf).requires_grad_(True)
    v = torch.randn(1, Hkv, S, Dv, generator=g, device=DEV).to(bf).requires_grad_(True)
    dout = torch.randn(B, Hq, L, Dv, generator=g, device=DEV).to(bf)
    dlse = torch.randn(B, Hq, L, generator=g, device=DEV)
    return q, k, v, dout, dlse


def _flex(case, q, k, v, dout, dlse, bm, options=None):
    """(out, lse, dq, dk, dv, *captured grads) through the API and autograd on the cute backend
    (``options``: kernel_options)."""
    out, lse = flex_attention(q, k, v, case.score_mod, bm, enable_gqa=q.shape[1] != k.shape[1],
                              return_lse=True, backend="cute", kernel_options=options)
    grads = torch.autograd.grad(_losses(out, lse, dout, dlse), (q, k, v, *case.learnable))
    return (out.detach(), lse.detach(), *grads)


def check(name, D=128, Dv=None, B=3, Hq=8, Hkv=2, L=1000, S=1000, seed=0, runs=1,
          deterministic=False, options=None):
    """Values against the oracle; ``runs`` > 1 repeats the kernels (for the determinism check)
    and returns every run. ``deterministic``: the flex calls (only: the oracle's cuBLAS matmuls
    would refuse it) under ``torch.use_deterministic_algorithms(True)``. ``options``: the
    calls' kernel_options."""
    Dv = Dv or D
    case, case64 = case_and_oracle(name, B, Hq, L, S, device=DEV, seed=seed)
    q, k, v, dout, dlse = _inputs(B, Hq, Hkv, L, S, D, Dv, seed)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    torch.use_deterministic_algorithms(deterministic)
    try:
        got = [_flex(case, q, k, v, dout, dlse, bm, options) for _ in range(runs)]
    finally:
        torch.use_deterministic_algorithms(False)
    want = _oracle(case64, q, k, v, dout, dlse, torch.float64)
    low = _oracle(case, q, k, v, dout, dlse, torch.bfloat16)
    labels = ("out", "lse", "dq", "dk", "dv", "d_captured0")
    for label, a, b, c in zip(labels, got[0], want, low):
        assert a.shape == b.shape, (label, a.shape, b.shape)
        floor = FLOOR[torch.bfloat16] * (1.0 if label in ("out", "lse") else max(1.0, b.abs().max().item()))
        assert_close_to_oracle(f"{name} D={D} {label}", a.to(b.dtype), b, c.to(b.dtype), floor)
    return got


def assert_sm90_broadcast_ran(passes_run):
    ran = _ran(passes_run)
    assert ("fwd", "cute", True) in ran and ("bwd", "cute", True) in ran, ran
    assert all(r[1] == "cute" for r in ran), ran


@pytest.mark.parametrize("name", ["full", "causal", "batch_dependent", "prefix_lm_per_batch", "alibi",
                                  "softcap", "document"])
def test_broadcast_mods(passes_run, name):
    # batch_dependent / prefix_lm_per_batch: per-batch lists and mods reading b.
    check(name)
    assert_sm90_broadcast_ran(passes_run)


@pytest.mark.parametrize("D,Dv,name", [(64, 64, "full"), (64, 64, "causal"), (192, 192, "causal"),
                                       (192, 128, "batch_dependent")])
def test_broadcast_head_dims(passes_run, D, Dv, name):
    check(name, D=D, Dv=Dv)
    assert_sm90_broadcast_ran(passes_run)


@pytest.mark.parametrize("D,Dv,name", [(192, 192, "causal"), (192, 128, "batch_dependent")])
def test_broadcast_keys96(passes_run, D, Dv, name):
    # The 96-key backward tile (BWD_CONFIG "keys96") loads K/V at batch 0 as the 64-key one does.
    check(name, D=D, Dv=Dv, options={"BWD_CONFIG": "keys96"})
    assert_sm90_broadcast_ran(passes_run)


def test_broadcast_learnable_table(passes_run):
    # The captured-gradient atomics run in every query batch's CTAs; the table's gradient sums
    # them, dK/dV are summed by autograd.
    check("learnable_bias")
    assert_sm90_broadcast_ran(passes_run)


def test_broadcast_persistent_short_loops(passes_run, monkeypatch):
    # The persistent forward (one CTA per SM looping over tiles of every batch) with K/V at 0.
    from flexjit.backends.cute import sm90
    real = sm90._persistent_fwd
    monkeypatch.setattr(sm90, "_persistent_fwd",
                        lambda D, lists, S, owner=None, pinned=None: real(D, lists, S, owner, True))
    check("causal", B=5, L=512, S=512, seed=4)
    assert_sm90_broadcast_ran(passes_run)


def test_broadcast_deterministic_is_bit_identical(passes_run):
    # 2k tokens: 16 kv blocks add into every causal dQ tile's last rows, in each query batch.
    runs = check("causal", L=2048, S=2048, seed=2, runs=3, deterministic=True)
    for r in runs[1:]:
        for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), r, runs[0]):
            assert torch.equal(a, b), f"deterministic broadcast runs differ in {label}"
    assert_sm90_broadcast_ran(passes_run)


def test_broadcast_equals_the_materialised_batch(passes_run):
    # The same call with K/V copied to every batch runs the unflagged kernel; both read the same
    # values in the same order, so the outputs agree bit for bit.
    case, _ = case_and_oracle("causal", 3, 8, 1000, 1000, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(5)
    q = torch.randn(3, 8, 1000, 128, generator=g, device=DEV).to(torch.bfloat16)
    k, v = [torch.randn(1, 2, 1000, 128, generator=g, device=DEV).to(torch.bfloat16) for _ in range(2)]
    bm = _block_mask(case.mask_mod, 3, 8, 1000, 1000)
    a, lse_a = flex_attention(q, k, v, None, bm, enable_gqa=True, return_lse=True, backend="cute")
    b, lse_b = flex_attention(q, k.repeat(3, 1, 1, 1), v.repeat(3, 1, 1, 1), None, bm,
                              enable_gqa=True, return_lse=True, backend="cute")
    assert torch.equal(a, b) and torch.equal(lse_a, lse_b)
    assert _ran(passes_run) == [("fwd", "cute", True), ("fwd", "cute", False)], _ran(passes_run)


@pytest.mark.parametrize("name,D", [("causal", 128), ("document", 64)])
def test_broadcast_qhead(passes_run, name, D):
    # One CTA per query head ("qhead"): every query batch's CTAs add into their own batch's
    # dK/dV workspaces (per query batch, as the loop's dK/dV are), autograd sums them.
    check(name, D=D, options={"BWD_CONFIG": "qhead"})
    assert_sm90_broadcast_ran(passes_run)
