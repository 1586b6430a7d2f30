"""Index bounds of captured tensors: every index a mod reads a captured tensor at, over one call.

torch, and flexjit's reference, raise ``IndexError`` where a mod indexes a captured tensor out of
range anywhere in the call's grid (b, h, q_idx, kv_idx over B, Hq, L, S), masked or not. A kernel
cannot raise, so ``check`` runs before any backend does, in up to three steps, each only for the
indices the one before left unproven:

1. interval analysis over the call (``intervals.domain``: the indices over their lengths, the
   scalars at their values, a loaded value as anything its dtype holds). No tensor is read, so
   the verdict depends only on the graphs, the lengths, the scalars and the tensors' shapes, and
   is remembered: a proven call costs one dictionary lookup.
2. The same, with each captured tensor that an index reads bounded by its actual min and max
   (one reduction per tensor, read back: a host sync on a GPU, every call).
3. The index evaluated exactly (``interp``) over the positions it depends on, its min and max.

A dim of size n takes indices in [-n, n): a negative one counts from the end, as in torch. The
kernels' clamp into [0, n) is a memory-safety guard behind this check: it keeps the rows and
columns past L and S, computed and then discarded, inside the tensor.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from flexjit.ir import intervals
from flexjit.ir.interp import Env, evaluate
from flexjit.ir.nodes import INDEX_LEAVES, Node, Op, toposort
from flexjit.ir.program import Program

# Index values evaluated at once in step 3: bounds its memory (int64) to a few tens of MiB.
_CHUNK = 1 << 22
_LEAF_AXIS = {Op.B: 0, Op.H: 1, Op.Q_IDX: 2, Op.KV_IDX: 3}
_LEAF_NAMES = ("b", "h", "q_idx", "kv_idx")


@dataclasses.dataclass(frozen=True)
class _Index:
    """Index ``dim`` of one load of captured tensor ``slot``, in the mod ``mod``."""
    mod: str
    slot: int
    dim: int
    node: Node


def check(program: Program, lengths: tuple[int, int, int, int]) -> None:
    """Raise ``IndexError`` (naming the mod, the tensor, the dim and the range of the index) if a
    mod of ``program`` indexes a captured tensor out of range anywhere in a call of ``lengths``
    (B, Hq, L, S); return quietly otherwise."""
    if not program.buffers:
        return
    shapes = tuple(tuple(t.shape) for t in program.buffers)
    key = (program.score, program.mask, tuple(lengths), program.scalars, shapes)
    pending = _UNPROVEN.get(key)
    if pending is None:
        if len(_UNPROVEN) > 4096:
            _UNPROVEN.clear()
        pending = _UNPROVEN[key] = _unproven(program, _indices(program), lengths, shapes, {})
    if not pending:
        return
    pending = _unproven(program, pending, lengths, shapes, _contents(program, pending))
    for ix in pending:  # operands before users: an inner load is checked before it is evaluated
        lo, hi = _exact_range(program, ix, lengths)
        _raise_if_outside(program, ix, lo, hi, shapes)


_UNPROVEN: dict[tuple, tuple[_Index, ...]] = {}


def _indices(program: Program) -> tuple[_Index, ...]:
    """Every index of every load, the loads in operand-before-user order."""
    out = []
    for root, name in ((program.score, f"score_mod `{program.score_name}`"),
                       (program.mask, f"mask_mod `{program.mask_name}`")):
        if root is None:
            continue
        for n in toposort([root]):
            if n.op is Op.LOAD:
                out += [_Index(name, n.src[0].arg[0], d, i) for d, i in enumerate(n.src[1:])]
    return tuple(out)


def _unproven(program: Program, pending, lengths, shapes, contents: dict) -> tuple[_Index, ...]:
    """The indices of ``pending`` that interval analysis does not place inside their dims."""
    env = intervals.domain(tuple(lengths), program.scalars, contents)
    values: dict[int, tuple] = {}
    for n in toposort([ix.node for ix in pending]):
        if n.op is not Op.BUFFER:
            values[id(n)] = intervals.bound(n, [values.get(id(s)) for s in n.src], env)
    left = []
    for ix in pending:
        _, lo, hi = values[id(ix.node)]
        lo, hi, size = lo.item(), hi.item(), shapes[ix.slot][ix.dim]
        if not (lo >= -size and hi <= size - 1):  # NaN bounds fail too
            left.append(ix)
    return tuple(left)


def _contents(program: Program, pending) -> dict[int, tuple[float, float]]:
    """(min, max) of every captured tensor that an unproven index reads, in one read-back."""
    slots = sorted({n.src[0].arg[0] for ix in pending for n in toposort([ix.node]) if n.op is Op.LOAD})
    slots = [s for s in slots if program.buffers[s].numel() > 0]
    if not slots:
        return {}
    ext = []
    for s in slots:
        t = program.buffers[s].detach()
        t = t.to(torch.uint8) if t.dtype == torch.bool else t
        ext += [t.min().to(torch.float64).cpu(), t.max().to(torch.float64).cpu()]
    flat = torch.stack(ext).tolist()
    return {s: (flat[2 * j], flat[2 * j + 1]) for j, s in enumerate(slots)}


def _exact_range(program: Program, ix: _Index, lengths) -> tuple[int, int]:
    """(min, max) of the index over every position of the call that it depends on."""
    sub = toposort([ix.node])
    if any(n.op is Op.SCORE for n in sub):
        raise IndexError(f"{ix.mod} indexes captured tensor #{ix.slot} (dim {ix.dim}) with a value "
                         "computed from the score, whose range flexjit cannot bound before the "
                         "kernel runs; clamp the index into the tensor (torch.clamp)")
    axes = sorted({_LEAF_AXIS[n.op] for n in sub if n.op in INDEX_LEAVES})
    device = program.buffers[ix.slot].device
    # Chunked along the longest axis the index depends on; the others are whole.
    longest = max(axes, key=lambda a: lengths[a], default=None)
    n_long = 1 if longest is None else lengths[longest]
    step = max(1, _CHUNK // max(1, math.prod(lengths[a] for a in axes if a != longest)))
    lo = hi = None
    for start in range(0, n_long, step):
        leaves = {}
        for a in axes:
            a0, a1 = (start, min(n_long, start + step)) if a == longest else (0, lengths[a])
            shape = [1, 1, 1, 1]
            shape[a] = a1 - a0
            leaves[_LEAF_NAMES[a]] = torch.arange(a0, a1, device=device).view(shape)
        v = evaluate(ix.node, Env(buffers=program.buffers, scalars=program.scalars, device=device,
                                  **leaves))
        lo = v.min() if lo is None else torch.minimum(lo, v.min())
        hi = v.max() if hi is None else torch.maximum(hi, v.max())
    lo, hi = torch.stack([lo, hi]).tolist()
    return int(lo), int(hi)


def _raise_if_outside(program: Program, ix: _Index, lo: int, hi: int, shapes) -> None:
    size = shapes[ix.slot][ix.dim]
    if lo >= -size and hi <= size - 1:
        return
    bad = hi if hi > size - 1 else lo
    raise IndexError(f"{ix.mod} indexes captured tensor #{ix.slot} of shape {shapes[ix.slot]} with "
                     f"values in [{lo}, {hi}] along dim {ix.dim}: index {bad} is out of bounds for "
                     f"dimension {ix.dim} with size {size} (valid: {-size} to {size - 1})")
