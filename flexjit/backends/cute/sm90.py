"""The CuTeDSL Hopper backend: fill the sm90 kernels' holes from a Program, compile, cache, launch.

What this module holds
----------------------
* The generated mods module of a Program (``load_mods``: ``cute.render.render``, written to
  ``$FLEXJIT_CACHE_DIR/cute/mods_<key>.py`` and imported once), the holes of
  ``templates/cute/sm90/fwd.py`` and ``bwd.py``.
* Compile and load: ``compile_program`` (forward), ``compile_backward`` (its three kernels,
  through the backward's host module ``templates/cute/sm90/bwd_host.py``), kept
  in memory per (key, dtypes, head dims, block-mask presence, tiling) and, when launched through
  TVM-FFI, on disk as ``$FLEXJIT_CACHE_DIR/cute/<kernel_key>.o`` (``backends.cute.objects``), all
  through ``cache.cached``, so a second process loads them instead of compiling.
* The backend interface (``flexjit.dispatch``): ``supports``/``forward`` for the forward;
  ``backward_supports``/``backward`` for the sm90 backward from the saved (out, lse). Where it
  refuses (head dims it has no tile for, captured tensors whose gradient depends on the score),
  dispatch pairs this forward with the Triton backward. Learnable captured tensors (bias tables,
  ALiBi slopes) get their gradients from the sm90 backward itself.
* The block lists the kernels read (``block_sparse_args``, ``bwd_block_lists``, remembered on the
  BlockMask) and the schedule choice (``_persistent_fwd``).
* The forward's configurations (``tuning``: the candidates ``runtime.autotune`` measures, the
  shape class, ``heuristic``'s default); ``forward(call, config)`` runs the one given.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import time

import torch

from flexjit import config
from flexjit.backends import kernel_cache as cache
from flexjit.ir import nodes as ir
from flexjit.ir.nodes import Op
from flexjit.ir.program import Program
from flexjit.planner.block_mask import (_dense_to_ordered, _transpose_ordered, block_classes, dq_order,
                                        tile_q_lists)
from flexjit.backends.base import Config, Tuning, capability
from flexjit.backends.fp8 import descale_table
from flexjit.backends.cute import objects as cute_cache, templates

# (head_dim, head_dim_v) pairs the sm90 forward has a tile for (``sm90.fwd_tiling.HEAD_DIMS``,
# repeated here so that refusing a shape needs no cutlass import).
_HEAD_DIMS = ((32, 32), (64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256))
# The pairs its FP8 (e4m3) forward serves (``sm90.fwd_tiling.FP8_HEAD_DIMS``).
_FP8_HEAD_DIMS = ((64, 64), (128, 128), (256, 256))
_E4M3 = torch.float8_e4m3fn


@functools.lru_cache(maxsize=None)
def _cutlass_dtype(dtype: torch.dtype):
    import cutlass
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


from flexjit.backends.cute.render import (  # noqa: F401  (re-exported)
    captured_grads_in_kernel, grad_slots, render, unit_dscore)


_MODULES: dict[str, object] = {}  # Program.key -> the imported generated module


def load_mods(program: Program):
    """Import (generating once) the module holding this program's score_mod / mask_mod."""
    return cache.cached(_MODULES, program.key, lambda: _import_mods(program))


def _import_mods(program: Program):
    # Named by the text itself: a flexjit that renders a program differently never imports an
    # older file of the same program (the kernels' keys cover flexjit's sources; this file's
    # name must too).
    source = render(program)
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    path = cache.cache_dir("cute") / f"mods_{key}.py"
    if config.settings.debug:
        print(f"[flexjit] cute mods for {program.score_name}/{program.mask_name}: {path}")
    return cache.import_source(path, f"flexjit_cute_mods_{key}", source)


# --------------------------------------------------------------------------- backend interface


def _template():
    return templates("sm90").fwd


def _scalar_signature(program: Program) -> tuple:
    """The DSL type name of each runtime scalar (Int32 / Float32): part of a loaded kernel's
    argument check."""
    as_scalar = templates("sm90").fwd.as_scalar
    return tuple(type(as_scalar(x)).__name__ for x in program.scalars)


def operands_refusal(q, k, v, head_dims, kernel: str, fp8: bool = False) -> tuple[bool, str] | None:
    """Why a CuTe kernel cannot take these q/k/v (dtype, head dims, TMA strides), or None.
    ``fp8``: the call's q, k and v are float8_e4m3fn (``fp8_native`` said so)."""
    if not fp8 and q.dtype not in (torch.float16, torch.bfloat16):
        return False, f"dtype {q.dtype} (the {kernel} kernel takes fp16/bf16)"
    D, Dv = q.shape[-1], v.shape[-1]
    if (D, Dv) not in head_dims:
        return False, (f"head dims ({D}, {Dv}); the {kernel} kernel takes (head_dim, head_dim_v) "
                       f"in {head_dims}")
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.stride(-1) != 1 or any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False, f"{name} needs a contiguous last dim and 16-byte aligned strides for TMA"
    return None


def call_refusal(call, kernel: str) -> tuple[bool, str] | None:
    """Why a CuTe forward cannot take this call's block mask or scale, or None. Without a
    score_mod the kernel folds the scale into exp2's multiplier and takes the row max of the raw
    q·k: right only for a scale > 0 (at 0, masked scores' -inf times 0 is NaN)."""
    bm = call.block_mask
    if bm is not None and tuple(bm.BLOCK_SIZE) != (128, 128):
        return False, f"block size {bm.BLOCK_SIZE}; the {kernel} kernel takes 128x128 mask blocks"
    if call.program.score is None and call.scale <= 0:
        sign = "<" if call.scale < 0 else "="
        return False, f"scale {call.scale} {sign} 0 without a score_mod (the {kernel} forward folds the scale)"
    return None


