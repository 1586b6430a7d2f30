"""Compiling CuTe kernels ahead of need, in worker processes that share the disk cache.

CuTeDSL compiles one kernel on one core, in seconds. A training call's backward needs three
kernels that are known as soon as its forward is traced, so they need not wait for the first
backward: ``ahead`` (called by ``dispatch.run`` for a call that will train on the sm90 backward)
sends their compile to a worker process and returns at once; the forward compiles and runs in
the caller meanwhile. The worker exports the kernels into the disk cache under the keys the
backend computes (it runs the backend's own ``compile_backward``); ``wait`` (called by
``dispatch.backward``) waits for that job, after which the backward loads them from disk in
milliseconds. ``submit`` runs any ``Job`` (the forward too: ``flexjit.warmup``). The tuner's
candidates (``runtime.autotune``) go in the background (``background``): a worker takes one only
while no job a call waits for is queued.

What this module holds
----------------------
* ``Job``: one compile (the sm90 forward or the backward's three kernels) with the Program as
  text (``ir.serialize``: nodes are interned, so they do not pickle) and its captured tensors as
  kinds only (dtype and shape: no kernel reads their values at compile time).
* ``run_job``: what a worker runs, in a worker or, as the fallback, in the caller: the backend's
  own compile path (memory, else disk, else compile and export) under an exclusive file lock
  on the job's identity, so that processes sharing a cache folder compile each kernel once: a
  second one waits for the first and then loads.
* The pool: ``workers()`` processes (the cores less one, at most 4), started at first need and
  stopped at exit. A worker is forked from the caller where ``can_fork`` allows, its cutlass
  pinned to ``ARCH``; else it is ``python -c`` importing this module with the GPU hidden and
  ``CUTE_DSL_ARCH`` set. Either talks length-prefixed pickles over its pipes. Not
  ``multiprocessing``'s spawn: it re-imports the caller's ``__main__`` in every worker, which
  reruns a training script that has no ``if __name__ == "__main__"`` guard.
* Failures: a job that raises, or a worker that dies (killed, out of memory, a crash in the
  compiler), makes ``wait`` warn (``CompileWorkerWarning``, with the worker's last stderr) and
  compile in the caller instead; a dead worker is replaced for the next job.

Off (``enabled()`` false: every call compiles in the caller, as before) when the disk cache is
off (``FLEXJIT_CACHE=0``) or cannot hold CuTe kernels (no TVM-FFI): a worker's kernel would have
no way back; and with one core, where a worker only competes with the caller.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import logging
import os
import pickle
import queue
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch

from flexjit import config
from flexjit.backends import kernel_cache as cache
from flexjit.backends.cute import objects as cute_cache, sm90 as cute_sm90
from flexjit.ir import nodes as ir
from flexjit.ir.program import GradLoad, Program

log = logging.getLogger("flexjit")

ARCH = "sm_90a"  # the workers' target: the sm90 kernels (sm100's self-check compiles at selection)
MAX_WORKERS = 4


class CompileWorkerWarning(RuntimeWarning):
    """A compile worker failed or died; the kernels were compiled in the calling process."""


def workers() -> int:
    """The pool's size: the cores this process may use less one (the caller's), at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(0, min(cores - 1, MAX_WORKERS))


def enabled() -> bool:
    """Whether jobs go to workers: the disk cache can carry their kernels back, and a core is
    free for one."""
    return cute_cache.available() and workers() > 0


# --------------------------------------------------------------------------- jobs


@dataclasses.dataclass(frozen=True)
class Job:
    """One compile, picklable: ``kind`` "fwd" (the sm90 forward) or "bwd" (the backward's
    three kernels), the Program as text, its buffers' kinds, and what else keys the kernels."""
    kind: str
    program_key: str  # Program.key, checked against the rebuilt program's in the worker
    program: tuple  # (graph text, root slots, names, buffer kinds, scalars)
    dtype: str
    head_dim: int
    head_dim_v: int
    sparse: bool
    deterministic: bool = False  # the backward's
    kv_batch_broadcast: bool = False
    persistent: bool = False  # the forward's tiling
    tile_m: int = 128  # the forward's query tile rows
    write_max: bool = False  # the forward writes max_scores
    bwd_config: str = ""  # the backward's schedule variants (kernel_options BWD_CONFIG)
    cache_dir: str = ""

    @functools.cached_property
    def ident(self) -> str:
        """The job's identity across processes (its lock's name): the Program key and every
        field that shapes its kernels, with the toolchain (``cache.kernel_key``)."""
        fields = dataclasses.astuple(dataclasses.replace(self, program=(), cache_dir=""))
        return cache.kernel_key(self.program_key, f"pool_{self.kind}", fields, ARCH)

    def what(self) -> str:
        names = self.program[2]
        which = "forward" if self.kind == "fwd" else "backward"
        tiling = f" (tile_m={self.tile_m}{', persistent' if self.persistent else ''})" \
            if self.kind == "fwd" else ""
        return f"sm90 {which} for {names[0]}/{names[1]} D={self.head_dim} {self.dtype}{tiling}"


