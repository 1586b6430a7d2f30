"""Gradient accuracy on the GPU under torch's error-ratio oracle, against torch's own
compiled Flex-Triton on the same inputs (``benchmarks.grad_accuracy``: relative bias, two bf16 /
fp32 tables, a gathered table, a learned ALiBi slope, no mod).

Bars, from the mean |float64 golden - result| over four seeds (``out·dO rms``: an RMS):
* torch's rule: out and every gradient within 1.1x the error of torch's eager math in the same
  dtype;
* no worse than torch's compiled kernel: 1.03x on out, dq, dk, dv and ``out·dO rms`` (millions
  of elements: the ratio moved by less than 0.01 between one seed and four on the H200);
* and on each gradient's error beyond the part the forward's stored output sets
  (``<t> beyond out``): 1.03x for dq and dk, 1.15x for a captured table's (8 to 1024 entries,
  each a sum over every score that reads it).

Why a table is judged beyond the output's part, not raw, against torch's kernel: a flash
backward forms D_i = dO_i · O_i from the bf16 output, so every gradient carries -Σ P_ij δ_i,
δ_i = dO_i · (O_i - golden_i) (``grad_accuracy._from_out`` computes it exactly; CPU test:
test_grad_accuracy_parts). For a table added at kv_idx that part is nearly one common draw per
seed, Σ_i δ_i, and dominates its error. On an H200 its offset equalled
-Σ_i δ_i / 1024 per seed (correlation -1.000, every kernel), and over 256 seeds Σ_i δ_i spread
0.250 / 0.255 / 0.260 (flexjit-cute / flexjit-triton / torch) against 0.245 predicted by
``out·dO rms``; over their first 32 seeds the same draws read 0.298 / 0.165 / 0.174, and the raw
ratio over four seeds read 1.18x, over 16 1.27x, and over 128 1.03x (flexjit-triton 0.99x).
Four draws cannot separate two kernels; the draw's size is judged through ``out·dO rms`` and the
rest of the error directly.
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
        if tensor.endswith(grad_accuracy.BEYOND_OUT):
            bar = 1.03 if tensor.split()[0] in ("q", "k") else 1.15
        else:
            if not ours <= 1.1 * eager:
                bad.append(f"{r['case']} {tensor}: {ours:.3g} > 1.1 x eager {eager:.3g}")
            if tensor not in ("out", "q", "k", "v", grad_accuracy.ROW_PROJECTION):
                continue  # a table: judged beyond the output's part (see above)
            bar = 1.03
        if not ours <= bar * theirs:
            bad.append(f"{r['case']} {tensor}: {ours:.3g} > {bar} x {TORCH} {theirs:.3g}")
    assert not bad, "\n".join(bad)
