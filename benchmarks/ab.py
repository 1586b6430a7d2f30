"""An A/B of source trees: ``benchmarks.run`` from each tree in turn, run after run, so that the
GPU's drift between runs hits every tree alike, and one table of the ranges.

    git worktree add /tmp/before main                # or: git archive ... | tar -x -C /tmp/before
    python -m benchmarks.ab --tree main=/tmp/before --tree new=. --runs 3 --out OUT -- \\
        --S 8k --hkv 4 --d 64,128 --variants full,causal --passes fwd --impls flexjit-cute,fa4

Everything after ``--`` goes to ``benchmarks.run`` (not ``--out``). Each run imports flexjit, its
kernels (``templates/``, as the tree's pyproject maps them, whatever is installed) and the
benchmarks from its own tree, in a child process with a kernel cache per tree
(``OUT/cache-NAME``), so a tree compiles its kernels once. Implementations that are not flexjit's
(the baselines) run in the first tree's first run only. ``OUT/NAME-i/`` holds each run's output;
``OUT/ab.md`` the table: per case, each flexjit row's TFLOP/s over the runs (lowest-highest) per
tree, and the baselines'.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

from .sass_identity import _THIS_TREE

_CHILD = textwrap.dedent('''
    import os, runpy, sys
    tree = sys.argv[1]
    # {this tree}
    import flexjit, flexjit.templates
    print("benchmarks.ab: flexjit from", os.path.dirname(flexjit.__file__), "kernels from",
          list(flexjit.templates.__path__)[0], flush=True)
    sys.argv = ["benchmarks.run"] + sys.argv[2:]
    runpy.run_module("benchmarks.run", run_name="__main__", alter_sys=True)
''').replace("# {this tree}", _THIS_TREE)

CASE = ("pass", "variant", "S", "Hkv", "D", "Dv")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                   help="a source tree (flexjit/, templates/, benchmarks/); two or more")
    p.add_argument("--runs", type=int, default=3, help="runs per tree (default 3)")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout-s", type=float, default=None, help="per run (default: none)")
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then benchmarks.run's flags")
    args = p.parse_args(argv)
    trees = {}
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        if not sep or not name or not all(c.isalnum() or c in "_-." for c in name):
            p.error(f"--tree takes NAME=PATH with a plain name, got {spec!r}")
        if not (Path(path) / "benchmarks" / "run.py").is_file() or not (Path(path) / "templates").is_dir():
            p.error(f"{path} holds no benchmarks/run.py and templates/: not a flexjit source tree")
        if name in trees:
            p.error(f"tree name {name!r} given twice")
        trees[name] = str(Path(path).resolve())
    if len(trees) < 2:
        p.error("an A/B needs two trees or more")
    rest = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    if "--out" in rest:
        p.error("--out after -- : each run's folder is OUT/NAME-i")
    args.trees, args.run_args = trees, rest
    return args


def _impls(run_args: list[str]) -> list[str] | None:
    if "--impls" in run_args:
        return run_args[run_args.index("--impls") + 1].split(",")
    return None


def _with_impls(run_args: list[str], impls: list[str]) -> list[str]:
    if "--impls" in run_args:
        i = run_args.index("--impls")
        return run_args[:i] + ["--impls", ",".join(impls)] + run_args[i + 2:]
    return run_args + ["--impls", ",".join(impls)]


def _revision(path: str, name: str) -> str:
    """The tree's commit where it is a git checkout of its own (a worktree), else its name."""
    if (Path(path) / ".git").exists():
        res = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True)
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip() + ("+changes" if subprocess.run(
                ["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                capture_output=True, text=True).stdout.strip() else "")
    return f"tree {name}"


def plan(args) -> list[tuple[str, int, list[str]]]:
    """(tree, run, benchmarks.run flags) in the order they run: run 1 of every tree, then run 2,
    ...; the baselines in the very first only."""
    impls = _impls(args.run_args)
    if impls is None:
        from .run import parse_args as run_parse
        impls = run_parse(args.run_args + ["--out", os.devnull, "--device", "cpu"]).impls
    ours = [i for i in impls if i.startswith("flexjit")]
    if not ours:
        raise SystemExit("--impls names no flexjit implementation: nothing to compare")
    steps = []
    for run in range(1, args.runs + 1):
        for n, name in enumerate(args.trees):
            first = run == 1 and n == 0
            steps.append((name, run, _with_impls(args.run_args, impls if first else ours)))
    return steps


def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def table(rows_by_run: dict) -> str:
    """Markdown: a line per case and implementation, flexjit's per tree (lowest-highest over
    the runs), the baselines' in their own column; a row not timed shows its status."""
    cells = defaultdict(lambda: defaultdict(list))
    trees = []
    for (tree, _run), rows in rows_by_run.items():
        if tree not in trees:
            trees.append(tree)
        for r in rows:
            col = tree if r["impl"].startswith("flexjit") else "baseline"
            key = tuple(r.get(k) for k in CASE) + (r["impl"],)
            ok = r.get("status") == "ok" and r.get("tflops") is not None
            cells[key][col].append(r["tflops"] if ok else r.get("status", "?"))
    head = "| pass | variant | S | Hkv | D | impl | " + " | ".join(trees + ["baseline"]) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key in sorted(cells, key=lambda k: tuple(str(x) for x in k)):
        p, variant, S, hkv, d, dv, impl = key
        dims = str(d) if d == dv else f"{d}/{dv}"
        vals = []
        for col in trees + ["baseline"]:
            got = cells[key].get(col, [])
            nums = sorted(x for x in got if isinstance(x, float))
            lo, hi = (_num(nums[0]), _num(nums[-1])) if nums else ("", "")
            text = lo if lo == hi else f"{lo}-{hi}"
            vals.append(" ".join([text] + [x for x in got if isinstance(x, str)]).strip())
        lines.append(f"| {p} | {variant} | {S} | {hkv} | {dims} | {impl} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_by_run, failed = {}, []
    for tree, run, flags in plan(args):
        folder = out / f"{tree}-{run}"
        env = dict(os.environ, FLEXJIT_CACHE_DIR=str(out / f"cache-{tree}"),
                   FLEXJIT_GIT_SHA=_revision(args.trees[tree], tree),
                   PYTHONPATH=os.pathsep.join([args.trees[tree]] + [p for p in os.environ.get(
                       "PYTHONPATH", "").split(os.pathsep) if p]))
        print(f"benchmarks.ab: {tree} run {run}: benchmarks.run {' '.join(flags)}", flush=True)
        try:
            res = subprocess.run([sys.executable, "-c", _CHILD, args.trees[tree], *flags,
                                  "--out", str(folder)], env=env, cwd=str(out),
                                 timeout=args.timeout_s)
            code = res.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        results = folder / "results.json"
        if code != 0 or not results.exists():
            failed.append(f"{tree} run {run}: exit {code}")
        if results.exists():
            rows_by_run[tree, run] = json.loads(results.read_text())
    text = table(rows_by_run) + "".join(f"\n- {f}" for f in failed)
    (out / "ab.md").write_text(text + "\n")
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
