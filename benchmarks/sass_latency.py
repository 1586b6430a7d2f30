"""How far each variable-latency result of the sm90 backward's hot loop is from its first use.

    python -m benchmarks.sass_latency [--causal] [--head-dim 128|64] [--cubin FILE] [--list]

No GPU: the kernel is compiled for sm_90a (CUTE_DSL_ARCH) through ``benchmarks.sass_compare``
and its steady-state loop path taken the same way (``hot_path``). For every shared-memory load
(LDS, the lse2/delta rows) and every MUFU op (EX2 of P) on that path it prints the number of
instructions between the producer and the first instruction that reads one of its destination
registers (the loop is cyclic: a use in the next iteration counts from the top), and whether a
``WARPGROUP.DEPBAR`` or ``BAR.SYNC`` sits in between (a wait there overlaps the latency instead
of adding to it). A short distance with no wait in between is a short-scoreboard stall waiting
to happen (LDS ~30 cycles, MUFU.EX2 ~20 at the SM's issue rate, where an instruction is >= 1
cycle). It also lists, for every wgmma wait, the loads issued after it whose first use follows
it closely: the "LDS right behind a DEPBAR" pattern the 2026-12-01 ncu profile pointed at.
Per 64 query rows per thread, as sass_compare counts.
"""
from __future__ import annotations

import argparse
import re
import statistics
import tempfile

_REG = re.compile(r"(?<![A-Z_])R(\d+)\b")
_WAITS = ("WARPGROUP.DEPBAR", "BAR.SYNC")


def _opcode(text: str) -> str:
    return text.split()[1] if text.startswith("@") else text.split()[0]


def _operands(text: str) -> list[str]:
    body = text.split(None, 2 if text.startswith("@") else 1)
    rest = body[-1] if len(body) > (2 if text.startswith("@") else 1) else ""
    return [o.strip() for o in rest.split(",")] if rest else []


def _width(op: str) -> int:
    """Registers a vector memory op moves per named register."""
    for suffix, n in ((".128", 4), (".64", 2)):
        if suffix in op:
            return n
    return 4 if op.startswith("STSM") and op.endswith(".4") else 1


def _regs(operand: str, n: int = 1) -> set[int]:
    return {int(r) + k for r in _REG.findall(operand) for k in range(n)} - {255}


def defs_uses(text: str) -> tuple[set[int], set[int]]:
    """(registers written, registers read) of one SASS instruction (vector widths expanded;
    an HGMMA's register A operand is 4 registers, its accumulator read and written)."""
    op, ops = _opcode(text), _operands(text)
    pred = set()
    if not ops:
        return set(), set()
    if op.startswith("HGMMA"):
        acc = _regs(ops[0], 1)  # only the first register is named; enough for first-use search
        a = _regs(ops[1], 4) if ops[1].startswith("R") else set()
        return acc, a | acc
    if op.startswith(("ST", "RED", "BAR", "SYNCS", "WARPGROUP", "MEMBAR", "FENCE", "BRA")):
        w = _width(op)
        uses = set()
        for i, o in enumerate(ops):
            uses |= _regs(o, w if i > 0 and not o.startswith("[") else 1)
        return set(), uses | pred
    dst = _regs(ops[0], _width(op) if op.startswith("LD") else 1) if not ops[0].startswith("[") else set()
    if op.startswith("F2FP") or op.startswith(("ISETP", "FSETP", "PLOP3")):
        dst = _regs(ops[0], 1)
    uses = set()
    for o in ops[1:]:
        uses |= _regs(o, 1)
    return dst, uses


def distances(path: list[str], kinds=("LDS", "MUFU")) -> list[dict]:
    """For each producer of ``kinds`` on the cyclic ``path``: index, text, distance to the first
    reader (None if the value dies unread), and the waits crossed on the way."""
    n = len(path)
    parsed = [defs_uses(t) for t in path]
    out = []
    for i, text in enumerate(path):
        if not _opcode(text).startswith(kinds):
            continue
        dst, _ = parsed[i]
        hit, waits = None, []
        for d in range(1, n):
            j = (i + d) % n
            if _opcode(path[j]).startswith(_WAITS):
                waits.append(_opcode(path[j]))
            if parsed[j][1] & dst:
                hit = d
                break
            if parsed[j][0] & dst == dst:
                break  # overwritten unread
        out.append({"i": i, "text": text, "dist": hit, "waits": waits})
    return out


def behind_waits(path: list[str], rows: list[dict], near: int = 12) -> list[str]:
    """Lines ``DEPBAR@i: LDS@j (first use +d)`` for loads issued within ``near`` instructions
    after a wgmma wait and read before ``near`` more: latency the wait could have hidden."""
    lines = []
    waits = [i for i, t in enumerate(path) if _opcode(t).startswith("WARPGROUP.DEPBAR")]
    for r in rows:
        if not _opcode(r["text"]).startswith("LDS") or r["dist"] is None:
            continue
        before = [w for w in waits if 0 < r["i"] - w <= near]
        if before and r["dist"] <= near:
            lines.append(f"  {path[before[-1]]} @{before[-1]} -> {r['text']} @{r['i']} "
                         f"(+{r['i'] - before[-1]} after the wait, first use +{r['dist']})")
    return lines


def summary(path: list[str], rows_per_iter: int) -> str:
    rows = distances(path)
    scale = 64 / rows_per_iter
    lines = []
    for kind in ("LDS", "MUFU"):
        sel = [r for r in rows if _opcode(r["text"]).startswith(kind)]
        used = [r for r in sel if r["dist"] is not None]
        if not sel:
            continue
        ds = [r["dist"] for r in used]
        exposed = [r for r in used if not r["waits"]]
        short = [r for r in exposed if r["dist"] < 8]
        lines.append(
            f"{kind}: {len(sel) * scale:.0f} per 64 rows; distance to first use min {min(ds)} "
            f"median {statistics.median(ds):g} mean {statistics.mean(ds):.1f}; "
            f"{len(used) - len(exposed)} with a wait in between; "
            f"{len(short) * scale:.0f} read < 8 instructions later with no wait between")
    lines.append("loads right behind a wgmma wait:")
    lines += behind_waits(path, rows) or ["  none"]
    return "\n".join(lines)


def main(argv=None) -> None:
    from benchmarks import sass_compare as sc

    p = argparse.ArgumentParser(prog="python -m benchmarks.sass_latency")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    p.add_argument("--cubin", default=None, help="analyse this cubin instead of compiling")
    p.add_argument("--list", action="store_true", help="print the path with each producer's distance")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        cubin = a.cubin or sc._ours("bwd", a.causal, f"{d}/ours", a.head_dim)
        ins = sc.disassemble(cubin)
        regs = sc.registers(cubin)
    path, skipped = sc.hot_path(ins)
    rows = sc._rows_per_iteration(path, "bwd")
    print(f"{regs} registers; hot path {len(path)} instructions for {rows} query rows"
          + (f" (a branch skips {skipped})" if skipped else ""))
    print(summary(path, rows))
    if a.list:
        info = {r["i"]: r for r in distances(path)}
        for i, t in enumerate(path):
            r = info.get(i)
            tag = "" if r is None else (f"   <- first use +{r['dist']}" if r["dist"] else "   <- unread")
            if r and r["waits"]:
                tag += " (across " + ", ".join(r["waits"]) + ")"
            print(f"{i:4d} {t}{tag}")


if __name__ == "__main__":
    main()
