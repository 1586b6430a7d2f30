"""The compile pool (``flexjit.runtime.compile_pool``), on the CPU: kernels for sm_90a.

* A Program survives the trip to a worker: the rebuilt one has the same key (learnable tables,
  runtime scalars and captured index tensors included).
* ``ahead`` compiles the backward's three kernels in another process while the caller goes on;
  afterwards this process loads all three from disk with ``cute.compile`` forbidden.
* A worker killed mid-job: ``wait`` warns and compiles here; the next job gets a fresh worker.
* A caller with CUDA initialized and its cutlass on another arch forks its worker all the same:
  the child compiles for sm_90a without a CUDA call, and the caller loads its kernels. A fork
  that fails spawns the worker instead.
* Two processes sharing a cache folder that need the same backward at once compile it once.
* With the disk cache off the pool starts nothing.
* ``dispatch.run`` starts the job before the forward runs; ``dispatch.backward`` waits for it
  before the backward runs.

The compiling tests use head dim 64, the smallest tile the sm90 backward's tests already cover
(its compile is the shortest), and are ``slow``: each spends seconds in CuTeDSL.
"""
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
torch = pytest.importorskip("torch")

from flexjit import config, mods  # noqa: E402
from flexjit.api.attention import prepare_call  # noqa: E402
from flexjit.api.masks import create_block_mask  # noqa: E402
from flexjit.runtime import compile_pool, dispatch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
S, D, H = 512, 64, 4


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    compile_pool.shutdown()  # no job or worker of another test's folder
    yield tmp_path / "cache"
    compile_pool.shutdown()


def _call(score_mod=None, grad=True):
    q, k, v = (torch.randn(1, H, S, D, dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
    bm = create_block_mask(mods.causal(), None, None, S, S, device="cpu")
    return prepare_call(q, k, v, mods.alibi(H) if score_mod is None else score_mod, bm, None,
                        False, None)


def _needs_cute():
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")


def test_a_program_is_rebuilt_with_its_key():
    table = torch.randn(2 * S - 1, requires_grad=True)
    docs = torch.arange(S) // 100
    cases = [mods.alibi(H), mods.softcap(30.0), mods.relative_bias(table),
             lambda s, b, h, q, kv: torch.where(docs[q] == docs[kv], s * 0.5 + 1.25, s)]
    for score_mod in cases:
        program = _call(score_mod).program
        back = compile_pool.unwire(pickle.loads(pickle.dumps(compile_pool.wire(program))))
        assert back.key == program.key
        assert [(t.dtype, t.shape, t.requires_grad) for t in back.buffers] == \
            [(t.dtype, t.shape, t.requires_grad) for t in program.buffers]
        assert back.scalars == program.scalars
        assert len(back.grad_loads) == len(program.grad_loads)


def _cubin_sms(path: Path) -> set:
    """The SM numbers (90 for sm_90a) of the cubins embedded in an exported object file, from each
    CUDA ELF header's e_flags: ABI version 7 holds the SM in the low byte, version 8 (CUDA 13's
    for every arch, 12.x's from sm_100) in bits 8-15. Whether the arch-specific "a" features are
    on is not in e_flags under every toolchain, and needs no check: the sm90 kernels' wgmma
    compiles for sm_90a alone."""
    data, sms = path.read_bytes(), set()
    at = data.find(b"\x7fELF", 1)  # the host object's own header is at 0
    while at > 0:
        if int.from_bytes(data[at + 0x12:at + 0x14], "little") == 190:  # EM_CUDA
            abi, flags = data[at + 8], int.from_bytes(data[at + 0x30:at + 0x34], "little")
            sms.add(flags & 0xff if abi < 8 else (flags & 0xff00) >> 8)
        at = data.find(b"\x7fELF", at + 1)
    return sms


def test_a_process_using_cuda_may_fork_its_workers(monkeypatch):
    # The child pins cutlass's target and never uses CUDA: neither CUDA nor the caller's arch
    # stands in the way; a thread inside the compiler (whose locks a child would inherit) does.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert compile_pool.can_fork()
    with compile_pool.cute_cache.compiling():
        assert not compile_pool.can_fork()


def test_off_when_the_disk_cache_is_off(cache, monkeypatch):
    monkeypatch.setenv("FLEXJIT_CACHE", "0")
    assert not compile_pool.enabled()
    call = _call()
    compile_pool.ahead("cute", call)
    compile_pool.wait("cute", call)
    assert compile_pool._POOL is None and not compile_pool._PENDING


def test_dispatch_starts_the_job_before_the_forward_and_waits_before_the_backward(cache,
                                                                               monkeypatch):
    import concurrent.futures as cf

    events = []

    def submit(job):  # a worker's future, finished by the forward below; one per job, as submit's
        if job.ident in pending:
            return pending[job.ident]
        events.append(("submit", job.kind, job.program_key))
        fut = cf.Future()
        fut.add_done_callback(lambda f: events.append(("done", job.kind)))
        pending[job.ident] = fut
        return fut

    pending = {}
    monkeypatch.setattr(compile_pool, "submit", submit)
    monkeypatch.setattr(compile_pool, "enabled", lambda: True)
    monkeypatch.setattr(compile_pool.cute_cache, "available", lambda: True)
    real_fwd = dispatch.forward

    def forward(name, call):
        events.append(("forward", name))
        # the worker finishes while the forward runs
        for fut in pending.values():
            fut.set_result({"compiled": 3, "cached": 0, "seconds": 0.0})
        return real_fwd(name, call)

    class FakeCute:  # the sm90 backward, which cannot run on the CPU
        @staticmethod
        def backward(call, q, k, v, out, lse, dout, dlse):
            events.append(("backward",))
            return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))

    monkeypatch.setattr(dispatch, "forward", forward)
    monkeypatch.setitem(dispatch._MODULES, "cute", FakeCute)
    call = _call(mods.softcap(20.0))
    choice = dispatch.Choice("reference", "test", (), "cute", "test")
    out, lse, _ = dispatch.run(choice, call)
    out.float().sum().backward()
    assert events[0] == ("submit", "bwd", call.program.key)
    assert events[1] == ("forward", "reference")
    assert events.index(("done", "bwd")) < events.index(("backward",))
    assert [e for e in events if e[0] == "submit"] == [events[0]]  # the backward's wait reused it


