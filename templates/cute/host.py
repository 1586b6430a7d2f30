"""The kernels' host side, both archs: compile against placeholders through TVM-FFI, load, and
launch (argument kinds and checks, the backward's workspaces and its three kernels' calls)."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flexjit.templates.cute.block_sparse import QBlockLists, QOrder
from flexjit.templates.cute.common import MASK_BLOCK


def tvm_ffi_enabled() -> bool:
    """Whether compiles use the TVM-FFI launch path (``tvm_ffi`` importable and the DSL has the
    placeholder API)."""
    try:
        import tvm_ffi  # noqa: F401  (importable: the launch path exists)
    except ImportError:
        return False
    return all(hasattr(cute.runtime, n) for n in ("make_fake_tensor", "make_fake_stream"))


def require_tvm_ffi(template: str) -> None:
    if not tvm_ffi_enabled():
        raise RuntimeError(f"{template} compiles through TVM-FFI only (tvm_ffi not importable)")


def compile_options(options: str, gpu_arch=None) -> str:
    """The caller's options, the target arch (None: CUTE_DSL_ARCH's) and the TVM-FFI path."""
    arch = f" --gpu-arch {gpu_arch}" if gpu_arch else ""
    return f"{options}{arch} --enable-tvm-ffi".strip()


def cutlass_dtype(torch_dtype, template: str):
    """q/k/v's element type: bf16 or fp16."""
    import torch

    table = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
    if torch_dtype not in table:
        raise TypeError(f"{template}: unsupported dtype {torch_dtype}")
    return table[torch_dtype]


def aux_cutlass_dtype(torch_dtype):
    import torch

    table = {torch.float32: Float32, torch.float16: cutlass.Float16,
             torch.bfloat16: cutlass.BFloat16, torch.float64: cutlass.Float64, torch.int32: Int32,
             torch.int64: cutlass.Int64, torch.int16: cutlass.Int16, torch.int8: cutlass.Int8,
             torch.uint8: cutlass.Uint8, torch.bool: cutlass.Boolean}
    if torch_dtype not in table:
        raise TypeError(f"cute: unsupported aux tensor dtype {torch_dtype}")
    return table[torch_dtype]


def as_scalar(x):
    if isinstance(x, (Float32, Int32)):
        return x
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"aux scalar must be a Python int or float, got {type(x)}")
    return Int32(x) if isinstance(x, int) else Float32(x)


def placeholder(dtype, ndim: int, align: int, stride_div: int = 1):
    """A compile-time stand-in for a torch tensor of this dtype and rank: every size is a runtime
    Int32, every stride a runtime Int64 (divisible by ``stride_div``) but the last, which is 1 —
    the same type ``from_dlpack(t).mark_layout_dynamic(leading_dim=ndim - 1)`` gives a CUDA
    tensor (global memory), plus the divisibility the TMA contract already requires."""
    shape = tuple(cute.sym_int32() for _ in range(ndim))
    stride = tuple(cute.sym_int64(divisibility=stride_div) for _ in range(ndim - 1)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=align)


def aux_placeholders(aux_tensors, aux_scalars) -> tuple:
    """(captured tensors, scalars) as compile-time arguments; None for an empty tuple (empty
    tuples are not jit arguments)."""
    tensors = tuple(placeholder(aux_cutlass_dtype(t.dtype), t.ndim, t.element_size())
                    for t in aux_tensors)
    scalars = tuple(as_scalar(x) for x in aux_scalars)
    return tensors or None, scalars or None


def aux_args(aux_tensors, aux_scalars) -> tuple:
    """(captured tensors, scalars) as TVM-FFI call arguments: contiguous tensors, Python ints and
    floats (a TypeError for anything else); None for an empty tuple."""
    tensors = tuple(t if t.is_contiguous() else t.contiguous() for t in aux_tensors) or None
    for x in aux_scalars:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError(f"aux scalar must be a Python int or float, got {type(x)}")
    return tensors, tuple(aux_scalars) or None


def aux_signature(aux_tensors, aux_scalars) -> tuple:
    """A compiled kernel's argument kinds: (dtype, rank) per captured tensor, then the DSL type
    name of each scalar (``as_scalar``: a TypeError for anything but a Python int or float)."""
    return tuple((t.dtype, t.ndim) for t in aux_tensors) + tuple(
        type(as_scalar(x)).__name__ for x in aux_scalars)


