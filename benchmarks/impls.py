"""Each implementation behind one adapter: `setup(variant, case, device)` -> `fn(q, k, v) -> out`.

An adapter builds everything that is not the attention call itself (block masks, compiled
callables, keyword arguments) in `setup`, outside the timed region. It raises `Skip` with a reason
where it cannot run here: a package that does not import, a variant the library has no way to
express, no GPU. `fn` takes and returns tensors in the adapter's `layout`:
"bhsd" ([B, H, S, D], FlexAttention and SDPA) or "bshd" ([B, S, H, D], FA4); the runner makes
each layout's copies and transposes the results back, outside the timed region.

| impl               | what runs                                                              |
|--------------------|------------------------------------------------------------------------|
| flexjit-<backend>  | flexjit.flex_attention(..., backend=<backend>), flexjit's block mask   |
| flexjit-cute-<mode>| the same under one of FLEXJIT_MODES' switches (det, pertile, persistent, |
|                    | m128/m192: the forward's query tile pinned; m192-pertile: and one tile |
|                    | per CTA)                                                               |
| torch-flex-triton  | torch.compile(flex_attention), torch's block mask, Triton kernels      |
| torch-flex-flash   | the same with kernel_options={"BACKEND": "FLASH"} (FA4 underneath)     |
| fa4                | flash_attn.cute.flash_attn_func with the variant's built-in arguments  |
| fa4-bhsd           | the same on [B, H, S, D] memory (transposed views), as torch-flex-flash |
|                    | hands it: FA4's kernel on flexjit's own layout                          |
| fa4-nopack         | fa4 with pack_gqa=False: a CTA per query head, as flexjit's forward    |
| cudnn              | F.scaled_dot_product_attention under SDPBackend.CUDNN_ATTENTION        |
| torch-flex-eager   | flex_attention without compile: for CPU smoke runs only                |
| flexjit-cute-fp8   | flexjit.flex_attention on float8_e4m3fn q, k, v with (B, Hkv) descales, |
| (-triton-, -ref-)  | bf16 out: the user's call, flexjit's own per-call work timed with it    |
| sdpa-fp8           | torch's _scaled_dot_product_attention_quantized (FA3 underneath, where  |
|                    | torch has it activated), (B, Hkv) descales; full and causal              |
| torch-flex-triton-fp8 | torch.compile(flex_attention) on e4m3 q, k, v, the descales folded    |
|                    | into a score_mod and the output (torch's flex takes none)               |
| fa4-fp8            | flash_attn_func on e4m3 q, k, v with its descale keywords, if it has them |

FP8 impls (``FP8_IMPLS``, adapters with ``fp8 = True``) time the forward only. Their inputs are
the case's bf16 sets quantised outside the timed region (``prepare``, ``reference.fp8_set``:
every FP8 impl gets the same values); ``fn(q, k, v)`` takes the bf16 tensors and looks their
quantised copies up. The run checks them against the attention of the dequantised values.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Callable

import torch

from .reference import E4M3, fp8_set
from .variants import Case, Variant

FLEXJIT_IMPLS = ("flexjit-cute", "flexjit-triton", "flexjit-reference")
BASELINE_IMPLS = ("torch-flex-triton", "torch-flex-flash", "fa4", "fa4-bhsd", "cudnn")
DEFAULT_IMPLS = FLEXJIT_IMPLS + BASELINE_IMPLS
# flexjit's switches, measured beside the default in one run:
# name -> (backend, kernel_options, deterministic).
FLEXJIT_MODES = {
    "flexjit-cute-det": ("cute", {}, True),
    "flexjit-cute-pertile": ("cute", {"PERSISTENT": False}, False),
    "flexjit-cute-persistent": ("cute", {"PERSISTENT": True}, False),
    "flexjit-cute-m128": ("cute", {"TILE_M": 128}, False),
    "flexjit-cute-m192": ("cute", {"TILE_M": 192}, False),
    "flexjit-cute-m192-pertile": ("cute", {"TILE_M": 192, "PERSISTENT": False}, False),
    # the sm90 backward's schedule variants (kernel_options BWD_CONFIG); "table": the tile
    # table's row pinned (the tuner measures none of the others: a fixed baseline for an A/B)
    "flexjit-cute-bwd-table": ("cute", {"BWD_CONFIG": ""}, False),
    **{f"flexjit-cute-bwd-{name}": ("cute", {"BWD_CONFIG": name}, False) for name in (
        "late", "dksmem", "late+dksmem", "shuffle", "late+dksmem+shuffle", "swapdq",
        "late+dksmem+swapdq", "psmem+dksmem", "psmem+dksmem+shuffle", "m80+late+dksmem+shuffle",
        "m128+psmem+dksmem+shuffle", "lpt", "lpt2", "qsplit", "sdpdup", "qhead", "qhead+lpt",
        "qhead+lpt2", "keys96", "dvafter", "m128+shuffle+dvafter", "m80+late+dksmem+shuffle+dvafter",
        "m128", "m128+dvafter", "m128+shuffle+late+dvafter+dpafter",
        "m128+psmem+dksmem+shuffle+dpafter", "m128+shuffle+dvafter+lpt",
        "m128+shuffle+dvafter+lpt2")},
}
# FP8 inputs: name -> (backend, pre). ``pre(fp8_set) -> (q8, k8, v8, kwargs)`` runs outside the
# timed region on each input set (None: the plain user call, flexjit's per-call preparation
# timed with it). A mode that hands flexjit that preparation pre-made (once a kernel exposes a
# way) is one more entry here with its ``pre``.
FLEXJIT_FP8_MODES = {
    "flexjit-cute-fp8": ("cute", None),
    "flexjit-triton-fp8": ("triton", None),
    "flexjit-reference-fp8": ("reference", None),
}
FP8_BASELINES = ("sdpa-fp8", "torch-flex-triton-fp8", "fa4-fp8")
FP8_IMPLS = tuple(FLEXJIT_FP8_MODES) + FP8_BASELINES
EXTRA_IMPLS = ("torch-flex-eager", "fa4-nopack") + tuple(FLEXJIT_MODES) + FP8_IMPLS

# Generous enough for every (variant, shape, pass) of one process: at torch's default of 8,
# FlexAttention silently falls back to its unfused eager path after 8 recompiles.
DYNAMO_LIMIT = 4096


class Skip(Exception):
    """The implementation cannot run this case here; the message says why."""


def raise_dynamo_limits() -> None:
    """Lift dynamo's recompile limits and make hitting one an error, never a silent fallback."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, DYNAMO_LIMIT)
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 8 * DYNAMO_LIMIT)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True


