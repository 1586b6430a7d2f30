"""flexjit's own host time per eager call, kernel launches stubbed, on the CPU.

    python -m benchmarks.host_decode [--cases decode8,decode1,decode64,prefill,train] [--out DIR]

Each case builds its inputs on the CPU and calls ``flexjit.flex_attention(..., backend="triton")``
under ``TRITON_INTERPRET=1`` with the Triton kernels replaced by no-ops at the launch
(``kernel[grid](*args)`` does nothing; the module lookup before it still runs): what is timed is
validation, tracing, dispatch, planning, output allocation and argument packing, i.e. the host
work of a call on the GPU minus Triton's own launcher and the CUDA allocator. The decode cases
are the H200 benchmark's (``benchmarks/decode.py``: causal at the last position, Hq 32, Hkv 8,
D 128, bf16, Q_LEN 1, KV 32k); ``prefill`` is a forward at S 2048 without gradients, ``train``
a forward + backward (autograd and the Triton backward's host side).

Per case: --warmup calls, then --rounds rounds of --calls calls; reported are the minimum over
rounds (the call's own cost on a shared machine, where other work only adds time) and the
median, in µs per call (``--clock thread``: this thread's CPU time instead of the wall clock, for a
loaded machine). Run it against two trees (``PYTHONPATH=TREE``) for a before/after on the
same machine; ``--profile CASE`` prints cProfile's top functions for one case instead.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

CASES = ("decode8", "decode1", "decode64", "prefill", "train")


class _NoLaunch:
    """A kernel whose launch does nothing."""

    def __getitem__(self, grid):
        return _no_op


def _no_op(*args, **kwargs):
    return None


class _StubModule:
    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        getattr(self.module, name)  # a missing kernel still fails
        return _NoLaunch()


def stub_launches() -> None:
    """Replace every Triton kernel flexjit launches by a no-op (the module is still loaded)."""
    from flexjit.backends import triton as tb_entry
    from flexjit.backends.triton import prefill as tb
    real = tb.load_module
    tb.load_module = lambda *a, **k: _StubModule(real(*a, **k))


def build(case: str):
    """(a zero-argument call, a description) for ``case``."""
    import flexjit
    from flexjit import mods
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    if case.startswith("decode"):
        B, Hq, Hkv, D, S = int(case[len("decode"):]), 32, 8, 128, 32768
        q = torch.randn(B, Hq, 1, D, generator=gen).to(dt)
        k = torch.empty(B, Hkv, S, D, dtype=dt)  # never read: the kernels are stubbed
        v = torch.empty(B, Hkv, S, D, dtype=dt)
        off = S - 1

        def causal(b, h, q_idx, kv_idx):
            return q_idx + off >= kv_idx
        bm = flexjit.create_block_mask(causal, None, None, 1, S, device="cpu")
        return (lambda: flexjit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, backend="triton"),
                f"decode B={B} Hq={Hq} Hkv={Hkv} D={D} KV={S} causal bf16")
    B, H, S, D = 2, 16, 2048, 128
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(dt) for _ in range(3))
    bm = flexjit.create_block_mask(mods.causal(), None, None, S, S, device="cpu")
    slopes = mods.alibi_slopes(H)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    if case == "prefill":
        return (lambda: flexjit.flex_attention(q, k, v, score_mod=alibi, block_mask=bm, backend="triton"),
                f"prefill forward B={B} H={H} S={S} D={D} causal+alibi bf16")
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn(B, H, S, D, generator=gen).to(dt)

    def step():
        for t in (qg, kg, vg):
            t.grad = None  # zero_grad(set_to_none=True): no CPU accumulation into .grad in the timing
        out = flexjit.flex_attention(qg, kg, vg, score_mod=alibi, block_mask=bm, backend="triton")
        out.backward(dout)
    return step, f"train forward+backward B={B} H={H} S={S} D={D} causal+alibi bf16"


def measure(fn, warmup: int, calls: int, rounds: int, clock=time.perf_counter_ns) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(rounds):
        t0 = clock()
        for _ in range(calls):
            fn()
        per_call.append((clock() - t0) / calls / 1e3)
    return min(per_call), statistics.median(per_call)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_decode", description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--profile", default=None, help="a case: print its cProfile instead")
    p.add_argument("--out", default=None, help="write DIR/results.json")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="wall (perf_counter) or this thread's CPU time (thread_time: on a loaded "
                        "machine it leaves out the time the process waited for a core)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    stub_launches()
    import flexjit
    if a.profile:
        import cProfile
        import pstats
        fn, what = build(a.profile)
        measure(fn, a.warmup, 1, 1)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fn()
        prof.disable()
        print(what)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        return 0
    rows = []
    for case in a.cases.split(","):
        fn, what = build(case)
        clock = time.thread_time_ns if a.clock == "thread" else time.perf_counter_ns
        lo, med = measure(fn, a.warmup, a.calls if case != "train" else max(1, a.calls // 4), a.rounds, clock)
        rows.append(dict(case=case, what=what, clock=a.clock, min_us=lo, median_us=med))
        print(f"{case:9} min {lo:7.1f} µs  median {med:7.1f} µs  ({what})", flush=True)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(flexjit=os.path.dirname(flexjit.__file__), torch=torch.__version__,
                    load=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    command=" ".join(sys.argv))
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