def check_kv_batch(kv_batch_broadcast: bool, q, k, v) -> None:
    """K/V's batch against the query's: equal, or 1 for a kernel compiled with
    ``kv_batch_broadcast`` (whose K/V batch stride must then be nonzero: a TMA descriptor is
    built over it). Neither kernel reads another batch entry than these allow: an unflagged
    kernel given a K/V batch of 1 would read past it (zeros from the TMA unit, a silent wrong
    answer), hence the check on the host."""
    want = 1 if kv_batch_broadcast else q.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != want:
            raise ValueError(f"{name} has batch {t.shape[0]}, the kernel takes {want} "
                             f"(query batch {q.shape[0]}, kv_batch_broadcast={kv_batch_broadcast})")
        if t.stride(0) == 0 and (t.shape[0] > 1 or kv_batch_broadcast):
            raise ValueError(f"{name}: a zero batch stride; pass the un-expanded (1, H, S, D) "
                             "tensor to a kv_batch_broadcast kernel")


def tma_ready(t) -> bool:
    """What the TVM-FFI wrapper checks for a TMA operand: unit last stride, other strides
    multiples of 16 bytes, a 16-byte aligned base."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((x * t.element_size()) % 16 == 0 for x in t.stride()[:-1]))


def ffi_function(compiled):
    """The bare ``tvm_ffi.Function`` of a TVM-FFI compile: positional arguments, no stream (the
    environment stream is implicit), no Python wrapper. A function loaded from an exported
    object file is already one."""
    get = getattr(compiled, "__tvm_ffi_object__", None)
    fn = get() if get is not None else compiled
    if fn is None:
        raise RuntimeError("the TVM-FFI function was not created (compiled for another arch?)")
    return fn


def launcher(compiled):
    """The TVM-FFI function of a compile, or None: compiled for an arch this process cannot
    launch (CUTE_DSL_ARCH differs, or a CPU-only machine)."""
    try:
        return ffi_function(compiled)
    except RuntimeError:
        return None


def stream_context(stream):
    """Run under ``stream`` (a torch stream, a CUstream or a raw handle) as torch's current
    stream, which the TVM-FFI wrapper launches on."""
    import torch

    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return torch.cuda.stream(torch.cuda.ExternalStream(int(stream)))


def env_stream():
    """The compile-time stream of a TVM-FFI kernel: torch's current stream at each call."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


class CompiledFwd:
    """A compiled forward and the facts needed to launch it again on new shapes.

    ``compiled`` is what ``cute.compile`` returned (``None`` for a function loaded from disk);
    ``ffi_fn`` the bare TVM-FFI function a launch calls (None where this process cannot launch
    it); ``signature`` what the compile was specialised on (for cache checks)."""

    def __init__(self, cfg, compiled, signature, ffi_fn=None):
        self.cfg = cfg
        self.compiled = compiled
        self.signature = signature
        self.ffi_fn = ffi_fn

    @property
    def tvm_ffi(self) -> bool:
        return self.ffi_fn is not None

    def export(self, object_file_path: str, function_name: str) -> None:
        """Write the compiled function to an object file (TVM-FFI path only);
        ``cute.runtime.load_module(path, enable_tvm_ffi=True).<function_name>`` loads it back."""
        if not self.tvm_ffi or self.compiled is None:
            raise RuntimeError("only a function compiled here through TVM-FFI can be exported")
        self.compiled.export_to_c(object_file_path=object_file_path, function_name=function_name)

    def check_max_scores(self, max_scores) -> None:
        if (max_scores is not None) != self.cfg.write_max:
            raise ValueError("max_scores must be given exactly when the kernel writes it "
                             "(write_max)")


# ---------------------------------------------------------------------------------------------
# The backward: three kernels (pre, main, post) with the same arguments on both archs
# ---------------------------------------------------------------------------------------------
PARTS = ("pre", "main", "post")


