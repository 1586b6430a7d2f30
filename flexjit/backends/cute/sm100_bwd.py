"""The CuTeDSL Blackwell backward (sm_100a): fill the sm100 backward's holes from a Program, compile.

Status: compiled for sm_100a on the CPU, never run on a Blackwell GPU. It reaches a call only
through ``cute_sm100.backward_supports``, which runs a first-use self-check of this module's
``backward`` on a small case of the call (every gradient against float64 autograd,
``selfcheck.check_backward``) before any answer is used, under ``kernel_key``. What is here is
what that gate calls:

* ``backward_supports``: refuses what the kernel cannot serve (``why_not``); the gate does the
  rest.
* ``kernel_key``: the compiled kernel's key (what ``compile_backward`` keeps it under, and what
  its self-check result is kept under).
* ``compile_backward``: the three kernels (the arch-neutral sm90 preprocess, the sm100 main
  kernel, the sm100 postprocess) for a Program, its mods rendered by the shared CuTe renderer
  (``cute_sm90.load_mods``: the module that fills the sm90 kernels), kept in memory per
  (program, dtype, head dims, block-mask presence, determinism, captured-tensor kinds) and on
  disk, one object file per part (``backends.cute.objects``, as the sm90 backward's; a loaded
  kernel is self-checked like a fresh one). ``export_backward``: the same, compiled afresh with
  each part's PTX and cubin kept (``flexjit.aot``).
* ``backward``: the sm90 backend's ``backward`` contract (dq, dk, dv and one gradient per
  captured tensor).
"""
from __future__ import annotations

import logging
import time

import torch

from flexjit.backends import kernel_cache as cache
from flexjit.ir.program import Program
from flexjit.backends.cute import objects as cute_cache, templates
from flexjit.backends.cute.render import captured_grads_in_kernel, grad_slots
from flexjit.backends.cute.sm90 import _aux_tensor, _cutlass_dtype, _scalar_signature, load_mods, run_backward

# (head_dim, head_dim_v) pairs the sm100 backward has a tile for (``cute_sm100_bwd.HEAD_DIMS``,
# repeated so that refusing needs no cutlass import).
HEAD_DIMS = ((64, 64), (128, 128))
PARTS = ("pre", "main", "post")  # the template's kernels (its ``PARTS``), in launch order

log = logging.getLogger("flexjit")
_COMPILED: dict[tuple, object] = {}


def _template():
    return templates("sm100").bwd


def backward_supports(call) -> tuple[bool, str]:
    """(False, why) for what the kernel cannot serve (``why_not``); else True: whether it may
    run is the first-use self-check's to say (``cute_sm100.backward_supports``)."""
    why = why_not(call)
    if why is not None:
        return False, why
    return True, "the sm100 backward (compiled here, never run on Blackwell: self-checked on first use)"


def _aux_sig(buffers) -> tuple:
    return tuple((t.dtype, t.dim()) for t in buffers)


def kernel_key(call) -> tuple:
    """``compile_backward``'s key for this call: what shapes the kernel (lengths, batch, heads,
    the scale and scalar values are runtime arguments)."""
    prog = call.program
    D, Dv = call.q.shape[-1], call.v.shape[-1]
    return (prog.key, call.q.dtype, D, Dv, call.block_mask is not None,
            torch.are_deterministic_algorithms_enabled(), _aux_sig(prog.buffers),
            prog.scalar_dtypes, "")


def why_not(call) -> str | None:
    """What the kernel itself cannot serve (None: nothing), independent of the self-check:
    head dims outside ``HEAD_DIMS``, dtypes other than fp16/bf16, and captured-tensor gradients
    whose derivative depends on the score (the sm90 backward's limit, shared renderer)."""
    D, Dv = call.q.shape[-1], call.v.shape[-1]
    if (D, Dv) not in HEAD_DIMS:
        return f"head dims ({D}, {Dv}); the sm100 backward takes {HEAD_DIMS}"
    if call.q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {call.q.dtype}; the sm100 backward takes float16 and bfloat16"
    if call.program.grad_loads:
        ok, why = captured_grads_in_kernel(call.program)
        if not ok:
            return f"captured-tensor gradients: {why}"
    return None


def compile_backward(program: Program, dtype: torch.dtype, head_dim: int, sparse: bool,
                     deterministic: bool, aux_tensors, head_dim_v: int | None = None,
                     options: str = ""):
    """The sm100 backward's three kernels for this program, from memory, the disk cache (each
    part its own object file, as the sm90 backward's) or a fresh compile. A kernel loaded from
    disk is gated like a fresh one: ``cute_sm100.backward_supports`` self-checks it in each
    process before a call uses it. Works on the CPU: the template always targets sm_100a."""
    head_dim_v = head_dim_v or head_dim
    key = (program.key, dtype, head_dim, head_dim_v, sparse, deterministic, _aux_sig(aux_tensors),
           program.scalar_dtypes, options)
    return cache.cached(_COMPILED, key, lambda: _build(
        program, dtype, head_dim, head_dim_v, sparse, deterministic, aux_tensors, options))


