"""Gradient accuracy on the GPU under torch's error-ratio oracle (issue #14), against torch's own
compiled Flex-Triton on the same inputs (``benchmarks.grad_accuracy``: relative bias, two bf16 /
fp32 tables, a gathered table, a learned ALiBi slope, no mod).

Two bars per tensor, from the mean |float64 golden - result|:
* torch's rule: within 1.1x the error of torch's eager math in the same dtype;
* no worse than torch's compiled kernel: 1.03x on out, dq, dk and dv (millions of elements: the
  four-seed spread of the ratio was below 0.01 on the H200), 1.10x on a captured table's gradient
  (8 to 1024 entries, each a sum over every score that reads it: the ratio moved 0.94-1.02 between
  seeds at the same code, gpu-s6-call3).
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from benchmarks import grad_accuracy  # noqa: E402

TORCH = "torch-flex-triton"


@pytest.mark.parametrize("backend", ["cute", "triton"])
def test_errors_within_torch_rule_and_no_worse_than_torch_flex(backend):
    if backend == "cute" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 kernels need Hopper")
    impl = f"flexjit-{backend}"
    rows = grad_accuracy.measure(1024, [impl, TORCH], torch.device("cuda"), seeds=2)
    bad = []
    for r in rows:
        ours, eager, theirs = r[impl], r["eager"], r[TORCH]
        bar = 1.03 if r["tensor"] in ("out", "q", "k", "v") else 1.10
        if not ours <= 1.1 * eager:
            bad.append(f"{r['case']} {r['tensor']}: {ours:.3g} > 1.1 x eager {eager:.3g}")
        if not ours <= bar * theirs:
            bad.append(f"{r['case']} {r['tensor']}: {ours:.3g} > {bar} x {TORCH} {theirs:.3g}")
    assert not bad, "\n".join(bad)
