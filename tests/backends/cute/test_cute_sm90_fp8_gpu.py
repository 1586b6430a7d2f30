"""The sm90 FP8 forward (e4m3 wgmma for QKᵀ and PV) through ``flex_attention`` on a Hopper GPU.

Against the float64 attention of the dequantised inputs: err(out) ≤ 2·err(the same math in
torch) + floor, where the same math is the plain FP8 reference with P rounded to e4m3 before P·V
(``fp8_reference(p_dtype=e4m3)``), as the kernel's PV GEMM does. lse (P's rounding does not
reach it) against float32 math, plus what the e4m3 tensor cores' accumulation may add to a score
(``_accumulation_slack``: lse moves by at most the largest score error). Every head dim the
kernel serves, ragged lengths (L 300, S 500: the permuted Vᵀ's tail block is partial), GQA 4:2,
per-(batch, kv head) and scalar descales, a negative descale product (the kernel negates its Q
tile), ``mods_catalog``'s core mods: block masks with partial, full and empty blocks, captured
tensors (ALiBi slopes, document ids, a bias table), softcap, a score_mod without a mask (dense
tiles), head dim 64's dense tiles (192 rows over three consumer warpgroups, and 128). explain()
must name the FP8 kernel, so a silent fall back to the dequantising road fails.
"""
import pytest
import torch

import flexjit
from flexjit import create_block_mask
from mods_catalog import make_case
from oracle import FLOOR, dense_attention, dequantize_e4m3, fp8_reference, max_err, quantize_e4m3

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

DEV = "cuda"
E4M3 = torch.float8_e4m3fn
B, HQ, HKV, L, S = 2, 4, 2, 300, 500
G = HQ // HKV


def _mods(name, seed=0):
    """(score_mod, mask_mod) of ``mods_catalog``'s case ``name`` on DEV, its captured tensors
    drawn from ``seed``."""
    torch.manual_seed(seed)
    case = make_case(name, B, HQ, L, S, device=DEV)
    return case.score_mod, case.mask_mod


def _inputs(D, seed, per_head=True, negative=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g, dtype=torch.float64)
               for h, n in ((HQ, L), (HKV, S), (HKV, S)))
    (q8, qd), (k8, kd), (v8, vd) = (quantize_e4m3(t, gr if per_head else None)
                                    for t, gr in ((q, G), (k, 1), (v, 1)))
    if negative:  # one (batch, kv head) with a negative q·k descale product, another negative v
        qd = qd.clone()
        vd = vd.clone()
        qd[0, 1] = -qd[0, 1]
        vd[1, 0] = -vd[1, 0]
    return (q8, k8, v8), (qd, kd, vd)


def _accumulation_slack(real_q, real_k) -> float:
    """A bound on a score's error from the FP8 wgmma's accumulation, which keeps fewer bits than
    float32 (about 14 of the mantissa: DeepSeek-V3 §3.3.2): 2^-14 of Σ|q_d·k_d| per 32-wide k
    step, D/32 steps, in the scores' units (scale included)."""
    D = real_q.shape[-1]
    k = real_k.repeat_interleave(G, dim=1)
    magnitude = (real_q.abs() @ k.abs().transpose(-1, -2)).amax().item()
    return (D / 32) * 2.0 ** -14 * magnitude / D ** 0.5


def _check(D, name, seed=0, per_head=True, negative=False, options=None):
    (q8, k8, v8), (qd, kd, vd) = _inputs(D, seed, per_head, negative)
    score_mod, mask_mod = _mods(name, seed)
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, L, S, device=DEV)
    args = [t.to(DEV) for t in (q8, k8, v8)]
    kw = dict(q_descale=qd.to(DEV), k_descale=kd.to(DEV), v_descale=vd.to(DEV))
    choice = flexjit.explain(*args, score_mod, bm, enable_gqa=True, kernel_options=options, **kw)
    # the FP8 kernel, not the dequantising road before a 16-bit one
    assert choice.name == "cute" and "FP8 forward" in choice.reason, choice
    out, lse = flexjit.flex_attention(*args, score_mod, bm, enable_gqa=True, return_lse=True,
                                      kernel_options=options, **kw)
    assert out.dtype == torch.bfloat16
    real = [dequantize_e4m3(t.to(DEV), d.to(DEV), torch.float64, gr)
            for t, d, gr in ((q8, qd, G), (k8, kd, 1), (v8, vd, 1))]
    ref, ref_lse = dense_attention(*real, score_mod, mask_mod)
    descales = tuple(d.to(DEV) for d in (qd, kd, vd))
    same, _ = fp8_reference(*args, descales, score_mod, mask_mod, p_dtype=E4M3)
    _, lse32 = fp8_reference(*args, descales, score_mod, mask_mod)
    assert not torch.isnan(out).any()
    err, bound = max_err(out, ref), 2 * max_err(same, ref) + FLOOR[torch.bfloat16]
    assert err <= bound, f"{name} D={D}: out error {err:.3g} > {bound:.3g}"
    slack = _accumulation_slack(real[0], real[1])  # the biases add, softcap is 1-Lipschitz
    err, bound = max_err(lse, ref_lse), 2 * max_err(lse32, ref_lse) + FLOOR[torch.float32] + slack
    assert err <= bound, f"{name} D={D}: lse error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("name", ["full", "causal", "alibi", "softcap", "document", "sliding_window",
                                  "relative_bias"])
def test_core_mods(D, name):
    _check(D, name)


@pytest.mark.parametrize("tile_m", [128, 192])
@pytest.mark.parametrize("name", ["full", "relative_bias"])
def test_head_dim_64_dense_tiles(tile_m, name):
    """Both tiles the tuner measures at head dim 64 without a block mask: 192 rows over three
    consumer warpgroups, and 128."""
    _check(64, name, seed=3, options={"TILE_M": tile_m})
    _check(64, name, seed=4, negative=True, options={"TILE_M": tile_m})


@pytest.mark.parametrize("name", ["full", "alibi"])
def test_negative_and_scalar_descales(name):
    _check(128, name, seed=1, negative=True)
    _check(128, name, seed=2, per_head=False)


@pytest.mark.parametrize("S", [77, 4096])
def test_value_transposed_kernel_matches_the_definition(S):
    """The GPU's one-pass Vᵀ (``fp8_layout``) writes the bytes the CPU definition does, for a
    strided V (a slice of a wider tensor) too."""
    from flexjit.backends.cute import sm90 as cute_sm90
    wide = (torch.randn(2, 3, S, 160) * 8).to(E4M3)
    v = wide[..., 16:144]
    want = cute_sm90.fp8_value_transposed(v).view(torch.uint8)
    got = cute_sm90.fp8_value_transposed(v.to(DEV)).view(torch.uint8).cpu()
    assert torch.equal(got, want)
