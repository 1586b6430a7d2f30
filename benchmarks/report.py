"""Turn result rows into results.md (TFLOP/s table, flexjit's ratio to the best baseline) and results.png.

Also a command to merge the results.json of several runs into one report:
    python -m benchmarks.report RUN_DIR_OR_JSON [...] --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from .impls import BASELINE_IMPLS, EXTRA_IMPLS, FLEXJIT_FP8_MODES, FLEXJIT_IMPLS, FP8_IMPLS
from .variants import VARIANTS

COLUMNS = FLEXJIT_IMPLS + BASELINE_IMPLS + EXTRA_IMPLS
# The bf16 baselines: neither flexjit's modes nor FP8 inputs (an FP8 row is not a bf16 yardstick).
BASELINES = tuple(c for c in BASELINE_IMPLS + EXTRA_IMPLS
                  if not c.startswith("flexjit") and c not in FP8_IMPLS)
# FP8 flexjit impls get their speed over the same backend's bf16 row: what FP8 inputs buy.
FP8_OVER_BF16 = {name: f"flexjit-{backend}" for name, (backend, _) in FLEXJIT_FP8_MODES.items()}
CASE_KEYS = ("pass", "Hkv", "D", "Dv", "variant", "S", "B", "Hq", "dtype")
CELL = {"wrong": "wrong", "error": "err", "skipped": "–"}


def _s(S: int) -> str:
    return f"{S // 1024}k" if S % 1024 == 0 else str(S)


def dims(r: dict) -> str:
    """The head dims as the tables name them: "128", or q/k over v ("192/128")."""
    dv = row_value(r, "Dv")
    return str(r["D"]) if dv == r["D"] else f"{r['D']}/{dv}"


def row_value(r: dict, k: str):
    """A row's field ``k``; rows from before v's own head dim was recorded have Dv = D."""
    return r.get("Dv", r["D"]) if k == "Dv" else r[k]


def _tf(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def row_line(r: dict) -> str:
    """One printed line per measurement."""
    head = (f"{r['pass']:6} {r['variant']:14} S={_s(r['S']):>3} B={r['B']:<2} Hkv={r['Hkv']:<2} "
            f"D={dims(r):<3} {r['impl']:18}")
    if r["status"] == "ok":
        return f"{head} {r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s  (first call {r.get('first_call_s', 0):.1f} s)"
    return f"{head} {r['status'].upper():7} {r['error']}"


def _cases(rows):
    """Rows grouped by case: fwd before fwdbwd, then Hkv (MHA first), D, variant, S."""
    groups = defaultdict(dict)
    for r in rows:
        groups[tuple(row_value(r, k) for k in CASE_KEYS)][r["impl"]] = r

    def order(key):
        pass_, hkv, d, dv, variant, S = key[:6]
        return (pass_ != "fwd", -hkv, d, dv, VARIANTS.index(variant) if variant in VARIANTS else 99, S)

    return {k: groups[k] for k in sorted(groups, key=order)}


def best_baseline(by_impl: dict):
    ok = [r for n, r in by_impl.items() if n in BASELINES and r["status"] == "ok"]
    return max(ok, key=lambda r: r["tflops"]) if ok else None


def table(rows: list[dict]) -> str:
    """Markdown tables of TFLOP/s, one per (pass, Hkv, D), with flexjit / best baseline."""
    present = {r["impl"] for r in rows}
    impls = [c for c in COLUMNS if c in present]
    fj = [c for c in FLEXJIT_IMPLS if c in present]
    fp8 = [c for c, bf16 in FP8_OVER_BF16.items() if c in present and bf16 in present]
    head = ["variant", "S", "B", "density"] + impls + ["best baseline"] + [f"{c.removeprefix('flexjit-')} / best" for c in fj]
    head += [f"{c.removeprefix('flexjit-')} / {FP8_OVER_BF16[c].removeprefix('flexjit-')}" for c in fp8]
    out, current = [], None
    for key, by_impl in _cases(rows).items():
        pass_, hkv = key[:2]
        some = next(iter(by_impl.values()))
        if key[:4] != current:
            current = key[:4]
            out += ["", f"**{pass_}**, Hq={some['Hq']}, Hkv={hkv}, D={dims(some)}, {some['dtype']}, TFLOP/s "
                        f"on the mask's true density ({'2' if pass_ == 'fwd' else '7'}·B·Hq·S²·(D+Dv)·density)", "",
                    "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        dens = next((r["density"] for r in by_impl.values() if r.get("density") is not None), None)
        cells = [some["variant"], _s(some["S"]), str(some["B"]), "–" if dens is None else f"{dens:.3f}"]
        for c in impls:
            r = by_impl.get(c)
            cells.append("" if r is None else _tf(r["tflops"]) if r["status"] == "ok" else CELL[r["status"]])
        best = best_baseline(by_impl)
        cells.append(f"{best['impl']} {_tf(best['tflops'])}" if best else "–")
        for c in fj:
            r = by_impl.get(c)
            ok = best and r is not None and r["status"] == "ok"
            cells.append(f"{r['tflops'] / best['tflops']:.2f}×" if ok else "–")
        for c in fp8:
            r, b = by_impl.get(c), by_impl.get(FP8_OVER_BF16[c])
            ok = r is not None and b is not None and r["status"] == b["status"] == "ok"
            cells.append(f"{r['tflops'] / b['tflops']:.2f}×" if ok else "–")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out).lstrip("\n")


def notes(rows: list[dict]) -> str:
    """Every row that was not timed, grouped by impl and reason."""
    groups = defaultdict(list)
    several = len({(r["Hkv"], dims(r)) for r in rows}) > 1  # then name Hkv and D too
    for r in rows:
        if r["status"] != "ok":
            where = f"{r['pass']} {r['variant']} {_s(r['S'])}" + (f" Hkv={r['Hkv']} D={dims(r)}" if several else "")
            groups[(r["impl"], r["status"], r["error"][:400])].append(where)
    if not groups:
        return "All measurements ran and passed the check."
    lines = ["Not timed (– skipped, err error, wrong: failed the check against the reference):"]
    for (impl, status, err), where in groups.items():
        shown = ", ".join(where[:6]) + (f", … ({len(where)} cases)" if len(where) > 6 else "")
        lines.append(f"- {impl} [{status}] {shown}: {err}")
    return "\n".join(lines)


def markdown(rows: list[dict], env: dict) -> str:
    env_line = ", ".join(f"{k} {v}" for k, v in env.items() if v is not None and k not in ("command", "date", "gpu"))
    return "\n".join([
        f"# flexjit benchmarks, {env.get('gpu')}, {env.get('date')}", "",
        f"Command: `{env.get('command')}`", "", f"Environment: {env_line}", "",
        "Each implementation's output (and, for fwdbwd, dq/dk/dv) was checked against a chunked fp32 "
        "reference before timing; median of `triton.testing.do_bench`. "
        "`x / best`: flexjit's TFLOP/s over the best bf16 baseline's for the same case; "
        "`cute-fp8 / cute`: the FP8-input row's TFLOP/s over the same backend's bf16 row. FP8 rows "
        "(e4m3 q, k, v, per-(batch, kv head) descales, bf16 out) are checked against the attention "
        "of the values they hold.", "",
        table(rows), "", notes(rows), ""])


def plot(rows: list[dict], path: Path) -> str:
    """Grouped bars of TFLOP/s, one panel per (pass, Hkv, D); returns what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"no chart: matplotlib does not import ({type(e).__name__}: {e})"
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return "no chart: no timed rows"
    panels = sorted({(r["pass"], r["Hkv"], dims(r)) for r in ok},
                    key=lambda p: (p[0] != "fwd", -p[1], [int(x) for x in p[2].split("/")]))
    impls = [c for c in COLUMNS if any(r["impl"] == c for r in ok)]
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(max(8.0, 0.9 * len({(r['variant'], r['S']) for r in ok}) + 3), 3.6 * len(panels)))
    width = 0.8 / len(impls)
    for ax, (pass_, hkv, d) in zip(axes[:, 0], panels):
        mine = [r for r in ok if (r["pass"], r["Hkv"], dims(r)) == (pass_, hkv, d)]
        groups = sorted({(r["variant"], r["S"]) for r in mine},
                        key=lambda g: (VARIANTS.index(g[0]) if g[0] in VARIANTS else 99, g[1]))
        for i, impl in enumerate(impls):
            val = {(r["variant"], r["S"]): r["tflops"] for r in mine if r["impl"] == impl}
            xs = [g for g, key in enumerate(groups) if key in val]
            if xs:  # one colour per impl in every panel
                ax.bar([x + (i - (len(impls) - 1) / 2) * width for x in xs], [val[groups[x]] for x in xs],
                       width, label=impl, color=f"C{i}")
        ax.set_xticks(range(len(groups)), [f"{v}\n{_s(S)}" for v, S in groups], fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{pass_}, Hkv={hkv}, D={d}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=min(4, len(impls)))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"chart: {path}"


def write(rows: list[dict], env: dict, out: Path, png: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "results.md").write_text(markdown(rows, env))
    if png:
        print(plot(rows, out / "results.png"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="results.json files or the run folders holding them")
    p.add_argument("--out", required=True)
    p.add_argument("--no-png", action="store_true")
    args = p.parse_args(argv)
    rows, envs = [], []
    for item in map(Path, args.inputs):
        folder = item if item.is_dir() else item.parent
        rows += json.loads((item / "results.json" if item.is_dir() else item).read_text())
        meta = folder / "meta.json"
        envs.append(json.loads(meta.read_text()) if meta.exists() else {})
    env = envs[0] if len(envs) == 1 else {
        "date": ", ".join(sorted({e.get("date", "?") for e in envs})),
        "gpu": ", ".join(sorted({e.get("gpu", "?") for e in envs})),
        "command": " ; ".join(e.get("command", "?") for e in envs)}
    write(rows, env, Path(args.out), png=not args.no_png)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
