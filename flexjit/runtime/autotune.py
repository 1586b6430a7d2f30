"""Kernel configurations chosen by measurement, once per shape class.

A backend declares, per call of a tunable pass, a :class:`~flexjit.backends.base.Tuning`: the
family ("sm90-fwd"), the call's shape class, the candidate configs and its heuristic's default
(``backends/base.py`` has the contract). This module decides which candidate runs:

1. a ``kernel_options`` pin (the backend leaves the pinned candidates only; one left runs);
2. ``AUTOTUNE=False`` (``fwd_``/``bwd_`` per pass), or deterministic algorithms (the same bits
   in every call and process): the default, never measured;
3. the choice remembered in this process;
4. the choice on disk (``record_path``), written by any process on this device and toolchain;
5. a measurement, once every candidate is compiled;
6. else the default.

**Never slower to start.** A class's first call runs the default, compiled (or loaded) in the
caller as without a tuner, and sends the other candidates to ``compile_pool``'s workers in the
background, once per class. The first call that finds every candidate compiled (here, in a
worker, or by any process: its done marker) measures them on its own inputs: CUDA events, one
warm-up launch each, then up to ``MAX_ROUNDS`` rounds with the candidates interleaved (the order
rotates, so clock drift hits each alike; each round is led by an untimed launch, so that no
timed one starts on an idle GPU and counts its host work), within ``BUDGET_S`` of launches (a
huge call gets fewer rounds), the median per candidate. Where every warm-up launch takes
``ONE_LAUNCH_MS`` or more (a million tokens: seconds a launch), the warm-up launches are the
measurement: their host work and kernel loading are under 1% of them, and each further launch
would add seconds to the user's first call. Each launch writes fresh outputs,
which are dropped; the call's own outputs come from the winner, launched once more. A candidate that is not
``TIE`` faster than the default loses to it, so noise never flips a choice between runs. A
candidate whose compile failed or whose launch raises is dropped with a logged reason.

Never measured: on the CPU, while a CUDA stream captures a graph, inside
``torch.compiler.is_compiling()``, inside ``flexjit.explain`` (``selfcheck.dry_run``), with
``AUTOTUNE=False``. Without workers (``compile_pool.enabled()`` false) nothing is compiled in the
background: the default runs until ``flexjit.warmup`` has compiled the candidates here.

**The record**: ``<cache>/tuning/<family>-<hash>.json`` per (family, shape class, candidates,
device, toolchain), sealed and written atomically under its lock (``kernel_cache``'s helpers):
the candidates' median times, those that failed, the winner, the device and the date. A
damaged or foreign file is reported once (``CacheWarning``), removed and tuned again. With
``FLEXJIT_CACHE=0`` choices live in memory only. The ``flexjit`` logger says each class's choice
once (INFO); ``FLEXJIT_DEBUG=1`` prints each measurement.

The backward runs the same way (``backward``): a backend's ``backward_tuning`` declares its
candidates; each measured launch returns fresh gradient buffers (the captured tensors' fp64
accumulators included), under the autograd backward's ``no_grad``, so autograd sees one result.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import statistics
import threading
from pathlib import Path
from typing import Callable

import torch

from flexjit import config
from flexjit.backends import kernel_cache as cache
from flexjit.backends.base import Config, Tuning
from flexjit.runtime import compile_pool, selfcheck

log = logging.getLogger("flexjit")

TIE = 0.02  # a candidate must beat the default by more than this share of its time
MAX_ROUNDS = 10
BUDGET_S = 0.2  # measured launches of one class, past the warm-up
ONE_LAUNCH_MS = 1000.0  # warm-up launches this long are the samples (module doc)
FORMAT = 1  # the record's layout: another is a foreign file
_HOOKS = {"fwd": "tuning", "bwd": "backward_tuning"}


class CudaTimer:
    """Times launches with CUDA events on the current stream (tests put a fake in ``timer``)."""

    def usable(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def device_name(self, device: torch.device) -> str:
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.multi_processor_count} SMs)"

    def round(self, fns: list[Callable[[], object]], lead: bool = True) -> list[float]:
        """Run each of ``fns`` once, in order; the milliseconds each took on the GPU. With
        ``lead``, the last runs once more first, untimed, so that the GPU is busy while the host
        enqueues the first timed launch: timed from an idle GPU, a launch also counts its host
        work (0.05-0.12 ms on an 8k window call, a quarter of its kernels' time)."""
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in fns]
        if lead:
            fns[-1]()
        for fn, (start, end) in zip(fns, marks):
            start.record()
            fn()
            end.record()
        marks[-1][1].synchronize()
        return [start.elapsed_time(end) for start, end in marks]


