"""An installed, non-editable flexjit must still find its kernel templates."""
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
