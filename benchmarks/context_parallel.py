"""Context parallelism: flexjit.distributed's ring over N ranks against one rank.

    torchrun --nproc_per_node 8 -m benchmarks.context_parallel --out $OUT/cp          # GPUs, NCCL
    torchrun --nproc_per_node 2 -m benchmarks.context_parallel --device cpu --S 1024 \\
        --heads 2 --dim 16 --block 64 --out /tmp/cp                                     # CPU, gloo

For each variant (causal; document: packed documents of random lengths around --doc-mean
tokens, causal inside each) and layout, every rank times its part of one attention over the
whole sequence (``--S`` tokens, sharded): the forward, and the forward + backward, each timed
as the slowest rank's time per iteration (median over ``--iters``, after ``--warmup``). Then
rank 0 alone times the same code path with a world of one (a one-rank group: the same
per-GPU ring code, chunks and merges, no exchange) over the whole sequence, and plain
``flexjit.flex_attention`` on it, while the other ranks wait. Every rank's ring counters
(``flexjit.distributed.last_stats``: steps and pairs computed, bytes sent) are recorded: a
document mask computes and sends less than causal.

Without torchrun (no RANK in the environment) it runs as a world of one.

DIR/results.json: one row per (variant, layout, mode, pass) with ms, TFLOP/s per rank on the
block mask's listed blocks (``block_density``: listed blocks x block area over S^2; the partial
blocks' masked-out elements are counted as work), and the per-rank counters; DIR/results.md the
table (printed last). The default DIR is benchmarks/results/<date>-cp.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.context_parallel", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<date>-cp)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--S", type=int, default=131072, help="total sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--variants", default="causal,document")
    p.add_argument("--layouts", default="zigzag,contiguous")
    p.add_argument("--doc-mean", type=int, default=4096, help="mean document length (document variant)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-single", action="store_true", help="skip rank 0's world-of-one rows")
    p.add_argument("--backend", default="auto")
    return p.parse_args(argv)


def _init(device: str) -> tuple[int, int, torch.device]:
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if device == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend)
    else:  # a world of one without torchrun
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"file://{tempfile.mktemp(prefix='cp-init-')}",
                                rank=0, world_size=1)
        local = 0
    dev = torch.device("cuda", local) if device == "cuda" else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), dev


def _doc_lengths(S: int, mean: int) -> list[int]:
    """Document lengths summing to S, uniform in [mean/4, 7 mean/4] (fixed seed: every rank
    plans the same mask)."""
    g = torch.Generator().manual_seed(0)
    lens, total = [], 0
    while total < S:
        n = int(torch.randint(max(1, mean // 4), max(2, 7 * mean // 4), (1,), generator=g))
        n = min(n, S - total)
        lens.append(n)
        total += n
    return lens


def _mask(variant: str, S: int, args, dev):
    from flexjit import create_block_mask
    from flexjit import mods
    if variant == "causal":
        mod = mods.causal()
    elif variant == "document":
        ids = torch.repeat_interleave(torch.arange(len(lens := _doc_lengths(S, args.doc_mean))),
                                      torch.tensor(lens)).to(dev)
        mod = mods.document(ids)
    else:
        raise SystemExit(f"unknown variant {variant!r} (causal, document)")
    return create_block_mask(mod, None, None, S, S, device=dev, BLOCK_SIZE=args.block)


def _density(bm) -> float:
    return 1.0 - bm.sparsity() / 100.0


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev, iters: int, warmup: int, group=None) -> float:
    """Median over iterations of the slowest rank's seconds (``group``'s ranks)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times.append(float(t.item()))
    return statistics.median(times)


def _inputs(B, H, Hkv, L, D, dtype, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, device=dev).to(dtype).requires_grad_(True)
    k = torch.randn(B, Hkv, L, D, generator=g, device=dev).to(dtype).requires_grad_(True)
    v = torch.randn(B, Hkv, L, D, generator=g, device=dev).to(dtype).requires_grad_(True)
    dout = torch.randn(B, H, L, D, generator=g, device=dev).to(dtype)
    return q, k, v, dout


def _passes(attend, q, k, v, dout):
    def fwd():
        with torch.no_grad():
            attend(q, k, v)

    def fwdbwd():
        out = attend(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)
    return {"fwd": fwd, "fwdbwd": fwdbwd}


