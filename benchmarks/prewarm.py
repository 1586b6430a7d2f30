"""Fill the CuTe disk cache for a benchmark run in parallel, before the timed run.

    python -m benchmarks.prewarm [benchmarks.run's flags] --jobs N
    python -m benchmarks.run [the same flags]            # then loads every CuTe kernel from disk

``benchmarks.run`` meets each flexjit CuTe kernel (the forward, the backward's three parts) in
one process, one after another, and compiles it there on one core. This walks the run's own grid
(``run.make_parser``, ``run.parse_args``, ``run.grid``: the same flags, cases and order) and,
for every (pass, case, variant) that the run sends to a CuTe impl (``flexjit-cute`` and its
modes in ``impls.FLEXJIT_MODES``, each under its own switches; an FP8 impl's forward on e4m3
q, k and v, the kernel a backend that reads FP8 runs, else its dequantising road's), compiles the kernels with
``flexjit.aot.compile_kernels`` in N ``spawn``-ed worker processes, each kernel once.

How it knows which kernels the run needs, without a GPU (``run_keys``): it builds the call the
run makes for the case (the variant from ``variants.build``, the same function objects and
captured tensors, on the CPU; the impl's block mask, ``impls.plan_mask``; ``prepare_call``; the
impl's environment and deterministic flag) and sends it through the run's own code,
``cute_sm90.forward`` / ``cute_sm90.backward``, with the disk lookup recording each key and
``cute.compile`` raising before any work. Jobs are deduplicated by those keys (S and Hkv often
change no kernel), keys already on disk are reported as cached, and each worker checks that the
keys ``compile_kernels`` stored are the run's keys (a mismatch is reported as failed). It also
builds the forward's other tuning candidates (``candidate`` lines), so the run's tuner measures
them on its first call instead of compiling them while the run is timed.

The variants' captured data come from the run's generator (``--seed``): given a seed, the builds
are replayed in the run's order, so document ids are the run's; without one the run draws fresh
ids, so variants whose build draws (document) are probed under DRAWS seeds and every distinct
kernel compiled (only the forward's tiling can change: it follows the mask's density).

No GPU is used: every tensor is a CPU one, the workers start with the GPU hidden
(``CUDA_VISIBLE_DEVICES=""``) and CuTeDSL compiling for ``CUTE_DSL_ARCH=sm_90a``, as
``tests/test_aot_gpu.py`` does (an H200 run loads such entries). The run afterwards prints
"cute disk cache: H hits, M misses"; after a complete prewarm M is 0. Cost: each worker imports
CuTeDSL (seconds) and compiles its kernels; kernels the run needs from others (Triton,
torch.compile, FA4) are not touched. Only sm_90a: an sm100 run self-checks its own kernels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import torch

from . import impls as impl_mod
from . import run as run_mod
from .envvars import overlay
from .variants import Case, build

ARCH = "sm_90a"
DRAWS = 4  # generator seeds probed without --seed, for variants whose build draws random data
CUTE_BACKENDS = ("cute", "auto")  # an impl on these backends runs the sm90 kernels on Hopper
CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One (pass, case, variant, impl) the run sends to a CuTe kernel, and how to rebuild its
    variant in another process: ``gen_state`` is the run's generator state before the build."""
    pass_: str  # "fwd" or "fwdbwd"
    case: Case
    variant: str
    impl: str
    deterministic: bool  # the run's --deterministic (the impl may add its own)
    gen_state: torch.Tensor = dataclasses.field(compare=False, hash=False)

    def what(self) -> str:
        dims = f"{self.case.D}" + ("" if self.case.dv == self.case.D else f"/{self.case.dv}")
        return (f"{self.variant} D={dims} S={self.case.S} B={self.case.B} Hq={self.case.Hq} "
                f"Hkv={self.case.Hkv} {self.impl}")


@dataclasses.dataclass
class Job:
    """Kernels one worker compiles: the forward (1 key) or the backward (its 3 parts' keys)."""
    spec: Spec
    pass_: str  # aot's "fwd" or "bwd"
    keys: dict  # part -> the run's disk key
    users: int = 1  # specs that need these kernels


class _Probed(Exception):
    """Raised in place of ``cute.compile`` while the run's keys are recorded."""


def cute_impls(args) -> list[str]:
    """The run's impls that reach the sm90 CuTe kernels."""
    out = []
    for name in args.impls:
        adapter = impl_mod.make(name)
        if isinstance(adapter, impl_mod.FlexjitImpl) and adapter.backend in CUTE_BACKENDS:
            out.append(name)
    return out


