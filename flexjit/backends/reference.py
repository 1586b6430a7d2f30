"""The reference backend: attention in plain torch, built from the same IR.

It defines what every kernel must compute:

    s      = (q @ kᵀ) · scale                       (float32, or float64 for float64 inputs)
    s      = score_mod(s, b, h, q_idx, kv_idx)       (the IR, through the interpreter)
    keep   = block listed as full, or listed as partial and mask_mod(b, h, q_idx, kv_idx)
    p      = softmax over kv of s where keep, else -inf
    out    = p @ v;  lse = logsumexp over kv (natural log)
    A row with nothing kept gives out = 0 and lse = -inf (and zero, not NaN, gradients).

It runs on any device, chunked over query rows so memory stays bounded (S = 16k
on the CPU), and its backward recomputes each chunk under autograd, so gradients
reach q, k, v and every captured tensor that requires grad.

FP8 inputs (``call.fp8``) are defined here too: dequantised (stored.float() × descale,
``backends.fp8``), attended in float32, the output rounded once to the output dtype.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from flexjit.backends.fp8 import dequantize_inputs
from flexjit.ir.interp import Env, evaluate
from flexjit.ir.program import Program

# Bytes of live float intermediates allowed per chunk (about six (B, H, rows, S) tensors).
_CHUNK_BYTES = 512 << 20


@dataclasses.dataclass
class Plan:
    """Everything about one call that is not a tensor input."""
    program: Program
    scale: float
    kinds: torch.Tensor | None  # (Bm, Hm, nQ, nKV) int8 block kinds, or None for no block mask
    block_size: tuple[int, int]


def _chunk_rows(B: int, H: int, S: int, bq: int, elem: int) -> int:
    rows = _CHUNK_BYTES // max(1, B * H * S * elem * 6)
    return max(bq, (rows // bq) * bq)


def _forward_chunk(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r0: int,
                   buffers: tuple, compute: torch.dtype):
    """out (B, Hq, rows, Ev), lse and the row max of the kept modded scores (B, Hq, rows; -inf
    where nothing is kept) for query rows [r0, r0 + rows)."""
    B, Hq, L, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    s = _scores(plan, q, k, r0, buffers, compute)
    row_max = s.amax(-1, keepdim=True).detach()  # softmax is shift-invariant: no gradient through m
    m = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    empty = denom == 0
    p = e / torch.where(empty, torch.ones_like(denom), denom)
    out = torch.matmul(p.view(B, Hkv, g, L, S), v.to(compute).unsqueeze(2)).view(B, Hq, L, -1)
    lse = torch.where(empty, torch.full_like(denom, float("-inf")),
                      torch.log(torch.where(empty, torch.ones_like(denom), denom)) + m).squeeze(-1)
    return out, lse, row_max.squeeze(-1)


def _scores(plan: Plan, q: torch.Tensor, k: torch.Tensor, r0: int, buffers: tuple,
            compute: torch.dtype) -> torch.Tensor:
    """The modded scores (B, Hq, rows, S) in ``compute`` of query rows [r0, r0 + rows), -inf
    where an element is not kept."""
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qc = q.to(compute).view(B, Hkv, Hq // Hkv, L, E)
    s = torch.matmul(qc, k.to(compute).unsqueeze(2).transpose(-1, -2)).view(B, Hq, L, S) * plan.scale
    dev = q.device
    env = Env(b=torch.arange(B, device=dev).view(-1, 1, 1, 1), h=torch.arange(Hq, device=dev).view(1, -1, 1, 1),
              q_idx=(torch.arange(L, device=dev) + r0).view(1, 1, -1, 1),
              kv_idx=torch.arange(S, device=dev).view(1, 1, 1, -1), score=s, buffers=buffers,
              scalars=plan.program.scalars, float_dtype=compute, device=dev)
    if plan.program.score is not None:
        s = evaluate(plan.program.score, env).expand(B, Hq, L, S)
    keep = _keep(plan, env, r0, L, S)
    if keep is not None:
        s = torch.where(keep, s, torch.tensor(float("-inf"), dtype=compute, device=dev))
    return s


def scores(call, q: torch.Tensor, k: torch.Tensor, compute: torch.dtype,
           buffers=None) -> torch.Tensor:
    """The call's modded scores (B, Hq, L, S) for these q, k (the call's shapes) in ``compute``,
    -inf where an element is not kept: the whole call in one piece (no chunking), differentiable
    in q, k and ``buffers`` (default: the Program's captured tensors). For small cases
    (``flexjit.selfcheck`` builds its baselines from it)."""
    buffers = call.program.buffers if buffers is None else buffers
    buffers = tuple(b.to(q.device) if b.device != q.device else b for b in buffers)
    return _scores(_plan(call), q, k, 0, buffers, compute)


def _keep(plan: Plan, env: Env, r0: int, L: int, S: int) -> torch.Tensor | None:
    """Element mask (broadcastable to (B, H, L, S)) from block kinds and mask_mod."""
    if plan.kinds is None:
        if plan.program.mask is None:
            return None
        return evaluate(plan.program.mask, env)
    bq, bkv = plan.block_size
    rows = plan.kinds[:, :, r0 // bq: (r0 + L - 1) // bq + 1]
    kinds = rows.repeat_interleave(bq, 2).repeat_interleave(bkv, 3)
    off = r0 - (r0 // bq) * bq
    kinds = kinds[:, :, off:off + L, :S]
    keep = kinds == 2
    if plan.program.mask is not None:
        keep = keep | ((kinds == 1) & evaluate(plan.program.mask, env))
    else:
        keep = keep | (kinds == 1)
    return keep


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _rows(plan: Plan, q, k):
    B, Hq, L, _ = q.shape
    bq = plan.block_size[0]
    step = _chunk_rows(B, Hq, k.shape[2], bq, 8 if q.dtype == torch.float64 else 4)
    return [(r, min(L, r + step)) for r in range(0, L, step)]


def _plan(call) -> Plan:
    bm = call.block_mask
    kinds = bm.derived("reference_kinds", bm.block_kinds) if bm is not None else None
    block_size = bm.BLOCK_SIZE if bm is not None else (128, 128)
    return Plan(call.program, call.scale, kinds, block_size)


def _attention(plan: Plan, q, k, v, buffers, out_dtype=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    compute = _compute_dtype(q)
    B, Hq, L, _ = q.shape
    out_dtype = q.dtype if out_dtype is None else out_dtype
    out = torch.empty(B, Hq, L, v.shape[-1], dtype=out_dtype, device=q.device)
    lse = torch.empty(B, Hq, L, dtype=compute, device=q.device)
    row_max = torch.empty(B, Hq, L, dtype=compute, device=q.device)
    for r0, r1 in _rows(plan, q, k):
        o, l_, m = _forward_chunk(plan, q[:, :, r0:r1], k, v, r0, buffers, compute)
        out[:, :, r0:r1] = o.to(out_dtype)
        lse[:, :, r0:r1] = l_
        row_max[:, :, r0:r1] = m
    return out, lse, row_max


def _gradients(plan: Plan, q, k, v, buffers, dout, dlse) -> tuple:
    """(dq, dk, dv, *captured grads): each chunk of query rows recomputed under autograd."""
    compute = _compute_dtype(q)
    kd = k.detach().requires_grad_(True)
    vd = v.detach().requires_grad_(True)
    bufs = [b.detach().requires_grad_(b.requires_grad and b.is_floating_point()) for b in buffers]
    learn = [b for b in bufs if b.requires_grad]
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape, dtype=compute, device=k.device)
    dv = torch.zeros(v.shape, dtype=compute, device=v.device)
    dbufs = [torch.zeros(b.shape, dtype=compute, device=b.device) for b in learn]
    for r0, r1 in _rows(plan, q, k):
        qc = q[:, :, r0:r1].detach().requires_grad_(True)
        with _autograd_on():
            o, l_, _ = _forward_chunk(plan, qc, kd, vd, r0, tuple(bufs), compute)
            outs, grads_in = [o], [dout[:, :, r0:r1].to(compute)]
            if dlse is not None and l_.requires_grad:  # a score_mod that ignores the score
                outs.append(l_)                            # leaves the LSE constant
                grads_in.append(torch.where(torch.isfinite(l_), dlse[:, :, r0:r1].to(compute),
                                            torch.zeros_like(l_)))
            grads = torch.autograd.grad(outs, [qc, kd, vd, *learn], grads_in, allow_unused=True)
        dq[:, :, r0:r1] = _or_zero(grads[0], qc).to(q.dtype)
        dk += _or_zero(grads[1], kd)
        dv += _or_zero(grads[2], vd)
        for acc, g in zip(dbufs, grads[3:]):
            if g is not None:
                acc += g
    it = iter(dbufs)
    dbuf_out = [next(it).to(b.dtype) if b.requires_grad else None for b in bufs]
    return (dq, dk.to(k.dtype), dv.to(v.dtype), *dbuf_out)


@contextlib.contextmanager
def _autograd_on():
    """Autograd recording, also inside a custom op's kernel (``flexjit.compile``'s backward op),
    where the dispatcher has autograd excluded: the recompute needs it."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    include = torch._C._dispatch_tls_local_include_set()
    with torch.enable_grad(), torch._C._ForceDispatchKeyGuard(
            include, exclude.remove(torch._C.DispatchKey.AutogradFunctionality)):
        yield


