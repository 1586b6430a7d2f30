"""The Hopper (sm_90a) kernels: ``fwd`` (the forward), ``bwd`` (the backward's three kernels) and
``bwd_host`` (the backward's compile, load and launch)."""
from flexjit.templates.cute.sm90 import bwd, bwd_host, fwd

__all__ = ["fwd", "bwd", "bwd_host"]