def wire(program: Program) -> tuple:
    """``program`` as picklable data (see ``Job.program``); ``unwire`` rebuilds it with the same
    ``Program.key``."""
    roots, slots = [], []
    for name in ("score", "mask", "dscore"):
        node = getattr(program, name)
        slots.append(None if node is None else len(roots))
        if node is not None:
            roots.append(node)
    for g in program.grad_loads:
        roots += [g.load, g.grad]
    kinds = tuple((str(t.dtype).removeprefix("torch."), tuple(t.shape), bool(t.requires_grad))
                  for t in program.buffers)
    return (ir.serialize(roots), tuple(slots), (program.score_name, program.mask_name), kinds,
            tuple(program.scalars))


def unwire(data: tuple) -> Program:
    text, slots, names, kinds, scalars = data
    roots = ir.deserialize(text)
    score, mask, dscore = (None if s is None else roots[s] for s in slots)
    rest = roots[sum(s is not None for s in slots):]
    grads = tuple(GradLoad(rest[i], rest[i + 1]) for i in range(0, len(rest), 2))
    buffers = tuple(torch.zeros(shape, dtype=getattr(torch, dtype)).requires_grad_(grad)
                    for dtype, shape, grad in kinds)
    return Program(score, mask, dscore, grads, buffers, tuple(scalars), *names)


def backward_job(call, deterministic: bool | None = None) -> Job:
    """The Job of the sm90 backward that ``call`` will run (``cute_sm90.backward``'s arguments)."""
    q, v = call.q, call.v
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    return Job("bwd", call.program.key, wire(call.program), str(q.dtype).removeprefix("torch."), q.shape[-1],
               v.shape[-1], call.block_mask is not None, deterministic,
               cute_sm90.kv_broadcast(call),
               bwd_config=cute_sm90.heuristic_bwd_config(call, deterministic),
               cache_dir=str(config.settings.cache_dir))


# The tuning families whose candidates the workers compile, and the Job kind of each: a
# candidate's ``Config`` fields are Job fields of the same names (``candidate_jobs``).
FAMILIES = {"sm90-fwd": "fwd", "sm90-bwd": "bwd"}


def candidate_jobs(call, family: str, configs) -> dict:
    """{config: the Job that compiles ``call``'s kernels on it} for a tuning family's configs
    ({} for a family the workers do not compile). A forward job writes max_scores as the call
    asks; a backward job follows deterministic mode."""
    kind = FAMILIES.get(family)
    if kind is None:
        return {}
    base = backward_job(call)
    if kind == "fwd":
        base = dataclasses.replace(base, kind="fwd", deterministic=False, write_max=call.max_scores)
    return {c: dataclasses.replace(base, **c.as_dict()) for c in configs}


READY, PENDING, MISSING = "ready", "pending", "missing"


def state(job: Job) -> str:
    """``READY`` (done in this process, or by any process sharing the cache: its done marker),
    ``PENDING``, ``MISSING``, or why its compile failed. Never waits, never compiles."""
    hit = _PENDING.get(job.ident)
    if hit is not None:
        fut = hit[1]
        if not fut.done():
            return PENDING
        error = fut.exception()
        return READY if error is None else f"{type(error).__name__}: {error}"
    marker = done_marker(job)
    return READY if marker is not None and marker.exists() else MISSING


def background(job: Job) -> bool:
    """Queue ``job`` behind every job a call waits for, unless it is pending or done; whether
    it was queued (never without workers: a compile here would hold up the caller)."""
    if not enabled() or state(job) != MISSING:
        return False
    submit(job, background=True)
    return True


