"""The oracle itself: taking query rows in chunks (large cases without a gradient) gives the
values of one pass, for every catalog mod (mods that read q_idx through captured tensors too)."""
import pytest
import torch

import oracle
from mods_catalog import make_case


@pytest.mark.parametrize("name", ["causal", "document", "alibi", "softcap", "sliding_window",
                                  "relative_bias", "prefix_lm"])
def test_row_chunks_equal_one_pass(monkeypatch, name):
    torch.manual_seed(0)
    B, H, L, S, D = 1, 4, 700, 650, 32
    case = make_case(name, B, H, L, S, device="cpu")
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64) for n in (L, S, S))
    with torch.no_grad():
        whole = oracle.dense_attention(q, k, v, case.score_mod, case.mask_mod)
        monkeypatch.setattr(oracle, "CHUNK_SCORES", B * H * S * 96)  # 8 chunks, the last short
        chunked = oracle.dense_attention(q, k, v, case.score_mod, case.mask_mod)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
