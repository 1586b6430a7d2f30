"""The sm90 forward's TVM-FFI launch path and the disk cache of compiled CuTe kernels.

CPU (CUTE_DSL_ARCH=sm_90a; an object file that targets sm_90a loads on a machine without a
driver, only its launch needs one):
* ``flexjit.backends.cute.objects`` mechanics with a stand-in exporter: temporary name then replace, one
  export when several processes race, ``FLEXJIT_CACHE=0``, a corrupt file is dropped.
* ``compile_program`` exports ``<kernel_key>.o`` holding exactly the cubin it compiled; a second
  process loads it with ``cute.compile`` patched to raise, and the loaded function's argument
  checks run up to the device check; another program gets another file.
* The TVM-FFI compile (placeholder tensors, no data) gives the PTX, byte for byte, that the DLPack
  path gives for CUDA tensors, so the launch change leaves the device code as measured.
* The call ABI: a variant compiled for CPU memory takes the exact call the GPU path makes (torch
  tensors, ``BlockSparse``, aux tuples, Python floats/ints, ``None``) up to the kernel launch,
  and rejects what the old Python checks rejected (misaligned base, strides not multiple of 8,
  wrong dtypes, a missing block mask, an int scalar passed as float).
GPU (marker ``gpu``, Hopper only): compile in process A, load in process B (no compile) and
compare B's output with A's and with the float64 oracle; the launch follows torch's current
stream; the DLPack fallback gives the same bits.

Sizes: L=300, S=500 (neither a multiple of 128, L != S), GQA 4/2: the compile must not depend
on any of them. Each compile takes ~5 s on the dev CPU; the file takes ~60 s.
"""
import ctypes
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")
import cutlass.cute as cute  # noqa: E402

from flexjit.backends import kernel_cache as cache  # noqa: E402
from flexjit import create_block_mask
from flexjit import mods
from flexjit.backends.cute import objects as cute_cache  # noqa: E402
from flexjit.backends.cute import sm90 as backend  # noqa: E402
from flexjit.ir.passes import lower  # noqa: E402
from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, trace_mod  # noqa: E402

from children import CHILD_NO_COMPILE  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
B, HQ, HKV, L, S, D = 2, 4, 2, 300, 500, 128
HAS_GPU = torch.cuda.is_available()


