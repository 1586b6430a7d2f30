"""The sm90 forward's 192-row query tile over 128×128 block masks, on the GPU.

At head dim 64 the forward runs three consumer warpgroups on 192-row query tiles, so one tile
covers two mask-block rows (``cute_sm90.merged_row_lists``): a kv block is visited where either
row lists it, runs without mask_mod only where both rows list it full, and each 64-row
warpgroup applies its own row's kind (skip, partial, full). These tests compare it with float64
math on every core mask, on ragged and unequal lengths, GQA, both schedules, and on block masks
whose lists disagree with their mask_mod (torch's semantics: a full block keeps every score, an
unlisted one none, whatever mask_mod says), where only the per-warpgroup kinds give the right
answer. The same calls pinned to the 128-row tile (``kernel_options={"TILE_M": 128}``) must
agree too. Head dim 96 has the 192-row tile as well, with P through shared memory for the PV
GEMM (``sm90.p_smem``), and so has head dim 32; they are checked the same way.
"""
import pytest
import torch

from flexjit import create_block_mask
from flexjit.api.attention import explain, flex_attention
from flexjit.planner.block_mask import BlockMask, _dense_to_ordered
from mods_catalog import make_case
from oracle import FLOOR, assert_close_to_oracle, dense_attention

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper GPU", allow_module_level=True)


def _qkv(B, Hq, Hkv, L, S, D=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


@pytest.mark.parametrize("persistent", [False, True], ids=["per_tile", "persistent"])
@pytest.mark.parametrize("tile_m", [192, 128])
@pytest.mark.parametrize("L,S", [(1000, 1000), (777, 1300), (4096, 4096)])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "document", "alibi",
                                  "softcap", "full"])
def test_core_masks_match_the_oracle(name, L, S, tile_m, persistent):
    B, Hq, Hkv = 2, 8, 2
    torch.manual_seed(0)
    case = make_case(name, B, Hq, L, S, device="cuda")
    q, k, v = _qkv(B, Hq, Hkv, L, S)
    bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cuda") if case.mask_mod else None
    opts = {"TILE_M": tile_m, "PERSISTENT": persistent}
    choice = explain(q, k, v, case.score_mod, bm, enable_gqa=True, kernel_options=opts)
    assert choice.name == "cute" and f"{tile_m}-row query tiles" in choice.reason, str(choice)
    with torch.no_grad():
        out, lse = flex_attention(q, k, v, case.score_mod, bm, enable_gqa=True, return_lse=True,
                                  kernel_options=opts)
        ref, ref_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=torch.float64)
        low, low_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=q.dtype)
    assert_close_to_oracle(f"{name} out", out, ref, low, FLOOR[q.dtype])
    assert_close_to_oracle(f"{name} lse", lse, ref_lse, low_lse, FLOOR[q.dtype])


# Head dims 96 (P through smem) and 32 on 192-row tiles: every core mask on ragged, unequal
# and 4k lengths (one full 192-row tile, a ragged last one, a ragged last kv tile), GQA 8/2,
# both schedules.
@pytest.mark.parametrize("D", [96, 32])
@pytest.mark.parametrize("persistent", [False, True], ids=["per_tile", "persistent"])
@pytest.mark.parametrize("L,S", [(1000, 1000), (777, 1300), (4096, 4096)])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "alibi", "softcap",
                                  "full"])
