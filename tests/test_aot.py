"""Ahead-of-time compilation (``flexjit compile``, ``flexjit.aot``; issue #15 part 4), on the CPU.

* The CLI compiles a built-in variant's forward and backward for sm_90a with no GPU, writes each
  kernel's PTX (holding the Hopper instructions: wgmma, TMA) and cubin (an ELF file), prints one
  line per kernel and exports every kernel into the disk cache.
* A second process that builds the same call the way a training script does, at another batch
  size, finds all four kernels there with ``cute.compile`` patched to raise: the AOT keys are the
  run's keys.
* The Python function does the same for a user's mod (a captured tensor, a Python float).
* sm_100a: the forward compiles (tcgen05, no wgmma in its PTX) and is NOT put in the disk cache
  (never run on Blackwell; no run may use it before a self-check exists).
* Bad requests get argparse's error: the sm_100a backward (not built), an unknown variant, a
  head dim the kernels lack, a bad --pass.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from flexjit import aot  # noqa: E402
from test_cute_cache import CHILD_NO_COMPILE  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
S, D = 2048, 64


def _cli(args, cache_dir, check=True):
    env = dict(os.environ, FLEXJIT_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "flexjit", *args], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    if check:
        assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-4000:]}"
    return res


_CHILD = CHILD_NO_COMPILE + """
    import torch
    import flexjit
    from flexjit.aot import builtin_variant
    from flexjit.api import prepare_call
    from flexjit.backends import cute_sm90 as backend

    S, D, B, H = SIZES, 3, 16  # another batch than the AOT compile's 1: a runtime value
    score_mod, mask_mod = builtin_variant("causal", S, H)
    q, k, v = (torch.empty(B, H, S, D, dtype=torch.bfloat16) for _ in range(3))
    bm = flexjit.create_block_mask(mask_mod, None, None, S, S, device="cpu")
    call = prepare_call(q, k, v, score_mod, bm, None, False, None)
    sparse = backend.block_sparse_args(bm)
    aux = tuple(backend._aux_tensor(t, q.device) for t in call.program.buffers)
    backend.compile_program(call.program, q, k, v, sparse, aux,
                            persistent=backend._persistent_fwd(D, sparse, S, owner=bm))
    backend.compile_backward(call.program, q.dtype, D, True, False, aux, head_dim_v=D)
    print(json.dumps({"messages": messages}))
"""


def test_cli_compiles_a_variant_and_a_training_process_finds_it(tmp_path):
    cache_dir, out = tmp_path / "cache", tmp_path / "out"
    res = _cli(["compile", "--arch", "sm_90a", "--variant", "causal", "--head-dim", str(D),
                "--pass", "fwd,bwd", "--seq-len", str(S), "--out", str(out)], cache_dir)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("sm_90a ")]
    assert [ln.split()[1:3] for ln in lines] == [["fwd", "main"], ["bwd", "pre"], ["bwd", "main"],
                                                 ["bwd", "post"]], res.stdout
    assert res.stdout.strip().endswith("4 kernels for sm_90a (causal)")
    for folder, ops in (("fwd-main", ("wgmma.mma_async", "cp.async.bulk.tensor")),
                        ("bwd-main", ("wgmma.mma_async", "cp.async.bulk.tensor")),
                        ("bwd-pre", ()), ("bwd-post", ())):
        ptx = (out / f"causal-d{D}" / folder / f"{folder}.sm_90a.ptx").read_text()
        assert ".target sm_90a" in ptx, folder
        for op in ops:
            assert op in ptx, f"{folder}: no {op} in its PTX"
        cubin = (out / f"causal-d{D}" / folder / f"{folder}.sm_90a.cubin").read_bytes()
        assert cubin[:4] == b"\x7fELF", folder
    objects = sorted(p.stem for p in cache_dir.rglob("*.o"))
    assert len(objects) == 4, objects
    for line in lines:
        assert any(f"cache {o}.o" in line for o in objects), line

    env = dict(os.environ, FLEXJIT_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD.replace("SIZES", f"{S}, {D}"))],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    messages = json.loads(child.stdout.strip().splitlines()[-1])["messages"]
    loaded = [m for m in messages if "loaded from disk" in m]
    assert any("sm90 forward" in m for m in loaded) and any("sm90 backward" in m for m in loaded), \
        messages
    assert not any("compiled" in m and "loaded" not in m for m in messages), messages
    assert sorted(p.stem for p in cache_dir.rglob("*.o")) == objects  # nothing new was written


def test_python_api_compiles_a_user_mod(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    bias = torch.randn(16)
    scale = 0.5

    def head_bias(score, b, h, q_idx, kv_idx):
        return score * scale + bias[h]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    lines = []
    kernels = aot.compile_kernels(head_bias, causal, head_dim=D, passes=("fwd",), seq_len=1024,
                                  out=tmp_path / "out", log=lines.append)
    (k,) = kernels
    assert (k.arch, k.pass_, k.part) == ("sm_90a", "fwd", "main") and k.cache_key
    assert k.ptx.name == "fwd-main.sm_90a.ptx" and "wgmma.mma_async" in k.ptx.read_text()
    assert (tmp_path / "cache").rglob(f"{k.cache_key}.o")
    assert lines == [k.line()] and "head_bias_causal D=64 bfloat16" in lines[0]


def test_cli_compiles_the_sm100_forward_and_caches_nothing(tmp_path):
    cache_dir, out = tmp_path / "cache", tmp_path / "out"
    res = _cli(["compile", "--arch", "sm_100a", "--variant", "document", "--pass", "fwd",
                "--seq-len", "1024", "--out", str(out)], cache_dir)
    assert "never cached before a Blackwell self-check" in res.stdout, res.stdout
    ptx = (out / "document-d128" / "fwd-main" / "fwd-main.sm_100a.ptx").read_text()
    assert ".target sm_100a" in ptx and "tcgen05.mma" in ptx and "cp.async.bulk.tensor" in ptx
    assert "wgmma" not in ptx
    assert not list(cache_dir.rglob("*.o"))


@pytest.mark.parametrize("args,message", [
    (["--arch", "sm_100a", "--variant", "causal"], "no sm_100a backward is built yet"),
    (["--arch", "sm_100a", "--variant", "causal", "--pass", "fwd", "--head-dim", "96"],
     "the sm100 forward takes"),
    (["--arch", "sm_90a", "--variant", "nope"], "invalid choice: 'nope'"),
    (["--arch", "sm_90a", "--variant", "causal", "--head-dim", "80"], "head dims (80, 80)"),
    (["--arch", "sm_90a", "--variant", "causal", "--pass", "fwd,back"], "give fwd, bwd or fwd,bwd"),
    (["--arch", "sm_90a", "--variant", "alibi", "--head-dim", "256"], "the sm90 backward takes"),
])
def test_cli_refuses_with_argparse_errors(tmp_path, args, message):
    res = _cli(["compile", *args, "--out", str(tmp_path / "out")], tmp_path / "cache", check=False)
    assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
