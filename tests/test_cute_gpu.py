"""The sm90 CuTeDSL forward on the GPU: output and LSE against float64 math, every core mod.

Runs only on a Hopper GPU (marker `gpu`). Outputs are poisoned first: the caching allocator's
next blocks are filled with NaN, so an element the kernel never writes shows up as NaN.
Shapes: S=1000 (ragged against 128), S=4096, GQA 16/4, head dims 128 and 64, bf16; one causal
case at S=16384. Each new mod compiles once (~3 s on the H200 host).
"""
import pytest
import torch

from flexjit import create_block_mask, explain, flex_attention
from mods_catalog import CORE, make_case
from oracle import FLOOR, assert_close_to_oracle, dense_attention

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper GPU", allow_module_level=True)


def poison_allocator(nbytes=1 << 30):
    x = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del x


def run_case(name, B, Hq, Hkv, L, S, D, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    case = make_case(name, B, Hq, L, S, device="cuda")
    q = torch.randn(B, Hq, L, D, device="cuda", dtype=dtype)
    k, v = [torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype) for _ in range(2)]
    bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cuda") if case.mask_mod else None
    choice = explain(q, k, v, case.score_mod, bm, enable_gqa=Hq != Hkv)
    assert choice.name == "cute", str(choice)
    poison_allocator()
    with torch.no_grad():
        out, lse = flex_attention(q, k, v, case.score_mod, bm, enable_gqa=Hq != Hkv, return_lse=True)
        ref, ref_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=torch.float64)
        low, low_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, dtype=dtype)
    assert_close_to_oracle(f"{name} out", out, ref, low, FLOOR[dtype])
    assert_close_to_oracle(f"{name} lse", lse, ref_lse, low_lse, FLOOR[dtype])


@pytest.mark.parametrize("name", CORE)
def test_core_mods_d128_ragged_gqa(name):
    run_case(name, B=2, Hq=16, Hkv=4, L=1000, S=1000, D=128)


@pytest.mark.parametrize("name", ["causal", "document", "alibi", "softcap", "sliding_window"])
def test_d64_and_4k(name):
    run_case(name, B=1, Hq=16, Hkv=16, L=4096, S=4096, D=64)


def test_q_len_differs_from_kv_len():
    run_case("prefix_lm", B=2, Hq=8, Hkv=2, L=700, S=1500, D=128)


def test_causal_16k():
    run_case("causal", B=1, Hq=2, Hkv=2, L=16384, S=16384, D=128)
