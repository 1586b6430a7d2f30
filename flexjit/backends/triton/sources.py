"""The Triton backend's compile cache: a rendered kernel module, on disk and imported once.

What this module holds
----------------------
* ``load_module(program, which, interpret)``: the rendered source is written to
  ``$FLEXJIT_CACHE_DIR/triton/<key>.py`` (default ``~/.cache/flexjit/triton``), sealed and
  checked on every import (``kernel_cache.import_source``: a bad file is rebuilt), imported
  (Triton needs a real file) and kept in memory by key. The key
  (``cache_key``, ``cache.kernel_key``) digests the Program's IR, which template, flexjit's
  sources and the Python/torch/Triton versions. Triton's own cache then compiles once per
  (dtype, head dim, block config, arch) under that source; captured sizes, strides and scalars
  are unspecialised arguments, so new values reuse the binary. ``FLEXJIT_DEBUG=1`` prints the
  generated path; ``FLEXJIT_DUMP_DIR`` keeps a readable copy of every generated kernel.
* How Triton is imported: always compiled (``import_triton``). A generated module's kernels are
  made interpreted or compiled per module (``_as_kernels``), never by setting
  ``TRITON_INTERPRET``: the variable is the whole process's, and another thread's call would
  see it flipped. Interpreted launches take turns (``_interpreter_kernel``), and get a libdevice
  the interpreter can evaluate.
* ``STATS``: what this process rendered, imported and launched (tests count them);
  ``triton_compiles``: the binaries Triton holds for a module.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading

from flexjit import config
from flexjit.backends import kernel_cache as cache
from flexjit.ir.program import Program
from flexjit.backends.triton.render import render

_INTERPRET_ENV = "TRITON_INTERPRET"

STATS = {"render": 0, "import": 0, "fwd_launch": 0, "bwd_launch": 0}
"""Counters: files rendered, modules imported and kernels launched by this process (tests)."""


# The user's TRITON_INTERPRET while ``compiler_env`` hides it from Triton (see there): flexjit's
# readers keep seeing the user's value meanwhile.
_HIDDEN: list[str | None] = []
_ENV_LOCK = threading.RLock()


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for the interpreter (for CPU tensors)."""
    hidden = _HIDDEN  # read once: the list changes only under _ENV_LOCK
    value = hidden[0] if hidden else os.environ.get(_INTERPRET_ENV)
    return value not in (None, "", "0", "false", "False")


def interpret_setting() -> str | None:
    """The user's TRITON_INTERPRET, as a cache key (``runtime.call_cache``)."""
    hidden = _HIDDEN
    return hidden[0] if hidden else os.environ.get(_INTERPRET_ENV)


def cache_key(p: Program, which: str) -> str:
    """The generated file's identity: the Program's IR and the toolchain (flexjit's sources and
    templates by content, torch/triton versions). Dtype, head dim, block config and arch are
    Triton's own specialisation of that file (constexprs and target), cached by Triton."""
    return cache.kernel_key(p.key, f"triton-{which}", (), "any")


# (Program.key, template, interpret) -> module. The toolchain half of ``cache_key`` cannot
# change inside a process, so the Program's key alone finds the module: no hash per call.
_MODULES: dict[tuple[str, str, bool], object] = {}


def forget_imported() -> None:
    """Drop the in-memory modules (as a new process starts): the next load reads the disk cache."""
    _MODULES.clear()


@contextlib.contextmanager
def compiler_env():
    """TRITON_INTERPRET off for Triton's compiler while a block runs, for a process whose user
    turned it on: Triton's own jit functions are decorated at its import, and its code generator
    reads the variable (constexpr functions). Needed only to import Triton and to compile without
    a GPU (``prefill.compile_launch``); kernels are never decorated under it (``_as_kernels``).
    Blocks take turns, and ``interpreting()`` keeps answering with the user's value."""
    with _ENV_LOCK:
        previous = os.environ.get(_INTERPRET_ENV)
        if previous in (None, "", "0"):
            yield
            return
        _HIDDEN.append(previous)
        os.environ[_INTERPRET_ENV] = "0"
        try:
            yield
        finally:
            os.environ[_INTERPRET_ENV] = previous
            _HIDDEN.clear()


@functools.lru_cache(maxsize=None)
def _interpreter_libdevice():
    """libdevice for the interpreter, where Triton's libdevice stubs return None: the same
    functions from ``tl`` ops, which the interpreter evaluates with numpy in float32."""
    import types

    import_triton()
    import triton.language as tl

    def tanh(x):
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    def pow(a, b):  # torch.pow for real results: negative bases need integral exponents
        a, b = a + b * 0.0, b + a * 0.0  # both tensors of the broadcast shape
        r = tl.exp2(b * tl.log2(tl.abs(a)))
        odd = tl.floor(b * 0.5) * 2.0 != b
        r = tl.where((a < 0) & odd, -r, r)
        r = tl.where((a < 0) & (tl.floor(b) != b), float("nan"), r)
        return tl.where(b == 0, 1.0, r)

    # Looked up at call time: the interpreter patches tl's builtins only while a kernel runs.
    ns = {name: (lambda name: lambda x: getattr(tl, name)(x))(name)
          for name in ("exp", "exp2", "log", "log2", "sin", "cos", "rsqrt")}
    # The rest have no tl op: numpy on the interpreter's own arrays (its tensors hold them).
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    def elementwise(fn):
        def f(x):
            h = x.handle
            return tl.core.tensor(TensorHandle(fn(h.data).astype(h.data.dtype), h.dtype.scalar), x.type)
        return f
    def elementwise2(fn):  # float32 operands (tensors or literals), numpy's broadcasting
        def f(x, y):
            args = [a.handle.data if isinstance(a, tl.core.tensor) else np.float32(a) for a in (x, y)]
            out = np.asarray(fn(*args), dtype=np.float32)
            block = any(isinstance(a, tl.core.tensor) and a.type.is_block() for a in (x, y))
            ty = tl.block_type(tl.float32, list(out.shape)) if block else tl.float32
            return tl.core.tensor(TensorHandle(out, tl.float32), ty)
        return f
    ns["atan2"] = elementwise2(np.arctan2)
    ns.update({name: elementwise(fn) for name, fn in (
        ("rint", np.rint), ("trunc", np.trunc), ("tan", np.tan), ("atan", np.arctan),
        ("sinh", np.sinh), ("cosh", np.cosh), ("asin", np.arcsin), ("acos", np.arccos),
        ("log1p", np.log1p), ("expm1", np.expm1))})
    return types.SimpleNamespace(tanh=tanh, pow=pow, **ns)