def specs(args, seed: int) -> list[Spec]:
    """Every CuTe (pass, case, variant, impl) of the run, its variants built from ``seed`` in
    the order the run builds them (``Runner.prepare``: once per (case, variant), at first need)."""
    names = cute_impls(args)
    fp8 = {n for n in names if getattr(impl_mod.make(n), "fp8", False)}  # forward only
    gen = torch.Generator().manual_seed(seed)
    states: dict = {}
    out = []
    for pass_, case, vname in run_mod.grid(args):
        if (case, vname) not in states:
            states[(case, vname)] = gen.get_state()
            build(vname, case, CPU, gen)  # advances gen as the run's build does
        out += [Spec(pass_, case, vname, n, bool(args.deterministic), states[(case, vname)])
                for n in names if pass_ == "fwd" or n not in fp8]
    return out


def draws_data(spec: Spec) -> bool:
    """Whether the variant's build draws from the generator (its captured data are random)."""
    gen = torch.Generator()
    gen.set_state(spec.gen_state)
    build(spec.variant, spec.case, CPU, gen)
    return not torch.equal(gen.get_state(), spec.gen_state)


def rebuild(spec: Spec):
    """The run's Variant for ``spec``, its captured tensors on the CPU."""
    gen = torch.Generator()
    gen.set_state(spec.gen_state)
    return build(spec.variant, spec.case, CPU, gen)


