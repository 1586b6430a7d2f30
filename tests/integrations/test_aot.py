"""Ahead-of-time compilation (``flexjit compile``, ``flexjit.aot``), on the CPU.

* The CLI compiles a built-in variant's forward and backward for sm_90a with no GPU, writes each
  kernel's PTX (holding the Hopper instructions: wgmma, TMA) and cubin (an ELF file), prints one
  line per kernel and exports every kernel into the disk cache.
* A second process that builds the same call the way a training script does, at another batch
  size, finds all four kernels there with ``cute.compile`` patched to raise: the AOT keys are the
  run's keys.
* The Python function does the same for a user's mod (a captured tensor, a Python float), and
  builds every forward configuration the run's tuner measures, each marked done.
* sm_100a the same way: the forward and the backward's three kernels (tcgen05 in the two main
  kernels' PTX, no wgmma), all four in the disk cache, all four found by a second process with
  ``cute.compile`` patched to raise (a run still self-checks each on its GPU before use); a
  user's learnable bias through the Python function.
* Bad requests get argparse's error: an unknown variant, a head dim the kernels lack, a bad
  --pass.
"""
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from flexjit.integrations import aot  # noqa: E402
from children import CHILD_NO_COMPILE  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
S, D = 2048, 64


def _cli(args, cache_dir, check=True):
    env = dict(os.environ, FLEXJIT_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "flexjit", *args], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    if check:
        assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-4000:]}"
    return res


# A second process's set-up, as a training script's: the causal variant's call at (S, D) with
# batch B (another than the AOT compile's 1: a runtime value); each test's script goes on from
# ``call`` and prints its json last.
_CHILD_CALL = CHILD_NO_COMPILE + """
    import torch
    import flexjit
    from flexjit.integrations.aot import builtin_variant
    from flexjit.api.attention import prepare_call

    S, D, B, H = SIZES, 16
    score_mod, mask_mod = builtin_variant("causal", S, H)
    q, k, v = (torch.empty(B, H, S, D, dtype=torch.bfloat16) for _ in range(3))
    bm = flexjit.create_block_mask(mask_mod, None, None, S, S, device="cpu")
    call = prepare_call(q, k, v, score_mod, bm, None, False, None)
"""


