"""The tuner (``flexjit.runtime.autotune``), on the CPU: every decision path, with a fake backend,
a fake timer and a fake compile pool.

The fake backend declares three candidates of the sm90 forward's shape (tile rows, schedule);
each launch records which configuration ran and returns an output filled with that
configuration's number, so a test sees which one produced the call's answer. The fake timer
"times" a launch by the configuration it ran (``TIMES``, in ms), and records every round's order.
The fake pool says which candidates are compiled and records the background jobs sent.

Checked: the order pin → AUTOTUNE=False → memory → disk → measurement → heuristic; the jobs sent
once per class, never before its first call or after its decision; the winner, the tie rule,
dropped candidates; the record on disk (its fields, a second process that reads it instead of
measuring, a damaged or foreign one healed with one warning); never measuring while capturing,
compiling, on the CPU or inside explain; the round budget, the interleaving and a huge call decided
on its warm-up launches; explain's text;
and the backward measured on scratch gradients with autograd seeing one result.
"""
import json
import logging
import types

import pytest
import torch

from flexjit.api.attention import explain, flex_attention, prepare_call
from flexjit.backends import kernel_cache as cache, reference
from flexjit.backends.base import Config, Tuning
from flexjit.runtime import autotune, compile_pool, dispatch, selfcheck

M128, M128P, M192 = (Config.of(tile_m=128, persistent=False), Config.of(tile_m=128, persistent=True),
                     Config.of(tile_m=192, persistent=False))
TIMES = {M128: 0.66, M128P: 0.61, M192: 0.70}


class FakeBackend:
    """A backend module with a tunable forward (and backward, ``backward_tuning``)."""

    def __init__(self, times=None, default=M128, fail=(), key=("shape=a",), candidates=None,
                 pins=""):
        self.times, self.default, self.fail = dict(times or TIMES), default, set(fail)
        self.key, self.pins = key, pins
        self.candidates = tuple(candidates or self.times)
        self.launched: list[Config] = []

    def tuning(self, call):
        return Tuning("sm90-fwd", self.key, self.candidates, self.default, self.pins)

    def backward_tuning(self, call):
        return Tuning("sm90-bwd", self.key, self.candidates, self.default, self.pins)

    def forward(self, call, config=None):
        config = self.default if config is None else config
        self.launched.append(config)
        if config in self.fail:
            raise RuntimeError(f"{config} cannot launch")
        number = list(self.candidates).index(config)
        out = torch.full((*call.q.shape[:-1], call.v.shape[-1]), float(number))
        return out, torch.zeros(call.q.shape[:-1]), None

    def backward(self, call, q, k, v, out, lse, dout, dlse, config=None):
        config = self.default if config is None else config
        self.launched.append(config)
        return reference.backward(call, q, k, v, out, lse, dout, dlse)


class FakeTimer:
    """Times each launch by the configuration the backend ran (``backend.times``)."""

    def __init__(self, backend):
        self.backend, self.rounds, self.leads = backend, [], []

    def usable(self, device):
        return True

    def device_name(self, device):
        return "Fake GPU (132 SMs)"

    def round(self, fns, lead=True):
        times, order = [], []
        self.leads.append(lead)
        for fn in fns:
            fn()
            ran = self.backend.launched[-1]
            order.append(ran)
            times.append(self.backend.times[ran])
        self.rounds.append(order)
        return times


class FakePool:
    """compile_pool's view of the candidates' jobs: their states, and the jobs sent."""

    def __init__(self):
        self.states: dict[str, str] = {}
        self.sent: list[str] = []

    def candidate_jobs(self, call, family, configs):
        jobs = {c: types.SimpleNamespace(ident=f"{family}:{c}") for c in configs}
        for job in jobs.values():
            self.states.setdefault(job.ident, compile_pool.MISSING)
        return jobs

    def state(self, job):
        return self.states.get(job.ident, compile_pool.MISSING)

    def background(self, job):
        self.sent.append(job.ident)
        self.states[job.ident] = compile_pool.PENDING
        return True

    def finish(self, *idents):
        """Mark these jobs (default: every job built so far) compiled."""
        for ident in idents or list(self.states):
            self.states[ident] = compile_pool.READY


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fresh process's tuner on its own cache folder, the fake backend, timer and pool."""
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    backend, pool = FakeBackend(), FakePool()
    tmr = FakeTimer(backend)
    monkeypatch.setattr(autotune, "timer", tmr)
    for name in ("candidate_jobs", "state", "background"):
        monkeypatch.setattr(compile_pool, name, getattr(pool, name))
    autotune.clear()
    yield types.SimpleNamespace(backend=backend, timer=tmr, pool=pool, cache=tmp_path / "cache")
    autotune.clear()