def _gather_stats(world: int) -> list[dict]:
    import flexjit.integrations.distributed as cp
    mine = {k: vars(v) for k, v in cp.last_stats().items()}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, dev = _init(args.device)
    import flexjit
    import flexjit.integrations.distributed as cp

    dtype = _DTYPES[args.dtype]
    B, H, D, S = args.batch, args.heads, args.dim, args.S
    Hkv = args.kv_heads or H
    rows = []
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world": world, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "argv": sys.argv[1:]}
    single_group = dist.new_group([0]) if not args.no_single else None  # every rank must call it
    for variant in args.variants.split(","):
        bm = _mask(variant, S, args, dev)
        density = _density(bm)
        flops_fwd = 4.0 * B * H * S * S * D * density
        for layout in args.layouts.split(","):
            q, k, v, dout = _inputs(B, H, Hkv, S // world, D, dtype, dev, seed=1 + rank)

            def attend(q, k, v, layout=layout, bm=bm):
                return cp.flex_attention(q, k, v, None, bm, layout=layout, enable_gqa=H != Hkv,
                                         backend=args.backend)
            for pass_, fn in _passes(attend, q, k, v, dout).items():
                sec = _time(fn, dev, args.iters, args.warmup)
                stats = _gather_stats(world)  # of the last timed iteration
                flops = flops_fwd * (3.5 if pass_ == "fwdbwd" else 1.0)
                rows.append(dict(variant=variant, layout=layout, mode="ring", world=world, pass_=pass_, S=S,
                                 B=B, H=H, Hkv=Hkv, D=D, dtype=args.dtype, block=args.block,
                                 block_density=density, ms=1e3 * sec, tflops_per_rank=flops / world / sec / 1e12,
                                 backend=stats[0]["forward"]["backend"],
                                 steps_computed=[s["forward"]["steps_computed"] for s in stats],
                                 pairs_computed=[s["forward"]["pairs_computed"] for s in stats],
                                 fwd_bytes_sent=[s["forward"]["bytes_sent"] for s in stats],
                                 bwd_bytes_sent=[s["backward"]["bytes_sent"] for s in stats]
                                 if pass_ == "fwdbwd" else None))
                if rank == 0:
                    r = rows[-1]
                    print(f"[cp] {variant} {layout} ring W={world} {pass_}: {r['ms']:.2f} ms, "
                          f"{r['tflops_per_rank']:.1f} TFLOP/s per rank, steps {r['steps_computed']}, "
                          f"fwd bytes sent {r['fwd_bytes_sent']}", flush=True)
            del q, k, v, dout
        if single_group is not None:
            if rank == 0:  # the same per-rank code path with a world of one, and the plain call
                q, k, v, dout = _inputs(B, H, Hkv, S, D, dtype, dev, seed=99)
                modes = {
                    "ring_world1": lambda q, k, v: cp.flex_attention(
                        q, k, v, None, bm, group=single_group, layout="zigzag", enable_gqa=H != Hkv,
                        backend=args.backend),
                    "plain": lambda q, k, v: flexjit.flex_attention(q, k, v, None, bm, enable_gqa=H != Hkv,
                                                                    backend=args.backend),
                }
                if world == 1:  # the ring rows above already are the world of one
                    del modes["ring_world1"]
                for mode, attend in modes.items():
                    for pass_, fn in _passes(attend, q, k, v, dout).items():
                        sec = _time(fn, dev, args.iters, args.warmup, group=single_group)
                        flops = flops_fwd * (3.5 if pass_ == "fwdbwd" else 1.0)
                        rows.append(dict(variant=variant, layout="zigzag" if mode == "ring_world1" else "-",
                                         mode=mode, world=1, pass_=pass_, S=S, B=B, H=H, Hkv=Hkv, D=D,
                                         dtype=args.dtype, block=args.block, block_density=density,
                                         ms=1e3 * sec, tflops_per_rank=flops / sec / 1e12))
                        print(f"[cp] {variant} {mode} W=1 {pass_}: {1e3 * sec:.2f} ms, "
                              f"{flops / sec / 1e12:.1f} TFLOP/s", flush=True)
                del q, k, v, dout
            dist.barrier()
    if rank == 0:
        out = Path(args.out or f"benchmarks/results/{datetime.date.today().isoformat()}-cp")
        out.mkdir(parents=True, exist_ok=True)
        for r in rows:
            r["pass"] = r.pop("pass_")
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "results.md").write_text(_table(rows, meta))
        print(_table(rows, meta))
    dist.destroy_process_group()
    return 0


def _table(rows, meta) -> str:
    lines = [f"# context parallel, {meta['device']}, world {meta['world']}, {meta['date']}", "",
             "| variant | layout | mode | W | pass | ms | TFLOP/s per rank | speedup vs W=1 ring | steps computed | fwd MB sent |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    single = {(r["variant"], r["pass"]): r["ms"] for r in rows
              if r["mode"] == "ring_world1" or (r["mode"] == "ring" and r["world"] == 1 and r["layout"] == "zigzag")}
    for r in rows:
        base = single.get((r["variant"], r["pass"]))
        speed = f"{base / r['ms']:.2f}x" if base and r["mode"] == "ring" and r["world"] > 1 else ""
        sent = r.get("fwd_bytes_sent")
        mb = "/".join(f"{b / 2**20:.1f}" for b in sent) if sent else ""
        steps = "/".join(str(s) for s in r.get("steps_computed") or [])
        lines.append(f"| {r['variant']} | {r['layout']} | {r['mode']} | {r['world']} | {r['pass']} | "
                     f"{r['ms']:.2f} | {r['tflops_per_rank']:.1f} | {speed} | {steps} | {mb} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
