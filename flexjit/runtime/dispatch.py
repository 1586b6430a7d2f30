"""Backend selection and the one autograd Function: the only place that looks at the device.

Each backend module exposes

* ``supports(call) -> (bool, reason)``: whether its forward can run the call;
* ``forward(call) -> (out, lse, max_scores)``: the forward, no autograd; max_scores (the row max
  of the modded scores) when ``call.max_scores`` asks for it, else None;
* ``backward_supports(call) -> (bool, reason)``: whether its backward can;
* ``backward(call, q, k, v, out, lse, dout, dlse) -> (dq, dk, dv, *captured grads)``, one
  gradient per ``Program.buffers`` entry (None where none is computed).

``select`` picks the forward (the first of the preference order that supports the call) and,
when the call needs gradients, its backward as a pair: the forward's own backend when it can,
else the next that can (the sm90 forward trains on the Triton backward for head dims its
backward lacks). ``flexjit.explain`` shows the same answer without running anything.

Preference for "auto": Hopper (sm90) -> cute; Blackwell (10.x) -> cute_sm100, only once its
compiled kernel has passed its first-use self-check on that GPU (``flexjit.runtime.selfcheck``, run
from ``backends.cute.sm100.supports``); any other CUDA GPU -> triton; CPU -> reference; on any GPU, a
decode-shaped call without gradients (``backends.triton.decode.routes``) -> triton first. An explicit
backend that cannot serve the call is an error; ``backend="cute"`` on a 10.x GPU is the sm100
backend (gated the same way).

FP8 inputs (``call.fp8``): a backend that reads them itself says so (``fp8_native(call)``: the
reference, Triton's split-KV decode kernel); for any other, ``supports`` is asked of the call
dequantised to the output dtype (``Call.dequantized``: shape-only stand-ins while choosing) and
``forward`` runs it on the dequantised tensors: correct, not faster; the reason says so. No
backward follows an FP8 forward: ``run`` gives its outputs a backward that raises, saying how to
train (bf16 inputs).

A backend that declares configurations (``tuning``, ``backward_tuning``) runs the one
``runtime.autotune`` picks; ``explain`` adds which and why (``Choice.config``).

``run`` is the eager entry: one ``torch.autograd.Function`` over every backend pair. A call
that will train on the sm90 backward starts its backward's compile in a worker before the
forward runs (``runtime.compile_pool``); ``backward`` waits for it. The
torch.compile path (``flexjit.api.compiled``) calls the same ``forward``/``backward`` from its custom
ops. Backends run with autocast off: the API casts the inputs once, by autocast's policy, before
they reach here.
"""
from __future__ import annotations

import dataclasses

import torch

from flexjit import config
from flexjit.backends import reference, triton
from flexjit.backends.base import Backend, capability
from flexjit.backends.cute import sm90 as cute_sm90, sm100 as cute_sm100
from flexjit.backends.triton import decode as triton_decode
from flexjit.ir import bounds
from flexjit.runtime import autotune, compile_pool, selfcheck

BACKENDS = ("cute", "triton", "reference")
_MODULES: dict[str, Backend] = {"cute": cute_sm90, "cute_sm100": cute_sm100, "triton": triton,
                                "reference": reference}
# Which backends may compute the gradients of each forward, in order of preference. A backward
# only needs (q, k, v, out, lse): any backend's backward can follow any forward of the same
# semantics; these orders keep training on the fastest one that runs the call.
_BACKWARD_ORDER = {"cute": ("cute", "triton"), "cute_sm100": ("cute_sm100", "triton"),
                   "triton": ("triton",), "reference": ("reference",)}


@dataclasses.dataclass(frozen=True)
class Choice:
    """The forward's backend, why, why the others were passed over, and (for a call that needs
    gradients) the backward's backend and why."""
    name: str
    reason: str
    passed_over: tuple[tuple[str, str], ...] = ()
    backward: str | None = None
    backward_reason: str = ""
    config: str = ""  # explain(): the forward's configuration and why ("" where none is tuned)
    backward_config: str = ""

    def __str__(self):
        lines = [f"backend: {self.name} ({self.reason})"]
        lines += [f"  {self.config}"] if self.config else []
        lines += [f"  not {n}: {r}" for n, r in self.passed_over]
        if self.backward is not None:
            lines.append(f"backward: {self.backward} ({self.backward_reason})")
            lines += [f"  {self.backward_config}"] if self.backward_config else []
        return "\n".join(lines)


def module(name: str) -> Backend:
    """The backend module ``name``."""
    return _MODULES[name]


def arch_of(device: torch.device) -> str:
    """'cpu', 'sm80', 'sm90', 'sm100', ... for a tensor's device."""
    if device.type != "cuda":
        return device.type
    major, minor = capability(device)
    return f"sm{major}{minor}"