def test_head_dim_96_tile_192_matches_the_oracle(name, L, S, persistent, D):
    B, Hq, Hkv = 2, 8, 2
    torch.manual_seed(0)
    case = make_case(name, B, Hq, L, S, device="cuda")
    q, k, v = _qkv(B, Hq, Hkv, L, S, D=D)
    bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cuda") if case.mask_mod else None
    opts = {"TILE_M": 192, "PERSISTENT": persistent}
    choice = explain(q, k, v, case.score_mod, bm, enable_gqa=True, kernel_options=opts)
    assert choice.name == "cute" and "192-row query tiles" in choice.reason, str(choice)
    with torch.no_grad():
        out, lse = flex_attention(q, k, v, case.score_mod, bm, enable_gqa=True, return_lse=True,
                                  kernel_options=opts)
        ref, ref_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=torch.float64)
        low, low_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=q.dtype)
    assert_close_to_oracle(f"{name} out", out, ref, low, FLOOR[q.dtype])
    assert_close_to_oracle(f"{name} lse", lse, ref_lse, low_lse, FLOOR[q.dtype])


def _stripes(b, h, q_idx, kv_idx):
    return (q_idx + 2 * kv_idx) % 5 != 0


@pytest.mark.parametrize("persistent", [False, True], ids=["per_tile", "persistent"])
@pytest.mark.parametrize("tile_m", [192, 128])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("D", [64, 96, 32])
def test_lists_that_disagree_with_mask_mod(D, seed, tile_m, persistent):
    """Random kinds per 128×128 block (a third each skipped, partial, full) under a mask_mod
    that is true and false inside every block: the result is the reference backend's, which
    applies torch's rule block by block. Rows whose blocks are all skipped give O = 0."""
    B, Hq, Hkv, L, S = 1, 4, 2, 1000, 1100
    nq, nk = -(-L // 128), -(-S // 128)
    g = torch.Generator(device="cuda").manual_seed(seed)
    kinds = torch.randint(0, 3, (B, Hq, nq, nk), device="cuda", generator=g)
    kinds[:, :, 2] = 0  # a whole mask-block row skipped: half of a 192-row tile sees nothing
    p_num, p_idx = _dense_to_ordered(kinds == 1)
    f_num, f_idx = _dense_to_ordered(kinds == 2)
    bm = BlockMask.from_kv_blocks(p_num, p_idx, f_num, f_idx, BLOCK_SIZE=128, mask_mod=_stripes,
                                  seq_lengths=(L, S))
    q, k, v = _qkv(B, Hq, Hkv, L, S, D=D, seed=seed)
    opts = {"TILE_M": tile_m, "PERSISTENT": persistent}
    assert explain(q, k, v, None, bm, enable_gqa=True, kernel_options=opts).name == "cute"
    with torch.no_grad():
        out, lse = flex_attention(q, k, v, None, bm, enable_gqa=True, return_lse=True,
                                  kernel_options=opts)
        ref, ref_lse = flex_attention(q.double(), k.double(), v.double(), None, bm,
                                      enable_gqa=True, return_lse=True, backend="reference")
        low, low_lse = flex_attention(q, k, v, None, bm, enable_gqa=True, return_lse=True,
                                      backend="reference")
    assert_close_to_oracle("out", out, ref, low, FLOOR[q.dtype])
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "rows with no key differ"
    assert (out[~finite] == 0).all()
    assert_close_to_oracle("lse", lse[finite], ref_lse[finite].float(), low_lse[finite],
                           FLOOR[q.dtype])


def test_default_tile_follows_the_partial_share():
    q, k, v = _qkv(1, 4, 4, 8192, 8192)
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 8192, 8192, device="cuda")
    assert "192-row query tiles" in explain(q, k, v, None, bm).reason
    window = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 256), None, None,
                               8192, 8192, device="cuda")
    assert "128-row query tiles" in explain(q, k, v, None, window).reason
    q, k, v = _qkv(1, 4, 4, 8192, 8192, D=96)  # 192 rows at head dim 96 only where pinned
    assert "128-row query tiles" in explain(q, k, v, None, bm).reason
    q, k, v = _qkv(1, 4, 4, 512, 512, D=128)
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 512, 512, device="cuda")
    assert "128-row query tiles" in explain(q, k, v, None, bm).reason
    with pytest.raises(ValueError, match="TILE_M=192"):
        explain(q, k, v, None, bm, kernel_options={"TILE_M": 192})
