"""Where a forward's output error lies (a probe of learnable tables' gradient error), per implementation.

    python -m benchmarks.fwd_error_profile [--S 1024] [--seeds 4] [--cases two_tables,plain]

A captured kv-indexed table's gradient is a column sum of dS over every row, and its error is
dominated by each row's mismatch r_i = dO_i · (O_i - O_kernel_i) between the output the
backward's P implies and the output the forward stored (Σ_j dS_ij is 0 exactly, not in the
kernel). So beside the mean |error| of out (what benchmarks.grad_accuracy reports) this prints
its RMS and max, the LSE's error (mean and RMS), and the RMS of r_i with the float64 golden
output standing in for the backward's: a forward with the same mean error but a larger RMS or
a biased LSE shows here. Runs on a GPU.
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks import grad_accuracy
from benchmarks.grad_accuracy import oracle


def _forward(name, device):
    if name.startswith("flexjit-"):
        import flexjit
        backend = name.removeprefix("flexjit-")
        return lambda q, k, v, sm: flexjit.flex_attention(q, k, v, score_mod=sm, return_lse=True,
                                                          backend=backend)
    if name != "torch-flex-triton":
        raise SystemExit(f"unknown impl {name}: flexjit-<backend> or torch-flex-triton")
    from torch.nn.attention import flex_attention as tfa
    fn = torch.compile(tfa.flex_attention, dynamic=False)
    return lambda q, k, v, sm: fn(q, k, v, score_mod=sm, return_lse=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--S", type=int, default=1024)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--cases", default="two_tables,plain")
    p.add_argument("--impls", default="flexjit-cute,flexjit-triton,torch-flex-triton")
    a = p.parse_args(argv)
    device = torch.device("cuda")
    runs = {n: _forward(n, device) for n in a.impls.split(",")}
    B, H, D = 2, 8, 128
    for case, (make, tables, mask_mod) in grad_accuracy._cases(a.S, device).items():
        if not any(c in case for c in a.cases.split(",")) or mask_mod is not None:
            continue
        stats: dict = {}
        for seed in range(a.seeds):
            g = torch.Generator().manual_seed(seed)
            q, k, v, do = (torch.randn(B, H, a.S, D, generator=g).to(torch.bfloat16).to(device)
                           for _ in range(4))
            with torch.no_grad():
                gold, glse = oracle.dense_attention(
                    q, k, v, make({n: t.double() for n, t in tables.items()}), None)
                for name, run in runs.items():
                    out, lse = run(q, k, v, make(tables))
                    e = out.double() - gold
                    r = (do.double() * e).sum(-1)
                    dl = lse.double() - glse
                    row = {"out_mean": e.abs().mean().item(), "out_rms": e.pow(2).mean().sqrt().item(),
                           "out_max": e.abs().max().item(), "lse_mean": dl.mean().item(),
                           "lse_rms": dl.pow(2).mean().sqrt().item(),
                           "r_rms": r.pow(2).mean().sqrt().item(), "r_sum": r.sum().item()}
                    for key, val in row.items():
                        stats.setdefault(name, {}).setdefault(key, []).append(val)
        for name, st in stats.items():
            rs = torch.tensor(st["r_sum"], dtype=torch.float64)
            print(json.dumps({"case": case, "impl": name,
                              **{k: sum(v) / len(v) for k, v in st.items()},
                              # over seeds: an unbiased forward has r_sum_mean ~ 0 within
                              # r_sum_std / sqrt(seeds), and r_sum_std ~ r_rms * sqrt(rows)
                              "r_sum_std": rs.std().item() if len(rs) > 1 else None,
                              "rows": B * H * a.S,
                              "r_sum_per_seed": st["r_sum"]}), flush=True)


if __name__ == "__main__":
    main()
