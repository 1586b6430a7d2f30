"""The TMA atoms both sm90 backward main kernels (``bwd``, ``bwd_keys``) build alike: the
operand loads with the bytes each load pipeline expects, and the dQ reduce-add."""

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync


def load_atoms(kernel, q, k, v, do, lse2, delta, sQ_layout, sdO_layout, sK_layout, sV_layout):
    """((atom, tensor) for Q, dO, K, V, lse2, delta) over the sequence-major views, each box one
    pipeline stage; sets ``kernel.tx_q`` / ``tx_do`` (a Q or dO stage plus its row statistics)
    and ``tx_kv`` (K and V)."""
    tm, tn, D, Dv, dtype = kernel.tile_m, kernel.tile_n, kernel.head_dim, kernel.head_dim_v, kernel.dtype
    g2s = cpasync.CopyBulkTensorTileG2SOp()
    sQ, sdO = cute.select(sQ_layout, mode=[0, 1]), cute.select(sdO_layout, mode=[0, 1])
    atoms = (cpasync.make_tiled_tma_atom(g2s, q, sQ, (tm, D)),
             cpasync.make_tiled_tma_atom(g2s, do, sdO, (tm, Dv)),
             cpasync.make_tiled_tma_atom(g2s, k, sK_layout, (tn, D)),
             cpasync.make_tiled_tma_atom(g2s, v, sV_layout, (tn, Dv)),
             cpasync.make_tiled_tma_atom(g2s, lse2, cute.make_layout(tm), (tm,)),
             cpasync.make_tiled_tma_atom(g2s, delta, cute.make_layout(tm), (tm,)))
    row_bytes = tm * 4
    kernel.tx_q = cute.size_in_bytes(dtype, sQ) + row_bytes
    kernel.tx_do = cute.size_in_bytes(dtype, sdO) + row_bytes
    kernel.tx_kv = cute.size_in_bytes(dtype, sK_layout) + cute.size_in_bytes(dtype, sV_layout)
    return atoms


def dq_atom(dqacc, sdQ_layout, dq_box):
    """(atom, tensor) of the dQ box's TMA reduce-add into the fp32 accumulator."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyReduceBulkTensorTileS2GOp(cute.ReductionKind.ADD),
                                       dqacc, cute.select(sdQ_layout, mode=[0, 1]), dq_box)