def _or_zero(g, like):
    return g if g is not None else torch.zeros_like(like)


def supports(call) -> tuple[bool, str]:
    return True, "pure torch on any device: the definition of correct, not fast"


def fp8_native(call) -> tuple[bool, str]:
    return True, "dequantises FP8 inputs to float32 itself: the definition of the FP8 result"


def backward_supports(call) -> tuple[bool, str]:
    return True, "recomputes the reference forward under autograd, chunk by chunk"


def forward(call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, lse, max_scores): lse and max_scores (if ``call.max_scores``, else None) in float32
    (float64 for float64 inputs)."""
    q, k, v = call.q, call.k, call.v
    if call.fp8 is not None:
        q, k, v = dequantize_inputs(q, k, v, call.fp8, torch.float32)
    out, lse, row_max = _attention(_plan(call), q, k, v, call.program.buffers, call.out_dtype)
    if q.dtype != torch.float64:
        lse, row_max = lse.float(), row_max.float()
    return out, lse, row_max if call.max_scores else None


def backward(call, q, k, v, out, lse, dout, dlse) -> tuple:
    """(dq, dk, dv, *captured grads); None for a captured tensor that needs none."""
    buffers = [b.to(q.device) if b.device != q.device else b for b in call.program.buffers]
    return _gradients(_plan(call), q, k, v, buffers, dout, dlse)
