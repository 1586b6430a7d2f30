"""kernel_options: torch FlexAttention's keys, flexjit's own, and what each means here.

``validate(kernel_options, backend)`` returns the options as a dict and the backend to use, or
raises ``ValueError`` for a key neither torch nor flexjit knows (with the list of valid ones),
and ``RuntimeError`` for ``BACKEND`` beside a true ``FORCE_USE_FLEX_ATTENTION``, as torch does.
A key may carry torch's ``fwd_`` / ``bwd_`` prefix (the forward's or the backward's kernel).

Keys with a meaning for flexjit:

* ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``: the Triton forward's tiles (``fwd_``
  prefix too; BLOCK_N, num_warps and num_stages also tune the split-KV decode kernel);
  ``BLOCK_M1``, ``BLOCK_N1``, ``BLOCK_M2``, ``BLOCK_N2``, ``bwd_num_warps``,
  ``bwd_num_stages``: the Triton backward's. The CuTeDSL kernels choose their own tiles.
* ``FAST_MATH`` (flexjit): approximate tanh/exp in the Triton kernels (default True).
* ``FORCE_USE_FLEX_ATTENTION`` (torch): True keeps a decode-shaped call (Q_LEN <= 128, no
  gradient) off the split-KV decode kernel, on the prefill forward, as torch's does.
* ``USE_TMA`` (torch's key; ``fwd_``/``bwd_`` per pass): the Triton kernels load tiles through
  TMA tensor descriptors on sm90+ where the tensors allow it (else pointer loads, as torch
  turns it off); ``WARP_SPECIALIZE`` (flexjit): Triton's automatic warp specialisation of the
  kv/q loops, refused on a GPU (``ValueError``: its kernels never finished on the H200 with
  Triton 3.6); the interpreter runs its merged loop. USE_TMA defaults to the backend's table
  (``triton_config``).
* ``PERSISTENT`` (flexjit): True or False pins the sm90 forward's schedule (one CTA per SM
  looping over tiles, or one CTA per tile); by default it is persistent where a query tile
  visits few kv tiles. Head dims 192 and 256 always run one CTA per tile.
* ``TILE_M`` (flexjit): 128 or 192 pins the sm90 forward's query tile rows; 192 (three
  consumer warpgroups) is served at head dims 32, 64 and 96: the default at 32 and 64, block
  masks included (their lists merged per tile), a tuner candidate at 96. ``flexjit.explain``
  shows the tile.
* ``PACK_GQA`` (flexjit): True or False pins whether the sm90 forward folds the query heads that
  share a kv head into one tile's rows (one K/V tile then serves them all). Served for plain
  attention (no score_mod, mask_mod or block mask) under GQA; a tuner candidate there, off
  until measured faster.
* ``BWD_CONFIG`` (flexjit): the sm90 backward's schedule variants, "+"-joined: "late" (P converted
  after dS, dV issued after it; with a score_mod only where d score/d score is 1, or with
  captured-tensor gradients), "dksmem" (dK reads dSᵀ from shared memory), "shuffle" (LSE and delta
  held one in 8 and shuffled), "swapdq" (dQᵀ = Kᵀ dSᵀ), "dvafter" (the dV GEMM issued once dS is in
  shared memory; "m128+shuffle+dvafter" is the 128-row tile with P and dS in registers at head dim
  64, the default there and, as "m128+dvafter", at 32 for mods without loads or transcendentals),
  "dpafter" (the dP GEMM issued once P is formed, not under it), "m80" / "m128" (80- or 128-row
  query tiles), "qhead" (one CTA per query head under GQA, dK/dV summed in fp32 workspaces),
  "keys96" (head dim 192: 64 × 96 tiles, FlashAttention-3's schedule); where a variant cannot serve
  (Hq = Hkv or deterministic mode for "qhead"; deterministic mode and captured-tensor gradients for
  "keys96") the table's runs, which ``flexjit.explain`` says; "" is the tile table's. For measuring
  schedules.
* ``AUTOTUNE`` (flexjit; ``fwd_``/``bwd_`` per pass): True (default) lets ``runtime.autotune``
  choose among a backend's candidate configurations (the sm90 forward's tile and schedule) by
  measurement, once per shape class, remembered on disk; False (and deterministic
  algorithms) run the heuristic's and never measure. ``TILE_M``, ``PERSISTENT`` and ``PACK_GQA`` pin their part either way.
* ``DECODE_SPLITS`` (flexjit): a positive int, the split-KV decode kernel's split count
  (default: from the shape and the SM count; ``flexjit.explain`` shows it).
* ``DECODE_CONFIG`` (flexjit): the split-KV decode kernel's variants, "+"-joined: "prefetch"
  (two K/V tiles in flight), "kbits" / "vbits" (an FP8 cache's tiles converted by integer
  ops); "" is the plain kernel. For measuring (``backends.triton.decode``).
* ``BACKEND`` (torch): "AUTO" (default), "TRITON" and "TRITON_DECODE" run flexjit's Triton
  kernels, "FLASH" its CuTeDSL kernels (torch's FLASH backend is FlashAttention-4's CuTeDSL
  kernel); with ``backend="auto"`` only: an explicit ``backend=`` wins.

Accepted and ignored (they tune torch's own Triton template, which flexjit does not run):
``PRESCALE_QK``, ``ROWS_GUARANTEED_SAFE``, ``BLOCKS_ARE_CONTIGUOUS``, ``WRITE_DQ``,
``kpack``, ``matrix_instr_nonkdim``, ``waves_per_eu``, ``OUTPUT_LOGSUMEXP``, ``OUTPUT_MAX``,
``SAFE_HEAD_DIMENSION``, the keys torch's inductor templates read (``num_consumer_groups``,
``num_buffers_warp_spec``, ``PARTITION_SIZE``, ``SAFE_N_BOUNDARY``, ``IS_DIVISIBLE``,
``SPLIT_KV``, ``SKIP_MASK_SCORE``), and any other key this torch's ``FlexKernelOptions``
declares.
"""
from __future__ import annotations

