"""The Triton backend's compile cache: a rendered kernel module, on disk and imported once.

What this module holds
----------------------
* ``load_module(program, which, interpret)``: the rendered source is written to
  ``$FLEXJIT_CACHE_DIR/triton/<key>.py`` (default ``~/.cache/flexjit/triton``; ``flexjit.cache``),
  imported with importlib (Triton needs a real file) and kept in memory by key. The key
  (``cache_key``, ``cache.kernel_key``) digests the Program's IR, which template, flexjit's
  sources and the Python/torch/Triton versions. Triton's own cache then compiles once per
  (dtype, head dim, block config, arch) under that source; captured sizes, strides and scalars
  are unspecialised arguments, so new values reuse the binary. ``FLEXJIT_DEBUG=1`` prints the
  generated path; ``FLEXJIT_DUMP_DIR`` keeps a readable copy of every generated kernel.
* How Triton is imported: always compiled (``import_triton``), with ``TRITON_INTERPRET`` set per
  module at decoration (``interpret_env``), and a libdevice the interpreter can evaluate.
* ``STATS``: what this process rendered, imported and launched (tests count them);
  ``triton_compiles``: the binaries Triton holds for a module.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys

from flexjit import config
from flexjit.backends import kernel_cache as cache
from flexjit.ir.program import Program
from flexjit.backends.triton.render import render

_INTERPRET_ENV = "TRITON_INTERPRET"

STATS = {"render": 0, "import": 0, "fwd_launch": 0, "bwd_launch": 0}
"""Counters: files rendered, modules imported and kernels launched by this process (tests)."""


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for the interpreter."""
    return os.environ.get(_INTERPRET_ENV, "0") not in ("", "0", "false", "False")


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
def interpret_env(interpret: bool):
    """TRITON_INTERPRET set to ``interpret`` for a block (decorating, or compiling: Triton's
    code generator misbehaves when the variable is on)."""
    previous = os.environ.get(_INTERPRET_ENV)
    os.environ[_INTERPRET_ENV] = "1" if interpret else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[_INTERPRET_ENV]
        else:
            os.environ[_INTERPRET_ENV] = previous


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
    ns.update({name: elementwise(fn) for name, fn in (
        ("rint", np.rint), ("trunc", np.trunc), ("tan", np.tan), ("atan", np.arctan),
        ("sinh", np.sinh), ("cosh", np.cosh), ("asin", np.arcsin), ("acos", np.arccos),
        ("log1p", np.log1p), ("expm1", np.expm1))})
    return types.SimpleNamespace(tanh=tanh, pow=pow, **ns)


def import_triton():
    """Import Triton itself compiled, whatever TRITON_INTERPRET says: its own jit helpers are
    fixed at import, and only compiled ones let one process both build kernels and interpret
    ours (the templates call no library jit function, so interpreted kernels work either way)."""
    if "triton" not in sys.modules:
        with interpret_env(False):
            import triton.language  # noqa: F401
            from triton.language.extra import libdevice  # noqa: F401


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
    with interpret_env(interpret):  # triton.jit reads it at decoration
        mod = cache.import_source(path, name, source, symbol=f"flex_{which}")
    if interpret:
        mod.libdevice = _interpreter_libdevice()
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
