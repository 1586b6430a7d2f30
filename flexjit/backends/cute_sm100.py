"""The CuTeDSL Blackwell backend (sm_100a): fill the sm100 forward's holes from a Program, compile.

Status: REFUSES EVERY CALL. The kernel (``templates/cute_sm100_fwd.py``) compiles for sm_100a on
the CPU but has never run on a Blackwell GPU, and the first-use self-check that would have to
pass before it may answer is not built, so ``supports`` says no and ``flexjit.dispatch`` does not
list this module. What is here is what that gate will call:

* ``sm100_block_lists``: flexjit's 128×128 block lists regrouped for the kernel's 256-row query
  tiles (one merged kv list per pair of mask-block rows, a kind per sub-tile), remembered on the
  BlockMask.
* ``compile_program``: the forward for a Program, its mods rendered by the shared CuTe renderer
  (``cute_sm90.load_mods``: the same generated module fills the sm90 and sm100 kernels), kept in
  memory per (program, dtype, head dims, block-mask presence, captured-tensor kinds, options).
* ``forward``: allocate, compile, launch; only reachable by calling it directly.
"""
from __future__ import annotations

import logging
import time

import torch

from .. import cache, ir
from ..ir import Op
from ..passes import Program
from .cute_sm90 import _aux_tensor, _cutlass_dtype, block_sparse_args, load_mods

# (head_dim, head_dim_v) pairs the sm100 forward has a tile for (``cute_sm100_fwd.HEAD_DIMS``,
# repeated so that refusing needs no cutlass import).
HEAD_DIMS = ((64, 64), (128, 128))
REFUSAL = "never run on Blackwell; self-check not built"

log = logging.getLogger("flexjit")
_COMPILED: dict[tuple, object] = {}

# A kv block's kind for one 128-row sub-tile (``cute_sm100_fwd.KIND_*``).
KIND_SKIP, KIND_PARTIAL, KIND_FULL = 0, 1, 2


def _template():
    return cache.load_template("cute_sm100_fwd")


def supports(call) -> tuple[bool, str]:
    """Always (False, reason): nothing may reach an unverified kernel.

    Once a first-use self-check exists, this must still refuse what the kernel does not handle
    (the sm90 backend's ``supports`` checks the same things): a device that is not sm_100
    (sm_103 needs its own ``--gpu-arch``), dtypes other than fp16/bf16, head dims outside
    ``HEAD_DIMS``, q/k/v without a contiguous last dim or with strides that are not 16-byte
    multiples (TMA), a batch broadcast by stride 0, block sizes other than 128x128, and a
    negative scale without a score_mod (the kernel folds the scale into exp2's multiplier and
    takes the row max of the raw q·k)."""
    return False, REFUSAL


# --------------------------------------------------------------------------- block lists


def merge_block_lists(kv_num, kv_idx, full_num, full_idx):
    """(num, indices, kinds) for 256-row query tiles from 128×128 block lists.

    Inputs are a BlockMask's int32 lists: counts (Bm, Hm, nQB), indices (Bm, Hm, nQB, nKVB), the
    first ``count`` entries of each row valid. Query tile m covers block rows 2m and 2m + 1 (a
    missing row 2m + 1, when nQB is odd, visits nothing). Output, int32: ``num`` (Bm, Hm, nQ2)
    kv blocks visited by either row, their ``indices`` (Bm, Hm, nQ2, nKVB) in ascending order,
    and ``kinds`` = k0 | k1 << 2 with k the row's kind of that block (0 skip, 1 partial, 2 full).
    A block listed both partial and full for one row counts as partial (mask_mod still
    applies), never as full. Entries past ``num`` hold index 0 and kind 0 and are never read."""
    Bm, Hm, nQB, nKVB = kv_idx.shape
    dev = kv_idx.device
    cols = torch.arange(kv_idx.shape[-1], device=dev)

    def dense(num, idx, code):
        out = torch.zeros(Bm, Hm, nQB, nKVB, dtype=torch.int64, device=dev)
        valid = cols < num[..., None].long()
        src = torch.where(valid, torch.full_like(idx, code, dtype=torch.int64),
                          torch.zeros_like(idx, dtype=torch.int64))
        return out.scatter_reduce(-1, idx.long().clamp(0, nKVB - 1), src, "amax")

    part = dense(kv_num, kv_idx, 1)
    full = dense(full_num, full_idx, 1) if full_num is not None else torch.zeros_like(part)
    cls = torch.where(part > 0, KIND_PARTIAL, torch.where(full > 0, KIND_FULL, KIND_SKIP))
    if nQB % 2:
        cls = torch.cat([cls, torch.zeros_like(cls[:, :, :1])], dim=2)
    pair = cls.view(Bm, Hm, -1, 2, nKVB)
    code = pair[:, :, :, 0] | (pair[:, :, :, 1] << 2)
    present = code != 0
    num = present.sum(-1)
    order = torch.argsort((~present).to(torch.int8), dim=-1, stable=True)
    kinds = torch.where(cols < num[..., None], code.gather(-1, order), torch.zeros_like(code))
    indices = torch.where(cols < num[..., None], order, torch.zeros_like(order))
    return tuple(t.to(torch.int32).contiguous() for t in (num, indices, kinds))


