"""FP8 accuracy: flexjit's FP8 forward against the float64 attention of the data before quantising.

    python -m benchmarks.fp8_accuracy --out DIR [--S 2k] [--d 128,64] [--variants ...] [--data normal,outliers]

For each core variant (``variants.py``: full, causal, ALiBi, sliding window, document, softcap),
head dim and data flavour, bf16 q, k, v are drawn ("normal": N(0, 1); "outliers": a few
channels of q and k, the same ones, scaled ×20–50 each, as LLM activations concentrate their
magnitude), and the truth is float64 attention of those bf16 values (``tests/oracle.py``,
mods called eagerly). q, k, v are quantised to float8_e4m3fn with one descale per (batch, kv
head), amax / 448 (the query's heads share their kv head's), and compared:

- ``fp8``: ``flexjit.flex_attention`` on the quantised tensors, backend "auto" (the backend and
  whether it reads FP8 itself or dequantises first are recorded: ``backend``, ``native``);
- ``plain``: the plain FP8 reference, dequantise → float32 attention → round to bf16;
- ``plain_p8``: the same with P rounded to e4m3 before P·V (row sums before rounding): the
  math of a kernel whose P·V is an e4m3 MMA, so what that design alone costs;
- ``bf16``: ``flexjit.flex_attention`` on the original bf16 data.

``inputs``: "qkv8" (all three FP8) or "kv8" (bf16 q beside an FP8 K/V: the mixed case).
``rotated``: q and k went through ``flexjit.fp8.hadamard_rotate`` before quantising
(FlashAttention-3's incoherent processing; q·k, hence the truth, is unchanged).

Errors, per output tensor (B, Hq, S, Dv): ``rel_*`` = ‖out − true‖₂ / ‖true‖₂, the L2
(Frobenius) norm over every element (a relative RMS error); ``max_*`` = max |out − true|.
``ratio_rel`` / ``ratio_max`` = fp8's over plain's; the target is ≤ 1.1.

Writes a record (``records.write_record``, capability ``fp8_accuracy``) after every case:
DIR/results.json (the rows), DIR/meta.json, DIR/results.md (the table). ``--device cpu`` with small sizes is a smoke
run (the reference backend answers there).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import records
from .impls import plan_mask
from .reference import E4M3
from .run import parse_sizes
from .variants import Case, build

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import oracle  # noqa: E402  (the tests' independent float64 oracle)

VARIANTS = ("full", "causal", "alibi", "sliding_window", "document", "softcap")
DATA = ("normal", "outliers")
TARGET = 1.1


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_accuracy", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the record folder to write")
    p.add_argument("--S", default="2k", help="sequence length (default 2k)")
    p.add_argument("--d", default="128,64", help="head dims (default 128,64)")
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--hq", type=int, default=16)
    p.add_argument("--hkv", type=int, default=4, help="kv heads (default 4: GQA, q's descale per kv head)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--data", default=",".join(DATA))
    p.add_argument("--inputs", default="qkv8,kv8", help="qkv8 (all FP8), kv8 (bf16 q, FP8 K/V)")
    p.add_argument("--rotate", default="0,1", help="0: as drawn, 1: Hadamard-rotated q and k; or both")
    p.add_argument("--outlier-channels", type=int, default=4)
    p.add_argument("--outlier-scale", default="20,50", help="range of the outlier channels' factors")
    p.add_argument("--backend", default="auto", help="flexjit backend for the fp8 and bf16 columns")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--machine", default=None, help="the record's machine (default from the GPU's name)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    (a.S,) = parse_sizes(a.S)
    a.d = parse_sizes(a.d)
    a.variants = _pick(a.variants, VARIANTS)
    a.data = _pick(a.data, DATA)
    a.inputs = _pick(a.inputs, ("qkv8", "kv8"))
    a.rotate = [bool(int(x)) for x in a.rotate.split(",")]
    lo, hi = (float(x) for x in a.outlier_scale.split(","))
    a.outlier_scale = (lo, hi)
    if a.hq % a.hkv:
        raise SystemExit(f"--hq {a.hq} is not a multiple of --hkv {a.hkv}")
    return a


def _pick(text: str, known) -> list[str]:
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in known]
    if bad:
        raise SystemExit(f"unknown {bad}; known: {', '.join(known)}")
    return items


# ---- data --------------------------------------------------------------------------------------


def draw(case: Case, flavour: str, gen: torch.Generator, channels: int, scale: tuple, device):
    """bf16 q (B, Hq, S, D), k, v (B, Hkv, S, D); "outliers": ``channels`` channels of q and k
    (the same ones) multiplied by factors uniform in ``scale``, each tensor its own factors."""
    shapes = ((case.B, case.Hq, case.S, case.D), (case.B, case.Hkv, case.S, case.D),
              (case.B, case.Hkv, case.S, case.D))
    q, k, v = (torch.randn(s, generator=gen) for s in shapes)
    if flavour == "outliers":
        idx = torch.randperm(case.D, generator=gen)[:channels]
        lo, hi = scale
        for t in (q, k):
            t[..., idx] *= lo + (hi - lo) * torch.rand(channels, generator=gen)
    return tuple(t.to(torch.bfloat16).to(device) for t in (q, k, v))


def quantise(q, k, v, q_fp8: bool):
    """((q, k, v) stored, (q_descale, k_descale, v_descale)): per-(batch, kv head) e4m3; a bf16
    query stays bf16 (descale None)."""
    g = q.shape[1] // k.shape[1]
    k8, kd = oracle.quantize_e4m3(k.double(), 1)
    v8, vd = oracle.quantize_e4m3(v.double(), 1)
    if not q_fp8:
        return (q, k8, v8), (None, kd, vd)
    q8, qd = oracle.quantize_e4m3(q.double(), g)
    return (q8, k8, v8), (qd, kd, vd)


# ---- one row -----------------------------------------------------------------------------------


def errors(out: torch.Tensor, true: torch.Tensor) -> tuple[float, float]:
    """(‖out − true‖₂ / ‖true‖₂ over all elements, max |out − true|)."""
    d = out.double() - true
    return float(torch.linalg.vector_norm(d) / torch.linalg.vector_norm(true)), float(d.abs().max())


def flexjit_fp8(stored, descales, variant, bm, backend):
    """(out, backend name, native): flexjit's FP8 call, and which road it took."""
    import flexjit
    from flexjit.api.attention import prepare_call
    from flexjit.runtime import dispatch

    kw = dict(score_mod=variant.score_mod, block_mask=bm, enable_gqa=True, backend=backend)
    fp8 = dict(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    choice = flexjit.explain(*stored, **kw, **fp8)
    call = prepare_call(*stored, variant.score_mod, bm, None, True, None, fp8=(*descales, None))
    native = bool(dispatch.fp8_native(dispatch.module(choice.name), call)[0])
    with torch.no_grad():
        out = flexjit.flex_attention(*stored, **kw, **fp8)
    return out, choice.name, native


def measure_case(args, case: Case, vname: str, flavour: str, gen: torch.Generator) -> list[dict]:
    """Every (inputs, rotated) row of one (variant, D, data)."""
    import flexjit
    from flexjit.fp8 import hadamard_rotate

    dev = args.device
    variant = build(vname, case, dev, gen)
    bm = plan_mask(flexjit.create_block_mask, variant, case, dev)
    q, k, v = draw(case, flavour, gen, args.outlier_channels, args.outlier_scale, dev)
    mods = (variant.score_mod, variant.mask_mod)
    true, _ = oracle.dense_attention(q, k, v, *mods)  # float64 of the bf16 values
    with torch.no_grad():
        bf16 = flexjit.flex_attention(q, k, v, score_mod=variant.score_mod, block_mask=bm,
                                      enable_gqa=True, backend=args.backend)
    rel_bf16, max_bf16 = errors(bf16, true)
    del bf16
    rows = []
    for rotated in args.rotate:
        qr, kr = (hadamard_rotate(q), hadamard_rotate(k)) if rotated else (q, k)
        for inputs in args.inputs:
            # A bf16 query beside FP8 K/V stays bf16, rotated or not (the user's tensor).
            qq = qr.to(torch.bfloat16) if inputs == "kv8" else qr
            stored, descales = quantise(qq, kr, v, inputs == "qkv8")
            t0 = time.perf_counter()
            out, backend, native = flexjit_fp8(stored, descales, variant, bm, args.backend)
            seconds = time.perf_counter() - t0
            plain, _ = oracle.fp8_reference(*stored, descales, *mods, torch.bfloat16)
            plain_p8, _ = oracle.fp8_reference(*stored, descales, *mods, torch.bfloat16, p_dtype=E4M3)
            (rel, mx), (rel_p, max_p), (rel_p8, max_p8) = (errors(t, true) for t in (out, plain, plain_p8))
            rows.append({
                "variant": vname, "D": case.D, "S": case.S, "B": case.B, "Hq": case.Hq, "Hkv": case.Hkv,
                "data": flavour, "inputs": inputs, "rotate": rotated, "backend": backend,
                "native": native, "rel_fp8": rel, "rel_plain": rel_p, "rel_plain_p8": rel_p8,
                "rel_bf16": rel_bf16, "max_fp8": mx, "max_plain": max_p, "max_plain_p8": max_p8,
                "max_bf16": max_bf16, "ratio_rel": rel / rel_p, "ratio_max": mx / max_p,
                "within_target": rel <= TARGET * rel_p and mx <= TARGET * max_p,
                "first_call_s": round(seconds, 3), "seed": args.seed,
            })
            print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    return (f"{r['variant']:14} D={r['D']:<3} {r['data']:8} {r['inputs']:4} rot={int(r['rotate'])} "
            f"{r['backend']}{'' if r['native'] else '(dequantised)'}: rel fp8 {r['rel_fp8']:.3e} "
            f"plain {r['rel_plain']:.3e} (P e4m3 {r['rel_plain_p8']:.3e}) bf16 {r['rel_bf16']:.3e} "
            f"ratio {r['ratio_rel']:.3f}; max {r['max_fp8']:.3e} / {r['max_plain']:.3e} "
            f"ratio {r['ratio_max']:.3f}")


# ---- the record --------------------------------------------------------------------------------


def _machine(device: torch.device) -> tuple[str, str]:
    """(the record's machine folder, the device's name)."""
    if device.type != "cuda":
        return "cpu", f"cpu ({platform.processor() or platform.machine()})"
    name = torch.cuda.get_device_name(device)
    found = re.search(r"\b([A-Z]\d{2,3})\b", name)
    return (found.group(1).lower() if found else "gpu"), name


def _git() -> str:
    sha = os.environ.get("FLEXJIT_GIT_SHA")
    if sha:
        return sha
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def meta_of(args) -> dict:
    machine, device = _machine(args.device)
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "cuda": torch.version.cuda}
    for dist in ("triton", "nvidia-cutlass-dsl"):
        try:
            from importlib.metadata import version
            versions[dist] = version(dist)
        except Exception:
            versions[dist] = None
    argv = [a if not a.startswith(("/tmp", "/root")) else "$OUT" for a in sys.argv[1:]]
    command = re.sub(r"--out \S+", "--out $OUT/fp8_accuracy",
                     " ".join(["python", "-m", "benchmarks.fp8_accuracy"] + argv))
    return {"machine": args.machine or machine, "device": device, "versions": versions,
            "command": command, "git": _git(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv=None) -> int:
    args = parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references must be float32
    rows: list[dict] = []
    start = time.monotonic()
    meta = meta_of(args)
    for D in args.d:
        case = Case(args.B, args.S, args.hq, args.hkv, D)
        for flavour in args.data:
            for vname in args.variants:
                rows += measure_case(args, case, vname, flavour, gen)
                out = records.write_record(args.out, rows, meta)  # after each case: a run cut short keeps its rows
                if args.device.type == "cuda":
                    torch.cuda.empty_cache()
    missed = [r for r in rows if not r["within_target"]]
    print(f"\nbenchmarks.fp8_accuracy: {len(rows)} rows in {time.monotonic() - start:.0f} s -> {out}; "
          f"{len(missed)} above {TARGET}× the plain FP8 reference")
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
