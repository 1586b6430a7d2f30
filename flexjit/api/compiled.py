"""flexjit inside ``torch.compile``: flex_attention and create_block_mask in a compiled graph.

Dynamo cannot run flexjit's tracer, so the API calls the mods inside torch's
``dynamo_bypassing_wrapper`` higher-order op on "role" tensors (all-ones tensors of 5 to 8 dims
standing for score, b, h, q_idx, kv_idx: no captured tensor has that many) and dynamo lifts what
they capture into graph inputs. At AOT-trace time the HOP's wrapper retraces that subgraph with
flexjit's tracer (the eager IR, hence the eager kernels) and calls the custom ops
``flexjit::attention`` (backward: ``flexjit::attention_backward``) and ``flexjit::block_mask``,
whose one non-tensor input is the program as text, so a graph from inductor's disk cache needs
nothing else. The attention ops make no host syncs (CUDA graphs capture them); the planner is
``cudagraph_unsafe``. docs/DESIGN.md says why this road and not others.
"""
from __future__ import annotations

import ast
import functools
import json
import math

import torch
import torch.fx

from flexjit.runtime import compile_pool, dispatch
from flexjit.ir import nodes as ir
from flexjit.planner.block_mask import (BlockMask, _dense_to_ordered, _transpose_ordered, plan_blocks,
                                        with_int32_lists)
from flexjit.ir.passes import FLOAT_INDEX_LIMIT, lower
from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, trace_bound
from flexjit.ir.program import TracedMod
from flexjit.runtime.call import Call
from flexjit.backends.fp8 import Fp8, is_fp8

try:  # torch >= 2.8; both supported stacks (2.11-2.13) have it
    from torch._higher_order_ops import dynamo_bypassing_wrapper
except ImportError:  # pragma: no cover
    dynamo_bypassing_wrapper = None

# Role tensors: (kind, dtype, number of all-ones dims).
_ROLES = (("score", torch.float32, 5), ("b", torch.int32, 5), ("h", torch.int32, 6),
          ("q_idx", torch.int32, 7), ("kv_idx", torch.int32, 8))
_LIST_ATTRS = BlockMask._TENSOR_ATTRS


def _role_of(x) -> str | None:
    if isinstance(x, torch.Tensor) and x.dim() >= 5 and all(s == 1 for s in x.shape):
        for name, dtype, dims in _ROLES:
            if x.dtype == dtype and x.dim() == dims:
                return name
    return None


def _role_tensors(device, names):
    return [torch.zeros((1,) * dims, dtype=dtype, device=device)
            for name, dtype, dims in _ROLES if name in names]


def _require_hop():
    if dynamo_bypassing_wrapper is None:
        raise RuntimeError("flexjit under torch.compile needs torch's dynamo_bypassing_wrapper "
                           f"(torch >= 2.8); this torch is {torch.__version__}")


# --------------------------------------------------------------------------- program text


def _encode(score: TracedMod | None, mask: TracedMod | None, learnable, float_index: bool,
            scalar_kinds) -> str:
    """The program as the custom ops receive it: everything ``lower`` needs but the values."""
    return json.dumps({
        "score": ir.serialize([score.out]) if score else None,
        "mask": ir.serialize([mask.out]) if mask else None,
        "names": [score.name if score else "identity", mask.name if mask else "noop"],
        "n_score": [len(score.buffers), len(score.scalars)] if score else [0, 0],
        "learnable": list(learnable), "float_index": float_index, "scalars": list(scalar_kinds)})


@functools.lru_cache(maxsize=1024)
def _decode(text: str) -> dict:
    spec = json.loads(text)
    for part in ("score", "mask"):
        spec[part] = ir.deserialize(spec[part])[0] if spec[part] is not None else None
    return spec