timer = CudaTimer()


@dataclasses.dataclass
class Decision:
    """A class's configuration and why: ``how`` is "measured", "tie" (the default, within
    ``TIE`` of the fastest) or "failed" (no candidate ran); ``times`` the medians in ms by
    name, ``failed`` why each dropped candidate was; ``cached``: read from disk."""
    config: Config
    how: str
    times: dict[str, float]
    failed: dict[str, str]
    cached: bool = False

    def text(self, tuning: Tuning) -> str:
        name = str(self.config)
        others = ", ".join(f"{_ms(t)} ({n})" for n, t in sorted(self.times.items(), key=lambda x: x[1])
                           if n != name)
        if self.how == "measured":
            why = f"measured {_ms(self.times[name])}" + (f" against {others}" if others else "")
        elif self.how == "tie":
            why = (f"the heuristic's, measured {_ms(self.times[name])}, within {TIE:.0%} of "
                   f"the fastest; the others {others}")
        else:
            why = "the heuristic's; no candidate could be measured"
        if self.failed:
            why += "; dropped: " + "; ".join(f"{n} ({e})" for n, e in self.failed.items())
        return f"config {name}: {why}" + (" [cached]" if self.cached else "")


def _ms(t: float) -> str:
    return f"{t / 1e3:.3g} s" if t >= 1e3 else f"{t:.3g} ms"  # not "1.4e+03 ms"


@dataclasses.dataclass
class _Class:
    """A shape class not yet decided: its candidates' compile jobs, those run here, those
    failed, whether the background jobs went out."""
    jobs: dict
    ran: set = dataclasses.field(default_factory=set)
    failed: dict = dataclasses.field(default_factory=dict)
    submitted: bool = False


_CHOICES: dict[tuple, Decision] = {}  # Tuning.ident -> the decision
_CLASSES: dict[tuple, _Class] = {}
_RAN: set[str] = set()  # Job.ident of each kernel a call compiled or loaded in this process
_LOCK = threading.RLock()
_MISSING = object()


def clear() -> None:
    """Forget every decision and class in memory (a new process, as tests simulate it)."""
    with _LOCK:
        _CHOICES.clear()
        _CLASSES.clear()
        _RAN.clear()
        _PATHS.clear()


def undecided() -> frozenset:
    """The shape classes that a later call of this process will decide (``Tuning.ident``s):
    every candidate compiled, or compiling in the background. Not the classes that wait for
    ``flexjit.warmup`` (no workers, or no compile jobs for the family): they run the default
    until then. A benchmark calls again until the classes its first call opened are gone, so
    that it times the configuration users run once tuning has settled."""
    with _LOCK:
        return frozenset(ident for ident, state in _CLASSES.items() if _progressing(state))


def _progressing(state: _Class) -> bool:
    if not state.jobs:
        return False
    for c, job in state.jobs.items():
        if c in state.failed or _ready(state, c):
            continue
        answer = compile_pool.state(job)
        if answer == compile_pool.MISSING:  # never queued: nothing compiles it
            return False
    return True


# --------------------------------------------------------------------------- entry points


def declared(mod, call, pass_: str) -> Tuning | None:
    """Backend ``mod``'s Tuning for ``call``'s pass ("fwd" or "bwd"), None where it declares
    none; kept in the call's memo (its signature fixes everything a declaration reads)."""
    hook = getattr(mod, _HOOKS[pass_], None)
    if hook is None:
        return None
    memo_key = ("tuning", pass_)
    hit = call.memo.get(memo_key, _MISSING)
    if hit is _MISSING:
        hit = call.memo[memo_key] = hook(call)
    return hit


def forward(mod, call) -> tuple:
    """``mod.forward(call)`` on the configuration chosen for it."""
    return run(mod, call, "fwd", lambda c: mod.forward(call) if c is None else mod.forward(call, c))