def build(name: str, device="cpu", dtype=torch.bfloat16, seed=0):
    """(program, q, k, v, block lists, aux tensors, score_mod, mask_mod) for a named test program.
    Seeded: a second process rebuilds the same program and inputs."""
    torch.manual_seed(seed)
    if name == "softcap_causal":  # the brief's pair: a float scalar + a block mask
        score, mask = mods.softcap(20.0), mods.causal()
    elif name == "sliding_window":  # another program: an int scalar, no score_mod
        score, mask = None, mods.sliding_window(96)
    elif name == "abi":  # every argument kind: bool aux tensor, float and int scalars, block mask
        keep = torch.rand(S, device=device) > 0.2
        window = 96

        def keep_window(b, h, q_idx, kv_idx):
            return keep[kv_idx] & (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        score, mask = mods.softcap(20.0), keep_window
    else:
        raise KeyError(name)
    program = lower(trace_mod(score, SCORE_MOD) if score else None, trace_mod(mask, MASK_MOD))
    bm = create_block_mask(mask, B, HQ, L, S, device=device)
    q = torch.randn(B, HQ, L, D, device=device, dtype=dtype)
    k, v = [torch.randn(B, HKV, S, D, device=device, dtype=dtype) for _ in range(2)]
    aux = tuple(backend._aux_tensor(t, q.device) for t in program.buffers)
    return program, q, k, v, backend.block_sparse_args(bm), aux, score, mask


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private cache folder, the disk cache on, and an empty in-memory kernel table."""
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLEXJIT_CACHE", raising=False)
    monkeypatch.setattr(backend, "_COMPILED", {})
    return tmp_path / "cache" / "cute"


def _objects(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.o")) if folder.exists() else []


def _run_child(code: str, env_extra: dict, timeout=600) -> dict:
    """Run ``code`` in a fresh interpreter (a second process); it prints one JSON line last."""
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"child failed:\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ cache mechanics (no compile)


def _writer(text: str, calls: list | None = None, delay: float = 0.0):
    """A stand-in for CompiledFwd.export: writes ``text`` to the path it is given."""
    def export(path: str, function_name: str):
        assert path.endswith(".o") and function_name == cute_cache.FUNCTION_NAME
        if calls is not None:
            calls.append(path)
        time.sleep(delay)
        Path(path).write_text(text)
    return export


def test_store_writes_once_under_the_key(cache_dir):
    calls = []
    path = cute_cache.store("k1", _writer("first", calls))
    assert path == cache_dir / "k1.o" and path.read_text() == "first"
    # The export went to a private temporary name, replaced into place, and nothing is left over.
    assert calls and Path(calls[0]).name != "k1.o"
    assert sorted(p.name for p in cache_dir.iterdir()) == ["k1.lock", "k1.o", "k1.o.meta"]
    assert cache.verify(path, cute_cache.FUNCTION_NAME) == cache.OK  # sealed
    # Already there (another process won the race): no second export, the file is untouched.
    assert cute_cache.store("k1", _writer("second", calls)) == path
    assert len(calls) == 1 and path.read_text() == "first"


def test_cache_off_stores_and_loads_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("FLEXJIT_CACHE", "0")
    assert cute_cache.store("k2", _writer("x")) is None
    assert _objects(cache_dir) == []
    monkeypatch.setenv("FLEXJIT_CACHE", "1")
    cute_cache.store("k2", _writer("x"))
    monkeypatch.setenv("FLEXJIT_CACHE", "0")
    assert cute_cache.load("k2") is None


def test_failed_export_leaves_no_file(cache_dir):
    def broken(path, name):
        Path(path).write_text("half")
        raise RuntimeError("export failed")
    assert cute_cache.store("k3", broken) is None
    assert _objects(cache_dir) == [] and not list(cache_dir.glob("*.tmp*"))


def test_corrupt_file_is_dropped(cache_dir):
    cute_cache.store("k4", _writer("not an object file"))
    with pytest.warns(cache.CacheWarning, match="k4.o"):
        assert cute_cache.load("k4") is None
    assert not (cache_dir / "k4.o").exists()  # so the next compile's export replaces it


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "directory"])
def test_damaged_object_file_is_reported_and_replaced(cache_dir, damage):
    """A sealed file damaged afterwards is never handed to the DSL: one warning naming it, the
    file removed, and the next store writes a good one (the stand-in's bytes are not loadable,
    so this stops at the seal, where a real object file would load)."""
    path = cute_cache.store(f"d-{damage}", _writer("payload " * 100))
    if damage == "directory":
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("x")
    else:
        path.write_bytes({"truncated": path.read_bytes()[:50], "empty": b"",
                          "garbage": os.urandom(800)}[damage])
    with pytest.warns(cache.CacheWarning, match=path.name):
        assert cute_cache.load(f"d-{damage}") is None
    assert not path.exists()
    assert cute_cache.store(f"d-{damage}", _writer("payload " * 100)) == path
    assert cache.verify(path, cute_cache.FUNCTION_NAME) == cache.OK


def test_racing_processes_export_once(cache_dir):
    """Four processes store the same key at once with a slow exporter: one export, whole file."""
    code = f"""
        import json, sys
        from pathlib import Path
        from flexjit.backends.cute import objects as cute_cache
        def export(path, name):
            import time
            with open({str(cache_dir / 'exports.log')!r}, "a") as f:
                f.write(path + "\\n")
            time.sleep(0.5)
            Path(path).write_text("payload " * 1000)
        print(json.dumps({{"path": str(cute_cache.store("race", export))}}))
    """
    env = {"FLEXJIT_CACHE_DIR": str(cache_dir.parent)}
    procs = []
    for _ in range(4):
        e = dict(os.environ, **env, PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {json.loads(o.strip().splitlines()[-1])["path"] for o, _ in outs}
    assert paths == {str(cache_dir / "race.o")}
    assert len((cache_dir / "exports.log").read_text().splitlines()) == 1
    assert (cache_dir / "race.o").read_text() == "payload " * 1000


def test_generated_mods_file_follows_its_text(cache_dir, monkeypatch):
    # A flexjit that renders a program differently (a later version over the same cache folder)
    # must import its own text, never the older file of the same program.
    monkeypatch.setattr(backend, "_MODULES", {})
    program = lower(None, trace_mod(mods.causal(), MASK_MOD))
    first = backend.load_mods(program)
    monkeypatch.setattr(backend, "_MODULES", {})
    monkeypatch.setattr(backend, "render", _later)
    second = backend.load_mods(program)
    assert not hasattr(first, "LATER") and second.LATER == 1
    assert len(list(cache_dir.glob("mods_*.py"))) == 2


def _later(program):
    from flexjit.backends.cute.render import render
    return render(program) + "\nLATER = 1\n"


def test_key_options_and_config():
    assert backend._key_options("--keep-ptx --dump-dir /tmp/x --keep-cubin") == ""
    assert backend._key_options("--dump-dir=/a --opt-level 2") == "--opt-level 2"
    tpl = backend._template()
    import cutlass
    prog = lower(None, trace_mod(mods.causal(), MASK_MOD))
    keys = set()
    for d in (64, 128):
        for sparse in (False, True):
            for dtype in (cutlass.BFloat16, cutlass.Float16):
                cfg = tpl.FwdConfig(d, d, dtype, None, None, has_block_mask=sparse)
                keys.add(cache.kernel_key(prog.key, "cute_sm90_fwd",
                                          backend._frozen_config(cfg, (), prog, ""), "sm90"))
    assert len(keys) == 8  # head dim, block-mask presence and dtype each change the file


# ------------------------------------------------------------------ compile, export, load (CPU)


# A second process's first lines: cute.compile raises, flexjit's log lines are kept in
# ``messages`` (also tests/integrations/test_aot.py's).

_CHILD_LOAD = CHILD_NO_COMPILE + """
    import torch
    from test_cute_cache import build
    from flexjit.backends.cute.sm90 import compile_program
    program, q, k, v, blocks, aux, _, _ = build("softcap_causal")
    fn = compile_program(program, q, k, v, blocks, aux)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1])
    call_error = None
    if not torch.cuda.is_available():
        try:
            fn(q, k, v, o, lse, 0.125, blocks, aux, program.scalars)
        except Exception as e:
            call_error = f"{type(e).__name__}: {e}"
    print(json.dumps({"loaded": fn.compiled is None and fn.tvm_ffi, "messages": messages,
                      "call_error": call_error}))