def supports(call) -> tuple[bool, str]:
    q, k, v = call.q, call.k, call.v
    if q.device.type != "cuda":
        return False, f"needs a CUDA tensor, got {q.device.type}"
    major, minor = capability(q.device)
    if (major, minor) != (9, 0):
        return False, f"the sm90 kernel needs Hopper (sm_90), this GPU is sm_{major}{minor}"
    fp8 = call.fp8 is not None
    if fp8:
        native, why = fp8_native(call)
        if not native:
            return False, why
    refusal = operands_refusal(q, k, v, _FP8_HEAD_DIMS if fp8 else _HEAD_DIMS, "sm90", fp8)
    if refusal:
        return refusal
    if q.shape[0] > 1 and q.stride(0) == 0:
        return False, ("query is broadcast over the batch (stride 0), which the sm90 kernel's "
                       "TMA descriptors are not built for")
    if q.shape[0] > 1 and (k.stride(0) == 0) != (v.stride(0) == 0):
        return False, ("only one of key and value is broadcast over the batch (stride 0); the sm90 "
                       "kernel takes both broadcast or neither")
    refusal = call_refusal(call, "sm90")
    if refusal:
        return refusal
    try:
        _template()
    except ImportError as e:
        return False, f"nvidia-cutlass-dsl is not importable ({e})"
    tile_m = heuristic(call)["tile_m"] if fp8 else \
        forward_tile_m(q.shape[-1], call.block_mask, call.kernel_options.get("TILE_M"))
    what = (f"Hopper GPU: the CuTeDSL sm90 kernel (TMA, {'e4m3 ' if fp8 else ''}wgmma, "
            f"warp-specialised; {tile_m}-row query tiles, {tile_m // 64} consumer warpgroups")
    if tile_m != 128 and call.block_mask is not None:
        what += ", block-mask rows merged per tile"
    if kv_broadcast(call):
        return True, what + "), key/value batch broadcast (read at batch 0)"
    return True, what + ")"


def fp8_native(call) -> tuple[bool, str]:
    """Whether the sm90 forward reads this FP8 call's inputs itself: e4m3 q, k and v (an FP8
    KV cache beside a 16-bit query is dequantised), a 16-bit output, head dims it has an FP8
    tile for, no ``kernel_options`` tile pins (one configuration)."""
    f, q, v = call.fp8, call.q, call.v
    if not f.q_fp8:
        return False, "the sm90 FP8 forward takes an FP8 query too (FP8 K/V beside a 16-bit query are dequantised)"
    if f.out_dtype not in (torch.bfloat16, torch.float16):
        return False, f"the sm90 FP8 forward writes bf16 or fp16, not {f.out_dtype}"
    if (q.shape[-1], v.shape[-1]) not in _FP8_HEAD_DIMS:
        return False, (f"head dims ({q.shape[-1]}, {v.shape[-1]}); the sm90 FP8 forward takes "
                       f"{_FP8_HEAD_DIMS}")
    opts = call.kernel_options
    if "PERSISTENT" in opts:
        return False, "kernel_options PERSISTENT pins a schedule the sm90 FP8 forward does not have"
    if opts.get("TILE_M") not in (None, 128, *((192,) if _fp8_tile_192(call) else ())):
        return False, (f"kernel_options TILE_M={opts['TILE_M']!r} pins a tile the sm90 FP8 forward "
                       "does not have (128 rows; 192 at head dim 64 without a block mask)")
    return True, ("the sm90 FP8 forward: e4m3 wgmma for QKᵀ and PV (P rounded to e4m3), V "
                  "transposed on the device first, descales folded into the scale and output")


def _fp8_tile_192(call) -> bool:
    """Whether the FP8 forward may run 192-row tiles here: head dim 64 without a block mask
    (``fwd_tiling._fp8_tiling``)."""
    return call.q.shape[-1] == 64 and call.block_mask is None


