"""benchmarks.grad_accuracy's split of a gradient's error: the part that the forward's
stored output sets, computed from the float64 golden, must be exactly what a backward that reads
D_i = dO_i · O_i from a rounded output adds to q's, k's and each captured tensor's gradient.

The "kernel" here is float64 math whose only inexact step is that one: O rounded to bf16 before
D is formed, as every flash backward does. Its error beyond the output's part must vanish while
its raw error does not (a wrong sign, P or derivative in the split would leave it).
"""
import pytest
import torch

from benchmarks import grad_accuracy
from oracle import dense_attention, dense_scores


def _rounded_output_backward(make, mask_mod, q, k, v, tables, do):
    """(out stored in bf16, {name: gradient}) with dS = P (dP - dO · bf16(O)), all else exact."""
    leaves = {"q": q.double().requires_grad_(True), "k": k.double().requires_grad_(True),
              **{n: t.detach().double().requires_grad_(True) for n, t in tables.items()}}
    s = dense_scores(leaves["q"], leaves["k"], make({n: leaves[n] for n in tables}), mask_mod)
    p = torch.softmax(s.detach(), -1).nan_to_num(0.0)
    vv = v.double()
    stored = (p @ vv).to(torch.bfloat16)
    dp = do.double() @ vv.transpose(-1, -2)
    ds = p * (dp - (do.double() * stored.double()).sum(-1, keepdim=True))
    loss = (ds * torch.where(torch.isfinite(s), s, torch.zeros_like(s))).sum()
    names = list(leaves)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return stored, dict(zip(names, grads))


@pytest.mark.parametrize("case", ["two_tables(bf16 q, fp32 kv)", "gathered_table(bias[offset[q]])",
                                  "learned_alibi_causal", "rel_bias_causal"])
def test_the_outputs_part_is_what_a_rounded_output_adds(case):
    S, B, H, D = 64, 1, 2, 16
    make, tables, mask_mod = grad_accuracy._cases(S, torch.device("cpu"))[case]
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, generator=g).to(torch.bfloat16) for _ in range(4))
    leaves = {"q": q.double().requires_grad_(True), "k": k.double().requires_grad_(True),
              **{n: t.detach().double().requires_grad_(True) for n, t in tables.items()}}
    gold_out = dense_attention(leaves["q"], leaves["k"], v.double(),
                               make({n: leaves[n] for n in tables}), mask_mod)[0]
    gold = dict(zip(leaves, torch.autograd.grad(gold_out, list(leaves.values()), do.double(),
                                                allow_unused=True)))
    stored, grads = _rounded_output_backward(make, mask_mod, q, k, v, tables, do)
    part = grad_accuracy._from_out(make, mask_mod, q, k, tables, gold_out.detach(), stored, do)
    for name in leaves:
        raw = (grads[name] - gold[name]).abs()
        rest = (grads[name] - part[name] - gold[name]).abs()
        # (a q-indexed additive table's exact gradient is 0: softmax ignores a per-row shift)
        assert raw.max() > 1e-6 * gold[name].abs().max() and raw.max() > 0, (
            f"{case} {name}: the rounded output changed nothing")
        assert rest.max() <= 1e-8 * raw.max(), (
            f"{case} {name}: {rest.max():.3g} left beyond the output's part (raw {raw.max():.3g})")
