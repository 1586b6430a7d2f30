"""Triton helpers shared by the forward and backward templates.

The code generator pastes this file's definitions (everything after the imports) into each
rendered kernel module at the ``# {{COMMON}}`` line, so a generated module stays one standalone
file (the interpreter swaps its ``libdevice`` per module). Unrendered, the templates import them.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice

@triton.jit
def _tanh(x, FAST: tl.constexpr):
    if FAST:
        # MUFU tanh (sm_75+): max relative error ~2^-11, far below the bf16 rounding of P.
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return libdevice.tanh(x)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """tl.dot with fp32 accumulation. PRECISION "interp-upcast" works around the interpreter,
    which multiplies bf16 operands as raw integers: fp32 products of bf16 values are exact, so
    upcasting first computes what the tensor cores compute."""
    if PRECISION == "interp-upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _sum(x, AXIS: tl.constexpr, KEEP: tl.constexpr):
    """tl.sum, through the library's own combine function: tl.sum is itself a jit function,
    which an interpreted kernel cannot call when Triton was imported compiled (flexjit imports
    it so, to build and interpret in one process); the interpreter sums this in numpy."""
    return tl.reduce(x, AXIS, tl.standard._sum_combine, keep_dims=KEEP)


@triton.jit
def _max(x, AXIS: tl.constexpr):
    """tl.max for fp32 rows, spelled like ``_sum`` (same reasons)."""
    return tl.reduce(x, AXIS, tl.standard._elementwise_max)
