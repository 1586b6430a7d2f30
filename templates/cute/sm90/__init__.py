"""The Hopper (sm_90a) kernels: ``fwd`` (the forward), ``fwd_mods`` (its mods and masking),
``fwd_tiling`` (its tile table), ``fp8``
(the FP8 forward's operand layouts), ``bwd`` (the backward's main kernel), ``bwd_tiling`` (its
tile table and schedule variants), ``bwd_prepost`` (its pre- and postprocess) and ``bwd_host``
(the backward's compile, load and launch)."""
from flexjit.templates.cute.sm90 import bwd, bwd_host, bwd_prepost, bwd_tiling, fp8, fwd, fwd_mods, fwd_tiling

__all__ = ["fwd", "fwd_mods", "fwd_tiling", "fp8", "bwd", "bwd_tiling", "bwd_prepost", "bwd_host"]
