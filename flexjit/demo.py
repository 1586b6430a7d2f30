"""`flexjit demo`: compile the headline variants on this machine and check them.

For ALiBi, sliding window, document masking and softcap it runs flex_attention
with backend="auto", checks the output against the reference backend in float64,
and prints a table: variant, backend and why, first-call (trace + compile) time,
steady run time and max error.
"""
from __future__ import annotations

import statistics
import time

import torch

from flexjit.api.masks import create_block_mask
from flexjit.api.attention import explain, flex_attention
from flexjit import mods


def _variants(B, H, S, device):
    doc_lengths = torch.randint(S // 16, S // 4, (64,))
    doc_ids = torch.repeat_interleave(torch.arange(64), doc_lengths)[:S].to(device)
    return [
        ("alibi", mods.alibi(H), mods.causal()),
        ("sliding_window", None, mods.sliding_window(S // 8)),
        ("document", None, mods.document(doc_ids)),
        ("softcap", mods.softcap(30.0), mods.causal()),
    ]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, reps):
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_demo(seq_len: int | None = None) -> list[dict]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        B, H, S, D, dtype = 2, 16, seq_len or 4096, 128, torch.bfloat16
        where = f"GPU: {torch.cuda.get_device_name()}"
    else:
        B, H, S, D, dtype = 1, 4, seq_len or 1024, 64, torch.float32
        where = "CPU (no CUDA GPU found): flexjit runs its pure-torch reference backend here"
    print(f"flexjit demo on {where}\nshape: B={B} H={H} S={S} D={D} {dtype}\n")
    torch.manual_seed(0)
    q, k, v = [torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(3)]
    rows = []
    for name, score_mod, mask_mod in _variants(B, H, S, device):
        bm = create_block_mask(mask_mod, None, None, S, S, device=device)
        choice = explain(q, k, v, score_mod=score_mod, block_mask=bm)
        t0 = time.perf_counter()
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
        _sync(device)
        first = time.perf_counter() - t0
        run = _time(lambda: flex_attention(q, k, v, score_mod=score_mod, block_mask=bm), device, 5)
        ref = flex_attention(q.double(), k.double(), v.double(), score_mod=score_mod, block_mask=bm,
                             backend="reference")
        err = (out.double() - ref).abs().max().item()
        rows.append(dict(variant=name, backend=choice.name, why=choice.reason, first_call_s=first,
                         run_ms=run * 1e3, max_err=err))
    _print(rows)
    return rows


def _print(rows):
    head = f"{'variant':<16}{'backend':<11}{'first call':>12}{'run':>12}{'max err':>11}  why"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['variant']:<16}{r['backend']:<11}{r['first_call_s']:>11.2f}s{r['run_ms']:>10.2f}ms"
              f"{r['max_err']:>11.2e}  {r['why']}")