@functools.lru_cache(maxsize=None)
def _round_bf16_to_nearest_in_the_interpreter() -> None:
    """The interpreter narrows float32 to bfloat16 by truncating the mantissa (its casts pass
    no rounding mode), where the GPU's cvt.rn rounds to nearest even: P before the PV dot and
    every stored output then carried up to one bf16 ulp more error on the CPU than on a GPU,
    so the CPU tests did not compute what the kernels compute. Patched once, for interpreted
    kernels only (compiled ones never reach the interpreter's builder)."""
    import numpy as np
    import torch

    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    truncating = getattr(builder, "cast_impl", None)
    if truncating is None:
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(bits.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return truncating(self, src, dst_type)
    builder.cast_impl = cast_impl  # the builder's create_fp_trunc & co. call self.cast_impl


def import_triton():
    """Import Triton itself compiled, whatever TRITON_INTERPRET says: its own jit helpers are
    fixed at import, and only compiled ones let one process both build kernels and interpret
    ours (the interpreter runs the library's compiled combine functions as well)."""
    if "triton.language.extra.libdevice" not in sys.modules:
        with compiler_env():
            import triton.language  # noqa: F401
            from triton.language.extra import libdevice  # noqa: F401


@functools.lru_cache(maxsize=None)
def _interpreter_kernel():
    """Triton's InterpretedFunction, launched one at a time: the interpreter keeps the grid
    position in one global builder and patches ``triton.language`` for the whole process while a
    kernel runs, so two interpreted launches at once read each other's program ids."""
    from triton.runtime.interpreter import InterpretedFunction

    lock = threading.Lock()

    class TakingTurns(InterpretedFunction):
        def run(self, *args, **kwargs):
            with lock:
                return super().run(*args, **kwargs)
    return TakingTurns


def _as_kernels(mod, interpret: bool) -> None:
    """Make the module's Triton functions interpreted or compiled, whatever ``triton.jit`` made
    of them at import (it follows TRITON_INTERPRET, the process's setting). Their globals are
    the module's, so calls between them find the replacements."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wanted = _interpreter_kernel() if interpret else JITFunction
    for name, fn in list(vars(mod).items()):
        if type(fn) is wanted or not isinstance(fn, (JITFunction, InterpretedFunction)):
            continue
        if getattr(fn.fn, "__globals__", None) is not vars(mod):
            continue  # a library function: left as Triton made it
        if isinstance(fn, InterpretedFunction):
            options = dict(getattr(fn, "kwargs", {}))
        else:  # the decorator's arguments, as JITFunction keeps them (``repr`` as ``_repr``)
            options = {arg: getattr(fn, attr) for arg, attr in _JIT_OPTIONS if hasattr(fn, attr)}
        setattr(mod, name, wanted(fn.fn, **options))


_JIT_OPTIONS = (("version", "version"), ("do_not_specialize", "do_not_specialize"),
                ("do_not_specialize_on_alignment", "do_not_specialize_on_alignment"),
                ("debug", "debug"), ("noinline", "noinline"), ("repr", "_repr"),
                ("launch_metadata", "launch_metadata"))


def load_module(p: Program, which: str, interpret: bool | None = None):
    """The imported generated module for (program, template), rendering it on a miss."""
    interpret = interpreting() if interpret is None else interpret
    return cache.cached(_MODULES, (p.key, which, interpret), lambda: _import(p, which, interpret))


def _import(p: Program, which: str, interpret: bool):
    import_triton()
    key = cache_key(p, which)
    path = cache.cache_dir("triton") / f"{key}.py"

    def source() -> str:  # only on a miss (or to replace a bad entry)
        text = render(p, which)
        STATS["render"] += 1
        dump = config.settings.dump_dir
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"{p.score_name}__{p.mask_name}__{key[:12]}_{which}.py").write_text(text)
        return text
    if config.settings.debug:
        print(f"[flexjit] triton {which} kernel for {p.score_name}/{p.mask_name}: {path}")
    name = f"flexjit_triton_{key}{'_interp' if interpret else ''}"
    mod = cache.import_source(path, name, source, symbol=f"flex_{which}")
    _as_kernels(mod, interpret)
    if interpret:
        mod.libdevice = _interpreter_libdevice()
        _round_bf16_to_nearest_in_the_interpreter()
    STATS["import"] += 1
    return mod


def triton_compiles(mod) -> int:
    """Compiled binaries Triton holds for a generated module's kernels (0 under the interpreter)."""
    total = 0
    for fn in (getattr(mod, n, None) for n in ("flex_fwd", "flex_bwd", "flex_bwd_preprocess")):
        caches = getattr(fn, "device_caches", None)
        if caches is not None:
            total += sum(len(c[0]) for c in caches.values())
        elif isinstance(getattr(fn, "cache", None), dict):
            total += sum(len(c) for c in fn.cache.values())
    return total
