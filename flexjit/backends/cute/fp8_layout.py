"""The sm90 FP8 forward's Vᵀ on the GPU in one pass (Triton): ``value_transposed``.

``backends.cute.sm90.fp8_value_transposed`` defines the layout (and computes it with torch ops on
the CPU); this kernel writes the same bytes at copy speed: each program reads a tile of keys ×
head dims of V (rows contiguous), gathers the keys in the order of their slots and stores the
tile transposed, slots contiguous. Slots past S are zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _value_transposed(v_ptr, out_ptr, S, Sp, H, stride_b, stride_h, stride_s,
                      DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_s, pid_d, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    slots = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    j = slots % 32
    # The key at slot j of its block: the inverse of KEY_SLOT (templates/cute/sm90/fp8.py).
    keys = slots - j + 16 * (j // 16) + 8 * ((j % 4) // 2) + 2 * ((j % 16) // 4) + j % 2
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    src = v_ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + keys[:, None].to(tl.int64) * stride_s + d[None, :]
    x = tl.load(src, mask=(keys[:, None] < S) & (d[None, :] < DV), other=0)
    dst = out_ptr + bh.to(tl.int64) * DV * Sp + d[None, :].to(tl.int64) * Sp + slots[:, None]
    tl.store(dst, x, mask=d[None, :] < DV)


def value_transposed(v: torch.Tensor, Sp: int) -> torch.Tensor:
    """(B, H, S, Dv) e4m3 (last dim contiguous) -> (B, H, Dv, Sp) e4m3, keys permuted per 32."""
    B, H, S, Dv = v.shape
    u = v.view(torch.uint8)
    out = torch.empty(B, H, Dv, Sp, dtype=torch.uint8, device=v.device)
    block_s, block_d = 128, min(64, triton.next_power_of_2(Dv))
    grid = (Sp // block_s, triton.cdiv(Dv, block_d), B * H)
    _value_transposed[grid](u, out, S, Sp, H, u.stride(0), u.stride(1), u.stride(2),
                            DV=Dv, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4)
    return out.view(torch.float8_e4m3fn)
