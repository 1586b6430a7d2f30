"""The Triton backend's block configurations: tile sizes, warps and pipeline stages per launch.

What this module holds
----------------------
* ``FwdConfig`` / ``BwdConfig``: the forward's (BLOCK_M, BLOCK_N) and the backward's two roles'
  tiles (BLOCK_M1, BLOCK_N1 for dK/dV; BLOCK_M2, BLOCK_N2 for dQ), with warps and stages.
* The static tables per (arch class, 16-bit inputs, padded head dim): ``_FWD_TABLE``,
  ``_BWD_TABLE`` (and the fp32 ones), with why each entry was chosen; entries with a kind
  ("short_kv_loop" for block masks with short kv loops, see ``SHORT_KV_LOOP``; "captured_grads").
* ``fwd_config`` / ``bwd_config``: a table entry fitted to the mask's block size, the sequence
  lengths and shared memory (``smem_limit``, ``_fwd_smem``, ``_bwd_smem``: Triton keeps
  ``num_stages`` buffers), then overridden by ``kernel_options``; remembered by their arguments
  (``_remembered``); ``head_pad``.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    use_tma: bool = False  # Q/K/V tiles by TMA tensor descriptors (sm90+; see ``tma_options``)
    warp_specialize: bool = False  # tl.range(warp_specialize=True) on the kv loop (sm90+)


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    BLOCK_M1: int  # query sub-tile walked by the dK/dV role
    BLOCK_N1: int  # key tile owned by the dK/dV role
    BLOCK_M2: int  # query tile owned by the dQ role
    BLOCK_N2: int  # key sub-tile walked by the dQ role
    num_warps: int
    num_stages: int
    use_tma: bool = False  # streamed tiles (Q/dO in the dK/dV role, K/V in the dQ role) by TMA
    warp_specialize: bool = False


# Forward (BLOCK_M, BLOCK_N, num_warps, num_stages) by (arch class, 16-bit inputs, padded head
# dim). Chosen compile-only (triton 3.9) as the largest tiles ptxas fits without spilling for a
# mask + score_mod kernel (softcap + ALiBi + window), within shared memory:
# * sm90 (227 KB smem): 128x128 tiles, 8 warps = two warpgroups of 64 rows each (wgmma M=64),
#   3 stages = 3 K/V buffers in flight (224 KB at D=128); D=256 halves BLOCK_N and stages.
# * sm100: as sm90 but BLOCK_N 64 at D=128 (128x128 spills 128 B there).
# * sm80 (163 KB smem) and smaller parts: BLOCK_N 64 (the mma.sync register budget).
# fp32 inputs run IEEE fp32 dots (no tensor cores) and get small tiles.
_FWD_TABLE = {
    ("sm90", True, 64): (128, 128, 8, 3), ("sm90", True, 128): (128, 128, 8, 3),
    ("sm90", True, 256): (128, 64, 8, 2),
    ("sm100", True, 64): (128, 128, 8, 3), ("sm100", True, 128): (128, 64, 8, 3),
    ("sm100", True, 256): (128, 64, 8, 2),
    ("sm80", True, 64): (128, 64, 4, 3), ("sm80", True, 128): (128, 64, 8, 3),
    ("sm80", True, 256): (64, 64, 4, 2),
    # A fourth key field names a kind of call with its own entry (``_table_entry``'s ``kind``).
    # "short_kv_loop": block masks whose query blocks visit at most SHORT_KV_LOOP keys on
    # average (windows, short documents): 64x64 tiles, 4 warps, fewer registers per CTA, so
    # several CTAs share an SM and one's prologue/epilogue hides under another's loop; on long
    # loops the 128x128 tile wins (docs/performance.md, "Triton tiles").
    ("sm90", True, 64, "short_kv_loop"): (64, 64, 4, 3),
    ("sm90", True, 128, "short_kv_loop"): (64, 64, 4, 3),
}
# fp32 inputs, by (dot precision, padded head dim), any arch, from `benchmarks/fp32.py --sweep`:
# * IEEE fp32 dots (torch's "highest") run on the CUDA cores: small tiles over 8 warps, since
#   larger ones (or 4 warps holding a 64x128 fp32 Q tile) spill to the stack.
# * TF32 (torch's "high"): tensor-core tiles, 128x64 over 8 warps.
# D=64 takes the D=128 entries (smaller tiles of the same shape); D=256 keeps small tiles
# (not swept).
_FWD_FP32 = {("ieee", 64): (32, 64, 8, 2), ("ieee", 128): (32, 64, 8, 2), ("ieee", 256): (32, 32, 4, 2),
             ("tf32", 64): (128, 64, 8, 3), ("tf32", 128): (128, 64, 8, 3), ("tf32", 256): (32, 32, 4, 2)}
SHORT_KV_LOOP = 2048
# Backward (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages), same keys. The dK/dV
# role keeps a key tile's dK, dV in registers and streams query sub-tiles; the dQ role the
# mirror image (FlashAttention-2 §3.2). Both roles share one kernel, so registers are the max
# of the two. sm90 D=128: 64x128 spills 112 bytes (32x128 fits in 234 registers) and is still
# the fastest in the sweep on full, causal, ALiBi, window and document (benchmarks/tune_triton.py;
# docs/performance.md, "Triton tiles").
_BWD_TABLE = {
    ("sm90", True, 64): (64, 128, 128, 64, 8, 3), ("sm90", True, 128): (64, 128, 128, 64, 8, 3),
    ("sm90", True, 256): (32, 32, 32, 32, 4, 2),
    ("sm100", True, 64): (64, 128, 128, 64, 8, 3), ("sm100", True, 128): (32, 128, 128, 32, 8, 3),
    ("sm100", True, 256): (32, 32, 32, 32, 4, 2),
    ("sm80", True, 64): (32, 128, 128, 32, 8, 3), ("sm80", True, 128): (64, 64, 64, 64, 8, 2),
    ("sm80", True, 256): (32, 32, 32, 32, 4, 2),
    # "captured_grads": the kernel also accumulates captured tensors' gradients (their atomics
    # add registers): at sm90 D=128, 64x128 spills 808 B for a learnable bias table (ptxas of
    # triton 3.9's PTX), 32x128 12 B; not swept on the GPU, so they keep the 32x128 tiles they
    # were verified with.
    ("sm90", True, 128, "captured_grads"): (32, 128, 128, 32, 8, 3),
}
# fp32 backward, same sweep: IEEE 32x64/64x32 tiles over 8 warps (the 4-warp entry before spilled
# 9 KB; 79 against 442 ms forward + backward with the old forward), TF32 32x128/128x32 over 8
# warps (7.4 against 10.2 ms).
_BWD_FP32 = {("ieee", 64): (32, 64, 64, 32, 8, 2), ("ieee", 128): (32, 64, 64, 32, 8, 2),
             ("ieee", 256): (16, 32, 32, 16, 4, 2), ("tf32", 64): (32, 128, 128, 32, 8, 2),
             ("tf32", 128): (32, 128, 128, 32, 8, 2), ("tf32", 256): (16, 32, 32, 16, 4, 2)}
_SMEM_BY_ARCH = {80: 163 << 10, 87: 163 << 10, 90: 227 << 10, 100: 227 << 10, 103: 227 << 10}


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def head_pad(d: int) -> int:
    """Head dims are padded to a power of two (>= 16, tl.dot's K minimum) and masked."""
    return max(16, _next_pow2(d))


def _pow2_divisor(x: int) -> int:
    return x & -x


def _fit_block(want: int, sparse: int | None, length: int) -> int:
    """The largest power of two <= want that divides the mask block and is not much longer
    than the sequence; at least 16."""
    b = min(_next_pow2(want), max(16, _next_pow2(length)))
    if sparse is not None:
        b = min(b, _pow2_divisor(sparse))
    return max(16, b)


def _user_block(opts: dict, names: tuple[str, ...], sparse: int | None) -> int | None:
    for n in names:
        if n in opts:
            b = int(opts[n])
            if b < 16 or b & (b - 1):
                raise ValueError(f"kernel_options[{n!r}] = {b}: must be a power of two >= 16")
            if sparse is not None and sparse % b:
                raise ValueError(f"kernel_options[{n!r}] = {b} must divide the block mask's block "
                                 f"size {sparse}; pick a divisor of {sparse}")
            return b
    return None


def _opt(opts: dict, names: tuple[str, ...], default):
    for n in names:
        if n in opts:
            return int(opts[n])
    return default


def _table_entry(table: dict, fp32: dict, arch: int, dtype: torch.dtype, e_pad: int,
                 kind: str | None = None, tf32: bool = False) -> tuple:
    """The table's config for (arch class, head dim); the ``kind``-specific entry if the table
    has one (e.g. "short_kv_loop"), else the plain one. fp32 inputs: the fp32 table's entry for
    their dot precision (``tf32``)."""
    d = min(256, max(64, e_pad))
    if dtype == torch.float32:
        return fp32[("tf32" if tf32 else "ieee", d)]
    cls = "sm90" if arch == 90 else "sm100" if arch in (100, 103) else "sm80"
    return table.get((cls, True, d, kind)) or table[(cls, True, d)]


def smem_limit(arch: int) -> int:
    return _SMEM_BY_ARCH.get(arch, 99 << 10)


def _fwd_smem(bm, bn, stages, e_pad, ev_pad, elem) -> int:
    return elem * (bm * e_pad + stages * bn * (e_pad + ev_pad))  # Triton keeps num_stages buffers


def _bwd_smem(c: "BwdConfig", e_pad, ev_pad, elem) -> int:
    buffers = c.num_stages
    role_kv = c.BLOCK_N1 * (e_pad + ev_pad) + buffers * c.BLOCK_M1 * (e_pad + ev_pad) \
        + c.BLOCK_M1 * c.BLOCK_N1
    role_q = c.BLOCK_M2 * (e_pad + ev_pad) + buffers * c.BLOCK_N2 * (e_pad + ev_pad) \
        + c.BLOCK_M2 * c.BLOCK_N2
    return elem * max(role_kv, role_q)


# TMA tensor descriptors and Triton's automatic warp specialisation, (use_tma, warp_specialize)
# per pass, for sm90+ only: off by default, since TMA loads were not faster where measured
# (benchmarks/tune_triton.py --grid tma; docs/performance.md).
_FWD_TMA_DEFAULT = (False, False)
_BWD_TMA_DEFAULT = (False, False)


def _flag(opts: dict, names: tuple[str, ...], default: bool) -> bool:
    for n in names:
        if n in opts:
            v = opts[n]
            if not isinstance(v, (bool, int)) or isinstance(v, int) and v not in (0, 1):
                raise TypeError(f"kernel_options[{n!r}] must be a bool, got {v!r}")
            return bool(v)
    return default


def has_tensor_descriptors() -> bool:
    """Whether this Triton passes host-side TMA descriptors (``triton.tools.tensor_descriptor``,
    Triton >= 3.4; the H200 has 3.6, CI 3.9)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


WS_DEADLOCK = ("kernel_options WARP_SPECIALIZE is refused on the GPU: flexjit's Triton kernels built "
               "with Triton's warp specialisation (4 warps + USE_TMA, 128x128) never finished on an "
               "H200 with Triton 3.6, and it was not measured faster; leave it off (USE_TMA alone "
               "is served)")


def tma_options(arch: int, opts: dict, prefix: str, default: tuple[bool, bool],
                interpret: bool = False) -> tuple[bool, bool]:
    """(use_tma, warp_specialize) for one pass: ``kernel_options`` USE_TMA / WARP_SPECIALIZE (also
    ``fwd_``/``bwd_``-prefixed) over the table's default. Both need sm90+ (TMA is Hopper's; Triton's
    warp specialiser partitions around async copies): below that they are off, as torch turns
    USE_TMA off where the GPU cannot use it. Whether a call's tensors admit descriptors (layout,
    alignment, lengths) is decided at launch (``triton._tma_ok``)."""
    tma = _flag(opts, (prefix + "USE_TMA", "USE_TMA"), default[0])
    ws = _flag(opts, (prefix + "WARP_SPECIALIZE", "WARP_SPECIALIZE"), default[1])
    if arch < 90:
        return False, False
    if ws and not interpret:  # the interpreter ignores it: its CPU tests check the loop's logic
        raise ValueError(WS_DEADLOCK)
    return tma and has_tensor_descriptors(), ws


def _warps(want: int, bm: int, bn: int, per_warp: int = 512) -> int:
    """The table's warps, fewer where a fitted tile leaves under ``per_warp`` elements a warp
    (fp32 tiles run their dots on the CUDA cores: 256 elements a warp, see the fp32 tables)."""
    return max(1, min(want, (bm * bn) // per_warp))


def _per_warp(dtype) -> int:
    return 256 if dtype == torch.float32 else 512


def fwd_config(arch: int, dtype, E: int, EV: int, L: int, S: int, sparse, opts: dict,
               short_kv_loop: bool = False, tf32: bool = False, interpret: bool = False) -> FwdConfig:
    """The forward's block config: table default, fitted to the mask blocks, lengths and smem;
    ``kernel_options`` (BLOCK_M, BLOCK_N, num_warps, num_stages, or fwd_-prefixed) override.
    ``short_kv_loop``: a block mask whose query blocks visit few keys (SHORT_KV_LOOP).
    ``tf32``: fp32 inputs whose dots run in TF32. ``interpret``: the Triton interpreter, which
    runs tensor descriptors on any arch (USE_TMA is honoured there, for the CPU tests)."""
    return _remembered(_fwd_config, arch, dtype, E, EV, L, S, sparse, opts,
                       (short_kv_loop, tf32, interpret))


_CONFIGS: dict[tuple, object] = {}


def _remembered(build, arch, dtype, E, EV, L, S, sparse, opts: dict, flag: tuple):
    """``build(...)``, remembered by its arguments: a training loop asks the same question every
    step (~20-40 µs of Python each time on the H200's host)."""
    try:
        key = (build, arch, dtype, E, EV, L, S, sparse, tuple(sorted(opts.items())), flag)
        hit = _CONFIGS.get(key)
    except TypeError:  # an unhashable kernel_options value: answer, do not remember
        return build(arch, dtype, E, EV, L, S, sparse, opts, *flag)
    if hit is None:
        if len(_CONFIGS) > 4096:
            _CONFIGS.clear()
        hit = _CONFIGS[key] = build(arch, dtype, E, EV, L, S, sparse, opts, *flag)
    return hit


def _fwd_config(arch: int, dtype, E: int, EV: int, L: int, S: int, sparse, opts: dict,
                short_kv_loop: bool, tf32: bool = False, interpret: bool = False) -> FwdConfig:
    e_pad, ev_pad = head_pad(E), head_pad(EV)
    bm, bn, warps, stages = _table_entry(_FWD_TABLE, _FWD_FP32, arch, dtype, max(e_pad, ev_pad),
                                         "short_kv_loop" if short_kv_loop else None, tf32)
    sq, skv = sparse if sparse is not None else (None, None)
    ubm = _user_block(opts, ("fwd_BLOCK_M", "BLOCK_M"), sq)
    ubn = _user_block(opts, ("fwd_BLOCK_N", "BLOCK_N"), skv)
    bm = ubm or _fit_block(bm, sq, L)
    bn = ubn or _fit_block(bn, skv, S)
    stages = _opt(opts, ("fwd_num_stages", "num_stages"), stages)
    elem = torch.finfo(dtype).bits // 8
    while "num_stages" not in opts and stages > 1 and \
            _fwd_smem(bm, bn, stages, e_pad, ev_pad, elem) > smem_limit(arch):
        stages -= 1
    while ubn is None and bn > 16 and _fwd_smem(bm, bn, stages, e_pad, ev_pad, elem) > smem_limit(arch):
        bn //= 2
    warps = _opt(opts, ("fwd_num_warps", "num_warps"), _warps(warps, bm, bn, _per_warp(dtype)))
    tma, ws = tma_options(90 if interpret else arch, opts, "fwd_", _FWD_TMA_DEFAULT, interpret)
    return FwdConfig(bm, bn, warps, stages, tma, ws)


def bwd_config(arch: int, dtype, E: int, EV: int, L: int, S: int, sparse, opts: dict,
               captured_grads: bool = False, tf32: bool = False, interpret: bool = False) -> BwdConfig:
    """The backward's block config (table, fitted like the forward's; kernel_options BLOCK_M1,
    BLOCK_N1, BLOCK_M2, BLOCK_N2, bwd_num_warps, bwd_num_stages override). ``captured_grads``:
    the kernel also accumulates captured tensors' gradients; ``tf32``, ``interpret`` as for the
    forward."""
    return _remembered(_bwd_config, arch, dtype, E, EV, L, S, sparse, opts,
                       (captured_grads, tf32, interpret))


def _bwd_config(arch: int, dtype, E: int, EV: int, L: int, S: int, sparse, opts: dict,
                captured_grads: bool, tf32: bool = False, interpret: bool = False) -> BwdConfig:
    e_pad, ev_pad = head_pad(E), head_pad(EV)
    m1, n1, m2, n2, warps, stages = _table_entry(_BWD_TABLE, _BWD_FP32, arch, dtype,
                                                 max(e_pad, ev_pad),
                                                 "captured_grads" if captured_grads else None, tf32)
    sq, skv = sparse if sparse is not None else (None, None)
    m1 = _user_block(opts, ("BLOCK_M1",), sq) or _fit_block(m1, sq, L)
    n1 = _user_block(opts, ("BLOCK_N1",), skv) or _fit_block(n1, skv, S)
    m2 = _user_block(opts, ("BLOCK_M2",), sq) or _fit_block(m2, sq, L)
    n2 = _user_block(opts, ("BLOCK_N2",), skv) or _fit_block(n2, skv, S)
    stages = _opt(opts, ("bwd_num_stages",), stages)
    c = BwdConfig(m1, n1, m2, n2, warps, stages)
    elem = torch.finfo(dtype).bits // 8
    while "bwd_num_stages" not in opts and c.num_stages > 1 and \
            _bwd_smem(c, e_pad, ev_pad, elem) > smem_limit(arch):
        c = dataclasses.replace(c, num_stages=c.num_stages - 1)
    warps = _opt(opts, ("bwd_num_warps",), _warps(warps, max(m1, m2), max(n1, n2), _per_warp(dtype)))
    tma, ws = tma_options(90 if interpret else arch, opts, "bwd_", _BWD_TMA_DEFAULT, interpret)
    return dataclasses.replace(c, num_warps=warps, use_tma=tma, warp_specialize=ws)
