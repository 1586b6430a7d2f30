"""Host half of the Hopper (sm_90a) FlashAttention backward: compile, load and launch the three
kernels of ``cute_sm90_bwd`` through TVM-FFI.

What this module holds
----------------------
* ``compile_bwd(cfg, aux_tensors, aux_scalars, parts=PARTS)``: each part ("pre", "main",
  "post") compiled once against placeholder tensors (sizes, strides, batch and heads are
  runtime values), returned as a ``CompiledBwd``. Works on a CPU-only machine with
  CUTE_DSL_ARCH=sm_90a.
* ``load_bwd(cfg, ffi_fns)``: the same ``CompiledBwd`` from functions loaded from the disk cache
  (each part exported on its own by ``_Part.export``).
* ``CompiledBwd.__call__``: the argument checks (shapes, head dims, block lists, aux scalars,
  captured-gradient accumulators), the fp32 workspaces (lse2, delta, the dQ accumulator, the
  deterministic mode's semaphores) from torch's caching allocator, then preprocess → main →
  postprocess on torch's current stream (or ``stream``).
* ``padded_len`` (the workspaces' rows) and ``num_grad_accs`` (how many fp64 accumulators the
  main kernel takes).
* The parts the sm100 backward's host (``cute_sm100_bwd``) shares, its kernels taking the same
  arguments: ``CompiledBwd`` (subclassed there for its semaphore count and operand checks),
  ``compile_parts`` (the compile loop), ``aux_signature``, ``_block_args`` and the
  placeholders.

The kernels, their configuration (``BwdConfig``, ``choose_bwd_tiling``, ``HEAD_DIMS``) and the
argument contracts (layouts, block lists, deterministic order) are ``cute_sm90_bwd``'s; this
module only builds the arguments those contracts name, so a change here never changes the
generated device code.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flexjit.templates.cute.common import MASK_BLOCK, as_scalar, aux_cutlass_dtype, check_kv_batch, ffi_function, placeholder, stream_context, tvm_ffi_enabled
from flexjit.templates.cute.sm90.bwd import BwdConfig, FlexAttentionBwdPostSm90, FlexAttentionBwdPreSm90, FlexAttentionBwdSm90, QBlockLists, QOrder


def padded_len(seqlen_q: int) -> int:
    """Rows of the lse2 / delta / dQ-accumulator workspaces: whole mask blocks, so that every
    Q tile's TMA box is in bounds and every row stride is a multiple of 16 bytes."""
    return max(1, -(-seqlen_q // MASK_BLOCK)) * MASK_BLOCK


class _Part:
    """One compiled kernel of the backward: ``cute.compile``'s result (None when loaded from
    disk) and the bare TVM-FFI function that is called."""

    def __init__(self, compiled, ffi_fn):
        self.compiled = compiled
        self.ffi_fn = ffi_fn

    def export(self, object_file_path: str, function_name: str) -> None:
        if self.compiled is None:
            raise RuntimeError("only a function compiled in this process can be exported")
        self.compiled.export_to_c(object_file_path=object_file_path, function_name=function_name)


PARTS = ("pre", "main", "post")


def _block_args(cfg: BwdConfig, block_lists, q_order):
    """(q lists, QOrder tensors or None) from the 8 BlockMask tensors (kv lists first, as in
    ``BlockMask._TENSOR_ATTRS``; zeros for absent full lists); (None, None) without a mask."""
    import torch

    if (block_lists is not None) != cfg.has_block_mask:
        raise ValueError("block_lists presence must match BwdConfig.has_block_mask")
    if block_lists is None:
        return None, None
    if len(block_lists) != 8 or any(t is None for t in block_lists):
        raise ValueError("block_lists: kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, "
                         "full_q_num, full_q_idx (zeros for absent full lists)")
    if cfg.deterministic:
        if q_order is None:
            raise ValueError("a deterministic launch needs q_order = flexjit.block_mask.dq_order(block_lists)")
        qlists, order = q_order
        return tuple(qlists), tuple(order)
    return tuple(t.to(torch.int32).contiguous() for t in block_lists[4:]), None  # no-op if int32


def _tma_ready(t) -> bool:
    """What the TVM-FFI wrapper checks for a TMA operand: unit last stride, other strides
    multiples of 16 bytes, a 16-byte aligned base."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((x * t.element_size()) % 16 == 0 for x in t.stride()[:-1]))


def _placeholder_main_args(cfg: BwdConfig, aux_tensors, aux_scalars) -> tuple:
    q, k, v, do, dk, dv = [placeholder(cfg.dtype, 4, 16, 8) for _ in range(6)]
    lse2, delta = [placeholder(Float32, 3, 16, 4) for _ in range(2)]
    dqacc = placeholder(Float32, 4, 16, 4)
    qblocks = qorder = None
    if cfg.has_block_mask:
        qblocks = QBlockLists(*[placeholder(Int32, n, 4) for n in (3, 4, 3, 4)])
        if cfg.deterministic:
            qorder = QOrder(*[placeholder(Int32, 4, 4) for _ in range(2)])
    sem = placeholder(Int32, 3, 4) if cfg.deterministic else None
    tensors = tuple(placeholder(aux_cutlass_dtype(t.dtype), t.ndim, t.element_size())
                    for t in aux_tensors)
    scalars = tuple(as_scalar(x) for x in aux_scalars)
    accs = tuple(placeholder(cutlass.Float64, 1, 8) for _ in range(num_grad_accs(cfg)))
    return (q, k, v, do, lse2, delta, dqacc, dk, dv, Float32(1.0), Int32(1), qblocks, qorder, sem,
            tensors or None, scalars or None, accs or None)


def num_grad_accs(cfg: BwdConfig) -> int:
    """How many fp64 captured-gradient accumulators the main kernel takes."""
    if cfg.grad_offsets is None:
        return 0
    return max(cfg.grad_offsets.acc) + 1


def _placeholder_pre_args(cfg: BwdConfig) -> tuple:
    o, do = [placeholder(cfg.dtype, 4, 16, 8) for _ in range(2)]
    lse, dlse = [placeholder(Float32, 3, 4) for _ in range(2)]
    lse2, delta = [placeholder(Float32, 3, 16, 4) for _ in range(2)]
    dqacc = placeholder(Float32, 4, 16, 4)
    sem = placeholder(Int32, 3, 4) if cfg.deterministic else None
    return (o, do, lse, dlse, Int32(0), lse2, delta, dqacc, sem)


def _placeholder_post_args(cfg: BwdConfig) -> tuple:
    return (placeholder(Float32, 4, 16, 4), placeholder(cfg.dtype, 4, 16, 8), Float32(1.0))


class CompiledBwd:
    """The three compiled kernels of one backward and the facts needed to launch them.

    ``__call__`` allocates the fp32 workspaces (lse2, delta, dQ accumulator, semaphores) from
    torch's caching allocator and runs preprocess → main → postprocess on the current stream
    (or ``stream``). The sm100 backward's host (``cute_sm100_bwd.CompiledBwd``) is this class
    with its own ``NAME``, ``sem_len`` and ``check_operands``: its kernels take the same
    arguments."""

    NAME = "cute_sm90_bwd"  # the prefix of the shape error

    def __init__(self, cfg: BwdConfig, parts: dict, signature):
        self.cfg = cfg
        self.parts = parts  # "pre" / "main" / "post" -> _Part
        self.signature = signature

    def sem_len(self, lpad: int) -> int:
        """Semaphores per (batch, query head) in deterministic mode: two per q tile (one per
        tile for each of the two dQ boxes), zeroed by the preprocess."""
        return 2 * (lpad // self.cfg.tiling.tile_m)

    def check_operands(self, q, k, v, dq, dk, dv) -> None:
        """What the kernels need of the operands beyond consistent shapes: here K/V's batch
        against the query's (``check_kv_batch``)."""
        check_kv_batch(self.cfg.kv_batch_broadcast, q, k, v)

    def __call__(self, q, k, v, out, dout, lse, dlse, dq, dk, dv, softmax_scale: float,
                 block_lists=None, aux_tensors=(), aux_scalars=(), stream=None, q_order=None,
                 grad_accs=()):
        """Write dq, dk, dv (preallocated like q, k, v; dk/dv with the query's batch when
        ``BwdConfig.kv_batch_broadcast`` gives k/v batch 1: the caller sums them over it) and
        return them.

        ``lse`` is the forward's natural-log LSE (B, Hq, L) fp32; ``dlse`` its gradient or None;
        ``dout`` None means zeros (autograd passes None when only the LSE was used).
        ``block_lists``: the 8 BlockMask tensors (kv lists, then q lists) or None.
        ``q_order``: ``flexjit.block_mask.dq_order(block_lists)``, required in deterministic
        mode (the host builds it once per BlockMask).
        ``grad_accs``: with ``BwdConfig.score_grads``, one zeroed contiguous float64 tensor per
        learnable captured tensor (``num_grad_accs``), shaped like it (or flat): the kernel adds
        d loss / d tensor into them."""
        if stream is None:
            return self._launch(q, k, v, out, dout, lse, dlse, dq, dk, dv, softmax_scale,
                                block_lists, aux_tensors, aux_scalars, q_order, grad_accs)
        with stream_context(stream):
            return self._launch(q, k, v, out, dout, lse, dlse, dq, dk, dv, softmax_scale,
                                block_lists, aux_tensors, aux_scalars, q_order, grad_accs)

    def _launch(self, q, k, v, out, dout, lse, dlse, dq, dk, dv, softmax_scale, block_lists,
                aux_tensors, aux_scalars, q_order, grad_accs):
        import torch

        cfg = self.cfg
        B, Hq, L, D = q.shape
        Hkv = k.shape[1]
        if dout is None:
            dout = torch.zeros_like(out)
        elif not _tma_ready(dout):  # e.g. the expanded (stride 0) gradient of out.sum()
            dout = dout.contiguous()
        o_shape = (B, Hq, L, v.shape[-1])  # (192, 128): out/dout/v narrower than q/k
        # dK/dV are per query batch, also when K/V are one batch broadcast over it.
        dk_shape, dv_shape = (B, *k.shape[1:]), (B, *v.shape[1:])
        if (tuple(out.shape) != o_shape or tuple(dout.shape) != o_shape or dq.shape != q.shape
                or tuple(dk.shape) != dk_shape or tuple(dv.shape) != dv_shape
                or v.shape[:-1] != k.shape[:-1]
                or (D, v.shape[-1]) != (cfg.head_dim, cfg.head_dim_v)
                or tuple(lse.shape) != (B, Hq, L) or Hq % Hkv):
            raise ValueError(f"{self.NAME}: inconsistent shapes")
        self.check_operands(q, k, v, dq, dk, dv)
        lpad = padded_len(L)
        f32 = dict(dtype=torch.float32, device=q.device)
        lse2 = torch.empty(B, Hq, lpad, **f32)
        delta = torch.empty(B, Hq, lpad, **f32)
        dqacc = torch.empty(B, Hq, lpad, D, **f32)  # zeroed by the preprocess
        sem = None
        if cfg.deterministic:  # zeroed by the preprocess
            sem = torch.empty(B, Hq, self.sem_len(lpad), dtype=torch.int32, device=q.device)
        has_dlse = dlse is not None
        dlse = dlse.float().contiguous() if has_dlse else lse  # autograd may hand a stride-0 grad
        qblocks, qorder = _block_args(cfg, block_lists, q_order)
        tensors = tuple(t if t.is_contiguous() else t.contiguous() for t in aux_tensors) or None
        for x in aux_scalars:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise TypeError(f"aux scalar must be a Python int or float, got {type(x)}")
        if len(grad_accs) != num_grad_accs(cfg):
            raise ValueError(f"expected {num_grad_accs(cfg)} captured-gradient accumulators, "
                             f"got {len(grad_accs)}")
        for a in grad_accs:
            if a.dtype != torch.float64 or not a.is_contiguous():
                raise ValueError("captured-gradient accumulators must be contiguous float64")
        accs = tuple(a.view(-1) for a in grad_accs) or None
        self.parts["pre"].ffi_fn(out, dout, lse, dlse, int(has_dlse), lse2, delta, dqacc, sem)
        self.parts["main"].ffi_fn(q, k, v, dout, lse2, delta, dqacc, dk, dv, float(softmax_scale),
                                  Hq // Hkv, qblocks, qorder, sem, tensors,
                                  tuple(aux_scalars) or None, accs)
        self.parts["post"].ffi_fn(dqacc, dq, float(softmax_scale))
        return dq, dk, dv


def compile_bwd(cfg: BwdConfig, aux_tensors=(), aux_scalars=(), options: str = "",
                parts=PARTS) -> CompiledBwd:
    """Compile the backward's kernels for this config and these aux kinds (dtypes and ranks of
    the captured tensors, types of the scalars). Sizes, strides, batch and heads are runtime
    values, so no example q/k/v are needed. Works on a CPU-only machine with
    CUTE_DSL_ARCH=sm_90a; with ``options='--keep-ptx'`` each part's ``compiled.__ptx__`` holds
    its PTX. ``parts``: which kernels to compile (the others are left out of the result)."""
    if not tvm_ffi_enabled():
        raise RuntimeError("cute_sm90_bwd launches through TVM-FFI only (import tvm_ffi failed "
                           ")")
    signature = aux_signature(aux_tensors, aux_scalars)
    kernels = {
        "pre": lambda: (FlexAttentionBwdPreSm90(cfg), _placeholder_pre_args(cfg)),
        "main": lambda: (FlexAttentionBwdSm90(cfg),
                         _placeholder_main_args(cfg, aux_tensors, aux_scalars)),
        "post": lambda: (FlexAttentionBwdPostSm90(cfg), _placeholder_post_args(cfg)),
    }
    built = compile_parts(kernels, f"{options} --enable-tvm-ffi".strip(), parts, ffi_function)
    return CompiledBwd(cfg, built, signature)


def aux_signature(aux_tensors, aux_scalars) -> tuple:
    """A compiled kernel's argument kinds: (dtype, rank) per captured tensor, then the DSL type
    name of each scalar (``as_scalar``: a TypeError for anything but a Python int or float)."""
    return tuple((t.dtype, t.ndim) for t in aux_tensors) + tuple(
        type(as_scalar(x)).__name__ for x in aux_scalars)


def compile_parts(kernels: dict, options: str, parts, launcher) -> dict:
    """{part: _Part} for each name in ``parts``, in order: ``kernels[name]()`` gives the kernel
    object and its placeholder arguments, compiled with ``options`` against TVM-FFI's
    environment stream; ``launcher(compiled)`` gives the function that is called (the sm100
    host's gives None for a kernel this process cannot launch). Shared by both archs' hosts."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    built = {}
    for name in parts:
        if name not in kernels:
            raise ValueError(f"unknown part {name!r}")
        kernel, args = kernels[name]()
        compiled = cute.compile(kernel, *args, stream, options=options)
        built[name] = _Part(compiled, launcher(compiled))
    return built


def load_bwd(cfg: BwdConfig, ffi_fns: dict, signature=()) -> CompiledBwd:
    """A ``CompiledBwd`` from functions loaded from exported object files (``_Part.export``)."""
    return CompiledBwd(cfg, {name: _Part(None, fn) for name, fn in ffi_fns.items()}, signature)
