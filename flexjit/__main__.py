"""Command line: `flexjit demo` (or `python -m flexjit demo`)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flexjit", description="flexjit: custom attention, compiled")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile ALiBi, sliding window, document and softcap here and check them")
    demo.add_argument("--seq-len", type=int, default=None, help="sequence length (default: 4096 GPU, 1024 CPU)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo
        rows = run_demo(args.seq_len)
        return 0 if all(r["max_err"] < 5e-2 for r in rows) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
