"""Environment variables set for a span and restored after it (a benchmark row's mode, the
prewarm workers' environment). Light enough to wrap every timed eager call: it touches only the
named variables (``unittest.mock.patch.dict`` would copy the whole environment each time)."""
from __future__ import annotations

import os


class overlay:
    """``with overlay({"NAME": "value", ...}):`` sets those variables, then restores each to
    its value before (or unsets it)."""

    __slots__ = ("env", "saved")

    def __init__(self, env: dict):
        self.env, self.saved = env, {}

    def __enter__(self):
        self.saved = {name: os.environ.get(name) for name in self.env}
        os.environ.update(self.env)
        return self

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
