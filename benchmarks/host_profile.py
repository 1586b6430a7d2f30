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

import flexjit
from .impls import plan_mask
from .variants import Case, build


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_profile")
    p.add_argument("--variant", default="full")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "fwdbwd"), default="fwd")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--backend", default="cute")
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    dev = torch.device("cuda")
    case = Case(B=1, S=128, Hq=1, Hkv=1, D=a.D)
    var = build(a.variant, case, dev, torch.Generator().manual_seed(0))
    q, k, v = [torch.randn(1, 1, 128, a.D, device=dev, dtype=torch.bfloat16,
                           requires_grad=a.pass_ == "fwdbwd") for _ in range(3)]
    bm = plan_mask(flexjit.create_block_mask, var, case, "cuda")
    dout = torch.randn(1, 1, 128, a.D, device=dev, dtype=torch.bfloat16)

    def step():
        if a.pass_ == "fwd":
            with torch.no_grad():
                flexjit.flex_attention(q, k, v, var.score_mod, bm, backend=a.backend)
        else:
            out = flexjit.flex_attention(q, k, v, var.score_mod, bm, backend=a.backend)
            torch.autograd.grad(out, (q, k, v), dout)

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.calls):
        step()
    host_us = (time.perf_counter() - t0) / a.calls * 1e6
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        step()
    prof.disable()
    torch.cuda.synchronize()
    print(f"{a.variant} {a.pass_} on {a.backend}: {host_us:.1f} us of host time per call "
          f"(no profiler, {a.calls} calls)")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(a.top)
    stats.sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()
