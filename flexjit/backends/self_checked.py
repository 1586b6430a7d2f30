"""Verdicts of first-use self-checks: which never-run kernels may answer calls.

A backend whose kernels have never run on their hardware (the sm100 kernels) sets
``SELF_CHECKED = True`` and offers ``self_check(call, part) -> Pending``. Before dispatch admits
such a backend for a call, ``runtime.selfcheck`` runs the pending check (a small case of the same
compiled kernel against the reference) and records the verdict here, per compiled kernel. The
backend's own ``forward``/``backward`` refuse a kernel without a passing verdict (``require``),
so a direct call is gated too.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import torch

NOT_RUN = ("first-use self-check not yet run (it runs on this kernel's first call, before any "
           "answer is used)")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A self-check's answer: ``passed`` and a one-line ``summary`` (each output's max abs
    error against its tolerance; where the worst error is when one exceeds it)."""
    passed: bool
    summary: str


@dataclasses.dataclass(frozen=True)
class Pending:
    """What a self-check of one call's kernel needs: the compiled kernel's ``key``, the
    ``variant`` of calls the check covers (runtime values its case copies from the call: the
    GQA ratio, the memory layout), a description, and ``run``: the kernel on a small case
    (forward: ``run(small) -> (out, lse, max_scores)``; backward: the backend's ``backward``)."""
    key: object
    variant: tuple
    what: str
    run: Callable


_FAILED: dict = {}  # kernel key -> Outcome: disabled for the process
_PASSED: dict = {}  # (kernel key, variant) -> Outcome
_LOCK = threading.Lock()
# Bumped whenever a verdict is recorded or a check deferred (dry run, graph capture): the call
# cache keys on it, so a backend choice made before a kernel passed, failed or could be checked
# is made again (a cached choice of a kernel since disabled would raise in its forward).
_EPOCH = [0]


def epoch() -> int:
    return _EPOCH[0]


def outcome(key, variant=()) -> Outcome | None:
    """The verdict on compiled kernel ``key`` for calls of ``variant``: its failure (any
    variant's: the kernel is disabled), else its pass for that variant, else None (not run)."""
    return _FAILED.get(key) or _PASSED.get((key, variant))


def record(key, variant, result: Outcome | None) -> None:
    """Keep ``result`` for (key, variant): a pass for that variant, a failure for the kernel.
    ``None`` records only that a check was deferred."""
    with _LOCK:
        if result is not None:
            if result.passed:
                _PASSED[(key, variant)] = result
            else:
                _FAILED[key] = result
        _EPOCH[0] += 1


def results() -> dict:
    """{(key, variant or None for a failure): Outcome} of every self-check run in this process."""
    return {**{(k, None): o for k, o in _FAILED.items()}, **_PASSED}


def forget() -> None:
    """Drop every verdict: kernels are checked again on their next call. For tests."""
    with _LOCK:
        _FAILED.clear()
        _PASSED.clear()
        _EPOCH[0] += 1


def require(pending: Pending) -> None:
    """Raise unless the pending check's kernel has passed on this variant."""
    res = outcome(pending.key, pending.variant)
    if res is None or not res.passed:
        why = "it has not run" if res is None else res.summary
        raise RuntimeError(f"flexjit: {pending.what} may not run before it has passed its "
                           f"first-use self-check on this GPU ({why})")


def layout(t: torch.Tensor) -> tuple[int, ...]:
    """The order of ``t``'s dims in memory, outermost first (what a self-check's case copies)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))
