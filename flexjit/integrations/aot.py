"""Ahead-of-time compilation of flexjit's CuTe kernels, without a GPU.

    flexjit compile --arch sm_90a --variant causal [--head-dim 128] [--pass fwd,bwd] --out DIR

or, for any mod, :func:`compile_kernels`. Each kernel is compiled for the named architecture on
this machine (CuTeDSL compiles for ``CUTE_DSL_ARCH`` with no driver), its PTX and cubin are
written under ``DIR/<what>/<kernel>/``, and the compiled kernel is exported into the disk cache
(``$FLEXJIT_CACHE_DIR`` or ``~/.cache/flexjit``) under the key a training process computes for
the same program, so that a job started with that cache loads it instead of compiling.

What decides the key, hence what must match the run: the mods (and the dtypes of what they
capture, and whether those require grad), the dtype, the head dims, whether a block mask is
used, the forward's tiling (its tile rows and schedule: every configuration the run's tuner
would measure at ``seq_len``, ``runtime.autotune``), deterministic mode for the backward, and the
versions of flexjit's templates, CuTeDSL and tvm_ffi. Sizes, strides, batch, heads and scalar
values are runtime arguments.

sm_100a: the forward and the backward's three kernels, exported to the disk cache the same way
(``cute_sm100``, ``cute_sm100_bwd``). Caching does not make them trusted: a run uses an sm100
kernel, loaded from disk or compiled, only after its first-use self-check has passed on that
GPU in that process (``flexjit.runtime.selfcheck``). CuTeDSL reads ``CUTE_DSL_ARCH`` once per process:
compile for sm_90a in a process that has not compiled for another arch (``compile_kernels``
sets it for the sm90 kernels); the sm100 templates pass ``--gpu-arch sm_100a`` explicitly, so
they compile (and export) in any process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path
from typing import Callable

import torch

from flexjit import mods
from flexjit.api.attention import prepare_call
from flexjit.api.masks import create_block_mask
from flexjit.backends.cute import sm90 as cute_sm90, sm100 as cute_sm100, sm100_bwd as cute_sm100_bwd
from flexjit.backends.cute.sm90 import _aux_tensor
from flexjit.planner.block_mask import noop_mask
from flexjit.runtime import autotune, compile_pool

ARCHS = ("sm_90a", "sm_100a")
PASSES = ("fwd", "bwd")


def _table(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) * 0.1


# name -> (seq_len, heads) -> (score_mod, mask_mod), as a model would build it
_VARIANTS = {
    "causal": lambda S, H: (None, mods.causal()),
    "sliding_window": lambda S, H: (None, mods.sliding_window(min(1024, S))),
    "prefix_lm": lambda S, H: (None, mods.prefix_lm(min(1024, max(S // 2, 1)))),
    "document": lambda S, H: (None, mods.document(torch.arange(S) // max(S // 4, 1))),
    "alibi": lambda S, H: (mods.alibi(H), mods.causal()),
    "softcap": lambda S, H: (mods.softcap(30.0), mods.causal()),
    "relative_bias": lambda S, H: (mods.relative_bias(_table(2 * S - 1)), None),
    "t5_bias": lambda S, H: (mods.t5_bias(_table(H, 32)), None),  # (heads, buckets), as T5
}
VARIANTS = tuple(_VARIANTS)


def builtin_variant(name: str, seq_len: int, heads: int) -> tuple[Callable | None, Callable | None]:
    """(score_mod, mask_mod) of a built-in variant (``VARIANTS``) at ``seq_len``."""
    if name not in _VARIANTS:
        raise ValueError(f"unknown variant {name!r}; the built-in ones are {', '.join(VARIANTS)}")
    return _VARIANTS[name](seq_len, heads)


@dataclasses.dataclass
class Kernel:
    """One compiled kernel: where its files went and how long it took."""
    arch: str
    pass_: str  # "fwd" or "bwd"
    part: str  # "main" for the forward; "pre", "main" or "post" for the backward
    what: str
    ptx: Path | None
    cubin: Path | None
    cache_key: str | None  # the disk-cache entry (None when the disk cache is off)
    seconds: float  # the backward's three parts report their time together

    def line(self) -> str:
        files = ", ".join(str(p) for p in (self.ptx, self.cubin) if p is not None) or "no files"
        cached = f"cache {self.cache_key}.o" if self.cache_key else "disk cache off"
        took = f"{self.seconds:.1f} s" + (" (the backward's 3 parts)" if self.pass_ == "bwd" else "")
        return f"{self.arch} {self.pass_:3} {self.part:4} {self.what}: {took}; {files}; {cached}"


@contextlib.contextmanager
def _arch(arch: str):
    """CUTE_DSL_ARCH set while compiling, the old value restored after. CuTeDSL reads it once per
    process, at its first compile: it decides only where nothing has compiled yet (the CLI)."""
    old = os.environ.get("CUTE_DSL_ARCH")
    os.environ["CUTE_DSL_ARCH"] = arch
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUTE_DSL_ARCH", None)
        else:
            os.environ["CUTE_DSL_ARCH"] = old


def _files(folder: Path, arch: str) -> tuple[Path | None, Path | None]:
    """The PTX and cubin CuTeDSL dumped into ``folder`` (one kernel's), renamed
    ``<folder name>.<arch>.ptx`` / ``.cubin``."""
    found = []
    for ext in ("ptx", "cubin"):
        dumped = sorted(folder.glob(f"*.{ext}"))
        target = folder / f"{folder.name}.{arch}.{ext}"
        if dumped and dumped[-1] != target:
            dumped[-1].replace(target)
        found.append(target if target.exists() else None)
    return found[0], found[1]


def compile_kernels(score_mod: Callable | None = None, mask_mod: Callable | None = None, *,
                    arch: str = "sm_90a", head_dim: int = 128, head_dim_v: int | None = None,
                    dtype: torch.dtype = torch.bfloat16, passes=None, seq_len: int = 8192,
                    heads: int = 16, kv_heads: int | None = None, deterministic: bool = False,
                    out: str | os.PathLike | None = None, name: str | None = None,
                    log: Callable[[str], None] | None = None, batch: int = 1,
                    block_mask=None, kernel_options: dict | None = None,
                    out_dtype: torch.dtype | None = None) -> list[Kernel]:
    """Compile the CuTe kernels a call with these mods would run, for ``arch``, on this machine.

    ``seq_len`` (query and key length) picks the forward's tiling as a run at that length does;
    ``heads`` / ``kv_heads`` matter only to mods that use them. ``batch`` and ``block_mask`` (a
    CPU BlockMask over ``seq_len``, e.g. one per batch entry for a mask that reads ``b``): the
    run's own, where they differ from the default batch of 1 and a mask built from ``mask_mod``
    broadcast over batch and heads (the mask's density picks the forward's tiling; the lengths
    can widen index math). ``kernel_options``: the run's (``TILE_M``, ``PERSISTENT`` and
    ``PACK_GQA`` pin the forward's configuration; by default every candidate the tuner would
    measure is compiled,
    only the heuristic's with ``AUTOTUNE=False``). ``dtype`` torch.float8_e4m3fn: the sm90 FP8
    forward (q, k and v in e4m3, ``out_dtype`` bf16 by default; no backward, so ``passes``
    defaults to the forward). ``out``: where each kernel's PTX
    and cubin go (``out/<name>/<pass>-<part>/``); None keeps no files. ``log`` gets one line per
    kernel as it is done. ``passes``: None for both (the forward alone for FP8). Returns the
    kernels, forward first."""
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r}: flexjit's CuTe kernels target {', '.join(ARCHS)}")
    fp8 = dtype == torch.float8_e4m3fn
    if passes is None:
        passes = ("fwd",) if fp8 else PASSES
    bad = [p for p in passes if p not in PASSES]
    if bad or not passes:
        raise ValueError(f"passes {tuple(passes)}: choose from {PASSES}")
    if fp8:
        if "bwd" in passes:
            raise ValueError("dtype float8_e4m3fn: FP8 inputs have no backward; pass passes=('fwd',)")
        if arch != "sm_90a":
            raise ValueError(f"dtype float8_e4m3fn: the FP8 forward is an sm_90a kernel, not {arch}")
        out_dtype = out_dtype or torch.bfloat16
        if out_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"out_dtype {out_dtype}: the sm90 FP8 forward writes bfloat16 or float16")
    elif dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype {dtype}: the sm90 kernels take float16 or bfloat16, or "
                         "float8_e4m3fn (the forward)")
    elif out_dtype not in (None, dtype):
        raise ValueError(f"out_dtype {out_dtype} applies to FP8 inputs only")
    head_dim_v = head_dim_v or head_dim
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise ValueError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    name = name or "_".join(n for n in (getattr(score_mod, "__name__", None) if score_mod else None,
                                          getattr(mask_mod, "__name__", None) if mask_mod else None)
                            if n) or "no_mods"
    what = f"{name} D={head_dim}" + (f"/{head_dim_v}" if head_dim_v != head_dim else "") + \
        f" {str(dtype).replace('torch.', '')}"
    leaf = f"{name}-d{head_dim}" + ("" if head_dim_v == head_dim else f"-{head_dim_v}")
    root = Path(out) / leaf if out is not None else None

    if arch == "sm_100a":
        return _compile_sm100(score_mod, mask_mod, head_dim, head_dim_v, dtype, passes, seq_len,
                              heads, kv_heads, deterministic, what, root, log, batch, block_mask)
    with _arch(arch), torch.no_grad():
        _check_dims("sm90", (head_dim, head_dim_v), passes,
                    cute_sm90._FP8_HEAD_DIMS if fp8 else cute_sm90._HEAD_DIMS,
                    cute_sm90._BWD_HEAD_DIMS, " (others train on the Triton backward)")
        q, k, v, bm, call, aux = _example(score_mod, mask_mod, head_dim, head_dim_v, dtype,
                                          seq_len, heads, kv_heads, batch, block_mask,
                                          kernel_options, out_dtype if fp8 else None)
        if fp8:  # the kernel's V operand: the permuted Vᵀ forward() passes (kinds only matter)
            v = torch.empty(*v.shape[:2], head_dim_v, -(-seq_len // 128) * 128, dtype=dtype)
        program = call.program
        kernels = []
        if "fwd" in passes:
            # Every configuration the tuner would measure (the run's heuristic's first, in
            # fwd-main), each with its done marker, so that a run with this cache tunes on its
            # first call.
            configs = autotune.to_compile(cute_sm90, call, "fwd")
            jobs = compile_pool.candidate_jobs(call, cute_sm90.FAMILY, configs)
            for n, cfg in enumerate(configs):
                leaf = "fwd-main" if n == 0 else "fwd-" + str(cfg).replace(", ", "-").replace("=", "")
                kernels.append(_sm90_forward(program, q, k, v, bm, aux, cfg, arch,
                                             what + ("" if n == 0 else f" ({cfg})"),
                                             _folder(root, leaf), call.out_dtype))
                compile_pool.mark_done(jobs[cfg])
                if log:
                    log(kernels[-1].line())
        if "bwd" in passes:
            # Every configuration the tuner would measure, the heuristic's first (in bwd-*).
            with _deterministic(deterministic):
                configs = autotune.to_compile(cute_sm90, call, "bwd")
                jobs = compile_pool.candidate_jobs(call, cute_sm90.BWD_FAMILY, configs)
            seen: set = set()  # the variants share their pre/postprocess (its key)
            for n, cfg in enumerate(configs):
                tag = "" if n == 0 else "-" + cfg["bwd_config"].replace("+", "-")
                kernels += _sm90_backward(program, dtype, head_dim, head_dim_v, bm is not None,
                                          deterministic, aux, cfg["bwd_config"], arch,
                                          what + ("" if n == 0 else f" ({cfg})"), root, tag, log,
                                          seen)
                compile_pool.mark_done(jobs[cfg])
    return kernels


@contextlib.contextmanager
def _deterministic(on: bool):
    """torch's deterministic flag set to ``on`` while inside (the backward's candidates depend
    on it), restored after."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=True)