"""


def test_second_process_loads_without_compiling(cache_dir, tmp_path):
    program, q, k, v, blocks, aux, _, _ = build("softcap_causal")
    fn = backend.compile_program(program, q, k, v, blocks, aux,
                                 options=f"--keep-cubin --dump-dir {tmp_path}")
    assert fn.tvm_ffi, "TVM-FFI is importable, so the kernel must be compiled for it"
    (obj,) = _objects(cache_dir)
    assert fn.compiled.__cubin__ and fn.compiled.__cubin__ in obj.read_bytes(), \
        "the exported object must embed exactly the cubin that was compiled"

    child = _run_child(_CHILD_LOAD, {"FLEXJIT_CACHE_DIR": str(cache_dir.parent)})
    assert child["loaded"], child
    assert any("loaded from disk" in m and obj.name in m for m in child["messages"]), child
    assert not any("compiled in" in m for m in child["messages"]), child
    assert _objects(cache_dir) == [obj]
    if not HAS_GPU:
        # The loaded wrapper is our kernel's: it names our parameters and checked every argument
        # before the device type (CPU tensors; the launch needs a GPU).
        err = child["call_error"]
        assert err and "expected device_type=cuda" in err, err
        assert "mQ: Tensor(" in err and "blocks: Tuple[" in err and "aux_scalars: Tuple[float32]" in err

    # Another program gets another file; the first one stays.
    program2, q2, k2, v2, blocks2, aux2, _, _ = build("sliding_window")
    backend.compile_program(program2, q2, k2, v2, blocks2, aux2)
    objs = _objects(cache_dir)
    assert len(objs) == 2 and obj in objs


# ------------------------------------------------------------------ same device code as before


class _CudaView:
    """A DLPack producer that shows a CPU tensor's dtype, shape and strides as a CUDA tensor's
    (the data pointer is never read): what ``from_dlpack`` sees on the GPU, without a GPU."""

    class _Device(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class _DType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class _DLTensor(ctypes.Structure):
        pass

    class _Managed(ctypes.Structure):
        pass

    _DLTensor._fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
                          ("dtype", _DType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                          ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]
    _Managed._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                         ("deleter", ctypes.c_void_p)]
    _alive: list = []  # the structs must outlive the compile

    def __init__(self, t):
        self.t = t

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA

    def __dlpack__(self, stream=None, **kwargs):
        t = self.t
        code = {torch.bfloat16: 4, torch.bool: 6}.get(t.dtype, 2 if t.dtype.is_floating_point else 0)
        shape = (ctypes.c_int64 * t.ndim)(*t.shape)
        strides = (ctypes.c_int64 * t.ndim)(*t.stride())
        m = self._Managed()
        m.dl_tensor = self._DLTensor(0x7F0000000000, self._Device(2, 0), t.ndim,
                                     self._DType(code, t.element_size() * 8, 1), shape, strides, 0)
        self._alive.append((m, shape, strides))
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(m), b"dltensor", None)


def _cfg_for(program, q, blocks):
    tpl = backend._template()
    m = backend.load_mods(program)
    return tpl, tpl.FwdConfig(D, D, backend._cutlass_dtype(q.dtype), m.score_mod, m.mask_mod,
                              has_block_mask=blocks is not None)


def test_tvm_ffi_compile_gives_the_dlpack_paths_ptx(cache_dir, monkeypatch, tmp_path):
    program, q, k, v, blocks, aux, _, _ = build("abi")
    tpl, cfg = _cfg_for(program, q, blocks)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:-1])
    new = tpl.compile_fwd(cfg, q, k, v, o, lse, blocks, aux, program.scalars,
                          options=f"--keep-ptx --dump-dir {tmp_path}", use_tvm_ffi=True)
    from cutlass.cute.runtime import from_dlpack
    monkeypatch.setattr(tpl, "_as_cute", lambda t, align=16: from_dlpack(
        _CudaView(t.detach()), assumed_align=align).mark_layout_dynamic(leading_dim=t.ndim - 1))
    old = tpl.compile_fwd(cfg, q, k, v, o, lse, blocks, aux, program.scalars,
                          options=f"--keep-ptx --dump-dir {tmp_path}", use_tvm_ffi=False)
    assert new.tvm_ffi and not old.tvm_ffi
    assert "wgmma.mma_async" in new.compiled.__ptx__
    assert new.compiled.__ptx__ == old.compiled.__ptx__, "the launch path changed the device code"


# ------------------------------------------------------------------ the call ABI (CPU)


@pytest.mark.skipif(HAS_GPU, reason="launches on CPU pointers; meaningful only without a GPU")
def test_call_abi_up_to_the_launch(cache_dir, monkeypatch):
    """The GPU wrapper takes CUDA tensors and the env stream; a variant whose placeholders live in
    CPU memory (and which takes an explicit stream) runs the same argument decoding on the CPU."""
    program, q, k, v, blocks, aux, _, _ = build("abi")
    assert [t.dtype for t in aux] == [torch.bool] and [type(x) for x in program.scalars] == [float, int]
    tpl, cfg = _cfg_for(program, q, blocks)
    fake_tensor, fake_stream = cute.runtime.make_fake_tensor, cute.runtime.make_fake_stream
    monkeypatch.setattr(cute.runtime, "make_fake_tensor", lambda *a, **kw: fake_tensor(
        *a, memspace=cute.AddressSpace.generic, **kw))
    monkeypatch.setattr(cute.runtime, "make_fake_stream", lambda **kw: fake_stream())
    o, lse = torch.empty_like(q), torch.empty(q.shape[:-1])
    fn = tpl.compile_fwd(cfg, q, k, v, o, lse, blocks, aux, program.scalars, use_tvm_ffi=True)

    def call(q=q, k=k, lse=lse, blocks=blocks, aux=aux, scalars=program.scalars):
        fn.ffi_fn(*tpl._ffi_launch_args(cfg, q, k, v, o, lse, 0.125, blocks, aux, scalars), 0)

    # Everything accepted: the wrapper gets as far as the CUDA runtime (no driver here).
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        call()
    with pytest.raises(RuntimeError, match="(?i)cuda"):  # non-contiguous aux: copied, accepted
        call(aux=(torch.stack([aux[0], aux[0]], 1)[:, 0],))
    wide = torch.randn(B, HQ, L, D + 4, dtype=q.dtype)
    bad = {
        "Misaligned Tensor data on argument #0": dict(q=wide.view(-1)[1:1 + q.numel()].view(q.shape)),
        "divisible by 8": dict(q=wide[..., :D]),
        "argument #4": dict(lse=lse.double()),
        "argument #7": dict(blocks=None),
        "aux_tensors[0]": dict(aux=(aux[0].int(),)),
        "aux_scalars[1]": dict(scalars=(program.scalars[0], float(program.scalars[1]))),
    }
    for what, kwargs in bad.items():
        with pytest.raises((ValueError, TypeError), match=re.escape(what)):
            call(**kwargs)


# ------------------------------------------------------------------ GPU: compile in A, load in B

_GPU_CHILD = """
    import json, os, sys
    import torch
    role, name, out_file = sys.argv[1:4]
    if role == "load":
        import cutlass.cute as cute

        def _no_compile(*args, **kwargs):
            raise AssertionError("cute.compile called in process B")
        cute.compile = _no_compile
    from flexjit import create_block_mask, explain, flex_attention
    from flexjit.backends.cute import sm90 as cute_sm90
    from mods_catalog import make_case
    from oracle import FLOOR, assert_close_to_oracle, dense_attention

    torch.manual_seed(0)
    B, Hq, Hkv, L, S, D = 2, 16, 4, 1000, 1000, 128
    case = make_case(name, B, Hq, L, S, device="cuda")
    q = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16)
    k, v = [torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cuda") if case.mask_mod else None
    # AUTOTUNE off: one kernel per process (the tuner would compile the other schedule in a worker)
    opts = {"AUTOTUNE": False}
    choice = explain(q, k, v, case.score_mod, bm, enable_gqa=True, kernel_options=opts)
    assert choice.name == "cute", str(choice)
    with torch.no_grad():
        out, lse = flex_attention(q, k, v, case.score_mod, bm, enable_gqa=True, return_lse=True,
                                  kernel_options=opts)
    torch.cuda.synchronize()
    (fn,) = cute_sm90._COMPILED.values()
    if role == "compile":
        torch.save({"out": out.cpu(), "lse": lse.cpu()}, out_file)
    else:
        first = torch.load(out_file)
        assert torch.equal(out.cpu(), first["out"]) and torch.equal(lse.cpu(), first["lse"])
        ref, ref_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=torch.float64)
        low, low_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=torch.bfloat16)
        assert_close_to_oracle("out", out, ref, low, FLOOR[torch.bfloat16])
        assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.bfloat16])
    print(json.dumps({"loaded": fn.compiled is None, "tvm_ffi": fn.tvm_ffi}))