def _call(options=None, grad=False):
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=grad) for _ in range(3))
    return prepare_call(q, k, v, None, None, None, False, options)


def _run(env, options=None) -> float:
    """One forward of the fake backend through the tuner; the number of the config that answered."""
    out, _, _ = autotune.forward(env.backend, _call(options))
    return out.flatten()[0].item()


def _number(config) -> float:
    return float(list(TIMES).index(config))


def _ready_after_first_call(env):
    """The class's first call (the default runs here), then every candidate compiled."""
    assert _run(env) == _number(M128)
    env.pool.finish()


def _records(env):
    return sorted((env.cache / "tuning").glob("*.json"))


# --------------------------------------------------------------------------- the life of a class


def test_a_class_runs_the_default_until_all_are_compiled_then_measures_once(env, caplog):
    caplog.set_level(logging.INFO, logger="flexjit")
    assert _run(env) == _number(M128)  # first call: the heuristic's, compiled here
    assert env.pool.sent == ["sm90-fwd:tile_m=128, persistent", "sm90-fwd:tile_m=192"]
    assert _run(env) == _number(M128) and len(env.pool.sent) == 2  # sent once, still pending
    env.pool.finish("sm90-fwd:tile_m=192")
    assert _run(env) == _number(M128) and env.timer.rounds == []  # one still compiling
    env.pool.finish()
    assert _run(env) == _number(M128P)  # measured on this call; its answer is the winner's
    n = len(env.backend.launched)
    rounds = env.timer.rounds
    assert [len(r) for r in rounds[:3]] == [1, 1, 1] and len(rounds) == 3 + autotune.MAX_ROUNDS
    assert _run(env) == _number(M128P) and len(env.backend.launched) == n + 1  # from memory
    assert len(env.timer.rounds) == len(rounds) and len(env.pool.sent) == 2
    (path,) = _records(env)
    rec = json.loads(path.read_text())
    assert rec["winner"] == "tile_m=128, persistent" and rec["how"] == "measured"
    assert rec["times_ms"] == {"tile_m=128": 0.66, "tile_m=128, persistent": 0.61, "tile_m=192": 0.7}
    assert rec["device"] == "Fake GPU (132 SMs)" and rec["default"] == "tile_m=128"
    assert rec["toolchain"] == cache.toolchain_fingerprint() and rec["date"][:2] == "20"
    assert cache.verify(path, "sm90-fwd") == cache.OK
    said = [r.getMessage() for r in caplog.records if "tuning sm90-fwd" in r.getMessage()]
    assert said == ["flexjit: tuning sm90-fwd [shape=a]: config tile_m=128, persistent: measured "
                    "0.61 ms against 0.66 ms (tile_m=128), 0.7 ms (tile_m=192)"]


def test_undecided_names_the_classes_a_later_call_will_decide(env, monkeypatch):
    assert autotune.undecided() == frozenset()
    _run(env)  # first call: the candidates go to the background
    (ident,) = autotune.undecided()
    env.pool.finish()
    assert autotune.undecided() == {ident}  # compiled, not yet measured
    _run(env)  # measures and decides
    assert autotune.undecided() == frozenset()
    # No workers: nothing compiles the candidates, and nothing but flexjit.warmup would decide
    # the class, so a benchmark must not wait for it.
    autotune.clear()
    env.pool.states.clear()
    for path in _records(env):  # nor a record on disk
        path.unlink()
    monkeypatch.setattr(compile_pool, "background", lambda job: False)
    _run(env)
    assert autotune.undecided() == frozenset() and autotune._CLASSES


def test_a_new_process_reads_the_record_and_measures_nothing(env):
    _ready_after_first_call(env)
    _run(env)
    autotune.clear()  # a new process: nothing in memory, nothing compiled, nothing sent
    env.pool.states.clear()
    env.pool.sent.clear()
    rounds = len(env.timer.rounds)
    assert _run(env) == _number(M128P)
    assert len(env.timer.rounds) == rounds and env.pool.sent == []
    assert autotune.describe(env.backend, _call(), "fwd") == (
        "config tile_m=128, persistent: measured 0.61 ms against 0.66 ms (tile_m=128), "
        "0.7 ms (tile_m=192) [cached]")


