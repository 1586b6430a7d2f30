"""Run one flexjit forward (or forward + backward) a few times, for a profiler to look at.

    ncu --clock-control none --section SpeedOfLight -k regex:flex -s 2 -c 1 \
        python3 -m benchmarks.profile_one --backend triton --variant sliding_window --S 8192
    ncu --clock-control none --section SpeedOfLight -k regex:Bwd -s 3 -c 3 \
        python3 -m benchmarks.profile_one --backend cute --variant causal --pass fwdbwd

B·S = 16384 tokens, 16 heads, head dim 128, bf16, the variant from benchmarks/variants.py.
"""
from __future__ import annotations

import argparse

import torch

import flexjit
from .variants import Case, build


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_one")
    p.add_argument("--backend", default="auto")
    p.add_argument("--variant", default="causal")
    p.add_argument("--S", type=int, default=8192)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--pass", dest="pass_", choices=("fwd", "fwdbwd"), default="fwd")
    a = p.parse_args()
    case = Case(B=16384 // a.S, S=a.S, Hq=16, Hkv=16, D=a.D)
    var = build(a.variant, case, torch.device("cuda"), torch.Generator().manual_seed(0))
    q, k, v = [torch.randn(case.B, 16, a.S, a.D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    bm = None
    if var.mask_mod is not None:
        bm = flexjit.create_block_mask(var.mask_mod, case.B if var.mask_uses_batch else None, None,
                                       a.S, a.S, device="cuda")
    if a.pass_ == "fwd":
        with torch.no_grad():
            for _ in range(a.iters):
                flexjit.flex_attention(q, k, v, var.score_mod, bm, backend=a.backend)
    else:
        q, k, v = [t.requires_grad_(True) for t in (q, k, v)]
        dout = torch.randn_like(q)
        for _ in range(a.iters):
            out = flexjit.flex_attention(q, k, v, var.score_mod, bm, backend=a.backend)
            torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    print(f"ran {a.variant} S={a.S} on {flexjit.explain(q, k, v, var.score_mod, bm, backend=a.backend).name}")


if __name__ == "__main__":
    main()
