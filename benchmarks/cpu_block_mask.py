"""create_block_mask on the CPU: time and peak memory, flexjit against torch.

    python -m benchmarks.cpu_block_mask --out DIR [--S 8k,32k,64k] [--masks ...] [--impls ...]

Impls: `flexjit` (flexjit.create_block_mask), `torch` (torch's create_block_mask, eager, its
default), `torch-compile` (torch's with `_compile=True`, which torch's docs recommend for long
sequences). Masks: causal, sliding_window (1024) and document (random lengths 256..4096), the
same mods as the GPU benchmark (`variants.py`), B=1, H=None (broadcast), BLOCK_SIZE=128.

Each (impl, mask, S) runs in its own subprocess, so that one case's memory does not pollute
another's peak: the child reads VmRSS after its imports and inputs, builds the mask once (the
first call, compile included), repeats it while that stays cheap (the median of the repeats is
the steady-state time), then reads VmHWM, the peak resident set. The child runs under an
address-space limit (--mem-gb) and a timeout (--timeout-s): torch materialises the S×S mask and
its integer intermediates, which at 64k is tens of GB, so running out is a result, recorded as
`oom` or `timeout`, not a crash.

For flexjit, at S <= --verify-max-S the child then builds torch's mask too and compares the
block classification (skipped / partial / full) block by block: a fast planner that lists the
wrong blocks would be worthless. flexjit may mark a full block partial (correct, slower); any
other difference is a failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPLS = ("flexjit", "torch", "torch-compile")
MASKS = ("causal", "sliding_window", "document")
DEFAULT_S = (8192, 32768, 65536)


def _status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def block_kinds(bm):
    """(B, H, nQ, nKV) int8 from the fields torch's and flexjit's BlockMask share: 0/1/2."""
    import torch

    def dense(num, idx):
        n = idx.shape[-1]
        valid = torch.arange(n) < num.unsqueeze(-1)
        out = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.int8)
        out.scatter_(-1, torch.where(valid, idx.long(), n), 1)
        return out[..., :n]

    kinds = dense(bm.kv_num_blocks.cpu(), bm.kv_indices.cpu())
    if bm.full_kv_num_blocks is not None:
        kinds = kinds + 2 * dense(bm.full_kv_num_blocks.cpu(), bm.full_kv_indices.cpu())
    return kinds


def compare_blocks(mine, theirs) -> dict:
    """flexjit's classification against torch's; conservative = full marked partial."""
    a, b = block_kinds(mine), block_kinds(theirs)
    if a.shape != b.shape:
        return {"ok": False, "detail": f"shapes {tuple(a.shape)} vs torch {tuple(b.shape)}"}
    differ = a != b
    conservative = int(((a == 1) & (b == 2)).sum())
    wrong = int(differ.sum()) - conservative
    return {"ok": wrong == 0, "blocks": int(a.numel()), "wrong": wrong, "conservative": conservative,
            "detail": "identical" if not differ.any() else f"{wrong} wrong, {conservative} full marked partial"}


def child(impl: str, mask: str, S: int, reps: int, rep_budget_s: float, timeout_s: float,
          verify_max_S: int, threads: int) -> dict:
    """Runs in the subprocess: build, repeat, read the peak; returns the row."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    from .variants import WINDOW, causal_mask, make_document, make_sliding_window, random_doc_ids

    torch.set_grad_enabled(False)
    torch.set_num_threads(threads)
    if mask == "causal":
        mod = causal_mask
    elif mask == "sliding_window":
        mod = make_sliding_window(WINDOW)
    else:
        mod = make_document(random_doc_ids(1, S, torch.Generator().manual_seed(0)))
    B = 1 if mask == "document" else None
    if impl == "flexjit":
        import flexjit

        def build():
            return flexjit.create_block_mask(mod, B, None, S, S, device="cpu")
    else:
        def build():
            return torch_create_block_mask(mod, B, None, S, S, device="cpu", _compile=impl == "torch-compile")

    rss0 = _status_kb("VmRSS")
    t0 = time.perf_counter()
    bm = build()
    first = time.perf_counter() - t0
    # Repeat once if that surely fits the timeout (a repeat costs at most the first call), then
    # while the last repeat fits the budget: a compiled first call says little about a repeat.
    times, t_end = [], time.perf_counter() + rep_budget_s
    while len(times) < reps and (time.perf_counter() + times[-1] < t_end if times else first < timeout_s / 3):
        del bm
        t0 = time.perf_counter()
        bm = build()
        times.append(time.perf_counter() - t0)
    peak = _status_kb("VmHWM")
    row = {"status": "ok", "first_s": first, "median_s": statistics.median(times) if times else None,
           "min_s": min(times) if times else None, "reps": len(times), "baseline_mb": rss0 / 1024,
           "peak_mb": peak / 1024, "delta_mb": (peak - rss0) / 1024, "sparsity_pct": float(bm.sparsity())}
    if impl == "flexjit" and S <= verify_max_S:
        row["vs_torch"] = compare_blocks(bm, torch_create_block_mask(mod, B, None, S, S, device="cpu"))
    return row


