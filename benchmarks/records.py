"""Benchmark records: one current record per capability and machine.

A record is a folder ``benchmarks/results/<machine>/<capability>/`` with exactly three files:

- ``results.json``: a list of rows, copied unchanged from the benchmarks' own outputs (one
  benchmark's row format per run; several runs may be merged, each a contiguous slice).
- ``meta.json``: what produced them (``REQUIRED_META``): the machine, the newest run's date and
  git commit, the software versions, the row format, and ``runs``: for each source run its
  exact command, date, commit and the slice ``[start, stop)`` of results.json it gave; an
  optional ``note``.
- ``results.md``: tables generated from the other two (``python -m benchmarks.records md DIR``);
  never edited by hand.

README's performance tables are generated from the records too, between marker lines
``<!-- records:begin NAME -->`` and ``<!-- records:end NAME -->`` (NAME in ``README_TABLES``):
``python -m benchmarks.records readme [--check] [README.md]``.

Other scripts write a record with ``write_record(dir, rows, meta)``; ``read_output(path)`` reads
what a benchmark wrote (see ``FORMATS``) and ``meta_from_output`` turns its meta into a record's:

    rows, meta = read_output("/path/to/run")            # a benchmarks.run --out folder
    write_record("benchmarks/results/h200/prefill", rows, meta_from_output(meta, "prefill", "h200"))

Standard library only.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RECORD_FILES = ("meta.json", "results.json", "results.md")
VERSION_KEYS = ("python", "torch", "triton", "cuda", "flash-attn-4", "nvidia-cutlass-dsl", "cudnn")
REQUIRED_META = ("capability", "machine", "device", "date", "git", "versions", "format", "runs")
REQUIRED_RUN = ("command", "date", "git", "rows")

# Row formats, keyed by the benchmark that writes them; each is recognised by the keys its rows
# always carry (``detect_format``).
FORMATS = {
    "benchmarks.run": ("impl", "variant", "S", "pass", "Hq", "Hkv", "D"),
    "benchmarks.decode": ("impl", "batch", "kv_len", "paged", "variant"),
    "benchmarks.train_step": ("model", "impl", "seq"),
    "benchmarks.fp32": ("precision", "pass_", "impl", "S"),
    "benchmarks.grad_accuracy": ("case", "tensor", "eager"),
    "benchmarks.warm_start": ("run", "first_forward"),
    "benchmarks.cpu_block_mask": ("impl", "mask", "S", "status"),
    "benchmarks.host_overhead": ("impl", "variant", "B", "H", "S", "D", "status"),
    "benchmarks.cold_start": ("case", "impl", "cold_s", "warm_s"),
    "benchmarks.compile_time": ("variant", "head_dim", "kernel", "total_s", "python_s", "backend_s"),
    "benchmarks.fp8_accuracy": ("variant", "D", "data", "inputs", "rotate", "rel_fp8", "rel_plain"),
    "log": ("file", "line"),
}

VARIANTS = ("full", "causal", "alibi", "sliding_window", "document", "softcap", "prefix_lm")
VARIANT_NAMES = {"full": "full", "causal": "causal", "alibi": "ALiBi", "sliding_window": "sliding window",
                 "document": "document", "softcap": "softcap", "prefix_lm": "prefix-LM"}
IMPL_ORDER = ("flexjit-cute", "flexjit-cute-det", "flexjit-triton", "flexjit", "fa4", "fa4-bhsd",
              "torch-flex-flash", "torch-flex-triton", "torch-flex", "cudnn")
IMPL_NAMES = {"fa4": "FA4", "fa4-bhsd": "FA4 (BHSD)", "torch-flex-flash": "Flex-FLASH",
              "torch-flex-triton": "Flex-Triton", "torch-flex": "torch flex", "cudnn": "cuDNN"}
MARKS = ("†", "‡", "§", "¶")


# ---------------------------------------------------------------------------------------------
# Reading and writing records


def detect_format(rows: list) -> str:
    """The benchmark format whose keys every row carries (``log`` rows: file + line)."""
    for name, keys in FORMATS.items():
        if rows and all(isinstance(r, dict) and all(k in r for k in keys) for r in rows):
            return name
    raise ValueError("rows match no known benchmark format: " + ", ".join(FORMATS))


def read_output(path) -> tuple[list, dict]:
    """(rows, meta) from a benchmark's output folder or file, as it wrote them.

    Accepted: ``benchmarks.run`` and ``benchmarks.decode`` folders (results.json list +
    meta.json); ``{"meta": ..., "rows": [...]}`` files (train_step, cpu_block_mask,
    host_overhead, tune_triton, host_decode, context_parallel); plain lists (fp32.json,
    grad_accuracy's results.json); JSON lines (warm_start.json).
    """
    path = Path(path)
    meta: dict = {}
    if path.is_dir():
        meta_file = path / "meta.json"
        if meta_file.exists():
            meta = json.loads(meta_file.read_text())
        for name in ("results.json", "fp32.json", "warm_start.json", "tune_triton.json"):
            if (path / name).exists():
                path = path / name
                break
        else:
            raise FileNotFoundError(f"no benchmark output in {path}")
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):
        meta = {**data.get("meta", {}), **meta}
        data = data["rows"]
    return data, meta


def meta_from_output(meta: dict, capability: str, machine: str) -> dict:
    """A record's meta for one run, from the meta a benchmark wrote (``read_output``'s): its
    command with ``--out`` pointed at ``$OUT/<capability>``, date, git, versions and device."""
    command = re.sub(r"--out \S+", f"--out $OUT/{capability}", str(meta.get("command", "")))
    return {"capability": capability, "machine": machine, "device": meta.get("gpu") or meta.get("device"),
            "command": command, "date": meta.get("date"), "git": meta.get("git"),
            "versions": {k: meta.get(k) for k in VERSION_KEYS}}


def check_meta(meta: dict, n_rows: int) -> None:
    """Raise ValueError unless meta has the required keys and its runs cover 0..n_rows."""
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ValueError(f"meta.json lacks {missing}")
    missing = [k for k in VERSION_KEYS if k not in meta["versions"]]
    if missing:
        raise ValueError(f"meta.json versions lack {missing}")
    at = 0
    for i, run in enumerate(meta["runs"]):
        missing = [k for k in REQUIRED_RUN if k not in run]
        if missing:
            raise ValueError(f"run {i} lacks {missing}")
        start, stop = run["rows"]
        if start != at or stop < start:
            raise ValueError(f"run {i} rows {run['rows']} do not follow row {at}")
        at = stop
    if at != n_rows:
        raise ValueError(f"runs cover {at} rows, results.json has {n_rows}")


def write_record(directory, rows: list, meta: dict) -> Path:
    """Write results.json, meta.json and results.md into ``directory`` (created if needed).

    ``meta`` needs ``machine``, ``capability`` (default: the folder's name), ``device``,
    ``versions`` and either ``runs`` or, for a single run, ``command``, ``date`` and ``git``;
    ``format`` is detected from the rows when absent.
    """
    directory = Path(directory)
    meta = dict(meta)
    meta.setdefault("capability", directory.name)
    if "format" not in meta:
        meta["format"] = detect_format(rows)
    if "runs" not in meta:
        meta["runs"] = [{"command": meta.pop("command"), "date": meta["date"], "git": meta["git"],
                         "rows": [0, len(rows)]}]
    newest = max(meta["runs"], key=lambda r: str(r["date"]))
    meta.setdefault("date", newest["date"])
    meta.setdefault("git", newest["git"])
    meta["versions"] = {k: meta.get("versions", {}).get(k) for k in VERSION_KEYS}
    order = [k for k in REQUIRED_META if k in meta] + [k for k in meta if k not in REQUIRED_META]
    meta = {k: meta[k] for k in order}
    check_meta(meta, len(rows))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")
    (directory / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    (directory / "results.md").write_text(render_md(rows, meta))
    return directory


def load_record(directory) -> tuple[list, dict]:
    directory = Path(directory)
    rows = json.loads((directory / "results.json").read_text())
    meta = json.loads((directory / "meta.json").read_text())
    return rows, meta


def record_dirs(root=RESULTS) -> list[Path]:
    """Every record folder under root (a folder holding meta.json), sorted."""
    return sorted(p.parent for p in Path(root).glob("*/*/meta.json"))


def runs_of(rows: list, meta: dict) -> list[tuple[dict, list]]:
    return [(run, rows[run["rows"][0]:run["rows"][1]]) for run in meta["runs"]]


# ---------------------------------------------------------------------------------------------
# Formatting


def _num(x, digits=1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def _sig(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.3g}"


def _table(header: list, body: list) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return lines


def _impls(rows: list) -> list[str]:
    seen = list(dict.fromkeys(r["impl"] for r in rows))
    return sorted(seen, key=lambda i: (IMPL_ORDER.index(i.split("[")[0]) if i.split("[")[0] in IMPL_ORDER
                                       else len(IMPL_ORDER), seen.index(i)))


def _is_flexjit(impl: str) -> bool:
    return impl.startswith("flexjit")


def _ok(row: dict) -> bool:
    return row.get("status", "ok") == "ok" and not row.get("error")


def _size(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def _not_timed(rows: list, where) -> list[str]:
    """One bullet per (impl, reason): the rows that carry no measurement, and why."""
    groups: dict = {}
    for r in rows:
        if r.get("status", "ok") == "ok" and not r.get("error"):
            continue
        reason = (r.get("error") or r.get("status") or "").splitlines()[0][:160]
        groups.setdefault((r.get("impl", ""), reason), []).append(where(r))
    if not groups:
        return []
    out = ["Not timed:", ""]
    out += [f"- {impl}: {reason} ({', '.join(cells)})" for (impl, reason), cells in groups.items()]
    return out + [""]


# ---------------------------------------------------------------------------------------------
# results.md, one renderer per row format


def _md_run(rows: list) -> list[str]:
    out = []
    groups: dict = {}
    for r in rows:
        key = (r["pass"], r["Hq"], r["Hkv"], r["D"], r.get("Dv", r["D"]), r["dtype"])
        groups.setdefault(key, []).append(r)
    for (pas, hq, hkv, d, dv, dtype), grp in groups.items():
        ok = [r for r in grp if _ok(r)]
        if not ok:
            continue
        impls = _impls(ok)
        flex = [i for i in impls if _is_flexjit(i)]
        base = [i for i in impls if not _is_flexjit(i)]
        dims = f"D {d}" if d == dv else f"D {d}/{dv}"
        out += [f"**{pas}, Hq {hq} / Hkv {hkv}, {dims}, {dtype}** (TFLOP/s on the mask's density)", ""]
        cells = sorted({(r["variant"], r["S"], r["B"]) for r in ok},
                       key=lambda c: (VARIANTS.index(c[0]) if c[0] in VARIANTS else 99, c[1]))
        header = ["variant", "S", "B"] + impls
        if base and flex:
            header += ["best baseline"] + [f"{i} ÷ best" for i in flex]
        body = []
        for variant, s, b in cells:
            at = {r["impl"]: r for r in ok if (r["variant"], r["S"], r["B"]) == (variant, s, b)}
            line = [variant, _size(s), b] + [_num(at[i]["tflops"]) if i in at else "–" for i in impls]
            if base and flex:
                have = [i for i in base if i in at]
                best = max(have, key=lambda i: at[i]["tflops"]) if have else None
                line.append(f"{best} {_num(at[best]['tflops'])}" if best else "–")
                line += [_num(at[i]["tflops"] / at[best]["tflops"], 2) if best and i in at else "–" for i in flex]
            body.append(line)
        out += _table(header, body) + [""]
    out += _not_timed(rows, lambda r: f"{r['variant']} {_size(r['S'])} {r['pass']}"
                      + ("" if (r["Hkv"], r["D"]) == (16, 128) else f" Hkv {r['Hkv']} D {r['D']}"))
    return out


def _md_decode(rows: list) -> list[str]:
    ok = [r for r in rows if r.get("ms_graph") is not None and not r.get("error")]
    out = []
    if ok:
        impls = _impls(ok)
        base = [i for i in impls if not _is_flexjit(i)]
        shape = sorted({(r["hq"], r["hkv"], r["d"]) for r in ok})
        out += ["µs per decode step, CUDA graph (eager); "
                + "; ".join(f"Hq {a} / Hkv {b}, D {c}" for a, b, c in shape)
                + ". GB/s: K and V bytes read per second, in the graph.", ""]
        cells = sorted({(r["batch"], r["kv_len"], r["paged"], r["variant"]) for r in ok})
        header = ["batch", "KV", "layout", "variant"] + [f"{i} µs" for i in impls] + ["flexjit splits",
                                                                                     "flexjit GB/s"]
        if base and "flexjit" in impls:
            header += ["best baseline (graph)", "best ÷ flexjit (graph)"]
        fp8 = "flexjit-fp8" in impls and "flexjit" in impls
        if fp8:
            header += ["bf16 ÷ FP8 cache (graph)"]
        body = []
        for batch, kv, paged, variant in cells:
            at = {r["impl"]: r for r in ok
                  if (r["batch"], r["kv_len"], r["paged"], r["variant"]) == (batch, kv, paged, variant)}
            line = [batch, _size(kv), "paged" if paged else "contiguous", variant]
            line += [f"{_num(at[i]['ms_graph'] * 1e3)} ({_num(at[i]['ms'] * 1e3)})" if i in at else "–"
                     for i in impls]
            fj = at.get("flexjit")
            line += [fj["splits"] if fj else "–", _num(fj["gbps_graph"], 0) if fj else "–"]
            if base and "flexjit" in impls:
                have = [i for i in base if i in at]
                best = min(have, key=lambda i: at[i]["ms_graph"]) if have else None
                line.append(f"{best} {_num(at[best]['ms_graph'] * 1e3)}" if best else "–")
                line.append(_num(at[best]["ms_graph"] / fj["ms_graph"], 2) if best and fj else "–")
            if fp8:
                f8 = at.get("flexjit-fp8")
                line.append(_num(fj["ms_graph"] / f8["ms_graph"], 2) if fj and f8 else "–")
            body.append(line)
        out += _table(header, body) + [""]
        wrong = [r for r in ok if r.get("correct") is False]
        if wrong:
            out += [f"Rows checked wrong against the reference: {len(wrong)}.", ""]
    out += _not_timed([r for r in rows if r not in ok],
                      lambda r: f"batch {r['batch']} KV {_size(r['kv_len'])} "
                                f"{'paged' if r['paged'] else 'contiguous'} {r['variant']}")
    return out


def _md_train(rows: list) -> list[str]:
    body = []
    sdpa = {(r["model"], r["seq"]): r["step_ms"] for r in rows if r["impl"] == "sdpa" and r.get("step_ms")}
    for r in rows:
        ref = sdpa.get((r["model"], r["seq"]))
        correct = str(r.get("correct")) + (f" ({r['note']})" if r.get("note") else "")
        body.append([r["model"], r["seq"], r["batch"], r["impl"], _num(r.get("step_ms")),
                     _num(r.get("max_loss_dev_vs_eager"), 4), correct,
                     _num(r["step_ms"] / ref, 2) if ref and r.get("step_ms") else "–"])
    return ["Median step time (ms); losses against eager attention's at every step.", ""] + _table(
        ["model", "seq", "batch", "impl", "step ms", "max |Δloss| vs eager", "correct", "÷ sdpa"], body) + [""]


def _md_fp32(rows: list) -> list[str]:
    body = [[r["precision"], r["S"], r["B"], r["pass_"], r["impl"], r.get("config") or "default",
             _num(r.get("ms"), 3), _num(r.get("tflops"), 1),
             " ".join(f"{k} {_sig(v)}" for k, v in (r.get("errors") or {}).items()) or "–",
             r.get("status", "")] for r in rows]
    torch = {(r["precision"], r["S"], r["pass_"]): r["ms"] for r in rows
             if r["impl"] == "torch-flex-triton" and r.get("ms")}
    ratio = [[r["precision"], r["S"], r["pass_"], _num(r["ms"], 3),
              _num(torch[(r["precision"], r["S"], r["pass_"])], 3),
              _num(torch[(r["precision"], r["S"], r["pass_"])] / r["ms"], 2)]
             for r in rows if r["impl"] == "flexjit-triton" and not r.get("config") and r.get("ms")
             and (r["precision"], r["S"], r["pass_"]) in torch]
    out = ["fp32 inputs, causal. `highest`: IEEE fp32 dots (torch's default); `high`: TF32 "
           "(`torch.set_float32_matmul_precision(\"high\")`). Errors: against float64.", ""]
    if ratio:
        out += _table(["precision", "S", "pass", "flexjit ms", "torch Flex-Triton ms", "torch ÷ flexjit"],
                      ratio) + [""]
    return out + _table(["precision", "S", "B", "pass", "impl", "config", "ms", "TFLOP/s", "errors", "status"],
                        body) + [""]


def _md_grad(rows: list) -> list[str]:
    impls = [k for k in rows[0] if k not in ("case", "tensor", "seeds", "eager")]
    ref = "torch-flex-triton" if "torch-flex-triton" in impls else None
    flex = [i for i in impls if _is_flexjit(i)]
    header = ["case", "tensor", "seeds", "eager"] + impls + [f"{i} ÷ eager" for i in impls]
    if ref:
        header += [f"{i} ÷ {ref}" for i in flex]
    body = []
    for r in rows:
        e = r.get("eager")
        line = [r["case"], r["tensor"], r.get("seeds", "–"), _sig(e)] + [_sig(r.get(i)) for i in impls]
        line += [_num(r[i] / e, 2) if _finite(e) and _finite(r.get(i)) and e else "–" for i in impls]
        if ref:
            t = r.get(ref)
            line += [_num(r[i] / t, 2) if _finite(t) and _finite(r.get(i)) and t else "–" for i in flex]
        body.append(line)
    return ["Mean |error| against a float64 golden per tensor, over the seeds; `eager`: the same "
            "math in bf16 with plain torch ops. `beyond out`: a gradient's error beyond the part "
            "that the kernel's own stored bf16 output sets.", ""] + _table(header, body) + [""]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _md_warm(rows: list) -> list[str]:
    keys = ["import_torch", "import_flexjit", "cuda_start", "create_block_mask", "first_forward",
            "first_backward", "second_forward"]
    body = [[r["run"], r.get("backend", "–")] + [_num(r.get(k), 3) for k in keys] for r in rows]
    return ["Seconds per phase of a fresh process, ALiBi-causal at B 2, H 16, S 2048, D 128; the "
            "first row compiles into an empty disk cache, the others find it warm.", ""] + _table(
        ["run", "backend"] + keys, body) + [""]


def _md_block_mask(rows: list) -> list[str]:
    body = []
    for r in rows:
        vs = r.get("vs_torch") or {}
        body.append([r["mask"], _size(r["S"]), r["impl"], r.get("status", ""), _num(r.get("first_s"), 3),
                     _num(r.get("median_s"), 3), _num(r.get("min_s"), 3), _num(r.get("delta_mb"), 1),
                     _num(r.get("sparsity_pct"), 1), vs.get("detail", "–")])
    return ["Seconds and MB over the process's baseline; each case in its own process.", ""] + _table(
        ["mask", "S", "impl", "status", "first s", "median s", "min s", "peak Δ MB", "sparsity %",
         "blocks vs torch"], body) + [""]


def _md_host(rows: list) -> list[str]:
    body = [[r["variant"], r["impl"], r.get("B"), r.get("H"), r.get("S"), r.get("D"), _num(r.get("host_us")),
             _num(r.get("host_min_us")), _num(r.get("gpu_us")), _num(r.get("dispatch_us")),
             _num(r.get("dispatch_min_us")), r.get("error") or r.get("status", "")] for r in rows]
    return ["µs per forward call with cached kernels: `host` issued back to back, `gpu` the kernel "
            "(do_bench), `dispatch` flexjit's own work before the launch.", ""] + _table(
        ["variant", "impl", "B", "H", "S", "D", "host µs", "host min µs", "gpu µs", "dispatch µs",
         "dispatch min µs", "status"], body) + [""]


def _md_cold(rows: list) -> list[str]:
    body = [[r["case"], r["impl"], _num(r.get("cold_s"), 2), _num(r.get("warm_s"), 2),
             r.get("error") or r.get("status", "")] for r in rows]
    return ["Seconds of a fresh process's first call or training step (synchronised), with empty "
            "compile caches (cold) and with the caches the cold process filled (warm).", ""] + _table(
        ["case", "impl", "cold s", "warm s", "status"], body) + [""]


def _md_compile(rows: list) -> list[str]:
    body = [[r["variant"], r["head_dim"], r["kernel"], _num(r["total_s"], 2), _num(r["python_s"], 2),
             _num(r["backend_s"], 2), _num(r.get("ptxas_s"), 2), _num(r.get("export_s"), 2),
             _num(r.get("load_s"), 3)] for r in rows]
    return ["Seconds of one cold `cute.compile` for sm_90a on the CPU: the DSL's Python (trace to "
            "MLIR), its backend (MLIR passes, LLVM, ptxas; ptxas alone beside it), then the "
            "object's export to the disk cache and its load from there.", ""] + _table(
        ["variant", "D", "kernel", "compile s", "python s", "backend s", "ptxas s", "export s",
         "load s"], body) + [""]


def _md_fp8_accuracy(rows: list) -> list[str]:
    shape = sorted({(r["B"], r["Hq"], r["Hkv"], r["S"]) for r in rows})
    body = []
    for r in rows:
        road = r["backend"] + ("" if r["native"] else " (dequantised)")
        body.append([r["variant"], r["D"], r["data"], r["inputs"], "yes" if r["rotate"] else "no", road,
                     _sig(r["rel_fp8"]), _sig(r["rel_plain"]), _sig(r["rel_plain_p8"]), _sig(r["rel_bf16"]),
                     _num(r["ratio_rel"], 3), _sig(r["max_fp8"]), _sig(r["max_plain"]), _sig(r["max_bf16"]),
                     _num(r["ratio_max"], 3), "yes" if r["within_target"] else "**no**"])
    missed = sum(not r["within_target"] for r in rows)
    return ["Errors against float64 attention of the bf16 data before quantising; "
            + "; ".join(f"B {b}, Hq {hq} / Hkv {hkv}, S {_size(s)}" for b, hq, hkv, s in shape)
            + ". `rel`: ‖out − true‖₂ / ‖true‖₂ over the whole output; `max`: max |out − true|. "
            "`fp8`: flexjit on e4m3 inputs (per-(batch, kv head) descales; `kv8`: a bf16 query); "
            "`plain`: dequantise, float32 attention, bf16 out; `plain P e4m3`: the same with P "
            "rounded to e4m3 before P·V (an e4m3-MMA kernel's math); `bf16`: flexjit on the bf16 "
            "data; `rotated`: q and k Hadamard-rotated before quantising. Target: fp8 ÷ plain ≤ 1.1 "
            f"in both norms ({missed} of {len(rows)} rows miss it).", ""] + _table(
        ["variant", "D", "data", "inputs", "rotated", "backend", "rel fp8", "rel plain",
         "rel plain P e4m3", "rel bf16", "fp8 ÷ plain (rel)", "max fp8", "max plain", "max bf16",
         "fp8 ÷ plain (max)", "≤ 1.1"], body) + [""]


def _md_log(rows: list) -> list[str]:
    return [f"- `{r['file']}`: `{r['line']}`" for r in rows] + [""]


RENDER = {"benchmarks.run": _md_run, "benchmarks.decode": _md_decode, "benchmarks.train_step": _md_train,
          "benchmarks.fp32": _md_fp32, "benchmarks.grad_accuracy": _md_grad, "benchmarks.warm_start": _md_warm,
          "benchmarks.cpu_block_mask": _md_block_mask, "benchmarks.host_overhead": _md_host, "benchmarks.cold_start": _md_cold,
          "benchmarks.compile_time": _md_compile, "benchmarks.fp8_accuracy": _md_fp8_accuracy,
          "log": _md_log}


def render_md(rows: list, meta: dict) -> str:
    """results.md for a record: a header from meta, then each run's tables."""
    v = meta["versions"]
    out = [f"# {meta['capability']}: {meta['device']}", "",
           f"Generated from results.json and meta.json by `python -m benchmarks.records md DIR`.", ""]
    if meta.get("note"):
        out += [meta["note"], ""]
    out += ["Versions: " + ", ".join(f"{k} {v[k]}" for k in VERSION_KEYS if v.get(k) is not None)
            + (f" ({meta['versions_note']})" if meta.get("versions_note") else "") + ".", ""]
    runs = runs_of(rows, meta)
    for n, (run, part) in enumerate(runs, 1):
        fmt = run.get("format", meta["format"])
        if len(runs) > 1:
            out += [f"## Rows {run['rows'][0]}-{run['rows'][1] - 1}", ""]
        out += [f"`{run['command']}`", "", f"{run['date']}, commit {run['git']}"
                + (f" (the run's own git field: {run['recorded_git']})" if run.get("recorded_git") else "")
                + "."]
        if run.get("select"):
            out += ["", run["select"]]
        if run.get("note"):
            out += ["", run["note"]]
        out += [""] + RENDER[fmt](part)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# README tables


def _source_line(path: str, meta: dict, used: list[dict]) -> tuple[str, dict]:
    """'Source: ...' naming the record, the machine and each run a table's cells came from;
    the newest run is unmarked, older ones get MARKS in date order (newest first)."""
    latest: dict = {}
    for r in used:
        key = _run_key(r)
        latest[key] = max(latest.get(key, ""), str(r["date"]))
    keys = sorted(latest, key=lambda k: latest[k], reverse=True)
    mark = {k: ("" if i == 0 else MARKS[i - 1]) for i, k in enumerate(keys)}
    first = keys[0] if keys else (str(meta["date"])[:10], meta["git"])
    line = f"Source: `benchmarks/results/{path}`, {meta['device']}, {first[0]}, commit {first[1]}"
    rest = [f"{mark[k]} {k[0]}, commit {k[1]}" for k in keys[1:]]
    return line + (f" ({'; '.join(rest)})" if rest else "") + ".", mark


def _run_key(run: dict) -> tuple:
    return (str(run["date"])[:10], run["git"])


def _prefill_table(passes=("fwd", "fwdbwd"), s: int = 8192):
    """Variant rows; per pass at size ``s``: flexjit-cute, the best baseline of the same run, the
    ratio."""
    def build(rows: list, meta: dict, path: str) -> list[str]:
        runs = [(run, part) for run, part in runs_of(rows, meta)
                if run.get("format", meta["format"]) == "benchmarks.run"]
        chosen: dict = {}
        for variant in VARIANTS:
            for pas in passes:
                best_run = None
                for run, part in runs:
                    at = [r for r in part if _ok(r) and r["pass"] == pas and r["variant"] == variant
                          and r["S"] == s and (r["Hq"], r["Hkv"], r["D"], r.get("Dv", r["D"])) == (16, 16, 128, 128)
                          and r["dtype"] == "bf16"]
                    ours = [r for r in at if r["impl"] == "flexjit-cute"]
                    base = [r for r in at if not _is_flexjit(r["impl"])]
                    if ours and base and (best_run is None or str(run["date"]) > str(best_run[0]["date"])):
                        best_run = (run, ours[0], max(base, key=lambda r: r["tflops"]))
                if best_run:
                    chosen[(variant, pas)] = best_run
        source, mark = _source_line(path, meta, [c[0] for c in chosen.values()])
        body = []
        for variant in VARIANTS:
            line = [VARIANT_NAMES[variant]]
            for pas in passes:
                if (variant, pas) not in chosen:
                    line += ["–", "–", "–"]
                    continue
                run, ours, base = chosen[(variant, pas)]
                m = mark[_run_key(run)]
                line += [f"{ours['tflops']:.0f}{m}", f"{IMPL_NAMES.get(base['impl'], base['impl'])} "
                         f"{base['tflops']:.0f}{m}", f"{ours['tflops'] / base['tflops']:.2f}"]
            body.append(line)
        names = {"fwd": "forward", "fwdbwd": "fwd+bwd"}
        head = ["variant"] + [f"{names[pas]}: {h}" for pas in passes
                              for h in ("flexjit", "best baseline", "ratio")]
        return _table(head, body) + ["", source]
    return build


def _decode_table(rows: list, meta: dict, path: str) -> list[str]:
    """Causal, contiguous, CUDA-graph times: flexjit's µs and GB/s, the fastest baseline of the same
    run (FA4 or torch's compiled flex decoding) and its time ÷ flexjit's; with an FP8 cache row
    in the same run, its µs and bf16's time ÷ its."""
    chosen = {}
    for run, part in runs_of(rows, meta):
        for r in part:
            if r["impl"] != "flexjit" or r["paged"] or r["variant"] != "causal" or r.get("ms_graph") is None:
                continue
            base = [x for x in part if x["impl"] in ("fa4", "torch-flex") and x.get("ms_graph") is not None
                    and (x["batch"], x["kv_len"], x["paged"], x["variant"])
                    == (r["batch"], r["kv_len"], r["paged"], r["variant"])]
            key = (r["batch"], r["kv_len"])
            fp8 = [x for x in part if x["impl"] == "flexjit-fp8" and x.get("ms_graph") is not None
                   and (x["batch"], x["kv_len"], x["paged"], x["variant"])
                   == (r["batch"], r["kv_len"], r["paged"], r["variant"])]
            if base and (key not in chosen or str(run["date"]) > str(chosen[key][0]["date"])):
                chosen[key] = (run, r, min(base, key=lambda x: x["ms_graph"]), fp8[0] if fp8 else None)
    source, mark = _source_line(path, meta, [c[0] for c in chosen.values()])
    body = []
    any_fp8 = any(c[3] for c in chosen.values())
    for (batch, kv), (run, r, base, f8) in sorted(chosen.items()):
        m = mark[_run_key(run)]
        name = IMPL_NAMES.get(base["impl"], base["impl"])
        line = [batch, _size(kv), f"{r['ms_graph'] * 1e3:.1f}{m}", f"{r['gbps_graph']:.0f}",
                f"{name} {base['ms_graph'] * 1e3:.1f}", f"{base['ms_graph'] / r['ms_graph']:.2f}{m}"]
        if any_fp8:
            line.append(f"{f8['ms_graph'] * 1e3:.1f} ({r['ms_graph'] / f8['ms_graph']:.2f}×)" if f8 else "–")
        body.append(line)
    head = ["batch", "KV", "flexjit µs", "GB/s", "best baseline µs", "ratio"]
    head += ["FP8 cache µs (× bf16)"] if any_fp8 else []
    return _table(head, body) + ["", source]


def _train_table(rows: list, meta: dict, path: str) -> list[str]:
    """Median step ms per (model, seq): flexjit, SDPA, torch flex_attention."""
    cells: dict = {}
    used = []
    for run, part in runs_of(rows, meta):
        for r in part:
            cells.setdefault((r["model"], r["seq"]), {})[r["impl"]] = (run, r)
            used.append(run)
    source, mark = _source_line(path, meta, used)
    names = {"llama": "Llama", "gemma2": "Gemma 2"}
    body = []
    for (model, seq), at in cells.items():
        line = [names.get(model, model), seq]
        for impl in ("flexjit", "sdpa", "flex_attention"):
            if impl not in at or at[impl][1].get("step_ms") is None:
                line.append("–")
                continue
            run, r = at[impl]
            cell = f"{r['step_ms']:.1f}{mark[_run_key(run)]}"
            if r.get("correct") is False:
                cell += f" (not correct: {r['note']})" if r.get("note") else " (not correct)"
            line.append(cell)
        body.append(line)
    return _table(["model", "seq", "flexjit ms", "SDPA ms", "torch flex ms"], body) + ["", source]


README_TABLES = {
    "prefill": ("h200/prefill", _prefill_table()),
    "decode": ("h200/decode", _decode_table),
    "train-step": ("h200/train_step", _train_table),
}

_BEGIN = re.compile(r"^<!-- records:begin (\S+) -->$")


def readme_blocks(root=RESULTS, names=None) -> dict[str, str]:
    """NAME -> the generated text that goes between NAME's marker lines."""
    out = {}
    for name in names or README_TABLES:
        path, build = README_TABLES[name]
        rows, meta = load_record(Path(root) / path)
        out[name] = "\n".join(build(rows, meta, path))
    return out


def replace_blocks(text: str, blocks) -> str:
    """Text with every marker block's content replaced by ``blocks[NAME]``.

    ``blocks`` maps NAME to its text, or is a callable NAME -> text. A begin marker without its
    end marker, or an unknown NAME, raises ValueError; lines outside the blocks are kept as they are.
    """
    get = blocks if callable(blocks) else blocks.__getitem__
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        m = _BEGIN.match(lines[i].strip())
        if not m:
            i += 1
            continue
        name = m.group(1)
        end = f"<!-- records:end {name} -->"
        try:
            j = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == end)
        except StopIteration:
            raise ValueError(f"no '{end}' after '{lines[i].strip()}'") from None
        try:
            content = get(name)
        except KeyError:
            raise ValueError(f"unknown records table {name!r} (known: {', '.join(README_TABLES)})") from None
        out += content.split("\n")
        out.append(lines[j])
        i = j + 1
    return "\n".join(out)


