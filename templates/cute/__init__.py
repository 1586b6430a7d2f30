"""The CuTeDSL kernel templates: parts every arch shares here, each arch's kernels in its folder."""
import warnings

# The templates unroll their per-register loops in Python on purpose (each register's row and
# column offsets are static ints); cutlass warns about any static loop of 64 or more iterations,
# which would print on a user's first call. Only warnings attributed to these modules are hidden.
warnings.filterwarnings("ignore", message=r"This static loop has \d+ iterations",
                        module=r"flexjit\.templates\.")
