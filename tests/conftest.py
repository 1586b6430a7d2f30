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
