"""Our sm90 kernel's steady-state loop against FA4's, instruction by instruction, on the CPU.

    python -m benchmarks.sass_compare [--pass fwd|bwd] [--causal] [--head-dim 128|64]
                                      [--fp8] [--fa4-site DIR]

No GPU: both kernels are compiled for sm_90a (CUTE_DSL_ARCH) and their cubins disassembled with
the cuobjdump in Triton's wheel. Ours comes through the templates (dense, or causal with a block
mask), FA4's through `flash_attn.cute.interface._flash_attn_fwd` / `_flash_attn_bwd` under
torch's FakeTensorMode with FLASH_ATTENTION_ARCH=sm_90 (FA4's own switch for CPU-only builds);
`--fa4-site` is a folder holding `flash_attn` (and `einops`), e.g. `pip install --target /tmp/fa4
--no-deps flash-attn-4 einops`. Without it, only ours is shown.

``--fp8``: our e4m3 forward (its wgmmas disassemble as QGMMA).

For each kernel: registers, total instructions, and the loop that issues the wgmmas with the
fewest instructions per query row (a loop body may hold two alternative paths, e.g. bounded and
unbounded tiles: the path with the most wgmmas between two branches is counted), as a histogram
per 64 query rows per thread (docs/performance.md has what it found).
"""
from __future__ import annotations

import importlib

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH = re.compile(r"BRA\s.*?0x([0-9a-f]+)")


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends/nvidia/bin" / name)


def disassemble(cubin: str) -> list[tuple[int, str]]:
    out = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    return [(int(m.group(1), 16), m.group(2).strip()) for m in map(_INSTR.match, out.splitlines()) if m]


def registers(cubin: str) -> str:
    out = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    return m.group(1) if m else "?"


def _opcode(text: str) -> str:
    return text.split()[1] if text.startswith("@") else text.split()[0]


def _is_gmma(text: str) -> bool:
    """A wgmma: HGMMA for 16-bit operands, QGMMA for FP8."""
    return _opcode(text).startswith(("HGMMA", "QGMMA"))