def sm100_block_lists(bm):
    """The kernel's three block tensors for a BlockMask (None without one), once per BlockMask."""
    if bm is None:
        return None
    return bm.derived("cute_sm100_lists", lambda: merge_block_lists(*block_sparse_args(bm)))


# --------------------------------------------------------------------------- compile, launch


def score_loads(program: Program) -> bool:
    """Whether the score_mod reads a captured tensor at an index that varies with kv_idx (a bias
    table: one load per score), ``FwdConfig.score_loads``: the softmax then goes through TMEM
    twice rather than spill beside the loads. A per-head or per-row load (ALiBi's slope) is
    one value per thread and stays on the one-pass path."""
    if program.score is None:
        return False
    memo: dict = {}
    return any(n.op is Op.LOAD and "kv" in ir.varies_with(n, memo)
               for n in ir.toposort([program.score]))


def compile_program(program: Program, q, v, has_block_mask: bool, aux_tensors, options: str = "",
                    write_max: bool = False, rescale_threshold: float = 0.0):
    """Compile (or find in memory) the sm100 forward for this program and these input kinds.
    Only dtypes, head dims, ranks and block-mask presence shape the kernel. Works on the CPU
    (the template always targets sm_100a). No disk cache yet: it would need a kernel that has
    been verified to be worth keeping."""
    tpl = _template()
    D, Dv = q.shape[-1], v.shape[-1]
    sig = tuple((t.dtype, t.dim()) for t in aux_tensors)
    key = (program.key, q.dtype, D, Dv, has_block_mask, sig, program.scalar_dtypes, options,
           write_max, float(rescale_threshold))

    def build():
        mods = load_mods(program)
        cfg = tpl.FwdConfig(D, Dv, _cutlass_dtype(q.dtype), mods.score_mod, mods.mask_mod,
                            has_block_mask=has_block_mask, rescale_threshold=rescale_threshold,
                            write_max=write_max, score_loads=score_loads(program))
        t0 = time.perf_counter()
        fn = tpl.compile_fwd(cfg, q, aux_tensors, program.scalars, options=options)
        log.info("flexjit: sm100 forward for %s/%s D=%d compiled in %.1f s", program.score_name,
                 program.mask_name, D, time.perf_counter() - t0)
        return fn

    return cache.cached(_COMPILED, key, build)


def forward(call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, lse, max_scores or None). Unverified: ``supports`` refuses every call, so dispatch
    never gets here."""
    prog = call.program
    q, k, v = call.q, call.k, call.v
    bm = call.block_mask
    lists = sm100_block_lists(bm)
    aux = tuple(_aux_tensor(t, q.device) for t in prog.buffers)
    fn = compile_program(prog, q, v, lists is not None, aux, write_max=call.max_scores)
    o = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    max_scores = torch.empty_like(lse) if call.max_scores else None
    fn(q, k, v, o, lse, call.scale, lists, aux, prog.scalars, max_scores=max_scores)
    return o, lse, max_scores
