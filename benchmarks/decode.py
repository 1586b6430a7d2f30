"""Decoding benchmark: `python -m benchmarks.decode --out DIR` (one Q_LEN=1 step against a long KV).

Rows: impl × batch × kv_len × paged × variant, each checked against an fp32 reference (on two
batch elements; heads and batch elements are independent) before it is timed, written to
DIR/results.json after every row (impl, batch, kv_len, paged, variant, ms, gbps, correct, and
ms_graph / gbps_graph: the same call replayed from a CUDA graph, i.e. without host overhead).
``gbps`` = bytes of K and V the variant must read (every key for causal at Q_LEN=1, the window for
sliding_window; one byte an element for the FP8 cache) ÷ time. An FP8 row is checked against the
attention of the values its cache holds (dequantised, in fp32).

| impl       | what runs                                                                        |
|------------|----------------------------------------------------------------------------------|
| flexjit    | flexjit.flex_attention, backend "auto" (on a GPU: the Triton split-KV decode kernel)|
| fa4        | flash_attn.cute: flash_attn_func (contiguous) / flash_attn_varlen_func with       |
|            | page_table (paged), causal / window_size, num_splits=0 (its own split heuristic)  |
| torch-flex | torch.compile(flex_attention) (torch's flex decoding kernel at small Q_LEN)       |
| flexjit-fp8| flexjit with the KV cache in float8_e4m3fn, one descale per (batch, kv head), bf16  |
|            | queries: the split-KV kernel reads the e4m3 tiles (half the bytes of bf16)         |

Paged: the KV of every sequence sits in 128-token pages of one pool, handed out by
flexjit.PagedAttention in round-robin rounds (so entries interleave; shuffled at random where
flexjit has no PagedAttention). flexjit's rows use PagedAttention.convert_logical_block_mask;
torch's get the same lists built here (every logical block replaced by its physical page, a
mask_mod mapping a physical key back to its logical position, as torch's PagedAttention does);
FA4 gets the page table itself.

Default grid: batch 1, 8, 64 × KV 4k, 32k, 128k × Hq=32, Hkv=8, D=128, bf16, both
variants, contiguous and paged, the cases of the speed target (batch >= 8, KV >= 32k) first. A
wall-clock budget (--budget-s, default 240) stops starting rows in time to write the outputs;
--resume finishes a run. `--device cpu` is a smoke mode at tiny sizes
(flexjit's Triton kernels under TRITON_INTERPRET=1, torch's flex_attention eager).
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import torch

from .impls import raise_dynamo_limits
from .run import parse_sizes

PAGE = 128
IMPLS = ("flexjit", "flexjit-fp8", "fa4", "torch-flex")
VARIANTS = ("causal", "sliding_window")




def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None,
                   help="default benchmarks/results/<date>-decode (on the device: $OUT/...)")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu (smoke sizes)")
    p.add_argument("--batch", default=None, help="default 1,8,64 (cpu: 1,2)")
    p.add_argument("--kv", default=None, help="KV lengths, default 4k,32k,128k (cpu: 256,512)")
    p.add_argument("--hq", type=int, default=None, help="default 32 (cpu: 4)")
    p.add_argument("--hkv", type=int, default=None, help="default 8 (cpu: 2)")
    p.add_argument("--d", type=int, default=None, help="default 128 (cpu: 32)")
    p.add_argument("--window", type=int, default=None, help="sliding window, default 4096 (cpu: 192)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--flexjit-modes", default="",
                   help="extra flexjit rows, ';'-separated, each comma-separated key=value: "
                        "splits=N (kernel_options DECODE_SPLITS), cfg=TOKENS (DECODE_CONFIG) or "
                        "another kernel_options key (BLOCK_N, num_warps, num_stages), e.g. "
                        "'splits=8;BLOCK_N=128,num_stages=4;cfg=prefetch+vbits'; cfg=plain pins the "
                        "plain kernel")
    p.add_argument("--fp8-modes", default="",
                   help="extra flexjit-fp8 rows, as --flexjit-modes (the FP8 cache's tiles)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--paged", default="0,1", help="0 (contiguous), 1 (paged) or both")
    p.add_argument("--budget-s", type=float, default=240.0, help="start no row after this (0: no limit)")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timing")
    p.add_argument("--resume", default=None, metavar="RESULTS_JSON",
                   help="keep that run's measured rows and measure only the others")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a.out = a.out or str(Path(__file__).parent / "results" / f"{datetime.date.today().isoformat()}-decode")
    cpu = a.device.type == "cpu"
    a.batch = parse_sizes(a.batch) if a.batch else ([1, 2] if cpu else [1, 8, 64])
    a.kv = parse_sizes(a.kv) if a.kv else ([256, 512] if cpu else [4096, 32768, 131072])
    a.hq = a.hq or (4 if cpu else 32)
    a.hkv = a.hkv or (2 if cpu else 8)
    a.d = a.d or (32 if cpu else 128)
    a.window = a.window or (192 if cpu else 4096)
    a.impls = [x for x in a.impls.split(",") if x]
    a.variants = [x for x in a.variants.split(",") if x]
    a.paged = [bool(int(x)) for x in a.paged.split(",")]
    for x in a.impls:
        if x not in IMPLS:
            raise SystemExit(f"unknown impl {x}; known: {IMPLS}")
    for mode in filter(None, a.flexjit_modes.split(";")):
        parse_mode(mode)
        a.impls.append(f"flexjit[{mode}]")
    for mode in filter(None, a.fp8_modes.split(";")):
        parse_mode(mode)
        a.impls.append(f"flexjit-fp8[{mode}]")
    for x in a.variants:
        if x not in VARIANTS:
            raise SystemExit(f"unknown variant {x}; known: {VARIANTS}")
    if any(s % PAGE for s in a.kv) and True in a.paged:
        raise SystemExit(f"paged rows need KV lengths that are multiples of the page ({PAGE})")
    return a


class Skip(Exception):
    pass


# ---- the case: data, masks, paging ------------------------------------------------------------


def base_mask(variant: str, S: int, window: int):
    """The variant's mask_mod in logical positions; the single query sits at position S - 1."""
    off = S - 1
    if variant == "causal":
        def causal(b, h, q_idx, kv_idx):
            return q_idx + off >= kv_idx
        return causal

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx + off >= kv_idx) & (q_idx + off - kv_idx < window)
    return sliding_window


