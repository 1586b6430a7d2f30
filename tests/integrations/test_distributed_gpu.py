"""flexjit.distributed on the GPU (NCCL, the default backend: cute on the H200). Marker ``gpu``.

World size 1 in this process: the zigzag layout still cuts the sequence into two chunks, so
the ring runs 3 (causal) of its 4 (query chunk, key/value chunk) pairs through the backend's
own forward and backward with global index offsets and merges them by LSE: the GPU path of
the pair math, its offsets as runtime scalars and its backward with the GLOBAL out/LSE (the
CPU tests cover the reference backend's rescaled variant). Each result (output, LSE, dq, dk,
dv, a learnable table's gradient) is compared with float64 dense math (tests/oracle.py):
err(ring) <= 2 * err(plain flexjit.flex_attention on the same backend) + FLOOR.

With 2 or more GPUs a second test spawns 2 NCCL ranks (the P2P ring itself); it is skipped on
the one-GPU H200.

Shapes: B=2, 8 query / 4 KV heads (GQA), S=2048, D=128, bf16, block 128: chunks of 1024 hold
full, partial and empty blocks; small enough to compile each kernel once in a few seconds.
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist

import flexjit
import flexjit.integrations.distributed as cp
from flexjit import mods
from oracle import FLOOR, dense_attention, max_err
from test_distributed import run_ranks

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

B, HQ, HKV, S, D = 2, 8, 4, 2048, 128


def _loss(out, lse, g_out, g_lse):
    return (out.double() * g_out).sum() + (torch.where(torch.isfinite(lse), lse.double(), 0) * g_lse).sum()


def compare(case: str, layout: str, device) -> dict:
    """{quantity: (err ring, err plain, scale)} on this rank's shard against float64."""
    g = torch.Generator(device=device).manual_seed(5)
    shapes = [(B, HQ, S, D), (B, HKV, S, D), (B, HKV, S, D), (HQ, 2 * S - 1), (B, HQ, S, D), (B, HQ, S)]
    q, k, v, table, g_out, g_lse = (torch.randn(s, generator=g, device=device, dtype=torch.float64)
                                    for s in shapes)
    table = 0.5 * table

    def mods_for(t):
        if case == "causal":
            return mods.causal(), None
        if case == "document_bias":  # documents crossing the chunks, a learnable (H, 2S-1) table
            lens = torch.tensor([700, 300, 1000, 48])
            ids = torch.repeat_interleave(torch.arange(4), lens).to(device)
            return mods.document(ids), mods.relative_bias(t)
        raise KeyError(case)

    def run(dtype, fn):
        leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v, table)]
        mask_mod, score_mod = mods_for(leaves[3])
        out, lse, scale = fn(leaves, mask_mod, score_mod)
        grads = torch.autograd.grad(_loss(out, lse, *scale), leaves, allow_unused=True)
        return [out.detach(), lse.detach(), *[x.detach() if x is not None else None for x in grads]]

    def whole(leaves, mask_mod, score_mod):
        bm = flexjit.create_block_mask(mask_mod, None, None, S, S, device=device)
        out, lse = flexjit.flex_attention(*leaves[:3], score_mod, bm, enable_gqa=True, return_lse=True)
        return out, lse, (g_out, g_lse)

    def oracle(leaves, mask_mod, score_mod):
        out, lse = dense_attention(*leaves[:3], score_mod, mask_mod)
        return out, lse, (g_out, g_lse)

    def ring(leaves, mask_mod, score_mod):
        bm = flexjit.create_block_mask(mask_mod, None, None, S, S, device=device)
        sq, sk, sv = (cp.shard(x, layout=layout) for x in leaves[:3])  # differentiable cuts
        out, lse = cp.flex_attention(sq, sk, sv, score_mod, bm, layout=layout, enable_gqa=True,
                                     return_lse=True)
        return out, lse, (cp.shard(g_out, layout=layout), cp.shard(g_lse, layout=layout))

    ref = run(torch.float64, oracle)
    plain = run(torch.bfloat16, whole)
    got = run(torch.bfloat16, ring)
    stats = cp.last_stats()
    res = {"stats": {k: vars(s) for k, s in stats.items()}}
    for i, what in enumerate(("out", "lse", "dq", "dk", "dv", "dtable")):
        if ref[i] is None:
            continue
        # q, k, v's gradients arrive through cp.shard's backward: the full tensors' gradients,
        # zero outside this rank's shard, so compare on the shard (output and LSE: shard too)
        cut = (lambda t: t) if what == "dtable" else (lambda t: cp.shard(t, layout=layout))
        mine = got[i] if what in ("out", "lse", "dtable") else cut(got[i])
        r64 = cut(ref[i])
        res[what] = (max_err(mine, r64), max_err(cut(plain[i]), r64), r64.abs().max().item())
    return res


def _assert(res, who=""):
    for what, vals in res.items():
        if what == "stats":
            continue
        err, err_plain, scale = vals
        bound = 2 * err_plain + FLOOR[torch.bfloat16] * max(1.0, scale)
        assert err <= bound, f"{who}{what}: error {err:.3g} exceeds {bound:.3g} (plain call: {err_plain:.3g})"


@pytest.fixture
def nccl_world1(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("case,layout", [("causal", "zigzag"), ("document_bias", "contiguous"),
                                         ("document_bias", "zigzag")])
def test_world1_nccl_equals_plain_call(nccl_world1, case, layout):
    res = compare(case, layout, torch.device("cuda", 0))
    _assert(res)
    fwd = res["stats"]["forward"]
    assert fwd["messages_sent"] == 0 and fwd["backend"] in ("cute", "triton")
    if case == "causal" and layout == "zigzag":
        assert (fwd["pairs_computed"], fwd["pairs_skipped"]) == (3, 1)


def _worker(rank, world, init, out_dir):
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world)
        res = {f"{c}-{lay}": compare(c, lay, torch.device("cuda", rank))
               for c, lay in (("causal", "zigzag"), ("document_bias", "zigzag"))}
        dist.destroy_process_group()
    except BaseException:
        res = {"crash": traceback.format_exc()}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_nccl_ranks_equal_plain_call(tmp_path):
    for r, res in enumerate(run_ranks(_worker, 2, (2, str(tmp_path / "init"), str(tmp_path)),
                                      tmp_path, 400)):
        for name, case in res.items():
            _assert(case, f"rank {r} {name}: ")
