"""Throughput under sustained load, with the GPU's clock and power beside it, and each call's
kernels: whether a ratio between two implementations comes from their kernels' cycles or from
the clock the GPU holds while running them.

    python3 -m benchmarks.sustained --impls flexjit-cute,fa4 --variants full,causal --S 8k

For every (variant, pass) the implementations take turns (``--rounds`` rounds, each running one
implementation back to back for ``--seconds``), so that drift in temperature and clocks reaches
each alike. For each turn: TFLOP/s from CUDA events around the whole loop, and the mean SM clock
and power drawn over it (``nvidia-smi`` sampled every 50 ms). Then one call of each under
torch.profiler: every kernel it launched and its GPU time, so that time outside the attention
kernel (pre/postprocessing, copies, memsets) shows. The last table: per implementation, the
median TFLOP/s, MHz and W over its turns, and TFLOP/s per GHz (throughput per clock cycle).

Inputs, adapters and FLOPs are ``benchmarks.run``'s (one input set per call, rotated as there).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

from . import impls as impl_mod
from .reference import mask_density
from .run import for_pass, in_layout, make_inputs, make_step, parse_head_dims, parse_list, parse_sizes, rotation_count
from .variants import VARIANTS, Case, attention_flops, build


class Sampler:
    """``nvidia-smi`` polling SM clock (MHz) and power (W) in a background process."""

    def __init__(self, period_ms: int = 50):
        self.period_ms = period_ms
        self.samples: list[tuple[float, float, float]] = []  # (time, MHz, W)
        self._proc = None
        self._thread = None

    def __enter__(self):
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 f"-lms={self.period_ms}"], stdout=subprocess.PIPE, text=True)
        except OSError:
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), mhz, watts))

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()

    def mean_between(self, t0: float, t1: float) -> tuple[float | None, float | None]:
        window = [(m, w) for t, m, w in self.samples if t0 <= t <= t1]
        if not window:
            return None, None
        return statistics.fmean(m for m, _ in window), statistics.fmean(w for _, w in window)


def kernels_of(step) -> list[tuple[str, float]]:
    """(name, µs) of every kernel one call of ``step`` launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type.name == "CUDA"]


def turn(step, seconds: float) -> tuple[float, int, float, float]:
    """Run ``step`` back to back for about ``seconds``: (ms per call, calls, t0, t1)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    n = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            step()
        n += 4
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n, n, t0, time.perf_counter()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sustained")
    p.add_argument("--impls", default="flexjit-cute,fa4")
    p.add_argument("--variants", default="full,causal")
    p.add_argument("--S", default="8k")
    p.add_argument("--d", default="128")
    p.add_argument("--hq", type=int, default=16)
    p.add_argument("--hkv", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--passes", default="fwd,fwdbwd")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="folder for results.json")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    impl_mod.raise_dynamo_limits()
    names = parse_list(a.impls, impl_mod.DEFAULT_IMPLS + impl_mod.EXTRA_IMPLS)
    rows = []
    with Sampler() as smi:
        for S in parse_sizes(a.S):
            for D, Dv in parse_head_dims(a.d):
                case = Case(B=max(1, a.tokens // S), S=S, Hq=a.hq, Hkv=a.hkv, D=D,
                            Dv=None if Dv == D else Dv)
                l2 = torch.cuda.get_device_properties(dev).L2_cache_size
                base = make_inputs(case, dev, rotation_count(case, dev, l2))
                for vname in parse_list(a.variants, VARIANTS):
                    var = build(vname, case, dev, torch.Generator().manual_seed(0))
                    density = mask_density(var, case.B, case.Hq, case.S, dev)
                    for pass_ in parse_list(a.passes, ("fwd", "fwdbwd")):
                        flops = attention_flops(case, density, pass_)
                        steps = {}
                        for name in names:
                            impl = impl_mod.make(name)
                            try:
                                fn = impl.setup(var, case, dev)
                            except impl_mod.Skip as e:
                                print(f"{name} {vname}: skipped: {e}")
                                continue
                            step = make_step(fn, for_pass(in_layout(base, impl.layout), pass_), pass_)
                            for _ in range(3):
                                step()
                            steps[name] = step
                        for name, step in steps.items():
                            ks = kernels_of(step)
                            total = sum(us for _, us in ks)
                            print(f"{vname} S={S} D={D} {pass_} {name}: {len(ks)} kernels, {total:.1f} us")
                            for kname, us in ks:
                                print(f"    {us:9.1f} us  {kname[:100]}")
                            rows.append(dict(kind="kernels", impl=name, variant=vname, S=S, D=D,
                                             pass_=pass_, kernels=ks))
                        for r in range(a.rounds):
                            for name, step in steps.items():
                                ms, n, t0, t1 = turn(step, a.seconds)
                                mhz, watts = smi.mean_between(t0, t1)
                                rows.append(dict(kind="turn", impl=name, variant=vname, S=S, D=D,
                                                 pass_=pass_, round=r, ms=ms, calls=n,
                                                 tflops=flops / ms / 1e9, mhz=mhz, watts=watts))
                                print(f"  round {r} {name:14s} {flops / ms / 1e9:7.1f} TFLOP/s "
                                      f"{ms:8.3f} ms  {mhz or 0:6.0f} MHz {watts or 0:6.0f} W")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "results.json").write_text(json.dumps(rows, indent=1))
    print("\nvariant S D pass impl: TFLOP/s, MHz, W, TFLOP/s per GHz (medians over rounds)")
    keys = sorted({(r["variant"], r["S"], r["D"], r["pass_"], r["impl"]) for r in rows if r["kind"] == "turn"})
    for key in keys:
        turns = [r for r in rows if r["kind"] == "turn" and (r["variant"], r["S"], r["D"], r["pass_"], r["impl"]) == key]
        tf = statistics.median(r["tflops"] for r in turns)
        mhz = statistics.median(r["mhz"] or 0 for r in turns)
        w = statistics.median(r["watts"] or 0 for r in turns)
        per_ghz = tf / (mhz / 1000) if mhz else float("nan")
        print(f"{' '.join(map(str, key))}: {tf:.1f}, {mhz:.0f}, {w:.0f}, {per_ghz:.1f}")


if __name__ == "__main__":
    main()