def _child(script: str, cache_dir, S: int, B: int) -> dict:
    """Run ``script`` (``_CHILD_CALL`` + its own lines) at sequence length ``S``, head dim ``D``
    and batch ``B`` in a fresh process on ``cache_dir``; its last line's json."""
    env = dict(os.environ, FLEXJIT_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    child = subprocess.run([sys.executable, "-c",
                            textwrap.dedent(script.replace("SIZES", f"{S}, {D}, {B}"))],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def _cli_kernels(res, arch: str, cache_dir) -> list[str]:
    """The CLI's four kernel lines for ``arch`` (forward, then the backward's three parts), each
    naming its disk-cache object; returns the four objects' keys."""
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(f"{arch} ")]
    assert [ln.split()[1:3] for ln in lines] == [["fwd", "main"], ["bwd", "pre"], ["bwd", "main"],
                                                 ["bwd", "post"]], res.stdout
    assert res.stdout.strip().endswith(f"4 kernels for {arch} (causal)")
    objects = sorted(p.stem for p in cache_dir.rglob("*.o"))
    assert len(objects) == 4, objects
    for line in lines:
        assert any(f"cache {o}.o" in line for o in objects), line
    return objects


def _assert_loaded_only(messages, arch: str) -> None:
    """The child loaded the forward and the backward from disk and compiled nothing."""
    loaded = [m for m in messages if "loaded from disk" in m]
    assert any(f"{arch} forward" in m for m in loaded), messages
    assert any(f"{arch} backward" in m for m in loaded), messages
    assert not any("compiled" in m and "loaded" not in m for m in messages), messages


_CHILD = _CHILD_CALL + """
    from flexjit.backends.cute import sm90 as backend

    tile_m = backend.forward_tile_m(D, bm)
    sparse = backend.forward_lists(bm, tile_m)
    aux = tuple(backend._aux_tensor(t, q.device) for t in call.program.buffers)
    backend.compile_program(call.program, q, k, v, sparse, aux, tile_m=tile_m,
                            persistent=backend._persistent_fwd(D, sparse, S, owner=bm))
    tiling = backend.tiling_for(call.program, D, D, backend.heuristic_bwd_config(call, False))
    backend.compile_backward(call.program, q.dtype, D, True, False, aux, head_dim_v=D,
                             tiling=tiling)
    print(json.dumps({"messages": messages}))
"""


def test_cli_compiles_a_variant_and_a_training_process_finds_it(tmp_path):
    cache_dir, out = tmp_path / "cache", tmp_path / "out"
    res = _cli(["compile", "--arch", "sm_90a", "--variant", "causal", "--head-dim", str(D),
                "--pass", "fwd,bwd", "--seq-len", str(S), "--out", str(out), "--no-autotune"],
               cache_dir)
    objects = _cli_kernels(res, "sm_90a", cache_dir)
    for folder, ops in (("fwd-main", ("wgmma.mma_async", "cp.async.bulk.tensor")),
                        ("bwd-main", ("wgmma.mma_async", "cp.async.bulk.tensor")),
                        ("bwd-pre", ()), ("bwd-post", ())):
        ptx = (out / f"causal-d{D}" / folder / f"{folder}.sm_90a.ptx").read_text()
        assert ".target sm_90a" in ptx, folder
        for op in ops:
            assert op in ptx, f"{folder}: no {op} in its PTX"
        cubin = (out / f"causal-d{D}" / folder / f"{folder}.sm_90a.cubin").read_bytes()
        assert cubin[:4] == b"\x7fELF", folder

    _assert_loaded_only(_child(_CHILD, cache_dir, S, B=3)["messages"], "sm90")
    assert sorted(p.stem for p in cache_dir.rglob("*.o")) == objects  # nothing new was written


def test_every_candidate_the_tuner_measures_is_compiled_and_marked_done(tmp_path, monkeypatch):
    # Causal at 2048, D=64: both tiles and both schedules are measured, so all four are built,
    # the heuristic's first (fwd-main), each with its done marker: the run tunes on its first call.
    from flexjit.backends.cute import sm90 as cute_sm90
    from flexjit.runtime import compile_pool

    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    built = []

    def compile_program(program, q, k, v, lists, aux, *, options, persistent, keys, tile_m,
                        out_dtype=None):
        built.append((tile_m, persistent, len(lists)))  # 192 rows read five merged lists
        keys["fwd"] = f"key{len(built)}"
    monkeypatch.setattr(cute_sm90, "compile_program", compile_program)
    score_mod, mask_mod = aot.builtin_variant("causal", S, 16)
    kernels = aot.compile_kernels(score_mod, mask_mod, head_dim=D, passes=("fwd",), seq_len=S)
    assert built == [(128, True, 4), (128, False, 4), (192, False, 5), (192, True, 5)]
    assert [k.what for k in kernels] == [f"causal_mask D=64 bfloat16{c}" for c in (
        "", " (tile_m=128)", " (tile_m=192)", " (tile_m=192, persistent)")]
    q = torch.empty(2, 16, S, D, dtype=torch.bfloat16)  # the run's call, another batch
    call = aot.prepare_call(q, q, q, score_mod, aot.create_block_mask(mask_mod, None, None, S, S, device="cpu"),
                            None, False, None)
    tuning = cute_sm90.tuning(call)
    jobs = compile_pool.candidate_jobs(call, tuning.family, tuning.candidates)
    assert [compile_pool.state(j) for j in jobs.values()] == [compile_pool.READY] * 4
    built.clear()
    one = aot.compile_kernels(score_mod, mask_mod, head_dim=D, passes=("fwd",), seq_len=S,
                              kernel_options={"AUTOTUNE": False})
    assert built == [(128, True, 4)] and len(one) == 1


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
                                  out=tmp_path / "out", log=lines.append,
                                  kernel_options={"AUTOTUNE": False})
    (k,) = kernels
    assert (k.arch, k.pass_, k.part) == ("sm_90a", "fwd", "main") and k.cache_key
    assert k.ptx.name == "fwd-main.sm_90a.ptx" and "wgmma.mma_async" in k.ptx.read_text()
    assert (tmp_path / "cache").rglob(f"{k.cache_key}.o")
    assert lines == [k.line()] and "head_bias_causal D=64 bfloat16" in lines[0]


