"""Gradient accuracy on the GPU under torch's error-ratio oracle (issue #14), against torch's own
compiled Flex-Triton on the same inputs (``benchmarks.grad_accuracy``: relative bias, two bf16 /
fp32 tables, a gathered table, a learned ALiBi slope, no mod).

Bars, from the mean |float64 golden - result| (``out·dO rms``: an RMS, see below):
* torch's rule: every tensor within 1.1x the error of torch's eager math in the same dtype;
* no worse than torch's compiled kernel: 1.03x on out, dq, dk, dv and ``out·dO rms`` (millions
  of elements: the ratio moved by less than 0.01 between one seed and four on the H200), 1.15x
  on a captured table's gradient over four seeds (8 to 1024 entries, each a sum over every
  score that reads it: one seed's ratio ranged 0.76-1.13 where four seeds' mean read 0.93-1.07
  for the same kernels, gpu-s6-call1 and -call2).
* A table the score_mod adds (``score + table[...]``) is judged raw (1.15x, as every table) AND
  with its gradient's mean over entries removed (``<table> centred``, 1.15x: what the
  backward's dS controls). Its gradients sum to sum(dS), 0 exactly; in a kernel
  that sum is -sum_i dO_i · (O_i - O_stored_i), the bf16 rounding of the forward's output
  projected on dO, and it lands on every entry as one common offset. For the fp32 kv-indexed
  table that offset is most of the error, and it is one Gaussian draw per seed whose spread is
  set by ``out·dO rms``: on the H200 (gpu-s7 NOTES) that RMS was the same for flexjit-cute,
  flexjit-triton and torch's kernel within 0.7%, while the raw bias2 error over 8 seeds read
  1.32x torch's for cute and 1.01x for flexjit-triton, and feeding cute's backward from
  Triton's forward read 1.01x (cute's forward into Triton's backward: 1.32x). The offset
  follows the forward's rounding draws. Whether cute's draws are merely unlucky or wider is
  open (over 32 seeds their spread read 1.7x torch's, with the same ``out·dO rms``): until
  that is settled the raw bar stays, and this test fails on cute's bias2 (1.18x over these four
  seeds on the H200, 2026-12-01-gpu-s7 stage 1). Issue #14 stays open on it.
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
        tensor = r["tensor"]
        bar = 1.03 if tensor in ("out", "q", "k", "v", grad_accuracy.ROW_PROJECTION) else 1.15
        if not ours <= 1.1 * eager:
            bad.append(f"{r['case']} {r['tensor']}: {ours:.3g} > 1.1 x eager {eager:.3g}")
        if not ours <= bar * theirs:
            bad.append(f"{r['case']} {r['tensor']}: {ours:.3g} > {bar} x {TORCH} {theirs:.3g}")
    assert not bad, "\n".join(bad)