def backward(mod, call, *args) -> tuple:
    """``mod.backward(call, q, k, v, out, lse, dout, dlse)`` on the configuration chosen."""
    return run(mod, call, "bwd", lambda c: mod.backward(call, *args) if c is None
               else mod.backward(call, *args, config=c))


def run(mod, call, pass_: str, launch: Callable[[Config | None], object]):
    """``launch(config)`` on the configuration the decision order picks for ``call``'s pass;
    ``launch(None)`` (the backend's heuristic) where the backend declares nothing or the
    default is picked. May measure first (module doc)."""
    tuning = declared(mod, call, pass_)
    if tuning is None or len(tuning.candidates) == 1 or not _autotune_on(call.kernel_options, pass_):
        return launch(None)  # nothing to decide: a pin's single candidate, or AUTOTUNE=False

    def go(c: Config):
        return launch(None if c == tuning.default else c)
    hit = _CHOICES.get(tuning.ident)
    if hit is not None:
        return go(hit.config)
    chosen = _choose(tuning, call, go)
    out = go(chosen)
    state = _CLASSES.get(tuning.ident)
    if state is not None and chosen not in state.ran:
        state.ran.add(chosen)
        if chosen in state.jobs:
            _RAN.add(state.jobs[chosen].ident)
    return out


def to_compile(mod, call, pass_: str) -> tuple[Config, ...]:
    """The configurations a warmed process needs for ``call``'s pass, the default first: every
    candidate, or only the default under ``AUTOTUNE=False``; () where none is declared."""
    tuning = declared(mod, call, pass_)
    if tuning is None:
        return ()
    if not _autotune_on(call.kernel_options, pass_):
        return (tuning.default,)
    return (tuning.default,) + tuple(c for c in tuning.candidates if c != tuning.default)


def describe(mod, call, pass_: str) -> str:
    """Which configuration ``call``'s pass runs on and why, for ``flexjit.explain``; "" where
    the backend declares none. Measures and compiles nothing."""
    tuning = declared(mod, call, pass_)
    if tuning is None:
        return ""
    name = str(tuning.default)
    if len(tuning.candidates) == 1:
        return f"config {name}: " + (f"pinned by {tuning.pins}" if tuning.pins
                                     else "the only candidate for this shape")
    if not _autotune_on(call.kernel_options, pass_):
        why = ("deterministic algorithms" if torch.are_deterministic_algorithms_enabled()
               else "AUTOTUNE=False")
        return f"config {name}: the heuristic's ({why})"
    hit = _CHOICES.get(tuning.ident)
    if hit is None and timer.usable(call.q.device):
        hit = _read(tuning, call.q.device, heal=False)
    if hit is not None:
        return hit.text(tuning)
    if not timer.usable(call.q.device):
        return f"config {name}: heuristic (not measured on {call.q.device.type})"
    state = _CLASSES.get(tuning.ident)
    ready = sum(_ready(state, c) for c in tuning.candidates) if state is not None else 0
    return (f"config {name}: heuristic ({len(tuning.candidates)} candidates, {ready} compiled; "
            "measured once all are compiled)")


# --------------------------------------------------------------------------- deciding


def _autotune_on(options: dict, pass_: str) -> bool:
    """Whether the tuner may choose: ``AUTOTUNE`` (per pass) and not deterministic algorithms,
    whose users expect the same bits in every call and process (candidates may sum in another
    order, and a choice depends on the cache a process finds)."""
    if torch.are_deterministic_algorithms_enabled():
        return False
    return bool(options.get(f"{pass_}_AUTOTUNE", options.get("AUTOTUNE", True)))


def _capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except (RuntimeError, AssertionError):  # no CUDA in this build
        return False


def _choose(tuning: Tuning, call, launch) -> Config:
    """Steps 3-6 of the module doc (memory again, under the lock) for a class with candidates
    to choose among."""
    device = call.q.device
    if selfcheck.dry() or not timer.usable(device):
        return tuning.default
    with _LOCK:
        hit = _CHOICES.get(tuning.ident)
        if hit is None:
            hit = _read(tuning, device, heal=True)
            if hit is not None:
                _remember(tuning, hit)
        if hit is not None:
            return hit.config
        if _capturing() or torch.compiler.is_compiling():
            return tuning.default
        state = _CLASSES.get(tuning.ident)
        if state is None:
            state = _CLASSES[tuning.ident] = _Class(_jobs(tuning, call))
        _drop_failed(state, tuning)
        waiting = [c for c in tuning.candidates if c not in state.failed and not _ready(state, c)]
        if waiting:
            if not state.submitted:  # the running one compiles in the caller
                state.submitted = True
                for c in waiting:
                    if c != tuning.default and c in state.jobs:
                        compile_pool.background(state.jobs[c])
            return tuning.default
        decision = _measure(tuning, state, launch)
        _remember(tuning, decision)
        if decision.how != "failed":
            _write(tuning, device, decision)
        _RAN.update(job.ident for c, job in state.jobs.items() if str(c) in decision.times)
        del _CLASSES[tuning.ident]
        return decision.config