def export_backward(program: Program, dtype: torch.dtype, head_dim: int, sparse: bool,
                    deterministic: bool, aux_tensors, head_dim_v: int | None = None,
                    dump_dirs: dict | None = None) -> dict:
    """Compile the three kernels afresh (never from disk), export each into the disk cache under
    the key ``compile_backward`` looks up, and with ``dump_dirs`` ({part: folder or None}) keep
    each part's PTX and cubin there. {part: disk key or None}. For ``flexjit.aot``."""
    keys: dict = {}
    _build(program, dtype, head_dim, head_dim_v or head_dim, sparse, deterministic, aux_tensors,
           "", dump_dirs=dump_dirs or {}, keys_out=keys)
    return keys


def _disk_keys(program: Program, cfg, aux_tensors, options: str, parts) -> dict:
    """{part: disk-cache key} (``cache.kernel_key``: it adds the toolchain and flexjit's
    sources). The pre/postprocess keys leave the Program out: every mod shares them."""
    import tvm_ffi  # the object file calls into its C ABI: a new version must not reuse it

    frozen = (cfg.dtype.__name__, cfg.head_dim, cfg.head_dim_v, cfg.has_block_mask,
              f"deterministic={cfg.deterministic}", f"grad_slots={grad_slots(program)}",
              tuple((str(t.dtype), t.dim()) for t in aux_tensors),
              tuple(d.value for d in program.scalar_dtypes), cute_cache.key_options(options),
              f"launch=tvm-ffi {tvm_ffi.__version__}")
    return {part: cache.kernel_key(program.key if part == "main" else "", f"cute_sm100_bwd_{part}",
                                   frozen, "sm100") for part in parts}


def _build(program: Program, dtype, head_dim: int, head_dim_v: int, sparse: bool,
           deterministic: bool, aux_tensors, options: str, dump_dirs: dict | None = None,
           keys_out: dict | None = None):
    """The three kernels, each loaded from its object file where one exists, the missing ones
    compiled (and exported). ``dump_dirs`` (ahead of time): compile every part, each dumping its
    PTX and cubin into its own folder."""
    tpl = _template()
    mods = load_mods(program)
    cfg = tpl.BwdConfig(head_dim, head_dim_v, _cutlass_dtype(dtype), mods.score_mod_and_grad,
                        mods.mask_mod, has_block_mask=sparse, deterministic=deterministic,
                        score_grads=getattr(mods, "score_grads", None),
                        grad_offsets=getattr(mods, "grad_offsets", None))
    what = (f"{program.score_name}/{program.mask_name} D={head_dim} "
            f"{str(dtype).replace('torch.', '')}")
    disk = tpl.tvm_ffi_enabled() and cute_cache.available()
    keys = _disk_keys(program, cfg, aux_tensors, options, tpl.PARTS) if disk else {}
    if keys_out is not None:
        keys_out.update({part: keys.get(part) for part in tpl.PARTS})
    fresh = dump_dirs is not None or cute_cache.wants_artifacts(options)
    t0 = time.perf_counter()
    loaded = {part: cute_cache.load(k) for part, k in keys.items()} if not fresh else {}
    loaded = {part: fn for part, fn in loaded.items() if fn is not None}
    missing = tuple(p for p in tpl.PARTS if p not in loaded)
    if not missing:
        cute_cache.announce(f"sm100 backward for {what}: loaded from disk in "
                            f"{time.perf_counter() - t0:.3f} s")
        return tpl.load_bwd(cfg, loaded, _aux_sig(aux_tensors) + _scalar_signature(program))
    with cute_cache.compiling():
        if dump_dirs is not None:  # one compile per part, each dumping into its own folder
            built = {}
            for part in missing:
                folder = dump_dirs.get(part)
                opts = "" if folder is None else f"--keep-ptx --keep-cubin --dump-dir {folder}"
                built.update(tpl.compile_bwd(cfg, aux_tensors, program.scalars, options=opts,
                                             parts=(part,)).parts)
            fn = tpl.CompiledBwd(cfg, built, _aux_sig(aux_tensors) + _scalar_signature(program))
        else:
            fn = tpl.compile_bwd(cfg, aux_tensors, program.scalars, options=options, parts=missing)
    for part in missing:
        if part in keys:
            cute_cache.store(keys[part], fn.parts[part].export)
    cute_cache.announce(f"sm100 backward for {what}: compiled {', '.join(missing)} in "
                        f"{time.perf_counter() - t0:.1f} s")
    if loaded:  # some parts came from disk: one backward of both kinds
        fn.parts.update(tpl.load_bwd(cfg, loaded).parts)
    return fn


def backward(call, q, k, v, out, lse, dout, dlse) -> tuple:
    """(dq, dk, dv, *captured-tensor grads), as ``cute_sm90.backward`` (``run_backward``: the
    same launch; no K/V batch broadcast here). Dispatch gets here only through
    ``cute_sm100.backward`` (after the self-check passed)."""
    prog = call.program
    aux = tuple(_aux_tensor(t, q.device) for t in prog.buffers)
    deterministic = torch.are_deterministic_algorithms_enabled()
    fn = compile_backward(prog, q.dtype, q.shape[-1], call.block_mask is not None, deterministic,
                          aux, head_dim_v=v.shape[-1])
    return run_backward(fn, call, q, k, v, out, lse, dout, dlse, aux, deterministic)
