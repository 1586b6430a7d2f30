"""Does the host's time per call show in the benchmark's timing? do_bench of a forward call
against do_bench of a CUDA graph that replays the same call (no host work at all).

    python -m benchmarks.host_exposure [--S 8192] [--variants full,causal,...]

do_bench enqueues calls back to back, so host time hides behind the GPU unless a call
synchronises or its host time exceeds its GPU time. A gap between the two columns is host time
the GPU waits for. Also runs one call under torch.cuda.set_sync_debug_mode("error") (a
synchronising torch op inside the call fails it). bf16, 16 heads, D=128, 16k tokens; each impl
through benchmarks.run's adapter (default flexjit-cute and fa4, which skips the variants it has
no built-in for).
"""
from __future__ import annotations

import argparse
import functools

import torch
from triton.testing import do_bench

from .impls import Skip, make
from .reference import mask_density
from .run import for_pass, in_layout, make_inputs
from .variants import Case, attention_flops, build


def _bench(fn) -> tuple[float, float]:
    """(eager ms, graph-replay ms); graph None when capture fails."""
    eager = do_bench(fn, warmup=100, rep=400, return_mode="median")
    try:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(g):
            fn()
        graph = do_bench(g.replay, warmup=100, rep=400, return_mode="median")
    except Exception as e:  # report, keep going
        print(f"    graph capture failed: {type(e).__name__}: {str(e)[:200]}")
        graph = None
    return eager, graph


def _sync_check(fn) -> str:
    """One call under set_sync_debug_mode("error"): a synchronising torch op inside it raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "no sync"
    except RuntimeError as e:
        return f"SYNC: {str(e)[:120]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_exposure")
    p.add_argument("--S", type=int, default=8192)
    p.add_argument("--variants", default="full,causal,alibi,sliding_window,document,softcap")
    p.add_argument("--impls", default="flexjit-cute,fa4", help="benchmarks.run impl names")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    case = Case(B=16384 // a.S, S=a.S, Hq=16, Hkv=16, D=128)
    print("variant impl eager_ms graph_ms eager_tflops graph_tflops host_share sync")
    for name in a.variants.split(","):
        var = build(name, case, dev, torch.Generator().manual_seed(0))
        flops = attention_flops(case, mask_density(var, case.B, case.Hq, a.S, dev), "fwd")
        sets = make_inputs(case, dev, 1)
        for impl_name in a.impls.split(","):
            impl = make(impl_name)
            try:
                attend = impl.setup(var, case, dev)
            except Skip as e:
                print(f"{name} {impl_name} skipped: {e}")
                continue
            q, k, v = (for_pass(in_layout(sets, impl.layout), "fwd")[0][n] for n in "qkv")
            fn = functools.partial(attend, q, k, v)
            for _ in range(3):  # compiles, caches
                fn()
            torch.cuda.synchronize()
            synced = _sync_check(fn)
            eager, graph = _bench(fn)
            tf = lambda ms: flops / ms / 1e9 if ms else float("nan")  # noqa: E731
            share = f"{(eager - graph) / eager:.1%}" if graph else "-"
            print(f"{name} {impl_name} {eager:.3f} {graph if graph is None else round(graph, 3)} "
                  f"{tf(eager):.0f} {tf(graph):.0f} {share} {synced}", flush=True)


if __name__ == "__main__":
    main()
