"""The Triton backend: any traced mod on any CUDA GPU (and on the CPU under TRITON_INTERPRET=1).

``render`` fills the templates' holes from a Program, ``sources`` keeps the rendered modules,
``config`` holds the block configurations, ``prefill`` plans and launches the forward and
backward, ``decode`` the split-KV decode kernel. This module is the backend's entry: it sends a
decode-shaped call without gradients to ``decode``, everything else to ``prefill``; its backward
needs only out and lse, so it also trains the CuTeDSL forwards. FP8 inputs: the decode kernel
reads them itself (``fp8_native``); a prefill call gets them dequantised (``runtime.dispatch``).
"""
from __future__ import annotations

import torch

from flexjit.backends.base import capability, device_buffers
from flexjit.backends.fp8 import compute_dtype
from flexjit.backends.triton import decode, prefill
from flexjit.backends.triton.sources import import_triton, interpreting


def supports(call) -> tuple[bool, str]:
    q = call.q
    interp = interpreting()
    if q.device.type == "cuda":
        major, minor = capability(q.device)
        if (major, minor) < (7, 5):
            return False, f"Triton needs sm75 or newer, this GPU is sm{major}{minor}"
        if q.dtype == torch.bfloat16 and major < 8:
            return False, f"bfloat16 needs sm80 or newer, this GPU is sm{major}{minor}"
        where = f"Triton kernels for sm{major}{minor}"
    elif q.device.type == "cpu" and interp:
        where = "Triton interpreter on the CPU (TRITON_INTERPRET=1)"
    else:
        return False, (f"Triton runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1); "
                       f"the inputs are on {q.device}")
    try:
        import_triton()
    except ImportError as e:
        return False, f"triton is not installed ({e})"
    if call.fp8 is not None:
        native, why = fp8_native(call)
        if not native:
            return False, why
    elif q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False, f"dtype {q.dtype} is not supported by the Triton kernels (fp16, bf16, fp32)"
    E, EV = q.shape[-1], call.v.shape[-1]
    if max(E, EV) > 256:
        return False, f"head dims {E}/{EV} exceed 256"
    for slot, t in enumerate(call.program.buffers):
        if t.numel() == 0:
            return False, f"captured tensor #{slot} is empty"
    routed, why = decode.routes(call)
    return True, f"{where}; {why}" if routed else where


def fp8_native(call) -> tuple[bool, str]:
    """Whether the Triton kernel that takes the call reads its FP8 inputs itself: the split-KV
    decode kernel does (e4m3 tiles loaded and converted in the kernel, on sm89+ and in the
    interpreter); the prefill kernels do not."""
    routed, why = decode.routes(call)
    if not routed:
        return False, f"the Triton prefill kernel reads 16/32-bit inputs; not decoding: {why}"
    if call.q.device.type == "cuda" and capability(call.q.device) < (8, 9):
        major, minor = capability(call.q.device)
        return False, f"Triton's e4m3 loads need sm89 or newer, this GPU is sm{major}{minor}"
    return True, (f"the split-KV decode kernel reads the FP8 tiles (converted to "
                  f"{str(compute_dtype(call.q)).replace('torch.', '')} in the kernel; descales "
                  f"folded into the score scale and the output)")


def forward(call):
    """(out, lse, max_scores or None) of the Triton forward for a validated call (no autograd:
    ``dispatch`` pairs it with a backward)."""
    if decode.routes(call)[0]:  # few query rows, long KV, no gradient: split-KV decoding
        return decode.forward(call)
    if call.fp8 is not None:
        raise ValueError("the Triton prefill forward takes no FP8 inputs; flex_attention "
                         "dequantises them for it (runtime.dispatch.forward)")
    bufs = device_buffers(call)
    return prefill.run_forward(prefill.make_plan(call), call.q, call.k, call.v, bufs, call.max_scores)


def backward_supports(call) -> tuple[bool, str]:
    """The Triton backward runs whatever its forward runs."""
    ok, why = supports(call)
    return ok, ("the Triton backward" if ok else why)


def backward(call, q, k, v, out, lse, dout, dlse) -> tuple:
    """(dq, dk, dv, *grads of the captured tensors) for a forward computed by any backend (it
    needs only out and lse); None for a captured tensor that gets no gradient."""
    bufs = [t.detach().to(q.device) for t in call.program.buffers]
    wanted = [t.requires_grad for t in call.program.buffers]
    dq, dk, dv, grads = prefill.run_backward(prefill.make_plan(call), q, k, v, out, lse.float(), dout, dlse, bufs)
    dbufs = [grads[s].to(b.dtype) if s in grads and want else None
             for s, (b, want) in enumerate(zip(bufs, wanted))]
    return (dq, dk, dv, *dbufs)
