"""Sweep the flexjit Triton backend's block configurations on a GPU and report the fastest.

    export FLEXJIT_CACHE_DIR=/tmp/fjc && \
        python3 -m benchmarks.tune_triton --out OUT/tune

The sm90 entries of the tables in `flexjit/backends/triton/config.py` (`_FWD_TABLE`,
`_BWD_TABLE`) come from this sweep.
For every variant, S and pass this times the table's default (whatever `fwd_config`/`bwd_config`
resolve with no `kernel_options`) and then each grid entry below, passed as `kernel_options`:
- fwd: `FWD_GRID`, (BLOCK_M, BLOCK_N, num_warps, num_stages);
- fwdbwd: the forward stays at its default and `BWD_GRID` varies the backward,
  (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, bwd_num_warps, bwd_num_stages).
A grid entry that resolves to the default's config is not run twice. Shapes are run.py's
defaults: bf16, Hq = Hkv = 16, D = 128, B·S = 16384 tokens. Each config is checked once against
run.py's chunked fp32 reference (a wrong or non-finite one is recorded, not timed), then timed
with do_bench (short warm-up and repetition: each config is also a fresh Triton compile).
TFLOP/s count the mask's true density, as run.py does. A config that fails to compile or launch
is recorded with its error; `--budget-s` stops starting measurements and still writes the output.
Expect about 4 minutes on a fresh H200: 96 cold compiles of 1.5-2 s each (S=8k reuses S=2k's
binaries: the lengths are unspecialised arguments) and 192 short timings. The loop runs variant by
variant, so a sweep the budget cuts is finished by a second call with `--variants` the rest.

`--grid tma`: the default
against `TMA_FWD_GRID` / `TMA_BWD_GRID` (USE_TMA tensor descriptors, with a few
tiles and stage counts around them; the fwdbwd entries set both passes). `--torch` times torch's
compiled Flex-Triton on each case beside them, and the report gives default x torch and
best x torch per case. Expect a few minutes on a fresh H200 (one cold flexjit compile of 1.5-3 s
per entry, one torch compile per variant, pass and length: dynamic=False); `--budget-s` stops it
in time and a second call with `--variants` the rest (or `--passes` one pass) finishes it:

    python3 -m benchmarks.tune_triton --grid tma --torch --out OUT/tma --budget-s 270

DIR/tune_triton.json (meta and every row) is rewritten after each measurement; at the end
DIR/tune_triton.md holds, per pass, each case's best config beside the default and each config's
geometric-mean speedup over the default across cases (the tables are per arch and head dim, not
per variant), and is printed.

`--dry-run` runs on the CPU: it builds every variant, block mask and input at a tiny shape,
resolves every candidate config through the Triton backend's planner for sm_90 (no kernel is
compiled or launched), prints the planned measurements and writes both files.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import flexjit
from flexjit.api.attention import prepare_call
from flexjit.backends import triton as fj_triton_entry
from flexjit.backends.triton import prefill as fj_triton

from .impls import make as make_impl
from .impls import plan_mask
from .reference import check, mask_density
from .run import (FATAL_CUDA, Refs, call_once, environment, for_pass, make_inputs, make_step, parse_list,
                  parse_sizes, poison_allocator, rotation_count, time_ms)
from .variants import VARIANTS, Case, attention_flops, build, default_scale

DEFAULT_VARIANTS = ("full", "causal", "alibi", "sliding_window", "document", "softcap")
TOKENS, HEADS, HEAD_DIM = 16384, 16, 128
DRY_ARCH = 90  # the H200 the sweep is for
DRY_CASE = dict(B=2, S=256, H=2)  # two 128-blocks per row: every mask has a partial and a full block

# Around the sm90 D=128 default (128, 128, 8, 3): smaller tiles, fewer warps, 2-4 stages.
FWD_GRID = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3),
            (64, 128, 4, 3), (128, 128, 4, 2), (64, 64, 4, 3), (128, 64, 8, 4)]
# Around ours (32, 128, 128, 32, 8, 3) and torch Flex's 64-wide tiles.
BWD_GRID = [(32, 128, 128, 32, 8, 3), (64, 128, 128, 64, 8, 3), (64, 64, 64, 64, 4, 3),
            (64, 128, 128, 64, 8, 2), (32, 128, 128, 32, 4, 3), (64, 64, 64, 64, 8, 2),
            (32, 64, 64, 32, 4, 3), (64, 128, 128, 64, 4, 2)]
# --grid tma: TMA tensor descriptors and warp specialisation
# against the current default at its tiles, plus torch Flex-Triton's sm90 forward tile (128x64,
# 8 warps, 3 stages) and deeper pipelines, which TMA's cheaper loads may now afford. The
# fwdbwd entries set both passes (unprefixed keys), so the row is the end-to-end choice.
# Warp specialisation (WARP_SPECIALIZE) is refused on a GPU: its 4-warp TMA forward never
# finished on an H200 with Triton 3.6; the grid has TMA rows only.
TMA_FWD_GRID = [{"USE_TMA": 1},
                {"USE_TMA": 1, "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}]
TMA_BWD_GRID = [{"USE_TMA": 1},
                {"USE_TMA": 1, "BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32}]
# The variant list (the blocks grid's default omits prefix_lm).
TMA_VARIANTS = ("full", "causal", "sliding_window", "prefix_lm", "document", "alibi", "softcap")
FWD_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
BWD_KEYS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "bwd_num_warps", "bwd_num_stages")
BWD_BLOCKS = BWD_KEYS[:4]
TORCH_LABEL = "torch-flex-triton"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.tune_triton", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for tune_triton.json and tune_triton.md")
    p.add_argument("--S", default="2k,8k", help="sequence lengths (default 2k,8k); B = 16384 / S")
    p.add_argument("--variants", default=None,
                   help="default: " + ",".join(DEFAULT_VARIANTS) + " (--grid tma: " + ",".join(TMA_VARIANTS) + ")")
    p.add_argument("--passes", default="fwd,fwdbwd", help="fwd, fwdbwd or both (default both)")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="start no measurement after this many seconds (0: no limit)")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench warm-up (default 10)")
    p.add_argument("--rep-ms", type=float, default=40.0, help="do_bench repetition time (default 40)")
    p.add_argument("--grid", choices=("blocks", "tma"), default="blocks",
                   help="blocks: FWD_GRID/BWD_GRID (tile sweep); tma: TMA_FWD_GRID/TMA_BWD_GRID "
                        "(descriptors and warp specialisation against the default)")
    p.add_argument("--torch", action="store_true",
                   help="also time torch's compiled Flex-Triton (the same mods) per case, the "
                        "baseline: the report gives each config's ratio to it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU only: build everything at a tiny shape, print the plan, launch nothing")
    args = p.parse_args(argv)
    args.S = parse_sizes(args.S)
    if args.variants is None:
        args.variants = ",".join(TMA_VARIANTS if args.grid == "tma" else DEFAULT_VARIANTS)
    args.variants = parse_list(args.variants, VARIANTS)
    args.passes = parse_list(args.passes, ("fwd", "fwdbwd"))
    for S in args.S:
        if TOKENS % S:
            raise SystemExit(f"S={S} does not divide {TOKENS} tokens")
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: the sweep times Triton kernels (use --dry-run to check the plan)")
    args.device = torch.device("cpu" if args.dry_run else "cuda")
    return args


# ---- configurations ----------------------------------------------------------------------------


def grid_options(pass_: str, grid: str = "blocks") -> list[dict]:
    """The grid as kernel_options dicts, for the forward or (fwdbwd) the backward."""
    if grid == "tma":
        return [dict(o) for o in (TMA_FWD_GRID if pass_ == "fwd" else TMA_BWD_GRID)]
    keys, grid = (FWD_KEYS, FWD_GRID) if pass_ == "fwd" else (BWD_KEYS, BWD_GRID)
    return [dict(zip(keys, entry)) for entry in grid]


def resolved(q, k, v, variant, block_mask, pass_: str, opts: dict, arch: int) -> dict:
    """The config the kernel would be launched with: read off the Triton backend's own launch plan
    (meta tensors, nothing compiled), so a grid entry the planner refits or rejects shows here."""
    call = prepare_call(q, k, v, variant.score_mod, block_mask, None, False, opts)
    name = "flex_fwd" if pass_ == "fwd" else "flex_bwd"
    launches = {x.kernel: x for x in fj_triton.launches_for(call, arch)}
    launch = launches[name]
    blocks = FWD_KEYS[:2] if pass_ == "fwd" else BWD_BLOCKS
    cfg = {b: launch.constexprs[b] for b in blocks}
    cfg = {**cfg, "num_warps": launch.options["num_warps"], "num_stages": launch.options["num_stages"],
           "tma": launch.constexprs["USE_TMA"], "ws": launch.constexprs["WARP_SPEC"]}
    if pass_ == "fwdbwd":  # the forward it runs with: the row times both
        cfg["fwd_tma"] = launches["flex_fwd"].constexprs["USE_TMA"]
        cfg["fwd_ws"] = launches["flex_fwd"].constexprs["WARP_SPEC"]
    return cfg


def label(cfg: dict) -> str:
    """'128x128 w8 s3' (forward) or '32/128/128/32 w8 s3' (backward), then ' tma' / ' ws' where
    the kernel loads by tensor descriptors / is warp-specialised (fwdbwd: ' fwd:tma' etc. for
    its forward)."""
    blocks = "x".join(str(cfg[b]) for b in FWD_KEYS[:2]) if "BLOCK_M" in cfg \
        else "/".join(str(cfg[b]) for b in BWD_BLOCKS)
    flags = "".join(f" {n}" for n in ("tma", "ws") if cfg.get(n))
    flags += "".join(f" fwd:{n}" for n in ("tma", "ws") if cfg.get("fwd_" + n))
    return f"{blocks} w{cfg['num_warps']} s{cfg['num_stages']}{flags}"


def candidates(q, k, v, variant, block_mask, pass_: str, arch: int,
               grid: str = "blocks") -> list[tuple[dict, dict, bool]]:
    """(kernel_options, resolved config, is the default) per measurement: the default first, then
    the grid without entries that resolve to a config already listed."""
    out, seen = [], set()
    for opts in [{}] + grid_options(pass_, grid):
        try:
            cfg = resolved(q, k, v, variant, block_mask, pass_, opts, arch)
        except Exception as e:  # e.g. kernel_options the planner refuses (a block not dividing the mask's)
            out.append((opts, {"error": f"{type(e).__name__}: {e}"}, False))
            continue
        if label(cfg) not in seen:
            seen.add(label(cfg))
            out.append((opts, cfg, not opts))
    return out


# ---- one measurement ---------------------------------------------------------------------------


def make_fn(variant, block_mask, opts: dict):
    score_mod = variant.score_mod

    def fn(q, k, v):
        return flexjit.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                      kernel_options=opts, backend="triton")

    return fn


def measure(fn, sets: list[dict], pass_: str, case: Case, refs: Refs, args) -> dict:
    """Check once, then time; never raises. ms, first_call_s, stages_ran (kernels whose launch fell
    back to fewer pipeline stages for shared memory, see triton._run) and check, or error."""
    fj_triton._STAGES_THAT_FIT.clear()  # forget earlier configs' fallbacks: this first call shows its own
    fj_triton.WS_REFUSED.clear()
    poison_allocator(case, args.device)
    t0 = time.perf_counter()
    try:
        got = call_once(fn, sets[0], pass_, "bhsd")
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:600]}
    res = {"first_call_s": round(time.perf_counter() - t0, 2)}
    fell_back = {key[1]: n for key, n in fj_triton._STAGES_THAT_FIT.items() if n != dict(key[3])["num_stages"]}
    if fell_back:
        res["stages_ran"] = fell_back
    if fj_triton.WS_REFUSED:  # a WARP_SPECIALIZE build Triton could not lower ran unspecialised
        res["ws_refused"] = sorted({key[1] for key in fj_triton.WS_REFUSED})
    try:
        verdict = check(got, *refs.pair())
    except Exception as e:
        return {**res, "error": f"reference: {type(e).__name__}: {e}"[:600]}
    del got
    res["check"] = {n: float(f"{d['rel']:.3g}") for n, d in verdict.detail.items()}  # relative L2 errors
    if not verdict.ok:
        return {**res, "error": f"wrong: {verdict.message}"}
    try:
        with torch.set_grad_enabled(pass_ == "fwdbwd"):
            res["ms"] = time_ms(make_step(fn, sets, pass_), args.device, args.warmup_ms, args.rep_ms)
    except Exception as e:
        return {**res, "error": f"timing: {type(e).__name__}: {e}"[:600]}
    return res


# ---- the sweep ---------------------------------------------------------------------------------


class Sweep:
    """Rows so far, the budget and a lost CUDA context, across cases."""

    def __init__(self, args, meta: dict, out: Path):
        self.args, self.meta, self.out = args, meta, out
        self.start = time.monotonic()
        self.gen = torch.Generator().manual_seed(args.seed)
        self.arch = DRY_ARCH if args.dry_run else fj_triton.arch_number(args.device)
        self.rows: list[dict] = []
        self.fatal = None

    def reason_not_to_run(self) -> str | None:
        if self.fatal:
            return f"skipped: CUDA context lost earlier ({self.fatal})"
        if self.args.budget_s and time.monotonic() - self.start > self.args.budget_s:
            return f"skipped: time budget of {self.args.budget_s:g} s spent"
        return None

    def run_case(self, vname: str, S: int) -> None:
        """Every pass and candidate of one (variant, S); inputs and references made once."""
        args, dev = self.args, self.args.device
        case = Case(TOKENS // S, S, HEADS, HEADS, HEAD_DIM)
        built = case if not args.dry_run else Case(DRY_CASE["B"], DRY_CASE["S"], DRY_CASE["H"],
                                                    DRY_CASE["H"], HEAD_DIM)
        base = {"variant": vname, "S": S, "B": case.B}
        reason = self.reason_not_to_run()
        if not reason:
            try:
                variant, block_mask, density, sets = self.setup(vname, built)
            except Exception as e:
                reason = f"case setup: {type(e).__name__}: {e}"[:600]
        if reason:
            for pass_ in args.passes:
                self.record({**base, "pass": pass_, "label": None, "error": reason})
            return
        # One reference per case: the fwdbwd one's "out" serves the forward's check too.
        refs = Refs(sets[0], variant, default_scale(built), "fwdbwd" if "fwdbwd" in args.passes else "fwd",
                    built.dtype)
        q, k, v = (sets[0][n].detach() for n in "qkv")
        for pass_ in args.passes:
            flops = attention_flops(case, density, pass_)
            pass_sets = for_pass(sets, pass_)
            if args.torch:
                self.measure_torch(base, pass_, variant, built, pass_sets, refs, flops, density)
            for opts, cfg, is_default in candidates(q, k, v, variant, block_mask, pass_, self.arch,
                                                    args.grid):
                name = label(cfg) if "error" not in cfg else " ".join(f"{n}={x}" for n, x in opts.items())
                row = {**base, "pass": pass_, "label": name,
                       "options": opts, "config": cfg, "default": is_default, "density": density,
                       "flops": flops}
                if "error" in cfg:
                    res = {"error": f"planner: {cfg['error']}"}
                elif args.dry_run:
                    res = {"error": "dry run: not launched"}
                else:
                    reason = self.reason_not_to_run()
                    res = {"error": reason} if reason else \
                        measure(make_fn(variant, block_mask, opts), pass_sets, pass_, built, refs, args)
                if res.get("ws_refused"):
                    row["label"] += " [ws refused: " + ",".join(res["ws_refused"]) + "]"
                self.record({**row, **res})
        del sets, refs
        if dev.type == "cuda" and not self.fatal:
            torch.cuda.empty_cache()

    def measure_torch(self, base, pass_, variant, case, pass_sets, refs, flops, density) -> None:
        """torch's compiled Flex-Triton on the same case and inputs (its own block mask), checked
        and timed like a config; the markdown's baseline column."""
        row = {**base, "pass": pass_, "label": TORCH_LABEL, "options": None, "config": {},
               "default": False, "baseline": True, "density": density, "flops": flops}
        reason = self.reason_not_to_run()
        if reason or self.args.dry_run:
            self.record({**row, "error": reason or "dry run: not launched"})
            return
        try:
            fn = make_impl("torch-flex-triton").setup(variant, case, self.args.device)
        except Exception as e:
            self.record({**row, "error": f"setup: {type(e).__name__}: {e}"[:600]})
            return
        self.record({**row, **measure(fn, pass_sets, pass_, case, refs, self.args)})

    def setup(self, vname: str, case: Case):
        """The variant, flexjit's block mask, the mask's exact density and the rotating inputs."""
        dev = self.args.device
        variant = build(vname, case, dev, self.gen)
        block_mask = plan_mask(flexjit.create_block_mask, variant, case, dev)
        density = mask_density(variant, case.B, case.Hq, case.S, dev)
        sets = make_inputs(case, dev, rotation_count(case, dev, self.meta.get("l2_bytes")))
        return variant, block_mask, density, sets

    def record(self, row: dict) -> None:
        row.setdefault("ms", None)
        row.setdefault("error", None)
        row["tflops"] = row["flops"] / row["ms"] / 1e9 if row["ms"] else None
        if row["error"] and any(m in row["error"] for m in FATAL_CUDA):
            self.fatal = f"{row['variant']} S={row['S']} {row['pass']} {row['label']}"
        self.rows.append(row)
        print(row_line(row), flush=True)
        (self.out / "tune_triton.json").write_text(json.dumps({"meta": self.meta, "rows": self.rows}, indent=1))


