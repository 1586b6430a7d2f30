"""flexjit's environment variables, read here and nowhere else, once at import.

========================  ==========================================================================
``FLEXJIT_DEBUG=1``       print each traced IR, the backend choice, each tuning measurement and
                          the generated kernels' paths
``FLEXJIT_CACHE_DIR``     where compiled kernels are kept (default ``~/.cache/flexjit``)
``FLEXJIT_CACHE=0``       keep compiled kernels (and tuning choices) in memory only
``FLEXJIT_DUMP_DIR``      keep a readable copy of every generated kernel source there
``FLEXJIT_DISABLE``       backends never to use, comma-separated: ``cute``, ``cute_sm100``,
                          ``triton``, ``triton_decode`` (``backend="auto"`` passes them over and
                          says so in ``explain``; asking for one by name raises)
``FLEXJIT_POISON=1``      fill outputs with NaN before a kernel writes them (an element a kernel
                          leaves unwritten then shows up as NaN)
========================  ==========================================================================

Tuning belongs to ``kernel_options`` (``runtime.options``), not to the environment.
:func:`reload` reads the variables again (tests that set them call it).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

VARIABLES = ("FLEXJIT_DEBUG", "FLEXJIT_CACHE_DIR", "FLEXJIT_CACHE", "FLEXJIT_DUMP_DIR",
             "FLEXJIT_DISABLE", "FLEXJIT_POISON")
DISABLEABLE = ("cute", "cute_sm100", "triton", "triton_decode")


@dataclasses.dataclass(frozen=True)
class Settings:
    debug: bool
    cache_dir: Path
    disk_cache: bool
    dump_dir: Path | None
    disabled: frozenset[str]
    poison: bool
    generation: int  # bumped by every reload: what was chosen under other settings is stale


def _flag(value: str | None) -> bool:
    return value not in (None, "", "0", "false", "False")


def _read(generation: int) -> Settings:
    env = os.environ
    disabled = frozenset(n.strip() for n in env.get("FLEXJIT_DISABLE", "").split(",") if n.strip())
    unknown = sorted(disabled - set(DISABLEABLE))
    if unknown:
        raise ValueError(f"FLEXJIT_DISABLE names unknown backends {unknown}; "
                         f"valid: {', '.join(DISABLEABLE)}")
    dump = env.get("FLEXJIT_DUMP_DIR")
    return Settings(
        debug=_flag(env.get("FLEXJIT_DEBUG")),
        cache_dir=Path(env.get("FLEXJIT_CACHE_DIR") or Path.home() / ".cache" / "flexjit"),
        disk_cache=env.get("FLEXJIT_CACHE", "1") != "0",
        dump_dir=Path(dump) if dump else None,
        disabled=disabled,
        poison=_flag(env.get("FLEXJIT_POISON")),
        generation=generation,
    )


settings = _read(0)


def child_environment(**extra: str) -> dict[str, str]:
    """The environment for a child process that must share these settings (a compile worker):
    this one's, with ``FLEXJIT_CACHE_DIR`` the folder in use, plus ``extra``."""
    return dict(os.environ, FLEXJIT_CACHE_DIR=str(settings.cache_dir), **extra)


def use_cache_dir(path) -> Settings:
    """Switch this process to the cache folder ``path`` (a worker following its caller's)."""
    os.environ["FLEXJIT_CACHE_DIR"] = str(path)
    return reload()


def reload() -> Settings:
    """Read the environment again; returns the new settings."""
    global settings
    settings = _read(settings.generation + 1)
    return settings
