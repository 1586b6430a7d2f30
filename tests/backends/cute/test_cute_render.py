"""Golden snapshots of the CuTeDSL code rendered for the core mods (CPU only).

A refactor that claims no behaviour change must leave these files unchanged. To accept an
intended change, run with FLEXJIT_UPDATE_GOLDEN=1 and review the diff.
"""
import os
from pathlib import Path

import pytest
import torch

from flexjit.backends.cute.sm90 import render
from mods_catalog import CORE, lowered, make_case

GOLDEN = Path(__file__).parent / "golden"


def _program(name):
    torch.manual_seed(0)  # captured tensors' values don't reach the code, only dtypes/ranks do
    case = make_case(name, 2, 4, 256, 256)
    return lowered(case.score_mod, case.mask_mod)


@pytest.mark.parametrize("name", CORE)
def test_rendered_mods_match_golden(name):
    src = render(_program(name))
    path = GOLDEN / f"{name}.py.txt"
    if os.environ.get("FLEXJIT_UPDATE_GOLDEN") == "1":
        path.write_text(src)
    assert path.exists(), f"no golden file {path}; create it with FLEXJIT_UPDATE_GOLDEN=1"
    assert src == path.read_text(), f"rendered code for {name} changed; see {path}"


def test_rendered_source_is_valid_python():
    for name in CORE:
        compile(render(_program(name)), name, "exec")
