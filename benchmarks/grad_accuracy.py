"""Gradient accuracy under torch's error-ratio oracle, flexjit against torch's flex.

    python -m benchmarks.grad_accuracy [--S 1024] [--impls flexjit-cute,flexjit-triton,torch-flex-triton]
                                       [--seeds N] [--cases SUBSTR] [--per-seed] [--out DIR]

For each case every implementation runs the same bf16 inputs forward and backward; a float64
"golden" runs the same math (tests/oracle.py's dense attention, mods called eagerly) on the
inputs upcast, and "eager" runs that dense math in bf16 with plain torch. The error of a tensor
is mean |golden - result|; the table gives each implementation's error ÷ eager's (torch's rule:
within 1.1x) and flexjit's error ÷ torch Flex-Triton's (the issue's bar: no worse than torch's
own compiled kernel). Captured learnable tables are differentiated too (their gradient is a sum
over every score that reads them, the error-prone part).

Writes results.json and results.md under --out. Runs on a GPU; on the CPU only the reference
backend and torch's eager flex can run (``--impls flexjit-reference,torch-flex-eager``, small S).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import oracle  # noqa: E402  (the tests' independent float64 oracle)


def _cases(S: int, device):
    """name -> (make_score_mod(tables) -> score_mod, tables: {name: tensor}, mask_mod or None).

    The tables are leaves that require grad; the float64 golden calls ``make`` on upcast copies.
    """
    g = torch.Generator(device="cpu").manual_seed(7)
    offset = torch.randint(0, 64, (S,), generator=g).to(device)

    def rel_bias(t):
        return lambda s, b, h, q, kv: s + (q - kv)

    def two_tables(t):
        b1, b2 = t["bias1"], t["bias2"]
        return lambda s, b, h, q, kv: s + b1[q] + b2[kv]

    def gathered(t):
        bias = t["bias"]
        return lambda s, b, h, q, kv: s + bias[offset[q]]

    def alibi_learned(t):
        slope = t["slope"]
        return lambda s, b, h, q, kv: s + slope[h] * (kv - q)

    def causal(b, h, q, kv):
        return q >= kv

    def tab(n, dtype, seed):
        return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)

    return {
        "plain": (lambda t: None, {}, None),
        "rel_bias": (rel_bias, {}, None),
        "rel_bias_causal": (rel_bias, {}, causal),
        "two_tables(bf16 q, fp32 kv)": (two_tables, {"bias1": tab(S, torch.bfloat16, 1),
                                                      "bias2": tab(S, torch.float32, 2)}, None),
        "gathered_table(bias[offset[q]])": (gathered, {"bias": tab(64, torch.float32, 3)}, None),
        "learned_alibi_causal": (alibi_learned, {"slope": tab(8, torch.float32, 4) * 0.01}, causal),
    }


def _impl(name: str, device):
    """name -> run(q, k, v, score_mod, mask_mod) -> out (differentiable)."""
    if name.startswith("flexjit-"):
        # "flexjit-FWD+BWD": one backend's forward feeding another's backward (which kernel an
        # error comes from), through the same autograd function as flex_attention.
        import flexjit
        from flexjit.runtime import dispatch
        from flexjit.api.attention import prepare_call

        fwd, _, bwd = name.removeprefix("flexjit-").partition("+")

        def run(q, k, v, score_mod, mask_mod):
            bm = None
            if mask_mod is not None:
                bm = flexjit.create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2],
                                               device=device)
            if not bwd:
                return flexjit.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                              backend=fwd)
            call = prepare_call(q, k, v, score_mod, bm, None, False, None)
            choice = dispatch.Choice(fwd, "asked for", backward=bwd, backward_reason="asked for")
            return dispatch.run(choice, call)[0]
        return run
    from torch.nn.attention import flex_attention as tfa

    fn = tfa.flex_attention
    if name == "torch-flex-triton":
        fn = torch.compile(tfa.flex_attention, dynamic=False)
    elif name != "torch-flex-eager":
        raise SystemExit(f"unknown impl {name}")

    def run(q, k, v, score_mod, mask_mod):
        bm = None
        if mask_mod is not None:
            bm = tfa.create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device=device)
        return fn(q, k, v, score_mod=score_mod, block_mask=bm)
    return run


def _grads(out_fn, q, k, v, tables, do):
    """(out, {name: grad}) of one implementation on fresh leaves of the given inputs."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in
              [("q", q), ("k", k), ("v", v)] + list(tables.items())}
    out = out_fn(leaves)
    names = list(leaves)
    grads = torch.autograd.grad(out, [leaves[n] for n in names], do, allow_unused=True)
    return out.detach(), {n: g for n, g in zip(names, grads)}