def marker_names(text: str) -> list[str]:
    return [m.group(1) for line in text.split("\n") if (m := _BEGIN.match(line.strip()))]


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.records", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    md = sub.add_parser("md", help="regenerate DIR/results.md from DIR/results.json and DIR/meta.json")
    md.add_argument("dirs", nargs="*", help="record folders (default: every record under benchmarks/results)")
    md.add_argument("--check", action="store_true", help="only compare; exit 1 if a results.md differs")
    rd = sub.add_parser("readme", help="regenerate README's tables between <!-- records:begin/end NAME --> lines")
    rd.add_argument("readme", nargs="?", default=str(RESULTS.parent.parent / "README.md"))
    rd.add_argument("--check", action="store_true", help="only compare; print a diff and exit 1 if they differ")
    rd.add_argument("--root", default=str(RESULTS), help="the records' root folder")
    a = p.parse_args(argv)

    if a.cmd == "md":
        status = 0
        for d in [Path(x) for x in a.dirs] or record_dirs():
            rows, meta = load_record(d)
            check_meta(meta, len(rows))
            text = render_md(rows, meta)
            target = d / "results.md"
            old = target.read_text() if target.exists() else ""
            if old == text:
                continue
            if a.check:
                print(f"{target} differs from what its record gives")
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                           str(target), "generated"))
                status = 1
            else:
                target.write_text(text)
                print(f"wrote {target}")
        return status

    path = Path(a.readme)
    text = path.read_text()
    names = marker_names(text)
    if not names:
        print(f"{path}: no <!-- records:begin NAME --> markers", file=sys.stderr)
        return 1
    new = replace_blocks(text, readme_blocks(a.root, names))
    if new == text:
        return 0
    if a.check:
        sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                   str(path), "from the records"))
        return 1
    path.write_text(new)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
