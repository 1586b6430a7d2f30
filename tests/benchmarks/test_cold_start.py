"""``benchmarks.cold_start`` in its smallest form on the CPU (tiny shapes, flexjit on the
reference backend, SDPA): every row of a fresh process, cold and warm, and a record from them."""
import json

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_cold_start_times_each_case_in_fresh_processes(tmp_path):
    from benchmarks import cold_start, records

    out = tmp_path / "cold"
    cold_start.main(["--out", str(out), "--tiny", "--device", "cpu", "--impls", "flexjit,sdpa",
                     "--cases", "alibi_causal_fwdbwd,llama_step"])
    rows = json.loads((out / "results.json").read_text())
    assert [(r["case"], r["impl"]) for r in rows] == [
        ("alibi_causal_fwdbwd", "flexjit"), ("llama_step", "flexjit"),
        ("alibi_causal_fwdbwd", "sdpa"), ("llama_step", "sdpa")]
    for r in rows:
        assert r["status"] == "ok", r
        assert 0 < r["cold_s"] < 120 and 0 < r["warm_s"] < 120, r
    meta = json.loads((out / "meta.json").read_text())
    record = records.write_record(tmp_path / "record", rows,
                                  records.meta_from_output(meta, "cold_start", "cpu"))
    assert records.load_record(record)[0] == rows
    assert "| llama_step | flexjit |" in (record / "results.md").read_text()