# What a backward makes of the forward's stored output. A kernel's backward computes
# D_i = dO_i · O_i from the bf16 output O the forward stored, so its dS_ij = P_ij (dP_ij - D_i)
# differs from the exact one by -P_ij δ_i, δ_i = dO_i · (O_i - O_golden_i). Pushed through the
# score's derivatives, that term is a part of dq, dk and of every captured tensor's gradient that
# the forward's output rounding alone sets: for a table the score_mod adds (score + t[kv]) it is
# -Σ_i P_ij δ_i, nearly one common draw per seed (Σ_i δ_i), which dominates a
# kv-indexed table's error and cannot separate two kernels over a few seeds.
# "<t> beyond out" is the error with that part (computed exactly from the golden P and each
# implementation's own stored output) removed: what the backward and the forward's LSE add.
# ROW_PROJECTION, the RMS over rows of δ_i, is what sets the removed part's size.
# The split applies to flash backwards (flexjit's kernels, torch's compiled one); eager torch and
# flexjit's reference differentiate their own softmax instead, and get NaN there.
BEYOND_OUT = " beyond out"
ROW_PROJECTION = "out·dO rms"


def _reads_stored_output(name: str) -> bool:
    return name == "torch-flex-triton" or (name.startswith("flexjit-") and "reference" not in name)


def _tensors(tables) -> list[str]:
    return (["out", ROW_PROJECTION, "q", "k", "v", *tables]
            + [t + BEYOND_OUT for t in ["q", "k", *tables]])


def _from_out(make, mask_mod, q, k, tables, gold_out, out, do) -> dict:
    """{name: the part of q's, k's and each table's gradient error that the stored output's
    error δ_i sets}: the gradient of Σ_ij (-P_ij δ_i) s_ij, with P and s the float64 golden's
    probabilities and modded scores, δ_i = dO_i · (out_i - golden_i)."""
    leaves = {"q": q.double().requires_grad_(True), "k": k.double().requires_grad_(True),
              **{n: t.detach().double().requires_grad_(True) for n, t in tables.items()}}
    s = oracle.dense_scores(leaves["q"], leaves["k"], make({n: leaves[n] for n in tables}),
                            mask_mod)
    finite = torch.isfinite(s)
    p = torch.softmax(s.detach(), dim=-1).nan_to_num(0.0)  # a fully masked row: no P
    delta = ((out.double() - gold_out.double()) * do.double()).sum(-1, keepdim=True)
    loss = (-p * delta * torch.where(finite, s, torch.zeros_like(s))).sum()
    names = list(leaves)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return {n: (torch.zeros_like(leaves[n]) if g is None else g) for n, g in zip(names, grads)}


def _row_projection(out, golden, do) -> float:
    r = ((out.double() - golden.double()) * do.double()).sum(-1)
    return r.pow(2).mean().sqrt().item()


def _err(a, golden) -> float:
    if a is None:
        return math.nan
    d = (a.double() - golden.double()).abs()
    return math.inf if torch.isnan(d).any() else d.mean().item()