def test_a_job_done_by_an_earlier_process_starts_no_worker(cache, monkeypatch):
    # A warm cache must not pay a worker's start and imports: the backend loads the kernels.
    submitted = []
    monkeypatch.setattr(compile_pool, "submit", lambda job: submitted.append(job))
    monkeypatch.setattr(compile_pool, "enabled", lambda: True)
    monkeypatch.setattr(compile_pool.cute_cache, "available", lambda: True)
    call = _call(mods.softcap(30.0))
    compile_pool.ahead("cute", call)
    assert len(submitted) == 1  # nothing on disk yet: the job goes to a worker
    marker = compile_pool.done_marker(submitted[0])
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()  # what run_job leaves once the kernels are built or found
    submitted.clear()
    compile_pool.ahead("cute", call)
    compile_pool.wait("cute", call)
    assert submitted == []


def test_a_job_found_done_is_not_looked_up_on_disk_again(cache, monkeypatch):
    # A training call asks before its forward and before its backward: after the first answer,
    # no folder or file check per step (they cost 0.1-0.2 ms each on a busy host).
    monkeypatch.setattr(compile_pool, "submit", lambda job: pytest.fail("submitted"))
    monkeypatch.setattr(compile_pool, "enabled", lambda: True)
    monkeypatch.setattr(compile_pool.cute_cache, "available", lambda: True)
    call = _call(mods.softcap(40.0))
    marker = compile_pool.done_marker(compile_pool._job_of(call))
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    compile_pool.ahead("cute", call)
    looked = []
    real = compile_pool.done_marker
    monkeypatch.setattr(compile_pool, "done_marker", lambda job: looked.append(job) or real(job))
    for _ in range(3):
        compile_pool.ahead("cute", call)
        compile_pool.wait("cute", call)
    assert looked == []
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(cache.parent / "other"))  # another folder: asked again
    with pytest.raises(pytest.fail.Exception, match="submitted"):
        compile_pool.ahead("cute", call)
    assert len(looked) == 1