_CHILD_SM100 = _CHILD_CALL + """
    from flexjit.backends.cute import sm100 as cute_sm100, sm100_bwd as cute_sm100_bwd

    fwd = cute_sm100._compile(call)  # the run's own compile (what SEAM.compile calls)
    aux = tuple(cute_sm100._aux_tensor(t, q.device) for t in call.program.buffers)
    bwd = cute_sm100_bwd.compile_backward(call.program, q.dtype, D, True,
                                          torch.are_deterministic_algorithms_enabled(), aux,
                                          head_dim_v=D)  # as cute_sm100_bwd.backward calls it
    loaded = (fwd.compiled is None and fwd.ffi_fn is not None
              and all(p.compiled is None and p.ffi_fn is not None for p in bwd.parts.values())
              and sorted(bwd.parts) == sorted(cute_sm100_bwd.PARTS))
    print(json.dumps({"messages": messages, "loaded": loaded}))
"""


def test_cli_compiles_the_sm100_kernels_and_a_training_process_finds_them(tmp_path):
    # D=64 at 1k: the cheapest sm100 tiles (the whole CLI run takes ~10 s on 2 cores); one
    # masked variant covers the block-list arguments of both passes.
    cache_dir, out = tmp_path / "cache", tmp_path / "out"
    res = _cli(["compile", "--arch", "sm_100a", "--variant", "causal", "--head-dim", str(D),
                "--pass", "fwd,bwd", "--seq-len", "1024", "--out", str(out)], cache_dir)
    objects = _cli_kernels(res, "sm_100a", cache_dir)
    for folder in ("fwd-main", "bwd-pre", "bwd-main", "bwd-post"):
        ptx = (out / f"causal-d{D}" / folder / f"{folder}.sm_100a.ptx").read_text()
        assert ".target sm_100a" in ptx and "wgmma" not in ptx, folder
        if folder.endswith("main"):  # the two attention kernels run on the Blackwell tensor cores
            assert "tcgen05.mma" in ptx and "cp.async.bulk.tensor" in ptx, folder
        cubin = (out / f"causal-d{D}" / folder / f"{folder}.sm_100a.cubin").read_bytes()
        assert cubin[:4] == b"\x7fELF", folder

    result = _child(_CHILD_SM100, cache_dir, 1024, B=2)
    _assert_loaded_only(result["messages"], "sm100")
    assert result["loaded"], "the child's kernels must be the loaded TVM-FFI functions"
    assert sorted(p.stem for p in cache_dir.rglob("*.o")) == objects  # nothing new was written


def test_python_api_compiles_a_learnable_bias_for_sm100(tmp_path, monkeypatch):
    # A captured tensor that requires grad: its gradient slots are part of the backward's key.
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    bias = torch.randn(16, requires_grad=True)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    lines = []
    kernels = aot.compile_kernels(head_bias, None, arch="sm_100a", head_dim=D, seq_len=512,
                                  out=tmp_path / "out", log=lines.append)
    assert [(k.arch, k.pass_, k.part) for k in kernels] == [
        ("sm_100a", "fwd", "main"), ("sm_100a", "bwd", "pre"), ("sm_100a", "bwd", "main"),
        ("sm_100a", "bwd", "post")]
    assert lines == [k.line() for k in kernels]
    keys = [k.cache_key for k in kernels]
    assert all(keys) and len(set(keys)) == 4
    assert sorted(p.stem for p in (tmp_path / "cache").rglob("*.o")) == sorted(keys)
    main = kernels[2].ptx.read_text()
    assert kernels[2].ptx.name == "bwd-main.sm_100a.ptx" and "tcgen05.mma" in main
    assert re.search(r"(red|atom)(\.\w+)*\.global(\.\w+)*\.add\.f64", main), \
        "the bias gradient is not accumulated in fp64"