def _sm90_backward(program, dtype, head_dim: int, head_dim_v: int, sparse: bool,
                   deterministic: bool, aux, bwd_config: str, arch: str, what: str, root, tag: str,
                   log, seen: set) -> list:
    """Compile and export the sm90 backward's kernels on schedule ``bwd_config`` (folders
    ``bwd-<part><tag>`` under ``root`` keep their PTX and cubin), each key once: a part whose key
    is in ``seen`` (another variant's pre/postprocess) is neither built again nor listed."""
    host = cute_sm90._bwd_host()
    t0 = time.perf_counter()
    folders = {part: _folder(root, f"bwd-{part}{tag}") if part == "main" or not seen else None
               for part in host.PARTS}
    keys = cute_sm90.export_backward(program, dtype, head_dim, sparse, deterministic, aux,
                                     head_dim_v=head_dim_v, dump_dirs=folders,
                                     tiling=cute_sm90.tiling_for(program, head_dim, head_dim_v,
                                                                 bwd_config, deterministic))
    spent = time.perf_counter() - t0  # the parts together
    out = []
    for part in host.PARTS:
        if keys.get(part) is not None and keys[part] in seen:
            continue
        seen.add(keys.get(part))
        files = _files(folders[part], arch) if folders[part] else (None, None)
        out.append(Kernel(arch, "bwd", part, what, *files, keys.get(part), spent))
        if log:
            log(out[-1].line())
    return out


