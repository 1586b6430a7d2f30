"""flexjit: a JIT compiler for custom attention, with torch FlexAttention's API.

    from flexjit import flex_attention, create_block_mask

Write score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx, kv_idx) in plain
torch-like Python; flexjit traces them into its IR and runs them in fused kernels (CuTeDSL on
Hopper, Triton on other GPUs, a torch reference on the CPU). docs/DESIGN.md maps the package.
"""
from flexjit.api import (AuxOutput, AuxRequest, BlockMask, FlexKernelOptions, PagedAttention,
                         SelfCheckWarning, StaleBlockMaskWarning, TraceError, and_masks,
                         create_block_mask, create_mask, explain, flex_attention, noop_mask,
                         or_masks)
# torch's private names that user code imports from torch.nn.attention.flex_attention
from flexjit.api import _DEFAULT_SPARSE_BLOCK_SIZE as _DEFAULT_SPARSE_BLOCK_SIZE
from flexjit.api import _LARGE_SPARSE_BLOCK_SIZE as _LARGE_SPARSE_BLOCK_SIZE
from flexjit.api import _identity as _identity
from flexjit.api import _mask_mod_signature as _mask_mod_signature
from flexjit.api import _score_mod_signature as _score_mod_signature
from flexjit.integrations.warmup import WarmupCall, WarmupSummary, warmup, warmup_model

__version__ = "0.1.0"

__all__ = ["flex_attention", "create_block_mask", "create_mask", "BlockMask", "and_masks",
           "or_masks", "noop_mask", "AuxRequest", "AuxOutput", "FlexKernelOptions", "explain",
           "PagedAttention", "TraceError", "SelfCheckWarning", "StaleBlockMaskWarning", "warmup",
           "warmup_model", "WarmupCall", "WarmupSummary", "__version__"]