def run_case(impl, mask, S, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.cpu_block_mask", "--one", impl, mask, str(S),
           "--reps", str(args.reps), "--rep-budget-s", str(args.rep_budget_s),
           "--timeout-s", str(args.timeout_s), "--verify-max-S", str(args.verify_max_S),
           "--threads", str(args.threads)]
    limit = int(args.mem_gb * (1 << 30))

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    base = {"impl": impl, "mask": mask, "S": S}
    t0 = time.perf_counter()
    # A session of its own, so that a timeout also ends the compile workers torch-compile starts.
    # A fresh inductor cache per case: torch-compile's first call is a cold compile every time,
    # not one that depends on which cases ran before.
    cache = tempfile.TemporaryDirectory(prefix="cbm-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache.name}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=cap_memory,
                         start_new_session=True, cwd=Path(__file__).resolve().parent.parent, env=env)
    try:
        stdout, stderr = p.communicate(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return {**base, "status": "timeout", "error": f"no result within {args.timeout_s:.0f} s"}
    finally:
        cache.cleanup()
    wall = time.perf_counter() - t0
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if p.returncode == 0 and lines:
        return {**base, **json.loads(lines[-1]), "wall_s": wall}
    tail = (stderr or stdout).strip().splitlines()[-3:]
    text = " | ".join(tail)
    oom = p.returncode < 0 or any(s in text for s in ("MemoryError", "can't allocate memory", "std::bad_alloc",
                                                        "out of memory", "Cannot allocate memory"))
    return {**base, "status": "oom" if oom else "error", "error": f"rc {p.returncode}: {text[-400:]}", "wall_s": wall}


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem = next((int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), 0)
    import torch

    return (f"{cpu}, {os.cpu_count()} cores, {mem / 2**20:.0f} GiB RAM, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}")


def _fmt(x, unit=""):
    return "–" if x is None else f"{x:.3g}{unit}"


def _load(avg) -> str:
    return "?" if avg is None else "/".join(f"{x:.1f}" for x in avg)


def markdown(rows, meta) -> str:
    out = [f"# create_block_mask on the CPU, {meta['date']}", "",
           f"Command: `{meta['command']}`", "", f"Machine: {meta['machine']}; load average (1, 5, 15 min) {_load(meta.get('load_start'))} at the start, "
           f"{_load(meta.get('load_end'))} at the end", "",
           f"flexjit git {meta['git']}; {meta['threads']} torch thread(s) per case; limits per case: {meta['mem_gb']} GiB address space, "
           f"{meta['timeout_s']:.0f} s. `first`: first call (torch-compile: a cold compile included, fresh inductor cache per case); `warm`: median of "
           "the repeats (`warm min`: the fastest; the machine may be shared, so the spread is noise); `peak`: VmHWM of the case's own process; `+peak`: over its resident set just before "
           "the first call (after imports and inputs).", "",
           "| mask | S | impl | status | first (s) | warm (s) | warm min (s) | peak (MB) | +peak (MB) | blocks vs torch |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = r.get("vs_torch", {}).get("detail", "")
        out.append(f"| {r['mask']} | {r['S'] // 1024}k | {r['impl']} | {r['status']} | {_fmt(r.get('first_s'))} | "
                   f"{_fmt(r.get('median_s'))} | {_fmt(r.get('min_s'))} | {_fmt(r.get('peak_mb'))} | {_fmt(r.get('delta_mb'))} | {vs} |")
    errs = [r for r in rows if r["status"] != "ok"]
    if errs:
        out += ["", "Cases without a result:"] + [f"- {r['impl']} {r['mask']} {r['S']}: {r['status']}: {r.get('error')}"
                                                  for r in errs]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_block_mask", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="folder for results.json and results.md")
    p.add_argument("--S", default=",".join(str(s) for s in DEFAULT_S), help="e.g. 8k,32k,64k")
    p.add_argument("--masks", default=",".join(MASKS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--reps", type=int, default=5, help="repeats after the first call (default 5)")
    p.add_argument("--rep-budget-s", type=float, default=20.0, help="stop repeating after this long")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per case (default 300)")
    p.add_argument("--mem-gb", type=float, default=12.0, help="address-space limit per case (default 12)")
    p.add_argument("--verify-max-S", type=int, default=8192, help="compare blocks with torch up to this S")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads in each case (default 1: the same for every impl, and steady on a "
                        "shared machine, where OpenMP's spinning threads turn others' load into noise)")
    p.add_argument("--one", nargs=3, metavar=("IMPL", "MASK", "S"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        impl, mask, S = args.one
        try:
            row = child(impl, mask, int(S), args.reps, args.rep_budget_s, args.timeout_s, args.verify_max_S,
                        args.threads)
        except (MemoryError, RuntimeError) as e:
            msg = f"{type(e).__name__}: {str(e)[:300]}"
            oom = isinstance(e, MemoryError) or "allocate" in str(e) or "memory" in str(e).lower()
            row = {"status": "oom" if oom else "error", "error": msg}
        print(json.dumps(row))
        return 0
    if not args.out:
        p.error("--out is required")
    from .run import parse_sizes

    sizes = parse_sizes(args.S)
    masks = [m for m in args.masks.split(",") if m]
    impls = [i for i in args.impls.split(",") if i]
    for name, items, known in (("mask", masks, MASKS), ("impl", impls, IMPLS)):
        if set(items) - set(known):
            p.error(f"unknown {name} {sorted(set(items) - set(known))}; known: {known}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except Exception:
        git = None
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", "-m", "benchmarks.cpu_block_mask"] + sys.argv[1:]),
            "machine": machine(), "git": git, "mem_gb": args.mem_gb, "timeout_s": args.timeout_s,
            "load_start": os.getloadavg(), "threads": args.threads}
    print(json.dumps(meta))
    rows = []
    for S in sizes:
        for mask in masks:
            for impl in impls:
                r = run_case(impl, mask, S, args)
                rows.append(r)
                print(f"{mask:14} S={S:6} {impl:13} {r['status']:7} first {_fmt(r.get('first_s'), ' s'):>8} "
                      f"warm {_fmt(r.get('median_s'), ' s'):>8} peak {_fmt(r.get('peak_mb'), ' MB'):>9} "
                      f"+{_fmt(r.get('delta_mb'), ' MB'):>9} {r.get('vs_torch', {}).get('detail', '')} "
                      f"{r.get('error') or ''}", flush=True)
                (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    meta["load_end"] = os.getloadavg()
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "results.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