def _supports(name: str, call, what: str = "supports") -> tuple[bool, str]:
    if name in config.settings.disabled:
        return False, f"FLEXJIT_DISABLE lists {name}"
    mod = _MODULES[name]
    if call.fp8 is not None:
        return _supports_fp8(name, mod, call, what)
    ok, why = getattr(mod, what)(call)
    if not ok:
        return False, why
    return selfcheck.admit(mod, call, "forward" if what == "supports" else "backward", why)


def fp8_native(mod: Backend, call) -> tuple[bool, str]:
    """(whether backend ``mod`` reads the call's FP8 inputs itself, why or why not)."""
    ask = getattr(mod, "fp8_native", None)
    return ask(call) if ask is not None else (False, "it has no FP8 kernel")


def _supports_fp8(name: str, mod: Backend, call, what: str = "supports",
                  admit: bool = True) -> tuple[bool, str]:
    """A backend's answer for an FP8 call: its own where it reads FP8, else its answer for the
    call dequantised to the output dtype, that road named in the reason. ``admit``: ask for the
    first-use self-check's verdict too."""
    if what != "supports":
        return False, "no backward runs through FP8 inputs"
    native, why_native = fp8_native(mod, call)
    if native:
        ok, why = mod.supports(call)
        road = why_native
    else:
        call = call.dequantized(shapes_only=True)
        ok, why = mod.supports(call)
        if not ok:
            return False, f"{why} (with the FP8 inputs dequantised to {_dtype_name(call.q.dtype)})"
        road = (f"FP8 inputs dequantised to {_dtype_name(call.q.dtype)} on the device first "
                f"({why_native}): correct, not faster")
    if ok and admit:
        ok, why = selfcheck.admit(mod, call, "forward", why)
    return ok, f"{why}; {road}" if ok else why


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _backward_of(name: str, call) -> tuple[str | None, str]:
    """(backend, reason) of the backward that follows forward ``name``; (None, why not) if none."""
    refused = []
    for bwd in _BACKWARD_ORDER[name]:
        ok, why = _supports(bwd, call, "backward_supports")
        if ok:
            if bwd != name:
                why = f"{why}; not on {name}: {'; '.join(refused)}"
            return bwd, why
        refused.append(why)
    return None, "; ".join(f"{b}: {r}" for b, r in zip(_BACKWARD_ORDER[name], refused))


def _pair(name: str, reason: str, call, passed=()) -> Choice | str:
    """The Choice for forward ``name``, or why training cannot run on it."""
    if not call.needs_grad:
        return Choice(name, reason, tuple(passed))
    bwd, why = _backward_of(name, call)
    if bwd is None:
        return f"{reason}, but no backward can train it ({why})"
    return Choice(name, reason, tuple(passed), bwd, why)


def check_backend(requested: str) -> None:
    if requested not in BACKENDS + ("auto",):
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {requested!r}")


def select(requested: str, call) -> Choice:
    check_backend(requested)
    if requested != "auto":
        name = "cute_sm100" if requested == "cute" and _sm100(call.q.device) else requested
        ok, reason = _supports(name, call)
        choice = _pair(name, f"requested; {reason}", call) if ok else reason
        if isinstance(choice, str):
            raise NotImplementedError(f"backend={requested!r} cannot run this call: {choice}. "
                                      f"Use backend='auto' to pick one that can.")
        return _the_others(choice, call, None, lambda n: f"backend={requested!r} was asked for")
    passed = []
    order = _preference(call.q.device)
    if "triton" in order and _decodes(call):
        order = ("triton",) + tuple(n for n in order if n != "triton")
    for name in order:
        ok, reason = _supports(name, call)
        choice = _pair(name, reason, call, passed) if ok else reason
        if isinstance(choice, Choice):
            return _the_others(choice, call, order, lambda n: f"{choice.name} ranks above it on "
                                                              f"{arch_of(call.q.device)} and runs the call")
        passed.append((name, choice))
    raise NotImplementedError("no backend can run this call:\n" +
                              "\n".join(f"  {n}: {r}" for n, r in passed))


