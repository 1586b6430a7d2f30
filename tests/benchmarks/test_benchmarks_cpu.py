"""The benchmark scripts run end to end on the CPU (smoke sizes), so a broken script is caught
here rather than on the GPU. Every timed row is checked by the harness against its fp32
reference before it is timed; the tests assert that check passed."""
import json
import math
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before any cutlass import (sass_compare)

pytest.importorskip("numpy")


def test_run_checks_and_times_each_row(tmp_path):
    from benchmarks import run
    out = tmp_path / "bench"
    run.main(["--out", str(out), "--device", "cpu", "--impls", "flexjit-reference,torch-flex-eager",
              "--variants", "causal,alibi", "--S", "256", "--tokens", "512", "--passes", "fwd,fwdbwd",
              "--no-png", "--rep-ms", "5", "--warmup-ms", "1"])
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 2 * 2 * 2  # impls x variants x passes
    for r in rows:
        if r["impl"] == "torch-flex-eager" and r["pass"] == "fwdbwd":
            # torch's FlexAttention has no backward on the CPU: the harness says so and skips.
            assert r["status"] == "skipped" and "backward on CPU" in r["error"], r
        else:
            assert r["status"] == "ok" and r["correct"] and r["ms"] > 0, r


def test_run_takes_unequal_head_dims_and_one_long_sequence(tmp_path):
    # --d 64/32: v's head dim apart from q/k's (checked against the reference like any row);
    # an S above --tokens runs one sequence.
    from benchmarks import report, run
    out = tmp_path / "bench"
    run.main(["--out", str(out), "--device", "cpu", "--impls", "flexjit-reference", "--variants", "causal",
              "--S", "512", "--tokens", "256", "--d", "64/32", "--passes", "fwd,fwdbwd", "--no-png",
              "--rep-ms", "5", "--warmup-ms", "1"])
    rows = json.loads((out / "results.json").read_text())
    assert [(r["B"], r["S"], r["D"], r["Dv"]) for r in rows] == [(1, 512, 64, 32)] * 2
    assert all(r["status"] == "ok" and r["correct"] for r in rows), rows
    # FLOPs count QK^T at D and PV at Dv: 2*B*Hq*S^2*(D+Dv)*density forward
    fwd = next(r for r in rows if r["pass"] == "fwd")
    assert fwd["flops"] == pytest.approx(2 * 16 * 512 ** 2 * (64 + 32) * fwd["density"])
    assert "D=64/32" in report.table(rows)
    assert run.parse_head_dims("128,192/128") == [(128, 128), (192, 128)]
    assert run.parse_sizes("128k") == [131072]
    assert run.parse_sizes("2k, 8192,1M,0.5k") == [2048, 8192, 1 << 20, 512]
    for bad in ("8q", "1.3k", "-2k", "k"):
        with pytest.raises(SystemExit):
            run.parse_sizes(bad)
    from benchmarks import records
    assert [records._size(n) for n in (512, 8192, 1 << 20, 3 << 20)] == ["512", "8k", "1M", "3M"]


def test_timing_waits_for_the_tuner(tmp_path, monkeypatch):
    """A case whose first call opened a shape class for flexjit's tuner is called again until
    the class is decided, and only then timed (``tune_s``); a class that never settles is an
    error, not a timing of the heuristic's configuration under the compiles' load."""
    from benchmarks import run
    answers = iter([frozenset(), frozenset({"cls"}), frozenset({"cls"}), frozenset({"cls"})])
    monkeypatch.setattr(run, "tuner_undecided", lambda: next(answers, frozenset()))
    out = tmp_path / "bench"
    run.main(["--out", str(out), "--device", "cpu", "--impls", "flexjit-reference", "--variants",
              "causal", "--S", "256", "--tokens", "256", "--passes", "fwd", "--no-png", "--rep-ms", "5",
              "--warmup-ms", "1"])
    (row,) = json.loads((out / "results.json").read_text())
    assert row["status"] == "ok" and row["correct"] and row["tune_s"] >= 0.5, row  # two calls

    calls = []
    monkeypatch.setattr(run, "tuner_undecided", lambda: frozenset({"cls"}))
    with pytest.raises(TimeoutError, match="1 shape class"):
        run.settle_tuner(frozenset({"cls"}), lambda: calls.append(1), timeout_s=0.3)
    assert calls
    from flexjit.runtime import autotune
    assert autotune.undecided() == frozenset()  # nothing is tuned on the CPU