def _jobs(tuning: Tuning, call) -> dict:
    """The candidates' compile jobs ({} where they cannot be made: then only what runs here
    becomes ready, and the default keeps running)."""
    try:
        return compile_pool.candidate_jobs(call, tuning.family, tuning.candidates)
    except Exception as e:  # noqa: BLE001 -- tuning must never fail the call
        log.warning("flexjit: tuning %s: no compile jobs for the candidates (%s: %s); the "
                    "heuristic's configuration runs", tuning.family, type(e).__name__, e)
        return {}


def _ready(state: _Class, c: Config) -> bool:
    """Whether candidate ``c`` is compiled: run here, or its compile job done (any process)."""
    if c in state.ran:
        return True
    job = state.jobs.get(c)
    return job is not None and (job.ident in _RAN or compile_pool.state(job) == compile_pool.READY)


def _drop_failed(state: _Class, tuning: Tuning) -> None:
    for c, job in state.jobs.items():
        if c in state.failed or c in state.ran or job.ident in _RAN:
            continue
        answer = compile_pool.state(job)
        if answer not in (compile_pool.READY, compile_pool.PENDING, compile_pool.MISSING):
            state.failed[c] = f"compile failed: {answer}"
            log.warning("flexjit: tuning %s: candidate %s dropped (%s)", tuning.family, c,
                        state.failed[c])


def _remember(tuning: Tuning, decision: Decision) -> None:
    """Keep the class's decision for this process, and say it once (INFO)."""
    _CHOICES[tuning.ident] = decision
    log.info("flexjit: tuning %s [%s]: %s", tuning.family, _shape(tuning), decision.text(tuning))


def _shape(tuning: Tuning) -> str:
    """The shape class to show: its key less the Program's digest."""
    return " ".join(k for k in tuning.key if not k.startswith("program="))


def _measure(tuning: Tuning, state: _Class, launch) -> Decision:
    """Time the candidates on this call (module doc); the decision, with the tie rule."""
    failed = {str(c): why for c, why in state.failed.items()}
    alive = [c for c in tuning.candidates if c not in state.failed]

    def attempt(c):
        def fn():
            try:
                launch(c)
            except Exception as e:  # noqa: BLE001 -- a candidate may fail; the call must not
                errors[c] = f"{type(e).__name__}: {e}"
        return fn

    def prune():
        for c, why in errors.items():
            if c in alive:
                alive.remove(c)
                failed[str(c)] = why
                log.warning("flexjit: tuning %s: candidate %s dropped (%s)", tuning.family, c, why)
        errors.clear()

    errors: dict = {}
    warm = {}
    for c in list(alive):  # warm-up: loads each kernel, and finds the ones that raise
        (warm[c],) = timer.round([attempt(c)], lead=False)
    prune()
    samples: dict[Config, list[float]] = {c: [] for c in alive}
    rounds, r = 1, 0
    if alive and min(warm[c] for c in alive) >= ONE_LAUNCH_MS:
        samples, rounds = {c: [warm[c]] for c in alive}, 0
    while r < rounds and alive:
        order = alive[r % len(alive):] + alive[:r % len(alive)]
        for c, t in zip(order, timer.round([attempt(c) for c in order])):
            samples[c].append(t)
        prune()
        if r == 0 and alive:  # the budget, from the first round's cost
            cost = sum(samples[c][0] for c in alive) / 1e3
            rounds = max(1, min(MAX_ROUNDS, int(BUDGET_S / max(cost, 1e-9))))
        r += 1
    if not alive:
        return Decision(tuning.default, "failed", {}, failed)
    times = {str(c): statistics.median(samples[c]) for c in alive}
    if config.settings.debug:
        print(f"[flexjit] tuning {tuning.family} [{_shape(tuning)}], "
              f"{f'{r} rounds' if rounds else 'the warm-up launches'}: " +
              ", ".join(f"{c}: {' '.join(f'{t:.3f}' for t in samples[c])} ms" for c in alive))
    best = min(alive, key=lambda c: times[str(c)])
    if tuning.default in alive and best != tuning.default and \
            times[str(tuning.default)] <= times[str(best)] * (1 + TIE):
        return Decision(tuning.default, "tie", times, failed)
    return Decision(best, "measured", times, failed)