def _the_others(choice: Choice, call, order, unreached) -> Choice:
    """``choice`` with a reason for every backend it lists nowhere (``explain`` says why each
    other one was passed over): ``unreached(name)`` for one that ``order`` holds but the choice
    came first (for every one when a backend was asked for by name, ``order`` None), and for one
    that ``auto`` never tries on this device its own refusal (its ``supports``; no self-check
    runs) or, if it could run the call, that auto leaves it out."""
    cute = "cute_sm100" if _sm100(call.q.device) else "cute"
    listed = {choice.name} | {n for n, _ in choice.passed_over}
    rest = []
    for name in (cute, "triton", "reference"):
        if name in listed:
            continue
        if order is None or name in order:
            rest.append((name, unreached(name)))
            continue
        if name in config.settings.disabled:
            ok, why = False, f"FLEXJIT_DISABLE lists {name}"
        elif call.fp8 is not None:
            ok, why = _supports_fp8(name, _MODULES[name], call, admit=False)
        else:
            ok, why = _MODULES[name].supports(call)
        rest.append((name, why if not ok else f"it could run the call ({why}), but auto does not "
                                              f"try it on {arch_of(call.q.device)}; ask for it "
                                              f"with backend={name!r}"))
    return dataclasses.replace(choice, passed_over=choice.passed_over + tuple(rest))


def with_configs(choice: Choice, call) -> Choice:
    """``choice`` with the configuration each of its passes runs on, and why (``explain``)."""
    fwd_call = call
    if call.fp8 is not None and not fp8_native(module(choice.name), call)[0]:
        fwd_call = call.dequantized(shapes_only=True)
    backward = "" if choice.backward is None else autotune.describe(module(choice.backward), call, "bwd")
    return dataclasses.replace(choice, config=autotune.describe(module(choice.name), fwd_call, "fwd"),
                               backward_config=backward)


def _sm100(device: torch.device) -> bool:
    return cute_sm100.on_sm100(device)


def _preference(device: torch.device) -> tuple[str, ...]:
    if _sm100(device):
        return ("cute_sm100", "triton", "reference")
    if device.type == "cuda":
        return ("cute", "triton", "reference")
    # Off the GPU only the reference runs; the Triton interpreter (TRITON_INTERPRET=1)
    # is for tests and must be asked for by name.
    return ("reference",)


def _decodes(call) -> bool:
    """Whether the Triton backend's split-KV decode kernel takes the call (few query rows, long
    KV, no gradient): it goes before the sm90 prefill kernel, whose grid has too few CTAs."""
    if "triton_decode" in config.settings.disabled:
        return False
    return triton_decode.routes(call)[0]


# --------------------------------------------------------------------------- running


def forward(name: str, call) -> tuple:
    """(out, lse, max_scores or None) of backend ``name``'s forward, outside autograd and autocast;
    out in the query's dimension order (``follow_layout``). A mod that indexes a captured tensor
    out of range raises ``IndexError`` here, before any backend runs (``ir.bounds``): kernels
    cannot raise, and their clamp would answer silently."""
    bounds.check(call.program, (*call.q.shape[:3], call.k.shape[2]))
    like = call.q
    if call.fp8 is not None and not fp8_native(module(name), call)[0]:
        call = call.dequantized()  # the road around a backend without an FP8 kernel
    device = call.q.device.type
    if not torch.is_autocast_enabled(device):  # the context manager costs ~3 µs a call
        out, lse, max_scores = autotune.forward(module(name), call)
    else:
        with torch.autocast(device, enabled=False):
            out, lse, max_scores = autotune.forward(module(name), call)
    return follow_layout(out, like), lse, max_scores


def backward(name: str, call, q, k, v, out, lse, dout, dlse) -> tuple:
    """(dq, dk, dv, *captured grads) of backend ``name``'s backward, outside autocast; dq, dk
    and dv in the layouts of q, k and v."""
    if dout is None:  # only the LSE was used
        dout = torch.zeros_like(out)
    compile_pool.wait(name, call)  # the kernels compiled ahead of need (``run``) are on disk now
    with torch.autocast(q.device.type, enabled=False):
        dq, dk, dv, *rest = autotune.backward(module(name), call, q, k, v, out, lse, dout, dlse)
    return (follow_layout(dq, q), follow_layout(dk, k), follow_layout(dv, v), *rest)


def layout_order(like: torch.Tensor) -> list[int] | None:
    """``like``'s dimensions from outermost to innermost, or None where its strides give no
    order to follow (an expanded or sliced view: not dense)."""
    order = sorted(range(like.dim()), key=lambda d: -like.stride(d))  # stable: ties keep dim order
    return order if like.permute(order).is_contiguous() else None


