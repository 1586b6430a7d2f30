"""The CuTeDSL backends: ``sm90`` (Hopper) and ``sm100`` (Blackwell, self-checked on first use).

``render`` turns a Program into the kernels' holes (arch-neutral), ``objects`` keeps compiled
kernels on disk.
"""


def templates(arch: str):
    """The kernel templates of ``arch`` ("sm90" or "sm100"). Imported on first use: they import
    cutlass, which only a CuTe kernel build needs."""
    if arch == "sm90":
        from flexjit.templates.cute import sm90 as package
    elif arch == "sm100":
        from flexjit.templates.cute import sm100 as package
    else:
        raise ValueError(f"no CuTe templates for {arch!r}")
    return package
