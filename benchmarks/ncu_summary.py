"""One table row per kernel from profile_kernels.sh's Nsight Compute text output.

    python -m benchmarks.ncu_summary benchmarks/results/<dir>/ncu_fwd.txt [more.txt ...]

Columns: the case (backend:variant:S:pass), the kernel (short name), its duration, registers,
achieved occupancy, the tensor pipe's active cycles (wgmma on sm90 reports as hmma), MUFU (xu:
exp2, tanh, conversions: instructions issued), FMA and ALU pipes, warp cycles per issued
instruction, and the top stall reason ncu's rules name. (profile_kernels also collects
sm__instruction_throughput; ncu defines it as the busiest pipe's share, so it repeats a column.)
"""
from __future__ import annotations

import argparse
import re
import sys

_METRICS = {
    "tensor": r"sm__pipe_tensor_op_(?:hmma|gmma)_cycles_active",
    "xu": r"sm__inst_executed_pipe_xu",
    "fma": r"sm__pipe_fma_cycles_active",
    "alu": r"sm__pipe_alu_cycles_active",
}
_SOL = {
    "duration": r"Duration",
    "regs": r"Registers Per Thread",
    "occ": r"Achieved Occupancy",
    "cpi": r"Warp Cycles Per Issued Instruction",
}
_UNIT_US = {"us": 1.0, "ms": 1000.0, "ns": 1e-3, "s": 1e6}


def _kernel_name(line: str) -> str:
    name = line.strip().split(" (")[0]
    for key in ("FlexAttentionFwd", "FlexAttentionBwd", "FlashAttentionForward", "FlashAttentionBackward",
                "flex_fwd", "flex_bwd"):
        if key in name:
            tail = name.split(key, 1)[1]
            # sm90 cute kernels: FlexAttentionBwdSm90..., the pre/post-processing kernels: ...Pre/Post
            m = re.match(r"(Sm90\w*?|Pre\w*?|Post\w*?)?_", tail)
            return key + (m.group(1) if m and m.group(1) else "")
    return name[:40]


def parse(text: str) -> list[dict]:
    rows: list[dict] = []
    case = ""
    cur: dict | None = None
    for line in text.splitlines():
        if line.startswith("=== "):
            case = line[4:].strip()
            continue
        # A kernel header: "  name (grid)x(block), Context 1, Stream 7, Device 0, CC 9.0"
        if re.search(r"\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\), Context", line):
            cur = {"case": case, "kernel": _kernel_name(line)}
            rows.append(cur)
            continue
        if cur is None:
            continue
        for key, pat in _METRICS.items():
            m = re.match(rf"\s+{pat}\.avg\.pct_of_peak_sustained_active\s+%\s+([\d.,]+)", line)
            if m:
                cur[key] = float(m.group(1).replace(",", ""))
        for key, pat in _SOL.items():
            m = re.match(rf"\s+{pat}\s+(\S+)?\s+([\d.,]+)\s*$", line)
            if m and key not in cur:
                val = float(m.group(2).replace(",", ""))
                if key == "duration":
                    val *= _UNIT_US.get(m.group(1) or "us", 1.0)
                cur[key] = val
        m = re.search(r"spends ([\d.]+) cycles being stalled (.*)$", line)
        if m and "stall" not in cur:
            what = re.sub(r"^(waiting (?:on|for) )?(an? |the )?", "", m.group(2).strip())
            cur["stall"] = f"{m.group(1)} cyc: {what}"
    return rows


def table(rows: list[dict]) -> str:
    head = ["case", "kernel", "µs", "regs", "occ %", "tensor %", "xu %", "fma %", "alu %", "cyc/issue",
            "top stall (ncu rule)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(r, k, fmt="{:.0f}"):
        return fmt.format(r[k]) if k in r else "–"

    for r in rows:
        out.append("| " + " | ".join([
            r["case"], r["kernel"], f(r, "duration"), f(r, "regs"), f(r, "occ", "{:.1f}"),
            f(r, "tensor", "{:.1f}"), f(r, "xu", "{:.1f}"), f(r, "fma", "{:.1f}"), f(r, "alu", "{:.1f}"),
            f(r, "cpi", "{:.2f}"), r.get("stall", "–")]) + " |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncu_summary")
    p.add_argument("files", nargs="+")
    a = p.parse_args(argv)
    rows = []
    for path in a.files:
        with open(path) as fh:
            rows += parse(fh.read())
    if not rows:
        sys.exit("no kernels found: is this profile_kernels.sh output?")
    print(table(rows))


if __name__ == "__main__":
    main()
