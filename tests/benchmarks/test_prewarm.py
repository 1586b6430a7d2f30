"""``benchmarks.prewarm`` on the CPU: it finds the run's CuTe kernels, compiles each once, and a
second process making the run's own calls then finds every one in the disk cache.

* The flags are ``benchmarks.run``'s (its parser), the calls are the run's grid restricted to
  its CuTe impls, and a variant's captured data (document ids) are the run's for the same seed.
* The keys the probe finds change where the kernels do (a mode's switches, the forward's tiling
  following the mask's density) and stay put where they do not (S, Hkv for a mod that reads no
  head): so jobs deduplicate.
* End to end (slow): the CLI compiles one variant's forward (and its other tuning candidate) and
  backward (D=64, the cheapest sm90 compiles, ~10 s here), then a second process runs ``benchmarks.impls``' flexjit-cute call
  (flex_attention on CPU tensors, the device gate opened) forward and backward with
  ``cute.compile`` patched to raise: 4 disk hits, 0 misses, and each kernel reaches its launch
  (which refuses CPU tensors). A second prewarm compiles nothing.
"""
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from benchmarks import prewarm  # noqa: E402
from benchmarks import run as run_mod  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# Small shapes: the probe builds the run's block masks and empty CPU tensors at these sizes.
SMALL = ["--tokens", "2048", "--hq", "4", "--hkv", "4", "--d", "64"]


def _args(*argv):
    return run_mod.parse_args(["--out", "unused", *argv])


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_prewarm_takes_the_runs_flags():
    run_flags = {s for a in run_mod.make_parser()._actions for s in a.option_strings}
    ours = prewarm.make_parser()
    assert run_flags <= {s for a in ours._actions for s in a.option_strings}
    args = run_mod.parse_args(["--S", "2k,8k", "--d", "192/128", "--jobs", "3"], ours)  # no --out
    assert (args.S, args.d, args.jobs) == ([2048, 8192], [(192, 128)], 3)


def test_specs_are_the_runs_cute_calls_in_its_order():
    args = _args("--S", "1k,2k", "--variants", "causal,document", "--passes", "fwd,fwdbwd",
                 "--impls", "fa4,flexjit-triton,flexjit-cute,flexjit-cute-det", "--seed", "3")
    specs = prewarm.specs(args, args.seed)
    grid = [(p, c, v) for p, c, v in run_mod.grid(args)]
    assert [(s.pass_, s.case, s.variant) for s in specs] == [g for g in grid for _ in range(2)]
    assert {s.impl for s in specs} == {"flexjit-cute", "flexjit-cute-det"}


def test_rebuilt_variants_capture_the_runs_data(tmp_path):
    # The run's Runner builds document ids from its seeded generator in grid order; a spec
    # rebuilds them in another process from the generator state recorded before that build.
    # S of 2k and 4k: several documents per row (lengths 256..4096).
    argv = ["--S", "2k,4k", "--tokens", "8192", "--hq", "1", "--hkv", "1", "--d", "32",
            "--variants", "document,causal", "--passes", "fwd,fwdbwd", "--impls", "flexjit-cute",
            "--seed", "11", "--device", "cpu"]
    args = _args(*argv)
    runner = run_mod.Runner(args, {"date": "", "gpu": ""}, tmp_path)
    for pass_, case, vname in run_mod.grid(args):
        runner.prepare(pass_, case, vname)
    ids = {}
    for spec in prewarm.specs(args, args.seed):
        ours, theirs = prewarm.rebuild(spec), runner.built[(spec.case, spec.variant)][0]
        assert ours.name == theirs.name == spec.variant
        if spec.variant == "document":  # a closure made per build, over the drawn ids
            got = inspect.getclosurevars(ours.mask_mod).nonlocals["doc_ids"]
            want = inspect.getclosurevars(theirs.mask_mod).nonlocals["doc_ids"]
            assert torch.equal(got, want) and prewarm.draws_data(spec)
            ids[spec.case.S] = got
        else:  # the module's own function: the very object the run passes
            assert ours.mask_mod is theirs.mask_mod and not prewarm.draws_data(spec)
    assert set(ids) == {2048, 4096} and ids[4096].max() >= 1  # several documents in a row
    assert not torch.equal(ids[2048].flatten(), ids[4096].flatten())  # two draws, not one replayed


