"""The Hopper (sm_90a) kernels: ``fwd`` (the forward), ``bwd`` (the backward's main kernel),
``bwd_tiling`` (its tile table and schedule variants), ``bwd_prepost`` (its pre- and
postprocess) and ``bwd_host`` (the backward's compile, load and launch)."""
from flexjit.templates.cute.sm90 import bwd, bwd_host, bwd_prepost, bwd_tiling, fwd

__all__ = ["fwd", "bwd", "bwd_tiling", "bwd_prepost", "bwd_host"]