def test_another_shape_class_tunes_apart_and_compiled_kernels_are_shared(env):
    _ready_after_first_call(env)
    _run(env)
    other = FakeBackend(times={M128: 0.5, M128P: 0.6, M192: 0.4}, key=("shape=b",))
    env.timer.backend = other
    # The same kernels (the jobs' identities), already compiled: measured on its first call.
    out, _, _ = autotune.forward(other, _call())
    assert out.flatten()[0].item() == _number(M192) and len(_records(env)) == 2
    assert env.pool.sent == ["sm90-fwd:tile_m=128, persistent", "sm90-fwd:tile_m=192"]


def test_a_difference_within_noise_keeps_the_default(env):
    env.backend.times = {M128: 0.66, M128P: 0.655, M192: 0.70}  # 0.8% faster: a tie
    _ready_after_first_call(env)
    assert _run(env) == _number(M128)
    (path,) = _records(env)
    rec = json.loads(path.read_text())
    assert (rec["winner"], rec["how"]) == ("tile_m=128", "tie")
    assert autotune.describe(env.backend, _call(), "fwd") == (
        "config tile_m=128: the heuristic's, measured 0.66 ms, within 2% of the fastest; "
        "the others 0.655 ms (tile_m=128, persistent), 0.7 ms (tile_m=192)")


def test_failing_candidates_are_dropped_with_a_reason(env, caplog):
    env.backend.fail = {M128P}  # raises at launch
    env.backend.times[M192] = 0.5
    assert _run(env) == _number(M128)
    env.pool.finish()
    env.pool.states["sm90-fwd:tile_m=192"] = "RuntimeError: ptxas died"  # its compile failed
    assert _run(env) == _number(M128)  # the default: the only one left
    assert M192 not in env.backend.launched  # never launched
    (path,) = _records(env)
    rec = json.loads(path.read_text())
    assert rec["times_ms"] == {"tile_m=128": 0.66}
    assert rec["failed"] == {"tile_m=192": "compile failed: RuntimeError: ptxas died",
                             "tile_m=128, persistent": "RuntimeError: tile_m=128, persistent cannot launch"}
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 2 and all(r.levelno == logging.WARNING for r in caplog.records
                                     if "dropped" in r.getMessage())


def test_when_every_candidate_fails_the_default_stays_unrecorded(env):
    env.backend.fail = set(TIMES)
    with pytest.raises(RuntimeError, match="cannot launch"):  # the first call's, as without a tuner
        _run(env)
    env.pool.finish()  # every candidate compiled, none launches
    with pytest.raises(RuntimeError, match="tile_m=128 cannot launch"):  # the caller's own launch
        _run(env)
    assert _records(env) == [] and autotune.describe(env.backend, _call(), "fwd").startswith(
        "config tile_m=128: the heuristic's; no candidate could be measured; dropped: ")


def test_candidates_without_compile_jobs_leave_the_default_running(env, monkeypatch, caplog):
    def broken(call, family, configs):
        raise ValueError("a program that cannot travel")
    monkeypatch.setattr(compile_pool, "candidate_jobs", broken)
    for _ in range(3):
        assert _run(env) == _number(M128)
    assert env.timer.rounds == [] and env.pool.sent == []
    assert [r.getMessage() for r in caplog.records if "no compile jobs" in r.getMessage()] == [
        "flexjit: tuning sm90-fwd: no compile jobs for the candidates (ValueError: a program "
        "that cannot travel); the heuristic's configuration runs"]


# --------------------------------------------------------------------------- pins, AUTOTUNE, never


def test_a_pin_leaving_one_candidate_runs_it_and_sends_nothing(env):
    env.backend.candidates, env.backend.pins = (M192,), "kernel_options TILE_M=192"
    env.backend.default = M192
    env.pool.finish()
    assert _run(env) == 0.0 and env.backend.launched == [M192]
    assert env.pool.sent == [] and env.timer.rounds == [] and _records(env) == []
    assert autotune.describe(env.backend, _call(), "fwd") == \
        "config tile_m=192: pinned by kernel_options TILE_M=192"


@pytest.mark.parametrize("key", ["AUTOTUNE", "fwd_AUTOTUNE"])
def test_autotune_false_runs_the_default_and_never_measures(env, key):
    for _ in range(3):
        assert _run(env, {key: False}) == _number(M128)
        env.pool.finish()
    assert env.pool.sent == [] and env.timer.rounds == [] and _records(env) == []
    assert autotune.describe(env.backend, _call({key: False}), "fwd") == \
        "config tile_m=128: the heuristic's (AUTOTUNE=False)"
    assert autotune.to_compile(env.backend, _call({key: False}), "fwd") == (M128,)
    assert autotune.to_compile(env.backend, _call({"bwd_AUTOTUNE": False}), "fwd") == (M128, M128P, M192)
    _ready_after_first_call(env)
    assert _run(env) == _number(M128P)  # the class measured without the option...
    assert _run(env, {key: False}) == _number(M128)  # ...and with it, still the heuristic's


