"""The backend contract, and what every backend shares.

A backend is a module with the four functions of :class:`Backend`. ``runtime.dispatch`` picks a
forward and, for training, a backward among them; neither needs autograd of its own (one
``torch.autograd.Function`` in ``runtime.dispatch`` serves every pair). Semantics: docs/DESIGN.md.

A pass with configurations chosen by measurement (``runtime.autotune``) adds two things: a
declaration, ``tuning(call)`` for the forward or ``backward_tuning(call)`` for the backward,
returning a :class:`Tuning` (or None: nothing to choose for this call), and a ``config`` keyword
on ``forward`` / ``backward`` that runs the given :class:`Config`; without it the backend runs
its own heuristic, which must be the declared default. Every run writes fresh outputs (the
tuner may launch each candidate several times). The backend only declares and runs; the
runtime decides.
"""
from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Config:
    """One candidate configuration of a kernel: named fields of bools, ints or strings, in the
    order the backend gives them; hashable, and named by ``str`` ("tile_m=192, persistent": a
    true flag by its name, a false one left out), which is how records on disk refer to it. A
    candidate compiled in a worker becomes ``runtime.compile_pool.Job``'s fields of the same
    names."""
    fields: tuple[tuple[str, bool | int | str], ...]

    @classmethod
    def of(cls, **fields) -> "Config":
        return cls(tuple(fields.items()))

    def __getitem__(self, name: str):
        for key, value in self.fields:
            if key == name:
                return value
        raise KeyError(name)

    def as_dict(self) -> dict:
        return dict(self.fields)

    def __str__(self) -> str:
        parts = [k if v is True else f"{k}={v}" for k, v in self.fields if v is not False]
        return ", ".join(parts) or "default"


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What a backend declares for one call of a tunable pass.

    ``family`` names the backend, arch and pass ("sm90-fwd"); ``key`` is the call's shape class,
    readable "name=value" strings: coarse enough that a training run tunes once per layer kind
    and shape, fine enough that another regime tunes again. ``candidates`` are the configs worth
    measuring for it (kernel_options pins applied, far-off ones pruned), ``default`` among
    them: the backend's heuristic, which runs until a measurement decides and wins ties.
    ``pins`` names the kernel_options that narrowed the candidates ("" if none)."""
    family: str
    key: tuple[str, ...]
    candidates: tuple[Config, ...]
    default: Config
    pins: str = ""

    def __post_init__(self):
        if self.default not in self.candidates:
            raise ValueError(f"{self.family}: the default {self.default} is not a candidate")

    @functools.cached_property
    def ident(self) -> tuple:
        """The class's identity: family, key and the candidates' names (pins change them)."""
        return (self.family, self.key, tuple(map(str, self.candidates)))


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