def empty_in_layout(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """An empty tensor of ``shape`` whose dimensions lie in ``like``'s order (torch's flex gives its
    output the query's stride order: a (B, L, H, D) buffer viewed as (B, H, L, D) yields an out
    that is such a view too); contiguous where ``like`` has no order."""
    dtype = like.dtype if dtype is None else dtype
    order = layout_order(like)
    if order is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return torch.empty([shape[d] for d in order], dtype=dtype, device=like.device).permute(inverse)


def follow_layout(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """``t`` (a result shaped like ``like`` but for its last dim) in ``like``'s dimension order: as
    it is when it already is (the common, contiguous case: no copy), else copied once."""
    if t is None or like.is_contiguous() and t.is_contiguous():
        return t
    order = layout_order(like)
    if order is None:
        return t
    stride, step = [0] * t.dim(), 1
    for d in reversed(order):
        stride[d], step = step, step * t.shape[d]
    if all(a == b for a, b, n in zip(stride, t.stride(), t.shape) if n > 1):
        return t
    return empty_in_layout(t.shape, like, t.dtype).copy_(t)


class _FlexAttention(torch.autograd.Function):
    """flex_attention on any (forward, backward) pair of backends."""

    @staticmethod
    def forward(ctx, call, choice: Choice, q, k, v, *buffers):
        out, lse, max_scores = forward(choice.name, call)
        ctx.call, ctx.backend = call, choice.backward
        ctx.save_for_backward(q, k, v, out, lse, *buffers)
        if max_scores is None:
            return out, lse
        ctx.mark_non_differentiable(max_scores)  # as torch's: no gradient through the row max
        return out, lse, max_scores

    @staticmethod
    def backward(ctx, dout, dlse, dmax=None):
        q, k, v, out, lse, *buffers = ctx.saved_tensors
        if config.settings.debug:
            print(f"[flexjit] backward on {ctx.backend}")
        with torch.no_grad():  # no backend's backward is differentiable
            dq, dk, dv, *dbufs = backward(ctx.backend, ctx.call, q, k, v, out, lse, dout, dlse)
        wanted = ctx.needs_input_grad[5:]
        grads = (dq, dk, dv, *[g if want else None for g, want in zip(dbufs, wanted)])
        if torch.is_grad_enabled():  # create_graph=True: a second derivative may be asked for
            grads = _NoDoubleBackward.refuse(grads, (q, k, v, dout, dlse, *buffers))
        return (None, None, *grads)


class _NoDoubleBackward(torch.autograd.Function):
    """The gradients of a backward run with ``create_graph=True``, passed through unchanged, and
    an error naming the limit when a second derivative reaches them. Without it they would not
    require grad and autograd's own error ("does not require grad") would not say why."""

    @staticmethod
    def refuse(grads: tuple, inputs: tuple) -> tuple:
        anchor = next((t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad), None)
        present = [g for g in grads if g is not None]
        if anchor is None or not present:
            return grads  # nothing upstream could be differentiated twice
        aliased = iter(_NoDoubleBackward.apply(anchor, *present))
        return tuple(None if g is None else next(aliased) for g in grads)

    @staticmethod
    def forward(ctx, anchor, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("flex_attention does not support double backward (a derivative of its "
                           "gradients, e.g. through torch.autograd.grad(..., create_graph=True)): "
                           "its backward kernels are not differentiable. Use the gradients "
                           "without differentiating them again, or compute that term with plain "
                           "torch attention.")


class _NoFp8Backward(torch.autograd.Function):
    """An FP8 call's forward whose outputs autograd tracks (an input or a captured tensor requires
    grad): the forward as it is, and a backward that says how to get gradients."""

    @staticmethod
    def forward(ctx, call, choice: Choice, *inputs):
        out, lse, max_scores = forward(choice.name, call)
        return (out, lse) if max_scores is None else (out, lse, max_scores)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(FP8_NO_GRAD)


FP8_NO_GRAD = ("flex_attention computes no gradients through FP8 (float8_e4m3fn) inputs. To train, "
               "pass bfloat16 query, key and value (dequantised: x.float() * x_descale, then "
               ".to(torch.bfloat16)); to run inference, call it under torch.no_grad().")


def run(choice: Choice, call) -> tuple:
    """(out, lse, max_scores or None) for a validated call; out and lse are differentiable in
    q, k, v and captured tensors (an FP8 call's backward raises ``FP8_NO_GRAD``)."""
    if call.fp8 is not None and torch.is_grad_enabled() and (
            any(t.requires_grad for t in (call.q, call.k, call.v))
            or any(b.requires_grad for b in call.program.buffers)):
        res = _NoFp8Backward.apply(call, choice, call.q, call.k, call.v, *call.program.buffers)
        return res if len(res) == 3 else (*res, None)
    if choice.backward is None:
        if not torch.is_grad_enabled():
            return forward(choice.name, call)
        with torch.no_grad():
            return forward(choice.name, call)
    if call.grad is None:  # grad mode is off inside the Function: backends must still know
        call.grad = True     # (the Triton backend sends only gradient-free calls to decoding)
    compile_pool.ahead(choice.backward, call)  # the backward's kernels compile while this runs
    res = _FlexAttention.apply(call, choice, call.q, call.k, call.v, *call.program.buffers)
    return res if len(res) == 3 else (*res, None)