from typing import Literal, TypedDict

from flexjit.backends.cute import sm90 as cute_sm90

MEANINGFUL = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2",
              "BLOCK_N2", "FAST_MATH", "BACKEND", "FORCE_USE_FLEX_ATTENTION", "USE_TMA",
              "WARP_SPECIALIZE", "PERSISTENT", "DECODE_SPLITS", "TILE_M", "BWD_CONFIG",
              "AUTOTUNE", "DECODE_CONFIG", "PACK_GQA")
IGNORED = ("PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "WRITE_DQ",
           "kpack", "matrix_instr_nonkdim", "waves_per_eu", "OUTPUT_LOGSUMEXP", "OUTPUT_MAX",
           "SAFE_HEAD_DIMENSION",
           # read by torch's inductor templates: warp specialisation, the CPU template's
           # partition, the decode template's boundary check, the divisibility hint, the split
           # count (flexjit's is DECODE_SPLITS), the skip of the mask score on the CPU
           "num_consumer_groups", "num_buffers_warp_spec", "PARTITION_SIZE", "SAFE_N_BOUNDARY",
           "IS_DIVISIBLE", "SPLIT_KV", "SKIP_MASK_SCORE")
_BACKENDS = {"AUTO": "auto", "TRITON": "triton", "TRITON_DECODE": "triton", "FLASH": "cute"}


class FlexKernelOptions(TypedDict, total=False):
    """The keys of ``kernel_options`` (torch's ``FlexKernelOptions``, and flexjit's own); each
    may also carry a ``fwd_`` or ``bwd_`` prefix. The module docstring says what each means
    here; torch's keys that tune only its own template are accepted and ignored."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_M1: int
    BLOCK_N1: int
    BLOCK_M2: int
    BLOCK_N2: int
    num_warps: int
    num_stages: int
    FAST_MATH: bool
    BACKEND: Literal["AUTO", "TRITON", "FLASH", "TRITON_DECODE"]
    FORCE_USE_FLEX_ATTENTION: bool
    USE_TMA: bool
    WARP_SPECIALIZE: bool
    PERSISTENT: bool
    DECODE_SPLITS: int
    TILE_M: int
    PACK_GQA: bool
    BWD_CONFIG: str
    AUTOTUNE: bool
    DECODE_CONFIG: str
    PRESCALE_QK: bool
    ROWS_GUARANTEED_SAFE: bool
    BLOCKS_ARE_CONTIGUOUS: bool
    WRITE_DQ: bool
    kpack: int
    matrix_instr_nonkdim: int
    waves_per_eu: int


def _known_keys() -> frozenset:
    keys = set(MEANINGFUL) | set(IGNORED)
    try:
        from torch.nn.attention.flex_attention import FlexKernelOptions
        keys |= set(getattr(FlexKernelOptions, "__annotations__", {}))
    except ImportError:
        pass
    return frozenset(keys)


KNOWN = _known_keys()  # every key accepted without a prefix: flexjit's, the ignored, torch's list


_TYPED = (
    ("PERSISTENT", lambda v: isinstance(v, bool), "True or False"),
    ("AUTOTUNE", lambda v: isinstance(v, bool), "True or False"),
    ("PACK_GQA", lambda v: isinstance(v, bool), "True or False"),
    ("TILE_M", lambda v: v in (128, 192) and not isinstance(v, bool), "128 or 192"),
    ("DECODE_SPLITS", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
     "a positive int"),
    ("BWD_CONFIG", lambda v: isinstance(v, str) and all(
        t in cute_sm90.BWD_CONFIG_TOKENS for t in v.split("+") if t),
     f"a '+'-joined string of {cute_sm90.BWD_CONFIG_TOKENS}"),
    ("DECODE_CONFIG", lambda v: isinstance(v, str), "a '+'-joined string"),
)


def _base(key: str) -> str:
    return key[4:] if key.startswith(("fwd_", "bwd_")) else key


def validate(kernel_options, backend: str) -> tuple[dict, str]:
    """(options, backend): the options as a dict, checked; the backend ``BACKEND`` asks for when
    ``backend`` is "auto"."""
    if kernel_options is None:
        return {}, backend
    if not isinstance(kernel_options, dict):
        raise TypeError("kernel_options must be a dict")
    unknown = sorted(k for k in kernel_options if not isinstance(k, str) or _base(k) not in KNOWN)
    if unknown:
        raise ValueError(f"unknown kernel_options {unknown}; valid keys (each also with a fwd_ or bwd_ "
                         f"prefix): {', '.join(sorted(KNOWN))}")
    for key, check, what in _TYPED:
        if key in kernel_options and not check(kernel_options[key]):
            raise ValueError(f"kernel_options[{key!r}] must be {what}, got {kernel_options[key]!r}")
    if "BACKEND" in kernel_options and kernel_options.get("FORCE_USE_FLEX_ATTENTION", False):
        raise RuntimeError("kernel_options BACKEND cannot be combined with FORCE_USE_FLEX_ATTENTION "
                           "(torch's legacy knob, which BACKEND supersedes): drop "
                           "FORCE_USE_FLEX_ATTENTION and keep BACKEND")
    wanted = kernel_options.get("BACKEND")
    if wanted is not None:
        if wanted not in _BACKENDS:
            raise ValueError(f"kernel_options['BACKEND'] must be one of {sorted(_BACKENDS)}, got {wanted!r}")
        if backend == "auto":
            backend = _BACKENDS[wanted]
    return dict(kernel_options), backend
