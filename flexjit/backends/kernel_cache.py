"""The compile cache's identity and its disk folder.

A compiled kernel is identified by :func:`kernel_key`: the Program's structural
key, the backend's frozen config, the GPU architecture, and the versions of
everything that shapes generated code (flexjit's own templates and renderers by
content hash, torch, triton, nvidia-cutlass-dsl, Python). Nothing is keyed on a
``repr`` of a closure.

The disk folder is ``$FLEXJIT_CACHE_DIR`` or ``~/.cache/flexjit``. Writes are
atomic (write a temporary file, then ``os.replace``), so processes sharing the
folder never read a half-written entry; ``FLEXJIT_CACHE=0`` turns it off.

:func:`cached` is the one compile-cache helper (quack's ``jit_cache``): memory, then
disk, then a build. Every backend keeps its artifacts through it: the generated
Triton and CuTe source modules (:func:`import_source`) and the compiled CuTeDSL
kernels (their object files, ``backends.cute_cache``).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import sys
import tempfile
import threading
from importlib import metadata, resources
from pathlib import Path
from typing import Callable, TypeVar

from flexjit import config

T = TypeVar("T")


def enabled() -> bool:
    return config.settings.disk_cache


def cache_dir(kind: str) -> Path:
    path = config.settings.cache_dir / kind
    path.mkdir(parents=True, exist_ok=True)
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


def import_source(path: Path, module_name: str, source: str | None = None):
    """Import the generated module at ``path`` as ``module_name`` (kernels and mods need a real
    file), writing ``source`` there first unless the file already holds it."""
    if source is not None and (not path.exists() or path.read_text() != source):
        atomic_write(path, source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
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
