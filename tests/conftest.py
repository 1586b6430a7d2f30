"""Fixtures shared by the test modules."""
import pytest


@pytest.fixture
def programs_run(monkeypatch):
    """The (backend, Program.key) of every forward flexjit runs from here on, eager or inside a
    compiled graph's custom op: both go through ``dispatch.forward``."""
    from flexjit import dispatch

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
    from flexjit import dispatch

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
