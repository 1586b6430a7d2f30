"""PTX checks shared by the sm100 (Blackwell) compile tests, forward and backward (no GPU
needed: the templates always target sm_100a, and Triton's wheel ships ptxas)."""
import os
import re

import torch
from ptx_checks import ptxas_report


def ptx_text(compiled) -> str:
    """The PTX of a ``cute.compile`` result built with ``--keep-ptx`` (``__ptx__`` is the text,
    or with ``--dump-dir`` the path of the dumped file)."""
    ptx = compiled.__ptx__
    assert ptx, "no PTX produced"
    if len(ptx) < 4096 and os.path.exists(ptx):  # a path to the dumped file
        with open(ptx) as f:
            ptx = f.read()
    assert ".entry" in ptx
    return ptx


def assert_blackwell_path(ptx: str) -> None:
    """An attention kernel on the Blackwell tensor cores: tcgen05 MMAs, TMEM, TMA loads,
    setmaxnreg, exp2; no Hopper or Ampere MMA."""
    assert "tcgen05.mma" in ptx, "no tcgen05.mma: the kernel fell off the Blackwell tensor cores"
    assert "wgmma" not in ptx, "wgmma found: a Hopper MMA in the sm100 kernel"
    assert "mma.sync" not in ptx, "mma.sync found: Ampere-style MMA instead of tcgen05"
    for insn in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "tcgen05.st",
                 "tcgen05.commit", "tcgen05.fence", "cp.async.bulk.tensor", "setmaxnreg.inc",
                 "setmaxnreg.dec", "ex2.approx"):
        assert insn in ptx, f"{insn} missing from the PTX"


def spill_bytes(tmp_path, ptx: str, stack_frame: bool = True) -> int:
    """ptxas's largest of spill stores, spill loads and (``stack_frame``) the stack frame, for
    sm_100a."""
    out = ptxas_report(tmp_path, ptx, arch="sm_100a")
    kinds = ("spill stores", "spill loads") + (("stack frame",) if stack_frame else ())
    sizes = [int(re.search(rf"(\d+) bytes {what}", out).group(1)) for what in kinds]
    return max(sizes)


def assert_scalars_not_baked(program, ptx: str) -> None:
    """Captured Python numbers stay runtime kernel arguments: no float scalar of ``program``
    (but 0 and 1, which any kernel holds) appears in ``ptx`` as an immediate."""
    for value in program.scalars:
        if isinstance(value, float) and value not in (0.0, 1.0):
            bits = torch.tensor(value, dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF
            assert f"0f{bits:08X}" not in ptx, f"runtime scalar {value} was baked into the PTX"
