"""ptxas checks shared by the CuTeDSL compile tests (no GPU needed: Triton's wheel ships ptxas)."""
import shutil
import subprocess
from pathlib import Path

import pytest


def ptxas_report(tmp_path, ptx: str, arch: str = "sm_90a") -> str:
    """ptxas -v's resource report for ``ptx`` (skips the test if no ptxas is available)."""
    ptxas = Path(__import__("triton").__file__).parent / "backends/nvidia/bin/ptxas"
    if not ptxas.exists() and shutil.which("ptxas") is None:
        pytest.skip("no ptxas to check register use")
    exe = str(ptxas) if ptxas.exists() else "ptxas"
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    return subprocess.run([exe, f"-arch={arch}", "-v", "-o", str(tmp_path / "k.cubin"), str(src)],
                          capture_output=True, text=True, check=True).stderr


def assert_no_spills(tmp_path, ptx: str, no_serialised_wgmma: bool = False) -> None:
    out = ptxas_report(tmp_path, ptx)
    assert "0 bytes spill stores, 0 bytes spill loads" in out, out
    assert "0 bytes stack frame" in out, out
    if no_serialised_wgmma:
        assert "serialized" not in out, out  # C7512: wgmma serialised for lack of registers
