"""Host half of the Hopper (sm_90a) backward: ``compile_bwd`` and ``load_bwd`` give a
``CompiledBwd`` whose call runs ``bwd``'s three kernels (the launch itself is ``cute.host``'s).
With ``BwdTiling.q_head`` the main kernel adds dK/dV into fp32 workspaces and the postprocess
kernel runs twice more, converting them (``kv_workspaces``)."""

from cutlass import Float32

from flexjit.templates.cute import host
from flexjit.templates.cute.host import PARTS
from flexjit.templates.cute.sm90.bwd import BwdConfig, FlexAttentionBwdSm90
from flexjit.templates.cute.sm90.bwd_keys import FlexAttentionBwdKeysSm90
from flexjit.templates.cute.sm90.bwd_prepost import (FlexAttentionBwdPostSm90, FlexAttentionBwdPostTransposedSm90,
                                                     FlexAttentionBwdPreSm90)
from flexjit.templates.cute.sm90.bwd_tiling import keys96

__all__ = ["PARTS", "CompiledBwd", "compile_bwd", "load_bwd"]


class CompiledBwd(host.CompiledBwd):
    """The three compiled kernels of one sm90 backward (``host.CompiledBwd`` launches them)."""

    NAME = "cute_sm90_bwd"

    def sem_len(self, lpad: int) -> int:
        """Semaphores per (batch, query head) in deterministic mode: two per q tile (one per
        tile for each of the two dQ boxes), zeroed by the preprocess."""
        return 2 * -(-lpad // self.cfg.tiling.tile_m)

    def dq_transposed(self) -> bool:
        return self.cfg.tiling.dq_swapped

    def check_operands(self, q, k, v, dq, dk, dv) -> None:
        """K/V's batch against the query's (``check_kv_batch``)."""
        host.check_kv_batch(self.cfg.kv_batch_broadcast, q, k, v)

    def kv_outputs(self, dk, dv) -> tuple:
        return kv_workspaces(dk, dv) if self.cfg.tiling.q_head else (dk, dv)

    def finish_kv(self, kv_out: tuple, dk, dv) -> None:
        """q_head: dK and dV from their workspaces by the dQ postprocess's kernel (scale 1: the
        main kernel scaled dK; D = Dv wherever q_head is served)."""
        if self.cfg.tiling.q_head:
            for acc, out in zip(kv_out, (dk, dv)):
                self.parts["post"].ffi_fn(acc, out, 1.0)


def kv_workspaces(dk, dv) -> tuple:
    """The zeroed fp32 dK and dV accumulators of ``BwdTiling.q_head``, (B, Hkv, Spad, D) each
    (``host.padded_len`` rows: whole kv tiles, 16-byte row strides), as two halves of one
    allocation: one memset zeroes both (cheaper than a kernel of our own: the preprocess's grid
    walks query heads and rows, not kv heads)."""
    import torch

    B, Hkv, S, D = dk.shape
    assert dv.shape[-1] == D, "q_head serves head_dim == head_dim_v"
    ws = torch.zeros(2, B, Hkv, host.padded_len(S), D, dtype=torch.float32, device=dk.device)
    return ws[0], ws[1]


def compile_bwd(cfg: BwdConfig, aux_tensors=(), aux_scalars=(), options: str = "",
                parts=PARTS) -> CompiledBwd:
    """Compile the backward's kernels for this config and these aux kinds (dtypes and ranks of
    the captured tensors, types of the scalars). Sizes, strides, batch and heads are runtime
    values, so no example q/k/v are needed. Works on a CPU-only machine with
    CUTE_DSL_ARCH=sm_90a; with ``options='--keep-ptx'`` each part's ``compiled.__ptx__`` holds
    its PTX. ``parts``: which kernels to compile (the others are left out of the result)."""
    host.require_tvm_ffi("cute_sm90_bwd")
    kernels = {
        "pre": lambda: (FlexAttentionBwdPreSm90(cfg), host.placeholder_pre_args(cfg)),
        "main": lambda: ((FlexAttentionBwdKeysSm90 if keys96(cfg.tiling) else FlexAttentionBwdSm90)(cfg),
                         _main_args(cfg, aux_tensors, aux_scalars)),
        "post": lambda: ((FlexAttentionBwdPostTransposedSm90 if cfg.tiling.dq_swapped
                          else FlexAttentionBwdPostSm90)(cfg), host.placeholder_post_args(cfg)),
    }
    return CompiledBwd(cfg, host.compile_parts(kernels, host.compile_options(options), parts),
                       host.aux_signature(aux_tensors, aux_scalars))


def _main_args(cfg: BwdConfig, aux_tensors, aux_scalars) -> tuple:
    """``host.placeholder_main_args``, with fp32 dK/dV (the workspaces) under q_head."""
    args = host.placeholder_main_args(cfg, aux_tensors, aux_scalars)
    if not cfg.tiling.q_head:
        return args
    dk, dv = [host.placeholder(Float32, 4, 16, 4) for _ in range(2)]
    return (*args[:7], dk, dv, *args[9:])


def load_bwd(cfg: BwdConfig, ffi_fns: dict, signature=()) -> CompiledBwd:
    """A ``CompiledBwd`` from functions loaded from exported object files (``Part.export``)."""
    return CompiledBwd(cfg, host.load_parts(ffi_fns), signature)
