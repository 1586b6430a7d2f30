"""The compile cache's identity and its disk folder.

A compiled kernel is identified by :func:`kernel_key`: the Program's structural
key, the backend's frozen config, the GPU architecture, and the versions of
everything that shapes generated code (flexjit's own templates and renderers by
content hash, torch, triton, nvidia-cutlass-dsl, Python). Nothing is keyed on a
``repr`` of a closure.

The disk folder is ``$FLEXJIT_CACHE_DIR`` or ``~/.cache/flexjit``; ``FLEXJIT_CACHE=0``
turns it off. A folder that cannot be written is passed over with one
:class:`CacheWarning`: kernels then live in memory (generated modules, which Python
and Triton need as files, in a private temporary folder) for the process.

Every entry is a file beside its seal, ``<file>.meta``: the format version, the size,
the SHA-256 and the symbol the entry must define (:func:`seal`, :func:`verify`). Files
are written atomically (a temporary file, then ``os.replace``) and under an exclusive
``flock`` of ``<file>.lock``, so processes sharing the folder never read a half-written
entry and many writers of one key leave one good entry. A bad entry (truncated, emptied,
overwritten, without its symbol, a directory in its place) is removed and rebuilt, and
reported once with a :class:`CacheWarning` naming the file; it never fails the call.

:func:`cached` is the one compile-cache helper (quack's ``jit_cache``): memory, then
disk, then a build. Every backend keeps its artifacts through it: the generated
Triton and CuTe source modules (:func:`import_source`) and the compiled CuTeDSL
kernels (their object files, ``backends.cute.objects``).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import warnings
from importlib import metadata, resources
from pathlib import Path
from typing import Callable, TypeVar

from flexjit import config

T = TypeVar("T")


class CacheWarning(UserWarning):
    """A disk cache entry was bad (it was removed and rebuilt), or the cache folder cannot be
    written (kernels are kept in memory). Either way the call goes on."""


FORMAT = 1  # the seal's layout: a change makes every older entry a miss, never a misread
LOCK_TIMEOUT_S = 120.0  # a write takes milliseconds; a lock held longer belongs to a stuck process
OK, ABSENT = "ok", "absent"  # verify()'s answers besides the reason an entry is bad

_REPORTED: set[str] = set()  # what this process has warned about: once each
_UNUSABLE: set[tuple[int, Path]] = set()  # (settings generation, folder) found unwritable
_USABLE: set[tuple[int, Path]] = set()
_PRIVATE: list[Path] = []  # this process's stand-in folder (see the module doc)


def _warn_once(what: str, message: str) -> None:
    if what not in _REPORTED:
        _REPORTED.add(what)
        warnings.warn(f"flexjit: {message}", CacheWarning, stacklevel=3)


def enabled() -> bool:
    """The disk cache is on and its folder can be written (probed once per folder)."""
    s = config.settings
    if not s.disk_cache:
        return False
    where = (s.generation, s.cache_dir)
    if where in _USABLE:
        return True
    if where in _UNUSABLE:
        return False
    try:
        s.cache_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=s.cache_dir, prefix=".probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        _give_up(s.cache_dir, e)
        return False
    _USABLE.add(where)
    return True


def _give_up(folder: Path, error: OSError) -> None:
    """Stop using the disk cache for this process's settings, with one warning."""
    _UNUSABLE.add((config.settings.generation, config.settings.cache_dir))
    _USABLE.discard((config.settings.generation, config.settings.cache_dir))
    _warn_once(f"unusable:{folder}", f"the kernel cache folder {folder} cannot be written "
               f"({type(error).__name__}: {error}); kernels are kept in memory for this process")


def cache_dir(kind: str) -> Path:
    """The folder for ``kind``'s entries: in the disk cache, or (cache off or unwritable) in a
    private temporary folder that lives as long as the process."""
    if enabled():
        path = config.settings.cache_dir / kind
        try:
            path.mkdir(parents=True, exist_ok=True)
            return path
        except OSError as e:  # e.g. a file where the folder should be
            _give_up(path, e)
    return _private_dir(kind)


def _private_dir(kind: str) -> Path:
    """``kind``'s folder in this process's private temporary folder."""
    if not _PRIVATE:
        _PRIVATE.append(Path(tempfile.mkdtemp(prefix="flexjit-")))
    path = _PRIVATE[0] / kind
    path.mkdir(exist_ok=True)
    return path


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        try:  # a package carried without dist-info (e.g. on PYTHONPATH)
            mod = __import__(dist.replace("-", "_").replace("nvidia_cutlass_dsl", "cutlass"))
            return getattr(mod, "__version__", "unknown")
        except Exception:
            return "absent"