def _fwd_job(call, **fields):
    """A forward job for ``call`` on the tiling ``fields`` (as the tuner builds one)."""
    from flexjit.backends.base import Config

    config = Config.of(**{"tile_m": 128, "persistent": False, **fields})
    return compile_pool.candidate_jobs(call, "sm90-fwd", (config,))[config]


def test_a_jobs_state_comes_from_this_process_or_its_marker(cache, monkeypatch):
    # What the tuner reads to know a candidate is compiled: never waits, never compiles.
    import concurrent.futures as cf

    job = _fwd_job(_call(grad=False))
    assert compile_pool.state(job) == compile_pool.MISSING
    fut = cf.Future()
    compile_pool._PENDING[job.ident] = (job, fut)
    assert compile_pool.state(job) == compile_pool.PENDING
    fut.set_exception(compile_pool.WorkerError("ptxas died"))
    assert compile_pool.state(job) == "WorkerError: ptxas died"
    compile_pool._PENDING.clear()
    monkeypatch.setattr(compile_pool.cute_cache, "available", lambda: True)
    compile_pool.mark_done(job)  # what run_job, warmup and flexjit compile leave behind
    assert compile_pool.state(job) == compile_pool.READY


def test_background_jobs_go_out_once_and_only_to_workers(cache, monkeypatch):
    import concurrent.futures as cf

    sent = []

    class FakePool:
        def submit(self, job, background=False):
            sent.append((job.tile_m, background))
            return cf.Future()
    job = _fwd_job(_call(grad=False), tile_m=192)
    monkeypatch.setattr(compile_pool, "enabled", lambda: False)
    assert not compile_pool.background(job) and sent == []  # no workers: never compiled here
    monkeypatch.setattr(compile_pool, "enabled", lambda: True)
    monkeypatch.setattr(compile_pool, "pool", FakePool)
    assert compile_pool.background(job) and not compile_pool.background(job)
    assert sent == [(192, True)] and compile_pool.state(job) == compile_pool.PENDING


def test_background_jobs_wait_behind_the_ones_calls_need(monkeypatch):
    # One worker, busy: a background job queued before a foreground one runs after it.
    import threading

    ran, started, release = [], threading.Event(), threading.Event()

    class FakeWorker:
        def __init__(self, fork=False):
            self.proc = types.SimpleNamespace(pid=0)

        def run(self, job):
            ran.append(job.ident)
            started.set()
            release.wait(10)
            return {"compiled": 1, "cached": 0, "seconds": 0.0}

        def alive(self):
            return True

        def stop(self):
            pass
    monkeypatch.setattr(compile_pool, "_Worker", FakeWorker)
    pool = compile_pool.Pool(1)
    try:
        first = pool.submit(types.SimpleNamespace(ident="needed first"))
        assert started.wait(10)
        later = [pool.submit(types.SimpleNamespace(ident="candidate"), background=True),
                 pool.submit(types.SimpleNamespace(ident="needed next"))]
        release.set()
        for fut in [first, *later]:
            assert fut.result(10)["compiled"] == 1
    finally:
        pool.shutdown()
    assert ran == ["needed first", "needed next", "candidate"]


@pytest.mark.slow
def test_the_backward_compiles_ahead_in_a_worker_and_loads_from_disk(cache):
    _needs_cute()
    from flexjit.backends.cute import sm90

    sm90._COMPILED_BWD.clear()  # a forked worker would find another test's kernels in memory
    call = _call()
    t0 = time.perf_counter()
    compile_pool.ahead("cute", call)
    assert time.perf_counter() - t0 < 1.0  # it returned before any compile
    job, fut = next(iter(compile_pool._PENDING.values()))
    assert job.kind == "bwd" and job.program_key == call.program.key
    answer = fut.result(timeout=600)
    assert answer == {"compiled": 3, "cached": 0, "seconds": answer["seconds"]}
    assert os.getpid() not in compile_pool.pool().pids()
    assert len(list((cache / "cute").glob("*.o"))) == 3

    _the_caller_loads_the_workers_backward(call)