@contextlib.contextmanager
def impl_context(spec: Spec):
    """The run's switches for ``spec``: its --deterministic, then the impl's own (``context``)."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(spec.deterministic, warn_only=True)
    try:
        with impl_mod.make(spec.impl).context():
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=True)


def run_call(spec: Spec, memo: dict | None = None):
    """(call, variant): the flexjit call the run makes for ``spec``, on CPU tensors without data;
    for an FP8 impl the call the sm90 backend is handed (dequantised where it reads no FP8).
    ``memo``: kept across calls, so that the specs of one (case, variant, draw) share the
    variant and block mask (as the run's passes do) and consecutive specs (the impls of one
    grid entry) their call."""
    import flexjit
    from flexjit.api.attention import prepare_call
    from flexjit.backends.cute import sm90 as cute_sm90

    memo = {} if memo is None else memo
    c = spec.case
    built = (c, spec.variant, spec.gen_state.numpy().tobytes())
    if built not in memo:
        variant = rebuild(spec)
        memo[built] = variant, impl_mod.plan_mask(flexjit.create_block_mask, variant, c, CPU)
    variant, bm = memo[built]
    last = memo.get("call")  # only the latest call (its q/k/v are full-size, if unwritten)
    impl = impl_mod.make(spec.impl)
    options = impl.kernel_options or None
    fp8 = bool(getattr(impl, "fp8", False))  # e4m3 q, k, v, the case's dtype out
    # The impl's switches are part of the call: two modes of one case differ only there.
    mine = (spec.pass_, built, tuple(sorted((options or {}).items())), fp8)
    if last is None or last[0] != mine:
        grad = spec.pass_ == "fwdbwd"
        dtype = torch.float8_e4m3fn if fp8 else c.dtype
        q = torch.empty(c.B, c.Hq, c.S, c.D, dtype=dtype).requires_grad_(grad)
        k = torch.empty(c.B, c.Hkv, c.S, c.D, dtype=dtype).requires_grad_(grad)
        v = torch.empty(c.B, c.Hkv, c.S, c.dv, dtype=dtype).requires_grad_(grad)
        call = prepare_call(q, k, v, variant.score_mod, bm, None, c.gqa, options,
                            fp8=(None, None, None, c.dtype if fp8 else None))
        if fp8 and not cute_sm90.fp8_native(call)[0]:
            call = call.dequantized()  # the dispatcher's road around a kernel that reads no FP8
        last = memo["call"] = (mine, call)
    return last[1], variant


@contextlib.contextmanager
def _recording(keys: list):
    """While inside: every disk lookup appends its key to ``keys`` and finds nothing, and
    ``cute.compile`` raises ``_Probed`` (so nothing is compiled, stored or launched)."""
    import cutlass.cute as cute

    from flexjit.backends.cute import objects as cute_cache

    def load(key):
        keys.append(key)
        return None

    def no_compile(*a, **kw):
        raise _Probed

    saved = (cute_cache.load, cute.compile)
    cute_cache.load, cute.compile = load, no_compile
    try:
        yield
    finally:
        cute_cache.load, cute.compile = saved


def run_keys(spec: Spec, memo: dict | None = None) -> dict:
    """{("fwd" | "bwd", part): disk key} of the CuTe kernels the run's call for ``spec`` looks
    up, found by sending that call through ``cute_sm90.forward`` / ``backward`` with the lookups
    recorded (``_recording``). Empty where the run would not use them: head dims the sm90
    forward lacks (the impl skips the case), a backward it leaves to Triton."""
    from flexjit.backends.cute import sm90 as backend

    c = spec.case
    if (c.D, c.dv) not in backend._HEAD_DIMS or c.dtype not in (torch.float16, torch.bfloat16):
        return {}
    with impl_context(spec):
        call, _ = run_call(spec, memo)
        out = {}
        fwd: list = []
        with _recording(fwd), torch.no_grad(), contextlib.suppress(_Probed):
            backend.forward(call)
        if len(fwd) != 1:
            raise RuntimeError(f"{spec.what()}: the forward looked up {len(fwd)} disk keys, not 1 "
                               "(is the disk cache off, FLEXJIT_CACHE=0, or TVM-FFI missing?)")
        out[("fwd", "main")] = fwd[0]
        if spec.pass_ == "fwdbwd" and backend.backward_supports(call)[0]:
            bwd: list = []
            q, k, v = (t.detach() for t in (call.q, call.k, call.v))
            o = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
            lse = torch.empty(q.shape[:-1], dtype=torch.float32)
            with _recording(bwd), torch.no_grad(), contextlib.suppress(_Probed):
                backend.backward(call, q, k, v, o, lse, torch.empty_like(o), None)
            parts = backend._bwd_host().PARTS
            if len(bwd) != len(parts):
                raise RuntimeError(f"{spec.what()}: the backward looked up {len(bwd)} disk keys, "
                                   f"not {len(parts)}")
            out.update({("bwd", p): key for p, key in zip(parts, bwd)})
    return out


def plan(all_specs: list[Spec]) -> tuple[list[Job], dict, list[str]]:
    """(jobs, on_disk, errors): one job per forward key and per backward key triple that is not
    all on disk yet, the backward first (the longest compiles start first); on_disk: {key:
    (spec, pass, part)} of the needed kernels already in the cache; errors: the calls whose
    keys could not be found (the run's own call would fail the same way, or this is a bug)."""
    from flexjit.backends.cute import objects as cute_cache

    jobs: dict = {}
    on_disk: dict = {}
    errors: list = []
    memo: dict = {}
    for spec in all_specs:
        try:
            keys = run_keys(spec, memo)
        except Exception as e:
            errors.append(f"{spec.what()} {spec.pass_}: {type(e).__name__}: {e}")
            continue
        for pass_ in ("bwd", "fwd"):
            mine = {part: key for (p, part), key in keys.items() if p == pass_}
            if not mine:
                continue
            ident = (pass_, tuple(sorted(mine.values())))
            if ident in jobs:
                jobs[ident].users += 1
                continue
            present = {key for key in mine.values() if cute_cache.object_path(key).exists()}
            for part, key in mine.items():
                if key in present:
                    on_disk.setdefault(key, (spec, pass_, part))
            if len(present) < len(mine):
                jobs[ident] = Job(spec, pass_, mine)
    order = sorted(jobs.values(), key=lambda j: j.pass_ != "bwd")
    return order, on_disk, errors


def compile_job(job: Job) -> dict:
    """In a worker: ``aot.compile_kernels`` for the job's spec, with the run's mods, block mask,
    batch and switches; {"kernels": [(part, key, seconds)], "error": None or text}."""
    from flexjit.integrations import aot

    spec, c = job.spec, job.spec.case
    try:
        with impl_context(spec):
            call, variant = run_call(spec)
            fp8 = call.fp8 is not None  # run_call: an FP8 call only where the kernel reads FP8
            kernels = aot.compile_kernels(
                variant.score_mod, variant.mask_mod, arch=ARCH, head_dim=c.D, head_dim_v=c.dv,
                dtype=call.q.dtype, out_dtype=call.out_dtype if fp8 else None,
                passes=(job.pass_,),
                seq_len=c.S, heads=c.Hq, kv_heads=c.Hkv,
                deterministic=torch.are_deterministic_algorithms_enabled(), batch=c.B,
                block_mask=call.block_mask, name=spec.variant,
                kernel_options=call.kernel_options)
    except Exception as e:
        return {"kernels": [], "error": f"{type(e).__name__}: {e}"}
    # The run's own kernels first; the forward's other tuning candidates after them (the run's
    # tuner measures them all on its first call, with nothing left to compile).
    got: dict = {}
    for k in kernels:
        got.setdefault(k.part, k.cache_key)
    own = [(k.part, k.cache_key, k.seconds) for k in kernels if k.cache_key in got.values()]
    extra = [(k.part, k.cache_key, k.seconds, k.what) for k in kernels
             if k.cache_key not in got.values()]
    error = None if got == job.keys else f"aot stored {got}, the run looks up {job.keys}"
    return {"kernels": own, "candidates": extra, "error": error}


def make_parser():
    p = run_mod.make_parser()
    p.prog = "python -m benchmarks.prewarm"
    p.description = ("Compile, in parallel, the flexjit CuTe kernels that `benchmarks.run` with "
                     "the same flags would compile, into the disk cache (FLEXJIT_CACHE_DIR)")
    for action in p._actions:
        if action.dest == "out":
            action.required = False
            action.help = "accepted and ignored (benchmarks.run's flag)"
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                   help="worker processes (default: the cores less two)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the kernels the run needs and which are cached; compile nothing")
    return p


