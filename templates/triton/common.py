"""Triton helpers shared by the forward and backward templates.

The code generator pastes this file's definitions (everything after the imports) into each
rendered kernel module at the ``# {{COMMON}}`` line, so a generated module stays one standalone
file (the interpreter swaps its ``libdevice`` per module). Unrendered, the templates import them.

* ``_tanh``, ``_dot``, ``_sum``, ``_max``: ops that need a helper (fast tanh; the interpreter's
  bf16 dots and reductions).
* ``_n_tiles``, ``_tile_start``: the walk of one block list in kernel tiles (every sub-tile of a
  listed mask block, or every tile without a block mask), for the forward and both backward roles.
* ``_load_tile``, ``_store_tile``, ``_load_rows``: tile and per-row accesses, masked only where a
  tile can pass the sequence length or a padded head dim.
* ``_score_tile``: one tile's modded scores in log2 units, for the forward and the decode
  kernels. It holds holes (``# {{CAPTURE_PARAMS}}``, ``# {{SCORE_MOD}}``, ``# {{MASK_MOD}}``):
  the renderer pastes this file first and fills every hole after, so the pasted lines are filled
  like the template's own. (In a backward module it is pasted unused: the backward's scores
  carry their derivative, ``triton_bwd.py``'s ``_ds_tile``.)
The helpers inline into every kernel, and Triton's schedule follows the order of the source:
a change here (or moving a call) is checked by compiling for sm_90 and comparing registers,
spills and SASS before and after.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)  # (unrendered use; each template defines its own)

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


@triton.jit
def _n_tiles(n_listed, SPARSE: tl.constexpr, BLOCK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr):
    """How many BLOCK-long tiles a loop over one block list visits: every sub-tile of each of the
    ``n_listed`` mask blocks of SPARSE, or, without a block mask, ``n_listed`` tiles."""
    if HAS_BLOCK_MASK:
        return n_listed * (SPARSE // BLOCK)
    else:
        return n_listed


@triton.jit
def _tile_start(it, idx_ptr, stride_idx, SPARSE: tl.constexpr, BLOCK: tl.constexpr,
                HAS_BLOCK_MASK: tl.constexpr):
    """The first index of tile ``it`` of a walk: sub-tile ``it % MULT`` of the listed mask block
    ``idx_ptr[it // MULT]``, or, without a block mask, the it-th tile."""
    if HAS_BLOCK_MASK:
        MULT: tl.constexpr = SPARSE // BLOCK
        blk = tl.load(idx_ptr + (it // MULT) * stride_idx)
        return blk * SPARSE + (it % MULT) * BLOCK
    else:
        return it * BLOCK


@triton.jit
def _load_tile(ptrs, offs_r, offs_c, n_r, n_c, EVEN_R: tl.constexpr, EVEN_C: tl.constexpr):
    """The (rows, cols) tile at ``ptrs`` (rows ``offs_r``, columns ``offs_c``), zero past ``n_r``
    rows or ``n_c`` columns; unmasked when both are EVEN (no tile reaches past the length, the
    dim is not padded). Callers compute ``ptrs``: the forward computes V's next to K's, before the
    softmax, and computing them beside V's load instead cost its learnable_bias kernel 7 registers
    on sm_90."""
    if EVEN_R and EVEN_C:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c), other=0.0)


@triton.jit
def _store_tile(ptrs, x, offs_r, offs_c, n_r, n_c, EVEN_R: tl.constexpr, EVEN_C: tl.constexpr):
    """Store ``x`` at ``ptrs`` in the pointers' dtype; masked like ``_load_tile``."""
    if EVEN_R and EVEN_C:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty))
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty),
                 mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c))


@triton.jit
def _load_rows(ptr, offs, n, EVEN: tl.constexpr):
    """``ptr[offs]`` of a per-row fp32 vector (lse, delta), 0 past ``n`` unless EVEN."""
    if EVEN:
        return tl.load(ptr + offs)
    else:
        return tl.load(ptr + offs, mask=offs < n, other=0.0)


@triton.jit
def _score_tile(qk, off_b, off_h, q_idx, kv_idx, S, sm_scale, qk_scale_log2,
                # {{CAPTURE_PARAMS}}
                APPLY_MASK: tl.constexpr, EVEN_N: tl.constexpr, HAS_SCORE_MOD: tl.constexpr,
                FAST_MATH: tl.constexpr, MERGED: tl.constexpr, full_tile):
    """Scores of one (BLOCK_M, BLOCK_N) tile in log2 units, -inf where not kept. MERGED: the
    tile may come from the full list (``full_tile``, a run-time bool), which keeps everything."""
    if HAS_SCORE_MOD:
        score = qk * sm_scale
        # {{SCORE_MOD}}
        s2 = score * LOG2E
    else:
        s2 = qk * qk_scale_log2
    if APPLY_MASK:
        mask = kv_idx >= 0  # {{MASK_MOD}}
        if MERGED:
            mask = mask | full_tile
        if not EVEN_N:
            mask = mask & (kv_idx < S)
        s2 = tl.where(mask, s2, float("-inf"))
    elif not EVEN_N:
        s2 = tl.where(kv_idx < S, s2, float("-inf"))
    return s2
