"""The first step's time: a fresh process's first attention call and first training step, with
an empty compile cache (cold) and again with the cache the cold process filled (warm).

    python3 -m benchmarks.cold_start --out DIR            # the H200 run (about 4 minutes)
    python3 -m benchmarks.cold_start --out DIR --tiny     # CPU smoke: tiny shapes, reference backend

Cases, each timed in its own fresh subprocess from the first call to its synchronised end
(imports, model construction and inputs are before the clock):

* ``alibi_causal_fwd``: one forward, ALiBi-causal, B=2 H=16 S=4k D=128 bf16, no gradients;
* ``alibi_causal_fwdbwd``: the same with q/k/v requiring grad: forward, then ``sum().backward()``;
* ``llama_step`` / ``gemma2_step``: the first AdamW step (forward, backward, optimizer) of
  ``benchmarks.train_step``'s models (4 layers, hidden 1024, 8/4 heads of 128; Gemma 2 with
  softcap 50 and 1024-token sliding windows), seq 4096, batch 2, autocast bf16.

Impls: ``flexjit``; ``sdpa`` (ALiBi as a dense additive bias with the causal mask in it;
transformers' "sdpa"); ``torch-flex`` (torch's flex_attention under torch.compile; transformers'
"flex_attention"). Cold: a new empty folder for flexjit's disk cache and inductor's and Triton's
caches; warm: a second process on the same folders. DIR/results.json: rows ``{case, impl,
cold_s, warm_s}`` (and ``status``/``error``); DIR/results.md the table; DIR/meta.json what ran.
``--budget-s`` stops starting processes once spent (the rest are recorded as skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CASES = ("alibi_causal_fwd", "alibi_causal_fwdbwd", "llama_step", "gemma2_step")
IMPLS = ("flexjit", "sdpa", "torch-flex")
HF_IMPL = {"flexjit": "flexjit", "sdpa": "sdpa", "torch-flex": "flex_attention"}
REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
case, impl, device, tiny = json.loads(sys.argv[1])
import torch
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
if case.startswith("alibi"):
    B, H, S, D = (1, 2, 256, 64) if tiny else (2, 16, 4096, 128)
    grad = case.endswith("fwdbwd")
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16, requires_grad=grad)
               for _ in range(3))
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)
    if impl == "flexjit":
        import flexjit
        from flexjit import mods
        bm = flexjit.create_block_mask(mods.causal(), None, None, S, S, device=device)
        alibi = mods.alibi(H)
        run = lambda: flexjit.flex_attention(q, k, v, score_mod=alibi, block_mask=bm)
    elif impl == "sdpa":
        pos = torch.arange(S, device=device)
        rel = (pos[None, :] - pos[:, None]).float()
        bias = (slopes[:, None, None] * rel).masked_fill(rel > 0, float("-inf"))
        bias = bias.to(torch.bfloat16)[None]
        run = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=device)

        def alibi(score, b, h, qi, ki):
            return score + slopes[h] * (ki - qi)
        flex = torch.compile(flex_attention) if device == "cuda" else flex_attention
        run = lambda: flex(q, k, v, score_mod=alibi, block_mask=bm)
    sync()
    t0 = time.perf_counter()
    out = run()
    if grad:
        out.float().sum().backward()
    sync()
else:
    import copy
    import transformers
    if impl == "flexjit":
        import flexjit.integrations.transformers  # noqa: F401  (registers "flexjit")
    from benchmarks.train_step import config
    model_name = case.removesuffix("_step")
    torch.manual_seed(0)
    cfg = copy.deepcopy(config(model_name, tiny))
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=HF_IMPL)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seq, batch = (128, 1) if tiny else (4096, 2)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    sync()
    t0 = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sync()
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def child(case: str, impl: str, device: str, tiny: bool, cache: Path, timeout: float) -> float:
    """Seconds of the case's first call in a fresh process on ``cache``'s folders."""
    env = dict(os.environ, FLEXJIT_CACHE_DIR=str(cache / "flexjit"),
               TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    script = textwrap.dedent(CHILD).replace("HF_IMPL)", f"{HF_IMPL[impl]!r})")
    res = subprocess.run([sys.executable, "-c", script, json.dumps([case, impl, device, tiny])],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else
                           f"exit code {res.returncode}")
    return json.loads(res.stdout.strip().splitlines()[-1])["seconds"]


def measure(case: str, impl: str, args, deadline: float) -> dict:
    row = {"case": case, "impl": impl, "cold_s": None, "warm_s": None}
    with tempfile.TemporaryDirectory(prefix="flexjit-cold-") as folder:
        for field in ("cold_s", "warm_s"):
            left = deadline - time.monotonic()
            if left <= 0:
                row["status"] = "skipped: time budget"
                return row
            try:
                row[field] = child(case, impl, args.device, args.tiny, Path(folder), left)
            except subprocess.TimeoutExpired:
                row["status"] = "skipped: time budget"
                return row
            except Exception as e:
                row.update(status="error", error=str(e)[:400])
                return row
    row["status"] = "ok"
    return row


def table(rows: list) -> str:
    lines = ["| case | impl | cold s | warm s |", "|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]:.2f}" if isinstance(r[k], float) else "–" for k in ("cold_s", "warm_s")]
        note = "" if r.get("status") == "ok" else f" ({r.get('error') or r.get('status')})"
        lines.append(f"| {r['case']} | {r['impl']}{note} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def environment(module: str, argv) -> dict:
    """A run's meta.json: ``python3 -m <module> <argv>``, date, git, device and versions."""
    import torch

    def version(name):
        try:
            from importlib import metadata
            return metadata.version(name)
        except Exception:
            return None
    git = os.environ.get("FLEXJIT_GIT_SHA") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"command": f"python3 -m {module} " + " ".join(argv),
            "date": time.strftime("%Y-%m-%d"), "git": git,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "python": platform.python_version(), "torch": torch.__version__,
            "triton": version("triton"), "cuda": torch.version.cuda,
            "flash-attn-4": None, "nvidia-cutlass-dsl": version("nvidia-cutlass-dsl"),
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
            "transformers": version("transformers"), "cpus": os.cpu_count()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.cold_start",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and models (CPU smoke runs)")
    p.add_argument("--budget-s", type=float, default=285.0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    rows = []
    for impl in args.impls.split(","):  # flexjit first: the budget reaches it before the rest
        for case in args.cases.split(","):
            if case not in CASES or impl not in IMPLS:
                raise SystemExit(f"unknown case or impl {case}/{impl}: {CASES}, {IMPLS}")
            rows.append(measure(case, impl, args, deadline))
            print(json.dumps(rows[-1]), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "meta.json").write_text(json.dumps(environment("benchmarks.cold_start", argv), indent=1) + "\n")
    (out / "results.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
