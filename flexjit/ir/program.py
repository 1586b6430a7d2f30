"""What the frontend hands the passes, and what the passes hand a backend.

``TracedMod`` is one traced mod: its IR and its captures. ``Program`` is the lowered pair of mods
(score, mask, the derivatives) with every capture: all a backend renders. ``Program.key`` is the
structural digest of its graphs, the compile-cache key.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib

import torch

from flexjit.ir import nodes as ir
from flexjit.ir.nodes import DType, Node


@dataclasses.dataclass
class TracedMod:
    """The result of tracing one mod: its IR and the run-time values it needs."""
    kind: str
    name: str
    out: Node
    buffers: list[torch.Tensor]
    scalars: list[float | int]

    @property
    def scalar_dtypes(self) -> tuple[DType, ...]:
        return tuple(ir.dtype_of_python(v) for v in self.scalars)


@dataclasses.dataclass(frozen=True)
class GradLoad:
    """A load of a captured tensor that requires grad, and d(score_mod)/d(that load)."""
    load: Node
    grad: Node

    @property
    def slot(self) -> int:
        return self.load.src[0].arg[0]


@dataclasses.dataclass(frozen=True)
class Program:
    """What a backend needs to render a kernel: the graphs and their captures.

    score: the score_mod output, or None for the identity.
    mask:  the mask_mod output, or None for no mask_mod (every listed block is full).
    dscore: d(score)/d(SCORE) (None when there is no score_mod, meaning 1).
    grad_loads: d(score)/d(load) for every load of a buffer that requires grad.
    buffers/scalars: run-time captures; mask captures come after score captures.
    """
    score: Node | None
    mask: Node | None
    dscore: Node | None
    grad_loads: tuple[GradLoad, ...]
    buffers: tuple[torch.Tensor, ...]
    scalars: tuple[float | int, ...]
    score_name: str = "identity"
    mask_name: str = "noop"

    @property
    def scalar_dtypes(self) -> tuple[DType, ...]:
        return tuple(ir.dtype_of_python(v) for v in self.scalars)

    @property
    def buffer_requires_grad(self) -> tuple[bool, ...]:
        return tuple(bool(t.requires_grad) for t in self.buffers)

    @functools.cached_property
    def key(self) -> str:
        """Structural digest of everything that shapes the generated code. ``lower`` builds a
        new Program per call, so the graphs' serialisation (most of the cost) is memoised on the
        interned graphs themselves."""
        roots = tuple(r for r in (self.score, self.mask, self.dscore) if r is not None)
        roots += tuple(g.grad for g in self.grad_loads) + tuple(g.load for g in self.grad_loads)
        text = _SERIALIZED.get(roots)
        if text is None:
            if len(_SERIALIZED) > 4096:
                _SERIALIZED.clear()
            text = _SERIALIZED[roots] = ir.serialize(list(roots))
        layout = (self.score is not None, self.mask is not None, self.dscore is not None,
                  len(self.grad_loads), [d.value for d in self.scalar_dtypes], len(self.buffers))
        return hashlib.sha256((text + "\n" + repr(layout)).encode()).hexdigest()


_SERIALIZED: dict[tuple, str] = {}