def test_deterministic_algorithms_run_the_default_and_never_measure(env):
    # Deterministic users expect the same bits in every call and process: no measurement, no
    # background jobs, and a class measured before is not followed either.
    _ready_after_first_call(env)
    assert _run(env) == _number(M128P)  # measured with the flag off
    torch.use_deterministic_algorithms(True)
    try:
        sent, rounds = list(env.pool.sent), list(env.timer.rounds)
        for _ in range(2):
            assert _run(env) == _number(M128)
        assert env.pool.sent == sent and env.timer.rounds == rounds
        assert autotune.describe(env.backend, _call(), "fwd") == \
            "config tile_m=128: the heuristic's (deterministic algorithms)"
    finally:
        torch.use_deterministic_algorithms(False)


def test_never_measured_while_capturing_compiling_or_in_explain(env, monkeypatch):
    _ready_after_first_call(env)
    with selfcheck.dry_run():
        assert _run(env) == _number(M128)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert _run(env) == _number(M128)
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert _run(env) == _number(M128)
    assert env.timer.rounds == [] and _records(env) == []
    assert _run(env) == _number(M128P)  # outside them: measured
    with monkeypatch.context() as m:  # a remembered choice runs while capturing
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert _run(env) == _number(M128P)


def test_never_measured_on_the_cpu(env, monkeypatch):
    monkeypatch.setattr(autotune, "timer", autotune.CudaTimer())
    env.pool.finish()
    for _ in range(2):
        assert _run(env) == _number(M128)
    assert env.pool.sent == [] and env.timer.rounds == [] and not (env.cache / "tuning").exists()
    assert autotune.describe(env.backend, _call(), "fwd") == \
        "config tile_m=128: heuristic (not measured on cpu)"


def test_with_the_disk_cache_off_choices_live_in_memory(env, monkeypatch):
    monkeypatch.setenv("FLEXJIT_CACHE", "0")
    _ready_after_first_call(env)
    assert _run(env) == _number(M128P) and _run(env) == _number(M128P)
    assert not (env.cache / "tuning").exists() and len(env.timer.rounds) == 3 + autotune.MAX_ROUNDS
    autotune.clear()
    env.pool.states.clear()
    assert _run(env) == _number(M128)  # a new process starts over


# --------------------------------------------------------------------------- measuring


def test_rounds_interleave_and_a_long_call_gets_fewer(env, capsys, monkeypatch):
    monkeypatch.setenv("FLEXJIT_DEBUG", "1")
    _ready_after_first_call(env)
    _run(env)
    timed = env.timer.rounds[3:]
    assert timed[:3] == [[M128, M128P, M192], [M128P, M192, M128], [M192, M128, M128P]]
    assert "[flexjit] tuning sm90-fwd [shape=a], 10 rounds: tile_m=128: " + \
        " ".join(["0.660"] * 10) + " ms" in capsys.readouterr().out
    # 3 × 100 ms a round: past the budget after one; its medians decide as well.
    env.backend.times = {M128: 100.0, M128P: 90.0, M192: 120.0}
    env.backend.key = ("shape=long",)
    env.timer.rounds.clear()
    assert _run(env) == _number(M128P)
    assert [len(r) for r in env.timer.rounds] == [1, 1, 1, 3]
    assert env.timer.leads[-4:] == [False, False, False, True]  # the warm-up is not led


def test_a_huge_call_is_decided_on_its_warm_up_launches(env, capsys, monkeypatch):
    """Seconds a launch (a million tokens): one launch each, then the winner's for the answer."""
    monkeypatch.setenv("FLEXJIT_DEBUG", "1")
    env.backend.times = {M128: 1500.0, M128P: 1400.0, M192: 1600.0}
    _ready_after_first_call(env)
    launched = len(env.backend.launched)
    assert _run(env) == _number(M128P)
    assert env.timer.rounds == [[M128], [M128P], [M192]]
    assert env.backend.launched[launched:] == [M128, M128P, M192, M128P]
    assert "tuning sm90-fwd [shape=a], the warm-up launches: tile_m=128: 1500.000 ms" in \
        capsys.readouterr().out
    assert autotune.describe(env.backend, _call(), "fwd") == (
        "config tile_m=128, persistent: measured 1.4 s against 1.5 s (tile_m=128), "
        "1.6 s (tile_m=192)")
    # Just under the mark, the rounds run as before.
    env.backend.times = {M128: 999.0, M128P: 990.0, M192: 1600.0}
    env.backend.key = ("shape=b",)
    env.timer.rounds.clear()
    assert _run(env) == _number(M128)  # 990 is within the tie rule's 2% of the default's 999
    assert [len(r) for r in env.timer.rounds] == [1, 1, 1, 3]


