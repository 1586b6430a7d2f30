"""An installed, non-editable flexjit must still find its kernel templates."""
import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_ships_templates(tmp_path):
    # Building the wheel takes a few seconds; it is what `pip install .` installs.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("flexjit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n.split("/")[-1] for n in names if n.startswith("flexjit/templates/")}
    expected = {p.name for p in (ROOT / "templates").glob("*.py")}
    assert expected and expected <= shipped, expected - shipped
    assert "flexjit/cache.py" in names


_SOURCE_TREE = """
import sys
# As on the GPU box (PYTHONPATH=<repo>, nothing installed): drop the editable install's finder.
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, sys.argv[1])
import flexjit
try:
    import flexjit.templates
    raise SystemExit("flexjit.templates importable without the source-tree registration")
except ModuleNotFoundError:
    pass
from flexjit.cache import load_template
bwd = importlib.import_module("flexjit.templates.cute.sm90.bwd")
fwd = importlib.import_module("flexjit.templates.cute.sm90.fwd")
assert bwd.__file__.startswith(sys.argv[1]) and fwd.Aux is bwd.Aux
import flexjit.templates.cute_common as common
assert common.Aux is fwd.Aux
host = importlib.import_module("flexjit.templates.cute.sm90.bwd_host")  # a template importing another template's classes
assert host.FlexAttentionBwdSm90 is bwd.FlexAttentionBwdSm90 and host.BwdConfig is bwd.BwdConfig
print("ok")
"""


def test_templates_import_each_other_from_a_source_tree(tmp_path):
    # The templates import their shared module normally (flexjit.templates.cute_common), also
    # where flexjit runs from a source tree and flexjit.templates is no installed package.
    pytest.importorskip("cutlass")
    import shutil
    for part in ("flexjit", "templates"):
        shutil.copytree(ROOT / part, tmp_path / part)
    res = subprocess.run([sys.executable, "-c", _SOURCE_TREE, str(tmp_path)], capture_output=True,
                         text=True, env={**__import__("os").environ, "CUTE_DSL_ARCH": "sm_90a"})
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_version_and_demo_argument_errors():
    # Issue #14: `flexjit --version`, and argparse's own error (exit 2) for a bad demo argument.
    run = lambda *a: subprocess.run([sys.executable, "-m", "flexjit", *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=ROOT)
    import flexjit
    res = run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"flexjit {flexjit.__version__}"
    for bad, why in ((["demo", "--seq-len", "-5"], "at least 128"), (["demo", "--seq-len", "x"], "not an integer"),
                     (["demo", "--bogus"], "unrecognized arguments")):
        res = run(*bad)
        assert res.returncode == 2 and why in res.stderr and "Traceback" not in res.stderr, res.stderr
