"""float32 attention without a cliff: flexjit's Triton kernels on fp32 inputs against
torch Flex-Triton (``torch.compile(flex_attention)``) on the same inputs, under the same
``torch.backends.cuda.matmul`` precision, in one run.

    python -m benchmarks.fp32 --out OUT/fp32 [--sweep]

Shape: the training step of benchmarks/train_step.py (B·S = 8192 tokens, 8 query / 4 KV heads, D = 128),
causal, S = 2k and 8k, forward and forward + backward. Precisions: "highest" (IEEE fp32 dots:
torch's default) and "high" (TF32 tensor cores, ``torch.set_float32_matmul_precision("high")``).
Every row is checked against a float64 reference first: the error of each implementation is
reported, and a row whose error exceeds twice torch's plus a floor is marked wrong. ``--sweep``
also times flexjit under each candidate block config (``FWD_GRID``/``BWD_GRID``, passed as
kernel_options) at the longest S, after every default row, and reports the fastest: the data
behind ``triton_config``'s fp32 tables.

DIR/fp32.json holds every row and DIR/fp32.md the table (printed last).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

# Candidates around torch's H100 fp32 entries (fwd 32x64, 4 warps, 3 stages; bwd 16x16) and the
# compile-only register reports (no local memory at 8 warps, see triton_config's fp32 notes).
FWD_GRID = [(32, 64, 8, 2), (32, 64, 4, 3), (16, 32, 8, 3), (64, 32, 8, 2), (64, 64, 4, 3),
            (128, 64, 8, 3), (64, 128, 8, 3), (128, 128, 8, 2)]
BWD_GRID = [(16, 16, 16, 16, 4, 1), (16, 32, 32, 16, 4, 2), (32, 32, 32, 32, 8, 2),
            (32, 64, 64, 32, 8, 2), (64, 64, 64, 64, 8, 2), (32, 128, 128, 32, 8, 2)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.fp32", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--S", default="2048,8192")
    p.add_argument("--precisions", default="highest,high")
    p.add_argument("--passes", default="fwd,fwdbwd")
    p.add_argument("--sweep", action="store_true", help="also time flexjit's candidate block configs")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--budget-s", type=float, default=420.0)
    return p.parse_args(argv)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def reference(q, k, v, do):
    """float64 causal attention and its gradients (chunk-free: these shapes fit)."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    s = (q64 @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    S = s.shape[-1]
    keep = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    out = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ vv
    grads = torch.autograd.grad(out, (q64, k64, v64), do.double())
    return {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def rel_err(a, b) -> float:
    return float((a.double() - b).norm() / b.norm())


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import flexjit
    from torch.nn.attention import flex_attention as tflex
    from triton.testing import do_bench

    dev = torch.device("cuda")
    torch_flex = torch.compile(tflex.flex_attention)
    rows, t_start = [], time.time()
    cases = {}  # (precision, S) -> (inputs, reference, impls); built on first use

    def case(precision, S):
        if (precision, S) not in cases:
            B, Hq, Hkv, D = 8192 // S, 8, 4, 128
            g = torch.Generator(device=dev).manual_seed(S)
            q = torch.randn(B, Hq, S, D, device=dev, generator=g).requires_grad_(True)
            k, v = (torch.randn(B, Hkv, S, D, device=dev, generator=g).requires_grad_(True) for _ in range(2))
            do = torch.randn_like(q)
            fj_bm = flexjit.create_block_mask(causal, None, None, S, S, device=dev)
            t_bm = tflex.create_block_mask(causal, None, None, S, S, device=dev)
            impls = {"torch-flex-triton": lambda q, k, v, o=None: torch_flex(q, k, v, block_mask=t_bm, enable_gqa=True),
                     "flexjit-triton": lambda q, k, v, o=None: flexjit.flex_attention(
                         q, k, v, block_mask=fj_bm, enable_gqa=True, backend="triton", kernel_options=o)}
            flops = 4 * B * Hq * S * S * D * (S + 1) / (2 * S)  # causal: the kept fraction
            cases[(precision, S)] = (B, (q, k, v, do), reference(q, k, v, do), impls, flops)
        return cases[(precision, S)]

    plan = []  # defaults and torch for every case first, then the sweep (at the longest S)
    precisions, lengths, passes = args.precisions.split(","), [int(x) for x in args.S.split(",")], args.passes.split(",")
    for precision in precisions:
        for S in lengths:
            for pass_ in passes:
                plan += [(precision, S, pass_, "flexjit-triton", None), (precision, S, pass_, "torch-flex-triton", None)]
    if args.sweep:
        for precision in precisions:
            for pass_ in passes:
                keys = (("BLOCK_M", "BLOCK_N", "num_warps", "num_stages") if pass_ == "fwd" else
                        ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "bwd_num_warps", "bwd_num_stages"))
                grid = FWD_GRID if pass_ == "fwd" else BWD_GRID
                plan += [(precision, max(lengths), pass_, "flexjit-triton", dict(zip(keys, c))) for c in grid]
    for precision, S, pass_, name, opts in plan:
        row = dict(precision=precision, S=S, pass_=pass_, impl=name, config=opts)
        if args.budget_s and time.time() - t_start > args.budget_s:
            rows.append(dict(row, status="skipped: time budget"))
            continue
        torch.set_float32_matmul_precision(precision)
        B, (q, k, v, do), ref, impls, flops_fwd = case(precision, S)
        row["B"] = B
        fn = impls[name]
        try:
            out = fn(q, k, v, opts)
            errs = {"out": rel_err(out, ref["out"])}
            if pass_ == "fwdbwd":
                grads = torch.autograd.grad(out, (q, k, v), do)
                errs.update({n: rel_err(t, ref[n]) for n, t in zip(("dq", "dk", "dv"), grads)})
            torch.cuda.synchronize()

            def step():
                o = fn(q, k, v, opts)
                if pass_ == "fwdbwd":
                    torch.autograd.grad(o, (q, k, v), do)
            if pass_ == "fwd":
                with torch.no_grad():
                    ms = do_bench(step, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
            else:
                ms = do_bench(step, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
            flops = flops_fwd * (1 if pass_ == "fwd" else 3.5)
            row.update(status="ok", ms=ms, tflops=flops / ms / 1e9, errors=errs)
        except Exception as e:
            row.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out_dir / "fp32.json").write_text(json.dumps(rows, indent=1))
    _report(rows, out_dir)
    return 0


def _report(rows, out_dir: Path) -> None:
    lines = ["| precision | S | pass | flexjit ms (default) | torch Flex-Triton ms | ratio (torch/ours) | "
             "best sweep config | best ms | errors (ours / torch, out) |", "|---|---|---|---|---|---|---|---|---|"]
    keyf = lambda r: (r["precision"], r["S"], r["pass_"])  # noqa: E731
    for key in sorted({keyf(r) for r in rows}):
        group = [r for r in rows if keyf(r) == key and r.get("status") == "ok"]
        ours = next((r for r in group if r["impl"] == "flexjit-triton" and r["config"] is None), None)
        theirs = next((r for r in group if r["impl"] == "torch-flex-triton"), None)
        swept = [r for r in group if r["impl"] == "flexjit-triton" and r["config"]]
        best = min(swept, key=lambda r: r["ms"]) if swept else None
        fmt = lambda r: f"{r['ms']:.3f}" if r else "—"  # noqa: E731
        ratio = f"{theirs['ms'] / ours['ms']:.2f}" if ours and theirs else "—"
        errs = (f"{ours['errors']['out']:.1e} / {theirs['errors']['out']:.1e}" if ours and theirs else "—")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {fmt(ours)} | {fmt(theirs)} | {ratio} | "
                     f"{best['config'] if best else '—'} | {fmt(best)} | {errs} |")
    text = "\n".join(lines)
    (out_dir / "fp32.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
