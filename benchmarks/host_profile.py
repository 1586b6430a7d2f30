"""Where flexjit's host time per call goes: cProfile over many calls at a tiny shape.

    python -m benchmarks.host_profile [--variant full] [--pass fwd|fwdbwd] [--calls 300] [--backend cute]

At B=1, H=1, S=128 the GPU finishes each kernel long before the host queues the next call, so the
profile is the host path alone (validation, tracing cache, dispatch, the kernel launcher, and for
fwdbwd autograd and the backward's workspaces). Prints the top functions by own time and by
cumulative time. `benchmarks.host_overhead` gives the per-call totals beside the baselines.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from .impls import FlexjitImpl
from .profile_one import _sync
from .run import for_pass, make_inputs, make_step
from .variants import Case, build


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_profile")
    p.add_argument("--variant", default="full")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "fwdbwd"), default="fwd")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--backend", default="cute")
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    case = Case(B=1, S=128, Hq=1, Hkv=1, D=a.D)
    var = build(a.variant, case, dev, torch.Generator().manual_seed(0))
    # The benchmark's own adapter, inputs and timed closure (run.py).
    sets = for_pass(make_inputs(case, dev, 1), a.pass_)
    step = make_step(FlexjitImpl(a.backend).setup(var, case, dev), sets, a.pass_)

    for _ in range(10):
        step()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(a.calls):
        step()
    host_us = (time.perf_counter() - t0) / a.calls * 1e6
    _sync(dev)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        step()
    prof.disable()
    _sync(dev)
    print(f"{a.variant} {a.pass_} on {a.backend}: {host_us:.1f} us of host time per call "
          f"(no profiler, {a.calls} calls)")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(a.top)
    stats.sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()
