"""The benchmark records under benchmarks/results/ and their generated tables (CPU, no flexjit import)."""

import json
from pathlib import Path

import pytest

from benchmarks import records

RECORDS = records.record_dirs()


def test_records_exist():
    assert RECORDS, "no record folders under benchmarks/results/<machine>/<capability>/"
    names = {(d.parent.name, d.name) for d in RECORDS}
    for cap in ("prefill", "decode", "train_step"):
        assert ("h200", cap) in names
    # nothing else lives beside the records
    root = records.RESULTS
    assert sorted(p.name for p in root.iterdir()) == sorted({d.parent.name for d in RECORDS})
    assert sum(1 for p in root.rglob("*") if p.is_file()) <= 80


@pytest.mark.parametrize("d", RECORDS, ids=lambda d: f"{d.parent.name}/{d.name}")
def test_record_folder(d):
    assert sorted(p.name for p in d.iterdir()) == sorted(records.RECORD_FILES)
    rows = json.loads((d / "results.json").read_text())
    meta = json.loads((d / "meta.json").read_text())
    assert isinstance(rows, list) and rows
    for key in records.REQUIRED_META:
        assert key in meta, key
    assert set(records.VERSION_KEYS) <= set(meta["versions"])
    assert meta["machine"] == d.parent.name and meta["capability"] == d.name
    assert meta["format"] in records.FORMATS
    for run in meta["runs"]:
        for key in records.REQUIRED_RUN:
            assert run.get(key) not in (None, ""), key
        assert run.get("format", meta["format"]) in records.FORMATS
        assert "/tmp/" not in run["command"] and "/root/" not in run["command"]
    records.check_meta(meta, len(rows))  # the runs' row slices cover results.json exactly
    assert (d / "results.md").read_text() == records.render_md(rows, meta)


def test_write_record_reads_back(tmp_path):
    rows = [{"impl": "flexjit-cute", "variant": "causal", "S": 2048, "B": 8, "Hq": 16, "Hkv": 16, "D": 128,
             "dtype": "bf16", "pass": "fwd", "tflops": 500.0, "status": "ok", "error": None},
            {"impl": "fa4", "variant": "causal", "S": 2048, "B": 8, "Hq": 16, "Hkv": 16, "D": 128,
             "dtype": "bf16", "pass": "fwd", "tflops": 400.0, "status": "ok", "error": None}]
    meta = {"machine": "h200", "device": "NVIDIA H200", "versions": {"torch": "2.11"},
            "command": "python3 -m benchmarks.run --out $OUT/x", "date": "2026-01-01", "git": "abc1234"}
    d = records.write_record(tmp_path / "h200" / "x", rows, meta)
    back, m = records.load_record(d)
    assert back == rows
    assert m["format"] == "benchmarks.run" and m["runs"][0]["rows"] == [0, 2]
    assert m["versions"]["python"] is None and m["versions"]["torch"] == "2.11"
    md = (d / "results.md").read_text()
    assert "| causal | 2k | 8 | 500.0 | 400.0 | fa4 400.0 | 1.25 |" in md
    with pytest.raises(ValueError):
        records.check_meta({**m, "runs": [{**m["runs"][0], "rows": [0, 1]}]}, 2)
    # a benchmark's own meta.json becomes a record's, --out rewritten and nothing else
    run_meta = {"command": "python3 -m benchmarks.run --out /x/y --S 2k", "date": "2026-01-02",
                "git": "def5678", "gpu": "NVIDIA H200", "torch": "2.11"}
    m2 = records.meta_from_output(run_meta, "prefill", "h200")
    assert m2["command"] == "python3 -m benchmarks.run --out $OUT/prefill --S 2k"
    assert (m2["device"], m2["git"], m2["versions"]["torch"]) == ("NVIDIA H200", "def5678", "2.11")
    d2 = records.write_record(tmp_path / "h200" / "prefill", rows, m2)
    assert records.load_record(d2)[1]["runs"][0]["git"] == "def5678"


