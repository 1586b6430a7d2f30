"""Gradient accuracy on the GPU under torch's error-ratio oracle (issue #14), against torch's own
compiled Flex-Triton on the same inputs (``benchmarks.grad_accuracy``: relative bias, two bf16 /
fp32 tables, a gathered table, a learned ALiBi slope, no mod).

Two bars per tensor, from the mean |float64 golden - result|:
* torch's rule: within 1.1x the error of torch's eager math in the same dtype;
* no worse than torch's compiled kernel: 1.03x on out, dq, dk and dv (millions of elements: the
  ratio moved by less than 0.01 between one seed and four on the H200), 1.15x on a captured
  table's gradient, over four seeds (8 to 1024 entries, each a sum over every score that reads
  it: one seed's ratio ranged 0.76-1.13 where four seeds' mean read 0.93-1.07 for the same
  kernels, gpu-s6-call1 and -call2).
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
    rows = grad_accuracy.measure(1024, [impl, TORCH], torch.device("cuda"), seeds=4)
    bad = []
    for r in rows:
        ours, eager, theirs = r[impl], r["eager"], r[TORCH]
        bar = 1.03 if r["tensor"] in ("out", "q", "k", "v") else 1.15
        if not ours <= 1.1 * eager:
            bad.append(f"{r['case']} {r['tensor']}: {ours:.3g} > 1.1 x eager {eager:.3g}")
        if not ours <= bar * theirs:
            bad.append(f"{r['case']} {r['tensor']}: {ours:.3g} > {bar} x {TORCH} {theirs:.3g}")
    assert not bad, "\n".join(bad)