def _sm90_forward(program, q, k, v, bm, aux, cfg, arch: str, what: str, folder,
                  out_dtype: torch.dtype | None = None) -> Kernel:
    """Compile (with ``folder``: always, keeping its PTX and cubin there) and export the sm90
    forward on configuration ``cfg``. A compile that keeps files never loads from disk, and
    still exports its kernel (its options are part of the in-memory key: a run's own kernels
    stay as they are). Without a folder, the run's own path: loaded if cached, else compiled and
    exported (artifact flags without --dump-dir would write files into the working directory)."""
    options = "" if folder is None else f"--keep-ptx --keep-cubin --dump-dir {folder}"
    t0 = time.perf_counter()
    keys: dict = {}
    cute_sm90.compile_program(program, q, k, v, cute_sm90.forward_lists(bm, cfg["tile_m"]), aux,
                              options=options, persistent=cfg["persistent"], keys=keys,
                              tile_m=cfg["tile_m"], out_dtype=out_dtype,
                              pack_gqa=cfg.as_dict().get("pack_gqa", 1))
    return Kernel(arch, "fwd", "main", what, *(_files(folder, arch) if folder else (None, None)),
                  keys.get("fwd"), time.perf_counter() - t0)


def _check_dims(arch: str, dims: tuple, passes, fwd_dims, bwd_dims, bwd_note: str = "") -> None:
    """A ValueError unless the ``arch`` kernels of ``passes`` take head dims ``dims``."""
    if dims not in fwd_dims:
        raise ValueError(f"head dims {dims}: the {arch} forward takes {fwd_dims}")
    if "bwd" in passes and dims not in bwd_dims:
        raise ValueError(f"head dims {dims}: the {arch} backward takes {bwd_dims}{bwd_note}; "
                         "pass passes=('fwd',)")