def _import(module: str):
    try:
        return importlib.import_module(module)
    except Exception as e:  # a broken install raises more than ImportError
        raise Skip(f"`import {module}` failed: {type(e).__name__}: {e}") from None


def _need_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise Skip("needs a CUDA GPU")


def plan_mask(create_block_mask: Callable, variant: Variant, case: Case, device):
    """The variant's block mask from ``create_block_mask`` (flexjit's or torch's), or None:
    per batch where the mask reads b, broadcast over heads."""
    if variant.mask_mod is None:
        return None
    B = case.B if variant.mask_uses_batch else None
    return create_block_mask(variant.mask_mod, B, None, case.S, case.S, device=device)


class FlexjitImpl:
    layout = "bhsd"

    def __init__(self, backend: str, name: str | None = None, kernel_options: dict | None = None,
                 deterministic: bool = False):
        self.backend = backend
        self.name = name or f"flexjit-{backend}"
        self.kernel_options, self.deterministic = dict(kernel_options or {}), deterministic

    @contextlib.contextmanager
    def context(self):
        """This mode's deterministic flag, for the checked call and the whole timing loop
        (forward and backward), restored afterwards."""
        was_deterministic = torch.are_deterministic_algorithms_enabled()
        if self.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(was_deterministic, warn_only=True)

    def setup(self, variant: Variant, case: Case, device: torch.device) -> Callable:
        fj = _import("flexjit")
        for attr in ("flex_attention", "create_block_mask"):
            if not hasattr(fj, attr):
                raise Skip(f"flexjit has no `{attr}` yet")
        block_mask = plan_mask(fj.create_block_mask, variant, case, device)
        attend, score_mod, gqa, backend = fj.flex_attention, variant.score_mod, case.gqa, self.backend
        options = self.kernel_options or None

        def fn(q, k, v):
            return attend(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa,
                          backend=backend, kernel_options=options)

        return fn