def row_line(r: dict) -> str:
    head = f"{r['pass']:6} {r['variant']:14} S={r['S']:<5} {r['label'] or '-':22} {'*' if r.get('default') else ' '}"
    if r["ms"]:
        return f"{head} {r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s  (first call {r['first_call_s']:.1f} s)"
    return f"{head} {r['error']}"


# ---- the report --------------------------------------------------------------------------------


def markdown(rows: list[dict], meta: dict) -> str:
    """Per pass: each case's best config beside the default, then each config across cases."""
    lines = [f"# flexjit Triton config sweep, {meta.get('gpu')} ({meta.get('date')})", "",
             f"`{meta.get('command')}` · git {meta.get('git')} · torch {meta.get('torch')} · "
             f"triton {meta.get('triton')} · bf16, Hq=Hkv={HEADS}, D={HEAD_DIM}, {TOKENS} tokens · "
             "TFLOP/s on the mask's true density. default: the config the current tables give "
             "(no kernel_options).", ""]
    for pass_ in dict.fromkeys(r["pass"] for r in rows):
        prow = [r for r in rows if r["pass"] == pass_]
        what = "forward" if pass_ == "fwd" else \
            "forward + backward (blocks grid: forward at its default, backward varied; tma grid: both)"
        lines += [f"## {pass_}: {what}", "",
                  "| variant | S | default | TFLOP/s | best | TFLOP/s | x default | torch Flex-Triton "
                  "| default x torch | best x torch |", "|---|---|---|---|---|---|---|---|---|---|"]
        cases = defaultdict(list)
        for r in prow:
            cases[(r["variant"], r["S"])].append(r)
        speedups = defaultdict(dict)  # label -> {case: tflops / default tflops}
        vs_torch = defaultdict(dict)  # label -> {case: tflops / torch Flex-Triton's}
        for (vname, S), rs in cases.items():
            torch_row = next((r for r in rs if r.get("baseline")), None)
            rs = [r for r in rs if not r.get("baseline")]
            ok = [r for r in rs if r["tflops"]]
            dflt = next((r for r in rs if r.get("default")), None)
            best = max(ok, key=lambda r: r["tflops"], default=None)
            d_tf = dflt["tflops"] if dflt else None
            t_tf = torch_row["tflops"] if torch_row else None
            ratio = f"{best['tflops'] / d_tf:.3f}" if best and d_tf else "-"
            d_t = f"{d_tf / t_tf:.3f}" if d_tf and t_tf else "-"
            b_t = f"{best['tflops'] / t_tf:.3f}" if best and t_tf else "-"
            t_cell = f"{t_tf:.0f}" if t_tf else (torch_row["error"][:40] if torch_row else "-")
            lines.append(f"| {vname} | {S} | {_cell(dflt)} | {_cell(best)} | {ratio} | {t_cell} | {d_t} | {b_t} |")
            for r in ok:
                if d_tf:
                    speedups[r["label"]][(vname, S)] = r["tflops"] / d_tf
                if t_tf:
                    vs_torch[r["label"]][(vname, S)] = r["tflops"] / t_tf
        tried = defaultdict(lambda: [0, 0])  # label -> [measured, failed]
        for r in prow:
            if r["label"] and not (r["error"] or "").startswith(("skipped", "dry run")):
                tried[r["label"]][0 if r["tflops"] else 1] += 1
        lines += ["", "| config | geomean x default | worst | best | cases | failed | worst x torch |",
                  "|---|---|---|---|---|---|---|"]
        by_geo = sorted(speedups.items(), key=lambda kv: -_geomean(kv[1].values()))
        for lab, per_case in by_geo:
            xs = list(per_case.values())
            wt = f"{min(vs_torch[lab].values()):.3f}" if vs_torch.get(lab) else "-"
            lines.append(f"| {lab} | {_geomean(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} | {len(xs)} | "
                         f"{tried[lab][1]} | {wt} |")
        for lab, (n_ok, n_bad) in tried.items():
            if lab not in speedups:
                lines.append(f"| {lab} | - | - | - | {n_ok} | {n_bad} |")
        errors = [r for r in prow if r["error"] and not r["error"].startswith(("skipped", "dry run"))]
        if errors:
            lines += ["", "Failures:", ""]
            lines += [f"- {r['variant']} S={r['S']} {r['label']}: {r['error'][:200]}" for r in errors]
        skipped = sum(1 for r in prow if (r["error"] or "").startswith("skipped"))
        if skipped:
            lines += ["", f"{skipped} measurements skipped (budget or lost context): see the JSON."]
        lines.append("")
    return "\n".join(lines)


def _cell(r: dict | None) -> str:
    """'label | TFLOP/s' of a row, dashes where it has none."""
    if r is None:
        return "- | -"
    return f"{r['label'] or '-'} | {r['tflops']:.0f}" if r["tflops"] else f"{r['label'] or '-'} | -"


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    meta = environment(args)
    meta["command"] = " ".join(["python3", "-m", "benchmarks.tune_triton"] + sys.argv[1:])
    meta["dry_run"] = args.dry_run
    print("benchmarks.tune_triton:", json.dumps(meta), flush=True)
    sweep = Sweep(args, meta, out)
    meta["arch"] = sweep.arch
    for vname in args.variants:
        for S in args.S:
            sweep.run_case(vname, S)
    text = markdown(sweep.rows, meta)
    (out / "tune_triton.md").write_text(text)
    print(f"\nbenchmarks.tune_triton: {len(sweep.rows)} rows in {time.monotonic() - sweep.start:.0f} s -> {out}\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