def test_ab_runs_each_tree_on_its_own_code(tmp_path, capfd):
    """benchmarks.ab: each tree's run imports flexjit and its kernels from that tree, the
    baselines run once (first tree, first run), and the table has every tree's numbers."""
    import shutil
    from pathlib import Path

    from benchmarks import ab
    root = Path(__file__).resolve().parents[2]
    for name in ("a", "b"):
        for part in ("flexjit", "templates", "benchmarks"):
            shutil.copytree(root / part, tmp_path / name / part,
                            ignore=shutil.ignore_patterns("__pycache__", "results"))
    out = tmp_path / "out"
    assert ab.main(["--tree", f"a={tmp_path / 'a'}", "--tree", f"b={tmp_path / 'b'}", "--runs", "1",
                    "--out", str(out), "--", "--device", "cpu", "--impls",
                    "flexjit-reference,torch-flex-eager", "--variants", "causal", "--S", "256",
                    "--tokens", "256", "--passes", "fwd", "--no-png", "--rep-ms", "5",
                    "--warmup-ms", "1"]) == 0
    printed = capfd.readouterr().out
    for name in ("a", "b"):
        assert f"flexjit from {tmp_path / name / 'flexjit'} kernels from {tmp_path / name / 'templates'}" in printed
        assert json.loads((out / f"{name}-1" / "meta.json").read_text())["git"] == f"tree {name}"
    impls = {n: {r["impl"] for r in json.loads((out / f"{n}-1" / "results.json").read_text())} for n in "ab"}
    assert impls == {"a": {"flexjit-reference", "torch-flex-eager"}, "b": {"flexjit-reference"}}
    row = next(line for line in (out / "ab.md").read_text().splitlines() if "flexjit-reference" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(float(c.split("-")[0]) > 0 for c in cells[6:8]) and cells[8] == "", row


def test_long_sequences_are_checked_on_one_kv_head(tmp_path, monkeypatch):
    # From REF_ONE_HEAD_FROM_S on, the reference covers the first KV head's group only (GQA
    # 16/4 here: query heads 0-3 and KV head 0); the rows are still checked and pass.
    from benchmarks import run
    monkeypatch.setattr(run, "REF_ONE_HEAD_FROM_S", 256)
    shapes, reference = [], run.attention_reference
    monkeypatch.setattr(run, "attention_reference",
                        lambda q, k, v, *a: shapes.append((q.shape[1], k.shape[1])) or reference(q, k, v, *a))
    out = tmp_path / "bench"
    run.main(["--out", str(out), "--device", "cpu", "--impls", "flexjit-reference", "--variants", "alibi",
              "--S", "256", "--tokens", "256", "--hkv", "4", "--passes", "fwdbwd", "--no-png",
              "--rep-ms", "5", "--warmup-ms", "1"])
    (row,) = json.loads((out / "results.json").read_text())
    assert row["status"] == "ok" and row["correct"], row
    assert set(row["check"]) == {"out", "dq", "dk", "dv"}
    assert shapes == [(4, 1), (4, 1)]  # fp32 and bf16 references, one KV head's group


def test_grad_accuracy_reports_errors_against_float64(tmp_path):
    # On the CPU only the reference backend runs; its errors are far below bf16 eager math's.
    from benchmarks import grad_accuracy
    rows = grad_accuracy.measure(64, ["flexjit-reference"], "cpu", B=1, H=2, D=16)
    tensors = {(r["case"], r["tensor"]) for r in rows}
    assert ("two_tables(bf16 q, fp32 kv)", "bias2") in tensors and ("rel_bias", "q") in tensors
    for r in rows:
        if r["tensor"].endswith(grad_accuracy.BEYOND_OUT):
            # the split applies to flash backwards only (the reference differentiates its softmax)
            assert math.isnan(r["eager"]) and math.isnan(r["flexjit-reference"]), r
            continue
        assert 0 < r["eager"] and 0 <= r["flexjit-reference"] < r["eager"], r
    assert "| rel_bias | q |" in grad_accuracy.report(rows, ["flexjit-reference"])
    assert "| rel_bias | q beyond out | nan | - |" in grad_accuracy.report(rows, ["flexjit-reference"])


def test_flexjit_modes_are_impls(tmp_path):
    # The switches measured beside the default (here skipped: the cute backend needs a GPU).
    from benchmarks import run
    out = tmp_path / "bench"
    run.main(["--out", str(out), "--device", "cpu", "--impls", "flexjit-cute-det,flexjit-cute-persistent",
              "--variants", "causal", "--S", "256", "--tokens", "256", "--passes", "fwd", "--no-png"])
    rows = json.loads((out / "results.json").read_text())
    assert {r["impl"] for r in rows} == {"flexjit-cute-det", "flexjit-cute-persistent"}
    assert all(r["status"] == "skipped" and "CUDA" in r["error"] for r in rows), rows
    # every impl the run accepts has its place in the run order (one without is never run)
    assert set(run.KNOWN_IMPLS) <= set(run.RUN_ORDER), set(run.KNOWN_IMPLS) - set(run.RUN_ORDER)


def test_fp8_impls_run_forward_only_and_are_checked(tmp_path, monkeypatch):
    # flexjit-reference-fp8 reads the sets quantised outside the timed region, and is checked
    # against the attention of the values they hold; a mode whose ``pre`` corrupts v (keys in
    # reverse) must fail that check. No backward for FP8; GPU baselines say they need one.
    # GQA 4/2, so the query's descale is per kv head.
    from benchmarks import impls, run
    monkeypatch.setitem(impls.FLEXJIT_FP8_MODES, "flexjit-reference-fp8-flipped",
                        ("reference", lambda f: (f["q8"], f["k8"], f["v8"].flip(2), {})))
    monkeypatch.setattr(run, "KNOWN_IMPLS", run.KNOWN_IMPLS + ("flexjit-reference-fp8-flipped",))
    monkeypatch.setattr(run, "RUN_ORDER", run.RUN_ORDER + ("flexjit-reference-fp8-flipped",))
    out = tmp_path / "bench"
    run.main(["--out", str(out), "--device", "cpu", "--impls",
              "flexjit-reference,flexjit-reference-fp8,flexjit-reference-fp8-flipped,sdpa-fp8",
              "--variants", "causal,document", "--S", "256", "--tokens", "512", "--hq", "4",
              "--hkv", "2", "--passes", "fwd,fwdbwd", "--no-png", "--rep-ms", "5", "--warmup-ms", "1"])
    rows = json.loads((out / "results.json").read_text())
    by = {(r["impl"], r["variant"], r["pass"]): r for r in rows}
    for v in ("causal", "document"):
        r = by[("flexjit-reference-fp8", v, "fwd")]
        assert r["status"] == "ok" and r["correct"] and r["ms"] > 0, r
        assert r["check"]["out"]["rel"] < 0.2 * r["check"]["out"]["tol_rel"], r["check"]
        assert by[("flexjit-reference-fp8-flipped", v, "fwd")]["status"] == "wrong"
        for impl in ("flexjit-reference-fp8", "flexjit-reference-fp8-flipped", "sdpa-fp8"):
            assert "no backward" in by[(impl, v, "fwdbwd")]["error"]
        assert by[("sdpa-fp8", v, "fwd")]["error"] == "skipped: needs a CUDA GPU"
    assert "reference-fp8 / reference" in (out / "results.md").read_text()


def test_fp8_accuracy_writes_a_record(tmp_path):
    # On the CPU the reference answers: it is the plain FP8 reference's math (ratio 1), and the
    # Hadamard rotation lowers the error on outlier data.
    from benchmarks import fp8_accuracy, records
    out = tmp_path / "cpu" / "fp8_accuracy"
    fp8_accuracy.main(["--out", str(out), "--device", "cpu", "--S", "128", "--d", "32", "--B", "1",
                       "--hq", "2", "--hkv", "1", "--variants", "causal,document"])
    rows, meta = records.load_record(out)
    assert meta["format"] == "benchmarks.fp8_accuracy" and meta["capability"] == "fp8_accuracy"
    assert len(rows) == 2 * 2 * 2 * 2  # variants x data x inputs x rotated
    for r in rows:
        assert r["backend"] == "reference" and r["native"], r
        assert abs(r["ratio_rel"] - 1) < 0.01 and r["within_target"], r
        assert r["rel_bf16"] < 0.2 * r["rel_plain"], r  # bf16 data: no quantisation error
    for v in ("causal", "document"):
        for inputs in ("qkv8", "kv8"):
            rel = {r["rotate"]: r["rel_fp8"] for r in rows
                   if (r["variant"], r["data"], r["inputs"]) == (v, "outliers", inputs)}
            assert rel[True] < 0.7 * rel[False], rel
    assert (out / "results.md").read_text() == records.render_md(rows, meta)
    assert "| causal | 32 | outliers | qkv8 | yes | reference |" in (out / "results.md").read_text()


def test_tune_triton_plans_its_sweep(tmp_path):
    from benchmarks import tune_triton
    tune_triton.main(["--dry-run", "--out", str(tmp_path), "--S", "2k", "--variants", "causal"])
    data = json.loads((tmp_path / "tune_triton.json").read_text())
    assert data["meta"]["command"] and data["rows"]
    assert {r["pass"] for r in data["rows"]} == {"fwd", "fwdbwd"}
    assert sum(r["default"] for r in data["rows"]) == 2  # one default config per pass


def test_host_overhead_checks_its_outputs(tmp_path):
    from benchmarks import host_overhead
    host_overhead.main(["--out", str(tmp_path), "--device", "cpu", "--impls", "flexjit-reference",
                        "--variants", "causal"])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rows and all(r["status"] == "ok" and r["host_us"] > 0 for r in rows), rows


def test_sass_compare_finds_the_forward_loop(capsys):
    # Our side only (FA4 is not installed here): the sm90 forward's steady-state loop issues one
    # QK and one PV GEMM per kv tile, 8 wgmma k-steps each, and 64 exp2 per thread.
    pytest.importorskip("cutlass")
    from benchmarks import sass_compare
    sass_compare.main(["--pass", "fwd"])
    out = capsys.readouterr().out
    assert "flexjit: 168 registers" in out and "steady-state loop path" in out, out
    table = out.split("per 64 query rows per thread")[1].splitlines()[2:]  # after the header
    rows = {line.split()[0]: float(line.split()[1]) for line in table if line.strip()}
    assert rows["HGMMA.64x128x16.F32.BF16"] == 16 and rows["MUFU.EX2"] >= 64, rows


def test_profiling_tools_run_what_the_benchmark_runs(capsys):
    # profile_one and host_profile (both in the GPU plan) build their calls from run.py's
    # adapters, inputs and timed closure; on the CPU the reference backend stands in. profile_one
    # reports the backend flexjit's dispatcher chose for the same inputs and mask.
    from benchmarks import host_profile, profile_one
    profile_one.main(["--device", "cpu", "--backend", "reference", "--variant", "alibi", "--S", "128",
                      "--D", "64", "--iters", "1", "--pass", "fwdbwd"])
    assert capsys.readouterr().out.strip().endswith("ran alibi S=128 on reference")
    # An FP8 impl: inputs quantised once, then the forward (its backward is refused).
    profile_one.main(["--device", "cpu", "--backend", "flexjit-reference-fp8", "--variant", "causal",
                      "--S", "128", "--D", "64", "--iters", "1"])
    assert capsys.readouterr().out.strip().endswith("ran causal S=128 on flexjit-reference-fp8")
    with pytest.raises(SystemExit):
        profile_one.main(["--device", "cpu", "--backend", "flexjit-reference-fp8", "--pass", "fwdbwd"])
    capsys.readouterr()
    host_profile.main(["--device", "cpu", "--backend", "reference", "--variant", "causal",
                       "--pass", "fwdbwd", "--calls", "3", "--top", "40"])
    out = capsys.readouterr().out
    # the profiled frames (with the call cache, torch's autograd fills the first few)
    assert out.startswith("causal fwdbwd on reference: ") and "flexjit" in out


def test_ncu_summary_reads_profile_kernels_output():
    # The recorded s4 forward profile: one row per kernel, with the numbers ncu printed.
    from pathlib import Path

    from benchmarks import ncu_summary
    raw = Path(__file__).parent / "data" / "ncu_fwd.txt"
    rows = ncu_summary.parse(raw.read_text())
    assert [r["case"] for r in rows] == ["cute:full:8192:fwd", "fa4-bhsd:full:8192:fwd",
                                         "cute:causal:8192:fwd", "cute:alibi:8192:fwd",
                                         "cute:document:8192:fwd", "cute:sliding_window:8192:fwd"]
    ours, fa4 = rows[0], rows[1]
    assert ours["kernel"] == "FlexAttentionFwdSm90" and fa4["kernel"] == "FlashAttentionForwardSm90"
    assert (ours["duration"], fa4["duration"], ours["regs"]) == (1530.0, 1510.0, 168.0)
    assert rows[3]["tensor"] == 57.41 and rows[3]["xu"] == 30.33  # ALiBi
    assert "| cute:alibi:8192:fwd | FlexAttentionFwdSm90 | 1010 |" in ncu_summary.table(rows)


def test_train_step_trains_and_compares_losses(tmp_path):
    # benchmarks/train_step.py end to end on a tiny model: every row trained, its losses compared
    # with eager attention's at every step (the correctness column), Gemma 2's sdpa marked as
    # not computing the model (no softcapping).
    pytest.importorskip("transformers")
    from benchmarks import train_step
    out = tmp_path / "train"
    train_step.main(["--out", str(out), "--device", "cpu", "--tiny", "--seqs", "64", "--tokens", "128",
                     "--warmup", "1", "--steps", "1", "--impls", "sdpa,eager,flexjit"])
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == 2 * 3
    for r in rows:
        if r["model"] == "gemma2" and r["impl"] == "sdpa":
            # sdpa cannot softcap: newer transformers refuse it for Gemma 2, older ones run it
            # without; either way the row is not correct.
            assert not r["correct"] and (r["status"] == "ok" or "does not support" in r["error"]), r
            continue
        assert r["status"] == "ok" and r["step_ms"] > 0, r
        assert {"model", "impl", "seq", "batch", "step_ms", "loss_first", "loss_last", "correct"} <= set(r)
        assert r["max_loss_dev_vs_eager"] < 1e-2 and r["correct"], r


def test_plain_preset_is_the_plain_cases_grid():
    from benchmarks import run as run_mod

    a = run_mod.parse_args(["--out", "x", "--plain", "--device", "cpu", "--seed", "1"])
    assert a.S == [2048, 8192, 32768, 131072, 1 << 20]
    assert a.hkv == [16, 4] and a.d == [(64, 64), (128, 128)]
    assert a.variants == ["full", "causal", "sliding_window", "prefix_lm"]
    assert a.impls == ["flexjit-cute", "fa4", "torch-flex-flash"]
    # 2k and 8k fill 16k tokens; 32k, 128k and 1M run one sequence (4 shapes per length).
    assert sorted({(c.S, c.B) for c in run_mod.cases(a)}) == [
        (2048, 8), (8192, 2), (32768, 1), (131072, 1), (1 << 20, 1)]
    # Explicit flags still win over the preset.
    b = run_mod.parse_args(["--out", "x", "--plain", "--S", "8k", "--impls", "fa4", "--device", "cpu"])
    assert b.S == [8192] and b.impls == ["fa4"] and b.hkv == [16, 4]
    assert run_mod.parse_args(["--out", "x", "--device", "cpu"]).variants == list(run_mod.VARIANTS)


def test_decode_modes_parse_to_kernel_options():
    """A --flexjit-modes / --fp8-modes row: short names map to kernel_options keys, cfg=plain
    pins the plain kernel (the empty DECODE_CONFIG, not the length rule), a bare key is refused."""
    from benchmarks.decode import parse_mode
    assert parse_mode("cfg=plain") == {"DECODE_CONFIG": ""}
    assert parse_mode("cfg=prefetch+vbits,BLOCK_N=64,splits=4") == {
        "DECODE_CONFIG": "prefetch+vbits", "BLOCK_N": 64, "DECODE_SPLITS": 4}
    with pytest.raises(SystemExit, match="not key=value"):
        parse_mode("BLOCK_N")


def test_resume_keeps_the_rows_or_refuses(tmp_path):
    """--resume into the same --out: a run with the same grid keeps the measured rows (measures
    nothing again); one whose grid leaves some of them out is refused before it overwrites them."""
    from benchmarks import run
    out = tmp_path / "bench"
    flags = ["--out", str(out), "--device", "cpu", "--impls", "flexjit-reference", "--variants",
             "causal", "--S", "256", "--tokens", "256", "--passes", "fwd", "--no-png",
             "--rep-ms", "2", "--warmup-ms", "1", "--seed", "0"]
    run.main(flags + ["--d", "32"])
    first = json.loads((out / "results.json").read_text())
    assert len(first) == 1 and first[0]["status"] == "ok", first
    run.main(flags + ["--d", "32", "--resume", str(out / "results.json")])
    assert json.loads((out / "results.json").read_text()) == first
    meta = (out / "meta.json").read_text()
    with pytest.raises(SystemExit, match="1 of its rows lie outside this run's grid"):
        run.main(flags + ["--d", "64", "--resume", str(out / "results.json")])
    assert json.loads((out / "results.json").read_text()) == first
    assert (out / "meta.json").read_text() == meta


def test_poisoning_stops_at_the_memory_it_has(monkeypatch):
    """The allocator poisoning allocates eight output-sized blocks at once; where they do not
    fit (1M tokens on an 80 GB card) it keeps the ones that did and the run goes on."""
    import torch
    from benchmarks import run
    from benchmarks.variants import Case
    made = []

    def full(shape, value, dtype, device):
        if len(made) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory")
        made.append((shape, dtype))
        return torch.empty(0)
    monkeypatch.setattr(run.torch, "full", full)
    run.poison_allocator(Case(B=1, S=1 << 20, Hq=16, Hkv=16, D=128), torch.device("cuda"))
    assert len(made) == 3 and made[0] == ((1, 16, 1 << 20, 128), torch.bfloat16)
