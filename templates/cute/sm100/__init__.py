"""The Blackwell (sm_100a) kernels: ``fwd`` and ``bwd``, on the parts in ``common``."""
from flexjit.templates.cute.sm100 import bwd, common, fwd

__all__ = ["fwd", "bwd", "common"]
