"""The user-facing API: torch FlexAttention's names and signatures.

``attention`` (flex_attention, explain, input validation), ``masks`` (create_block_mask),
``compiled`` (the same calls inside torch.compile, as custom ops) and ``paged``
(PagedAttention). torch's private names that user code imports (``_identity``, the block-size
constants, the mod signatures) are here too, so that such code also moves by one import.
"""
from collections.abc import Callable

import torch

from flexjit.api.attention import AuxOutput, AuxRequest, explain, flex_attention
from flexjit.api.masks import create_block_mask
from flexjit.api.paged import PagedAttention
from flexjit.frontend.trace import TraceError
from flexjit.planner.block_mask import (BlockMask, StaleBlockMaskWarning, and_masks, create_mask,
                                        noop_mask, or_masks)
# torch's private names that user code imports, re-exported (``X as X``)
from flexjit.planner.block_mask import _DEFAULT_SPARSE_BLOCK_SIZE as _DEFAULT_SPARSE_BLOCK_SIZE
from flexjit.planner.block_mask import _LARGE_SPARSE_BLOCK_SIZE as _LARGE_SPARSE_BLOCK_SIZE
from flexjit.planner.block_mask import _identity as _identity
from flexjit.runtime.options import FlexKernelOptions
from flexjit.runtime.selfcheck import SelfCheckWarning

# torch's type aliases for mods, under the names torch's module gives them
_score_mod_signature = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                                torch.Tensor]
_mask_mod_signature = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = ["flex_attention", "create_block_mask", "create_mask", "BlockMask", "and_masks",
           "or_masks", "noop_mask", "AuxRequest", "AuxOutput", "FlexKernelOptions", "explain",
           "PagedAttention", "TraceError", "SelfCheckWarning", "StaleBlockMaskWarning"]
