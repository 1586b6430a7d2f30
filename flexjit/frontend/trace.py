"""Tracing: run a user's score_mod / mask_mod on symbolic proxies and record IR.

``trace_mod(fn, kind)`` calls ``fn`` once with :class:`Proxy` arguments standing
for (score,) b, h, q_idx, kv_idx. Python operators on proxies and the torch
functions we support (intercepted by a ``TorchFunctionMode``) build IR nodes.
The proxies and the routing of one torch call are ``frontend/proxy.py``; the table of
torch functions is ``frontend/torch_ops.py``; this module holds the entry points.

Captures:
  * a torch.Tensor the mod indexes with traced values (``bias[h, q_idx]``) or
    uses as a 0-d value becomes a BUFFER input, deduplicated by identity;
  * a Python int/float reached through the mod's closure or globals becomes a
    SCALAR: a run-time argument, so a new value reuses the compiled kernel.
    (The function is re-created with proxies in those closure cells/globals.)

Anything that cannot be expressed per element raises :class:`TraceError` naming
the mod, the user's source line, the reason and what to write instead.

A trace is reused while the mod's fingerprint (``captures.fingerprint``: its code and
everything it captures, numbers by value) is unchanged, so Python control flow on captured
scalars (``if window > 0``) stays correct: a new value traces again, and the branch taken
lands in the IR.
"""
from __future__ import annotations

import functools
import inspect
import types
import weakref
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from flexjit import config
from flexjit.ir import nodes as ir
from flexjit.frontend import torch_ops
from flexjit.frontend.captures import ScalarRewriter, Unfingerprintable, fingerprint
from flexjit.frontend.proxy import (_ACTIVE, BufferView, Proxy, TraceError, _coerce, _Context,
                                    _dispatch, _is_row, Vector)
from flexjit.ir.nodes import DType, Node, Op, cast
from flexjit.ir.program import TracedMod

SCORE_MOD = "score_mod"
MASK_MOD = "mask_mod"
_ARG_NAMES = {SCORE_MOD: ("score", "b", "h", "q_idx", "kv_idx"), MASK_MOD: ("b", "h", "q_idx", "kv_idx")}

__all__ = ["SCORE_MOD", "MASK_MOD", "TraceError", "check_arity", "trace_mod", "trace_bound"]

torch_ops.register()


class _TraceMode(TorchFunctionMode):
    """Routes torch calls that touch proxies to IR builders; refuses tensor creation."""

    def __init__(self, ctx: _Context):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _dispatch(self.ctx, func, args, kwargs or {})



# --------------------------------------------------------------------------- entry point


_ARITY_CHECKED: "weakref.WeakKeyDictionary[Callable, tuple]" = weakref.WeakKeyDictionary()


def check_arity(fn: Callable, kind: str) -> None:
    """Raise a clear TypeError unless fn takes exactly the mod's positional arguments. A plain
    function that passed is remembered with its code and defaults (inspect.signature costs tens
    of microseconds, and every flex_attention call checks its score_mod)."""
    stamp = (kind, getattr(fn, "__code__", None), getattr(fn, "__defaults__", None))
    try:
        if stamp[1] is not None and _ARITY_CHECKED.get(fn) == stamp:
            return
    except TypeError:  # not weak-referenceable
        pass
    _check_arity(fn, kind)
    if stamp[1] is not None:
        try:
            _ARITY_CHECKED[fn] = stamp
        except TypeError:
            pass


