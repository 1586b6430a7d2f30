"""The CuTeDSL Blackwell backend (sm_100a): fill the sm100 forward's holes from a Program, compile,
self-check, launch.

Status: the kernel (``templates/cute/sm100/fwd.py``) compiles for sm_100a on the CPU but has
NEVER RUN on a Blackwell GPU. So no call gets an answer from it before that compiled kernel has
passed a first-use self-check on the GPU it runs on (``flexjit.selfcheck``): a small case of the
same Program, compared with the reference backend. ``supports`` runs the check on a kernel's
first call (``flexjit.explain`` only reports it), and a kernel that fails it is refused for the
rest of the process (``backend="auto"`` falls back to Triton, ``backend="cute"`` raises).
``FLEXJIT_CUTE_SM100=0`` turns the sm100 kernels off. Dispatch lists this module as
``cute_sm100``: ``backend="cute"`` on a 10.x GPU means it.

* ``sm100_block_lists``: flexjit's 128×128 block lists regrouped for the kernel's 256-row query
  tiles (one merged kv list per pair of mask-block rows, a kind per sub-tile), remembered on the
  BlockMask.
* ``compile_program``: the forward for a Program, its mods rendered by the shared CuTe renderer
  (``cute_sm90.load_mods``: the same generated module fills the sm90 and sm100 kernels), kept in
  memory under ``kernel_key`` (program, dtype, head dims, block-mask presence, captured-tensor
  kinds, options) and on disk (``backends.cute.objects``, as the sm90 kernels; a loaded kernel
  is self-checked like a fresh one).
* ``supports`` / ``forward``: the backend interface, both gated. ``backward_supports`` /
  ``backward``: the sm100 backward (``cute_sm100_bwd``, never run on Blackwell either), gated
  the same way by its own first-use self-check of every gradient; where it refuses the call or
  fails its check, training pairs this forward with the Triton backward (its saved LSE is the
  natural-log, fp32 (B, Hq, L) LSE, -inf on an empty row, that the Triton backward reads; the
  self-check compares it).
* ``SEAM``: the capability query, the compile and the launch, replaced by the CPU tests
  (``tests/test_sm100_gate.py``) to simulate a Blackwell device with stand-in kernels.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from flexjit.ir import nodes as ir
from flexjit.ir.nodes import Op
from flexjit.ir.program import Program
from flexjit.backends.base import capability
from flexjit.backends.cute import objects as cute_cache, templates
from flexjit.backends.cute import sm100_bwd
from flexjit.backends.self_checked import Pending, layout, require
from flexjit.backends.cute.sm90 import _aux_tensor, _cutlass_dtype, _key_options, _scalar_signature, block_sparse_args, call_refusal, forward_disk_key, forward_label, load_mods, operands_refusal

# (head_dim, head_dim_v) pairs the sm100 forward has a tile for (``sm100.fwd.HEAD_DIMS``,
# repeated so that refusing needs no cutlass import).
HEAD_DIMS = ((64, 64), (128, 128))
SELF_CHECKED = True  # never run on Blackwell hardware: dispatch admits it per kernel (self_checked)

log = logging.getLogger("flexjit")
_COMPILED: dict[tuple, object] = {}

# A kv block's kind for one 128-row sub-tile (``block_sparse.KIND_*``).
KIND_SKIP, KIND_PARTIAL, KIND_FULL = 0, 1, 2


def _template():
    return templates("sm100").fwd


# --------------------------------------------------------------------------- the seam


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    return capability(device) if device.type == "cuda" else None


def _compile(call):
    """The compiled sm100 forward for this call (``compile_program``, memory-cached by
    ``kernel_key``)."""
    q = call.q
    aux = tuple(_aux_tensor(t, q.device) for t in call.program.buffers)
    return compile_program(call.program, q, call.v, call.block_mask is not None, aux,
                           write_max=call.max_scores)


def _launch(kernel, call, o, lse, max_scores) -> None:
    """Run ``kernel`` on the call, writing o, lse (and max_scores when asked)."""
    prog = call.program
    aux = tuple(_aux_tensor(t, call.q.device) for t in prog.buffers)
    kernel(call.q, call.k, call.v, o, lse, call.scale, sm100_block_lists(call.block_mask), aux,
           prog.scalars, max_scores=max_scores)


@dataclasses.dataclass
class Seam:
    """What stands between the gate and the hardware. ``capability(device)``: (major, minor) of
    a CUDA device, None for any other; ``compile(call)``: the compiled kernel for the call;
    ``launch(kernel, call, o, lse, max_scores)``: run it, writing the outputs. The CPU tests
    replace all three (a "Blackwell" CPU device, stand-in kernels); nothing else should."""
    capability: Callable = _cuda_capability
    compile: Callable = _compile
    launch: Callable = _launch


SEAM = Seam()


def on_sm100(device: torch.device) -> bool:
    """Whether ``device`` is a compute-capability 10.x GPU (dispatch's preference order)."""
    cap = SEAM.capability(device)
    return cap is not None and cap[0] == 10


# --------------------------------------------------------------------------- backend interface


def supports(call) -> tuple[bool, str]:
    """Whether the sm100 forward may answer the call: what the kernel handles (as the sm90
    backend's ``supports`` checks it: sm_100 exactly (sm_103 needs its own ``--gpu-arch``),
    fp16/bf16, head dims in ``HEAD_DIMS``, contiguous last dims and 16-byte strides for TMA, no
    batch broadcast by stride 0, 128x128 blocks, no scale <= 0 without a score_mod), then the
    first-use self-check of the call's compiled kernel, run here on the first call (reported
    only, under ``flexjit.explain``)."""
    q, k, v = call.q, call.k, call.v
    cap = SEAM.capability(q.device)
    if cap is None:
        return False, f"needs a CUDA tensor, got {q.device.type}"
    if tuple(cap) != (10, 0):
        return False, (f"the sm100 kernel is built for sm_100a (B200/GB200), this GPU is "
                       f"sm_{cap[0]}{cap[1]}")
    refusal = operands_refusal(q, k, v, HEAD_DIMS, "sm100")
    if refusal:
        return refusal
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.shape[0] > 1 and t.stride(0) == 0:
            return False, (f"{name} is broadcast over the batch (stride 0), which the sm100 "
                           "kernel's TMA descriptors are not built for")
    refusal = call_refusal(call, "sm100")
    if refusal:
        return refusal
    if SEAM.compile is _compile:
        try:
            _template()
        except ImportError as e:
            return False, f"nvidia-cutlass-dsl is not importable ({e})"
    return True, "Blackwell GPU: the CuTeDSL sm100 forward (tcgen05, TMEM, warp roles)"


def self_check(call, part: str) -> Pending:
    """The first-use self-check of the call's compiled ``part`` ("forward" or "backward")."""
    if part == "forward":
        return Pending(("sm100 forward", kernel_key(call)), variant(call), _what(call, "forward"),
                       _checked_launch)
    return Pending(("sm100 backward", sm100_bwd.kernel_key(call)), variant(call),
                   _what(call, "backward"), sm100_bwd.backward)


def variant(call) -> tuple:
    """What a kernel takes at run time but its self-check's case copies from the call, so that
    a call that differs in it is checked again (``selfcheck.gate``): the GQA ratio and the
    memory order of q, k, v."""
    return (call.q.shape[1] // call.k.shape[1], layout(call.q), layout(call.k), layout(call.v))


def _what(call, part: str) -> str:
    p = call.program
    dims = f"{call.q.shape[-1]}" if call.q.shape[-1] == call.v.shape[-1] else \
        f"{call.q.shape[-1]}/{call.v.shape[-1]}"
    return (f"the sm100 {part} for {p.score_name}/{p.mask_name} D={dims} "
            f"{str(call.q.dtype).replace('torch.', '')}")


# --------------------------------------------------------------------------- backward


def backward_supports(call) -> tuple[bool, str]:
    """Whether the sm100 backward serves the call's gradients (whether it may run is its
    first-use self-check's to say: ``self_check``); else dispatch pairs the forward with the
    Triton backward, which reads the same natural-log fp32 LSE."""
    return sm100_bwd.backward_supports(call)


def backward(call, q, k, v, out, lse, dout, dlse) -> tuple:
    """(dq, dk, dv, *captured grads) on the sm100 backward; only after its self-check passed."""
    require(self_check(call, "backward"))
    return sm100_bwd.backward(call, q, k, v, out, lse, dout, dlse)


# --------------------------------------------------------------------------- block lists


def merge_block_lists(kv_num, kv_idx, full_num, full_idx):
    """(num, indices, kinds) for 256-row query tiles from 128×128 block lists.

    Inputs are a BlockMask's int32 lists: counts (Bm, Hm, nQB), indices (Bm, Hm, nQB, nKVB), the
    first ``count`` entries of each row valid. Query tile m covers block rows 2m and 2m + 1 (a
    missing row 2m + 1, when nQB is odd, visits nothing). Output, int32: ``num`` (Bm, Hm, nQ2)
    kv blocks visited by either row, their ``indices`` (Bm, Hm, nQ2, nKVB) in ascending order,
    and ``kinds`` = k0 | k1 << 2 with k the row's kind of that block (0 skip, 1 partial, 2 full).
    A block listed both partial and full for one row counts as partial (mask_mod still
    applies), never as full. Entries past ``num`` hold index 0 and kind 0 and are never read."""
    Bm, Hm, nQB, nKVB = kv_idx.shape
    dev = kv_idx.device
    cols = torch.arange(kv_idx.shape[-1], device=dev)

    def dense(num, idx, code):
        out = torch.zeros(Bm, Hm, nQB, nKVB, dtype=torch.int64, device=dev)
        valid = cols < num[..., None].long()
        src = torch.where(valid, torch.full_like(idx, code, dtype=torch.int64),
                          torch.zeros_like(idx, dtype=torch.int64))
        return out.scatter_reduce(-1, idx.long().clamp(0, nKVB - 1), src, "amax")

    part = dense(kv_num, kv_idx, 1)
    full = dense(full_num, full_idx, 1) if full_num is not None else torch.zeros_like(part)
    cls = torch.where(part > 0, KIND_PARTIAL, torch.where(full > 0, KIND_FULL, KIND_SKIP))
    if nQB % 2:
        cls = torch.cat([cls, torch.zeros_like(cls[:, :, :1])], dim=2)
    pair = cls.view(Bm, Hm, -1, 2, nKVB)
    code = pair[:, :, :, 0] | (pair[:, :, :, 1] << 2)
    present = code != 0
    num = present.sum(-1)
    order = torch.argsort((~present).to(torch.int8), dim=-1, stable=True)
    kinds = torch.where(cols < num[..., None], code.gather(-1, order), torch.zeros_like(code))
    indices = torch.where(cols < num[..., None], order, torch.zeros_like(order))
    return tuple(t.to(torch.int32).contiguous() for t in (num, indices, kinds))


def sm100_block_lists(bm):
    """The kernel's three block tensors for a BlockMask (None without one), once per BlockMask."""
    if bm is None:
        return None
    return bm.derived("cute_sm100_lists", lambda: merge_block_lists(*block_sparse_args(bm)))


# --------------------------------------------------------------------------- compile, launch


def score_loads(program: Program) -> bool:
    """Whether the score_mod reads a captured tensor at an index that varies with kv_idx (a bias
    table: one load per score), ``FwdConfig.score_loads``: the softmax then goes through TMEM
    twice rather than spill beside the loads. A per-head or per-row load (ALiBi's slope) is
    one value per thread and stays on the one-pass path."""
    if program.score is None:
        return False
    memo: dict = {}
    return any(n.op is Op.LOAD and "kv" in ir.varies_with(n, memo)
               for n in ir.toposort([program.score]))


def _key(program: Program, dtype, D: int, Dv: int, has_block_mask: bool, aux_tensors,
         options: str = "", write_max: bool = False, rescale_threshold: float = 0.0) -> tuple:
    sig = tuple((t.dtype, max(t.dim(), 1)) for t in aux_tensors)  # 0-d buffers launch as 1-d
    return (program.key, dtype, D, Dv, has_block_mask, sig, program.scalar_dtypes, options,
            write_max, float(rescale_threshold))


def kernel_key(call) -> tuple:
    """The compiled-kernel key of the call's sm100 forward (what ``compile_program`` keeps it
    under, and what its self-check result is kept under): lengths, batch, heads, strides, the
    scale and scalar values are runtime arguments and not in it."""
    return _key(call.program, call.q.dtype, call.q.shape[-1], call.v.shape[-1],
                call.block_mask is not None, call.program.buffers, write_max=call.max_scores)


def compile_program(program: Program, q, v, has_block_mask: bool, aux_tensors, options: str = "",
                    write_max: bool = False, rescale_threshold: float = 0.0,
                    keys: dict | None = None):
    """Compile (or find in memory, or load from disk) the sm100 forward for this program and
    these input kinds. Only dtypes, head dims, ranks and block-mask presence shape the kernel.
    Works on the CPU (the template always targets sm_100a).

    Disk cache as the sm90 forward's (``cute_sm90.compile_program``): the TVM-FFI kernel is
    exported to ``cache_dir("cute")/<disk key>.o`` and a later process loads it. A cached
    kernel is no more trusted than a fresh one: ``supports`` still self-checks it in each
    process before a call uses it. A caller asking for ``--keep-ptx``/``--keep-cubin`` always
    compiles (a loaded kernel has no PTX); its kernel is still exported. ``keys``: if given,
    ``keys["fwd"]`` is set to the disk key (None with the disk cache off; ``flexjit.aot``)."""
    tpl = _template()
    D, Dv = q.shape[-1], v.shape[-1]
    key = _key(program, q.dtype, D, Dv, has_block_mask, aux_tensors, options, write_max,
               rescale_threshold)
    hit = _COMPILED.get(key)
    if hit is not None and keys is None:  # the per-call path: no config or disk key to build
        return hit
    mods = load_mods(program)
    cfg = tpl.FwdConfig(D, Dv, _cutlass_dtype(q.dtype), mods.score_mod, mods.mask_mod,
                        has_block_mask=has_block_mask, rescale_threshold=rescale_threshold,
                        write_max=write_max, score_loads=score_loads(program))
    what = forward_label(program, q.dtype, D)
    disk_key = forward_disk_key(tpl, program, "sm100", keys,
                                lambda: _kernel_config(cfg, aux_tensors, program, options))
    return cute_cache.cached_kernel(
        _COMPILED, key, label=f"sm100 forward for {what}", disk_key=disk_key, options=options,
        compile=lambda: tpl.compile_fwd(cfg, q, aux_tensors, program.scalars, options=options),
        from_disk=lambda fn: tpl.CompiledFwd(cfg, None, _signature(program, aux_tensors), fn),
        export=_export)


def _kernel_config(cfg, aux_tensors, program: Program, options: str) -> tuple:
    """The sm100 forward's disk-cache key material besides the program: every ``FwdConfig``
    field but the mods (the program stands for them), the captured tensors' kinds, the scalar
    dtypes, the code-changing compile options and the TVM-FFI version (the object file calls its
    C ABI). Sizes, strides and scalar values are runtime arguments."""
    import tvm_ffi

    fields = tuple((f.name, cfg.dtype.__name__ if f.name == "dtype" else getattr(cfg, f.name))
                   for f in dataclasses.fields(cfg) if f.name not in ("score_mod", "mask_mod"))
    return (repr(fields), tuple((str(t.dtype), t.dim()) for t in aux_tensors),
            tuple(d.value for d in program.scalar_dtypes), _key_options(options),
            f"launch=tvm-ffi {tvm_ffi.__version__}")


def _signature(program: Program, aux_tensors) -> tuple:
    """A compiled kernel's argument kinds, as ``compile_fwd`` records them."""
    return tuple((t.dtype, t.dim()) for t in aux_tensors) + _scalar_signature(program)


def _export(fn):
    """The object-file writer of a kernel compiled here (None for one loaded from disk)."""
    if fn.compiled is None:
        return None
    return lambda path, name: fn.compiled.export_to_c(object_file_path=path, function_name=name)


def _run(call, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Compile and launch through ``SEAM``; ``poison``: outputs start as NaN, so that an element
    the kernel does not write shows up (the self-check)."""
    q = call.q
    alloc = torch.full if poison else (lambda shape, _, **kw: torch.empty(shape, **kw))
    nan = float("nan")
    o = alloc((*q.shape[:-1], call.v.shape[-1]), nan, dtype=q.dtype, device=q.device)
    lse = alloc(tuple(q.shape[:-1]), nan, dtype=torch.float32, device=q.device)
    max_scores = alloc(tuple(q.shape[:-1]), nan, dtype=torch.float32, device=q.device) \
        if call.max_scores else None
    SEAM.launch(SEAM.compile(call), call, o, lse, max_scores)
    return o, lse, max_scores


def _checked_launch(small) -> tuple:
    """The self-check's run of the kernel on its small case (poisoned outputs)."""
    return _run(small, poison=True)


def forward(call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, lse, max_scores or None), only from a kernel that has passed its self-check on this
    GPU (run now if it has not run: a direct call is gated too)."""
    require(self_check(call, "forward"))
    return _run(call)