def test_keys_follow_the_kernels(cache_dir):
    import cutlass.cute as cute

    from flexjit.backends.cute import objects as cute_cache

    real = (cute_cache.load, cute.compile)
    args = _args(*SMALL, "--S", "512,1k,4k", "--variants", "full,alibi", "--passes", "fwdbwd",
                 "--impls", "flexjit-cute,flexjit-cute-det,flexjit-cute-pertile", "--seed", "0")
    keys = {(s.case.S, s.variant, s.impl): prewarm.run_keys(s) for s in prewarm.specs(args, 0)}
    assert all(len(k) == 4 for k in keys.values())  # the forward and the backward's 3 parts
    fwd = {n: k[("fwd", "main")] for n, k in keys.items()}
    main = {n: k[("bwd", "main")] for n, k in keys.items()}
    # 512 and 1k: at most 8 kv tiles per q tile, both persistent: one forward; full at 4k visits
    # 32 tiles (one tile per CTA); alibi at 4k is causal, 16.5 on average: also one per CTA.
    assert fwd[(512, "full", "flexjit-cute")] == fwd[(1024, "full", "flexjit-cute")]
    assert fwd[(1024, "full", "flexjit-cute")] != fwd[(4096, "full", "flexjit-cute")]
    # The pertile mode forces one tile per CTA: at 4k that is the default's kernel already.
    assert fwd[(1024, "full", "flexjit-cute-pertile")] == fwd[(4096, "full", "flexjit-cute")]
    # Deterministic mode changes the backward's main kernel, not the forward.
    assert fwd[(1024, "alibi", "flexjit-cute-det")] == fwd[(1024, "alibi", "flexjit-cute")]
    assert main[(1024, "alibi", "flexjit-cute-det")] != main[(1024, "alibi", "flexjit-cute")]
    assert fwd[(1024, "alibi", "flexjit-cute")] != fwd[(4096, "alibi", "flexjit-cute")]
    assert len({main[(S, "alibi", "flexjit-cute")] for S in (512, 1024, 4096)}) == 1
    assert fwd[(1024, "alibi", "flexjit-cute")] != fwd[(1024, "full", "flexjit-cute")]
    # Probing compiled nothing, stored nothing and left the patched functions restored.
    assert not list(cache_dir.rglob("*.o"))
    assert cute_cache.load is real[0] and cute.compile is real[1]


def test_head_dims_the_kernels_lack_need_nothing(cache_dir):
    # D=256 has a forward but no sm90 backward (the run trains it on Triton); D=80 has neither.
    args = _args("--tokens", "1024", "--hq", "2", "--hkv", "2", "--S", "512", "--d", "256,80",
                 "--variants", "causal", "--passes", "fwdbwd", "--seed", "0")
    got = {s.case.D: sorted(prewarm.run_keys(s)) for s in prewarm.specs(args, 0)}
    assert got == {256: [("fwd", "main")], 80: []}


