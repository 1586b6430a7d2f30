"""``Call``: one validated flex_attention call, as every backend receives it."""
from __future__ import annotations

import dataclasses

import torch

from flexjit.ir.program import Program
from flexjit.planner.block_mask import BlockMask


@dataclasses.dataclass
class Call:
    """One validated flex_attention call, as every backend receives it."""
    q: torch.Tensor  # (B, Hq, L, E)
    k: torch.Tensor  # (B, Hkv, S, E)
    v: torch.Tensor  # (B, Hkv, S, Ev)
    program: Program
    block_mask: BlockMask | None
    scale: float
    kernel_options: dict
    grad: bool | None = None  # whether gradients will be needed, where autograd cannot tell
                              # (inside flexjit.api.compiled's custom ops); None: ask autograd
    max_scores: bool = False  # whether the forward also returns the row max of the modded scores
    # What the backends plan for this call (plans, ready launches), shared by every call of one
    # call_cache entry: its keys may depend only on what the entry's signature and guards fix.
    memo: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def shape(self):
        B, Hq, L, E = self.q.shape
        return B, Hq, self.k.shape[1], L, self.k.shape[2], E, self.v.shape[-1]

    @property
    def needs_grad(self) -> bool:
        if self.grad is not None:
            return self.grad
        return torch.is_grad_enabled() and (
            any(t.requires_grad for t in (self.q, self.k, self.v))
            or any(b.requires_grad for b in self.program.buffers))
