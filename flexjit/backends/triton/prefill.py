"""The Triton backend: plan, launch and differentiate a call on the Triton kernels.

The backend is split by stage; this module is its entry (``flexjit.dispatch`` and the CuTeDSL
backend import it) and re-exports what callers use from the others:

* ``triton_render``: IR → Triton source in the holes of ``templates/triton_{fwd,bwd}.py``.
* ``triton_cache``: the rendered module on disk and imported once per (IR, template); how Triton
  is imported (compiled, or interpreted under ``TRITON_INTERPRET=1``); ``STATS``.
* ``triton_config``: block configurations (``fwd_config``/``bwd_config``): a static table per
  (arch, dtype, head dim), fitted to the mask's block size and to shared memory;
  ``kernel_options`` can override.

What this module holds
----------------------
* The plan of a call (``make_plan``, ``Plan``: block lists, configs, arch) and its launches
  (``Launch``: ``fwd_launch``, ``preprocess_launch``, ``bwd_launch``), run by ``_run``, which
  retries with fewer stages when Triton's shared memory outgrows the estimate.
  ``FLEXJIT_POISON=1`` NaN-fills outputs.
* ``forward``/``backward`` for ``flexjit.dispatch`` (the backward needs only out and lse, so
  it also follows the CuTeDSL forward). ``forward`` sends decode-shaped calls without gradients
  to ``triton_decode`` (split-KV decoding).
* Compile-only builds (``launches_for`` + ``compile_launch``): the exact launches a training
  step makes, built for any sm_XX without a GPU, specialised as Triton's launcher would.
* The backend interface ``supports`` / ``backward_supports``.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from flexjit import config
from flexjit.backends.base import device_buffers
from flexjit.ir.program import Program
from flexjit.planner.block_mask import _transpose_ordered
from flexjit.backends.base import capability
from flexjit.backends.fp8 import compute_dtype
from flexjit.backends.triton.sources import STATS, cache_key, compiler_env, forget_imported, import_triton, interpreting, load_module, triton_compiles
from flexjit.backends.triton.config import _BWD_TABLE, _FWD_TABLE, SHORT_KV_LOOP, BwdConfig, FwdConfig, _fwd_smem, bwd_config, fwd_config, head_pad, smem_limit
from flexjit.backends.triton.render import buffer_ranks, capture_names, fill, grad_names, grad_slots, render, render_holes, template_text

LOG2E = 1.4426950408889634
log = logging.getLogger("flexjit")


# --------------------------------------------------------------------------- launch


def arch_number(device: torch.device) -> int:
    """80, 90, 100, ... for a CUDA device; 80 for the interpreter (its tables are Ampere's)."""
    if device.type != "cuda":
        return 80
    major, minor = capability(device)
    return major * 10 + minor


def _dot_precision(dtype: torch.dtype, interpret: bool) -> str:
    """tl.dot's input_precision: fp32 inputs take TF32 where torch's own fp32 matmuls would
    (``torch.backends.cuda.matmul.fp32_precision``, else ``torch.get_float32_matmul_precision()``
    not "highest": torch Flex-Triton's rule), else IEEE; the interpreter upcasts bf16 (see the
    templates' ``_dot``)."""
    if interpret and dtype == torch.bfloat16:
        return "interp-upcast"
    if dtype == torch.float32 and fp32_matmul_is_tf32():
        return "tf32"
    return "ieee"


def fp32_matmul_is_tf32() -> bool:
    """Whether torch computes float32 matmuls on CUDA in TF32."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if precision not in (None, "none"):
        return precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


def _bcast_strides(t: torch.Tensor) -> list[int]:
    """Strides with 0 on size-1 dims, so one offset formula serves B/H broadcast lists."""
    return [0 if n == 1 else s for n, s in zip(t.shape, t.stride())]


@dataclasses.dataclass
class _Lists:
    """Block lists as the kernels read them: int32, contiguous, broadcast strides."""
    num: torch.Tensor | None
    idx: torch.Tensor | None
    full_num: torch.Tensor | None
    full_idx: torch.Tensor | None

    @property
    def present(self) -> bool:
        return self.num is not None or self.full_num is not None

    def args(self, dummy: torch.Tensor) -> list:
        num = self.num if self.num is not None else self.full_num
        idx = self.idx if self.idx is not None else self.full_idx
        if num is None:
            return [dummy] * 4 + [0] * 7
        full_num = self.full_num if self.full_num is not None else num
        full_idx = self.full_idx if self.full_idx is not None else idx
        return [num if self.num is not None else dummy, idx if self.idx is not None else dummy,
                full_num, full_idx, *_bcast_strides(num), *_bcast_strides(idx)]


def _i32(t):
    return None if t is None else t.to(torch.int32).contiguous()


def _kv_lists(bm) -> _Lists:
    """The kv block lists as the kernels read them, built once per BlockMask."""
    return bm.derived("triton_kv_lists", lambda: _Lists(
        _i32(bm.kv_num_blocks), _i32(bm.kv_indices),
        _i32(bm.full_kv_num_blocks), _i32(bm.full_kv_indices)))


@dataclasses.dataclass
class Plan:
    """Everything about one call that is not a differentiable tensor."""
    program: Program
    scale: float
    kv_lists: _Lists
    q_lists: _Lists | None  # computed lazily for the backward
    block_mask: object
    sparse: tuple[int, int] | None
    fwd: FwdConfig
    kernel_options: dict
    arch: int
    interpret: bool
    fast_math: bool
    dot: str  # tl.dot's input precision (``_dot_precision``: torch's matmul precision at plan time)

    @property
    def tf32(self) -> bool:
        return self.dot == "tf32"


def _capture_args(p: Program, bufs) -> list:
    """Run-time values for ``capture_names``: each read tensor (bool as uint8), its sizes and
    strides, then the scalars."""
    args = []
    for slot in buffer_ranks(p):
        t = bufs[slot]
        args.append(t.view(torch.uint8) if t.dtype == torch.bool else t)
        args += list(t.shape) + list(t.stride())
    return args + list(p.scalars)


def _common_constexprs(plan: Plan, E: int, EV: int) -> dict:
    p = plan.program
    return dict(E=E, EV=EV, E_PAD=head_pad(E), EV_PAD=head_pad(EV),
                SPARSE_Q=plan.sparse[0] if plan.sparse else 16,
                SPARSE_KV=plan.sparse[1] if plan.sparse else 16,
                HAS_BLOCK_MASK=plan.sparse is not None,
                HAS_MASK_MOD=p.mask is not None, HAS_SCORE_MOD=p.score is not None,
                FAST_MATH=plan.fast_math)


@dataclasses.dataclass
class Launch:
    """One kernel launch: the kernel's name in the generated module, grid, positional run-time
    arguments (in the kernel's parameter order), constexprs and launch options. Real launches
    and compile-only builds (``compile_launch``) are made from the same object."""
    which: str
    kernel: str
    grid: tuple
    args: list
    constexprs: dict
    options: dict


def _options(num_warps: int, num_stages: int) -> dict:
    # FMA contraction on (Triton 3.9's default, to become opt-in in 3.10): the softmax's
    # scale-and-subtract and the O rescale are FMAs. Mask arithmetic is integer in practice.
    return dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True)


def _tma_ok(tensors, even: bool) -> bool:
    """Whether tensor descriptors over (rows, dim) views can serve these tensors: contiguous (the
    kernels address row (b·H + h)·len + i), 16-byte aligned, an unpadded power-of-two head dim
    (the box is the padded dim), and ``even`` lengths (no tile reaches past its head's rows, so
    the descriptors' missing per-head bounds are never needed). Otherwise: pointer loads."""
    if not even:
        return False
    for t in tensors:
        d = t.shape[-1]
        if t.numel() == 0 or not t.is_contiguous() or d != head_pad(d) or (d * t.element_size()) % 16:
            return False
        if t.device.type != "meta" and t.data_ptr() % 16:
            return False
    return True


def _descriptor(t: torch.Tensor, rows: int):
    """A host-side TMA descriptor of contiguous ``t`` viewed as (numel / dim, dim), block (rows, dim)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    d = t.shape[-1]
    return TensorDescriptor(t, [t.numel() // d, d], [d, 1], [rows, d])


def fwd_launch(plan: Plan, q, k, v, out, lse, bufs, max_scores=None) -> Launch:
    """``max_scores``: a (B, Hq, L) fp32 tensor for the row max of the modded scores, or None."""
    B, Hq, L, E = q.shape
    Hkv, S, EV = k.shape[1], k.shape[2], v.shape[3]
    c = plan.fwd
    lists = plan.kv_lists
    maxs = max_scores if max_scores is not None else lse  # unread unless OUTPUT_MAX
    even_m, even_n = L % c.BLOCK_M == 0, _even(S, c.BLOCK_N, plan.sparse, 1)
    tma = c.use_tma and _tma_ok((q, k, v), even_m and even_n)
    descs = [_descriptor(q, c.BLOCK_M), _descriptor(k, c.BLOCK_N), _descriptor(v, c.BLOCK_N)] \
        if tma else [q, k, v]
    args = [q, k, v, out, lse, maxs, *descs, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            *lists.args(lse), Hq, L, S, Hq // Hkv, triton_cdiv(S, c.BLOCK_N),
            plan.scale, plan.scale * LOG2E, *_capture_args(plan.program, bufs)]
    consts = _common_constexprs(plan, E, EV)
    consts.update(BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, HAS_PARTIAL=lists.num is not None,
                  HAS_FULL=lists.full_num is not None, EVEN_M=even_m,
                  EVEN_N=even_n, DOT_PRECISION=plan.dot,
                  NUM_STAGES=c.num_stages, OUTPUT_MAX=max_scores is not None,
                  USE_TMA=tma, WARP_SPEC=c.warp_specialize,
                  MERGE_LISTS=c.warp_specialize and lists.num is not None and lists.full_num is not None)
    return Launch("fwd", "flex_fwd", (triton_cdiv(L, c.BLOCK_M), Hq, B), args, consts,
                  _options(c.num_warps, c.num_stages))


def _even(length: int, block: int, sparse, axis: int) -> bool:
    """Whether no tile a loop visits can reach past ``length`` (bounds checks compiled out).
    A walked block list visits every sub-tile of a listed mask block, so with a block mask
    the mask block must divide the length too (the last mask block may overhang it by more
    than one kernel tile)."""
    return length % block == 0 and (sparse is None or length % sparse[axis] == 0)


_STAGES_THAT_FIT: dict[tuple, int] = {}
# Launch keys whose warp-specialised build Triton could not lower (its Hopper pass takes one
# simple loop: on 3.6 the forward at 4 warps with TMA, lists merged, but not a mod that gathers a
# captured tensor per key; 3.9's fails on every forward); they run unspecialised.
WS_REFUSED: set[tuple] = set()


def _ws_refused(e: Exception) -> bool:
    """Whether ``e`` is Triton's compiler failing in a pass (how a warp-specialised build that
    its partitioner cannot handle fails, on 3.6 and 3.9)."""
    return isinstance(e, RuntimeError) and "PassManager" in str(e)


class Ready:
    """A launch that has run: the kernel with its grid and the keyword arguments that worked
    (the stages that fit, WARP_SPEC as Triton could build it). ``ready(args)`` launches it
    again with new run-time arguments in the same parameter order: no module lookup, no
    launch key, no retry loop.

    Only for arguments of the same specialisation as the first (a call_cache hit: the same
    ints, captured tensors and list tensors, q/k/v of the same 16-byte alignment, fresh
    outputs). It then skips Triton's own launch path too (binding ~50 arguments, specialising
    each, the cache key): Triton's compiled kernel is fetched once and its launcher called
    directly. The launcher convention this relies on (every parameter's value in order,
    constexprs included) is the same in Triton 3.6's and 3.9's ``JITFunction.run``; where it is
    not available the normal launch runs."""
    __slots__ = ("fn", "kwargs", "jit", "grid", "direct")

    def __init__(self, fn, kwargs: dict, jit=None, grid=None):
        self.fn, self.kwargs, self.jit, self.grid = fn, kwargs, jit, grid
        self.direct = None  # the compiled kernel's launch and the constexprs' places, once built

    def __call__(self, args) -> None:
        if self.jit is not None:
            if self.direct is None:
                self.direct = _direct_launch(self.jit, self.grid, args, self.kwargs) or False
            if self.direct:
                launch, places, consts = self.direct
                if places is None:  # the constexprs are the last parameters (the templates' order)
                    launch(*args, *consts)
                    return
                full = [None] * (len(args) + len(consts))
                for i, a in zip(places, args):
                    full[i] = a
                for i, c in consts:
                    full[i] = c
                launch(*full)
                return
        self.fn(*args, **self.kwargs)


def _direct_launch(jit, grid, args, kwargs):
    """(launch, run-time argument places, [(place, constexpr value)]) for Triton's compiled
    kernel of ``jit`` at these arguments, or None where this Triton has no such path (the
    interpreter; another version's internals). Triton launches a compiled kernel with every
    parameter's value in order, constexprs included (``JITFunction.run``)."""
    try:
        params = jit.params
        places = [i for i, p in enumerate(params) if not p.is_constexpr]
        if len(places) != len(args):
            return None
        consts = []
        for i, p in enumerate(params):
            if p.is_constexpr:
                if p.name not in kwargs and p.default is p._param.empty:
                    return None
                consts.append((i, kwargs.get(p.name, p.default)))
        compiled = jit.run(*args, grid=grid, warmup=True, **kwargs)
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        if places == list(range(len(args))):
            return compiled[grid3], None, tuple(c for _, c in consts)
        return compiled[grid3], places, consts
    except Exception as e:  # noqa: BLE001 (a Triton without these internals: the normal path)
        log.info("flexjit: direct Triton launch unavailable (%s: %s)", type(e).__name__, e)
        return None


def _run(plan: Plan, launch: Launch) -> Ready:
    """Launch; if Triton's real shared-memory use exceeds the estimate (a mod's loads can add
    layout-conversion buffers), retry with fewer pipeline stages and remember what fit; if a
    WARP_SPEC build fails to compile, run (and remember) the unspecialised one. Returns the
    launch as it ran, to be launched again (``Ready``)."""
    mod = load_module(plan.program, launch.which, plan.interpret)
    kernel = getattr(mod, launch.kernel)
    key = (plan.program.key, launch.kernel, tuple(sorted(launch.constexprs.items())),
           tuple(sorted(launch.options.items())))
    first = key not in _STAGES_THAT_FIT
    stages = _STAGES_THAT_FIT.get(key, launch.options["num_stages"])
    t0 = time.perf_counter()
    while True:
        consts = dict(launch.constexprs)
        if "NUM_STAGES" in consts:
            consts["NUM_STAGES"] = stages
        if key in WS_REFUSED:
            consts["WARP_SPEC"] = False
        fn, kwargs = kernel[launch.grid], dict(consts, **dict(launch.options, num_stages=stages))
        try:
            fn(*launch.args, **kwargs)
        except Exception as e:  # triton.runtime.errors.OutOfResources (its module moved across versions)
            if consts.get("WARP_SPEC") and _ws_refused(e):
                WS_REFUSED.add(key)
                log.info("flexjit: Triton cannot warp-specialise %s for %s/%s; running it "
                         "unspecialised", launch.kernel, plan.program.score_name, plan.program.mask_name)
                continue
            if type(e).__name__ != "OutOfResources" or stages <= 1:
                raise
            stages -= 1
            log.info("flexjit: %s needs more shared memory than it has; retrying with %d stages",
                     launch.kernel, stages)
            continue
        _STAGES_THAT_FIT[key] = stages
        if first and not plan.interpret:
            _log_first_launch(plan, launch, time.perf_counter() - t0)
        return Ready(fn, kwargs, None if plan.interpret else kernel, launch.grid)


def _log_first_launch(plan: Plan, launch: Launch, seconds: float) -> None:
    """One line per kernel a process first launches: Triton compiles it there (or loads it from
    its own disk cache, which takes well under a second; Triton does not say which)."""
    what = (f"Triton {launch.kernel} for {plan.program.score_name}/{plan.program.mask_name} "
            f"({', '.join(f'{k}={v}' for k, v in sorted(launch.constexprs.items()) if k.startswith('BLOCK'))})")
    if seconds >= 1.0:
        log.info("flexjit: %s: compiled in %.1f s", what, seconds)
    else:
        log.info("flexjit: %s: ready in %.2f s (from Triton's disk cache)", what, seconds)


def run_forward(plan: Plan, q, k, v, bufs, want_max: bool = False):
    """Launch the forward kernel: out (B, Hq, L, EV) in q's dtype, lse (B, Hq, L) fp32, and the
    row max of the modded scores (B, Hq, L) fp32 if ``want_max``, else None."""
    B, Hq, L, _ = q.shape
    out = _out((B, Hq, L, v.shape[3]), q.dtype, q.device)
    lse = _out((B, Hq, L), torch.float32, q.device)
    max_scores = _out((B, Hq, L), torch.float32, q.device) if want_max else None
    _run(plan, fwd_launch(plan, q, k, v, out, lse, bufs, max_scores))
    STATS["fwd_launch"] += 1
    return out, lse, max_scores


def _out(shape, dtype, device) -> torch.Tensor:
    """An output buffer; NaN-filled under FLEXJIT_POISON=1 so an element no kernel writes shows."""
    if config.settings.poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _q_lists(plan: Plan) -> _Lists:
    """The transposed block lists (per key block: the query blocks), for the dK/dV role."""
    if plan.q_lists is None:
        bm = plan.block_mask

        def build():
            qn, qi, fqn, fqi = bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices
            if qn is None:  # a hand-built BlockMask without them: transpose (GPU work, once)
                qn, qi = _transpose_ordered(bm.kv_num_blocks, bm.kv_indices)
                if bm.full_kv_num_blocks is not None:
                    fqn, fqi = _transpose_ordered(bm.full_kv_num_blocks, bm.full_kv_indices)
            return _Lists(_i32(qn), _i32(qi), _i32(fqn), _i32(fqi))
        plan.q_lists = bm.derived("triton_q_lists", build)
    return plan.q_lists


_PRE_BLOCK = 64

# The captured tensors' gradient accumulators. A table entry read at a clamped relative position
# (relative_bias: every kv - q <= -max_distance) receives one atomic per score, ~L·S/2 of them:
# in fp32 each add rounds the running sum (|sum| up to tens, ulp ~1e-6), and at L = S = 1024
# that summation error (2.5e-4) was the whole error of the gradient; fp64 sums leave only the
# per-score fp32 error of ds (1.6e-5 against a float64 oracle). Same atomic count, native
# red.global.add.f64 on sm_60+.
_GRAD_ACC = torch.float64


def preprocess_launch(plan: Plan, out, dout, lse, dlse, delta, lse2) -> Launch:
    B, Hq, L, EV = out.shape
    args = [out, dout, lse, dlse if dlse is not None else lse, delta, lse2, *out.stride(),
            *dout.stride(), Hq, L]
    consts = dict(EV=EV, EV_PAD=head_pad(EV), BLOCK=_PRE_BLOCK, HAS_DLSE=dlse is not None)
    return Launch("bwd", "flex_bwd_preprocess", (triton_cdiv(L, _PRE_BLOCK), Hq, B), args, consts,
                  _options(4, 1))


def bwd_launch(plan: Plan, c: BwdConfig, q, k, v, dout, lse2, delta, dq, dk, dv, bufs,
               grads: dict) -> Launch:
    B, Hq, L, E = q.shape
    Hkv, S, EV = k.shape[1], k.shape[2], v.shape[3]
    grad_args = []
    for g in grads.values():
        grad_args += [g, *g.stride()]
    kv_lists = plan.kv_lists
    q_lists = _q_lists(plan) if plan.sparse is not None else _Lists(None, None, None, None)
    n_kv, n_q, G = triton_cdiv(S, c.BLOCK_N1), triton_cdiv(L, c.BLOCK_M2), Hq // Hkv
    kv_args, q_args = kv_lists.args(delta), q_lists.args(delta)
    even_m = _even(L, max(c.BLOCK_M1, c.BLOCK_M2), plan.sparse, 0)
    even_n = _even(S, max(c.BLOCK_N1, c.BLOCK_N2), plan.sparse, 1)
    tma = c.use_tma and _tma_ok((q, k, v, dout), even_m and even_n)
    # Descriptors for the streamed tiles only: Q/dO walked by the dK/dV role, K/V by the dQ role.
    descs = [_descriptor(q, c.BLOCK_M1), _descriptor(k, c.BLOCK_N2), _descriptor(v, c.BLOCK_N2),
             _descriptor(dout, c.BLOCK_M1)] if tma else [q, k, v, dout]
    args = [q, k, v, dout, lse2, delta, dq, dk, dv, *descs, *q.stride(), *k.stride(), *v.stride(),
            *dout.stride(), *dq.stride(), *dk.stride(), *dv.stride(),
            *kv_args[:4], *q_args[:4], *kv_args[4:], *q_args[4:],
            Hq, L, S, G, n_kv, n_q, triton_cdiv(L, c.BLOCK_M1), triton_cdiv(S, c.BLOCK_N2),
            plan.scale, *_capture_args(plan.program, bufs), *grad_args]
    consts = _common_constexprs(plan, E, EV)
    consts.update(BLOCK_M1=c.BLOCK_M1, BLOCK_N1=c.BLOCK_N1, BLOCK_M2=c.BLOCK_M2, BLOCK_N2=c.BLOCK_N2,
                  HAS_PARTIAL=kv_lists.num is not None, HAS_FULL=kv_lists.full_num is not None,
                  ACC_GRADS=bool(grads), EVEN_M=even_m, EVEN_N=even_n,
                  DOT_PRECISION=plan.dot, NUM_STAGES=c.num_stages,
                  USE_TMA=tma, WARP_SPEC=c.warp_specialize)
    return Launch("bwd", "flex_bwd", (n_kv + n_q * G, Hkv, B), args, consts,
                  _options(c.num_warps, c.num_stages))


def run_backward(plan: Plan, q, k, v, out, lse, dout, dlse, bufs):
    """Launch preprocess + backward: (dq, dk, dv, grads of captured tensors by slot)."""
    B, Hq, L, E = q.shape
    S, EV = k.shape[2], v.shape[3]
    c = bwd_config(plan.arch, q.dtype, E, EV, L, S, plan.sparse, plan.kernel_options,
                   captured_grads=bool(grad_slots(plan.program)), tf32=plan.tf32,
                   interpret=plan.interpret)
    delta = _out((B, Hq, L), torch.float32, q.device)
    lse2 = _out((B, Hq, L), torch.float32, q.device)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()  # autograd may hand an expanded (stride 0) grad
    _run(plan, preprocess_launch(plan, out, dout, lse, dlse, delta, lse2))
    dq = _out(q.shape, q.dtype, q.device)
    dk = _out(k.shape, k.dtype, k.device)
    dv = _out(v.shape, v.dtype, v.device)
    grads = {s: torch.zeros(bufs[s].shape, dtype=_GRAD_ACC, device=q.device)
             for s in grad_slots(plan.program)}
    _run(plan, bwd_launch(plan, c, q, k, v, dout, lse2, delta, dq, dk, dv, bufs, grads))
    STATS["bwd_launch"] += 1
    return dq, dk, dv, grads


# --------------------------------------------------------------------------- compile-only

_SIG_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
              torch.float64: "fp64", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
              torch.int64: "i64", torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}


def _sig_type(value) -> str:
    if type(value).__name__ == "TensorDescriptor":
        return f"tensordesc<{_SIG_TYPES[value.base.dtype]}{list(value.block_shape)}>"
    if isinstance(value, torch.Tensor):
        return "*" + _SIG_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2 ** 31) <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton signature type for {type(value).__name__}")


