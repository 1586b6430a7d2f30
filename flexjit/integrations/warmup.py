"""Warm-up: compile, in parallel and before the first step, every CuTe kernel some calls need.

    flexjit.warmup([flexjit.WarmupCall(B=2, H=16, S=4096, D=128, score_mod=alibi,
                                       mask_mod=causal, requires_grad=True)])
    flexjit.warmup_model(model, seq_lens=[4096], batch=2)   # after import flexjit.integrations.transformers

Each call becomes the jobs its kernels need (the sm90 forward, on every configuration the tuner
would measure, ``runtime.autotune``, so a warmed process tunes on its first call; with
``requires_grad`` the backward's kernels too, likewise), built as ``flexjit compile`` builds them:
the call's Program traced on CPU tensors without data, the block mask planned at its length
(which picks the forward's tiling), and the jobs run on ``runtime.compile_pool``'s workers, all
at once, each exporting its kernels under the keys the run looks up. A later process (or this
one) with the same cache folder loads them in milliseconds. No GPU is needed: the workers
compile for sm_90a on the CPU, as ``flexjit compile`` does. With the disk cache off the jobs
run here, one after another, and only this process keeps the kernels.

Progress goes to a tqdm bar when tqdm is installed and stderr is a terminal, else to one
rewritten stderr line on a terminal; each job is logged (logger "flexjit").
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import sys
import time
from typing import Callable, Iterable

import torch

from flexjit.api.attention import autocast_dtype, prepare_call
from flexjit.api.masks import create_block_mask
from flexjit.backends.cute import sm90 as cute_sm90
from flexjit.planner.block_mask import BlockMask, noop_mask
from flexjit.runtime import autotune, compile_pool

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None

log = logging.getLogger("flexjit")


@dataclasses.dataclass(frozen=True)
class WarmupCall:
    """A flex_attention call described without tensors: (B, H, S, D) query, (B, Hkv, S, Dv)
    key/value of ``dtype``, the mods, and whether it trains. ``block_mask``: the call's own (a
    CPU BlockMask over S), where it is not the one ``mask_mod`` plans broadcast over batch and
    heads. ``kernel_options``: the call's (``PERSISTENT`` pins the forward's schedule)."""
    B: int
    H: int
    S: int
    D: int
    dtype: torch.dtype = torch.bfloat16
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    Hkv: int | None = None
    Dv: int | None = None
    requires_grad: bool = False
    block_mask: BlockMask | None = None
    kernel_options: dict | None = None

    @classmethod
    def like(cls, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             score_mod: Callable | None = None, block_mask: BlockMask | None = None,
             kernel_options: dict | None = None) -> "WarmupCall":
        """The call ``flex_attention(query, key, value, score_mod, block_mask)`` makes; the
        tensors give only their shapes, dtype (as autocast hands it to the call: Gemma 2's
        rotary embedding leaves q and k in float32 under a bfloat16 autocast) and
        requires_grad."""
        B, H, S, D = query.shape
        if block_mask is not None and block_mask.kv_num_blocks.device.type != "cpu":
            block_mask = block_mask.to("cpu")
        return cls(B, H, S, D, autocast_dtype(query), score_mod, None, key.shape[1], value.shape[-1],
                   any(t.requires_grad for t in (query, key, value)), block_mask,
                   kernel_options)


@dataclasses.dataclass
class WarmupSummary:
    """What ``warmup`` did: kernels compiled, kernels found cached (on disk, or already in this
    process), seconds, and the calls (or their backward) that no sm90 kernel serves, with why."""
    compiled: int = 0
    cached: int = 0
    seconds: float = 0.0
    skipped: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        return (f"flexjit warmup: {self.compiled} kernels compiled, {self.cached} cached, "
                f"{len(self.skipped)} calls skipped, in {self.seconds:.1f} s")


def jobs(call: WarmupCall, backward: bool | None = None,
         candidates: bool = False) -> tuple[list[compile_pool.Job], str]:
    """The pool's jobs for ``call`` (forward first), and why none where the sm90 kernels do not
    take it. ``backward``: None follows ``call.requires_grad``. ``candidates``: also every
    other configuration the tuner would measure for each pass (``autotune.to_compile``), after
    the kernels the call runs first."""
    Hkv, Dv = call.Hkv or call.H, call.Dv or call.D
    q = torch.empty(call.B, call.H, call.S, call.D, dtype=call.dtype)
    k = torch.empty(call.B, Hkv, call.S, call.D, dtype=call.dtype)
    v = torch.empty(call.B, Hkv, call.S, Dv, dtype=call.dtype)
    bm = call.block_mask
    if bm is None and call.mask_mod is not None and call.mask_mod is not noop_mask:
        bm = create_block_mask(call.mask_mod, None, None, call.S, call.S, device="cpu")
    with torch.no_grad():
        prepared = prepare_call(q, k, v, call.score_mod, bm, None, Hkv != call.H,
                                call.kernel_options)
    if call.dtype not in (torch.float16, torch.bfloat16):
        return [], f"dtype {call.dtype}: the sm90 kernels take float16 or bfloat16"
    if (call.D, Dv) not in cute_sm90._HEAD_DIMS:
        return [], f"head dims ({call.D}, {Dv}): the sm90 forward takes {cute_sm90._HEAD_DIMS}"
    fwd = _pass_jobs(prepared, "fwd")
    out, more, why = fwd[:1], fwd[1:], ""
    wants_backward = call.requires_grad if backward is None else backward
    if wants_backward:
        ok, refusal = cute_sm90.backward_supports(prepared)
        if ok:
            bwd = _pass_jobs(prepared, "bwd")
            out.append(bwd[0])
            more += bwd[1:]
        else:
            why = f"the backward runs on Triton ({refusal})"
    return out + (more if candidates else []), why


def _pass_jobs(call, pass_: str) -> list[compile_pool.Job]:
    """The jobs of one pass of ``call``: its default configuration's first, then the other
    candidates (none where the backend declares no tuning for the pass)."""
    tuning = autotune.declared(cute_sm90, call, pass_)
    if tuning is None:
        return [compile_pool.backward_job(call)]
    configs = autotune.to_compile(cute_sm90, call, pass_)
    return list(compile_pool.candidate_jobs(call, tuning.family, configs).values())


def warmup(calls: Iterable[WarmupCall], *, backward: bool | None = None,
           progress: bool | None = None) -> WarmupSummary:
    """Compile every sm90 CuTe kernel ``calls`` need (their backward's too where they train, or
    as ``backward`` says), in parallel on the compile pool's workers; returns when all are done.
    ``progress``: None shows it on a terminal only."""
    t0 = time.perf_counter()
    summary = WarmupSummary()
    work: dict[str, compile_pool.Job] = {}
    for call in calls:
        found, why = jobs(call, backward, candidates=True)
        if why:
            summary.skipped.append(f"B={call.B} H={call.H} S={call.S} D={call.D}: {why}")
            log.info("flexjit warmup: %s", summary.skipped[-1])
        for job in found:
            work.setdefault(job.ident, job)
    sizes = {ident: 1 if job.kind == "fwd" else 3 for ident, job in work.items()}
    pending = {}
    for ident, job in work.items():
        if ident in compile_pool._PENDING and compile_pool._PENDING[ident][1].done():
            summary.cached += sizes[ident]  # done in this process already
        else:
            pending[compile_pool.submit(job)] = ident
    bar = _Progress(sum(sizes.values()), summary.cached, progress)
    for fut in cf.as_completed(pending):
        job = work[pending[fut]]
        answer = compile_pool.result(job, fut)
        summary.compiled += answer["compiled"]
        summary.cached += sizes[job.ident] - answer["compiled"]
        log.info("flexjit warmup: %s: %d compiled, %d cached, %.1f s", job.what(),
                 answer["compiled"], sizes[job.ident] - answer["compiled"], answer["seconds"])
        bar.update(sizes[job.ident])
    bar.close()
    summary.seconds = time.perf_counter() - t0
    log.info("%s", summary)
    return summary


def warmup_model(model_or_config, seq_lens: Iterable[int], batch: int = 1,
                 dtype: torch.dtype = torch.bfloat16, *, requires_grad: bool = True,
                 progress: bool | None = None) -> WarmupSummary:
    """``warmup`` for the attention calls of a transformers model (or its config) run with
    ``attn_implementation="flexjit"`` at each sequence length: one call per layer kind (full,
    sliding window), with the model's heads, head dim and softcap, through the mods
    ``flexjit.integrations.transformers`` gives those layers (import it first: it registers
    "flexjit" with transformers, and the model cannot use flexjit without it)."""
    hf = sys.modules.get("flexjit.integrations.transformers")
    if hf is None:
        raise RuntimeError("flexjit.warmup_model: import flexjit.integrations.transformers first "
                           "(it registers attn_implementation='flexjit')")
    calls = hf.warmup_calls(model_or_config, seq_lens, batch, dtype, requires_grad)
    return warmup(calls, progress=progress)


class _Progress:
    """A tqdm bar, or one stderr line rewritten in place, or nothing (not a terminal)."""

    def __init__(self, total: int, done: int, show: bool | None):
        show = sys.stderr.isatty() if show is None else show
        self.total, self.done = total, done
        self.bar = None
        self.line = show and tqdm is None
        if show and tqdm is not None:
            self.bar = tqdm(total=total, initial=done, desc="flexjit warmup", unit="kernel")
        self._draw()

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        self._draw()

    def _draw(self) -> None:
        if self.line:
            sys.stderr.write(f"\rflexjit warmup: {self.done}/{self.total} kernels")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.line:
            sys.stderr.write("\n")