def run_job(job: Job) -> dict:
    """Compile (or load) the job's kernels through the backend's own path, in this process,
    holding the job's lock; {"compiled": kernels compiled, "cached": kernels loaded, "seconds"}."""
    if job.cache_dir and Path(job.cache_dir) != config.settings.cache_dir:
        config.use_cache_dir(job.cache_dir)  # a worker follows its caller's folder
    program = unwire(job.program)
    if program.key != job.program_key:  # a wiring bug would compile kernels nobody looks up
        raise RuntimeError(f"the {job.what()}: the rebuilt program's key differs from the caller's")
    dtype = getattr(torch, job.dtype)
    aux = tuple(cute_sm90._aux_tensor(t, torch.device("cpu")) for t in program.buffers)
    before = dict(cute_cache.STATS)
    t0 = time.perf_counter()
    with cute_cache.building(job.ident):
        if job.kind == "bwd":
            cute_sm90.compile_backward(
                program, dtype, job.head_dim, job.sparse, job.deterministic, aux,
                head_dim_v=job.head_dim_v, kv_batch_broadcast=job.kv_batch_broadcast,
                tiling=cute_sm90.tiling_for(program, job.head_dim, job.head_dim_v, job.bwd_config,
                                             job.deterministic))
        else:
            q = torch.empty(1, 1, 128, job.head_dim, dtype=dtype)
            v = torch.empty(1, 1, 128, job.head_dim_v, dtype=dtype)
            lists = None
            if job.sparse:  # only their presence (and the tile's kinds list) shapes the kernel
                lists = (torch.ones(1, 1, 1, dtype=torch.int32),
                         torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                         torch.zeros(1, 1, 1, dtype=torch.int32),
                         torch.zeros(1, 1, 1, 1, dtype=torch.int32))
                if job.tile_m != 128:
                    lists += (torch.zeros(1, 1, 1, 1, dtype=torch.int32),)
            cute_sm90.compile_program(program, q, q, v, lists, aux, persistent=job.persistent,
                                      write_max=job.write_max, tile_m=job.tile_m,
                                      kv_batch_broadcast=job.kv_batch_broadcast)
    hits = cute_cache.STATS["hits"] - before["hits"]
    misses = cute_cache.STATS["misses"] - before["misses"]
    mark_done(job)
    return {"compiled": misses, "cached": hits, "seconds": time.perf_counter() - t0}


def mark_done(job: Job) -> None:
    """Leave ``job``'s done marker (``done_marker``): its kernels are in the disk cache."""
    marker = done_marker(job)
    if marker is not None:
        try:
            marker.touch()
        except OSError:  # a read-only folder: later processes only lose the shortcut
            pass


def done_marker(job: Job) -> Path | None:
    """``<ident>.done`` beside the kernels once a process has built or found them all: a later
    process skips the worker (whose start and imports cost seconds) and loads them itself. A
    marker whose kernels have since gone costs only an in-process compile, never a wrong one."""
    if not cute_cache.available():
        return None
    return cute_cache.object_path(job.ident).with_name(f"{job.ident}.done")


# Jobs this process found done on disk, by (ident, cache folder): a training call asks twice per
# step, and the marker's folder and file checks cost 0.1-0.2 ms each on a busy host. Once found,
# the kernels are in memory or loadable; a marker deleted since costs only an in-process compile.
_FOUND: set[tuple[str, str]] = set()


def _on_disk(job: Job) -> bool:
    seen = (job.ident, str(config.settings.cache_dir))
    if seen in _FOUND:
        return True
    marker = done_marker(job)
    found = job.ident not in _PENDING and marker is not None and marker.exists()
    if found:
        _FOUND.add(seen)
    return found


# --------------------------------------------------------------------------- workers


class WorkerError(RuntimeError):
    """A worker's job raised, or the worker died."""


_BOOT = ("import sys; sys.path[:0] = {path!r}; "
         "from flexjit.runtime.compile_pool import serve; serve()")
_WORKER_ENV = dict(CUDA_VISIBLE_DEVICES="", CUTE_DSL_ARCH=ARCH)  # no GPU; the workers' target
IDLE_S = 30.0  # a worker with no job for this long exits (a forked one holds the caller's pages)
JOB_TIMEOUT_S = 900.0  # a job's longest wait: past it the worker is taken for hung, and killed
_PIPES: set[int] = set()  # this process's ends of its workers' pipes (a forked child closes them)


def can_fork() -> bool:
    """Whether a new worker may be forked from this thread now: POSIX, and no thread of this
    process inside the CuTe compiler (a child inherits whatever locks are held at the fork; the
    compile loop it runs takes the compiler's). A process using CUDA forks too: the child pins
    cutlass's target to ``ARCH`` (``_pin_target``) whatever arch the caller's cutlass holds, and
    never uses CUDA, whose state does not survive a fork (it compiles against placeholders and
    CPU tensors)."""
    return hasattr(os, "fork") and not cute_cache.compiles_running()