def keys_read(variant: str, S: int, window: int) -> int:
    return S if variant == "causal" else min(S, window)


class Case:
    """q, k, v of one (batch, kv_len) and, built on first need, its paged copy."""

    def __init__(self, args, B: int, S: int):
        self.args, self.B, self.S = args, B, S
        dev, dt = args.device, (torch.float32 if args.device.type == "cpu" else torch.bfloat16)
        g = torch.Generator(device=dev).manual_seed(args.seed + B * 7919 + S)
        self.q = torch.randn(B, args.hq, 1, args.d, device=dev, dtype=dt, generator=g)
        # [B, S, H, D] memory seen as [B, H, S, D]: FA4's layout, and flex takes the strides.
        self.k = torch.randn(B, S, args.hkv, args.d, device=dev, dtype=dt, generator=g).transpose(1, 2)
        self.v = torch.randn(B, S, args.hkv, args.d, device=dev, dtype=dt, generator=g).transpose(1, 2)
        self._paged = None
        self._fp8 = None
        self.pa = None

    def fp8(self):
        """(k8, v8, k_descale, v_descale): K and V quantised to float8_e4m3fn with one descale per
        (batch, kv head) (amax / 448), in the same [B, S, H, D] memory seen as [B, H, S, D]."""
        if self._fp8 is None:
            out = []
            for t in (self.k, self.v):
                scale = (t.abs().amax(dim=(2, 3)).float() / 448.0).clamp(min=1e-12)  # (B, Hkv)
                q8 = torch.empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3], device=t.device,
                                 dtype=torch.float8_e4m3fn).transpose(1, 2)
                for b in range(t.shape[0]):  # one batch row at a time: no float32 copy of the cache
                    q8[b] = (t[b].float() / scale[b, :, None, None]).to(torch.float8_e4m3fn)
                out.append((q8, scale.contiguous()))
            (k8, kd), (v8, vd) = out
            self._fp8 = (k8, v8, kd, vd)
        return self._fp8

    def dequantised(self, bs: list[int]):
        """The values the FP8 cache holds for batch rows ``bs``, in fp32: what an FP8 row is
        checked against."""
        k8, v8, kd, vd = self.fp8()
        return tuple(t[bs].float() * d[bs][:, :, None, None] for t, d in ((k8, kd), (v8, vd)))

    def paged(self):
        """(k_pool, v_pool [n_pages, PAGE, Hkv, D], page_table [B, S/PAGE] int32,
        physical_to_logical [B, n_pages] int32, -1 where the page is not b's)."""
        if self._paged is None:
            B, S, dev = self.B, self.S, self.args.device
            n = S // PAGE
            spare = 4  # pages no sequence owns: garbage a kernel must not read
            self.pa = _page_pool(B, n, spare, dev)
            if self.pa is not None:  # the pages flexjit.PagedAttention handed out
                perm = self.pa.page_table[:, :n].to(dev)
            else:
                g = torch.Generator().manual_seed(self.args.seed + 1)
                perm = torch.randperm(B * n + spare, generator=g)[:B * n].view(B, n).to(dev)
            shape = (B * n + spare, PAGE, self.args.hkv, self.args.d)
            # Unowned pages hold NaN on the GPU, where every kernel skips unlisted blocks; torch's
            # eager flex_attention (the CPU smoke baseline) computes every score and multiplies
            # masked ones' zero weights by V, so there they hold finite garbage.
            fill = float("nan") if dev.type == "cuda" else 1e3
            kp = torch.full(shape, fill, device=dev, dtype=self.k.dtype)
            vp = torch.full(shape, fill, device=dev, dtype=self.v.dtype)
            kp[perm.reshape(-1)] = self.k.transpose(1, 2).reshape(B * n, PAGE, *shape[2:])
            vp[perm.reshape(-1)] = self.v.transpose(1, 2).reshape(B * n, PAGE, *shape[2:])
            p2l = torch.full((B, shape[0]), -1, dtype=torch.int32, device=dev)
            p2l.scatter_(1, perm, torch.arange(n, device=dev, dtype=torch.int32).expand(B, n).contiguous())
            self._paged = (kp, vp, perm.to(torch.int32).contiguous(), p2l)
        return self._paged

    def paged_fp8(self):
        """(k_pool, v_pool) of the FP8 cache: the bf16 pools' layout and page table, e4m3
        values (unowned pages hold e4m3 NaN on the GPU, 448 on the CPU)."""
        kp, vp, perm, _ = self.paged()
        k8, v8, _, _ = self.fp8()
        B, n = perm.shape
        out = []
        fill = 0x7F if kp.device.type == "cuda" else 0x7E  # e4m3fn's NaN, 448
        for pool, t in ((kp, k8), (vp, v8)):
            p8 = torch.empty(pool.shape, device=pool.device, dtype=torch.float8_e4m3fn)
            p8.view(torch.uint8).fill_(fill)
            p8[perm.reshape(-1).long()] = t.transpose(1, 2).reshape(B * n, PAGE, *pool.shape[2:])
            out.append(p8)
        return tuple(out)

    def flex_kv(self, paged: bool, fp8: bool = False):
        """k, v as flex_attention takes them: [B, Hkv, S, D], or the pool as one sequence
        [1, Hkv, n_pages·PAGE, D] expanded over the batch (strided views, no copy)."""
        if not paged:
            return self.fp8()[:2] if fp8 else (self.k, self.v)
        kp, vp = self.paged_fp8() if fp8 else self.paged()[:2]
        P = kp.shape[0] * PAGE
        return tuple(t.view(1, P, *t.shape[2:]).transpose(1, 2).expand(self.B, -1, -1, -1)
                     for t in (kp, vp))