def _check_arity(fn: Callable, kind: str) -> None:
    want = _ARG_NAMES[kind]
    if not callable(fn):
        raise TypeError(f"{kind} must be callable, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) <= len(want) <= len(positional):
        return
    name = getattr(fn, "__name__", type(fn).__name__)
    other = MASK_MOD if kind == SCORE_MOD else SCORE_MOD
    hint = ""
    if len(required) == len(_ARG_NAMES[other]):
        hint = f" It looks like a {other}: pass it as {'block_mask=create_block_mask(...)' if other == MASK_MOD else 'score_mod='}."
    raise TypeError(f"{kind} `{name}` must take {len(want)} arguments ({', '.join(want)}), "
                    f"but it takes {len(required)}.{hint}")


# --------------------------------------------------------------------------- trace cache


_TRACES: "weakref.WeakKeyDictionary[Callable, tuple]" = weakref.WeakKeyDictionary()


def trace_mod(fn: Callable, kind: str) -> TracedMod:
    """Trace ``fn`` (a score_mod or mask_mod) into IR. Raises TraceError/TypeError.

    A trace is reused while the function's fingerprint (its code and everything it captures)
    is unchanged; a function capturing something we cannot fingerprint is traced every call."""
    try:
        fp = (kind, fingerprint(fn))
    except (Unfingerprintable, ValueError, TypeError):  # ValueError: an empty closure cell
        return _trace(fn, kind)
    hit = _TRACES.get(fn)
    if hit is not None and hit[0] == fp:
        return hit[1]
    traced = _trace(fn, kind)
    try:
        _TRACES[fn] = (fp, traced)
    except TypeError:  # not weak-referenceable
        pass
    return traced


def trace_bound(kind: str, name: str, bind: Callable[["_Context"], Callable]) -> TracedMod:
    """Trace the callable ``bind(ctx)`` returns as a mod of ``kind`` named ``name``, uncached.
    ``bind`` may create SCALAR proxies itself (``ctx.scalar``): how ``flexjit.api.compiled`` traces
    the FX graph dynamo captured of a mod, whose captured numbers are graph inputs."""
    ctx = _Context(bind, kind)
    ctx.name = name
    return _run_trace(ctx, bind(ctx))


def _trace(fn: Callable, kind: str) -> TracedMod:
    check_arity(fn, kind)
    ctx = _Context(fn, kind)
    target = fn
    if isinstance(fn, (types.FunctionType, functools.partial)):
        target = ScalarRewriter(ctx.scalar).value(fn, (id(fn), 0))
    return _run_trace(ctx, target)


def _run_trace(ctx: _Context, target: Callable) -> TracedMod:
    kind = ctx.kind
    args = [Proxy(ir.node(op, DType.FLOAT32 if op is Op.SCORE else DType.INT32), ctx)
            for op in ((Op.SCORE,) if kind == SCORE_MOD else ()) + (Op.B, Op.H, Op.Q_IDX, Op.KV_IDX)]
    _ACTIVE.append(ctx)
    try:
        with _TraceMode(ctx):
            result = target(*args)
    except TraceError:
        raise
    except RecursionError:
        raise
    except Exception as e:  # an error of the user's own code while tracing
        raise TraceError(ctx.describe(f"{type(e).__name__}: {e}",
                                      "the mod raised while being traced; it is called once with "
                                      "symbolic arguments", tb=e.__traceback__)) from e
    finally:
        _ACTIVE.pop()
    out = _result_node(ctx, result)
    if config.settings.debug:
        print(f"[flexjit] traced {kind} `{ctx.name}`: {len(ctx.buffers)} buffer(s), "
              f"scalars={ctx.scalars}\n{ir.format_graph({'out': out})}")
    return TracedMod(kind, ctx.name, out, ctx.buffers, ctx.scalars)


def _result_node(ctx: _Context, result) -> Node:
    if _is_row(result):
        row = result if isinstance(result, Vector) else result._as_row()
        raise TraceError(f"{ctx.kind} `{ctx.name}` returned a row of {len(row.items)} values, not "
                         f"one element ({row.origin}); or reduce the row, e.g. "
                         "(pos[q_idx] - pos[kv_idx]).pow(2).sum(-1)")
    if isinstance(result, BufferView) or (isinstance(result, torch.Tensor) and result.dim() > 0):
        raise TraceError(f"{ctx.kind} `{ctx.name}` returned a tensor, not one element; "
                         "index captured tensors down to a single element")
    if result is None:
        raise TraceError(f"{ctx.kind} `{ctx.name}` returned None; did you forget `return`?")
    try:
        n = _coerce(ctx, result)
    except TraceError:
        raise TraceError(f"{ctx.kind} `{ctx.name}` returned {type(result).__name__}, not a value")
    if ctx.kind == MASK_MOD:
        if n.dtype is not DType.BOOL:
            raise TraceError(f"mask_mod `{ctx.name}` must return a bool, but returns {n.dtype.value}; "
                             "compare to get a bool, e.g. `q_idx >= kv_idx`")
        return n
    if n.dtype is DType.BOOL:
        raise TraceError(f"score_mod `{ctx.name}` returns a bool; a score_mod returns the new score. "
                         "For masking, use a mask_mod in create_block_mask, or "
                         "torch.where(cond, score, -float('inf'))")
    return cast(n, DType.FLOAT32)

