"""Code that test processes' children run (they must prove they compile nothing)."""

# The prefix of a child script that fails on any CuTe compile and keeps flexjit's log messages
# in ``messages``: a child that must load kernels from the disk cache.
CHILD_NO_COMPILE = """
    import json, logging, os
    import cutlass.cute as cute

    def _no_compile(*args, **kwargs):
        raise AssertionError("cute.compile called in the second process")
    cute.compile = _no_compile
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
    logging.getLogger("flexjit").addHandler(Keep())
    logging.getLogger("flexjit").setLevel(logging.INFO)
"""