"""


def _gpu_child(role, name, out_file, cache_root):
    # keep the caller's PYTHONPATH (on the GPU box it carries cutlass-dsl from the device bundle)
    paths = [str(REPO), str(REPO / "tests"), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, FLEXJIT_CACHE_DIR=str(cache_root), PYTHONPATH=os.pathsep.join(p for p in paths if p))
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_GPU_CHILD), role, name, str(out_file)],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{role} failed:\n{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


needs_hopper = pytest.mark.skipif(
    not HAS_GPU or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("name", ["alibi", "document"])  # fp32 / int64 aux tensors, block masks
def test_gpu_second_process_runs_the_loaded_kernel(name, tmp_path):
    a = _gpu_child("compile", name, tmp_path / "a.pt", tmp_path / "cache")
    assert a == {"loaded": False, "tvm_ffi": True}
    assert len(_objects(tmp_path / "cache" / "cute")) == 1
    b = _gpu_child("load", name, tmp_path / "a.pt", tmp_path / "cache")
    assert b == {"loaded": True, "tvm_ffi": True}


@pytest.mark.gpu
@needs_hopper
def test_gpu_launch_follows_the_torch_stream_and_matches_the_fallback(cache_dir):
    """The TVM-FFI launch goes to torch's current stream: with the default stream stalled, a
    launch under a side stream finishes on its own. The DLPack fallback gives the same bits."""
    program, q, k, v, blocks, aux, score, mask = build("abi", device="cuda")
    tpl, cfg = _cfg_for(program, q, blocks)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device="cuda")
    fn = tpl.compile_fwd(cfg, q, k, v, o, lse, blocks, aux, program.scalars, use_tvm_ffi=True)
    old = tpl.compile_fwd(cfg, q, k, v, o, lse, blocks, aux, program.scalars, use_tvm_ffi=False)
    assert fn.tvm_ffi and not old.tvm_ffi
    scale = D ** -0.5
    side = torch.cuda.Stream()
    o.fill_(float("nan"))
    lse.fill_(float("nan"))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of busy-wait on the default stream
    with torch.cuda.stream(side):
        fn(q, k, v, o, lse, scale, blocks, aux, program.scalars)
        # Read on the side stream: had the kernel gone to the stalled default stream, it would
        # not have run yet and o would still be NaN here.
        unwritten = torch.isnan(o).any().item()
    assert not unwritten, "the kernel did not run on torch's current (side) stream"
    torch.cuda.synchronize()
    from oracle import FLOOR, assert_close_to_oracle, dense_attention
    ref, ref_lse = dense_attention(q, k, v, score, mask, scale, torch.float64)
    low, low_lse = dense_attention(q, k, v, score, mask, scale, torch.bfloat16)
    assert_close_to_oracle("out", o, ref, low, FLOOR[torch.bfloat16])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.bfloat16])
    o2, lse2 = torch.full_like(o, float("nan")), torch.full_like(lse, float("nan"))
    old(q, k, v, o2, lse2, scale, blocks, aux, program.scalars)
    torch.cuda.synchronize()
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
