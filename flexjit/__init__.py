"""flexjit: a JIT compiler for custom attention, with torch FlexAttention's API.

    from flexjit import flex_attention, create_block_mask

Write score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx, kv_idx) in
plain torch-like Python; flexjit traces them into its IR and runs them in a fused
kernel (CuTeDSL on Hopper, Triton on other GPUs, a torch reference on the CPU).
"""
from .api import AuxOutput, AuxRequest, explain, flex_attention
from .block_mask import BlockMask, and_masks, create_block_mask, create_mask, noop_mask, or_masks
from .paged import PagedAttention
from .selfcheck import SelfCheckWarning
from .trace import TraceError

__version__ = "0.1.0"


def __getattr__(name):
    # flexjit.distributed (context parallelism) is imported on first use, not with flexjit
    if name == "distributed":
        import importlib
        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module 'flexjit' has no attribute {name!r}")


__all__ = ["flex_attention", "create_block_mask", "create_mask", "BlockMask", "and_masks", "or_masks",
           "noop_mask", "AuxRequest", "AuxOutput", "explain", "PagedAttention", "TraceError", "SelfCheckWarning", "__version__"]
