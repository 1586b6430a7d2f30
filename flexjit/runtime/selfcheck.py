"""First-use self-checks: a compiled kernel that has never run on this kind of GPU answers no call
before it has computed a small case of the same Program correctly on this GPU.

The sm100 (Blackwell) kernels were compiled and checked on machines without a Blackwell GPU and
have never run on one; this gate is what makes offering them safe. ``backends/cute/sm100.py``
asks ``admit`` from its ``supports``; the first call of each compiled kernel (keyed by its
compiled-kernel key) runs the check, and the answer holds for the process:

* passed: the kernel serves calls; ``flexjit.explain`` says "self-checked on this GPU";
* failed (wrong values, NaN, unwritten outputs, or an exception while compiling or launching):
  the kernel is disabled for the process, ``warnings.warn(..., SelfCheckWarning)`` once with the
  errors (max abs error, where, tolerance); ``backend="auto"`` falls back, an explicit backend
  raises; explain says "self-check failed" and why;
* not yet run: explain (``dry_run``) reports it without running anything.

The small case (``small_call``) is the call's own Program object (same traced mods, captured
buffers, runtime scalars, hence the same compiled kernel), the call's dtype, head dims, GQA ratio,
scale, max_scores request and the memory layout of q, k, v, at lengths min(L, 300) x min(S, 300):
300 = 256 + 44 is one full 256-row sm100 query tile and a ragged one (an odd number of 128-row
mask blocks), two full 128-key tiles and a 44-key tail. With a block mask the small case's lists
are built to visit every kind of block (``_small_block_mask``: partial, full, skipped, a sub-tile
skipping while the other visits, full and partial ragged blocks, empty rows), so mask_mod runs on
partial blocks and not on full ones whatever the call's mask looks like. Inputs are fresh
standard-normal draws from a fixed seed; outputs start as NaN.

Tolerances come from the data (as ``tests/oracle.py``): for each output (out, lse, max_scores;
dq, dk, dv and learnable captured tensors' gradients for a backward),
``err(kernel vs float64) <= 2 * err(the same math at lower precision vs float64) + floor``.
The float64 side is the reference backend's definition (``reference.scores`` in float64, then
softmax). For the forward the lower precision is a kernel's: the scores, mods, max and
exp(s − max) in float32 (flexjit's semantics: floating math in mods is float32), then P rounded
to the call's dtype and its row sum, P·V and the output in the dtype. The tests' baseline (all of
it in the dtype, the scores too) is far looser where scores are large: ALiBi's bias terms reach
~150 at these lengths and its bf16 output bound was ~0.6, enough to let a wrong kernel through;
this one is ~0.03, and the Triton forward's own error on the same cases is about half of it for
every core mod (``tests/runtime/test_sm100_gate.py`` runs it under the interpreter). For a backward the
baseline is the tests' own (everything in the dtype, ``tests/backends/cute/test_cute_sm90_bwd_gpu.py``): the
Triton backward exceeded the float32-scores one on ALiBi's dv and its slope gradient (it rounds
P and dS for its GEMMs and reads a 16-bit O), so the hook keeps the bound the suite's backward
kernels pass; it is loose for ALiBi-like mods and should be tightened from the sm100 backward's
own measured errors.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import threading
import warnings
from typing import Callable

import torch

from flexjit.backends import reference
from flexjit.backends.self_checked import NOT_RUN, Outcome, epoch, forget, layout, outcome, record, results  # noqa: F401
from flexjit.planner.block_mask import BlockMask
from flexjit.runtime.call import Call

log = logging.getLogger("flexjit")

SMALL_LEN = 300  # 256 + 44: see the module docstring
# The noise floor added to each bound (tests/oracle.py's FLOOR for the 16-bit dtypes).
FLOOR = {torch.float16: 1e-3, torch.bfloat16: 4e-3, torch.float32: 2e-5, torch.float64: 1e-9}
_SEED = 20260


class SelfCheckWarning(RuntimeWarning):
    """A kernel failed its first-use self-check on this GPU and is disabled for the process."""


_LOCK = threading.Lock()
_DRY = contextvars.ContextVar("flexjit_selfcheck_dry", default=False)


@contextlib.contextmanager
def dry_run():
    """Inside: ``gate`` reports what is known and runs no check (``flexjit.explain``)."""
    token = _DRY.set(True)
    try:
        yield
    finally:
        _DRY.reset(token)


def dry() -> bool:
    return _DRY.get()


def blocked() -> str:
    """Why a check cannot run now, outside a dry run ("" when it can)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "the current stream is capturing a CUDA graph"
    return ""