def measure(S: int, impls: list[str], device, B: int = 2, H: int = 8, D: int = 128,
            seeds: int = 1, cases: str | None = None, per_seed: bool = False) -> list[dict]:
    """One row per (case, tensor): each implementation's mean |golden - result|, averaged over
    ``seeds`` fresh draws of q, k, v and dout (the tables stay). ``cases``: only the cases whose
    name contains this string. ``per_seed``: also print, per seed and captured table, each
    implementation's mean |error| and mean signed error (a kernel whose table gradient is
    biased shows a signed mean near its |error|; rounding noise averages out)."""
    rows = []
    runs = {name: _impl(name, device) for name in impls}
    for case, (make, tables, mask_mod) in _cases(S, device).items():
        if cases is not None and cases not in case:
            continue
        def dense(dtype):
            def fn(leaves):
                t = {n: leaves[n].to(dtype) if dtype == torch.float64 else leaves[n]
                     for n in tables}
                return oracle.dense_attention(leaves["q"], leaves["k"], leaves["v"], make(t),
                                              mask_mod, dtype=dtype)[0]
            return fn

        sums: dict = {}
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            q, k, v, do = (torch.randn(B, H, S, D, generator=g).to(torch.bfloat16).to(device)
                           for _ in range(4))
            results = {"golden": _grads(dense(torch.float64), q, k, v, tables, do.double()),
                       "eager": _grads(dense(torch.bfloat16), q, k, v, tables, do)}
            for name, run in runs.items():
                try:
                    results[name] = _grads(
                        lambda lv: run(lv["q"], lv["k"], lv["v"],
                                       make({n: lv[n] for n in tables}), mask_mod),
                        q, k, v, tables, do)
                except Exception as e:  # noqa: BLE001  (recorded in the table, not hidden)
                    print(f"[grad_accuracy] {case} {name}: {type(e).__name__}: {e}", flush=True)
                    results[name] = None
            gold_out, gold = results["golden"]
            if per_seed:
                for tensor in tables:
                    line = {"case": case, "tensor": tensor, "seed": seed,
                            "fields": ["mean |error|", "mean error", "mean |error beyond out|"]}
                    for name, res in results.items():
                        if name != "golden" and res is not None:
                            d = res[1][tensor].double() - gold[tensor].double()
                            beyond = math.nan
                            if _reads_stored_output(name):
                                part = _from_out(make, mask_mod, q, k, tables, gold_out, res[0], do)
                                beyond = (d - part[tensor]).abs().mean().item()
                            line[name] = [d.abs().mean().item(), d.mean().item(), beyond]
                    print(json.dumps(line), flush=True)
            for name, res in results.items():
                if name == "golden":
                    continue
                errs = {t: math.nan for t in _tensors(tables)}
                if res is not None:
                    out, grads = res
                    errs.update({t: _err(out if t == "out" else grads[t], gold_out if t == "out"
                                         else gold[t]) for t in ["out", "q", "k", "v", *tables]})
                    errs[ROW_PROJECTION] = _row_projection(out, gold_out, do)
                    if _reads_stored_output(name):
                        part = _from_out(make, mask_mod, q, k, tables, gold_out, out, do)
                        for t in ["q", "k", *tables]:
                            errs[t + BEYOND_OUT] = _err(grads[t].double() - part[t], gold[t])
                for t, err in errs.items():
                    sums[(t, name)] = sums.get((t, name), 0.0) + err / seeds
        for tensor in _tensors(tables):
            row = {"case": case, "tensor": tensor, "seeds": seeds,
                   **{name: sums[(tensor, name)] for name in ["eager"] + impls}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def report(rows: list[dict], impls: list[str]) -> str:
    flex = [i for i in impls if i.startswith("flexjit-")]
    torch_ref = "torch-flex-triton" if "torch-flex-triton" in impls else None
    head = ["case", "tensor", "eager"] + [f"{i} ÷eager" for i in impls]
    if torch_ref:
        head += [f"{i} ÷{torch_ref}" for i in flex]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["case"], r["tensor"], f"{r['eager']:.3g}"]
        cells += [f"{r[i] / r['eager']:.2f}" if r["eager"] and not math.isnan(r["eager"]) else "-"
                  for i in impls]
        if torch_ref:
            cells += [f"{r[i] / r[torch_ref]:.2f}" if r[torch_ref] else "-" for i in flex]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--S", type=int, default=1024)
    p.add_argument("--impls", default="flexjit-cute,flexjit-triton,torch-flex-triton",
                   help="also flexjit-FWD+BWD: one backend's forward into another's backward")
    p.add_argument("--seeds", type=int, default=1, help="fresh inputs per case, errors averaged")
    p.add_argument("--cases", default=None, help="only the cases whose name contains this")
    p.add_argument("--per-seed", action="store_true",
                   help="print each seed's |error| and signed error of the captured tables")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    impls = a.impls.split(",")
    rows = measure(a.S, impls, device, seeds=a.seeds, cases=a.cases, per_seed=a.per_seed)
    md = report(rows, impls)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        Path(a.out, "results.json").write_text(json.dumps(rows, indent=1))
        Path(a.out, "results.md").write_text(md)


if __name__ == "__main__":
    main()
