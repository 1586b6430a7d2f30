"""flexjit called from several threads at once: every call gets its own right answer.

* CPU: eight threads, each with a different mod, call ``flex_attention`` together (a barrier
  lines them up) on the Triton interpreter and on the reference backend; each result is checked
  against the float64 oracle with tolerances from the data (err <= 2·err(plain torch in the
  test dtype) + floor). The first calls render, import and interpret kernels concurrently, the
  second ones reuse them, so both the build and the launch paths run under contention.
* Whatever TRITON_INTERPRET says, a module's kernels are of the kind its caller asked for, and
  the variable is left alone.
* GPU (``gpu`` marker): the same with compiled Triton and CuTe kernels on CUDA.
"""
from concurrent.futures import ThreadPoolExecutor
import os
import threading

import pytest
import torch

from flexjit import create_block_mask
from flexjit.api.attention import flex_attention
from flexjit.backends.triton import sources
from flexjit.frontend.trace import MASK_MOD, trace_mod
from flexjit.ir.nodes import Op, uses
from mods_catalog import lowered, make_case
from oracle import FLOOR, assert_close_to_oracle, dense_attention, random_qkv

# Eight mods of different kinds (mask only, score only, captured tensors, per-head), one per
# thread: a result computed with another thread's mod, or another thread's grid position,
# shows up as an error far above the tolerance.
NAMES = ["full", "causal", "sliding_window", "document", "alibi", "softcap", "relative_bias",
         "head_dependent"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """A fresh kernel cache and no modules in memory, so the threads build concurrently."""
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLEXJIT_POISON", "1")
    sources.forget_imported()
    yield
    sources.forget_imported()


def _block_mask(mask_mod, B, H, L, S, device, block_size):
    if mask_mod is None:
        return None
    traced = trace_mod(mask_mod, MASK_MOD).out
    return create_block_mask(mask_mod, B if uses(traced, Op.B) else None,
                             H if uses(traced, Op.H) else None, L, S, device=device,
                             BLOCK_SIZE=block_size)


def _run_threads(backend, device, shape, dtype, block_size, rounds=2):
    """Every case's (out, lse) from each round, all eight threads calling at once."""
    B, H, L, S, E = shape
    torch.manual_seed(0)  # captured tensors drawn here, in one thread
    cases = [make_case(n, B, H, L, S, device) for n in NAMES]
    inputs = [tuple(t.detach().to(device) for t in random_qkv(B, H, H, L, S, E, E, dtype, seed))
              for seed in range(len(NAMES))]
    barrier = threading.Barrier(len(NAMES))

    def one(i):
        case, (q, k, v) = cases[i], inputs[i]
        got = []
        try:
            for _ in range(rounds):
                barrier.wait()
                bm = _block_mask(case.mask_mod, B, H, L, S, device, block_size)
                got.append(flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm,
                                          return_lse=True, backend=backend))
        except BaseException:
            barrier.abort()  # the other threads stop waiting for this one
            raise
        return got

    with ThreadPoolExecutor(len(NAMES)) as pool:
        futures = [pool.submit(one, i) for i in range(len(NAMES))]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                 next((e for e in errors if e is not None), None))
    if first is not None:  # the thread that failed first, not those it released
        raise first
    results = [f.result() for f in futures]
    for name, case, (q, k, v), got in zip(NAMES, cases, inputs, results):
        ref, ref_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=torch.float64)
        low, low_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=dtype)
        for r, (out, lse) in enumerate(got):
            assert_close_to_oracle(f"{name} round {r} out", out, ref, low, FLOOR[dtype])
            assert_close_to_oracle(f"{name} round {r} lse", lse, ref_lse, low_lse, FLOOR[dtype])


# Two heads of 64 × 80 at D = 16 with 32-blocks: several programs per grid (so a wrong program
# id shows), a ragged kv edge, and eight interpreted kernels in about a minute on two cores.
CPU_SHAPE = (1, 2, 64, 80, 16)


def test_threads_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _run_threads("triton", "cpu", CPU_SHAPE, torch.float32, block_size=32)
    # The calls selected the interpreter without leaving the process's setting changed.
    assert sources.interpreting()


@pytest.mark.parametrize("setting", ["1", None])
def test_kernel_kind_follows_the_call_not_the_variable(setting, monkeypatch):
    """A module's kernels are interpreted or compiled as its caller asks, whatever
    TRITON_INTERPRET says while it is imported, and the variable is never touched."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if setting is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", setting)
    program = lowered(None, make_case("causal", 1, 1, 8, 8).mask_mod)
    compiled = sources.load_module(program, "fwd", interpret=False)
    interpreted = sources.load_module(program, "fwd", interpret=True)
    assert type(compiled.flex_fwd) is JITFunction and type(compiled._attend) is JITFunction
    assert isinstance(interpreted.flex_fwd, InterpretedFunction)
    assert isinstance(interpreted._attend, InterpretedFunction)
    assert os.environ.get("TRITON_INTERPRET") == setting


def test_threads_reference():
    _run_threads("reference", "cpu", CPU_SHAPE, torch.float32, block_size=32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_threads_gpu(backend, monkeypatch):
    """Compiled kernels from eight threads: the builds (Triton's JIT, CuTe's compiles and disk
    exports) and the launches interleave. bf16 at D = 128 with 128-blocks, the kernels' common
    configuration; 2 heads × 512 × 640 gives every kernel several tiles and a ragged edge."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if backend == "cute" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the CuTe kernels need sm90 or newer")
    _run_threads(backend, "cuda", (1, 2, 512, 640, 128), torch.bfloat16, block_size=128)
