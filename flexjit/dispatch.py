"""Backend selection: the one place that looks at the device and architecture.

Each backend module exposes ``supports(call) -> (bool, reason)`` and
``run(call) -> (out, lse)``. ``select`` returns the first backend of the
preference order that supports the call, with the reason for the choice and
for every backend passed over; ``flexjit.explain`` shows the same answer
without running anything.

Preference for "auto": Hopper (sm90) -> cute; any other CUDA GPU -> triton;
CPU -> reference. An explicit backend that cannot serve the call is an error.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch

from .backends import capability

BACKENDS = ("cute", "triton", "reference")
_MODULES = {"cute": "flexjit.backends.cute_sm90", "triton": "flexjit.backends.triton",
            "reference": "flexjit.backends.reference"}


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend flex_attention runs, why, and why the others were passed over."""
    name: str
    reason: str
    passed_over: tuple[tuple[str, str], ...] = ()

    def __str__(self):
        lines = [f"backend: {self.name} ({self.reason})"]
        lines += [f"  not {n}: {r}" for n, r in self.passed_over]
        return "\n".join(lines)


def _module(name: str):
    try:
        return importlib.import_module(_MODULES[name])
    except ImportError as e:
        return e


def arch_of(device: torch.device) -> str:
    """'cpu', 'sm80', 'sm90', 'sm100', ... for a tensor's device."""
    if device.type != "cuda":
        return device.type
    major, minor = capability(device)
    return f"sm{major}{minor}"


def _supports(name: str, call) -> tuple[bool, str]:
    mod = _module(name)
    if isinstance(mod, ImportError):
        return False, f"backend `{name}` is unavailable ({mod})"
    return mod.supports(call)


def select(requested: str, call) -> Choice:
    if requested not in BACKENDS + ("auto",):
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {requested!r}")
    if requested != "auto":
        ok, reason = _supports(requested, call)
        if not ok:
            raise NotImplementedError(f"backend={requested!r} cannot run this call: {reason}. "
                                      f"Use backend='auto' to pick one that can.")
        return Choice(requested, f"requested; {reason}")
    passed = []
    for name in _preference(call.q.device):
        ok, reason = _supports(name, call)
        if ok:
            return Choice(name, reason, tuple(passed))
        passed.append((name, reason))
    raise NotImplementedError("no backend can run this call:\n" +
                              "\n".join(f"  {n}: {r}" for n, r in passed))


def _preference(device: torch.device) -> tuple[str, ...]:
    if device.type == "cuda":
        return ("cute", "triton", "reference")
    # Off the GPU only the reference runs; the Triton interpreter (TRITON_INTERPRET=1)
    # is for tests and must be asked for by name.
    return ("reference",)


def run(name: str, call):
    return _module(name).run(call)
