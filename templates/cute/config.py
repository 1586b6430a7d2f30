"""The kernels' frozen compile-time configuration, one family for both archs: ``Config`` holds
what every kernel reads, ``FwdConfig`` and ``BwdConfig`` what a direction adds; an arch's template subclasses them for its own
fields, and every kernel class derives from ``Kernel``."""

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Config:
    """What a forward's and a backward's compile-time configurations share (everything not in a
    config is a runtime argument). ``score_mod`` is the score hole: the forward's
    ``score_mod(score, b, h, q_idx, kv_idx, aux) -> modded``; a backward's reads it as
    ``score_mod_and_grad``, which also returns the derivative of the modded score."""

    head_dim: int
    head_dim_v: int
    dtype: type  # cutlass.BFloat16 or cutlass.Float16
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    has_block_mask: bool = False


@dataclass(frozen=True)
class FwdConfig(Config):
    """A forward's compile-time configuration."""

    rescale_threshold: float = 0.0  # log2 units; 0.0 rescales whenever a row max grows
    write_max: bool = False  # also write each row's max modded score (AuxRequest(max_scores))


@dataclass(frozen=True)
class BwdConfig(Config):
    """A backward's compile-time configuration (``score_mod`` is the ``score_mod_and_grad``)."""

    deterministic: bool = False
    # Gradients of captured tensors (the renderer's ``score_grads`` / ``grad_offsets``, or None):
    # the main kernel then takes one fp64 accumulator per learnable tensor.
    score_grads: Optional[Callable] = None
    grad_offsets: Optional[Callable] = None

    @property
    def score_mod_and_grad(self) -> Optional[Callable]:
        return self.score_mod

    def __post_init__(self):
        if (self.score_grads is None) != (self.grad_offsets is None):
            raise ValueError("score_grads and grad_offsets come together")
        if self.score_grads is not None and self.score_mod_and_grad is None:
            raise ValueError("captured-tensor gradients need a score_mod")


def check_head_dims(template: str, head_dim: int, head_dim_v: int, head_dims) -> None:
    """A config's head dims must be a pair the template has a tile for."""
    if (head_dim, head_dim_v) not in head_dims:
        raise NotImplementedError(
            f"{template}: head dims ({head_dim}, {head_dim_v}) not in {head_dims}")


class Kernel:
    """A kernel class's base: what every kernel reads from its configuration (the config, the
    element type, the head dims, the two mods, whether block lists come)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.dtype = cfg.dtype
        self.head_dim, self.head_dim_v = cfg.head_dim, cfg.head_dim_v
        self.score_mod = cfg.score_mod
        self.mask_mod = cfg.mask_mod
        self.sparse = cfg.has_block_mask


class TiledKernel(Kernel):
    """A warp-specialised kernel with a ``cfg.tiling`` (the sm90 ones): the tile and its stages,
    one producer warpgroup beside ``num_mma_threads`` MMA threads, the two register budgets."""

    def __init__(self, cfg, num_mma_threads: int):
        super().__init__(cfg)
        t = cfg.tiling
        self.tile_m, self.tile_n, self.num_stages = t.tile_m, t.tile_n, t.num_stages
        self.num_mma_threads = num_mma_threads
        self.num_threads = 128 + num_mma_threads
        self.mma_regs, self.load_regs = t.mma_regs, t.load_regs
        self.kv_batch_broadcast = bool(cfg.kv_batch_broadcast)
