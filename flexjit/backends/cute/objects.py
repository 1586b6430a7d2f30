"""The disk cache of compiled CuTeDSL kernels: a second process loads instead of compiling.

What this module holds
----------------------
* ``load(key)``: the ``tvm_ffi.Function`` exported under ``key``, or ``None`` (absent,
  bad, disk cache off). Loading an object file takes milliseconds; compiling the sm90
  forward takes seconds.
* ``store(key, export)``: ``export(path, function_name)`` writes the object file of a
  compiled function; ``store`` gives it its place in the folder.
* ``available()``: whether the disk cache is on (``FLEXJIT_CACHE`` is not ``0``) and this
  install can load what it would store (TVM-FFI is importable).
* ``STATS``: this process's disk lookups, ``hits`` (loaded) and ``misses`` (absent or unreadable,
  so compiled); ``benchmarks.run`` prints them, ``benchmarks.prewarm`` aims for no misses.
* ``cached_kernel``: one compiled forward kernel through ``cache.cached`` with this folder
  behind memory (load, else compile and export), as the sm90 and sm100 backends use it;
  ``key_options`` / ``wants_artifacts``: what of the compile options enters a disk key, and
  whether the caller asked for PTX/cubin files (then it always compiles).

Only TVM-FFI functions are cached on disk: ``export_to_c`` writes one object file holding the
host launcher, the argument checks and the cubin, and ``cute.runtime.load_module(path,
enable_tvm_ffi=True)`` gives back a callable with the same signature. Files are
``cache.cache_dir("cute")/<key>.o``; the key (``cache.kernel_key``) already folds in the
toolchain versions and flexjit's own sources, so a stale file is never picked up, only
orphaned.

Concurrency: processes may share the folder. A writer holds an exclusive ``fcntl.flock`` on
``<key>.lock`` while it exports, exports to a private temporary name and ``os.replace``\\ s it
into place, seals it (``cache.seal``: size, checksum, symbol) and skips the export when another
process got there first; a reader holds a shared lock on the same file while it verifies the
seal and loads. A reader therefore never sees a half-written file, and a bad file is reported,
removed and compiled again. A build holds ``<key>.build.lock`` (``building``) from its disk
lookup to its export, so two processes that need the same kernel at once compile it once: the
second waits, then loads.

Trap (seen in FlashAttention-4's cache): the object file calls into the DSL runtime libraries
(``libcute_dsl_runtime.so``, ``libtvm_ffi.so``); they are loaded with ``RTLD_GLOBAL`` before the
first ``load_module``, or the load can fail on undefined symbols.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from flexjit import config
from flexjit.backends import kernel_cache as cache

log = logging.getLogger("flexjit")

FUNCTION_NAME = "flexjit_kernel"  # the exported symbol (``__tvm_ffi_flexjit_kernel``)
LOCK_TIMEOUT_S = 120.0  # an export takes ~0.5 s; a lock held longer belongs to a stuck process
BUILD_TIMEOUT_S = 1800.0  # a compile takes seconds to minutes on a loaded machine
STATS = {"hits": 0, "misses": 0}  # lookups by load() with the disk cache on (module doc)


def announce(msg: str) -> None:
    """Log ``msg`` (and print it under ``FLEXJIT_DEBUG``): what a compile or a load took."""
    log.info("flexjit: %s", msg)
    if config.settings.debug:
        print(f"[flexjit] {msg}")


ARTIFACT_FLAGS = ("--keep-ptx", "--keep-cubin")


def key_options(options: str) -> str:
    """The compile options that can change the code: all but asking for PTX/cubin files and
    where to dump them."""
    words, kept = options.split(), []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w == "--dump-dir":
            skip = True
        elif w not in ARTIFACT_FLAGS and not w.startswith("--dump-dir="):
            kept.append(w)
    return " ".join(kept)


def wants_artifacts(options: str) -> bool:
    """Whether ``options`` ask for PTX or cubin files: a loaded kernel has none to show."""
    return any(f in options.split() for f in ARTIFACT_FLAGS)


@functools.lru_cache(maxsize=None)
def _tvm_ffi_importable() -> bool:
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


def available() -> bool:
    """The disk cache is on and this install can load TVM-FFI object files."""
    return cache.enabled() and _tvm_ffi_importable()


def object_path(key: str) -> Path:
    return cache.cache_dir("cute") / f"{key}.o"


def _locked(key: str, exclusive: bool, timeout: float = LOCK_TIMEOUT_S):
    """Hold ``<key>.lock`` in the CuTe folder (``cache.locked``). Raises TimeoutError."""
    return cache.locked(cache.cache_dir("cute") / key, exclusive, timeout)


@functools.lru_cache(maxsize=None)
def _preload_runtime_libraries() -> tuple:
    """Load the DSL runtime libraries with RTLD_GLOBAL, once per process (see the module doc).
    The handles are kept (in the lru_cache) for the life of the process."""
    import cutlass.cute as cute

    return tuple(ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                 for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
                 if Path(lib).exists())


def load(key: str):
    """The function stored under ``key`` (a ``tvm_ffi.Function``), or None. A file that exists
    but cannot be loaded is logged and removed, so the caller's compile replaces it."""
    if not available():
        return None
    fn = _load(key)
    STATS["hits" if fn is not None else "misses"] += 1
    return fn