def _the_caller_loads_the_workers_backward(call):
    """After a worker compiled ``call``'s backward: the caller waits for it, then loads its three
    kernels from disk and compiles none."""
    import cutlass.cute as cute

    from flexjit.backends.cute import objects, sm90

    real, hits = cute.compile, objects.STATS["hits"]
    cute.compile = lambda *a, **k: pytest.fail("the backward compiled in the caller")
    try:
        compile_pool.wait("cute", call)
        aux = tuple(sm90._aux_tensor(t, call.q.device) for t in call.program.buffers)
        sm90._COMPILED_BWD.clear()
        sm90.compile_backward(call.program, call.q.dtype, D, True, False, aux, head_dim_v=D)
    finally:
        cute.compile = real
    assert objects.STATS["hits"] - hits == 3


@pytest.mark.slow
def test_a_dead_worker_falls_back_with_a_warning_and_is_replaced(cache):
    _needs_cute()
    call = _call(mods.softcap(25.0))
    compile_pool.ahead("cute", call)
    job, fut = next(iter(compile_pool._PENDING.values()))
    pool = compile_pool.pool()
    deadline = time.monotonic() + 60
    while not pool.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    (pid,) = pool.pids()
    os.kill(pid, 9)
    with pytest.warns(compile_pool.CompileWorkerWarning, match="died with exit code -9"):
        compile_pool.wait("cute", call)
    assert len(list((cache / "cute").glob("*.o"))) == 3  # compiled here, exported
    # The next job runs on a fresh worker, which compiles nothing: a forked one has this
    # process's kernels in memory, a spawned one finds them on disk.
    compile_pool._PENDING.clear()
    answer = compile_pool.submit(job).result(timeout=600)
    assert pid not in pool.pids() and len(pool.pids()) == 1
    (fresh,) = pool.live
    assert answer["compiled"] == 0 and answer["cached"] == (0 if fresh.forked else 3)


@pytest.mark.slow
def test_a_hung_worker_is_killed_and_the_caller_compiles(cache, monkeypatch):
    _needs_cute()
    import signal

    from flexjit.backends.cute import sm90

    sm90._COMPILED_BWD.clear()  # no kernel of another test's folder in memory
    monkeypatch.setattr(compile_pool, "JOB_TIMEOUT_S", 3.0)
    call = _call(mods.softcap(15.0))
    compile_pool.ahead("cute", call)
    pool = compile_pool.pool()
    (pid,) = pool.pids()
    os.kill(pid, signal.SIGSTOP)  # alive, and silent
    with pytest.warns(compile_pool.CompileWorkerWarning, match="no answer in 3 s"):
        compile_pool.wait("cute", call)
    assert len(list((cache / "cute").glob("*.o"))) == 3  # compiled here, exported
    deadline = time.monotonic() + 10
    while pid in pool.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid not in pool.pids()


@pytest.mark.slow
def test_a_worker_forked_after_a_compile_here_compiles_and_starts_fast(cache):
    # The child inherits a process whose compiler has run (its thread pools, its contexts): it
    # must still compile, and it starts without paying torch's and cutlass's imports.
    _needs_cute()
    from flexjit.backends.cute import sm90

    sm90._COMPILED_BWD.clear()  # no kernel of another test's folder in memory
    compile_pool.run_job(compile_pool.backward_job(_call(mods.softcap(35.0))))  # here, first
    # A transcendental, as softcap's: the same backward tile, so the same pre/postprocess.
    call = _call(lambda s, b, h, q, kv: torch.where(q >= kv, s, torch.tanh(s)))
    t0 = time.perf_counter()
    compile_pool.ahead("cute", call)
    pool = compile_pool.pool()
    assert [w.forked for w in pool.live] == [True]
    job, fut = next(iter(compile_pool._PENDING.values()))
    answer = fut.result(timeout=600)
    # Its main kernel; the pre/postprocess (the same for every mod) come from the first job.
    assert (answer["compiled"], answer["cached"]) == (1, 2)
    # a spawned worker's imports alone take seconds; a fork, milliseconds
    assert time.perf_counter() - t0 - answer["seconds"] < 1.0
    assert len(list((cache / "cute").glob("*.o"))) == 4


