"""Fixtures shared by the test modules, and the ``compile_all`` opt-in.

``@pytest.mark.compile_all(reason=...)`` marks a compile that repeats what another default test
already compiles (the same kernel, or one more mod at a head dim that representatives cover):
default CI skips it with its reason; ``FLEXJIT_COMPILE_ALL=1`` runs it, exactly as before.
"""
import os

import pytest

from flexjit import config


def _reloading(method):
    """A MonkeyPatch method that has flexjit read its settings again after changing a FLEXJIT_*
    variable (flexjit reads the environment once, at import, as a user's process would)."""
    def patched(self, name, *args, **kwargs):
        method(self, name, *args, **kwargs)
        if str(name).startswith("FLEXJIT_"):
            config.reload()
    return patched


def _undo_reloading(method):
    def patched(self):
        method(self)
        config.reload()
    return patched


pytest.MonkeyPatch.setenv = _reloading(pytest.MonkeyPatch.setenv)
pytest.MonkeyPatch.delenv = _reloading(pytest.MonkeyPatch.delenv)
pytest.MonkeyPatch.undo = _undo_reloading(pytest.MonkeyPatch.undo)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FLEXJIT_COMPILE_ALL") == "1":
        return
    for item in items:
        marker = item.get_closest_marker("compile_all")
        if marker is not None:
            why = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
            item.add_marker(pytest.mark.skip(
                reason="opt-in (FLEXJIT_COMPILE_ALL=1 runs it)" + (f": {why}" if why else "")))


@pytest.fixture
def programs_run(monkeypatch):
    """The (backend, Program.key) of every forward flexjit runs from here on, eager or inside a
    compiled graph's custom op: both go through ``dispatch.forward``."""
    from flexjit.runtime import dispatch

    seen = []
    real = dispatch.forward

    def spy(name, call):
        seen.append((name, call.program.key))
        return real(name, call)
    monkeypatch.setattr(dispatch, "forward", spy)
    return seen


@pytest.fixture
def passes_run(monkeypatch):
    """(pass, backend, call) of every forward ("fwd") and backward ("bwd") flexjit dispatches
    from here on: which kernels actually ran, not only which ``explain`` would pick."""
    from flexjit.runtime import dispatch

    seen = []
    fwd, bwd = dispatch.forward, dispatch.backward

    def spy_fwd(name, call):
        seen.append(("fwd", name, call))
        return fwd(name, call)

    def spy_bwd(name, call, *args):
        seen.append(("bwd", name, call))
        return bwd(name, call, *args)
    monkeypatch.setattr(dispatch, "forward", spy_fwd)
    monkeypatch.setattr(dispatch, "backward", spy_bwd)
    return seen