@pytest.mark.parametrize("args,message", [
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


def test_sm100_backward_recompiles_only_a_missing_part(tmp_path, monkeypatch):
    # The three parts are separate cache entries: with one object file gone, a run loads two
    # and compiles (and exports again) only the third. ALiBi: a cheap compile (~10 s for both
    # passes) that still captures a tensor (the slopes).
    from flexjit.backends.cute import sm100_bwd as cute_sm100_bwd

    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # without out=, nothing may land in the working directory
    kernels = aot.compile_variant("alibi", arch="sm_100a", head_dim=D, seq_len=256)
    assert not list(work.iterdir()) and all(k.ptx is None and k.cubin is None for k in kernels)
    keys = {k.part: k.cache_key for k in kernels if k.pass_ == "bwd"}
    cute_dir = tmp_path / "cache" / "cute"
    (cute_dir / f"{keys['post']}.o").unlink()
    monkeypatch.setattr(cute_sm100_bwd, "_COMPILED", {})
    _, _, _, bm, call, aux = aot._example(*aot.builtin_variant("alibi", 256, 16), D, D,
                                          torch.bfloat16, 256, 16, 16)
    fn = cute_sm100_bwd.compile_backward(call.program, torch.bfloat16, D, bm is not None, False, aux)
    assert {p: part.compiled is None for p, part in fn.parts.items()} == \
        {"pre": True, "main": True, "post": False}
    assert all(part.ffi_fn is not None for p, part in fn.parts.items() if p != "post")
    assert sorted(p.stem for p in cute_dir.glob("*.o")) == sorted(k.cache_key for k in kernels)


def test_every_builtin_variant_traces_with_its_captured_tensors():
    # Tracing only (no compile): each variant's mods build the Program a run would; T5's table
    # is (heads, buckets) and ALiBi's slopes one per head.
    for name in aot.VARIANTS:
        _, _, _, _, call, _ = aot._example(*aot.builtin_variant(name, 256, 4), D, D,
                                           torch.bfloat16, 256, 4, 4)
        shapes = [tuple(t.shape) for t in call.program.buffers]
        if name == "t5_bias":
            assert shapes == [(4, 32)], shapes
        elif name == "alibi":
            assert shapes == [(4,)], shapes


def test_fp8_forward_is_compiled_and_found_by_the_run(tmp_path, monkeypatch):
    """dtype float8_e4m3fn: the sm90 FP8 forward only (e4m3 wgmma in its PTX), exported; the
    run's own compile of an FP8 call (Vᵀ as forward() builds it, another batch and length)
    loads it from disk with cute.compile patched to raise. A backward is refused."""
    import cutlass.cute as cute
    from flexjit.backends.cute import sm90 as cute_sm90

    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    score_mod, mask_mod = aot.builtin_variant("alibi", 1024, 16)
    (k,) = aot.compile_kernels(score_mod, mask_mod, head_dim=D, dtype=torch.float8_e4m3fn,
                               seq_len=1024, out=tmp_path / "out")
    assert k.pass_ == "fwd" and "e4m3" in k.ptx.read_text() and k.cache_key
    with pytest.raises(ValueError, match="no backward"):
        aot.compile_kernels(score_mod, mask_mod, head_dim=D, dtype=torch.float8_e4m3fn,
                            passes=("fwd", "bwd"))

    cute_sm90._COMPILED.clear()
    monkeypatch.setattr(cute, "compile", lambda *a, **kw: pytest.fail("compiled, not loaded"))
    e4m3 = torch.float8_e4m3fn
    q = torch.zeros(3, 16, 700, D).to(e4m3)
    kv = torch.zeros(3, 16, 700, D).to(e4m3)
    bm = aot.create_block_mask(mask_mod, None, None, 700, 700, device="cpu")
    call = aot.prepare_call(q, kv, kv, score_mod, bm, None, False, None)
    aux = tuple(cute_sm90._aux_tensor(t, q.device) for t in call.program.buffers)
    keys: dict = {}
    cute_sm90.compile_program(call.program, q, kv, cute_sm90.fp8_value_transposed(kv),
                              cute_sm90.forward_lists(bm, 128), aux, persistent=False, keys=keys,
                              out_dtype=call.out_dtype)
    assert keys["fwd"] == k.cache_key