def gate(key, what: str, check: Callable[[], Outcome], variant=()) -> Outcome | None:
    """The result for compiled kernel ``key`` on calls of ``variant`` (what the kernel takes as
    runtime values but the check's case copies from the call: the GQA ratio, the memory layout),
    running ``check()`` once if there is none (not in a dry run, nor while a CUDA graph is being
    captured: then None). An exception from the check (compile or launch errors included) is a
    failure. A failure disables the kernel for every variant and warns once, here."""
    hit = outcome(key, variant)
    if hit is not None:
        return hit
    if dry() or blocked():
        record(None, None, None)  # a deferred check: cached choices are made again
        return None
    with _LOCK:
        hit = outcome(key, variant)
        if hit is not None:
            return hit
        try:
            res = check()
        except Exception as e:  # noqa: BLE001 -- any error disables the kernel, with its text
            res = Outcome(False, f"the check raised {type(e).__name__}: {e}")
        record(key, variant, res)
    if res.passed:
        log.info("flexjit: %s passed its first-use self-check on this GPU (%s)", what, res.summary)
    else:
        warnings.warn(f"flexjit: {what} failed its first-use self-check on this GPU and is "
                      f"disabled for this process (backend='auto' falls back to Triton, "
                      f"backend='cute' raises): {res.summary}", SelfCheckWarning, stacklevel=2)
    return res


def admit(backend, call, part: str, reason: str) -> tuple[bool, str]:
    """``backend``'s answer for ``part`` ("forward" or "backward") of the call, given that its
    static checks passed with ``reason``: unchanged for a backend whose kernels have run on their
    hardware; for one that declares ``SELF_CHECKED``, the verdict of the call's compiled
    kernel's first-use self-check, run now if it has not run (unless explaining)."""
    if not getattr(backend, "SELF_CHECKED", False):
        return True, reason
    pending = backend.self_check(call, part)
    check = check_forward if part == "forward" else check_backward
    res = gate(pending.key, pending.what, lambda: check(call, pending.run), pending.variant)
    if res is None:
        if dry():
            return True, f"{reason}; {NOT_RUN}"
        return False, (f"its first-use self-check has not run and cannot run now "
                       f"({blocked()}); run one call outside CUDA graph capture first")
    if res.passed:
        return True, f"{reason}; self-checked on this GPU (passed: {res.summary})"
    return False, f"self-check failed on this GPU, disabled for this process: {res.summary}"


# --------------------------------------------------------------------------- the small case