def padded_len(seqlen_q: int) -> int:
    """Rows of the lse2 / delta / dQ-accumulator workspaces: whole mask blocks, so that every
    Q tile's TMA box is in bounds and every row stride is a multiple of 16 bytes."""
    return max(1, -(-seqlen_q // MASK_BLOCK)) * MASK_BLOCK


def num_grad_accs(cfg) -> int:
    """How many fp64 captured-gradient accumulators the main kernel takes."""
    if cfg.grad_offsets is None:
        return 0
    return max(cfg.grad_offsets.acc) + 1


class Part:
    """One compiled kernel of the backward: ``cute.compile``'s result (None when loaded from
    disk) and the bare TVM-FFI function that is called."""

    def __init__(self, compiled, ffi_fn):
        self.compiled = compiled
        self.ffi_fn = ffi_fn

    def export(self, object_file_path: str, function_name: str) -> None:
        if self.compiled is None:
            raise RuntimeError("only a function compiled in this process can be exported")
        self.compiled.export_to_c(object_file_path=object_file_path, function_name=function_name)


def compile_parts(kernels: dict, options: str, parts, launch=ffi_function) -> dict:
    """{part: Part} for each name in ``parts``, in order: ``kernels[name]()`` gives the kernel
    object and its placeholder arguments, compiled with ``options`` against TVM-FFI's
    environment stream; ``launch(compiled)`` gives the function that is called."""
    stream = env_stream()
    built = {}
    for name in parts:
        if name not in kernels:
            raise ValueError(f"unknown part {name!r}")
        kernel, args = kernels[name]()
        compiled = cute.compile(kernel, *args, stream, options=options)
        built[name] = Part(compiled, launch(compiled))
    return built


def block_args(cfg, block_lists, q_order):
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
            raise ValueError("a deterministic launch needs q_order = "
                             "flexjit.block_mask.dq_order(block_lists)")
        qlists, order = q_order
        return tuple(qlists), tuple(order)
    return tuple(t.to(torch.int32).contiguous() for t in block_lists[4:]), None  # no-op if int32


def placeholder_main_args(cfg, aux_tensors, aux_scalars) -> tuple:
    """The main kernel's compile-time arguments (its ``__call__``'s order, no stream)."""
    q, k, v, do, dk, dv = [placeholder(cfg.dtype, 4, 16, 8) for _ in range(6)]
    lse2, delta = [placeholder(Float32, 3, 16, 4) for _ in range(2)]
    dqacc = placeholder(Float32, 4, 16, 4)
    qblocks = qorder = None
    if cfg.has_block_mask:
        qblocks = QBlockLists(*[placeholder(Int32, n, 4) for n in (3, 4, 3, 4)])
        if cfg.deterministic:
            qorder = QOrder(*[placeholder(Int32, 4, 4) for _ in range(2)])
    sem = placeholder(Int32, 3, 4) if cfg.deterministic else None
    tensors, scalars = aux_placeholders(aux_tensors, aux_scalars)
    accs = tuple(placeholder(cutlass.Float64, 1, 8) for _ in range(num_grad_accs(cfg)))
    return (q, k, v, do, lse2, delta, dqacc, dk, dv, Float32(1.0), Int32(1), qblocks, qorder, sem,
            tensors, scalars, accs or None)


def placeholder_pre_args(cfg) -> tuple:
    o, do = [placeholder(cfg.dtype, 4, 16, 8) for _ in range(2)]
    lse, dlse = [placeholder(Float32, 3, 4) for _ in range(2)]
    lse2, delta = [placeholder(Float32, 3, 16, 4) for _ in range(2)]
    dqacc = placeholder(Float32, 4, 16, 4)
    sem = placeholder(Int32, 3, 4) if cfg.deterministic else None
    return (o, do, lse, dlse, Int32(0), lse2, delta, dqacc, sem)


def placeholder_post_args(cfg) -> tuple:
    return (placeholder(Float32, 4, 16, 4), placeholder(cfg.dtype, 4, 16, 8), Float32(1.0))


class CompiledBwd:
    """The three compiled kernels of one backward and the facts needed to launch them.

    ``__call__`` allocates the fp32 workspaces (lse2, delta, dQ accumulator, semaphores) from
    torch's caching allocator and runs preprocess → main → postprocess on the current stream
    (or ``stream``). An arch's subclass names itself (``NAME``) and gives its semaphore count
    (``sem_len``) and operand checks (``check_operands``)."""

    NAME = "cute_bwd"  # the prefix of the shape error

    def __init__(self, cfg, parts: dict, signature):
        self.cfg = cfg
        self.parts = parts  # "pre" / "main" / "post" -> Part
        self.signature = signature

    def sem_len(self, lpad: int) -> int:
        raise NotImplementedError

    def check_operands(self, q, k, v, dq, dk, dv) -> None:
        raise NotImplementedError

    def dq_transposed(self) -> bool:
        """Whether the main kernel accumulates dQ transposed, (B, Hq, D, Lpad)."""
        return False

    def kv_outputs(self, dk, dv) -> tuple:
        """What the main kernel writes dK and dV into: dk and dv themselves, or workspaces that
        ``finish_kv`` converts into them."""
        return dk, dv

    def finish_kv(self, kv_out: tuple, dk, dv) -> None:
        """dk, dv from ``kv_outputs``' workspaces (nothing to do when the main kernel wrote them)."""

    def __call__(self, q, k, v, out, dout, lse, dlse, dq, dk, dv, softmax_scale: float,
                 block_lists=None, aux_tensors=(), aux_scalars=(), stream=None, q_order=None,
                 grad_accs=()):
        """Write dq, dk, dv (preallocated like q, k, v; dk/dv with the query's batch when
        ``kv_batch_broadcast`` gives k/v batch 1: the caller sums them over it) and return them.

        ``lse`` is the forward's natural-log LSE (B, Hq, L) fp32; ``dlse`` its gradient or None;
        ``dout`` None means zeros (autograd passes None when only the LSE was used).
        ``block_lists``: the 8 BlockMask tensors (kv lists, then q lists) or None.
        ``q_order``: ``flexjit.block_mask.dq_order(block_lists)``, required in deterministic
        mode (the host builds it once per BlockMask).
        ``grad_accs``: with ``score_grads``, one zeroed contiguous float64 tensor per learnable
        captured tensor (``num_grad_accs``), shaped like it (or flat): the kernel adds
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
        elif not tma_ready(dout):  # e.g. the expanded (stride 0) gradient of out.sum()
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
        # Zeroed by the preprocess, which sees it as (B, Hq, Lpad, D) either way.
        if self.dq_transposed():
            dqacc = torch.empty(B, Hq, D, lpad, **f32)
            dqacc_rows = dqacc.view(B, Hq, lpad, D)
        else:
            dqacc = dqacc_rows = torch.empty(B, Hq, lpad, D, **f32)
        sem = None
        if cfg.deterministic:  # zeroed by the preprocess
            sem = torch.empty(B, Hq, self.sem_len(lpad), dtype=torch.int32, device=q.device)
        has_dlse = dlse is not None
        dlse = dlse.float().contiguous() if has_dlse else lse  # autograd may hand a stride-0 grad
        qblocks, qorder = block_args(cfg, block_lists, q_order)
        tensors, scalars = aux_args(aux_tensors, aux_scalars)
        if len(grad_accs) != num_grad_accs(cfg):
            raise ValueError(f"expected {num_grad_accs(cfg)} captured-gradient accumulators, "
                             f"got {len(grad_accs)}")
        for a in grad_accs:
            if a.dtype != torch.float64 or not a.is_contiguous():
                raise ValueError("captured-gradient accumulators must be contiguous float64")
        accs = tuple(a.view(-1) for a in grad_accs) or None
        kv_out = self.kv_outputs(dk, dv)
        self.parts["pre"].ffi_fn(out, dout, lse, dlse, int(has_dlse), lse2, delta, dqacc_rows, sem)
        self.parts["main"].ffi_fn(q, k, v, dout, lse2, delta, dqacc, *kv_out, float(softmax_scale),
                                  Hq // Hkv, qblocks, qorder, sem, tensors, scalars, accs)
        self.parts["post"].ffi_fn(dqacc, dq, float(softmax_scale))
        self.finish_kv(kv_out, dk, dv)
        return dq, dk, dv


def load_parts(ffi_fns: dict) -> dict:
    """{part: Part} from functions loaded from exported object files (``Part.export``)."""
    return {name: Part(None, fn) for name, fn in ffi_fns.items()}
