"""Training steps of Hugging Face models with each attention implementation.

    python -m benchmarks.train_step --out OUT/train

For each model and sequence length, the same randomly initialised model (same seed, same
weights) trains the same batches for a few AdamW steps under ``torch.autocast("cuda",
torch.bfloat16)`` with attn_implementation "sdpa", "eager", "flex_attention" (transformers' own
torch flex integration, compiled by transformers) and "flexjit". A step is forward, backward and
the optimizer step, synchronised; the first ``--warmup`` steps (compiles) are not timed, nor the
passes (no optimizer step) that let flexjit's tuner settle, and the median of the rest is
``step_ms``. ``correct``: the implementation computes the model's attention (sdpa has no
softcapping, so it is not correct on Gemma 2) and its losses stay within ``--loss-tol`` of eager
attention's at every step.

Models (small, attention-heavy enough to show): Llama, 4 layers, hidden 1024, 8 query / 4 KV
heads of 128, vocab 32000; Gemma 2 of the same size with attention softcap 50, final softcap 30,
and alternating 1024-token sliding-window layers. Batch = 8192 tokens / seq.

DIR/results.json: rows with model, impl, seq, batch, step_ms, loss_first, loss_last, correct
(and the losses, the max deviation from eager, errors); DIR/results.md: the table, printed last.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from .run import settle_tuner, tuner_undecided

IMPLS = ("sdpa", "eager", "flex_attention", "flexjit")
NO_SOFTCAP = {"sdpa"}  # implementations that ignore attn_logit_softcapping


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.train_step", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="llama,gemma2")
    p.add_argument("--seqs", default="2048,8192")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--tokens", type=int, default=8192, help="batch * seq (default 8192)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    p.add_argument("--loss-tol", type=float, default=0.02, help="max |loss - eager loss| per step")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke runs and tests)")
    return p.parse_args(argv)


def config(model: str, tiny: bool = False):
    import transformers

    common = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                  max_position_embeddings=8192, attention_dropout=0.0)
    if tiny:
        common.update(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if model == "llama":
        return transformers.LlamaConfig(**common)
    if model == "gemma2":
        return transformers.Gemma2Config(**common, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                         sliding_window=1024, query_pre_attn_scalar=128,
                                         layer_types=["sliding_attention", "full_attention"]
                                         * (common["num_hidden_layers"] // 2))
    raise SystemExit(f"unknown model {model}")


def train(model_name: str, impl: str, seq: int, args, batches) -> dict:
    import transformers

    if impl == "flexjit":
        import flexjit.integrations.transformers  # noqa: F401  (registers the implementation)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config(model_name, args.tiny)),
                                                          attn_implementation=impl).to(args.device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, times = [], []
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def forward_backward(ids):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    open_before = tuner_undecided()
    for i, ids in enumerate(batches):
        if i == args.warmup:
            # Untimed forward and backward passes until flexjit's tuner has decided the shape
            # classes the warm-up opened; their gradients are dropped, so training is unchanged.
            settle_tuner(tuner_undecided() - open_before,
                         lambda: (forward_backward(ids), opt.zero_grad(set_to_none=True)))
        sync()
        t0 = time.perf_counter()
        loss = forward_backward(ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss))
    timed = times[args.warmup:]
    return {"step_ms": statistics.median(timed), "step_ms_all": times, "losses": losses,
            "loss_first": losses[0], "loss_last": losses[-1]}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    rows, t_start = [], time.time()
    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    for model_name in args.models.split(","):
        for seq in (int(s) for s in args.seqs.split(",")):
            batch = args.tokens // seq
            g = torch.Generator().manual_seed(seq)
            vocab = config(model_name, args.tiny).vocab_size
            batches = [torch.randint(0, vocab, (batch, seq), generator=g).to(args.device)
                       for _ in range(args.warmup + args.steps)]
            group = []
            for impl in args.impls.split(","):
                row = dict(model=model_name, impl=impl, seq=seq, batch=batch)
                if args.budget_s and time.time() - t_start > args.budget_s:
                    row.update(status="skipped: time budget", correct=False, step_ms=None)
                else:
                    try:
                        row.update(train(model_name, impl, seq, args, batches), status="ok")
                    except Exception as e:
                        row.update(status="error", correct=False, step_ms=None,
                                   error=f"{type(e).__name__}: {str(e)[:400]}")
                        traceback.print_exc()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                group.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "step_ms_all"}), flush=True)
            eager = next((r for r in group if r["impl"] == "eager" and r["status"] == "ok"), None)
            for r in group:
                if r["status"] != "ok":
                    continue
                dev = max(abs(a - b) for a, b in zip(r["losses"], eager["losses"])) if eager else None
                r["max_loss_dev_vs_eager"] = dev
                wrong_model = model_name == "gemma2" and r["impl"] in NO_SOFTCAP
                r["correct"] = bool(dev is not None and dev <= args.loss_tol and not wrong_model)
                if wrong_model:
                    r["note"] = "ignores attn_logit_softcapping"
            rows += group
            (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _report(rows, out, meta)
    return 0


def _report(rows, out: Path, meta: dict) -> None:
    lines = [f"{meta['gpu']}, torch {meta['torch']}, transformers {meta['transformers']}, {meta['date']}", "",
             "| model | seq | batch | impl | step ms | loss first → last | max |Δloss| vs eager | correct | vs sdpa |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sdpa = next((x for x in rows if x["model"] == r["model"] and x["seq"] == r["seq"]
                     and x["impl"] == "sdpa" and x.get("step_ms")), None)
        ratio = f"{r['step_ms'] / sdpa['step_ms']:.2f}×" if r.get("step_ms") and sdpa else "—"
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r['seq']} | {r['batch']} | {r['impl']} | {r.get('status')} "
                         f"{r.get('error', '')[:80]} | | | False | |")
            continue
        dev = r.get("max_loss_dev_vs_eager")
        lines.append(f"| {r['model']} | {r['seq']} | {r['batch']} | {r['impl']} | {r['step_ms']:.1f} | "
                     f"{r['loss_first']:.4f} → {r['loss_last']:.4f} | "
                     f"{'—' if dev is None else f'{dev:.4f}'} | {r['correct']}{' (' + r['note'] + ')' if r.get('note') else ''} | {ratio} |")
    text = "\n".join(lines)
    (out / "results.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
