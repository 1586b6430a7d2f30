"""Ahead-of-time kernels on the GPU: an entry that ``flexjit compile`` built
in a process that sees no GPU is what a training call on the H200 loads, and it computes the
right answer.

The compile runs with ``CUDA_VISIBLE_DEVICES=""`` and ``CUTE_DSL_ARCH=sm_90a`` (as on a CPU-only
build machine), into a fresh cache folder; then this process trains one step of the same
variant with that cache, ``cute.compile`` patched to raise, and compares out / dq / dk / dv with
the float64 oracle.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper GPU", allow_module_level=True)

from oracle import FLOOR, assert_close_to_oracle, dense_attention  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
S, D, H = 1024, 128, 4


def test_a_cpu_built_entry_trains_on_the_gpu(tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    env = dict(os.environ, FLEXJIT_CACHE_DIR=str(cache_dir), CUDA_VISIBLE_DEVICES="",
               CUTE_DSL_ARCH="sm_90a")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "flexjit", "compile", "--arch", "sm_90a",
                          "--variant", "alibi", "--head-dim", str(D), "--seq-len", str(S),
                          "--heads", str(H), "--out", str(tmp_path / "out")],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    built = sorted(p.name for p in cache_dir.rglob("*.o"))
    # The forward on both schedules the tuner measures (4.5 kv tiles per q tile), the backward's 3
    # and the main kernels of its two longest-first launches (their pre/postprocess shared): the
    # run measures them on its first calls, loading them, compiling nothing.
    assert len(built) == 7, res.stdout

    import cutlass.cute as cute

    import flexjit
    from flexjit.integrations.aot import builtin_variant
    from flexjit.backends.cute import sm90 as cute_sm90

    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(cute_sm90, "_COMPILED", {})
    monkeypatch.setattr(cute_sm90, "_COMPILED_BWD", {})

    def no_compile(*a, **k):
        raise AssertionError("cute.compile called: the CPU-built entry was not used")
    monkeypatch.setattr(cute, "compile", no_compile)

    score_mod, mask_mod = builtin_variant("alibi", S, H)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, H, S, D, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bm = flexjit.create_block_mask(mask_mod, None, None, S, S, device="cuda")
    assert flexjit.explain(q, k, v, score_mod=score_mod, block_mask=bm).name == "cute"
    out = flexjit.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    grads = torch.autograd.grad(out, (q, k, v), do)
    # The oracle runs on the CPU, where the built-in variant's captured tables live (the eager
    # mods index them with the oracle's index tensors, which must share their device).
    leaves = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    refs = {}
    for dtype in (torch.float64, torch.bfloat16):
        ro = dense_attention(*leaves, score_mod, mask_mod, dtype=dtype)[0]
        refs[dtype] = (ro, torch.autograd.grad(ro, leaves, do.cpu().to(dtype)))
    assert_close_to_oracle("out", out.cpu(), refs[torch.float64][0], refs[torch.bfloat16][0],
                           FLOOR[torch.bfloat16])
    for name, got, r64, rlo in zip("qkv", grads, refs[torch.float64][1], refs[torch.bfloat16][1]):
        assert_close_to_oracle(f"d{name}", got.cpu(), r64, rlo, FLOOR[torch.bfloat16])
    assert sorted(p.name for p in cache_dir.rglob("*.o")) == built  # loaded, none added