@pytest.mark.slow
def test_a_worker_forked_from_a_cuda_process_on_another_arch_compiles_for_sm90a(cache, tmp_path,
                                                                                monkeypatch):
    # A GPU process whose cutlass settled on another arch (another GPU's, or sm_100a, cutlass's
    # fallback when detection fails) forks its worker: the child compiles for sm_90a all the same,
    # calls no CUDA driver or runtime function, and the caller loads the kernels it exported.
    _needs_cute()
    driver = pytest.importorskip("cuda.bindings.driver")
    runtime = pytest.importorskip("cuda.bindings.runtime")
    from cutlass.base_dsl.dsl import DSLSingletonMeta

    from flexjit.backends.cute import sm90

    parent, calls = os.getpid(), tmp_path / "cuda_calls"

    def recorded(name, fn):
        def call(*args, **kwargs):
            if os.getpid() != parent:  # the worker's; this process's own are not in question
                with open(calls, "a") as f:
                    f.write(f"{name}\n")
            return fn(*args, **kwargs)
        return call

    for module in (driver, runtime):
        for name in dir(module):
            fn = getattr(module, name)
            if name.startswith("cu") and callable(fn) and not isinstance(fn, type):
                monkeypatch.setattr(module, name, recorded(f"{module.__name__}.{name}", fn))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    sm90._COMPILED_BWD.clear()  # a forked worker would find another test's kernels in memory
    envs = [dsl.envar for dsl in DSLSingletonMeta._instances.values()]
    saved = [env._arch for env in envs]  # None where not yet read (detected at first use)
    call = _call(mods.softcap(45.0))
    try:
        for env in envs:
            env.arch = "sm_100a"
        compile_pool.ahead("cute", call)
        assert [w.forked for w in compile_pool.pool().live] == [True]
        _, fut = next(iter(compile_pool._PENDING.values()))
        answer = fut.result(timeout=600)
        assert [env.arch for env in envs] == ["sm_100a"] * len(envs)  # the caller's, untouched
    finally:
        for env, arch in zip(envs, saved):
            env.arch = arch
    assert answer["compiled"] == 3
    objs = sorted((cache / "cute").glob("*.o"))
    assert len(objs) == 3 and [_cubin_sms(o) for o in objs] == [{90}] * 3  # not sm_100a's 100
    assert not calls.exists(), calls.read_text()

    _the_caller_loads_the_workers_backward(call)


@pytest.mark.slow
def test_a_worker_that_cannot_be_forked_is_spawned(monkeypatch):
    # Forking a large process can fail (ENOMEM where memory is not overcommitted): the pool then
    # pays a spawned worker's start rather than failing the caller, and leaks no pipe.
    def fork():
        raise OSError(12, "Cannot allocate memory")

    fds = set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    monkeypatch.setattr(os, "fork", fork)
    worker = compile_pool._Worker(fork=True)
    try:
        assert not worker.forked and isinstance(worker.proc, subprocess.Popen) and worker.alive()
    finally:
        worker.stop()
    if fds is not None:
        assert set(os.listdir("/proc/self/fd")) == fds


@pytest.mark.slow
def test_two_processes_sharing_a_cache_compile_a_job_once(cache, tmp_path):
    _needs_cute()
    job = compile_pool.backward_job(_call(mods.softcap(40.0)))
    (tmp_path / "job.pkl").write_bytes(pickle.dumps(job))
    script = textwrap.dedent(f"""
        import json, pickle
        from flexjit.runtime import compile_pool
        job = pickle.load(open({str(tmp_path / 'job.pkl')!r}, "rb"))
        print(json.dumps(compile_pool.run_job(job)))
    """)
    env = dict(os.environ, FLEXJIT_CACHE_DIR=str(config.settings.cache_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    children = [subprocess.Popen([sys.executable, "-c", script], env=env, cwd=REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for _ in range(2)]
    answers = []
    for child in children:
        out, err = child.communicate(timeout=900)
        assert child.returncode == 0, err[-3000:]
        answers.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted((a["compiled"], a["cached"]) for a in answers) == [(0, 3), (3, 0)]
