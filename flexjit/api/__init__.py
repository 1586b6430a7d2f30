"""The user-facing API: torch FlexAttention's names and signatures.

``attention`` (flex_attention, explain, input validation), ``masks`` (create_block_mask),
``compiled`` (the same calls inside torch.compile, as custom ops) and ``paged``
(PagedAttention).
"""
from flexjit.api.attention import AuxOutput, AuxRequest, explain, flex_attention
from flexjit.api.masks import create_block_mask
from flexjit.api.paged import PagedAttention
from flexjit.frontend.trace import TraceError
from flexjit.planner.block_mask import (BlockMask, StaleBlockMaskWarning, and_masks, create_mask,
                                        noop_mask, or_masks)
from flexjit.runtime.selfcheck import SelfCheckWarning

__all__ = ["flex_attention", "create_block_mask", "create_mask", "BlockMask", "and_masks",
           "or_masks", "noop_mask", "AuxRequest", "AuxOutput", "explain", "PagedAttention",
           "TraceError", "SelfCheckWarning", "StaleBlockMaskWarning"]
