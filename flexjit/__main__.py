"""Command line: `flexjit demo` (or `python -m flexjit demo`)."""
from __future__ import annotations

import argparse
import sys


def _seq_len(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 128:
        raise argparse.ArgumentTypeError(f"{value} is too short: the demo needs at least 128 tokens")
    return value


def main(argv=None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="flexjit", description="flexjit: custom attention, compiled")
    parser.add_argument("--version", action="version", version=f"flexjit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile ALiBi, sliding window, document and softcap here and check them")
    demo.add_argument("--seq-len", type=_seq_len, default=None,
                      help="sequence length, at least 128 (default: 4096 GPU, 1024 CPU)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo
        rows = run_demo(args.seq_len)
        return 0 if all(r["max_err"] < 5e-2 for r in rows) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