@functools.lru_cache(maxsize=None)
def toolchain_fingerprint() -> str:
    """Versions of Python, torch, triton, cutlass-dsl and a hash of flexjit's sources."""
    import torch
    package = Path(__file__).resolve().parents[1]
    templates = Path(str(resources.files("flexjit.templates")))
    h = hashlib.sha256()
    for root in (package, templates):
        for path in sorted(root.rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    parts = [f"python={platform.python_version()}", f"torch={torch.__version__}",
             f"triton={_version('triton')}", f"cutlass-dsl={_version('nvidia-cutlass-dsl')}",
             f"tvm-ffi={_version('apache-tvm-ffi')}",
             f"flexjit-src={h.hexdigest()[:16]}"]
    return ";".join(parts)


def kernel_key(program_key: str, backend: str, config: tuple, arch: str) -> str:
    """The compile-cache key of one kernel."""
    text = "\n".join([program_key, backend, repr(config), arch, toolchain_fingerprint()])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


_BUILD_LOCK = threading.RLock()  # reentrant: a build may itself go through `cached`


def cached(memory: dict, key, build: Callable[[], T], *, disk_key: str | None = None,
           load: Callable[[str], T | None] | None = None,
           store: Callable[[str, T], None] | None = None) -> T:
    """``memory[key]``; on a miss, ``load(disk_key)`` (None: not on disk), else ``build()`` then
    ``store(disk_key, value)``; the value is remembered under ``key``.

    ``key`` is the artifact's in-process identity (``Program.key`` and what else shapes it; the
    toolchain cannot change inside a process), ``disk_key`` its :func:`kernel_key` (which adds
    the toolchain, so a stale file is never found). ``memory`` is the caller's table, read at
    call time (tests swap it). Builds are serialised: two threads never compile one kernel."""
    hit = memory.get(key)
    if hit is not None:
        return hit
    with _BUILD_LOCK:
        hit = memory.get(key)
        if hit is not None:
            return hit
        value = load(disk_key) if disk_key is not None and load is not None else None
        if value is None:
            value = build()
            if disk_key is not None and store is not None:
                store(disk_key, value)
        memory[key] = value
        return value


def seal_path(path: Path) -> Path:
    return path.with_name(path.name + ".meta")


def seal(path: Path, symbol: str | None = None) -> None:
    """Write the seal of the file at ``path`` (after the file itself is in place)."""
    data = path.read_bytes()
    meta = {"format": FORMAT, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "symbol": symbol}
    atomic_write(seal_path(path), json.dumps(meta))


def verify(path: Path, symbol: str | None = None) -> str:
    """``OK``, ``ABSENT`` (no file: a plain miss), or why the entry at ``path`` is bad."""
    if not os.path.lexists(path):
        return ABSENT
    if not path.is_file():
        return "it is not a file"
    try:
        meta = json.loads(seal_path(path).read_text())
        size, digest, sealed = meta["size"], meta["sha256"], meta.get("symbol")
        fmt = meta["format"]
    except FileNotFoundError:
        return "it has no seal"
    except (OSError, ValueError, KeyError, TypeError):  # garbage where the seal should be
        return "its seal is unreadable"
    if fmt != FORMAT:
        return f"its seal has format {fmt!r}, not {FORMAT}"
    if symbol is not None and sealed != symbol:
        return f"it was not written to define {symbol}"
    data = path.read_bytes()
    if len(data) != size:
        return f"it holds {len(data)} bytes of the {size} written"
    if hashlib.sha256(data).hexdigest() != digest:
        return "its contents do not match their checksum"
    return OK


def discard(path: Path) -> None:
    """Remove the entry at ``path`` and its seal, whatever stands there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    seal_path(path).unlink(missing_ok=True)


def report_bad(path: Path, reason: str) -> None:
    """The one warning for a bad entry that is being removed and rebuilt."""
    _warn_once(f"bad:{path}", f"the kernel cache entry {path} was bad ({reason}); "
               "it is removed and rebuilt")


@contextlib.contextmanager
def locked(path: Path, exclusive: bool = True, timeout: float = LOCK_TIMEOUT_S):
    """Hold ``<path>.lock`` (exclusive for writers, shared for readers) across processes.
    Raises TimeoutError after ``timeout`` seconds, OSError where the lock cannot be made."""
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, mode)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout:.0f} s for the lock {lock}") from None
                time.sleep(0.02)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def import_source(path: Path, module_name: str, source: str | Callable[[], str],
                  symbol: str | None = None):
    """Import the generated module at ``path`` as ``module_name`` (kernels and mods need a real
    file). ``source`` (the text, or a function rendering it) is written there, sealed, unless a
    good entry already holds it; the module must define ``symbol``. A bad entry is reported,
    removed and rewritten; a folder that cannot be written gives a private copy instead."""
    text = [source] if isinstance(source, str) else []

    def render() -> str:
        if not text:
            text.append(source())
        return text[0]
    try:
        with locked(path):  # exclusive: a reader may have to heal the entry
            return _import_entry(path, module_name, render, symbol)
    except (OSError, TimeoutError) as e:  # the folder went unwritable, or a stuck lock
        if isinstance(e, TimeoutError):  # (an OSError too: tested first)
            _warn_once(f"lock:{path}", f"kernel cache skipped: {e}")
        else:
            _give_up(path.parent, e)
        fd, private = tempfile.mkstemp(dir=_private_dir(path.parent.name), suffix=".py")
        os.close(fd)
        private = Path(private)
        atomic_write(private, render())
        seal(private, symbol)
        return _import_entry(private, module_name, render, symbol)


def _import_entry(path: Path, module_name: str, render: Callable[[], str], symbol: str | None):
    """Under the entry's lock: verify, (re)write, import, and check the symbol."""
    state = verify(path, symbol)
    if state != OK:
        if state != ABSENT:
            report_bad(path, state)
            discard(path)
        atomic_write(path, render())
        seal(path, symbol)
    try:
        return _exec(path, module_name, symbol)
    except Exception as e:  # sealed yet broken: written by something other than flexjit
        report_bad(path, f"{type(e).__name__}: {e}")
        discard(path)
        atomic_write(path, render())
        seal(path, symbol)
        return _exec(path, module_name, symbol)


def _exec(path: Path, module_name: str, symbol: str | None):
    """Run the file's text as a module. Compiled here rather than by the import system, which
    would keep a ``__pycache__`` beside the entry: bytecode outside the seal."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        exec(compile(path.read_bytes(), str(path), "exec"), module.__dict__)
        if symbol is not None and not hasattr(module, symbol):
            raise AttributeError(f"the module defines no {symbol}")
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