class TorchFlexImpl:
    """torch's FlexAttention; compiled once per impl, recompiled by dynamo per variant and shape."""

    layout = "bhsd"

    def __init__(self, name: str, kernel_options: dict | None, compiled: bool):
        self.name, self.kernel_options, self.compiled = name, kernel_options, compiled
        self._fn = None

    def _flex(self):
        if self._fn is None:
            from torch.nn.attention.flex_attention import flex_attention

            # dynamic=False: a kernel specialised to each shape, as the users who tune do;
            # fullgraph=True: a graph break is an error, never a silent eager fallback.
            self._fn = torch.compile(flex_attention, dynamic=False, fullgraph=True) if self.compiled \
                else flex_attention
        return self._fn

    def setup(self, variant: Variant, case: Case, device: torch.device) -> Callable:
        if self.compiled:
            _need_cuda(device)
        if self.kernel_options and self.kernel_options.get("BACKEND") == "FLASH":
            _import("flash_attn.cute")
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = plan_mask(create_block_mask, variant, case, device)
        flex, score_mod, gqa = self._flex(), variant.score_mod, case.gqa
        opts = dict(self.kernel_options) if self.kernel_options else None

        def fn(q, k, v):
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa,
                        kernel_options=opts)

        return fn


class FA4Impl:
    name = "fa4"
    layout = "bshd"
    options: dict = {}  # flash_attn_func keywords beyond the variant's (a subclass's switch)

    @staticmethod
    def _function(variant: Variant, device: torch.device, extra=(), why: str = "") -> Callable:
        """FA4's flash_attn_func where it has the variant's keywords and ``extra`` ones, else
        Skip (``why`` says what their absence means). The bundle pins one FA4 version; check
        the keywords rather than trust this file."""
        _need_cuda(device)
        if variant.fa4_kwargs is None:
            raise Skip(f"FA4 has no built-in {variant.name}")
        flash_attn_func = _import("flash_attn.cute").flash_attn_func
        params = inspect.signature(flash_attn_func).parameters
        missing = [k for k in (*variant.fa4_kwargs, *extra) if k not in params]
        if missing:
            raise Skip(f"flash_attn_func takes no {missing}{why}; its signature: "
                       f"{inspect.signature(flash_attn_func)}")
        return flash_attn_func

    def setup(self, variant: Variant, case: Case, device: torch.device) -> Callable:
        flash_attn_func = self._function(variant, device, extra=tuple(self.options))
        kwargs = dict(variant.fa4_kwargs, **self.options)

        def fn(q, k, v):
            out = flash_attn_func(q, k, v, **kwargs)
            return out[0] if isinstance(out, tuple) else out  # (out, lse) in 4.0

        return fn