def small_call(call, grad: bool = False):
    """The self-check's case for ``call``: the same Program object, dtype, head dims, GQA ratio,
    scale, kernel options and max_scores request; B <= 2, Hkv <= 2 (Hq = Hkv times the call's
    ratio), lengths min(L, SMALL_LEN) x min(S, SMALL_LEN) (never longer than the call's, so
    captured tensors indexed by position stay in range), q/k/v laid out as the call's
    (the same dim order in memory)."""
    q, k, v = call.q, call.k, call.v
    B, Hq, L, E = q.shape
    Hkv, S, Ev = k.shape[1], k.shape[2], v.shape[-1]
    Bs, Hkvs = min(B, 2), min(Hkv, 2)
    Hqs, Ls, Ss = Hkvs * (Hq // Hkv), min(L, SMALL_LEN), min(S, SMALL_LEN)
    gen = torch.Generator(device=q.device).manual_seed(_SEED)
    qs = _randn_like((Bs, Hqs, Ls, E), q, gen)
    ks = _randn_like((Bs, Hkvs, Ss, E), k, gen)
    vs = _randn_like((Bs, Hkvs, Ss, Ev), v, gen)
    bm = None if call.block_mask is None else _small_block_mask(call.block_mask, Hqs, Ls, Ss, q.device)
    return Call(qs, ks, vs, call.program, bm, call.scale, dict(call.kernel_options), grad=grad,
                max_scores=call.max_scores)


def _randn_like(shape, like: torch.Tensor, gen) -> torch.Tensor:
    """Standard-normal values of ``shape`` in ``like``'s dtype and device, stored in the order
    of ``like``'s strides (outermost first; a transposed (B, L, H, D) layout stays one)."""
    order = layout(like)
    base = torch.randn([shape[d] for d in order], generator=gen, device=like.device)
    inverse = [order.index(d) for d in range(len(shape))]
    return base.to(like.dtype).permute(inverse)


def _small_block_mask(bm, H: int, L: int, S: int, device):
    """A BlockMask over (L, S) in ``bm``'s block size whose lists visit every kind of block:
    block (i, j) of head h is (partial, skipped, full)[(i + 2j + h) % 3], and odd heads skip
    block row 1 entirely (empty rows: out 0, lse -inf). At 3 x 3 blocks that puts, in each
    256-row tile, kv blocks that one sub-tile skips while the other visits, and full as well as
    partial blocks on the ragged last row and column. Per head when the call has several heads
    (the lists of a broadcast mask would be the same for all), one batch row (broadcast)."""
    bq, bkv = bm.BLOCK_SIZE
    nq, nkv = -(-L // bq), -(-S // bkv)
    hh = torch.arange(H).view(-1, 1, 1)
    ii = torch.arange(nq).view(1, -1, 1)
    jj = torch.arange(nkv).view(1, 1, -1)
    kinds = torch.tensor([1, 0, 2])[(ii + 2 * jj + hh) % 3]
    kinds = torch.where((hh % 2 == 1) & (ii == 1), torch.zeros_like(kinds), kinds)[None]
    part_num, part_idx = _lists(kinds == 1)
    full_num, full_idx = _lists(kinds == 2)
    return BlockMask.from_kv_blocks(part_num.to(device), part_idx.to(device), full_num.to(device),
                                    full_idx.to(device), BLOCK_SIZE=(bq, bkv), mask_mod=bm.mask_mod,
                                    seq_lengths=(L, S))


def _lists(dense: torch.Tensor):
    """(num, indices) int32 of a dense (B, H, nq, nkv) bool block map, listed blocks first in
    ascending order."""
    num = dense.sum(-1).to(torch.int32)
    idx = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, idx


# --------------------------------------------------------------------------- baselines


def _softmax_parts(s: torch.Tensor):
    """Row max (−inf on an empty row), exp(s − max) with a safe max, its row sum."""
    m = s.amax(-1, keepdim=True)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - safe)
    return m, safe, e, e.sum(-1, keepdim=True)


def _heads(v: torch.Tensor, Hq: int) -> torch.Tensor:
    return v.repeat_interleave(Hq // v.shape[1], dim=1)


def _attention(call, q, k, v, compute: torch.dtype, dtype: torch.dtype | None = None,
               buffers=None):
    """(out, lse, max_scores) of the call from the reference's modded scores: scores, their
    max and exp(s − max) in ``compute``; with ``dtype``, P = exp(s − max) is rounded to it and
    its row sum, P·V and the output are computed in it (a kernel's 16-bit half)."""
    s = reference.scores(call, q, k, compute, buffers)
    m, safe, e, den = _softmax_parts(s)
    vv = _heads(v.to(compute), q.shape[1])
    if dtype is not None:
        e, vv = e.to(dtype), vv.to(dtype)
        den = e.sum(-1, keepdim=True)
    empty = den == 0
    one = torch.ones_like(den)
    out = torch.matmul(e, vv) / torch.where(empty, one, den)
    den = den.to(compute)
    empty = den == 0
    one = torch.ones_like(den)
    lse = torch.where(empty, torch.full_like(den, -math.inf),
                      torch.log(torch.where(empty, one, den)) + safe)
    return out, lse.squeeze(-1), m.squeeze(-1)


# --------------------------------------------------------------------------- comparing


def _where(shape, flat: int, names=("b", "h", "q", "d")) -> str:
    names = names[:len(shape)]
    idx = []
    for n in reversed(shape):
        idx.append(flat % n)
        flat //= n
    return ", ".join(f"{a}={i}" for a, i in zip(names, reversed(idx)))


def _abs_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a − b| in float64, matching infinities counted equal, NaN (on either side) infinite."""
    a, b = a.double(), b.double()
    same_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    d = torch.where(same_inf, torch.zeros_like(a), (a - b).abs())
    return torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)


def compare(name: str, got: torch.Tensor, want: torch.Tensor, low: torch.Tensor,
            floor: float, dims=("b", "h", "q", "d")) -> tuple[bool, str]:
    """(ok, text): max |got − want| against 2·max |low − want| + floor; NaN or a mismatched
    infinity in ``got`` is an infinite error. ``dims`` name the indices of where it is worst."""
    if got is None or tuple(got.shape) != tuple(want.shape):
        shape = None if got is None else tuple(got.shape)
        return False, f"{name}: shape {shape}, expected {tuple(want.shape)}"
    d = _abs_err(got, want)
    tol = 2 * float(_abs_err(low, want).max()) + floor if want.numel() else floor
    if not d.numel():
        return True, f"{name} (empty)"
    err = float(d.max())
    if err <= tol:
        return True, f"{name} {err:.2g} <= {tol:.2g}"
    flat = int(torch.argmax(torch.where(torch.isinf(d), torch.full_like(d, 1e300), d)))
    g, w = got.reshape(-1)[flat].item(), want.reshape(-1)[flat].item()
    return False, (f"{name}: max abs error {err:.3g} at ({_where(tuple(d.shape), flat, dims)}) "
                   f"[got {g:.6g}, expected {w:.6g}] > tolerance {tol:.3g}")


def _verdict(lines: list[tuple[bool, str]]) -> Outcome:
    bad = [t for ok, t in lines if not ok]
    if bad:
        return Outcome(False, "; ".join(bad))
    return Outcome(True, ", ".join(t for _, t in lines))


# --------------------------------------------------------------------------- the checks


def check_forward(call, run: Callable) -> Outcome:
    """Run ``run(small) -> (out, lse, max_scores or None)`` (the kernel on ``small_call(call)``)
    and compare each output with the reference (module docstring)."""
    small = small_call(call)
    q, k, v = small.q, small.k, small.v
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        got = run(small)
        want = _attention(small, q.double(), k.double(), v.double(), torch.float64)
        low = _attention(small, q, k, v, torch.float32, dtype=q.dtype)
    floor = FLOOR[q.dtype]
    names = ("out", "lse", "max_scores") if small.max_scores else ("out", "lse")
    return _verdict([compare(n, got[i], want[i], low[i], floor) for i, n in enumerate(names)])


def check_backward(call, run_backward: Callable) -> Outcome:
    """Run ``run_backward(small, q, k, v, out, lse, dout, dlse) -> (dq, dk, dv, *captured
    grads)`` (a backward kernel's entry, as ``dispatch.backward`` calls it) on
    ``small_call(call, grad=True)`` with the reference forward's out and LSE, a random dout and
    dlse, and compare every gradient with float64 autograd through the reference's scores
    (baseline: the same math in the dtype). The hook a backward kernel's gate plugs into."""
    small = small_call(call, grad=True)
    q, k, v = small.q, small.k, small.v
    gen = torch.Generator(device=q.device).manual_seed(_SEED + 1)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        out, lse, _ = reference.forward(dataclasses.replace(small, max_scores=False))
        dout = torch.randn(out.shape, generator=gen, device=q.device).to(q.dtype)
        dlse = torch.randn(lse.shape, generator=gen, device=q.device)
        got = run_backward(small, q, k, v, out, lse, dout, dlse)
    learn = [i for i, b in enumerate(small.program.buffers) if b.requires_grad and b.is_floating_point()]
    want = _grads(small, q, k, v, dout, dlse, torch.float64, learn)
    low = _grads(small, q, k, v, dout, dlse, q.dtype, learn)
    floor = FLOOR[q.dtype]
    names = ["dq", "dk", "dv"] + [f"grad of captured tensor #{i}" for i in learn]
    dims = [("b", "h", "q", "d"), ("b", "h", "kv", "d"), ("b", "h", "kv", "d")] + \
        [tuple(f"i{j}" for j in range(small.program.buffers[i].dim())) for i in learn]
    picked = list(got[:3]) + [got[3 + i] for i in learn]
    return _verdict([compare(n, g, w.to(torch.float64), lw, floor, dm)
                     for n, g, w, lw, dm in zip(names, picked, want, low, dims)])


def _grads(small, q, k, v, dout, dlse, compute: torch.dtype, learn: list[int],
           dtype: torch.dtype | None = None) -> list:
    """dq, dk, dv and the learnable buffers' gradients of (out·dout + lse·dlse) by autograd
    through ``_attention(..., compute, dtype)`` (float64 and no dtype: the definition)."""
    leaves = [t.detach().to(compute).requires_grad_(True) for t in (q, k, v)]
    bufs = list(small.program.buffers)
    for i in learn:
        bufs[i] = bufs[i].detach().to(compute if compute == torch.float64 else bufs[i].dtype)
        bufs[i].requires_grad_(True)
    with torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
        out, lse, _ = _attention(small, *leaves, compute, dtype=dtype, buffers=tuple(bufs))
        finite = torch.isfinite(lse)
        loss = (out * dout.to(compute)).sum() + torch.where(finite, lse * dlse.to(compute),
                                                            torch.zeros_like(lse)).sum()
        grads = torch.autograd.grad(loss, leaves + [bufs[i] for i in learn], allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves + [bufs[i] for i in learn])]
