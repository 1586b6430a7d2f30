"""Run one flexjit forward (or forward + backward) a few times, for a profiler to look at.

    ncu --clock-control none --section SpeedOfLight -k regex:flex -s 2 -c 1 \
        python3 -m benchmarks.profile_one --backend triton --variant sliding_window --S 8192
    ncu --clock-control none --section SpeedOfLight -k regex:Bwd -s 3 -c 3 \
        python3 -m benchmarks.profile_one --backend cute --variant causal --pass fwdbwd
    ncu --clock-control none --section SpeedOfLight -k regex:FlexAttentionFwd -s 2 -c 1 \
        python3 -m benchmarks.profile_one --backend flexjit-cute-fp8 --variant full
    python3 -m benchmarks.profile_one --backend cute --variant full --pass fwdbwd --timeline

``--timeline``: after the warm-up calls, time 20 calls with CUDA events (median), then list the
kernels of one more call (torch.profiler), so a call's wall time can be set against the sum of
its kernels: the difference is GPU idle time (host work, allocations, synchronisation).

B·S = 16384 tokens (B = 1 beyond), 16 heads, head dim 128, bf16, the variant from
benchmarks/variants.py.
"""
from __future__ import annotations

import argparse

import torch

import flexjit
from .impls import FLEXJIT_FP8_MODES, FlexjitImpl, make, plan_mask
from .run import event_ms, for_pass, in_layout, make_inputs, make_step
from .variants import Case, build


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_one")
    p.add_argument("--backend", default="auto",
                   help="a flexjit backend, fa4 / fa4-bhsd (FA4's built-in variant, the baseline "
                        "beside which a profile is read), a flexjit mode (flexjit-cute-bwd-lpt: "
                        "a pinned schedule, so no tuner launches between the profiled calls), or "
                        "an FP8 impl (flexjit-cute-fp8: e4m3 q, k, v quantised outside the "
                        "profiled calls; forward only)")
    p.add_argument("--variant", default="causal")
    p.add_argument("--S", type=int, default=8192)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--pass", dest="pass_", choices=("fwd", "fwdbwd"), default="fwd")
    p.add_argument("--timeline", action="store_true",
                   help="one timed call: its wall time against the sum of its kernels")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (no --timeline)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    case = Case(B=max(1, 16384 // a.S), S=a.S, Hq=16, Hkv=16, D=a.D)
    var = build(a.variant, case, dev, torch.Generator().manual_seed(0))
    # The benchmark's own adapters, inputs and timed closure (run.py), so a profile is of
    # exactly what benchmarks.run times.
    fp8 = a.backend in FLEXJIT_FP8_MODES
    if fp8 and a.pass_ != "fwd":
        p.error(f"{a.backend} has no backward: --pass fwd")
    named = a.backend.startswith(("fa4", "flexjit-"))
    impl = make(a.backend) if named else FlexjitImpl(a.backend)
    sets = for_pass(in_layout(make_inputs(case, dev, 1), impl.layout), a.pass_)
    if fp8:
        impl.prepare(sets)  # quantised once, as benchmarks.run does outside its timing
    step = make_step(impl.setup(var, case, dev), sets, a.pass_)

    for _ in range(a.iters):
        step()
    _sync(dev)
    if a.timeline:
        timeline(step)
    ran = a.backend
    if isinstance(impl, FlexjitImpl) and not fp8:
        bm = plan_mask(flexjit.create_block_mask, var, case, dev)
        q, k, v = (sets[0][n] for n in "qkv")
        ran = flexjit.explain(q, k, v, var.score_mod, bm, backend=impl.backend,
                              kernel_options=impl.kernel_options or None).name
    print(f"ran {a.variant} S={a.S} on {ran}")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeline(step, reps: int = 20) -> None:
    """A call's wall time against the kernels it launched: the wall time is the median of
    ``reps`` calls timed with CUDA events and nothing else running (the profiler's own start-up
    would inflate it); the kernels come from one further call under torch.profiler. The
    difference is GPU idle time inside a call (host work, allocations, synchronisation)."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    for _ in range(reps):
        walls.append(event_ms(step) * 1e3)
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