class FA4BhsdImpl(FA4Impl):
    """FA4 on head-major memory: [B, H, S, D] tensors passed as their [B, S, H, D] views (FA4
    reads strides through TMA), which is how torch Flex's FLASH backend calls it. torch-flex-flash
    once ran faster than fa4 on contiguous [B, S, H, D] with the same FA4 kernel configuration;
    this impl measures whether the layout is the difference."""

    name = "fa4-bhsd"
    layout = "bhsd"

    def setup(self, variant: Variant, case: Case, device: torch.device) -> Callable:
        inner = super().setup(variant, case, device)

        def fn(q, k, v):
            return inner(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

        return fn


class FA4NoPackImpl(FA4Impl):
    """FA4 with its GQA packing off: the g query heads of a kv head no longer share a tile's
    rows (and its K/V loads). Beside fa4 under GQA, what packing is worth to FA4."""

    name = "fa4-nopack"
    options = {"pack_gqa": False}


class CudnnImpl:
    name = "cudnn"
    layout = "bhsd"

    def setup(self, variant: Variant, case: Case, device: torch.device) -> Callable:
        _need_cuda(device)
        if variant.sdpa_kwargs is None:
            raise Skip(f"SDPA has no built-in {variant.name}")
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        kwargs, gqa = dict(variant.sdpa_kwargs), case.gqa

        def fn(q, k, v):
            # Only cuDNN is allowed: where it cannot run the case, SDPA raises instead of
            # quietly timing another backend.
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(q, k, v, enable_gqa=gqa, **kwargs)

        return fn


class Fp8Inputs:
    """The FP8 half of an FP8 adapter: ``prepare(sets)`` quantises each bf16 input set once,
    outside the timed region; ``lookup(q)`` finds set q's quantised values (a dict lookup in the
    timed call). ``pre``: (fp8_set) -> (q8, k8, v8, extra keyword arguments), run in prepare."""

    fp8 = True
    pre = None

    def prepare(self, sets: list[dict]) -> None:
        self._by_q = {}
        for s in sets:
            f = fp8_set(s)
            q8, k8, v8, extra = self.pre(f) if self.pre else (f["q8"], f["k8"], f["v8"], {})
            self._by_q[id(s["q"])] = (s["q"], f, q8, k8, v8, extra)  # holds q: its id stays its own

    def lookup(self, q: torch.Tensor):
        """(fp8_set, q8, k8, v8, extra kwargs) of the set whose bf16 query is ``q``."""
        hit = getattr(self, "_by_q", {}).get(id(q))
        if hit is None or hit[0] is not q:
            raise RuntimeError(f"{self.name}: inputs not prepared (the harness calls prepare(sets) "
                               "before the first call)")
        return hit[1:]


class FlexjitFp8Impl(Fp8Inputs, FlexjitImpl):
    """flexjit.flex_attention on e4m3 q, k, v with (B, Hkv) float32 descales, bf16 out."""

    def __init__(self, name: str, backend: str, pre=None):
        super().__init__(backend, name)
        self.pre = pre

    def setup(self, variant: Variant, case: Case, device: torch.device) -> Callable:
        fj = _import("flexjit")
        block_mask = plan_mask(fj.create_block_mask, variant, case, device)
        attend, score_mod, gqa, backend = fj.flex_attention, variant.score_mod, case.gqa, self.backend
        lookup = self.lookup

        def fn(q, k, v):
            f, q8, k8, v8, extra = lookup(q)
            return attend(q8, k8, v8, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa,
                          backend=backend, q_descale=f["q_descale"], k_descale=f["k_descale"],
                          v_descale=f["v_descale"], out_dtype=torch.bfloat16, **extra)

        return fn


class SdpaFp8Impl(Fp8Inputs):
    """torch's experimental FP8 SDPA (FlashAttention-3's FP8 forward where torch has FA3
    activated; otherwise it raises, and the row records why)."""

    name = "sdpa-fp8"
    layout = "bhsd"

    def setup(self, variant: Variant, case: Case, device: torch.device) -> Callable:
        _need_cuda(device)
        if variant.sdpa_kwargs is None:
            raise Skip(f"SDPA has no built-in {variant.name}")
        quantized = getattr(_import("torch.nn.attention.experimental._scaled_dot_product_attention_quantized"),
                            "_scaled_dot_product_attention_quantized", None)
        if quantized is None:
            raise Skip(f"torch {torch.__version__} has no _scaled_dot_product_attention_quantized")
        is_causal, lookup = bool(variant.sdpa_kwargs.get("is_causal")), self.lookup

        def fn(q, k, v):
            f, q8, k8, v8, _ = lookup(q)
            return quantized(q8, k8, v8, is_causal=is_causal, q_descale=f["q_descale"],
                             k_descale=f["k_descale"], v_descale=f["v_descale"])

        return fn


class TorchFlexFp8Impl(Fp8Inputs, TorchFlexImpl):
    """torch's compiled flex_attention on e4m3 inputs. It takes no descales: q's and k's are
    folded into a score_mod (score × q_descale × k_descale of the query's kv head, before the
    variant's own score_mod) and v's multiplies the output, both inside the timed call."""

    def __init__(self):
        TorchFlexImpl.__init__(self, "torch-flex-triton-fp8", None, compiled=True)

    def setup(self, variant: Variant, case: Case, device: torch.device) -> Callable:
        _need_cuda(device)
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = plan_mask(create_block_mask, variant, case, device)
        flex, inner, gqa, group, lookup = self._flex(), variant.score_mod, case.gqa, case.Hq // case.Hkv, self.lookup
        mods: dict = {}  # one score_mod per input set, made on its first call (no recompiles after)

        def score_mod_of(f: dict):
            qk = f["q_descale"] * f["k_descale"]

            def descaled(score, b, h, q_idx, kv_idx):
                score = score * qk[b, h // group]
                return score if inner is None else inner(score, b, h, q_idx, kv_idx)
            return descaled, f["v_descale"].repeat_interleave(group, 1)[:, :, None, None]

        def fn(q, k, v):
            f, q8, k8, v8, _ = lookup(q)
            if id(f) not in mods:
                mods[id(f)] = score_mod_of(f)
            descaled, vd = mods[id(f)]
            out = flex(q8, k8, v8, score_mod=descaled, block_mask=block_mask, enable_gqa=gqa)
            return (out.float() * vd).to(torch.bfloat16)

        return fn


class FA4Fp8Impl(Fp8Inputs, FA4Impl):
    """FA4's flash_attn_func on e4m3 q, k, v ([B, S, H, D] copies made in prepare, outside the
    timed region), where its signature has FA3's descale keywords; out back as a view."""

    name = "fa4-fp8"
    layout = "bhsd"  # the sets it is given; its own [B, S, H, D] copies come from ``pre``
    DESCALES = ("q_descale", "k_descale", "v_descale")

    def pre(self, f: dict):
        return (*(f[n].transpose(1, 2).contiguous() for n in ("q8", "k8", "v8")), {})

    def setup(self, variant: Variant, case: Case, device: torch.device) -> Callable:
        flash_attn_func = self._function(variant, device, self.DESCALES,
                                         ": no FP8 forward with descales in this FA4")
        kwargs, lookup = dict(variant.fa4_kwargs), self.lookup

        def fn(q, k, v):
            f, q8, k8, v8, _ = lookup(q)
            out = flash_attn_func(q8, k8, v8, q_descale=f["q_descale"], k_descale=f["k_descale"],
                                  v_descale=f["v_descale"], **kwargs)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

        return fn


def make(name: str):
    """The adapter for an impl name (see the module table)."""
    if name in FLEXJIT_IMPLS:
        return FlexjitImpl(name.removeprefix("flexjit-"))
    if name in FLEXJIT_MODES:
        backend, options, deterministic = FLEXJIT_MODES[name]
        return FlexjitImpl(backend, name, options, deterministic)
    if name in FLEXJIT_FP8_MODES:
        backend, pre = FLEXJIT_FP8_MODES[name]
        return FlexjitFp8Impl(name, backend, pre)
    table = {
        "torch-flex-triton": lambda: TorchFlexImpl(name, None, compiled=True),
        "torch-flex-flash": lambda: TorchFlexImpl(name, {"BACKEND": "FLASH"}, compiled=True),
        "torch-flex-eager": lambda: TorchFlexImpl(name, None, compiled=False),
        "fa4": FA4Impl,
        "fa4-bhsd": FA4BhsdImpl,
        "fa4-nopack": FA4NoPackImpl,
        "cudnn": CudnnImpl,
        "sdpa-fp8": SdpaFp8Impl,
        "torch-flex-triton-fp8": TorchFlexFp8Impl,
        "fa4-fp8": FA4Fp8Impl,
    }
    if name not in table:
        raise ValueError(f"unknown impl {name!r}; known: {', '.join(DEFAULT_IMPLS + EXTRA_IMPLS)}")
    return table[name]()