def fp8_value_transposed(v: torch.Tensor) -> torch.Tensor:
    """The FP8 forward's V operand: (B, H, S, Dv) e4m3 -> Vᵀ (B, H, Dv, S rounded up to 128),
    contiguous, key j of every 32-key block at slot ``KEY_SLOT[j]`` (``cute_sm90.fp8``), zeros
    past S. One read of V and one write."""
    B, H, S, Dv = v.shape
    S32, Sp = -(-S // 32) * 32, -(-S // 128) * 128
    if v.device.type == "cuda":  # the same bytes in one pass (torch's scatter below is ~10x slower)
        from flexjit.backends.cute import fp8_layout
        return fp8_layout.value_transposed(v, Sp)
    slot = templates("sm90").fp8.KEY_SLOT
    u = v.view(torch.uint8)
    if S32 != S:
        u = torch.cat([u, u.new_zeros(B, H, S32 - S, Dv)], dim=2)
    out = torch.empty(B, H, Dv, Sp, dtype=torch.uint8, device=v.device)
    if Sp != S32:
        out[..., S32:].zero_()
    index = torch.tensor(slot, device=v.device)
    out[..., :S32].view(B, H, Dv, S32 // 32, 32)[..., index] = \
        u.view(B, H, S32 // 32, 32, Dv).permute(0, 1, 4, 2, 3)
    return out.view(_E4M3)


def kv_broadcast(call) -> bool:
    """Whether the call's key and value are one batch entry broadcast over the query's batch
    (stride 0: torch's batch broadcast, a paged KV cache). The kernels then take the un-expanded
    (1, H, S, D) tensors (``_batch_one``) and load K/V at batch 0 (``kv_batch_broadcast``)."""
    k, v = call.k, call.v
    return k.shape[0] > 1 and k.stride(0) == 0 and v.stride(0) == 0


def _batch_one(t: torch.Tensor) -> torch.Tensor:
    """Batch entry 0 of a tensor broadcast over the batch, as (1, H, S, D) with a nonzero batch
    stride (its span: a TMA descriptor is built over every stride; with extent 1 it never moves
    an address). A view: no copy."""
    span = max(st * n for st, n in zip(t.stride()[1:], t.shape[1:]))
    return t.as_strided((1, *t.shape[1:]), (span, *t.stride()[1:]))


_COMPILED: dict[tuple, object] = {}
log = logging.getLogger("flexjit")


def _aux_tensor(t: torch.Tensor, device) -> torch.Tensor:
    t = t.detach()
    if t.device != device:
        t = t.to(device)
    return t.reshape(1) if t.dim() == 0 else t


# The compile options that can change the code (the disk key's) and the artifact flags that
# make a compile keep PTX/cubin files (``cute_cache``: the sm100 backends share them).
_ARTIFACT_FLAGS = cute_cache.ARTIFACT_FLAGS
_key_options = cute_cache.key_options


def _kernel_config(cfg, aux_tensors, program: Program, *extra) -> tuple:
    """Everything besides the program that shapes a compiled kernel, forward or backward (the
    disk-cache key material; sizes, strides and scalar values are runtime arguments), plus the
    kernel's own ``extra`` fields. The K/V batch broadcast is named only where it is on, so the
    keys of the kernels that existed before it did not change."""
    return (cfg.dtype.__name__, cfg.head_dim, cfg.head_dim_v, cfg.has_block_mask,
            tuple((str(t.dtype), t.dim()) for t in aux_tensors),
            tuple(d.value for d in program.scalar_dtypes), dataclasses.astuple(cfg.tiling),
            _launch_tag(), *extra, *(("kv_batch_broadcast",) if cfg.kv_batch_broadcast else ()))


def _launch_tag() -> str:
    """TVM-FFI's version: the exported object calls into its C ABI, so a new version must not
    reuse it."""
    import tvm_ffi

    return f"launch=tvm-ffi {tvm_ffi.__version__}"


def _frozen_config(cfg, aux_tensors, program: Program, options: str) -> tuple:
    """The forward's disk-cache key material (``_kernel_config`` plus its rescale threshold,
    whether it writes max_scores and the code-changing compile options)."""
    return _kernel_config(cfg, aux_tensors, program, float(cfg.rescale_threshold),
                          bool(cfg.write_max), _key_options(options),
                          *(("fp8",) if cfg.fp8 else ()))


# The persistent forward (one CTA per SM looping over tiles, claimed from an atomic counter)
# overlaps a tile's epilogue with the next tile's loads; that pays where a tile's kv loop is short
# and buys nothing on long loops, where one CTA per tile keeps the hardware's greedy balancing of
# uneven tiles (docs/performance.md, "Persistent CTAs"). Hence the threshold, in kv tiles per q tile.
PERSISTENT_MAX_KV_TILES = 16
PERSISTENT_HEAD_DIMS = (32, 64, 96, 128)  # the others have no smem for a separate O buffer


def _mean_kv_tiles(lists, S: int, owner=None) -> float:
    """Mean number of 128-key tiles a q tile visits: from the BlockMask ``owner`` (remembered
    there), else from the kernel's block lists (one device sync), else every tile."""
    if owner is not None:
        return owner.mean_kv_tokens() / 128
    if lists is None:
        return float(-(-S // 128))
    kv_num, full_num = lists[0], lists[2]
    return float((kv_num.float().mean() + full_num.float().mean()).item())


def _persistent_fwd(head_dim: int, lists, S: int, owner=None, pinned: bool | None = None) -> bool:
    """Whether to launch the persistent forward: as ``pinned`` (``kernel_options["PERSISTENT"]``)
    says, else when a q tile visits at most PERSISTENT_MAX_KV_TILES kv tiles on average. Head
    dims 192 and 256 always keep the one-tile-per-CTA kernel (no smem for a separate O buffer
    beside their K/V stages)."""
    if head_dim not in PERSISTENT_HEAD_DIMS:
        return False
    if pinned is not None:
        return bool(pinned)
    return _mean_kv_tiles(lists, S, owner) <= PERSISTENT_MAX_KV_TILES


_announce = cute_cache.announce  # log (and print under FLEXJIT_DEBUG) a compile's or load's time


def _rescale_threshold() -> float:
    """The forward's rescale threshold in log2 units: O is rescaled at every growth of a row's
    max, which keeps torch's output accuracy (a lazy threshold was faster but measurably less
    accurate; docs/performance.md)."""
    return 0.0


def compile_program(program: Program, q, k, v, block_mask, aux_tensors, options: str = "",
                    persistent: bool | None = None, write_max: bool = False, keys: dict | None = None,
                    kv_batch_broadcast: bool = False, tile_m: int = 128,
                    out_dtype: torch.dtype | None = None):
    """Compile (or find in memory, or load from disk) the sm90 forward for this program and
    these input kinds.

    Only dtypes, head dims, ranks and block-mask presence shape the kernel: lengths, batch,
    heads, strides and scalar values are runtime arguments. Works on the CPU with
    CUTE_DSL_ARCH=sm_90a (for compile-only tests).

    Disk cache (TVM-FFI launches only, ``backends.cute.objects``): a compiled kernel is exported to
    ``cache_dir("cute")/<kernel_key>.o`` and a later process loads it instead of compiling. A
    caller asking for ``--keep-ptx``/``--keep-cubin`` always compiles (a loaded kernel has no
    PTX to show); its kernel is still exported.

    ``write_max``: the kernel also writes the row max of the modded scores (max_scores).
    ``kv_batch_broadcast``: k and v are one batch entry (1, H, S, D) for every query batch.
    ``tile_m``: the query tile's rows (``forward_tile_m``); 192 with a block mask takes the
    lists merged per tile (``merged_row_lists``).
    ``keys``: if given, ``keys["fwd"]`` is set to the disk-cache key (None with the cache off;
    ``flexjit.aot`` reports it).
    FP8 (float8_e4m3fn q, k and v, where ``v`` is the permuted Vᵀ, ``fp8_value_transposed``):
    ``out_dtype`` is the output's (bf16 or fp16); one tile per CTA."""
    tpl = _template()
    fp8 = q.dtype == _E4M3
    D, Dv = q.shape[-1], v.shape[-2 if fp8 else -1]
    out_dtype = out_dtype or q.dtype
    sig = tuple((t.dtype, t.dim()) for t in aux_tensors)
    if fp8:
        persistent = False
    if persistent is None:
        persistent = _persistent_fwd(D, block_mask, k.shape[2])
    # Persistent launches claim tiles dynamically: part of the tiling, hence of both cache keys.
    dynamic = persistent and tpl.dynamic_schedule_default()
    key = (program.key, q.dtype, D, Dv, block_mask is not None, sig, program.scalar_dtypes, options,
           persistent, dynamic, write_max, _rescale_threshold(), kv_batch_broadcast, tile_m, out_dtype)
    hit = _COMPILED.get(key)
    if hit is not None:  # the per-call path: no mods, config or disk key to build for `cached`
        return hit
    mods = load_mods(program)
    # The tiling (persistent flag included) is part of _frozen_config, hence of the disk key.
    cfg = tpl.FwdConfig(D, Dv, _cutlass_dtype(out_dtype), mods.score_mod, mods.mask_mod,
                        has_block_mask=block_mask is not None,
                        tiling=tpl.choose_tiling(D, Dv, block_mask is not None, persistent=persistent,
                                                 dynamic_schedule=dynamic, tile_m=tile_m, fp8=fp8),
                        write_max=write_max,
                        rescale_threshold=_rescale_threshold(), kv_batch_broadcast=kv_batch_broadcast,
                        fp8=fp8)
    what = forward_label(program, q.dtype, D)
    if kv_batch_broadcast:
        what += " (K/V batch broadcast)"
    disk_key = forward_disk_key(tpl, program, "sm90", keys,
                                lambda: _frozen_config(cfg, aux_tensors, program, options))

    def build():
        o = torch.empty(*q.shape[:-1], Dv, dtype=out_dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        return tpl.compile_fwd(cfg, q, k, v, o, lse, block_mask, aux_tensors, program.scalars,
                               options=options)

    return cute_cache.cached_kernel(
        _COMPILED, key, label=f"sm90 forward for {what}", disk_key=disk_key, options=options,
        compile=build, from_disk=lambda fn: tpl.CompiledFwd(
            cfg, None, sig + _scalar_signature(program), ffi_fn=fn),
        export=lambda fn: fn.export if fn.tvm_ffi else None)


def forward_label(program: Program, dtype, head_dim: int) -> str:
    return f"{program.score_name}/{program.mask_name} D={head_dim} {str(dtype).replace('torch.', '')}"


def forward_disk_key(tpl, program: Program, arch: str, keys, material) -> str | None:
    """A forward's disk-cache key (None with the disk cache off or without TVM-FFI), from the
    key ``material()``; recorded as ``keys["fwd"]`` when ``keys`` is given (``flexjit.aot``)."""
    disk_key = None
    if tpl.tvm_ffi_enabled() and cute_cache.available():
        disk_key = cache.kernel_key(program.key, f"cute_{arch}_fwd", material(), arch)
    if keys is not None:
        keys["fwd"] = disk_key
    return disk_key


def block_sparse_args(bm):
    """The kernel's four block lists (a mask without separate full blocks lists none full)."""
    if bm is None:
        return None
    full_num, full_idx = bm.full_kv_num_blocks, bm.full_kv_indices
    if full_num is None:  # empty full lists, made once per BlockMask rather than per call
        full_num, full_idx = bm.derived("cute_no_full_lists", lambda: (
            torch.zeros_like(bm.kv_num_blocks), torch.zeros_like(bm.kv_indices)))
    return (bm.kv_num_blocks, bm.kv_indices, full_num, full_idx)


# Merged list rows hold one class per (tile row, kv block) of the dense block grid while they are
# built; past this many the 128-row tile is kept (a 1M-token mask shared by all heads is 2^26).
_MERGE_MAX_BLOCKS = 1 << 28


# The 192-row tile with a block mask pays where few of its kv tiles are partial: at 8k, D=64, it
# took causal, prefix-LM, ALiBi and softcap forwards 9-14% faster (3-6% of their merged tiles
# partial) and sliding window (40%) 5%, document (31%) 28% slower: a partial tile runs mask_mod
# per score on 160 registers, where ptxas spills, and merging doubles the partial tiles.
MERGED_MAX_PARTIAL = 0.15
# Head dims whose forward takes the 192-row tile by that rule. D=32 on the H100, 8k, 128 → 192
# rows: full 248 → 318 TFLOP/s, causal 246 → 272 (FA4 346, 324).
TILE_192_HEAD_DIMS = (32, 64)


def forward_tile_m(head_dim: int, bm, pinned: int | None = None) -> int:
    """The forward's query tile rows: 192 at head dims 32 and 64 (three consumer warpgroups;
    with a block mask over merged list rows where at most MERGED_MAX_PARTIAL of the merged tiles
    are partial), else 128; ``pinned`` is ``kernel_options["TILE_M"]``. Head dim 96 has a
    192-row tile too (P through shared memory, ``fwd_tiling.choose_tiling``) that the tuner
    measures but the rule does not pick: causal +8% on the H200, -2% on the H100, full ±1%."""
    if head_dim == 96 and pinned in (128, 192):
        return int(pinned)
    if head_dim not in TILE_192_HEAD_DIMS:
        if pinned not in (None, 128):
            raise ValueError(f"kernel_options TILE_M={pinned}: the sm90 forward runs 128-row "
                             f"query tiles at head dim {head_dim} (192 only at head dims 32, "
                             "64 and 96)")
        return 128
    if pinned is not None:
        return int(pinned)
    if bm is None:
        return 192
    if bm.kv_num_blocks.numel() * bm.kv_indices.shape[-1] > _MERGE_MAX_BLOCKS:
        return 128
    return 192 if _merged_partial_share(bm) <= MERGED_MAX_PARTIAL else 128


def _merged_partial_share(bm) -> float:
    """The share of partial tiles among the tiles the 192-row forward would visit (one device
    sync, remembered on the BlockMask)."""
    def share() -> float:
        p_num, _, f_num, _, _ = forward_lists(bm, 192)
        p, f = p_num.sum().item(), f_num.sum().item()
        return p / (p + f) if p + f else 0.0
    return bm.derived("cute_sm90_partial_share", share)


def merged_row_lists(kv_num, kv_idx, full_num, full_idx, tile_m: int = 192) -> tuple:
    """``BlockSparseRows``' five int32 tensors for ``tile_m``-row query tiles from 128×128 block
    lists (counts (Bm, Hm, nQB), indices (Bm, Hm, nQB, nKVB)).

    Tile t covers block rows r0 = ⌊t·tile_m / 128⌋ and r1 = ⌊(t·tile_m + tile_m − 1) / 128⌋ (each
    64-row warpgroup slab lies in one of them); a row r1 past the mask has no queries and takes
    r0's class. A kv block is FULL for the tile where both rows list it full, PARTIAL where
    either row lists it at all otherwise, with kinds k0 | k1 << 2 (0 skip, 1 partial, 2 full;
    a block listed both partial and full counts as partial). Lists ascending, as torch's."""
    classes = block_classes(kv_num, kv_idx, full_num, full_idx)
    nqb = classes.shape[2]
    t = torch.arange(-(-nqb * 128 // tile_m), device=classes.device)
    r0, r1 = t * tile_m // 128, (t * tile_m + tile_m - 1) // 128
    c0 = classes[:, :, r0]
    c1 = classes[:, :, torch.where(r1 < nqb, r1, r0)]
    full = (c0 == 2) & (c1 == 2)
    partial = ((c0 | c1) != 0) & ~full
    code = (c0 | (c1 << 2)).to(torch.int32)
    p_num, p_idx = _dense_to_ordered(partial)
    f_num, f_idx = _dense_to_ordered(full)
    kinds = code.gather(-1, p_idx.long())
    cols = torch.arange(p_idx.shape[-1], device=p_idx.device)
    kinds = torch.where(cols < p_num[..., None], kinds, torch.zeros_like(kinds))
    return p_num, p_idx, f_num, f_idx, kinds.contiguous()


def forward_lists(bm, tile_m: int):
    """The forward kernel's block tensors for a BlockMask at this tile (None without one), the
    merged ones made once per BlockMask."""
    if bm is None or tile_m == 128:
        return block_sparse_args(bm)
    return bm.derived(f"cute_sm90_rows{tile_m}",
                      lambda: merged_row_lists(*block_sparse_args(bm), tile_m=tile_m))


def forward(call, config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, lse, max_scores or None), on ``config`` (one of ``tuning(call)``'s candidates;
    None: the heuristic's), into fresh outputs: the tuner may run it more than once."""
    prog = call.program
    q, k, v = call.q, call.k, call.v
    broadcast = kv_broadcast(call)
    if broadcast:
        k, v = _batch_one(k), _batch_one(v)
    bm = call.block_mask
    if config is None:
        config = call.memo.get("sm90_fwd_heuristic")
        if config is None:
            config = call.memo["sm90_fwd_heuristic"] = heuristic(call)
    tile_m = config["tile_m"]
    sparse = forward_lists(bm, tile_m)
    aux = tuple(_aux_tensor(t, q.device) for t in prog.buffers)
    descale = None
    if call.fp8 is not None:  # fp8_native: e4m3 q, k, v
        v = fp8_value_transposed(v)
        descale = descale_table(call)
    fn = compile_program(prog, q, k, v, sparse, aux, persistent=config["persistent"],
                         write_max=call.max_scores, kv_batch_broadcast=broadcast, tile_m=tile_m,
                         out_dtype=call.out_dtype)
    o = torch.empty(*q.shape[:-1], call.v.shape[-1], dtype=call.out_dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    max_scores = torch.empty_like(lse) if call.max_scores else None
    o, lse = fn(q, k, v, o, lse, call.scale, sparse, aux, prog.scalars, max_scores=max_scores,
                descale=descale)
    return o, lse, max_scores


# --------------------------------------------------------------------------- configurations

FAMILY = "sm90-fwd"


def heuristic(call) -> Config:
    """The forward's configuration by rule (``forward_tile_m``, ``_persistent_fwd``), pins in
    ``kernel_options`` honoured: what runs until the tuner has measured, and without it."""
    D, opts = call.q.shape[-1], call.kernel_options
    if call.fp8 is not None:  # one tile per CTA; 192 rows where _fp8_tile_192 allows them
        pinned = opts.get("TILE_M")
        tile_m = pinned if pinned is not None else 192 if _fp8_tile_192(call) else 128
        return _configs((int(tile_m),), (False,))[0]
    return Config.of(tile_m=forward_tile_m(D, call.block_mask, opts.get("TILE_M")),
                     persistent=_persistent_fwd(D, None, call.k.shape[2], owner=call.block_mask,
                                                pinned=opts.get("PERSISTENT")))


@functools.lru_cache(maxsize=None)
def _configs(tile_ms: tuple, persistents: tuple) -> tuple[Config, ...]:
    return tuple(Config.of(tile_m=m, persistent=p) for m in tile_ms for p in persistents)


def _log2(x: float) -> int:
    """A length's bucket: nearby lengths (8000, 8192) share one."""
    return round(math.log2(max(x, 1.0)))


def tuning(call) -> Tuning:
    """The forward's candidates for this call (``runtime.autotune`` measures them).

    Only close calls are measured: both tiles at head dims 32, 64 and 96 (192 with a block mask
    only where at most 2·MERGED_MAX_PARTIAL of the merged tiles are partial), both schedules where a query
    tile visits at most 2·PERSISTENT_MAX_KV_TILES kv tiles on average; a kernel_options pin
    keeps its value alone. The shape class holds what moves the answer: the Program, dtype,
    head dims, mask presence, K/V broadcast, max_scores, and log2 buckets of L, S, the grid
    (B·Hq·⌈L/128⌉) and the mean kv tiles per q tile; at those head dims with a mask the
    merged tiles' partial share in tenths (known there already; elsewhere it would cost a
    sync)."""
    q, bm, opts = call.q, call.block_mask, call.kernel_options
    B, H, L, D = q.shape
    S = call.k.shape[2]
    default = heuristic(call)
    kv_tiles = _mean_kv_tiles(None, S, bm)
    share = None
    tile_ms = (default["tile_m"],)
    fp8 = call.fp8 is not None  # one schedule; both tiles only where _fp8_tile_192 allows 192
    if fp8 and "TILE_M" not in opts and _fp8_tile_192(call):
        tile_ms = (128, 192)
    elif D in (*TILE_192_HEAD_DIMS, 96) and "TILE_M" not in opts and not fp8:
        mergeable = bm is None or bm.kv_num_blocks.numel() * bm.kv_indices.shape[-1] <= _MERGE_MAX_BLOCKS
        if bm is not None and mergeable:
            share = _merged_partial_share(bm)
        if mergeable and (share is None or share <= 2 * MERGED_MAX_PARTIAL):
            tile_ms = (128, 192)
    persistents = (default["persistent"],)
    if D in PERSISTENT_HEAD_DIMS and "PERSISTENT" not in opts and not fp8 and \
            kv_tiles <= 2 * PERSISTENT_MAX_KV_TILES:
        persistents = (False, True)
    key = (f"program={call.program.key}", f"dtype={str(q.dtype).removeprefix('torch.')}",
           f"dims={D}x{call.v.shape[-1]}", f"mask={bm is not None}",
           f"kv_broadcast={kv_broadcast(call)}", f"max_scores={call.max_scores}",
           f"L=2^{_log2(L)}", f"S=2^{_log2(S)}", f"grid=2^{_log2(B * H * -(-L // 128))}",
           f"kv_tiles=2^{_log2(kv_tiles)}")
    if share is not None:
        key += (f"partial={round(share, 1)}",)
    pins = ", ".join(f"{k}={opts[k]!r}" for k in ("TILE_M", "PERSISTENT") if k in opts)
    return Tuning(FAMILY, key, _configs(tile_ms, persistents), default,
                  f"kernel_options {pins}" if pins else "")


# --------------------------------------------------------------------------- backward

# (head_dim, head_dim_v) pairs the sm90 backward has a tile for (``sm90.bwd_tiling.HEAD_DIMS``).
# 192 and (192, 128) run on 64 × 96 tiles by default ("keys96", ``bwd_keys``); deterministic
# mode and captured-tensor gradients take the table's 64-key tile with the head dims split
# between the MMA warpgroups (``bwd_tiling.choose_bwd_tiling``).
_BWD_HEAD_DIMS = ((32, 32), (64, 64), (96, 96), (128, 128), (192, 192), (192, 128))
# The backward's schedule variants (``bwd_tiling.BWD_CONFIG_TOKENS``, repeated here so that
# checking kernel_options needs no cutlass import).
BWD_CONFIG_TOKENS = ("late", "dksmem", "psmem", "lpt", "lpt2", "shuffle", "swapdq", "dvafter",
                     "m80", "m128", "qsplit", "sdpdup", "qhead", "keys96", "dpafter")
# The kv tile of "keys96" (``bwd_tiling.KEYS96``): its q lists are per 96 keys.
_KEY_TILE = 96


def _bwd_template():
    return templates("sm90").bwd


def _bwd_host():
    return templates("sm90").bwd_host


def keys96_refusal(prog: Program, deterministic: bool) -> str:
    """Why the 96-key tile ("keys96", ``bwd_keys``) cannot take this backward, "" if it can: it
    has no deterministic dQ order and no captured-tensor gradients; the tile table's 64-key
    kernel serves those."""
    if deterministic:
        return "deterministic algorithms"
    if prog.grad_loads:
        return "captured-tensor gradients"
    return ""


def routed_config(prog: Program, config: str, deterministic: bool) -> str:
    """``config`` (a ``BWD_CONFIG`` string) as the backward runs it: "keys96" dropped where
    ``keys96_refusal`` says (the tile table's row runs instead, ``backward_tuning`` says so)."""
    if "keys96" in config.split("+") and keys96_refusal(prog, deterministic):
        return "+".join(t for t in config.split("+") if t != "keys96")
    return config


def tiling_for(prog: Program, head_dim: int, head_dim_v: int, config: str,
               deterministic: bool = False):
    """The backward's ``BwdTiling``: the tile table's row with the schedule variants ``config``
    names (a ``BWD_CONFIG`` string, ``routed_config``); None for the row itself."""
    config = routed_config(prog, config, deterministic)
    if not config:
        return None
    if ("late" in config.split("+") and prog.score is not None and not prog.grad_loads
            and not unit_dscore(prog)):
        raise ValueError("kernel_options BWD_CONFIG 'late' converts P after dS, which needs P "
                         "itself in the S accumulator: not with a score_mod whose d score/d score "
                         "is not the constant 1 (P∘dscore is there)")
    return templates("sm90").bwd_tiling.bwd_tiling(head_dim, head_dim_v, light_mods(prog) or None,
                                                   config)


def backward_supports(call) -> tuple[bool, str]:
    """Whether the sm90 backward serves this call's gradients (else the Triton backward does)."""
    D, Dv = call.q.shape[-1], call.v.shape[-1]
    if (D, Dv) not in _BWD_HEAD_DIMS:
        return False, (f"head dims ({D}, {Dv}); the sm90 backward takes (head_dim, head_dim_v) in "
                       f"{_BWD_HEAD_DIMS}")
    if call.program.grad_loads:
        ok, why = captured_grads_in_kernel(call.program)
        if not ok:
            return False, f"captured-tensor gradients: {why} (the Triton backward computes them)"
    try:
        if not _template().tvm_ffi_enabled():
            return False, "the sm90 backward launches through TVM-FFI, unavailable here"
    except ImportError as e:
        return False, f"nvidia-cutlass-dsl is not importable ({e})"
    return True, "the CuTeDSL sm90 backward"


def light_mods(program: Program) -> bool:
    """No loads and no transcendentals in the score, its derivative or the mask: cheap enough
    for the backward to form P under the dP GEMM (``BwdConfig.overlap_dp``)."""
    hit = _LIGHT.get(program.key)
    if hit is None:
        roots = [r for r in (program.score, program.dscore, program.mask) if r is not None]
        hit = _LIGHT[program.key] = not any(n.op is Op.LOAD or n.op in ir.TRANSCENDENTAL
                                            for n in ir.toposort(roots))
    return hit


_LIGHT: dict[str, bool] = {}  # Program.key -> light_mods: every backward call asks, twice


def bwd_block_lists(bm, tiling=None):
    """The 8 int32 tensors the backward takes: the kv lists, then the q lists (zeros for absent
    full lists; transposed lists derived when the BlockMask lacks them). Kept on the BlockMask.
    ``tiling``: the backward's ``BwdTiling``; the 96-key tile's q lists are per kv tile
    (``tile_q_lists``), the others' per mask block."""
    if bm is None:
        return None
    lists = bm.derived("cute_bwd_lists", lambda: _bwd_block_lists(bm))
    if tiling is not None and tiling.tile_n == _KEY_TILE:
        return bm.derived("cute_bwd_lists96", lambda: (
            *lists[:4], *(t.contiguous() for t in tile_q_lists(*lists[4:], _KEY_TILE))))
    return lists


def _bwd_block_lists(bm):
    kv = block_sparse_args(bm)
    qn, qi, fqn, fqi = bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices
    if qn is None:
        qn, qi = _transpose_ordered(bm.kv_num_blocks, bm.kv_indices)
    if fqn is None:
        if bm.full_kv_num_blocks is not None:
            fqn, fqi = _transpose_ordered(bm.full_kv_num_blocks, bm.full_kv_indices)
        else:
            fqn, fqi = torch.zeros_like(qn), torch.zeros_like(qi)
    return tuple(t.to(torch.int32).contiguous() for t in (*kv, qn, qi, fqn, fqi))


def _dq_order(bm, lists):
    """Deterministic mode's merged q lists and dQ accumulation order, once per BlockMask."""
    return bm.derived("cute_dq_order", lambda: dq_order(lists))


_COMPILED_BWD: dict[tuple, object] = {}


def compile_backward(program: Program, dtype: torch.dtype, head_dim: int, sparse: bool,
                     deterministic: bool, aux_tensors, head_dim_v: int | None = None,
                     kv_batch_broadcast: bool = False, tiling=None):
    """The sm90 backward's three kernels (preprocess, main, postprocess) for this program, from
    memory, the disk cache (each part its own object file) or a fresh compile. A program with
    learnable captured tensors (``Program.grad_loads``, part of its key) gets a main kernel that
    also accumulates their gradients (``BwdConfig.score_grads``). ``kv_batch_broadcast``: K/V
    are one batch entry for every query batch (``BwdConfig.kv_batch_broadcast``). ``tiling``:
    a ``BwdTiling`` (None: the tile table's, ``choose_bwd_tiling``)."""
    host = _bwd_host()
    sig = tuple((t.dtype, t.dim()) for t in aux_tensors)
    head_dim_v = head_dim_v or head_dim
    key = (program.key, dtype, head_dim, head_dim_v, sparse, deterministic, sig,
           program.scalar_dtypes, kv_batch_broadcast, tiling)
    return cache.cached(_COMPILED_BWD, key, lambda: _build_backward(
        host, program, dtype, head_dim, head_dim_v, sparse, deterministic, aux_tensors, sig,
        kv_batch_broadcast=kv_batch_broadcast, tiling=tiling))


def export_backward(program: Program, dtype: torch.dtype, head_dim: int, sparse: bool,
                    deterministic: bool, aux_tensors, head_dim_v: int | None = None,
                    dump_dirs: dict | None = None, kv_batch_broadcast: bool = False,
                    tiling=None) -> dict:
    """Compile the backward's three kernels afresh (never from disk), export each into the disk
    cache under the key ``compile_backward`` looks up, and with ``dump_dirs`` ({part: folder or
    None}) keep each part's PTX and cubin there. {part: disk key or None}. For ``flexjit.aot``."""
    host = _bwd_host()
    head_dim_v = head_dim_v or head_dim
    sig = tuple((t.dtype, t.dim()) for t in aux_tensors)
    keys: dict = {}
    _build_backward(host, program, dtype, head_dim, head_dim_v, sparse, deterministic, aux_tensors,
                    sig, dump_dirs=dump_dirs or {}, keys_out=keys, kv_batch_broadcast=kv_batch_broadcast,
                    tiling=tiling)
    return keys


def _build_backward(host, program: Program, dtype, head_dim: int, head_dim_v: int, sparse: bool,
                    deterministic: bool, aux_tensors, sig, dump_dirs: dict | None = None,
                    keys_out: dict | None = None, kv_batch_broadcast: bool = False, tiling=None):
    """The three kernels (``host``: the template ``sm90.bwd_host``), each from its own object file on disk, the missing ones compiled
    together (and exported); the pre/postprocess keys leave the Program out: every mod shares
    them."""
    mods = load_mods(program)
    cfg = _bwd_template().BwdConfig(
        head_dim, head_dim_v, _cutlass_dtype(dtype), mods.score_mod_and_grad, mods.mask_mod,
        has_block_mask=sparse, deterministic=deterministic,
        overlap_dp=True if light_mods(program) else None,
        score_grads=getattr(mods, "score_grads", None),
        grad_offsets=getattr(mods, "grad_offsets", None), kv_batch_broadcast=kv_batch_broadcast,
        unit_dscore=unit_dscore(program), tiling=tiling)
    dims = f"{head_dim}" if head_dim_v == head_dim else f"{head_dim}/{head_dim_v}"
    what = f"{program.score_name}/{program.mask_name} D={dims} {str(dtype).replace('torch.', '')}"
    if kv_batch_broadcast:
        what += " (K/V batch broadcast)"
    frozen = _kernel_config(cfg, aux_tensors, program, f"deterministic={deterministic}",
                            f"grad_slots={grad_slots(program)}")
    # The pre/postprocess read only these: schedule variants of one tile share them.
    plain = (cfg.dtype.__name__, head_dim, head_dim_v, deterministic, cfg.tiling.tile_m,
             cfg.tiling.dq_swapped, _launch_tag())
    disk = cute_cache.available()
    keys = {part: cache.kernel_key(program.key, f"cute_sm90_bwd_{part}", frozen, "sm90")
            if part == "main" else cache.kernel_key("", f"cute_sm90_bwd_{part}", plain, "sm90")
            for part in host.PARTS}
    if keys_out is not None:
        keys_out.update({part: keys[part] if disk else None for part in host.PARTS})
    t0 = time.perf_counter()
    fresh = dump_dirs is not None  # ahead of time: always compile (and keep the files asked for)
    loaded = {part: cute_cache.load(k) for part, k in keys.items()} if disk and not fresh else {}
    missing = tuple(p for p in host.PARTS if loaded.get(p) is None)
    if fresh and disk:
        # Ahead of time, a pre/postprocess another schedule variant already exported (they
        # share its key) is not built again unless its files are asked for.
        missing = tuple(p for p in missing if p == "main" or dump_dirs.get(p) is not None
                        or not cute_cache.object_path(keys[p]).exists())
    if missing:
        log.info("flexjit: compiling the sm90 backward (%s) for %s ...", ", ".join(missing), what)
        with cute_cache.compiling():
            if fresh:  # one compile per part, each dumping into its own folder
                parts = {}
                for part in missing:
                    folder = dump_dirs.get(part)
                    opts = "" if folder is None else f"--keep-ptx --keep-cubin --dump-dir {folder}"
                    parts[part] = host.compile_bwd(cfg, aux_tensors, program.scalars, options=opts,
                                                   parts=(part,)).parts[part]
            else:
                parts = host.compile_bwd(cfg, aux_tensors, program.scalars, parts=missing).parts
        for part in missing:
            loaded[part] = parts[part].ffi_fn
            if disk:
                cute_cache.store(keys[part], parts[part].export)
        _announce(f"sm90 backward for {what}: compiled {', '.join(missing)} in "
                  f"{time.perf_counter() - t0:.1f} s")
    else:
        _announce(f"sm90 backward for {what}: loaded from disk in {time.perf_counter() - t0:.3f} s")
    return host.load_bwd(cfg, loaded, sig + _scalar_signature(program))


BWD_FAMILY = "sm90-bwd"


def backward_heuristic(call) -> Config:
    """The backward's configuration by rule: ``default_bwd_config`` (at head dim 192 the 96-key
    tile, "keys96", wherever it serves: 1.4x the 64-key tile's fwd+bwd on the H100), or
    the variants ``kernel_options["BWD_CONFIG"]`` pins (``bwd_config_for``: less the variants
    that cannot serve this call)."""
    return Config.of(bwd_config=heuristic_bwd_config(call, torch.are_deterministic_algorithms_enabled()))


# The 128-row backward tile at head dims 32 and 64 (FA4's), dV issued only after dS is stored
# ("dvafter": earlier, ptxas serialises every wgmma for want of registers). H100 fwd+bwd 8k
# against the 64-row tile, same run: D=64 full +5% (Hkv 16) / +12% (Hkv 4), causal +10% / +3%;
# D=32 full +16%, causal +12%. Mods with loads or transcendentals spill there (ALiBi 264 bytes
# at D=64), so they keep the 64-row tile.
TALL_BWD = {32: "m128+dvafter", 64: "m128+shuffle+dvafter"}


def default_bwd_config(call) -> str:
    """The ``BWD_CONFIG`` the backward runs unless pinned: at head dim 192 the 96-key tile; at
    head dims 32 and 64 with light mods (``light_mods``) the 128-row tile (``TALL_BWD``); else
    the tile table's row."""
    D = call.q.shape[-1]
    if D == 192:
        return "keys96"
    if D in TALL_BWD and light_mods(call.program):  # Dv = D there (backward_supports)
        return TALL_BWD[D]
    return ""


def heuristic_bwd_config(call, deterministic: bool) -> str:
    """``backward_heuristic``'s ``BWD_CONFIG`` string under ``deterministic``."""
    default = default_bwd_config(call)
    return bwd_config_for(call, call.kernel_options.get("BWD_CONFIG", default), deterministic)[0]


def bwd_config_for(call, config: str, deterministic: bool) -> tuple[str, str]:
    """(``config`` as this call runs it, why it differs or ""). "keys96" is dropped where
    ``keys96_refusal`` says (the 64-key tile serves). "qhead" (one CTA per query head, dK/dV
    summed over the group in fp32 workspaces) is dropped where the kernel's head loop serves
    instead: without GQA (nothing to sum), in deterministic mode (the group's fp32 adds land in
    no fixed order) and at head dim 192 (no such form there)."""
    whys = []
    refusal = keys96_refusal(call.program, deterministic)
    if "keys96" in config.split("+") and refusal:
        config = routed_config(call.program, config, deterministic)
        whys.append(f"without keys96: the 64-key tile serves {refusal}")
    tokens = config.split("+")
    why = "" if "qhead" not in tokens else (
        "Hq = Hkv" if call.q.shape[1] == call.k.shape[1]
        else "deterministic algorithms: the group's fp32 dK/dV adds are unordered" if deterministic
        else "head dim 192" if call.q.shape[-1] > 128 else "")
    if why:
        config = "+".join(t for t in tokens if t != "qhead")
        whys.append(f"'qhead' runs as the head loop ({why})")
    return config, "; ".join(whys)


def backward_tuning(call) -> Tuning:
    """The backward's candidates for this call (``runtime.autotune`` measures them): the
    heuristic's schedule and, under a block mask outside deterministic mode, the same with kv
    tiles launched longest first in sections of 8 or 2 (kv head, batch) pairs ("lpt", "lpt2": causal masks'
    work falls with the kv tile; which section pays depends on the Q/dO bytes, docs/
    performance.md); under GQA at head dim 128 outside deterministic mode, one CTA per query
    head ("qhead": +5% on causal 8k, -6% on full 8k, even elsewhere; it lost at head dim 64 and
    with the lpt sections, so those stay unmeasured). D = 192: the 96-key tile ("keys96",
    ``bwd_keys``) alone (the heuristic's, where it serves). The shape class: the Program, dtype, head dims, mask presence,
    K/V broadcast, deterministic mode, the GQA group, and log2 buckets of L, S and the grid
    (B·Hkv·⌈S/128⌉)."""
    q, prog, bm, opts = call.q, call.program, call.block_mask, call.kernel_options
    B, H, L, D = q.shape
    S, Hkv, Dv = call.k.shape[2], call.k.shape[1], call.v.shape[-1]
    default = backward_heuristic(call)
    deterministic = torch.are_deterministic_algorithms_enabled()
    names = [default["bwd_config"]]
    lpt = "BWD_CONFIG" not in opts and D <= 128 and bm is not None and not deterministic
    if lpt:
        names += ["+".join(t for t in (names[0], sec) if t) for sec in ("lpt", "lpt2")]
    if "BWD_CONFIG" not in opts and D == 128 and H > Hkv and not deterministic:
        names.append("qhead")
    key = (f"program={prog.key}", f"dtype={str(q.dtype).removeprefix('torch.')}",
           f"dims={D}x{Dv}", f"mask={bm is not None}", f"kv_broadcast={kv_broadcast(call)}",
           f"deterministic={deterministic}", f"group={H // Hkv}", f"L=2^{_log2(L)}",
           f"S=2^{_log2(S)}", f"grid=2^{_log2(B * Hkv * -(-S // 128))}")
    pins = f"kernel_options BWD_CONFIG={opts['BWD_CONFIG']!r}" if "BWD_CONFIG" in opts else ""
    routed = bwd_config_for(call, opts.get("BWD_CONFIG", ""), deterministic)[1]
    pins += f"; {routed}" if routed else ""
    return Tuning(BWD_FAMILY, key, tuple(Config.of(bwd_config=n) for n in names), default, pins)


def backward(call, q, k, v, out, lse, dout, dlse, config: Config | None = None) -> tuple:
    """(dq, dk, dv, *captured-tensor grads) on the sm90 backward kernels: one gradient per
    ``Program.buffers`` entry, None for those that get none (no ``grad_loads``). dk/dv have the
    query's batch also where K/V are broadcast over it (``kv_broadcast``). dq/dk/dv are
    deterministic (a fixed dQ accumulation order) when
    ``torch.are_deterministic_algorithms_enabled()``; the captured gradients are summed by fp64
    atomics in any order (as the Triton backward's), so they are reproducible to fp64 rounding,
    not bit for bit. ``config``: one of ``backward_tuning(call)``'s candidates (None: the
    heuristic's)."""
    prog = call.program
    aux = tuple(_aux_tensor(t, q.device) for t in prog.buffers)
    deterministic = torch.are_deterministic_algorithms_enabled()
    broadcast = kv_broadcast(call)
    # The compiled kernels by configuration, in the call's memo (its signature fixes everything
    # the choice reads): a training step would otherwise rebuild the choice every call.
    memo_key = ("sm90_bwd", None if config is None else config["bwd_config"], deterministic)
    fn = call.memo.get(memo_key)
    if fn is None:
        if config is None:
            config = backward_heuristic(call)
        tiling = tiling_for(prog, q.shape[-1], v.shape[-1],
                            bwd_config_for(call, config["bwd_config"], deterministic)[0], deterministic)
        fn = call.memo[memo_key] = compile_backward(
            prog, q.dtype, q.shape[-1], call.block_mask is not None, deterministic, aux,
            head_dim_v=v.shape[-1], kv_batch_broadcast=broadcast, tiling=tiling)
    return run_backward(fn, call, q, k, v, out, lse, dout, dlse, aux, deterministic, broadcast)


def run_backward(fn, call, q, k, v, out, lse, dout, dlse, aux, deterministic: bool,
                 broadcast: bool = False) -> tuple:
    """Launch a compiled backward ``fn`` (either arch's ``CompiledBwd``) on the call: its block
    lists (and deterministic mode's dQ order), dq/dk/dv, one fp64 accumulator per learnable
    captured tensor; returns (dq, dk, dv, *captured-tensor grads in the buffers' dtypes).
    ``broadcast``: K/V are one batch entry for every query batch (``kv_broadcast``; the sm90
    kernels only): dk/dv come back per query batch, for autograd's expand backward to sum."""
    prog = call.program
    bm = call.block_mask
    lists = bwd_block_lists(bm, getattr(fn.cfg, "tiling", None))
    order = _dq_order(bm, lists) if deterministic and bm is not None else None
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if broadcast:
        # dK/dV per query batch (contiguous: empty_like of a stride-0 view is): the gradient of
        # the expanded view, which autograd's expand backward sums over the batch.
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        k, v = _batch_one(k), _batch_one(v)
    slots = grad_slots(prog) if prog.grad_loads else []
    # fp64: a table entry can receive ~L·S/2 adds (see triton._GRAD_ACC).
    accs = {s: torch.zeros(aux[s].shape, dtype=torch.float64, device=q.device) for s in slots}
    fn(q, k, v, out, dout, lse, dlse, dq, dk, dv, call.scale, lists, aux, prog.scalars,
       q_order=order, grad_accs=tuple(accs[s] for s in slots))
    dbufs = [accs[s].reshape(b.shape).to(device=b.device, dtype=b.dtype) if s in accs else None
             for s, b in enumerate(prog.buffers)]
    return (dq, dk, dv, *dbufs)