def _compile_sm100(score_mod, mask_mod, head_dim, head_dim_v, dtype, passes, seq_len, heads,
                   kv_heads, deterministic, what, root, log, batch=1, block_mask=None) -> list[Kernel]:
    """The sm100 forward (``cute_sm100``) and backward (``cute_sm100_bwd``), both targeting
    sm_100a whatever CUTE_DSL_ARCH says, exported to the disk cache as the sm90 kernels are. A
    run still self-checks each kernel on its GPU before using it, loaded or not."""
    _check_dims("sm100", (head_dim, head_dim_v), passes, cute_sm100.HEAD_DIMS,
                cute_sm100_bwd.HEAD_DIMS)
    kernels = []
    with torch.no_grad():
        q, _, v, bm, call, aux = _example(score_mod, mask_mod, head_dim, head_dim_v, dtype,
                                          seq_len, heads, kv_heads, batch, block_mask)
        program = call.program
        if "fwd" in passes:
            folder = _folder(root, "fwd-main")
            # As the sm90 forward above: with a folder, always compiled (and exported under the
            # run's disk key); without one, the run's own path.
            options = "" if folder is None else f"--keep-ptx --keep-cubin --dump-dir {folder}"
            t0 = time.perf_counter()
            keys: dict = {}
            cute_sm100.compile_program(program, q, v, bm is not None, aux, options=options,
                                       keys=keys)
            kernels.append(Kernel("sm_100a", "fwd", "main", what,
                                  *(_files(folder, "sm_100a") if folder else (None, None)),
                                  keys.get("fwd"), time.perf_counter() - t0))
            if log:
                log(kernels[-1].line())
        if "bwd" in passes:
            parts = cute_sm100_bwd.PARTS
            folders = {part: _folder(root, f"bwd-{part}") for part in parts}
            t0 = time.perf_counter()
            keys = cute_sm100_bwd.export_backward(program, dtype, head_dim, bm is not None,
                                                  deterministic, aux, head_dim_v=head_dim_v,
                                                  dump_dirs=folders)
            spent = time.perf_counter() - t0  # the three parts together
            for part in parts:
                files = _files(folders[part], "sm_100a") if folders[part] else (None, None)
                kernels.append(Kernel("sm_100a", "bwd", part, what, *files, keys.get(part), spent))
                if log:
                    log(kernels[-1].line())
    return kernels


