"""The backend contract, and what every backend shares.

A backend is a module with the four functions of :class:`Backend`. ``runtime.dispatch`` picks a
forward and, for training, a backward among them; neither needs autograd of its own (one
``torch.autograd.Function`` in ``runtime.dispatch`` serves every pair). Semantics: docs/DESIGN.md.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from flexjit.runtime.call import Call


@runtime_checkable
class Backend(Protocol):
    """What ``runtime.dispatch`` asks of a backend module."""

    def supports(self, call: "Call") -> tuple[bool, str]:
        """Whether its forward can run the call, and why (or why not)."""

    def forward(self, call: "Call") -> tuple:
        """(out, lse, max_scores or None), no autograd: max_scores (the row max of the modded
        scores) exactly when ``call.max_scores`` asks for it."""

    def backward_supports(self, call: "Call") -> tuple[bool, str]:
        """Whether its backward can compute the call's gradients, and why (or why not)."""

    def backward(self, call: "Call", q, k, v, out, lse, dout, dlse) -> tuple:
        """(dq, dk, dv, *one gradient per Program.buffers entry, None where none is computed)."""


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, looked up once per device: torch's own query costs
    ~10 µs, and every call asks it several times (dispatch, each backend's supports, the plan)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place edit); None for an inference tensor."""
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


def device_buffers(call) -> list:
    """The call's captured tensors on its device. A tensor captured on another device is copied
    once per version (an in-place edit bumps it) and the copy kept in the call's memo; one
    without a version counter (an inference tensor) is copied every call."""
    bufs = call.program.buffers
    if not bufs:
        return []
    device = call.q.device
    if all(t.device == device for t in bufs):
        return list(bufs)
    copies = call.memo.setdefault("device_buffers", {})
    out = []
    for slot, t in enumerate(bufs):
        if t.device == device:
            out.append(t)
            continue
        ver = version(t)
        hit = copies.get(slot)
        if ver is None or hit is None or hit[0] != ver:
            hit = (ver, t.detach().to(device))
            if ver is not None:
                copies[slot] = hit
        out.append(hit[1])
    return out
