"""flexjit: a JIT compiler for custom attention, with torch FlexAttention's API.

    from flexjit import flex_attention, create_block_mask

Write score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx, kv_idx) in plain
torch-like Python; flexjit traces them into its IR and runs them in fused kernels (CuTeDSL on
Hopper, Triton on other GPUs, a torch reference on the CPU). docs/DESIGN.md maps the package.
"""
from flexjit.api import (AuxOutput, AuxRequest, BlockMask, PagedAttention, SelfCheckWarning,
                         StaleBlockMaskWarning, TraceError, and_masks, create_block_mask,
                         create_mask, explain, flex_attention, noop_mask, or_masks)

__version__ = "0.1.0"

__all__ = ["flex_attention", "create_block_mask", "create_mask", "BlockMask", "and_masks",
           "or_masks", "noop_mask", "AuxRequest", "AuxOutput", "explain", "PagedAttention",
           "TraceError", "SelfCheckWarning", "StaleBlockMaskWarning", "__version__"]