def _page_pool(B: int, n: int, spare: int, device):
    """A flexjit.PagedAttention whose entries got their n pages in 16 round-robin rounds (so
    they interleave in the pool, as a server's do), or None where flexjit has none."""
    try:
        from flexjit.api.paged import PagedAttention
    except ImportError:
        return None
    pa = PagedAttention(B * n + spare, PAGE, B, device=device)
    rounds = min(16, n)
    for r in range(1, rounds + 1):
        for b in range(B):
            pa.reserve(b, (n * r // rounds) * PAGE)
    return pa


def paged_lists(case: Case, variant: str, lib):
    """The block mask of a paged step for ``lib`` (flexjit or torch.nn.attention.flex_attention):
    the logical mask's lists with every logical block replaced by its physical page, and a
    mask_mod that maps a physical key back to (batch, logical position)."""
    args, B, S = case.args, case.B, case.S
    base = base_mask(variant, S, args.window)
    logical = lib.create_block_mask(base, None, None, 1, S, device=args.device, BLOCK_SIZE=PAGE)
    _, _, table, p2l = case.paged()
    n_phys = p2l.shape[1]

    def to_physical(num, idx):
        if num is None:
            return None, None
        num = num.expand(B, 1, 1).contiguous()
        phys = torch.gather(table, 1, idx.expand(B, 1, 1, -1)[:, 0, 0].long().clamp(max=table.shape[1] - 1))
        out = torch.zeros(B, 1, 1, n_phys, dtype=torch.int32, device=args.device)
        out[:, 0, 0, :phys.shape[1]] = phys
        return num.to(torch.int32), out

    kn, ki = to_physical(logical.kv_num_blocks, logical.kv_indices)
    fn, fi = to_physical(logical.full_kv_num_blocks, logical.full_kv_indices)

    def paged_mask(b, h, q_idx, kv_idx):
        lb = p2l[b, kv_idx // PAGE]
        return (lb >= 0) & base(b, h, q_idx, lb * PAGE + kv_idx % PAGE)
    return lib.BlockMask.from_kv_blocks(kn, ki, fn, fi, BLOCK_SIZE=PAGE, mask_mod=paged_mask,
                                        seq_lengths=(1, n_phys * PAGE))


# ---- implementations --------------------------------------------------------------------------


MODE_OPTIONS = {"splits": "DECODE_SPLITS", "cfg": "DECODE_CONFIG"}
"""--flexjit-modes keys that are short names of kernel_options keys (the rest are the keys)."""


def parse_mode(mode: str) -> dict:
    """The kernel_options of a --flexjit-modes entry; ``cfg=plain`` pins the plain kernel
    (DECODE_CONFIG "")."""
    opts = {}
    for item in mode.split(","):
        key, _, value = item.partition("=")
        if key == "cfg" and value == "plain":
            opts["DECODE_CONFIG"] = ""
            continue
        if not value:
            raise SystemExit(f"--flexjit-modes entry {item!r} is not key=value")
        key = MODE_OPTIONS.get(key, key)
        opts[key] = value if key == "DECODE_CONFIG" else int(value)
    return opts


def setup_flexjit(case: Case, variant: str, paged: bool, mode: str = "", fp8: bool = False):
    import flexjit
    opts = parse_mode(mode) if mode else None
    k, v = case.flex_kv(paged, fp8)
    descales = dict(k_descale=case.fp8()[2], v_descale=case.fp8()[3]) if fp8 else {}
    if paged and case.pa is not None:  # the user's path: flexjit.PagedAttention's conversion
        logical = flexjit.create_block_mask(base_mask(variant, case.S, case.args.window), None, None,
                                            1, case.S, device=case.args.device, BLOCK_SIZE=PAGE)
        rows = torch.arange(case.B, device=case.args.device)  # expands the batch-1 mask to B
        bm = case.pa.convert_logical_block_mask(logical, batch_idx=rows)
    elif paged:
        bm = paged_lists(case, variant, flexjit)
    else:
        bm = flexjit.create_block_mask(base_mask(variant, case.S, case.args.window), None, None, 1,
                                       case.S, device=case.args.device)
    backend = "triton" if case.args.device.type == "cpu" else "auto"
    q = case.q

    def call():
        return flexjit.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, backend=backend,
                                      kernel_options=opts, **descales)
    note = str(flexjit.explain(q, k, v, block_mask=bm, enable_gqa=True, backend=backend,
                               kernel_options=opts, **descales)).splitlines()[0]
    return call, note


def setup_flexjit_fp8(case: Case, variant: str, paged: bool):
    return setup_flexjit(case, variant, paged, fp8=True)


def setup_torch_flex(case: Case, variant: str, paged: bool):
    from torch.nn.attention import flex_attention as tfa
    k, v = case.flex_kv(paged)
    if paged:
        bm = paged_lists(case, variant, tfa)
    else:
        bm = tfa.create_block_mask(base_mask(variant, case.S, case.args.window), None, None, 1, case.S,
                                   device=case.args.device)
    flex = tfa.flex_attention
    if case.args.device.type == "cuda":
        flex = torch.compile(flex, dynamic=False, fullgraph=True)
    q = case.q
    return (lambda: flex(q, k, v, block_mask=bm, enable_gqa=True)), "compiled" if flex is not tfa.flex_attention else "eager"


def setup_fa4(case: Case, variant: str, paged: bool):
    if case.args.device.type != "cuda":
        raise Skip("needs a CUDA GPU")
    try:
        import flash_attn.cute as fa
    except Exception as e:
        raise Skip(f"`import flash_attn.cute` failed: {type(e).__name__}: {e}") from None
    q = case.q.transpose(1, 2)  # [B, 1, Hq, D] view
    kw = {"causal": True}
    if variant == "sliding_window":
        kw["window_size"] = (case.args.window - 1, 0)
    if paged:
        fn = fa.flash_attn_varlen_func
        kp, vp, table, _ = case.paged()
        seqused = torch.full((case.B,), case.S, dtype=torch.int32, device=q.device)
        k, v = kp, vp
        kw.update(page_table=table, seqused_k=seqused, max_seqlen_q=1, max_seqlen_k=case.S)
        q = q.contiguous()
    else:
        fn = fa.flash_attn_func
        k, v = case.k.transpose(1, 2), case.v.transpose(1, 2)
    params = inspect.signature(fn).parameters
    missing = [n for n in kw if n not in params]
    if missing:
        raise Skip(f"{fn.__name__} takes no {missing}")
    notes = []
    for splits in (0, 1):  # 0: FA4's own split heuristic, where this version has one
        if "num_splits" in params:
            kw["num_splits"] = splits
        try:
            out = fn(q, k, v, **kw)
            torch.cuda.synchronize()
            break
        except Exception as e:
            notes.append(f"num_splits={splits}: {type(e).__name__}: {str(e)[:200]}")
            if "num_splits" not in params or splits == 1:
                raise
    args = dict(kw)

    def call():
        out = fn(q, k, v, **args)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)
    return call, "; ".join(notes + [f"num_splits={args.get('num_splits', 'n/a')}"])


SETUP = {"flexjit": setup_flexjit, "flexjit-fp8": setup_flexjit_fp8, "fa4": setup_fa4,
         "torch-flex": setup_torch_flex}


# ---- reference, timing ------------------------------------------------------------------------


def reference_check(case: Case, variant: str, out: torch.Tensor,
                    fp8: bool = False) -> tuple[bool, float, float]:
    """(correct, err, bound): out against fp32 (fp64 on the CPU) math on the logical K/V (for an
    FP8 cache: the values it holds), for batch elements 0 and B-1; bound = 2·err(the same math in
    the query's dtype) + 1e-3."""
    bs = sorted({0, case.B - 1})
    k, v = case.dequantised(bs) if fp8 else (case.k[bs], case.v[bs])
    q = case.q[bs]
    G = q.shape[1] // k.shape[1]
    S = case.S
    kv_idx = torch.arange(S, device=q.device)
    keep = base_mask(variant, S, case.args.window)(None, None, torch.zeros((), device=q.device,
                                                                          dtype=torch.long), kv_idx)
    wide = torch.float64 if q.device.type == "cpu" else torch.float32

    def attend(dt):
        kk = k.to(dt).repeat_interleave(G, 1)
        vv = v.to(dt).repeat_interleave(G, 1)
        s = (q.to(dt) @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~keep, float("-inf"))
        return torch.softmax(s.float() if dt != wide else s, -1).to(dt) @ vv
    ref = attend(wide)
    low = attend(q.dtype)  # for FP8: bf16 math on the dequantised values
    got = out[bs]
    err = (got.to(wide) - ref).abs().max().item()
    bound = 2 * (low.to(wide) - ref).abs().max().item() + 1e-3
    return bool(err <= bound and not torch.isnan(got).any()), err, bound


def time_ms(fn, args) -> float:
    if args.device.type == "cuda":
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def graph_ms(fn, args) -> float | None:
    """The call replayed from a CUDA graph (no host overhead), or None where it cannot be
    captured."""
    if args.device.type != "cuda" or args.no_graph:
        return None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_ms(g.replay, args)


# ---- the run ----------------------------------------------------------------------------------


def row_key(r: dict) -> tuple:
    return (r["impl"], r["batch"], r["kv_len"], r["paged"], r["variant"])


def case_order(args) -> list[tuple[int, int]]:
    """The speed target's cases (batch >= 8, KV >= 32k) first, then the rest."""
    cases = [(B, S) for S in args.kv for B in args.batch]
    return sorted(cases, key=lambda c: (not (c[0] >= 8 and c[1] >= 32768), -c[1], c[0]))


def environment(args) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python", "-m", "benchmarks.decode"] + sys.argv[1:]),
           "python": platform.python_version(), "torch": torch.__version__,
           "device": str(args.device), "hq": args.hq, "hkv": args.hkv, "d": args.d,
           "window": args.window, "page": PAGE}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if args.device.type == "cuda":
        props = torch.cuda.get_device_properties(args.device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count)
    return env