def hot_path(ins: list[tuple[int, str]]) -> tuple[list[str], int]:
    """One iteration of the steady-state loop: the smallest loop body holding at least half as
    many HGMMAs as the loop with the most (outer loops hold more, tail loops fewer). Where the
    body holds a forward branch over at least a quarter of it (a skipped O rescale, a
    bounded/unbounded pair of tile bodies), the path that takes the branch is returned: the
    common case in both kernels seen so far. Returns (instructions, how many
    were skipped by the branch)."""
    loops = []
    for addr, text in ins:
        m = _BRANCH.search(text)
        # A loop's back edge is predicated; an unpredicated backward BRA is the return from an
        # out-of-line mbarrier retry stub placed after the code (not a loop).
        if m and int(m.group(1), 16) < addr and text.startswith("@"):
            body = [(a, t) for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if sum(_is_gmma(t) for _, t in body) >= 8:
                loops.append(body)
    if not loops:
        return [], 0
    count = lambda b: sum(_is_gmma(t) for _, t in b)  # noqa: E731
    most = max(map(count, loops))
    body = min((b for b in loops if 2 * count(b) >= most), key=len)
    hi = body[-1][0]
    for a, t in body:
        m = _BRANCH.search(t)
        if m and a < int(m.group(1), 16) <= hi:
            tgt = int(m.group(1), 16)
            skipped = [x for x in body if a < x[0] < tgt]
            if len(skipped) >= len(body) // 4:
                return [t for b, t in body if not a < b < tgt], len(skipped)
    return [t for _, t in body], 0


def _ours(pass_: str, causal: bool, out: str, head_dim: int = 128, head_dim_v: int = None,
          fp8: bool = False) -> str:
    import cutlass
    import torch

    from flexjit import mods as fmods
    from flexjit.backends.cute.sm90 import load_mods
    from flexjit.ir.passes import lower
    from flexjit.frontend.trace import MASK_MOD, trace_mod

    os.makedirs(out, exist_ok=True)  # the DSL writes nowhere (or into the cwd) otherwise
    head_dim_v = head_dim_v or head_dim
    mask = fmods.causal() if causal else None
    program = lower(None, trace_mod(mask, MASK_MOD) if mask else None, float_index=True)
    mods = load_mods(program)
    options = f"--keep-cubin --dump-dir {out}"
    if pass_ == "fwd":
        tpl = importlib.import_module("flexjit.templates.cute.sm90.fwd")
        cfg = tpl.FwdConfig(head_dim, head_dim_v, cutlass.BFloat16, mods.score_mod, mods.mask_mod,
                            has_block_mask=causal, fp8=fp8)
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        q = torch.randn(2, 4, 300, head_dim).to(dtype)
        k = torch.randn(2, 4, 500, head_dim).to(dtype)
        # the FP8 kernel reads V transposed (B, H, Dv, keys)
        v = torch.randn(2, 4, head_dim_v, 512).to(dtype) if fp8 else torch.randn(2, 4, 500, head_dim_v).to(dtype)
        lists = None
        if causal:
            ones, idx = torch.ones(1, 1, 3, dtype=torch.int32), torch.zeros(1, 1, 3, 4, dtype=torch.int32)
            lists = (ones, idx, ones.clone(), idx.clone())
        tpl.compile_fwd(cfg, q, k, v, torch.empty(2, 4, 300, head_dim_v, dtype=torch.bfloat16),
                        torch.empty(2, 4, 300), lists,
                        (), (), options=options)
    else:
        tpl = importlib.import_module("flexjit.templates.cute.sm90.bwd")
        cfg = tpl.BwdConfig(head_dim, head_dim_v, cutlass.BFloat16, mods.score_mod_and_grad,
                            mods.mask_mod, has_block_mask=causal)
        host = importlib.import_module("flexjit.templates.cute.sm90.bwd_host")
        host.compile_bwd(cfg, (), (), options=options, parts=("main",))
    return _largest_cubin(out)


def _fa4(pass_: str, causal: bool, out: str, site: str, head_dim: int = 128) -> str:
    os.makedirs(out, exist_ok=True)
    os.environ.update(FLASH_ATTENTION_ARCH="sm_90", FLASH_ATTENTION_NUM_SMS="132")
    sys.path.insert(0, site)
    import cutlass.cute as cute
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import flash_attn.cute.interface as fa

    compile_ = cute.compile
    extra = f" --keep-cubin --dump-dir {out}"

    class _Keep:  # cute.compile, and cute.compile[options], with the cubin kept
        def __getitem__(self, key):
            return lambda *a, options="", **kw: compile_[key](*a, options=options + extra, **kw)

        def __call__(self, *a, options="", **kw):
            return compile_(*a, options=options + extra, **kw)

    fa.cute.compile = _Keep()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            B, H, S, D = 2, 16, 8192, head_dim
            if pass_ == "fwd":  # [B, H, S, D] memory, as torch Flex's FLASH backend passes it
                q, k, v = [torch.empty(B, H, S, D, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
                           for _ in range(3)]
                fa._flash_attn_fwd(q, k, v, softmax_scale=D ** -0.5, causal=causal, return_lse=True)
            else:
                q, k, v, o, do = [torch.empty(B, S, H, D, dtype=torch.bfloat16, device="cuda")
                                  for _ in range(5)]
                lse = torch.empty(B, H, S, dtype=torch.float32, device="cuda")
                c = fa._tile_size_bwd_sm90(D, D, causal, False)
                fa._flash_attn_bwd(q, k, v, o, do, lse, D ** -0.5, causal=causal,
                                   m_block_size=c.m_block_size, n_block_size=c.n_block_size,
                                   num_stages_Q=c.num_stages_Q, num_stages_dO=c.num_stages_dO)
    finally:
        fa.cute.compile = compile_
    return _largest_cubin(out, exclude=("process", "Process"))


def _largest_cubin(folder: str, exclude=()) -> str:
    cubins = [c for c in glob.glob(f"{folder}/**/*.cubin", recursive=True)
              if not any(x in c for x in exclude)]
    if not cubins:
        raise RuntimeError(f"no cubin written under {folder}")
    return max(cubins, key=os.path.getsize)


def _rows_per_iteration(path: list[str], pass_: str) -> int:
    """Query rows one pass of ``path`` covers: the forward's loop is over kv tiles of a 128-row
    Q tile shared by 2 warpgroups (64 rows each); the backward's over Q tiles whose row count is
    the N of the S GEMM (HGMMA.64xN): the most frequent N, since the S, dP (and, at D = tile_m,
    dV, dK) GEMMs share it (the smallest N is wrong at D = 64, where our dQ GEMM is 64x32)."""
    if pass_ == "fwd":
        return 64
    sizes = collections.Counter(int(m.group(1)) for t in path
                                for m in [re.match(r"HGMMA\.64x(\d+)x16", _opcode(t))] if m)
    return sizes.most_common(1)[0][0] if sizes else 64


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sass_compare")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="fwd")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--head-dim", type=int, choices=(64, 128, 192), default=128)
    p.add_argument("--head-dim-v", type=int, choices=(128, 192), default=None,
                   help="v's head dim (flexjit only; default --head-dim)")
    p.add_argument("--fp8", action="store_true", help="our e4m3 forward (flexjit only)")
    p.add_argument("--fa4-site", default=None)
    p.add_argument("--top", type=int, default=24)
    a = p.parse_args(argv)
    kernels = {}
    with tempfile.TemporaryDirectory() as d:
        if a.fp8 and a.pass_ != "fwd":
            p.error("--fp8 serves the forward")
        kernels["flexjit"] = _ours(a.pass_, a.causal, f"{d}/ours", a.head_dim, a.head_dim_v, a.fp8)
        if a.fa4_site:
            kernels["fa4"] = _fa4(a.pass_, a.causal, f"{d}/fa4", a.fa4_site, a.head_dim)
        hist = {}
        for name, cubin in kernels.items():
            ins = disassemble(cubin)
            path, skipped = hot_path(ins)
            rows = _rows_per_iteration(path, a.pass_)
            hist[name] = {k: v * 64 / rows for k, v in collections.Counter(map(_opcode, path)).items()}
            print(f"{name}: {registers(cubin)} registers, {len(ins)} instructions; steady-state "
                  f"loop path {len(path)} instructions for {rows} query rows = "
                  f"{len(path) * 64 / rows:.0f} per 64 rows per thread"
                  + (f" (a branch inside skips {skipped} more)" if skipped else ""))
    names = list(hist)
    ops = sorted({o for h in hist.values() for o in h},
                 key=lambda o: -max(h.get(o, 0) for h in hist.values()))
    print(f"\nper 64 query rows per thread ({a.pass_}, {'causal' if a.causal else 'full'}, "
          f"D={a.head_dim}):")
    print(f"  {'opcode':36s}" + "".join(f"{n:>10s}" for n in names))
    for o in ops[:a.top]:
        print(f"  {o:36s}" + "".join(f"{hist[n].get(o, 0):10.1f}" for n in names))


if __name__ == "__main__":
    main()