def _program(text: str, buffers, iscalars, fscalars, lengths):
    spec = _decode(text)
    ints, floats = iter(iscalars), iter(fscalars)
    scalars = [int(next(ints)) if kind == "i" else float(next(floats).item()) for kind in spec["scalars"]]
    nb, ns = spec["n_score"]
    score = mask = None
    if spec["score"] is not None:
        score = TracedMod(SCORE_MOD, spec["names"][0], spec["score"], list(buffers[:nb]), scalars[:ns])
    if spec["mask"] is not None:
        mask = TracedMod(MASK_MOD, spec["names"][1], spec["mask"], list(buffers[nb:]), scalars[ns:])
    return lower(score, mask, spec["float_index"], learnable=tuple(spec["learnable"]), lengths=lengths), spec


def _block_mask(lists, L: int, S: int, block, mean_kv_tokens: float) -> BlockMask | None:
    if not block:
        return None
    bm = BlockMask((L, S), *lists, BLOCK_SIZE=tuple(block))
    if mean_kv_tokens < 0 and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        mean_kv_tokens = float(S)  # unknown, and no sync is allowed: plan for long kv loops
    if mean_kv_tokens >= 0:
        bm.derived("mean_kv_tokens", lambda: mean_kv_tokens)
    return with_int32_lists(bm)  # a hand-built mask's int64 lists arrive as they were given


def _fp8(q, descales, out_dtype: str) -> Fp8 | None:
    """The call's FP8 part from the op's arguments: ``descales`` (q, k, v; None for 1.0) and the
    output dtype's name; None for 16/32-bit inputs (no descales, "")."""
    if not out_dtype:
        return None
    qd, kd, vd = descales
    return Fp8(qd, kd, vd, getattr(torch, out_dtype), is_fp8(q))


def _out_dtype(q, out_dtype: str) -> torch.dtype:
    return getattr(torch, out_dtype) if out_dtype else q.dtype


