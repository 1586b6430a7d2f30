"""An installed, non-editable flexjit must still find its kernel templates."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_an_installed_wheel_finds_its_templates(tmp_path):
    # The templates reach the package through packaging alone: a wheel (what `pip install .`
    # installs) ships every template, and an installed copy imports them as flexjit.templates.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("flexjit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n[len("flexjit/templates/"):] for n in names if n.startswith("flexjit/templates/")}
    expected = {p.relative_to(ROOT / "templates").as_posix() for p in (ROOT / "templates").rglob("*.py")}
    assert expected and expected <= shipped, expected - shipped
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            f"sys.path.insert(0, {str(site)!r}); import flexjit, flexjit.templates.triton as t; "
            "from flexjit.backends.triton.render import template_text; "
            "assert flexjit.__file__.startswith(sys.path[0]) and t.__file__.startswith(sys.path[0]); "
            "assert '{{SCORE_MOD}}' in template_text('fwd'); print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_version_and_demo_argument_errors():
    # `flexjit --version`, and argparse's own error (exit 2) for a bad demo argument.
    run = lambda *a: subprocess.run([sys.executable, "-m", "flexjit", *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=ROOT)
    import flexjit
    res = run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"flexjit {flexjit.__version__}"
    for bad, why in ((["demo", "--seq-len", "-5"], "at least 128"), (["demo", "--seq-len", "x"], "not an integer"),
                     (["demo", "--bogus"], "unrecognized arguments")):
        res = run(*bad)
        assert res.returncode == 2 and why in res.stderr and "Traceback" not in res.stderr, res.stderr
