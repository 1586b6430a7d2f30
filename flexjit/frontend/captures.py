"""What a traced mod captures: the functions it reaches, and the key its trace is cached by.

* ``ScalarRewriter``: re-creates a mod function with the Python numbers it captures (closure
  cells, named globals, recursively through nested functions, ``functools.partial`` objects and
  tuples of functions) replaced by proxies, so they become run-time SCALAR arguments.
* ``fingerprint``: everything a trace can depend on, as a hashable value (the trace cache key
  in ``trace.trace_mod``); ``Unfingerprintable`` when a capture cannot be vouched for.
* ``tensor_name``: the name a mod captures a tensor under, for messages.
"""
from __future__ import annotations

import functools
import os
import types
from typing import Any, Callable

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class ScalarRewriter:
    """Re-creates a function with captured Python numbers replaced by SCALAR proxies.

    Walks closure cells and the globals the code names, into nested functions,
    functools.partial objects and tuples/lists of them (how and_masks holds its mods).
    """

    def __init__(self, scalar: Callable[[Any, tuple], Any]):
        self.scalar = scalar  # (value, a key unique to where it was found) -> its proxy
        self.done: dict[int, Any] = {}

    def value(self, v, key: tuple[int, int]):
        if isinstance(v, bool) or v is None:
            return v
        if isinstance(v, (int, float)):
            return self.scalar(v, key)
        if isinstance(v, types.FunctionType):
            return self.function(v)
        if isinstance(v, functools.partial):
            return functools.partial(self.value(v.func, (id(v), -1)),
                                     *[self.value(a, (id(v), i)) for i, a in enumerate(v.args)],
                                     **{k: self.value(a, (id(v), hash(k))) for k, a in v.keywords.items()})
        if isinstance(v, (tuple, list)) and any(isinstance(x, (types.FunctionType, functools.partial))
                                                for x in v):
            mapped = [self.value(x, (id(v), i)) for i, x in enumerate(v)]
            return type(v)(mapped)
        return v

    def function(self, fn: types.FunctionType) -> types.FunctionType:
        if id(fn) in self.done:
            return self.done[id(fn)]
        if is_library_function(fn):
            return fn
        self.done[id(fn)] = fn  # while recursing: a self-reference keeps the original
        code = fn.__code__
        new_globals = fn.__globals__
        names = global_names(code)
        replaced = {}
        for name in names:
            if name in fn.__globals__:
                g = fn.__globals__[name]
                new = self.value(g, (id(fn.__globals__), hash(name)))
                if new is not g:
                    replaced[name] = new
        if replaced:
            new_globals = dict(fn.__globals__)
            new_globals.update(replaced)
        closure = fn.__closure__
        if closure:
            cells = []
            for cell in closure:
                try:
                    content = cell.cell_contents
                except ValueError:  # an empty cell (not yet assigned)
                    cells.append(cell)
                    continue
                cells.append(types.CellType(self.value(content, (id(cell), 0))))
            closure = tuple(cells)
        new_fn = types.FunctionType(code, new_globals, fn.__name__, fn.__defaults__, closure)
        self.done[id(fn)] = new_fn
        new_fn.__kwdefaults__ = fn.__kwdefaults__
        new_fn.__qualname__ = fn.__qualname__
        return new_fn


def is_library_function(fn) -> bool:
    return _code_facts(fn.__code__)[0]


def global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= global_names(c)
    return names


_FACTS: dict[int, tuple] = {}


def _code_facts(code: types.CodeType) -> tuple[bool, tuple[str, ...]]:
    """(whether the code is a library's, its global names sorted): fixed for a code object, and
    asked on every call (the call cache's and the trace cache's fingerprints), so kept by the
    code object's identity (the entry holds the code, so its id is not reused)."""
    hit = _FACTS.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    filename = os.path.abspath(code.co_filename)
    library = filename.startswith(_TORCH_DIR) or "site-packages" in filename and "flexjit" not in filename
    facts = (library, tuple(sorted(global_names(code))))
    if len(_FACTS) > 4096:
        _FACTS.clear()
    _FACTS[id(code)] = (code, facts)
    return facts



def tensor_name(fn, t: torch.Tensor, depth: int = 0) -> str | None:
    """The name under which ``fn`` captures tensor ``t`` (a closure variable or a global its
    code names, looked up through nested functions, ``functools.partial`` objects and tuples
    of functions, as ``ScalarRewriter`` walks them), or None: how a message names a tensor
    the user knows. A view of ``t`` counts as ``t``."""
    if depth > 8:
        return None
    if isinstance(fn, functools.partial):
        return next((n for n in (tensor_name(x, t, depth + 1) for x in (fn.func, *fn.args,
                                                                         *fn.keywords.values()))
                     if n), None)
    if isinstance(fn, (tuple, list)):
        return next((n for n in (tensor_name(x, t, depth + 1) for x in fn) if n), None)
    if not isinstance(fn, types.FunctionType):
        return None
    code = fn.__code__
    found = [(name, cell.cell_contents) for name, cell in zip(code.co_freevars, fn.__closure__ or ())
             if _filled(cell)]
    found += [(name, fn.__globals__[name]) for name in sorted(global_names(code))
              if name in fn.__globals__]
    for name, v in found:
        if v is t or isinstance(v, torch.Tensor) and t._base is v:
            return name
    for _, v in found:
        if isinstance(v, (types.FunctionType, functools.partial, tuple, list)) and \
                not (isinstance(v, types.FunctionType) and is_library_function(v)):
            name = tensor_name(v, t, depth + 1)
            if name:
                return name
    return None


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return False
    return True


class Unfingerprintable(Exception):
    """A captured value the fingerprint cannot vouch for: trace again every call."""


def fingerprint(v, depth: int = 0):
    """Everything a trace of ``v`` can depend on, as a hashable value.

    Functions by code, defaults, closure contents and the globals they name; numbers, bools,
    strings and None by value; tensors by identity, dtype, rank and requires_grad (their
    values are read at run time, not traced); modules by name; tuples/lists by contents.
    Anything else (an object whose attributes a mod might read) raises Unfingerprintable.
    """
    if depth > 16:
        raise Unfingerprintable
    if v is None or isinstance(v, (bool, int, float, str)):
        return (type(v).__name__, v)
    if isinstance(v, torch.Tensor):
        return ("T", id(v), v.dtype, v.dim(), v.requires_grad)
    if isinstance(v, types.ModuleType):
        return ("M", v.__name__)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(fingerprint(x, depth + 1) for x in v))
    if isinstance(v, functools.partial):
        return ("P", fingerprint(v.func, depth + 1), fingerprint(v.args, depth + 1),
                tuple(sorted((k, fingerprint(x, depth + 1)) for k, x in v.keywords.items())))
    if isinstance(v, types.FunctionType):
        if is_library_function(v):
            return ("LF", v.__module__, v.__qualname__, fingerprint(v.__closure__ and
                    tuple(c.cell_contents for c in v.__closure__), depth + 1))
        cells = tuple(c.cell_contents for c in v.__closure__ or ())
        g = v.__globals__
        named = tuple((n, fingerprint(g[n], depth + 1)) for n in _code_facts(v.__code__)[1] if n in g)
        return ("F", v.__code__, fingerprint(v.__defaults__, depth + 1),
                fingerprint(cells, depth + 1), named)
    module = (getattr(v, "__module__", None) or "").split(".")[0]
    if module in ("torch", "math", "builtins", "operator", "flexjit") and (
            isinstance(v, (type, types.BuiltinFunctionType)) or callable(v)):
        return ("C", id(v))  # library classes and functions: fixed for the process's life
    raise Unfingerprintable