def _call(q, k, v, lists, buffers, iscalars, fscalars, program, scale, block, mean_kv_tokens,
          options, train, want_max=False, descales=(), out_dtype=""):

    prog, _ = _program(program, buffers, iscalars, fscalars, (*q.shape[:3], k.shape[2]))
    bm = _block_mask(lists, q.shape[2], k.shape[2], block, mean_kv_tokens)
    opts = {}
    for entry in filter(None, options.split("\n")):
        key, value = entry.split("=", 1)
        opts[key] = ast.literal_eval(value)
    return Call(q, k, v, prog, bm, scale, opts, grad=train, max_scores=want_max,
                fp8=_fp8(q, descales, out_dtype))


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("flexjit::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lists: list[torch.Tensor | None],
                 buffers: list[torch.Tensor], iscalars: list[int], fscalars: list[torch.Tensor], program: str,
                 scale: float, block: list[int], mean_kv_tokens: float, options: str, backend: str,
                 train: bool, want_max: bool, descales: list[torch.Tensor | None],
                 out_dtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, max_scores) of flex_attention; ``train``: whether the backward will run, so the
    forward is the one dispatch pairs with a backward, as in eager mode; max_scores is empty
    unless ``want_max``. FP8 inputs: ``descales`` (q, k, v; None for 1.0) and ``out_dtype`` (a
    torch dtype's name), read by the backend itself where it can (``dispatch.forward``); else
    both empty."""
    call = _call(q, k, v, lists, buffers, iscalars, fscalars, program, scale, block, mean_kv_tokens,
                 options, train, want_max, descales, out_dtype)
    choice = dispatch.select(backend, call)
    compile_pool.ahead(choice.backward, call)  # as dispatch.run: the backward compiles meanwhile
    out, lse, max_scores = dispatch.forward(choice.name, call)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if max_scores is None:
        max_scores = q.new_empty(0, dtype=lse_dtype)
    return out, lse.to(lse_dtype), max_scores.to(lse_dtype)


@attention_op.register_fake
def _(q, k, v, lists, buffers, iscalars, fscalars, program, scale, block, mean_kv_tokens, options,
      backend, train, want_max, descales, out_dtype):
    B, Hq, L, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    # out in the query's dimension order, as dispatch.forward returns it
    out = dispatch.empty_in_layout((B, Hq, L, v.shape[-1]), q, _out_dtype(q, out_dtype))
    return (out, q.new_empty(B, Hq, L, dtype=lse_dtype),
            q.new_empty(*((B, Hq, L) if want_max else (0,)), dtype=lse_dtype))


@torch.library.custom_op("flexjit::attention_backward", mutates_args=())
def attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                          lists: list[torch.Tensor | None], buffers: list[torch.Tensor],
                          iscalars: list[int], fscalars: list[torch.Tensor], program: str, scale: float,
                          block: list[int], mean_kv_tokens: float, options: str,
                          backend: str) -> list[torch.Tensor]:
    """[dq, dk, dv, *gradients of the learnable captured tensors, in buffer order]."""
    call = _call(q, k, v, lists, buffers, iscalars, fscalars, program, scale, block, mean_kv_tokens,
                 options, True)
    choice = dispatch.select(backend, call)
    dq, dk, dv, *dbufs = dispatch.backward(choice.backward, call, q, k, v, out, lse, dout, dlse)
    learnable = _decode(program)["learnable"]
    return [dq, dk, dv] + [g if g is not None else torch.zeros_like(b)
                           for g, b, want in zip(dbufs, buffers, learnable) if want]


@attention_backward_op.register_fake
def _(q, k, v, out, lse, dout, dlse, lists, buffers, iscalars, fscalars, program, scale, block,
      mean_kv_tokens, options, backend):
    learnable = _decode(program)["learnable"]
    grads = [dispatch.empty_in_layout(t.shape, t) for t in (q, k, v)]  # as dispatch.backward's
    return grads + [
        torch.empty_like(b) for b, want in zip(buffers, learnable) if want]


def _setup_attention(ctx, inputs, output):
    (q, k, v, lists, buffers, iscalars, fscalars, program, scale, block, mean, options, backend,
     _train, _want_max, _descales, _out_dtype) = inputs
    present = [t is not None for t in lists]
    ctx.mark_non_differentiable(output[2])  # max_scores, as torch's: no gradient
    ctx.save_for_backward(q, k, v, *output[:2], *[t for t in lists if t is not None], *buffers)
    ctx.present, ctx.n_buffers = present, len(buffers)
    # How autograd flattens the inputs (torch._library.autograd): a list of tensors only, or an
    # empty one, is a list of gradients; any other list (numbers, or block lists with a None:
    # a BlockMask without full lists) is one leaf.
    ctx.shape_of_inputs = [len(x) if isinstance(x, list) and all(
        isinstance(e, torch.Tensor) for e in x) else None for x in inputs]
    ctx.args = (iscalars, fscalars, program, scale, block, mean, options, backend)


def _attention_grad(ctx, dout, dlse, _dmax):
    q, k, v, out, lse, *rest = ctx.saved_tensors
    it = iter(rest[:len(rest) - ctx.n_buffers])
    lists = [next(it) if p else None for p in ctx.present]
    buffers = rest[len(rest) - ctx.n_buffers:]
    iscalars, fscalars, program, scale, block, mean, options, backend = ctx.args
    if dout is None:
        dout = torch.zeros_like(out)
    grads = attention_backward_op(q, k, v, out, lse, dout, dlse, lists, list(buffers), iscalars,
                                  fscalars, program, scale, block, mean, options, backend)
    learned = iter(grads[3:])
    dbufs = [next(learned) if want else None for want in _decode(program)["learnable"]]
    # One gradient per input, a list for a list input: q, k, v and the learnable buffers get one.
    nothing = [None if n is None else [None] * n for n in ctx.shape_of_inputs]
    return (grads[0], grads[1], grads[2], nothing[3], dbufs, *nothing[5:])


attention_op.register_autograd(_attention_grad, setup_context=_setup_attention)

_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


@torch.library.custom_op("flexjit::block_mask", mutates_args=(), tags=_UNSAFE)
def block_mask_op(buffers: list[torch.Tensor], iscalars: list[int], fscalars: list[torch.Tensor],
                  program: str, B: int, H: int, L: int, S: int, block: list[int],
                  device: torch.device) -> list[torch.Tensor]:
    """The eight block lists of create_block_mask (kv partial/full, then q partial/full); the
    planner runs on the CPU, as in eager mode."""
    prog, _ = _program(program, buffers, iscalars, fscalars, (B, H, L, S))
    bq, bkv = block
    kinds = plan_blocks(prog.mask, prog.buffers, prog.scalars, B, H, L, S, bq, bkv)
    kv_num, kv_idx = _dense_to_ordered(kinds == 1)
    fkv_num, fkv_idx = _dense_to_ordered(kinds == 2)
    q_num, q_idx = _transpose_ordered(kv_num, kv_idx)
    fq_num, fq_idx = _transpose_ordered(fkv_num, fkv_idx)
    return [t.to(device) for t in (kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx)]


def _list_shapes(B, H, L, S, bq, bkv):
    nq, nkv = -(-L // bq), -(-S // bkv)
    return [(B, H, nq), (B, H, nq, nkv)] * 2 + [(B, H, nkv), (B, H, nkv, nq)] * 2


@block_mask_op.register_fake
def _(buffers, iscalars, fscalars, program, B, H, L, S, block, device):
    return [torch.empty(s, dtype=torch.int32, device=device) for s in _list_shapes(B, H, L, S, *block)]


# --------------------------------------------------------------------------- the captured mods


def _sub_module(gm: torch.fx.GraphModule, out_index: int, scalar_phs: set) -> torch.fx.GraphModule:
    """``gm`` computing only its output ``out_index``, with ``.item()`` of scalar placeholders
    (dynamo's tensorised Python floats) replaced by the placeholder itself."""
    g = torch.fx.Graph()
    val_map: dict = {}
    outs = g.graph_copy(gm.graph, val_map)
    out = outs[out_index]
    if isinstance(out, torch.fx.Node) and out.target is torch.as_tensor:  # a mod returned a constant
        out = out.args[0]
    g.output(out)
    for n in list(g.nodes):
        if n.op == "call_method" and n.target == "item" and n.args[0].name in scalar_phs:
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
    g.eliminate_dead_code()
    return torch.fx.GraphModule(gm, g)


def _is_scalar_arg(x, node) -> bool:
    """A captured number: a SymInt/SymFloat/number input, or dynamo's 0-d tensor form of a
    Python float (read through ``.item()`` only)."""
    if isinstance(x, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(x, bool):
        return True
    return (isinstance(x, torch.Tensor) and x.dim() == 0 and bool(node.users)
            and all(u.op == "call_method" and u.target == "item" for u in node.users))


class _Captured:
    """The mods dynamo captured in one HOP subgraph, retraced into flexjit IR."""

    def __init__(self, gm: torch.fx.GraphModule, args: tuple, first: int):
        self.gm, self.args = gm, args
        self.phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(self.phs) != len(args):
            raise RuntimeError(f"flexjit: the captured mods take {len(self.phs)} inputs, got {len(args)}")
        self.roles = {i: _role_of(a) for i, a in enumerate(args) if i >= first and _role_of(a)}
        self.scalar_idx = [i for i, (a, n) in enumerate(zip(args, self.phs))
                           if i >= first and i not in self.roles and _is_scalar_arg(a, n)]
        self.scalar_names = {self.phs[i].name for i in self.scalar_idx}

    def trace(self, kind: str, name: str, out_index: int) -> tuple[TracedMod, list[int]]:
        """The mod at output ``out_index`` as a TracedMod, and for each of its scalar slots the
        index of the argument holding its value."""
        sub = _sub_module(self.gm, out_index, self.scalar_names)
        used = {n.name for n in sub.graph.nodes if n.op == "placeholder" and n.users}
        sources: list[int] = []

        def bind(ctx):
            fixed = list(self.args)
            for i in self.scalar_idx:
                if self.phs[i].name in used:
                    example = 0 if isinstance(self.args[i], (int, torch.SymInt)) else 0.0
                    fixed[i] = ctx.scalar(example, ("fx", i))
                    sources.append(i)
            roles = {r: i for i, r in self.roles.items()}

            def mod(*xs):
                names = ("score", "b", "h", "q_idx", "kv_idx")[5 - len(xs):]
                call_args = list(fixed)
                for nm, x in zip(names, xs):
                    if nm in roles:
                        call_args[roles[nm]] = x
                return sub(*call_args)
            return mod
        return trace_bound(kind, name, bind), sources

    def scalar_values(self, sources: list[int]) -> tuple[list[str], list, list]:
        """(kinds, ints, floats) for the ops: ints as (Sym)Ints; floats as 0-d CPU tensors, the
        form dynamo gives a Python float it stopped specialising (a ``float`` argument of a
        custom op would specialise it again: a recompile per value)."""
        kinds, ints, floats = [], [], []
        for i in sources:
            a = self.args[i]
            if isinstance(a, (int, torch.SymInt)):
                kinds.append("i")
                ints.append(a)
            else:
                kinds.append("f")
                floats.append(a if isinstance(a, torch.Tensor) else torch.scalar_tensor(a, dtype=torch.float64))
        return kinds, ints, floats


def _bind_attention(static: tuple, gm: torch.fx.GraphModule):
    """The HOP's wrapper: at AOT-trace time, retrace the mods and call ``flexjit::attention``."""
    (names, has, n_tensors, present, scale, block, mean, options, backend, want_max,
     (has_descale, out_dtype)) = static

    def run(*args):
        ops = _operands(args, n_tensors)
        cap = _Captured(gm, args, ops[-1] + 1)
        q, k, v = (args[i] for i in ops[:3])
        sm_scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        float_index = bool(max(*q.shape[:3], k.shape[2]) < FLOAT_INDEX_LIMIT)  # guards on the bound only
        it = iter(args[i] for i in ops[3:])
        lists = [next(it) if p else None for p in present]
        descales = [next(it) if p else None for p in has_descale]
        score = mask = None
        src_s = src_m = []
        out_index = 3  # after out, lse, max_scores
        if has[0]:
            score, src_s = cap.trace(SCORE_MOD, names[0], out_index)
            out_index += 1
        if has[1]:
            mask, src_m = cap.trace(MASK_MOD, names[1], out_index)
            _check_broadcast(mask, lists[0], q)
        buffers = (score.buffers if score else []) + (mask.buffers if mask else [])
        learnable = [bool(t.requires_grad and t.is_floating_point()) for t in buffers]
        kinds, ints, floats = cap.scalar_values(src_s + src_m)
        program = _encode(score, mask, learnable, float_index, kinds)
        lower(score, mask, float_index)  # errors in the mods surface here, at compile time
        train = torch.is_grad_enabled() and any(t.requires_grad for t in [q, k, v, *buffers])
        out, lse, max_scores = attention_op(q, k, v, lists, buffers, ints, floats, program, sm_scale,
                                            list(block), mean, options, backend, train, want_max,
                                            descales, out_dtype)
        extra = [torch.empty(n.meta["example_value"].shape, dtype=n.meta["example_value"].dtype,
                             device=n.meta["example_value"].device)
                 for n in list(gm.graph.output_node().args[0])[3:]]
        return (out, lse, max_scores, *extra)
    return run


def _operands(args, n: int) -> list[int]:
    """The positions of the HOP's first ``n`` tensor operands among the subgraph's arguments:
    under dynamic shapes dynamo lifts the symbols of each tensor's sizes in before it."""
    found = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)][:n]
    if len(found) != n:
        raise RuntimeError(f"flexjit: the captured mods' graph has {len(found)} tensor inputs, expected {n}")
    return found


def _check_broadcast(mask: TracedMod, kv_num_blocks, q) -> None:
    """As in eager mode: a mask planned for one batch/head must not read b/h when broadcast."""
    for dim, op, what in ((0, ir.Op.B, "batch index b"), (1, ir.Op.H, "head index h")):
        if kv_num_blocks.shape[dim] == 1 and q.shape[dim] > 1 and ir.uses(mask.out, op):
            raise ValueError(f"mask_mod `{mask.name}` depends on the {what}, but the block_mask was "
                             f"created with {'BH'[dim]}=1/None; create it with "
                             f"{'BH'[dim]}={q.shape[dim]}")


def _bind_block_mask(static: tuple, gm: torch.fx.GraphModule):
    """The HOP's wrapper for create_block_mask: retrace the mask, call ``flexjit::block_mask``."""
    name, block, device = static

    def run(*args):
        # the lengths' carrier: the empty 5-d tensor (0, B, H, L, S); dynamo orders the subgraph's
        # inputs by first use, so it is found by its shape
        carrier = next(a for a in args if isinstance(a, torch.Tensor) and a.dim() == 5 and a.shape[0] == 0)
        B, H, L, S = carrier.shape[1:]
        cap = _Captured(gm, args, 0)
        mask, sources = cap.trace(MASK_MOD, name, 8)
        kinds, ints, floats = cap.scalar_values(sources)
        program = _encode(None, mask, [False] * len(mask.buffers), False, kinds)
        lists = block_mask_op(mask.buffers, ints, floats, program, B, H, L, S, list(block),
                              torch.device(device))
        out = gm.graph.output_node().args[0][8].meta["example_value"]
        return (*lists, torch.empty(out.shape, dtype=out.dtype, device=out.device))
    return run


# --------------------------------------------------------------------------- front ends (traced by dynamo)


def _mod_name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def flex_attention(q, k, v, score_mod, block_mask, scale: float | None, kernel_options, backend: str,
                   mask_mod, want_max: bool = False, fp8: Fp8 | None = None):
    """(out, lse, max_scores or None) of a validated call, inside a graph dynamo is tracing.
    ``scale`` None: 1/sqrt(E), formed where the head dim is known (a symbol under dynamic shapes
    while dynamo traces). ``fp8``: the FP8 inputs' descales and output dtype (``api.fp8``),
    handed to the op as they are: the backend that runs decides whether it dequantises."""
    B, Hq, L, E = q.shape
    Ev = v.shape[-1]
    lists = [getattr(block_mask, a) for a in _LIST_ATTRS] if block_mask is not None else []
    present = tuple(t is not None for t in lists)
    descales = [fp8.q_descale, fp8.k_descale, fp8.v_descale] if fp8 is not None else []
    has_descale = tuple(t is not None for t in descales)
    out_dtype = str(fp8.out_dtype).removeprefix("torch.") if fp8 is not None else ""
    out_torch_dtype = fp8.out_dtype if fp8 is not None else q.dtype
    # Views make each a graph value of its own, so none is merged with another (q is k is v).
    tensors = [t.view(t.shape) for t in [q, k, v] + [t for t in lists if t is not None] +
               [t for t in descales if t is not None]]
    n_lists = sum(present)
    block = _block_size(block_mask)
    mean = _known_mean(block_mask)
    # kernel_options as "key=repr(value)" lines (json is not traceable by dynamo)
    options = "\n".join(f"{key}={value!r}" for key, value in sorted((kernel_options or {}).items()))
    names = (_mod_name(score_mod) if score_mod is not None else "identity",
             _mod_name(mask_mod) if mask_mod is not None else "noop")
    if score_mod is None and mask_mod is None:
        train = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        scale = scale if scale is not None else 1.0 / math.sqrt(E)
        out, lse, max_scores = attention_op(
            tensors[0], tensors[1], tensors[2], _unflatten(tensors[3:3 + n_lists], present), [], [], [],
            _NO_MODS, scale, list(block), mean, options, backend, train, want_max,
            _unflatten(tensors[3 + n_lists:], has_descale), out_dtype)
        return out, lse, max_scores if want_max else None
    _require_hop()
    # The HOP's static arguments must be Python constants; what depends on the shapes (the
    # default scale, the float-index choice) is formed by the wrapper, where dynamic shapes are
    # symbols that guard on what the value depends on.
    static = (names, (score_mod is not None, mask_mod is not None), len(tensors), present, scale,
              block, mean, options, backend, want_max, (has_descale, out_dtype))
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32

    def inner(*args):
        ts = args[:len(tensors)]
        score, b, h, q_idx, kv_idx = args[len(tensors):]
        # First use fixes the order in which dynamo lifts these inputs (e4m3 has no sum).
        anchor = sum((t.float() if is_fp8(t) else t).sum() for t in ts)
        zero = (anchor * 0).to(lse_dtype)
        outs = [torch.empty((B, Hq, L, Ev), dtype=out_torch_dtype, device=q.device) + zero.to(out_torch_dtype),
                torch.empty((B, Hq, L), dtype=lse_dtype, device=q.device) + zero,
                torch.empty((B, Hq, L) if want_max else (0,), dtype=lse_dtype, device=q.device) + zero]
        if score_mod is not None:
            outs.append(score_mod(score, b, h, q_idx, kv_idx))
        if mask_mod is not None:
            m = mask_mod(b, h, q_idx, kv_idx)
            outs.append(m if isinstance(m, torch.Tensor) else torch.as_tensor(m))
        return tuple(outs)

    roles = _role_tensors(q.device, ("score", "b", "h", "q_idx", "kv_idx"))
    res = dynamo_bypassing_wrapper(functools.partial(_bind_attention, static), inner, *tensors, *roles)
    return res[0], res[1], res[2] if want_max else None


def _unflatten(tensors, present):
    it = iter(tensors)
    return [next(it) if p else None for p in present]


_NO_MODS = _encode(None, None, [], False, [])


def _block_size(block_mask) -> tuple:
    """The BlockMask's block size, from its text: under dynamic=True dynamo makes its integers
    symbols, where the HOP's static arguments must be constants (the block size shapes the
    kernels: a new one compiles anew, as in torch's flex_attention)."""
    if block_mask is None:
        return ()
    return tuple(int(x) for x in block_mask._block_text.split(","))


def _known_mean(block_mask) -> float:
    """The BlockMask's remembered schedule hint (``mean_kv_tokens``, to a power of two), or -1 if
    it has none."""
    if block_mask is None:
        return -1.0
    hit = getattr(block_mask, "_derived", {}).get("mean_kv_tokens")
    return float(hit[2]) if hit is not None else -1.0  # its text: a constant under dynamic=True


def create_block_mask(mask_mod, B, H, Q_LEN: int, KV_LEN: int, device, BLOCK_SIZE) -> BlockMask:
    """create_block_mask inside a graph dynamo is tracing: the planner as a custom op."""
    _require_hop()
    B_, H_ = (1 if B is None else B), (1 if H is None else H)
    bq, bkv = BLOCK_SIZE
    static = (_mod_name(mask_mod), (bq, bkv), str(device))
    # The lengths travel as the shape of an empty tensor, not in the HOP's static arguments:
    # under dynamic shapes they are symbols, which a static argument cannot hold.
    lengths = torch.empty((0, B_, H_, Q_LEN, KV_LEN), device=device)

    def inner(carrier, b, h, q_idx, kv_idx):
        m = mask_mod(b, h, q_idx, kv_idx)
        m = m if isinstance(m, torch.Tensor) else torch.as_tensor(m)
        shapes = _list_shapes(*carrier.shape[1:], bq, bkv)
        used = carrier.sum().to(torch.int32)  # a use keeps the carrier among the subgraph's inputs
        return (*[torch.empty(s, dtype=torch.int32, device=device) + used for s in shapes], m)

    roles = _role_tensors(device, ("b", "h", "q_idx", "kv_idx"))
    res = dynamo_bypassing_wrapper(functools.partial(_bind_block_mask, static), inner, lengths, *roles)
    return BlockMask((Q_LEN, KV_LEN), *res[:8], BLOCK_SIZE=(bq, bkv), mask_mod=mask_mod)

