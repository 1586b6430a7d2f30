"""``Call``: one validated flex_attention call, as every backend receives it."""
from __future__ import annotations

import dataclasses

import torch

from flexjit.backends.fp8 import Fp8, dequantize_inputs
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
    fp8: Fp8 | None = None  # FP8 inputs' descales and output dtype (backends/fp8.py); None: none

    @property
    def shape(self):
        B, Hq, L, E = self.q.shape
        return B, Hq, self.k.shape[1], L, self.k.shape[2], E, self.v.shape[-1]

    @property
    def out_dtype(self) -> torch.dtype:
        return self.q.dtype if self.fp8 is None else self.fp8.out_dtype

    @property
    def needs_grad(self) -> bool:
        """Whether the backends must keep what a backward needs. Never for FP8 inputs: no
        gradient is computed through them (``dispatch.run`` makes a backward say so)."""
        if self.grad is not None:
            return self.grad
        if self.fp8 is not None:
            return False
        return torch.is_grad_enabled() and (
            any(t.requires_grad for t in (self.q, self.k, self.v))
            or any(b.requires_grad for b in self.program.buffers))

    def dequantized(self, shapes_only: bool = False) -> Call:
        """This FP8 call on q, k, v dequantised to the output dtype (``backends.fp8``), for a
        backend with no FP8 kernel; its memo is its own, kept in this call's. ``shapes_only``:
        stand-ins with the shapes, strides, dtype and device those tensors will have and no data
        (what ``supports`` reads), so choosing a backend allocates and computes nothing."""
        memo = self.memo.setdefault("fp8_dequantized", {})
        dtype = self.fp8.out_dtype
        if shapes_only:
            q, k, v = (_Shaped(t.shape, dtype, t.device) for t in (self.q, self.k, self.v))
        else:
            q, k, v = dequantize_inputs(self.q, self.k, self.v, self.fp8, dtype)
        return dataclasses.replace(self, q=q, k=k, v=v, fp8=None, grad=False, memo=memo)


class _Shaped(torch.Tensor):
    """A contiguous tensor's metadata without storage: shape, strides, dtype, device. Any
    operation on it is an error (backends' ``supports`` read metadata only)."""

    @staticmethod
    def __new__(cls, shape, dtype, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"flexjit: {func} on a shape-only stand-in of a dequantised FP8 input; "
                           "a backend's supports() may read only shapes, strides, dtype and device")
