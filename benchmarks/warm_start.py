"""How long a fresh process takes to run its first flexjit forward when the disk cache is warm
and where that time goes.

    python -m benchmarks.warm_start --out OUT/warm

A first child process compiles an ALiBi-causal forward (and backward) into a private cache
folder; then ``--repeats`` fresh children, with the cache warm, each time their phases: import
torch, import flexjit, CUDA start (the inputs), create_block_mask, the first forward (until its
result is synchronised), the first backward, a second forward. The first warm child also runs the
first forward under cProfile. DIR/warm_start.json holds every child's phases and DIR/profile.txt
the profile (top 40 by cumulative time); the table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter()
import flexjit
from flexjit import create_block_mask, flex_attention, mods
t_flexjit = time.perf_counter()
B, H, S, D = 2, 16, 2048, 128
q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
torch.cuda.synchronize()
t_cuda = time.perf_counter()
bm = create_block_mask(mods.causal(), None, None, S, S, device="cuda")
torch.cuda.synchronize()
t_mask = time.perf_counter()
alibi = mods.alibi(H)
profile = sys.argv[1] if len(sys.argv) > 1 else ""
if profile:
    import cProfile
    pr = cProfile.Profile()
    pr.enable()
out = flex_attention(q, k, v, score_mod=alibi, block_mask=bm)
torch.cuda.synchronize()
t_fwd = time.perf_counter()
if profile:
    pr.disable()
    import pstats
    with open(profile, "w") as f:
        pstats.Stats(pr, stream=f).sort_stats("cumulative").print_stats(40)
out.sum().backward()
torch.cuda.synchronize()
t_bwd = time.perf_counter()
flex_attention(q, k, v, score_mod=alibi, block_mask=bm)
torch.cuda.synchronize()
t_fwd2 = time.perf_counter()
print(json.dumps({"import_torch": t_torch - t0, "import_flexjit": t_flexjit - t_torch,
                  "cuda_start": t_cuda - t_flexjit, "create_block_mask": t_mask - t_cuda,
                  "first_forward": t_fwd - t_mask, "first_backward": t_bwd - t_fwd,
                  "second_forward": t_fwd2 - t_bwd, "backend": str(flexjit.explain(q, k, v, alibi, bm).name)}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.warm_start", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="flexjit-warm-")
    env = dict(os.environ, FLEXJIT_CACHE_DIR=cache)
    env["PYTHONPATH"] = os.pathsep.join([str(Path.cwd()), env.get("PYTHONPATH", "")])
    runs = []
    for i in range(1 + args.repeats):
        extra = [str(out / "profile.txt")] if i == 1 else []
        res = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), *extra], env=env,
                             capture_output=True, text=True, timeout=900)
        if res.returncode:
            print(res.stdout[-3000:], res.stderr[-5000:])
            return 1
        row = json.loads(res.stdout.strip().splitlines()[-1])
        row["run"] = "cold (compiles)" if i == 0 else f"warm {i}"
        runs.append(row)
        print(json.dumps(row), flush=True)
    (out / "warm_start.json").write_text(json.dumps(runs, indent=1))
    keys = [k for k in runs[0] if k not in ("run", "backend")]
    lines = ["| run | " + " | ".join(keys) + " | backend |", "|---" * (len(keys) + 2) + "|"]
    for r in runs:
        lines.append(f"| {r['run']} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + f" | {r['backend']} |")
    print("\n".join(lines))
    (out / "warm_start.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