# --------------------------------------------------------------------------- records


_PATHS: dict[tuple, tuple[str, Path]] = {}  # (ident, device, settings) -> (device name, path)


def record_path(tuning: Tuning, device_name: str) -> Path:
    """The class's record: one file per (family, shape class, candidates, device, toolchain)."""
    key = cache.kernel_key("", f"tuning {tuning.family}", tuning.ident, device_name)
    return cache.cache_dir("tuning") / f"{tuning.family}-{key}.json"


def _where(tuning: Tuning, device) -> tuple[str, Path]:
    """(device name, record path), worked out once per class, device and cache folder."""
    memo = (tuning.ident, str(device), config.settings.generation)
    hit = _PATHS.get(memo)
    if hit is None:
        name = timer.device_name(device)
        hit = _PATHS[memo] = (name, record_path(tuning, name))
    return hit


def _read(tuning: Tuning, device, heal: bool) -> Decision | None:
    """The decision on disk, or None (absent, cache off; a bad file reported and removed
    where ``heal``)."""
    if not cache.enabled():
        return None
    name, path = _where(tuning, device)
    if not os.path.lexists(path):
        return None
    try:
        with cache.locked(path, exclusive=heal):
            state = cache.verify(path, tuning.family)
            decision = None
            if state == cache.OK:
                decision, state = _parse(path.read_text(), tuning, name)
            if decision is None and heal and state != cache.ABSENT:
                cache.report_bad(path, state)
                cache.discard(path)
            return decision
    except (OSError, TimeoutError) as e:
        log.warning("flexjit: tuning record %s skipped: %s", path, e)
        return None


def _parse(text: str, tuning: Tuning, device_name: str) -> tuple[Decision | None, str]:
    """(the decision, "ok") from a record's text, or (None, why it does not belong here)."""
    try:
        rec = json.loads(text)
        expect = {"format": FORMAT, "family": tuning.family, "key": list(tuning.key),
                  "candidates": [str(c) for c in tuning.candidates], "device": device_name,
                  "toolchain": cache.toolchain_fingerprint()}
        wrong = [k for k, v in expect.items() if rec.get(k) != v]
        if wrong:
            return None, f"its {', '.join(wrong)} differ from this class's"
        by_name = {str(c): c for c in tuning.candidates}
        times = {str(n): float(t) for n, t in rec["times_ms"].items()}
        if rec["winner"] not in times or rec["how"] not in ("measured", "tie") or \
                not set(times) <= set(by_name) or not all(math.isfinite(t) for t in times.values()):
            return None, "its winner or times are not this class's candidates"
        failed = {str(n): str(why) for n, why in rec.get("failed", {}).items()}
        return Decision(by_name[rec["winner"]], rec["how"], times, failed, cached=True), cache.OK
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"unreadable ({type(e).__name__}: {e})"


def _write(tuning: Tuning, device, decision: Decision) -> None:
    """Store the decision for later processes (nothing with the disk cache off)."""
    if not cache.enabled():
        return
    name, path = _where(tuning, device)
    rec = {"format": FORMAT, "family": tuning.family, "key": list(tuning.key),
           "candidates": [str(c) for c in tuning.candidates], "default": str(tuning.default),
           "winner": str(decision.config), "how": decision.how, "times_ms": decision.times,
           "failed": decision.failed, "device": name, "toolchain": cache.toolchain_fingerprint(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        with cache.locked(path):
            cache.atomic_write(path, json.dumps(rec, indent=1))
            cache.seal(path, tuning.family)
    except (OSError, TimeoutError) as e:
        log.warning("flexjit: tuning record %s not written (%s); the choice holds for this "
                    "process", path, e)