def _cli(argv, cache_dir, timeout=300):
    env = dict(os.environ, FLEXJIT_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "benchmarks.prewarm", *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_requests_are_refused(tmp_path):
    res = _cli(["--jobs", "0"], tmp_path / "cache", timeout=120)
    assert res.returncode != 0 and "--jobs must be at least 1" in res.stderr
    env_off = dict(os.environ, FLEXJIT_CACHE="0", FLEXJIT_CACHE_DIR=str(tmp_path / "cache"))
    env_off["PYTHONPATH"] = os.pathsep.join([str(REPO), env_off.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "benchmarks.prewarm", "--jobs", "1"], env=env_off,
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "disk cache is off" in res.stderr


# The run's own call for each (pass, case) of the grid: the variant from its seeded generator,
# the flexjit-cute adapter's setup and call_once. Only the device gate is opened (CPU tensors),
# and a launch's refusal of CPU tensors ends each pass; cute.compile raises if it is reached.
_CHILD = """
import json, os, sys
import torch
import cutlass.cute as cute
def no_compile(*a, **k):
    raise AssertionError("cute.compile called: a kernel was not in the disk cache")
cute.compile = no_compile
from benchmarks import impls, run
from benchmarks.variants import build
from flexjit.backends.cute import objects as cute_cache, sm90 as cute_sm90
cute_sm90.supports = lambda call: (True, "test: the CPU stands in for the GPU")
launches = []
real_forward = cute_sm90.forward
def forward(call):  # the launch refuses CPU tensors; hand autograd outputs to go on with
    try:
        return real_forward(call)
    except ValueError as e:
        assert "Mismatched Tensor" in str(e), e
        launches.append("fwd")
        q, v = call.q, call.v
        return (torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype),
                torch.zeros(q.shape[:-1]), None)
cute_sm90.forward = forward
args = run.parse_args(ARGV)
gen = torch.Generator().manual_seed(args.seed)
built = {}
for pass_, case, vname in run.grid(args):
    if (case, vname) not in built:
        built[(case, vname)] = build(vname, case, torch.device("cpu"), gen)
    fn = impls.make("flexjit-cute").setup(built[(case, vname)], case, torch.device("cpu"))
    s = run.for_pass(run.make_inputs(case, "cpu", 1), pass_)[0]
    try:
        run.call_once(fn, s, pass_, "bhsd")
    except ValueError as e:
        assert pass_ == "fwdbwd" and "Mismatched Tensor" in str(e), e
        launches.append("bwd")
print(json.dumps({"stats": cute_cache.STATS, "launches": launches,
                  "line": run.cute_disk_cache_line()}))
"""


@pytest.mark.slow
def test_after_a_prewarm_the_runs_calls_all_hit_the_disk_cache(tmp_path):
    cache_dir = tmp_path / "cache"
    # One variant, one head dim, both passes at two lengths that share every kernel.
    argv = [*SMALL, "--S", "512,1k", "--variants", "alibi", "--passes", "fwd,fwdbwd",
            "--impls", "flexjit-cute,fa4", "--seed", "7"]
    res = _cli([*argv, "--jobs", "2"], cache_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-4000:]
    lines = res.stdout.splitlines()
    compiled = [ln for ln in lines if ln.startswith("compiled ")]
    assert sorted(ln.split()[1:3] for ln in compiled) == [["bwd", "main"], ["bwd", "post"],
                                                         ["bwd", "pre"], ["fwd", "main"]], res.stdout
    assert lines[-1].startswith("prewarm: 4 compiled, 0 already cached, 0 failed"), res.stdout
    # The other tuning candidates too, so the run measures instead of compiling: the forward's
    # one tile per CTA (128 rows only: these causal masks' merged tiles are mostly partial) and
    # the backward's longest-first launches (sections of 8 and 2 head pairs).
    # The variant shares the default's pre/postprocess (one key): only its main kernel is new.
    extra = sorted(ln.split(":")[0] for ln in lines if ln.startswith("candidate "))
    assert extra == ["candidate bwd main alibi D=64 bfloat16 (bwd_config=lpt)",
                     "candidate bwd main alibi D=64 bfloat16 (bwd_config=lpt2)",
                     "candidate fwd main alibi D=64 bfloat16 (tile_m=128)"], extra
    assert len(list(cache_dir.rglob("*.o"))) == 7

    env = dict(os.environ, FLEXJIT_CACHE_DIR=str(cache_dir), CUTE_DSL_ARCH="sm_90a")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    child = subprocess.run([sys.executable, "-c", _CHILD.replace("ARGV", repr(["--out", "x", "--device", "cpu", *argv]))],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-4000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    # 4 calls: fwd at 512 and 1k (1 kernel each), fwdbwd at both (forward + 3 backward parts);
    # the process keeps what it loaded, so the second length loads nothing more.
    assert got["stats"] == {"hits": 4, "misses": 0}, got
    assert got["launches"] == ["fwd", "fwd", "fwd", "bwd", "fwd", "bwd"], got
    assert got["line"] == "cute disk cache: 4 hits, 0 misses"

    again = _cli([*argv, "--jobs", "2"], cache_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines()[-1].startswith("prewarm: 0 compiled, 4 already cached"), \
        again.stdout
    assert sum(ln.startswith("cached ") for ln in again.stdout.splitlines()) == 4


def test_the_disk_cache_counts_its_lookups(cache_dir, monkeypatch):
    # benchmarks.run's closing line comes from cute_cache.STATS: a lookup that finds nothing or
    # a file it cannot load is a miss; with the disk cache off nothing is looked up or counted.
    from flexjit.backends.cute import objects as cute_cache

    monkeypatch.setattr(cute_cache, "STATS", {"hits": 0, "misses": 0})
    assert cute_cache.load("0" * 32) is None
    cute_cache.object_path("1" * 32).write_bytes(b"not an object file")
    assert cute_cache.load("1" * 32) is None and not cute_cache.object_path("1" * 32).exists()
    monkeypatch.setenv("FLEXJIT_CACHE", "0")
    assert cute_cache.load("0" * 32) is None
    assert cute_cache.STATS == {"hits": 0, "misses": 2}
    assert run_mod.cute_disk_cache_line() == "cute disk cache: 0 hits, 2 misses"


def test_plan_compiles_each_key_once_and_skips_what_is_on_disk(cache_dir):
    from flexjit.backends.cute import objects as cute_cache

    # causal at 512 and 1k, both passes: one forward key (both persistent) and one backward
    # triple, each needed by several calls; the backward planned first.
    args = _args(*SMALL, "--S", "512,1k", "--variants", "causal", "--passes", "fwd,fwdbwd",
                 "--seed", "0")
    specs = prewarm.specs(args, 0)
    jobs, on_disk, errors = prewarm.plan(specs)
    assert not errors and not on_disk
    assert [(j.pass_, sorted(j.keys), j.users) for j in jobs] == [
        ("bwd", ["main", "post", "pre"], 2), ("fwd", ["main"], 4)]
    # A forward already on disk is reported, not compiled; a backward with one part missing
    # is compiled again (export_backward builds its three parts together).
    fwd, bwd = jobs[1].keys["main"], jobs[0].keys
    for key in (fwd, bwd["pre"], bwd["main"]):
        cute_cache.object_path(key).write_bytes(b"stand-in")
    jobs2, on_disk2, _ = prewarm.plan(specs)
    assert [(j.pass_, j.keys) for j in jobs2] == [("bwd", bwd)]
    assert set(on_disk2) == {fwd, bwd["pre"], bwd["main"]}


def test_plan_gives_each_mode_of_a_case_its_own_kernels(cache_dir):
    # Consecutive modes of one case share its variant and block mask, never the call: each mode's
    # kernel_options shape its kernels (at 1k full the default forward is persistent, the pertile
    # mode's is not; the backward variant's three kernels are its own).
    args = _args(*SMALL, "--S", "1k", "--variants", "full", "--passes", "fwdbwd", "--seed", "0",
                 "--impls", "flexjit-cute,flexjit-cute-pertile,flexjit-cute-bwd-late")
    specs = prewarm.specs(args, 0)
    jobs, on_disk, errors = prewarm.plan(specs)
    assert not errors and not on_disk
    alone = {s.impl: prewarm.run_keys(s) for s in specs}  # each probed with a fresh memo
    planned = {(j.pass_, tuple(sorted(j.keys.values()))) for j in jobs}
    for keys in alone.values():
        for pass_ in ("fwd", "bwd"):
            assert (pass_, tuple(sorted(k for (p, _), k in keys.items() if p == pass_))) in planned
    assert [j.pass_ for j in jobs].count("fwd") == 2 and [j.pass_ for j in jobs].count("bwd") == 2
