"""Command line: `flexjit demo`, `flexjit compile`, `flexjit warmup` (or `python -m flexjit ...`)."""
from __future__ import annotations

import argparse
import sys

import torch

import flexjit
from flexjit.demo import run_demo
from flexjit.integrations.aot import VARIANTS, compile_variant


def _seq_len(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 128:
        raise argparse.ArgumentTypeError(f"{value} is too short: the demo needs at least 128 tokens")
    return value


def _passes(text: str) -> tuple:
    passes = tuple(p.strip() for p in text.split(",") if p.strip())
    if not passes or any(p not in ("fwd", "bwd") for p in passes):
        raise argparse.ArgumentTypeError(f"{text!r}: give fwd, bwd or fwd,bwd")
    return passes


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def _compile(parser, args) -> int:
    try:
        kernels = compile_variant(
            args.variant, arch=args.arch, head_dim=args.head_dim, head_dim_v=args.head_dim_v,
            dtype=_DTYPES[args.dtype],
            passes=args.passes,
            seq_len=args.seq_len, heads=args.heads, kv_heads=args.kv_heads,
            deterministic=args.deterministic, out=args.out, log=lambda line: print(line, flush=True),
            kernel_options={"AUTOTUNE": False} if args.no_autotune else None)
    except ValueError as e:
        parser.error(str(e))
    print(f"{len(kernels)} kernels for {args.arch} ({args.variant})")
    return 0


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give lengths such as 4096 or 4096,8192") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive lengths such as 4096,8192")
    return values


def _warmup(parser, args) -> int:
    try:  # here, not at the top: transformers takes seconds to import, and only this needs it
        import transformers
        import flexjit.integrations.transformers  # noqa: F401  (registers "flexjit")
    except ImportError as e:
        parser.error(f"flexjit warmup --model needs transformers: {e}")
    try:
        cfg = transformers.AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        parser.error(f"cannot read a transformers config from {args.model!r}: {e}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    summary = flexjit.warmup_model(cfg, args.seq_len, args.batch, dtype,
                                   requires_grad=not args.inference)
    for line in summary.skipped:
        print(f"skipped: {line}")
    print(summary)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flexjit", description="flexjit: custom attention, compiled")
    parser.add_argument("--version", action="version", version=f"flexjit {flexjit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile ALiBi, sliding window, document and softcap here and check them")
    demo.add_argument("--seq-len", type=_seq_len, default=None,
                      help="sequence length, at least 128 (default: 4096 GPU, 1024 CPU)")
    aot = sub.add_parser("compile", help="compile a built-in variant's CuTe kernels ahead of time, "
                         "without a GPU: PTX and cubin to --out, kernels into the disk cache")
    aot.add_argument("--arch", required=True, choices=("sm_90a", "sm_100a"))
    aot.add_argument("--variant", required=True, choices=VARIANTS)
    aot.add_argument("--head-dim", type=int, default=128)
    aot.add_argument("--head-dim-v", type=int, default=None, help="default: --head-dim")
    aot.add_argument("--pass", dest="passes", type=_passes, default=None,
                     help="fwd, bwd or fwd,bwd (default; fwd for --dtype fp8)")
    aot.add_argument("--dtype", choices=("bf16", "fp16", "fp8"), default="bf16",
                     help="fp8: float8_e4m3fn q, k, v (the sm90 forward, bf16 out)")
    aot.add_argument("--seq-len", type=int, default=8192,
                     help="the run's length: picks the forward's tiling as a run does (default 8192)")
    aot.add_argument("--heads", type=int, default=16)
    aot.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    aot.add_argument("--deterministic", action="store_true",
                     help="the backward for torch.use_deterministic_algorithms(True)")
    aot.add_argument("--out", required=True, help="folder for the PTX and cubin files")
    aot.add_argument("--no-autotune", action="store_true",
                     help="only the heuristic's forward configuration (kernel_options AUTOTUNE=False), "
                          "not every candidate the run's tuner measures")
    warm = sub.add_parser("warmup", help="compile, in parallel, the CuTe kernels a transformers "
                          "model will need into the disk cache, so its first step starts warm")
    warm.add_argument("--model", required=True,
                      help="a transformers config: a folder or config.json, or a hub name")
    warm.add_argument("--seq-len", type=_lengths, required=True,
                      help="the lengths its steps run at, e.g. 4096 or 4096,8192")
    warm.add_argument("--batch", type=int, default=1)
    warm.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    warm.add_argument("--inference", action="store_true", help="forward kernels only")
    args = parser.parse_args(argv)
    if args.command == "warmup":
        return _warmup(parser, args)
    if args.command == "compile":
        return _compile(parser, args)
    if args.command == "demo":
        rows = run_demo(args.seq_len)
        return 0 if all(r["max_err"] < 5e-2 for r in rows) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