def _pin_target() -> None:
    """Set every cutlass DSL singleton's target arch to ``ARCH``, in a forked worker. cutlass
    builds its singletons (``CuTeDSL``, ``CuteExperimentalDSL``) when it is imported, reads
    ``<prefix>_ARCH`` then, and without it detects the arch from the CUDA driver at first use
    (``EnvironmentVarManager.arch``); a compile reads the target there. A child inherits the
    caller's singletons with the caller's arch, or detects it where the driver query fails (in
    a child of a CUDA process) and gets cutlass's fallback, sm_100a. Without cutlass imported
    here, the child's own import reads ``CUTE_DSL_ARCH`` from ``_WORKER_ENV``."""
    if "cutlass" not in sys.modules:
        return
    from cutlass.base_dsl.dsl import DSLSingletonMeta

    for dsl in tuple(DSLSingletonMeta._instances.values()):
        dsl.envar.arch = ARCH


class _Forked:
    """A forked worker's process, with the part of ``subprocess.Popen`` that ``_Worker`` uses."""

    def __init__(self, pid: int, stdin, stdout):
        self.pid, self.stdin, self.stdout, self.returncode = pid, stdin, stdout, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"compile worker {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class _Worker:
    """One worker process; ``run`` sends it a job and waits for its answer.

    Forked (``fork=True``) from the caller, it starts in milliseconds with torch, flexjit and
    cutlass already imported; a ``python -c`` worker (spawned) pays those imports, seconds. The
    caller forks only where ``can_fork`` allows (no thread compiling). The child pins cutlass's
    target to ``ARCH`` (``_pin_target``), never calls CUDA (a CUDA context does not survive a
    fork: the compile needs none), touches nothing of the caller's but its own pipes, and exits
    by ``os._exit``. A fork that fails (no memory to account for a large caller's copy) spawns
    instead."""

    def __init__(self, fork: bool = False):
        self.stderr = tempfile.TemporaryFile()
        self.forked = False
        if fork:
            try:
                self.proc = self._fork()
                self.forked = True
            except OSError as e:
                log.info("flexjit: cannot fork a compile worker (%s); spawning one", e)
        if not self.forked:
            self.proc = self._spawn()
        _PIPES.update((self.proc.stdin.fileno(), self.proc.stdout.fileno()))

    def _spawn(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[2])
        path = [] if root in site.getsitepackages() + [site.getusersitepackages()] else [root]
        env = config.child_environment(**_WORKER_ENV)
        return subprocess.Popen([sys.executable, "-c", _BOOT.format(path=path)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=self.stderr, env=env)

    def _fork(self) -> _Forked:
        job_r, job_w = os.pipe()
        answer_r, answer_w = os.pipe()
        sys.stdout.flush(), sys.stderr.flush()  # nothing buffered is written twice
        try:
            with warnings.catch_warnings():
                # Python warns that forking a multi-threaded process may deadlock the child:
                # the child here runs only the compile loop, forked while no thread compiles.
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError:
            for fd in (job_r, job_w, answer_r, answer_w):
                os.close(fd)
            raise
        if pid == 0:  # the worker
            code = 1
            try:
                for fd in _PIPES | {job_w, answer_r}:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                os.dup2(self.stderr.fileno(), 1)
                os.dup2(self.stderr.fileno(), 2)
                os.environ.update(_WORKER_ENV)  # for what is read from here on
                _pin_target()  # cutlass read its arch at its import, in the caller
                torch.set_num_threads(1)  # the caller's OpenMP pool did not survive the fork
                serve(os.fdopen(job_r, "rb"), os.fdopen(answer_w, "wb"))
                code = 0
            except BaseException:  # the caller's warning quotes this (``tail``)
                traceback.print_exc()
            finally:
                os._exit(code)  # never the caller's atexit hooks, nor its code after the fork
        os.close(job_r)
        os.close(answer_w)
        return _Forked(pid, os.fdopen(job_w, "wb"), os.fdopen(answer_r, "rb"))

    def run(self, job: Job) -> dict:
        data = pickle.dumps(job)
        try:
            self.proc.stdin.write(len(data).to_bytes(8, "little") + data)
            self.proc.stdin.flush()
            answer = _read(self.proc.stdout)
        except (BrokenPipeError, EOFError, OSError):
            answer = None
        if answer is None:
            code = self.proc.wait()
            raise WorkerError(f"the compile worker (pid {self.proc.pid}) died with exit code "
                              f"{code}; its last output:\n{self.tail()}")
        if answer.get("error"):
            raise WorkerError(answer["error"])
        return answer

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 2000) -> str:
        self.stderr.seek(0, os.SEEK_END)
        self.stderr.seek(max(0, self.stderr.tell() - chars))
        return self.stderr.read().decode(errors="replace").strip() or "(none)"

    def stop(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            _PIPES.discard(f.fileno())
            with contextlib.suppress(OSError, ValueError):
                f.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def _read(stream) -> dict | None:
    header = stream.read(8)
    if len(header) < 8:
        return None
    body = stream.read(int.from_bytes(header, "little"))
    return pickle.loads(body)


def serve(jobs=None, answers=None) -> None:
    """A worker's loop: a job from ``jobs`` (stdin), its answer to ``answers`` (stdout), until
    the jobs' pipe closes. A spawned worker's compiler output goes to stderr (stdout carries
    only the answers)."""
    if answers is None:
        answers = os.fdopen(os.dup(1), "wb")
        os.dup2(2, 1)
        sys.stdout = sys.stderr
    jobs = sys.stdin.buffer if jobs is None else jobs
    while True:
        job = _read(jobs)
        if job is None:
            return
        try:
            answer = run_job(job)
        except BaseException as e:  # the caller compiles instead, with this message
            answer = {"error": f"{type(e).__name__}: {e}"}
        data = pickle.dumps(answer)
        answers.write(len(data).to_bytes(8, "little") + data)
        answers.flush()


class Pool:
    """Up to ``size`` worker processes behind a queue; each job's ``Future`` gets its answer.

    ``submit`` forks a worker (``can_fork``) when fewer are idle than jobs are waiting, so the
    workers start from the caller's thread; a thread that finds no idle worker (one died)
    spawns its replacement. Workers idle for ``IDLE_S`` exit; the next job starts another.
    Background jobs queue behind the others and never fork (a fork of a large process costs
    the caller milliseconds): a pool thread spawns a worker for them where room is left."""

    def __init__(self, size: int):
        self.pid = os.getpid()
        self.size = size
        self.order = iter(range(1 << 62))  # ties in priority keep the submission order
        self.jobs: queue.PriorityQueue = queue.PriorityQueue()
        self.idle: queue.Queue = queue.Queue()
        self.live: list[_Worker] = []
        self.lock = threading.Lock()
        self.running: dict[str, _Worker] = {}  # Job.ident -> the worker running it
        self.threads = [threading.Thread(target=self._loop, daemon=True,
                                         name=f"flexjit-compile-{i}") for i in range(size)]
        for t in self.threads:
            t.start()

    def submit(self, job: Job, background: bool = False) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self.lock:  # this job and those not yet taken, against the idle workers
            if not background and self.idle.qsize() < self.jobs.qsize() + 1 and \
                    len(self.live) < self.size:
                worker = _Worker(fork=can_fork())
                self.live.append(worker)
                self.idle.put(worker)
            self.jobs.put((int(background), next(self.order), (job, fut)))
        return fut

    def pids(self) -> list[int]:
        with self.lock:
            return [w.proc.pid for w in self.live]

    def _take(self) -> _Worker:
        """An idle live worker, else a new one, forked or spawned (room permitting), else the
        next to become idle."""
        while True:
            try:
                worker = self.idle.get_nowait()
            except queue.Empty:
                with self.lock:
                    if len(self.live) < self.size:
                        worker = _Worker(fork=False)  # not this thread's to fork from
                        self.live.append(worker)
                        return worker
                worker = self.idle.get()
            if worker.alive():
                return worker
            self._drop(worker)

    def _drop(self, worker: _Worker) -> None:
        with self.lock:
            if worker in self.live:
                self.live.remove(worker)
        worker.stop()

    def _retire_idle(self) -> None:
        while True:
            try:
                worker = self.idle.get_nowait()
            except queue.Empty:
                return
            self._drop(worker)

    def _loop(self) -> None:
        while True:
            try:
                item = self.jobs.get(timeout=IDLE_S)[2]
            except queue.Empty:
                self._retire_idle()
                continue
            if item is None:
                return
            job, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            worker = None
            try:
                worker = self._take()
                self.running[job.ident] = worker
                fut.set_result(worker.run(job))
            except BaseException as e:
                if not fut.done():
                    fut.set_exception(e if isinstance(e, WorkerError) else WorkerError(repr(e)))
            self.running.pop(job.ident, None)
            if worker is not None:
                if worker.alive():
                    self.idle.put(worker)
                else:  # dead: the next job gets a fresh one
                    self._drop(worker)

    def shutdown(self) -> None:
        for _ in self.threads:
            self.jobs.put((2, next(self.order), None))
        for t in self.threads:
            t.join(timeout=1)
        with self.lock:
            live, self.live = self.live, []
        for w in live:
            w.stop()


_POOL: Pool | None = None
_POOL_LOCK = threading.Lock()
_PENDING: dict[str, tuple[Job, cf.Future]] = {}  # Job.ident -> its job and future


def pool() -> Pool:
    """The process's pool, started at first need (again in a forked child: the parent's
    threads did not survive the fork)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():
            _POOL = Pool(workers())
        return _POOL


def shutdown() -> None:
    """Stop the workers (at exit; a later job starts new ones) and forget the jobs found done."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and _POOL.pid == os.getpid():
            _POOL.shutdown()
        _POOL = None
        _PENDING.clear()
        _FOUND.clear()


atexit.register(shutdown)


def submit(job: Job, background: bool = False) -> cf.Future:
    """The job's future: the one already pending or done in this process, else a new job on a
    worker (or, with the pool off, a future done here, now). ``background``: behind the others
    (``Pool``)."""
    ident = job.ident
    hit = _PENDING.get(ident)
    if hit is not None:
        return hit[1]
    if enabled():
        fut = pool().submit(job, background)
    else:
        fut = cf.Future()
        try:
            fut.set_result(run_job(job))
        except Exception as e:
            fut.set_exception(e)
    _PENDING[ident] = (job, fut)
    return fut


def _kill_running(job: Job) -> None:
    worker = _POOL.running.get(job.ident) if _POOL is not None else None
    if worker is not None:
        worker.proc.kill()


def start(job: Job) -> None:
    """Send ``job`` to a worker unless it is pending or an earlier process finished it."""
    if enabled() and not _on_disk(job):
        submit(job)


def result(job: Job, fut: cf.Future) -> dict:
    """The job's answer; a failed worker, or one silent past ``JOB_TIMEOUT_S`` (killed), is
    reported (``CompileWorkerWarning``) and the job run in this process instead."""
    try:
        try:
            return fut.result(timeout=JOB_TIMEOUT_S)
        except cf.TimeoutError:
            _kill_running(job)
            raise WorkerError(f"no answer in {JOB_TIMEOUT_S:.0f} s; the worker was killed")
    except Exception as e:
        warnings.warn(f"flexjit: the compile worker failed on the {job.what()} ({e}); "
                      "compiling it in this process", CompileWorkerWarning, stacklevel=3)
        answer = run_job(job)
        done: cf.Future = cf.Future()
        done.set_result(answer)
        _PENDING[job.ident] = (job, done)
        return answer


# --------------------------------------------------------------------------- the dispatch hooks


_SEEN: dict[tuple, Job] = {}  # (Program.key, deterministic, ...) -> the job, skips re-wiring


def _job_of(call) -> Job:
    deterministic = torch.are_deterministic_algorithms_enabled()
    q, v = call.q, call.v
    key = (call.program.key, deterministic, q.dtype, q.shape[-1], v.shape[-1],
           call.block_mask is not None, cute_sm90.kv_broadcast(call), str(config.settings.cache_dir),
           tuple((t.dtype, t.dim()) for t in call.program.buffers))
    job = _SEEN.get(key)
    if job is None:
        job = _SEEN[key] = backward_job(call, deterministic)
    return job


def ahead(backward: str | None, call) -> None:
    """Start compiling the backward a training call will run on ``backward`` (the sm90 backend's
    "cute" only), in a worker, and return at once."""
    if backward == "cute" and enabled():
        start(_job_of(call))


def wait(backward: str, call) -> None:
    """Before ``backward`` runs ``call``'s gradients: its job's answer, the job started by
    ``ahead`` or, without workers, run here now (under the job's lock, so that processes sharing
    the cache compile it once); the backend then finds its kernels in memory or on disk."""
    if backward == "cute" and cute_cache.available():
        job = _job_of(call)
        if not _on_disk(job):
            result(job, submit(job))