def _load(key: str):
    path = object_path(key)
    if not os.path.lexists(path):
        return None
    fn = None
    try:
        with _locked(key, exclusive=False):
            state = cache.verify(path, FUNCTION_NAME)  # the seal: size, checksum, symbol
            if state == cache.OK:
                import cutlass.cute as cute

                _preload_runtime_libraries()
                module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
                fn = getattr(module, FUNCTION_NAME)
    except TimeoutError as e:
        log.warning("flexjit: disk cache skipped: %s", e)
        return None
    except Exception as e:  # a sealed file the DSL cannot read (another DSL build's, say)
        state = f"{type(e).__name__}: {e}"
    if fn is None and state != cache.ABSENT:
        cache.report_bad(path, state)
        _discard(key)
    return fn


def _discard(key: str) -> None:
    try:
        with _locked(key, exclusive=True):
            cache.discard(object_path(key))
    except (OSError, TimeoutError) as e:
        log.warning("flexjit: cannot remove the bad cache entry %s: %s", key, e)


_RUNNING = 0  # CuTe compiles under way in this process's threads
_RUNNING_LOCK = threading.Lock()


@contextlib.contextmanager
def compiling():
    """Around a CuTe compile: ``compiles_running`` counts it (``runtime.compile_pool`` forks a
    worker only while no thread is inside the compiler, whose locks a child would inherit)."""
    global _RUNNING
    with _RUNNING_LOCK:
        _RUNNING += 1
    try:
        yield
    finally:
        with _RUNNING_LOCK:
            _RUNNING -= 1


def compiles_running() -> int:
    return _RUNNING


@contextlib.contextmanager
def building(key: str, timeout: float = BUILD_TIMEOUT_S):
    """Hold ``<key>.build.lock`` exclusively while building what ``key`` names, so that
    processes sharing the folder build it once: the second waits, then finds it on disk. Without
    the disk cache, or past ``timeout`` (logged), the build goes on unlocked."""
    if not available():
        yield
        return
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_locked(f"{key}.build", exclusive=True, timeout=timeout))
        except TimeoutError as e:
            log.warning("flexjit: building without the lock: %s", e)
        yield


def store(key: str, export: Callable[[str, str], None]) -> Optional[Path]:
    """Export a compiled function under ``key``: ``export(object_file_path, function_name)``
    writes it. Returns the file's path, or None when the cache is off or the export failed
    (logged: the compiled function in memory still works, only the next process recompiles)."""
    if not available():
        return None
    path = object_path(key)
    # The DSL picks the output format from the extension, so the temporary name ends in ".o".
    tmp = path.with_name(f"{key}.{os.getpid()}.{threading.get_ident()}.tmp.o")
    try:
        with _locked(key, exclusive=True):
            state = cache.verify(path, FUNCTION_NAME)
            if state == cache.OK:  # another process exported it while we compiled
                return path
            if state != cache.ABSENT:
                cache.discard(path)
            t0 = time.perf_counter()
            export(str(tmp), FUNCTION_NAME)
            os.replace(tmp, path)
            cache.seal(path, FUNCTION_NAME)
            announce(f"exported {path.name} ({path.stat().st_size >> 10} KiB) in "
                   f"{time.perf_counter() - t0:.2f} s")
        return path
    except Exception as e:
        log.warning("flexjit: could not export %s to the disk cache (%s: %s)", key,
                    type(e).__name__, e)
        return None
    finally:
        if tmp.exists():
            tmp.unlink()


def cached_kernel(memory: dict, key, *, label: str, disk_key: str | None, options: str,
                  compile: Callable, from_disk: Callable, export: Callable):
    """``memory[key]``, else the kernel loaded from ``disk_key``'s object file, else compiled
    and exported there (``cache.cached``); one forward kernel, for any arch's backend.

    ``label`` names it in the log ("sm90 forward for causal/none D=128 bfloat16");
    ``disk_key`` None: no disk (TVM-FFI or the cache off); ``options`` asking for PTX/cubin
    files (``wants_artifacts``): always compiled, still exported. ``compile()`` gives a fresh
    kernel, ``from_disk(fn)`` the kernel around a loaded ``tvm_ffi.Function``, ``export(kernel)``
    the ``export(path, function_name)`` writer of a kernel compiled here, or None where it has
    none (not a TVM-FFI compile)."""
    fresh = wants_artifacts(options)

    def from_file(disk_key):
        t0 = time.perf_counter()
        loaded = None if fresh else load(disk_key)
        if loaded is None:
            return None
        announce(f"{label}: loaded from disk in {time.perf_counter() - t0:.3f} s ({disk_key}.o)")
        return from_disk(loaded)

    def build():
        # Under the build lock (``building``): another process compiling the same kernel
        # finishes first, and this one loads its file instead of compiling it again.
        with building(disk_key) if disk_key is not None else contextlib.nullcontext():
            if disk_key is not None:
                done = from_file(disk_key)
                if done is not None:
                    return done
            log.info("flexjit: compiling the %s ...", label)
            t0 = time.perf_counter()
            with compiling():
                fn = compile()
            announce(f"{label}: compiled in {time.perf_counter() - t0:.1f} s")
            writer = export(fn) if disk_key is not None else None
            if writer is not None:
                store(disk_key, writer)
            return fn

    return cache.cached(memory, key, build)