def run_row(args, case: Case, impl: str, variant: str, paged: bool) -> dict:
    row = dict(impl=impl, batch=case.B, kv_len=case.S, paged=paged, variant=variant, hq=args.hq,
               hkv=args.hkv, d=args.d, ms=None, gbps=None, ms_graph=None, gbps_graph=None,
               correct=None, note="", error=None)
    fp8 = impl.startswith("flexjit-fp8")
    elem = 1 if fp8 else case.q.element_size()
    nbytes = case.B * args.hkv * keys_read(variant, case.S, args.window) * 2 * args.d * elem
    try:
        if impl.startswith(("flexjit[", "flexjit-fp8[")):
            fn, row["note"] = setup_flexjit(case, variant, paged, impl[impl.index("[") + 1:-1], fp8)
        else:
            fn, row["note"] = SETUP[impl](case, variant, paged)
        found = re.search(r"(\d+) splits? ", row["note"])
        row["splits"] = int(found.group(1)) if found else None
        out = fn()
        row["correct"], row["err"], row["bound"] = reference_check(case, variant, out, fp8)
        if not row["correct"]:
            row["error"] = f"wrong answer: err {row['err']:.3g} > bound {row['bound']:.3g}"
            return row
        row["ms"] = time_ms(fn, args)
        row["gbps"] = nbytes / (row["ms"] * 1e-3) / 1e9
        try:
            row["ms_graph"] = graph_ms(fn, args)
            if row["ms_graph"]:
                row["gbps_graph"] = nbytes / (row["ms_graph"] * 1e-3) / 1e9
        except Exception as e:
            row["note"] += f"; no CUDA graph: {type(e).__name__}: {str(e)[:120]}"
    except Skip as e:
        row["error"] = f"skipped: {e}"
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc()
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    # torch-flex compiles once per (batch, KV, layout, variant): 12 cases per batch pass dynamo's
    # default limit of 8 (every torch-flex row after the 8th would fail).
    raise_dynamo_limits()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps(environment(args), indent=1))
    kept = {}
    if args.resume:
        kept = {row_key(r): r for r in json.loads(Path(args.resume).read_text())
                if not str(r.get("error") or "").startswith("skipped: time budget")}
    rows = list(kept.values())
    start = time.monotonic()
    for B, S in case_order(args):
        case = None
        for paged in args.paged:
            for variant in args.variants:
                for impl in args.impls:
                    key = (impl, B, S, paged, variant)
                    if key in kept:
                        continue
                    if args.budget_s and time.monotonic() - start > args.budget_s:
                        row = dict(impl=impl, batch=B, kv_len=S, paged=paged, variant=variant,
                                   error=f"skipped: time budget of {args.budget_s:.0f} s spent")
                    else:
                        case = case or Case(args, B, S)
                        row = run_row(args, case, impl, variant, paged)
                    rows.append(row)
                    (out / "results.json").write_text(json.dumps(rows, indent=1))
                    print(_line(row), flush=True)
        del case
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


def _line(r: dict) -> str:
    what = f"{r['impl']:10s} B={r['batch']:<3d} kv={r['kv_len']:<7d} {'paged' if r['paged'] else 'contig'} {r['variant']:14s}"
    if r.get("ms") is not None:
        g = f"  graph {r['ms_graph'] * 1e3:8.1f} us {r['gbps_graph']:7.0f} GB/s" if r.get("ms_graph") else ""
        return f"{what} {r['ms'] * 1e3:8.1f} us {r['gbps']:7.0f} GB/s{g}  {r.get('note', '')}"
    return f"{what} {r.get('error')}"


if __name__ == "__main__":
    sys.exit(main())
