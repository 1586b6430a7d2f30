"""``create_block_mask``: torch's signature, the planner underneath, in eager code and in graphs."""
from __future__ import annotations

from typing import Callable

import torch

from flexjit.api import compiled
from flexjit.planner.block_mask import _DEFAULT_SPARSE_BLOCK_SIZE, BlockMask, plan_args, plan_block_mask


def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      device=None, BLOCK_SIZE=_DEFAULT_SPARSE_BLOCK_SIZE, _compile: bool = False,
                      separate_full_blocks: bool = True, compute_dq_write_order: bool = False,
                      dq_kv_order: bool = True) -> BlockMask:
    """Plan the block sparsity of ``mask_mod`` for (B, H, Q_LEN, KV_LEN).

    B or H set to None plans one batch/head that broadcasts. ``device`` defaults to CUDA when
    available (the BlockMask's tensors live there), else the CPU. ``_compile`` is accepted for
    torch compatibility and ignored: nothing dense is built. ``separate_full_blocks=False`` lists
    every block as partial (mask_mod everywhere), as torch. ``compute_dq_write_order`` /
    ``dq_kv_order`` (torch's deterministic FLASH backward) are accepted and need nothing here: the
    deterministic backward builds its order from the lists when it first runs. Inside
    ``torch.compile`` the planner runs as a custom op (``flexjit.api.compiled``).
    """
    if not isinstance(dq_kv_order, bool):  # as torch's create_block_mask
        raise ValueError(f"dq_kv_order must be a bool when using create_block_mask, got "
                         f"{type(dq_kv_order).__name__}")
    if torch.compiler.is_compiling():
        Q_LEN, KV_LEN, bq, bkv, device = plan_args(Q_LEN, KV_LEN, device, BLOCK_SIZE)
        return compiled.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, (bq, bkv))
    return plan_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE,
                           separate_full_blocks=separate_full_blocks)