def _example(score_mod, mask_mod, head_dim, head_dim_v, dtype, seq_len, heads, kv_heads,
             batch=1, block_mask=None, kernel_options=None, out_dtype=None):
    """(q, k, v, block mask or None, Call, aux tensors): the call a run at ``seq_len`` makes,
    on CPU tensors without data (only kinds and the mask's lists shape the kernels)."""
    q = torch.empty(batch, heads, seq_len, head_dim, dtype=dtype)
    k = torch.empty(batch, kv_heads, seq_len, head_dim, dtype=dtype)
    v = torch.empty(batch, kv_heads, seq_len, head_dim_v, dtype=dtype)
    if block_mask is not None:
        bm = block_mask
    else:
        bm = create_block_mask(mask_mod, None, None, seq_len, seq_len, device="cpu") \
            if mask_mod is not None and mask_mod is not noop_mask else None
    call = prepare_call(q, k, v, score_mod, bm, None, kv_heads != heads, kernel_options,
                        fp8=(None, None, None, out_dtype))
    return q, k, v, bm, call, tuple(_aux_tensor(t, q.device) for t in call.program.buffers)


def _folder(root: Path | None, leaf: str) -> Path | None:
    if root is None:
        return None
    folder = root / leaf
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def compile_variant(variant: str, **kw) -> list[Kernel]:
    """:func:`compile_kernels` for a built-in variant (``VARIANTS``)."""
    score_mod, mask_mod = builtin_variant(variant, kw.get("seq_len", 8192), kw.get("heads", 16))
    return compile_kernels(score_mod, mask_mod, name=variant, **kw)
