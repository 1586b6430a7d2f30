"""The repository holds the product: the checks that keep it so (CPU, no kernels).

What a clone shows must be flexjit itself: one current record per benchmarked capability,
imports that run one way through the pipeline, one place that reads the environment, short
files and short docs.
"""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import records
from flexjit import config

ROOT = Path(__file__).resolve().parent.parent


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.split() if (ROOT / p).is_file()]


def test_benchmark_records_are_few_and_current():
    results = [p for p in _tracked() if "benchmarks/results/" in p.as_posix()]
    assert len(results) <= 80, len(results)
    # nothing beside the records: each file is one of a record's three, in a record's folder
    stray = [p for p in results if p.name not in records.RECORD_FILES or not (p.parent / "meta.json").exists()]
    assert not stray, stray


def _package_files():
    return sorted(list((ROOT / "flexjit").rglob("*.py")) + list((ROOT / "templates").rglob("*.py")))


def test_no_package_file_is_over_1200_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in _package_files()
            if (n := len(p.read_text().splitlines())) > 1200}
    assert not long, long


def _function_level_imports():
    found = []
    for path in _package_files():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                own = (isinstance(node, ast.ImportFrom) and
                       (node.level or (node.module or "").startswith("flexjit"))) or \
                      (isinstance(node, ast.Import) and
                       any(a.name.startswith("flexjit") for a in node.names))
                if own:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return sorted(set(found))


def test_imports_of_our_own_modules_are_at_module_level():
    # The exceptions import what takes seconds and few runs need: the CuTe templates (they
    # import cutlass; only a CuTe kernel build needs them) and, in the command line's
    # `warmup --model`, the transformers integration.
    found = _function_level_imports()
    assert len(found) <= 7, found
    assert all(f.startswith("flexjit/backends/cute/") or f.startswith("flexjit/__main__.py")
               for f in found), found
    assert sum(f.startswith("flexjit/__main__.py") for f in found) <= 1, found


def test_the_layers_contract_holds():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    res = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]


def test_readme_lists_exactly_the_variables_flexjit_reads():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(FLEXJIT_[A-Z0-9_]+)", section))
    assert listed == set(config.VARIABLES), (listed, config.VARIABLES)
    assert len(config.VARIABLES) <= 7


def test_docs_are_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    words = sum(len(p.read_text().split()) for p in (ROOT / "docs").rglob("*.md"))
    assert words <= 9000, words
