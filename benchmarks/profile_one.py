"""Run one flexjit forward (or forward + backward) a few times, for a profiler to look at.

    ncu --clock-control none --section SpeedOfLight -k regex:flex -s 2 -c 1 \
        python3 -m benchmarks.profile_one --backend triton --variant sliding_window --S 8192
    ncu --clock-control none --section SpeedOfLight -k regex:Bwd -s 3 -c 3 \
        python3 -m benchmarks.profile_one --backend cute --variant causal --pass fwdbwd
    python3 -m benchmarks.profile_one --backend cute --variant full --pass fwdbwd --timeline

``--timeline``: after the warm-up calls, time 20 calls with CUDA events (median), then list the
kernels of one more call (torch.profiler), so a call's wall time can be set against the sum of
its kernels: the difference is GPU idle time (host work, allocations, synchronisation).

B·S = 16384 tokens, 16 heads, head dim 128, bf16, the variant from benchmarks/variants.py.
"""
from __future__ import annotations

import argparse

import torch

import flexjit
from .impls import plan_mask
from .variants import Case, build


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_one")
    p.add_argument("--backend", default="auto",
                   help="a flexjit backend, or fa4 / fa4-bhsd (FA4's built-in variant, the baseline "
                        "beside which a profile is read)")
    p.add_argument("--variant", default="causal")
    p.add_argument("--S", type=int, default=8192)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--pass", dest="pass_", choices=("fwd", "fwdbwd"), default="fwd")
    p.add_argument("--timeline", action="store_true",
                   help="one timed call: its wall time against the sum of its kernels")
    a = p.parse_args()
    case = Case(B=16384 // a.S, S=a.S, Hq=16, Hkv=16, D=a.D)
    var = build(a.variant, case, torch.device("cuda"), torch.Generator().manual_seed(0))
    q, k, v = [torch.randn(case.B, 16, a.S, a.D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    bm = plan_mask(flexjit.create_block_mask, var, case, "cuda")
    if a.pass_ == "fwdbwd":
        q, k, v = [t.requires_grad_(True) for t in (q, k, v)]
        dout = torch.randn_like(q)

    attend = _baseline(a.backend, var, case) if a.backend.startswith("fa4") else (
        lambda q, k, v: flexjit.flex_attention(q, k, v, var.score_mod, bm, backend=a.backend))

    def step():
        if a.pass_ == "fwd":
            with torch.no_grad():
                attend(q, k, v)
        else:
            out = attend(q, k, v)
            torch.autograd.grad(out, (q, k, v), dout)

    for _ in range(a.iters):
        step()
    torch.cuda.synchronize()
    if a.timeline:
        timeline(step)
    ran = a.backend if a.backend.startswith("fa4") else \
        flexjit.explain(q, k, v, var.score_mod, bm, backend=a.backend).name
    print(f"ran {a.variant} S={a.S} on {ran}")


def _baseline(name: str, var, case):
    """FA4 as the benchmark's impl of that name runs it: (q, k, v) [B, H, S, D] -> out."""
    from .impls import make

    fn = make(name).setup(var, case, torch.device("cuda"))
    if name == "fa4-bhsd":
        return fn
    return lambda q, k, v: fn(*(t.transpose(1, 2).contiguous() for t in (q, k, v))).transpose(1, 2)


def timeline(step, reps: int = 20) -> None:
    """A call's wall time against the kernels it launched: the wall time is the median of
    ``reps`` calls timed with CUDA events and nothing else running (the profiler's own start-up
    would inflate it); the kernels come from one further call under torch.profiler. The
    difference is GPU idle time inside a call (host work, allocations, synchronisation)."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end) * 1e3)
    wall_us = sorted(walls)[len(walls) // 2]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    print(f"call: {wall_us:.1f} us wall (median of {reps}, min {min(walls):.1f}), "
          f"{busy_us:.1f} us in {len(kernels)} kernels, {wall_us - busy_us:.1f} us not in kernels")
    for e in kernels:
        print(f"  {e.time_range.elapsed_us():10.1f} us  {e.name[:110]}")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
