"""Does the host's time per call show in the benchmark's timing? do_bench of a forward call
against do_bench of a CUDA graph that replays the same call (no host work at all).

    python -m benchmarks.host_exposure [--S 8192] [--variants full,causal,...]

do_bench enqueues calls back to back, so host time hides behind the GPU unless a call
synchronises or its host time exceeds its GPU time. A gap between the two columns is host time
the GPU waits for. Also runs one call under torch.cuda.set_sync_debug_mode("error") (a
synchronising torch op inside the call fails it). bf16, 16 heads, D=128, 16k tokens; FA4's own
call beside it for full and causal when flash_attn.cute is importable.
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import flexjit
from .impls import plan_mask
from .reference import mask_density
from .variants import Case, build


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


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_exposure")
    p.add_argument("--S", type=int, default=8192)
    p.add_argument("--variants", default="full,causal,alibi,sliding_window,document,softcap")
    a = p.parse_args()
    dev = torch.device("cuda")
    case = Case(B=16384 // a.S, S=a.S, Hq=16, Hkv=16, D=128)
    print("variant impl eager_ms graph_ms eager_tflops graph_tflops host_share")
    for name in a.variants.split(","):
        var = build(name, case, dev, torch.Generator().manual_seed(0))
        q, k, v = [torch.randn(case.B, 16, a.S, 128, device=dev, dtype=torch.bfloat16)
                   for _ in range(3)]
        bm = plan_mask(flexjit.create_block_mask, var, case, "cuda")
        density = mask_density(var, case.B, case.Hq, a.S, dev)
        flops = 4 * case.B * 16 * a.S * a.S * 128 * density

        @torch.no_grad()
        def ours():
            return flexjit.flex_attention(q, k, v, var.score_mod, bm, backend="cute")

        for _ in range(3):
            ours()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ours()
            synced = "no sync"
        except RuntimeError as e:
            synced = f"SYNC: {str(e)[:120]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rows = [("flexjit-cute", ours)]
        if name in ("full", "causal"):
            try:
                from flash_attn.cute import flash_attn_func
                q4, k4, v4 = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
                causal = name == "causal"
                rows.append(("fa4", lambda: flash_attn_func(q4, k4, v4, causal=causal)))
            except Exception as e:
                print(f"    fa4 unavailable: {type(e).__name__}: {e}")
        for impl, fn in rows:
            fn()
            torch.cuda.synchronize()
            eager, graph = _bench(fn)
            tf = lambda ms: flops / ms / 1e9 if ms else float("nan")  # noqa: E731
            share = f"{(eager - graph) / eager:.1%}" if graph else "-"
            print(f"{name} {impl} {eager:.3f} {graph if graph is None else round(graph, 3)} "
                  f"{tf(eager):.0f} {tf(graph):.0f} {share} ({synced if impl == 'flexjit-cute' else ''})",
                  flush=True)


if __name__ == "__main__":
    main()