@contextlib.contextmanager
def _workers_env():
    """What the workers are started with: no GPU (CPU tensors; nothing touches the GPU the run
    is about to use) and CuTeDSL compiling for sm_90a. Restored afterwards."""
    with overlay({"CUDA_VISIBLE_DEVICES": "", "CUTE_DSL_ARCH": ARCH}):
        yield


def compile_all(jobs: list[Job], workers: int, on_disk: set) -> set:
    """Run the jobs in ``workers`` spawned processes, printing each kernel as its job ends;
    the keys compiled (those not already on disk)."""
    import concurrent.futures as cf
    import multiprocessing

    done: set = set()
    if not jobs:
        return done
    ctx = multiprocessing.get_context("spawn")
    with _workers_env(), cf.ProcessPoolExecutor(max_workers=min(workers, len(jobs)),
                                                mp_context=ctx) as pool:
        futures = {pool.submit(compile_job, job): job for job in jobs}
        for fut in cf.as_completed(futures):
            job = futures[fut]
            try:
                res = fut.result()
            except Exception as e:  # a worker that died (killed, out of memory)
                res = {"kernels": [], "error": f"worker: {type(e).__name__}: {e}"}
            shared = f" (and {job.users - 1} more calls)" if job.users > 1 else ""
            for part, key, seconds in res["kernels"]:
                took = f"{seconds:.1f} s" + (" (the 3 parts)" if job.pass_ == "bwd" else "")
                print(f"compiled {job.pass_} {part:4} {job.spec.what()} {job.spec.pass_}{shared}: "
                      f"{took}; {key}.o", flush=True)
            for part, key, seconds, what in res.get("candidates", ()):
                print(f"candidate {job.pass_} {part:4} {what}: {seconds:.1f} s; {key}.o", flush=True)
            if res["error"]:
                print(f"FAILED   {job.pass_} {job.spec.what()} {job.spec.pass_}: {res['error']}",
                      flush=True)
            else:
                done |= set(job.keys.values()) - on_disk
    return done


def main(argv=None) -> int:
    # CuTeDSL reads the arch once, at its first compile; this process only traces and keys.
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    from flexjit.backends import kernel_cache as cache
    from flexjit.backends.cute import objects as cute_cache

    args = run_mod.parse_args(argv, make_parser())
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
    if not cute_cache.available():
        raise SystemExit("prewarm: the CuTe disk cache is off (FLEXJIT_CACHE=0) or TVM-FFI is not "
                         "importable: a run could load nothing")
    t0 = time.perf_counter()
    all_specs = specs(args, args.seed)
    if make_parser().parse_args(argv).seed is None:
        # The run will draw its own seed: where a build draws (document ids), probe several
        # draws and compile every distinct kernel.
        all_specs += [s for seed in range(1, DRAWS) for s in specs(args, seed) if draws_data(s)]
    jobs, on_disk, errors = plan(all_specs)
    for err in errors:
        print(f"FAILED   to find the keys of {err}", flush=True)
    todo = {key for job in jobs for key in job.keys.values()} - set(on_disk)
    print(f"prewarm: {len(all_specs)} CuTe calls of the run "
          f"({', '.join(cute_impls(args)) or 'no CuTe impl'}) need {len(todo) + len(on_disk)} "
          f"kernels: {len(on_disk)} already cached, {len(todo)} to compile in {len(jobs)} jobs "
          f"on {min(args.jobs, max(len(jobs), 1))} workers; cache "
          f"{cache.cache_dir('cute')}; planned in {time.perf_counter() - t0:.1f} s",
          flush=True)
    for key, (spec, pass_, part) in on_disk.items():
        print(f"cached   {pass_} {part:4} {spec.what()} {spec.pass_}: {key}.o", flush=True)
    if args.dry_run:
        for job in jobs:
            for part, key in job.keys.items():
                if key not in on_disk:
                    print(f"needed   {job.pass_} {part:4} {job.spec.what()} {job.spec.pass_}: "
                          f"{key}.o", flush=True)
        return 1 if errors else 0
    done = compile_all(jobs, args.jobs, set(on_disk))
    missing = todo - done
    print(f"prewarm: {len(done)} compiled, {len(on_disk)} already cached, {len(missing)} failed"
          + (f", {len(errors)} calls not probed" if errors else "")
          + f", in {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if missing or errors else 0


if __name__ == "__main__":
    sys.exit(main())
