"""flexjit's host overhead per call, with its kernels already cached.

    python -m benchmarks.host_overhead --out DIR [--device cpu|cuda] [--impls ...] [--variants ...]

At a tiny shape (default B=1, H=1, S=128, D=64, bf16, forward only: one block, so that the
call's fixed costs dominate) each implementation is set up and called --warmup times (compiles,
caches) and until flexjit's tuner has decided what those calls opened, then:
- `host_us`: the median over rounds of (host time to issue --calls calls back to back) / calls.
  On the GPU nothing synchronises inside a round, so this is the time the CPU spends per call
  before the kernel is queued: the overhead a small decode-like call cannot hide. On the CPU the
  call also computes, so it bounds the overhead from above.
- `gpu_us` (GPU only): do_bench's median of the same call, for scale: where host_us > gpu_us,
  the call is host-bound at this size.
- `dispatch_us` (flexjit only): the same for `flexjit.explain(...)`, which validates, traces (from
  the cache) and picks the backend without running anything: flexjit's own share of host_us.
Outputs are checked against the float32 reference (`reference.py`) after the warm-up, so a fast
wrong call is reported as wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from . import impls as impl_mod
from .reference import check
from .run import Refs, call_once, environment, for_pass, in_layout, make_inputs, settle_tuner, tuner_undecided
from .variants import VARIANTS, Case, build, default_scale

CPU_IMPLS = ("flexjit-reference", "torch-flex-eager")
GPU_IMPLS = ("flexjit-cute", "flexjit-triton", "flexjit-reference", "torch-flex-triton", "torch-flex-flash",
             "fa4", "cudnn")


def issue_time_us(fn, args: tuple, calls: int, rounds: int, cuda: bool) -> tuple[float, float]:
    """(median, min) over rounds of host microseconds per call, issuing `calls` calls back to back.

    The minimum is the better estimate of the call's own cost on a shared machine, where other
    work only ever adds time; the median shows what a run typically saw.
    """
    per_call = []
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
        if cuda:
            torch.cuda.synchronize()
    return statistics.median(per_call), min(per_call)


def explain_fn(variant, case: Case, device):
    """flexjit.explain with the same arguments the flexjit adapter passes, or None."""
    try:
        import flexjit
    except Exception:
        return None
    if not hasattr(flexjit, "explain"):
        return None
    bm = impl_mod.plan_mask(flexjit.create_block_mask, variant, case, device)
    return lambda q, k, v, backend: flexjit.explain(q, k, v, score_mod=variant.score_mod, block_mask=bm,
                                                    enable_gqa=case.gqa, backend=backend)


def measure(name: str, variant, case: Case, s: dict, refs: Refs, args) -> dict:
    row = {"impl": name, "variant": variant.name, "B": case.B, "H": case.Hq, "S": case.S, "D": case.D,
           "status": "ok", "host_us": None, "host_min_us": None, "gpu_us": None, "dispatch_us": None,
           "dispatch_min_us": None, "error": None}
    impl = impl_mod.make(name)
    s = for_pass(in_layout([s], impl.layout), "fwd")[0]  # FA4 takes [B, S, H, D]
    try:
        fn = impl.setup(variant, case, args.device)
        open_before = tuner_undecided()
        for _ in range(args.warmup):
            got = call_once(fn, s, "fwd", impl.layout)
        # the tuner's background compiles would load the host being timed
        settle_tuner(tuner_undecided() - open_before, lambda: call_once(fn, s, "fwd", impl.layout))
    except (impl_mod.Skip, NotImplementedError) as e:
        return {**row, "status": "skipped", "error": str(e)}
    except Exception as e:
        return {**row, "status": "error", "error": f"{type(e).__name__}: {e}"}
    verdict = check(got, *refs.pair())
    if not verdict.ok:
        return {**row, "status": "wrong", "error": verdict.message}
    cuda = args.device.type == "cuda"
    qkv = (s["q"], s["k"], s["v"])
    with torch.no_grad():
        row["host_us"], row["host_min_us"] = issue_time_us(fn, qkv, args.calls, args.rounds, cuda)
        if cuda:
            from triton.testing import do_bench

            row["gpu_us"] = 1e3 * do_bench(lambda: fn(*qkv), warmup=10, rep=50, return_mode="median")
        explain = explain_fn(variant, case, args.device) if name.startswith("flexjit-") else None
        if explain is not None:
            backend = name.removeprefix("flexjit-")
            row["dispatch_us"], row["dispatch_min_us"] = issue_time_us(lambda *a: explain(*a, backend), qkv,
                                                                       args.calls, args.rounds, False)
    return row


def _us(x):
    return "–" if x is None else f"{x:.1f}"


def markdown(rows, env) -> str:
    out = [f"# flexjit host overhead per call, {env['gpu']}, {env['date']}", "",
           f"Command: `{env['command']}`", "",
           f"torch {env['torch']}, triton {env['triton']}, git {env['git']}. Forward, cached kernels; "
           "`host`: host time per call issued back to back (median and min over rounds); `gpu`: do_bench "
           "median; `dispatch`: flexjit.explain (validate, trace from cache, pick backend) alone. "
           f"{torch.get_num_threads()} torch CPU threads; load average at the start: {env.get('load')}.", "",
           "| variant | impl | B | H | S | D | host (µs) | host min (µs) | gpu (µs) | dispatch (µs) | dispatch min (µs) | status |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {str(r['error'])[:160]}"
        out.append(f"| {r['variant']} | {r['impl']} | {r['B']} | {r['H']} | {r['S']} | {r['D']} | "
                   f"{_us(r['host_us'])} | {_us(r['host_min_us'])} | {_us(r['gpu_us'])} | {_us(r['dispatch_us'])} | "
                   f"{_us(r['dispatch_min_us'])} | {status} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--impls", default=None, help=f"default: {','.join(CPU_IMPLS)} on CPU, {','.join(GPU_IMPLS)} on GPU")
    p.add_argument("--variants", default="full,causal,alibi,document")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=1)
    p.add_argument("--S", type=int, default=128)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--warmup", type=int, default=5, help="calls before timing (default 5)")
    p.add_argument("--calls", type=int, default=100, help="calls per round (default 100)")
    p.add_argument("--rounds", type=int, default=7, help="rounds; the median is kept (default 7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: a tiny call gains nothing from more, and on a shared "
                        "machine OpenMP's spinning threads turn others' load into large, random delays)")
    args = p.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(args.threads)
    names = (args.impls.split(",") if args.impls else list(GPU_IMPLS if args.device.type == "cuda" else CPU_IMPLS))
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}")
    torch.manual_seed(args.seed)
    impl_mod.raise_dynamo_limits()
    env = environment(argparse.Namespace(device=args.device, seed=args.seed))
    env["command"] = " ".join(["python", "-m", "benchmarks.host_overhead"] + sys.argv[1:])
    env["load"] = "/".join(f"{x:.1f}" for x in os.getloadavg())
    case = Case(args.B, args.S, args.H, args.H, args.D)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for vname in variants:
        variant = build(vname, case, args.device, gen)
        s = for_pass(make_inputs(case, args.device, 1), "fwd")[0]
        refs = Refs(s, variant, default_scale(case), "fwd", case.dtype)
        for name in names:
            r = measure(name, variant, case, s, refs, args)
            rows.append(r)
            print(f"{vname:14} {name:18} host {_us(r['host_us']):>8} µs  gpu {_us(r['gpu_us']):>8} µs  "
                  f"dispatch {_us(r['dispatch_us']):>8} µs  {r['status']} {r['error'] or ''}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": env, "rows": rows}, indent=1))
    text = markdown(rows, env)
    (out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