def test_a_damaged_record_is_reported_once_removed_and_tuned_again(env):
    _ready_after_first_call(env)
    _run(env)
    (path,) = _records(env)
    path.write_text(path.read_text().replace("0.61", "0.01"))  # its checksum no longer holds
    autotune.clear()
    env.pool.states.clear()
    env.pool.sent.clear()
    with pytest.warns(cache.CacheWarning, match="its contents do not match their checksum"):
        assert _run(env) == _number(M128)  # heuristic again, and its jobs go out again
    assert not path.exists() and len(env.pool.sent) == 2
    env.pool.finish()
    assert _run(env) == _number(M128P) and json.loads(path.read_text())["times_ms"]["tile_m=128, persistent"] == 0.61


def test_a_foreign_record_is_reported_removed_and_tuned_again(env):
    _ready_after_first_call(env)
    _run(env)
    (path,) = _records(env)
    rec = json.loads(path.read_text())
    rec["winner"] = "tile_m=256"  # sealed, but not one of this class's candidates
    cache.atomic_write(path, json.dumps(rec))
    cache.seal(path, "sm90-fwd")
    autotune.clear()
    env.pool.states.clear()
    with pytest.warns(cache.CacheWarning, match="not this class's candidates") as seen:
        assert _run(env) == _number(M128)
        assert _run(env) == _number(M128)  # no second warning: the file is gone
    assert len([w for w in seen if issubclass(w.category, cache.CacheWarning)]) == 1
    assert not path.exists()


# --------------------------------------------------------------------------- through the API


@pytest.fixture
def tuned_reference(env, monkeypatch):
    """The reference backend with the fake forward's candidates: what auto picks on the CPU."""
    backend = env.backend
    module = types.SimpleNamespace(
        supports=reference.supports, backward_supports=reference.backward_supports,
        tuning=backend.tuning, backward=reference.backward,
        forward=lambda call, config=None: (backend.launched.append(config or M128),
                                           reference.forward(call))[1])
    monkeypatch.setitem(dispatch._MODULES, "reference", module)
    return module


def test_explain_says_which_config_runs_and_why(env, tuned_reference):
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    first = explain(q, k, v)
    assert first.config == ("config tile_m=128: heuristic (3 candidates, 0 compiled; measured "
                            "once all are compiled)")
    assert env.pool.sent == []  # explain sends no job: the class's first call does
    ref = flex_attention(q, k, v)
    assert explain(q, k, v).config.startswith("config tile_m=128: heuristic (3 candidates, 1 compiled")
    assert env.timer.rounds == []  # explain measured nothing
    env.pool.finish()
    out = flex_attention(q, k, v)  # measures, then the winner answers
    assert torch.equal(out, ref) and env.backend.launched[-1] == M128P
    choice = explain(q, k, v)
    assert choice.config == ("config tile_m=128, persistent: measured 0.61 ms against 0.66 ms "
                             "(tile_m=128), 0.7 ms (tile_m=192)")
    assert str(choice).splitlines()[1] == "  " + choice.config
    pinned = explain(q, k, v, kernel_options={"AUTOTUNE": False})
    assert pinned.config == "config tile_m=128: the heuristic's (AUTOTUNE=False)"


def test_the_backward_measures_on_scratch_gradients_and_autograd_sees_one(env, monkeypatch):
    bias = torch.randn(2, requires_grad=True)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    backend = env.backend
    backend.tuning = lambda call: None  # only the backward is tuned here
    monkeypatch.setitem(dispatch._MODULES, "fake", backend)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(4))
    choice = dispatch.Choice("reference", "test", (), "fake", "test")

    def step():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        bias.grad = None
        call = prepare_call(*leaves, head_bias, None, None, False, None)
        out, _, _ = dispatch.run(choice, call)
        out.backward(dout)
        return [t.grad for t in leaves] + [bias.grad.clone()]

    want = step()  # the default's backward; then every candidate is compiled
    assert backend.launched == [M128]
    env.pool.finish()
    got = step()  # measured: 3 warm-ups and 10 rounds of 3, then the winner once more
    assert len(backend.launched) == 1 + 3 + 3 * autotune.MAX_ROUNDS + 1
    assert backend.launched[-1] == M128P and _records(env)[0].name.startswith("sm90-bwd-")
    for w, g_ in zip(want, got):  # autograd received one backward's gradients, not a sum
        assert torch.equal(w, g_)