SYNTHETIC = """# Title

Some text.

<!-- records:begin alpha -->
| old | table |
|---|---|
| 1 | 2 |
<!-- records:end alpha -->

Between.
<!-- records:begin beta -->
<!-- records:end beta -->
End.
"""


def test_compile_time_output_becomes_a_record(tmp_path):
    from benchmarks import compile_time

    res = {"variant": "alibi", "head_dim": 128, "export_s": [0.25, 0.125], "load_s": [0.004],
           "kernels": [{"part": "fwd-main", "total_s": 4.0, "python_s": 1.5, "backend_s": 2.5,
                        "ptxas_s": 0.5, "jit_s": 0.0},
                       {"part": "bwd-pre", "total_s": 0.25, "python_s": 0.125, "backend_s": 0.125,
                        "ptxas_s": None, "jit_s": 0.0}]}
    rows = compile_time.rows_of(res)
    assert [r["load_s"] for r in rows] == [0.004, None]
    meta = {"machine": "cpu", "device": "CPU", "versions": {}, "date": "2026-01-01", "git": "abc1234",
            "command": "python -m benchmarks.compile_time --out $OUT/compile_time"}
    d = records.write_record(tmp_path / "cpu" / "compile_time", rows, meta)
    assert records.load_record(d)[1]["format"] == "benchmarks.compile_time"
    md = (d / "results.md").read_text()
    assert "| alibi | 128 | fwd-main | 4.00 | 1.50 | 2.50 | 0.50 | 0.25 | 0.004 |" in md
    assert "| alibi | 128 | bwd-pre | 0.25 | 0.12 | 0.12 | – | 0.12 | – |" in md


def test_replace_blocks_exact():
    new = records.replace_blocks(SYNTHETIC, {"alpha": "| a |\n|---|\n| 3 |\n\nSource: x.", "beta": "B"})
    assert new == """# Title

Some text.

<!-- records:begin alpha -->
| a |
|---|
| 3 |

Source: x.
<!-- records:end alpha -->

Between.
<!-- records:begin beta -->
B
<!-- records:end beta -->
End.
"""
    assert records.marker_names(SYNTHETIC) == ["alpha", "beta"]
    # idempotent, and text without markers is untouched
    assert records.replace_blocks(new, {"alpha": "| a |\n|---|\n| 3 |\n\nSource: x.", "beta": "B"}) == new
    assert records.replace_blocks("no markers\n", {}) == "no markers\n"


def test_replace_blocks_errors():
    with pytest.raises(ValueError, match="no '<!-- records:end alpha -->'"):
        records.replace_blocks("<!-- records:begin alpha -->\nx\n", {"alpha": ""})
    with pytest.raises(ValueError, match="unknown records table 'gamma'"):
        records.replace_blocks("<!-- records:begin gamma -->\n<!-- records:end gamma -->\n", {})


def test_readme_check(tmp_path, capsys):
    blocks = records.readme_blocks()
    assert set(blocks) == set(records.README_TABLES)
    for name, text in blocks.items():
        path = records.README_TABLES[name][0]
        assert text.splitlines()[-1].startswith(f"Source: `benchmarks/results/{path}`, ")
    good = "\n".join(f"<!-- records:begin {n} -->\n{t}\n<!-- records:end {n} -->" for n, t in blocks.items()) + "\n"
    readme = tmp_path / "README.md"
    readme.write_text(good)
    assert records.main(["readme", "--check", str(readme)]) == 0
    readme.write_text(good.replace("<!-- records:end decode -->", "| stale |\n<!-- records:end decode -->"))
    assert records.main(["readme", "--check", str(readme)]) == 1
    assert "-| stale |" in capsys.readouterr().out
    assert records.main(["readme", str(readme)]) == 0
    assert readme.read_text() == good