def compile_launch(plan: Plan, launch: Launch, arch: int):
    """Build one launch's kernel for ``sm_<arch>`` without a GPU (``triton.compile`` on an
    ``ASTSource``); returns Triton's compiled kernel (``.asm["ptx"]`` holds the PTX).

    The arguments are specialised as a real launch would be (an int 1 becomes a constant,
    16-divisible ints and 16-byte aligned pointers are marked so), through Triton's own binder
    where this Triton has it, so the PTX is what the GPU would run."""
    import_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(load_module(plan.program, launch.which, interpret=False), launch.kernel)
    target = GPUTarget("cuda", arch, 32)
    runtime = [n for n in fn.arg_names if n not in launch.constexprs]
    if len(runtime) != len(launch.args):
        raise RuntimeError(f"{launch.kernel}: {len(launch.args)} arguments for {len(runtime)} parameters")
    with compiler_env():
        try:
            from triton.compiler import make_backend
            from triton.runtime.jit import create_function_from_signature
            backend = make_backend(target)
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            kwargs = dict(launch.constexprs, **launch.options)
            bound, spec, options = binder(*launch.args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
            src = ASTSource(fn, signature, constexprs, attrs)
            options = options.__dict__
        except (ImportError, AttributeError, TypeError):  # another Triton's internals: unspecialised
            nones = {n: None for n, v in zip(runtime, launch.args) if v is None}
            signature = {n: "constexpr" if v is None else _sig_type(v) for n, v in zip(runtime, launch.args)}
            signature.update({n: "constexpr" for n in launch.constexprs})
            src = ASTSource(fn, signature, constexprs=dict(launch.constexprs, **nones))
            options = dict(launch.options)
        return triton.compile(src, target=target, options=options)


def launches_for(call, arch: int) -> list[Launch]:
    """Every launch a training step of ``call`` makes (forward, preprocess, backward), planned
    for ``sm_<arch>``, with meta tensors standing in for the data (compile-only)."""
    plan = make_plan(call, arch=arch, interpret=False)
    q, k, v = (t.to("meta") for t in (call.q, call.k, call.v))
    B, Hq, L, E = q.shape
    S, EV = k.shape[2], v.shape[3]
    bufs = [t.detach().to("meta") for t in call.program.buffers]
    out = torch.empty(B, Hq, L, EV, dtype=q.dtype, device="meta")
    lse = torch.empty(B, Hq, L, dtype=torch.float32, device="meta")
    c = bwd_config(arch, q.dtype, E, EV, L, S, plan.sparse, plan.kernel_options,
                   captured_grads=bool(grad_slots(plan.program)), tf32=plan.tf32)
    grads = {s: torch.empty(bufs[s].shape, dtype=_GRAD_ACC, device="meta")
             for s in grad_slots(plan.program)}
    max_scores = torch.empty_like(lse) if call.max_scores else None
    return [fwd_launch(plan, q, k, v, out, lse, bufs, max_scores),
            preprocess_launch(plan, out, out, lse, None, lse, lse),
            bwd_launch(plan, c, q, k, v, out, lse, lse, q, k, v, bufs, grads)]


def make_plan(call, arch: int | None = None, interpret: bool | None = None) -> Plan:
    """The launch plan of a call; ``arch``/``interpret`` default to the inputs' device (a
    compile-only build passes the target's arch and ``interpret=False``). The default plan is
    kept in ``call.memo`` (everything it reads is fixed by a call_cache entry's guards)."""
    if arch is None and interpret is None:
        plan = call.memo.get("triton_plan")
        if plan is None:
            plan = call.memo["triton_plan"] = _make_plan(call, None, None)
        return plan
    return _make_plan(call, arch, interpret)


def _make_plan(call, arch: int | None, interpret: bool | None) -> Plan:
    q = call.q
    B, Hq, L, E = q.shape
    S, EV = call.k.shape[2], call.v.shape[3]
    bm = call.block_mask
    interp = q.device.type != "cuda" if interpret is None else interpret
    arch = arch_number(q.device) if arch is None else arch
    if bm is not None:
        kv = _kv_lists(bm)
        sparse = tuple(bm.BLOCK_SIZE)
    else:
        kv, sparse = _Lists(None, None, None, None), None
    opts = dict(call.kernel_options)
    fast = bool(opts.get("FAST_MATH", True)) and not interp
    short = bm is not None and bm.mean_kv_tokens() <= SHORT_KV_LOOP
    dtype = q.dtype if call.fp8 is None else compute_dtype(q)  # FP8: what the tiles convert to
    dot = _dot_precision(dtype, interp)
    cfg = fwd_config(arch, dtype, E, EV, L, S, sparse, opts, short_kv_loop=short, tf32=dot == "tf32",
                     interpret=interp)
    return Plan(call.program, call.scale, kv, None, bm, sparse, cfg, opts, arch, interp, fast, dot)
