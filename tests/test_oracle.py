"""The oracle itself: taking query rows in chunks (large cases without a gradient) gives the
values of one pass, for every catalog mod (mods that read q_idx through captured tensors too);
the error bound's half-ulp minimum."""
import pytest
import torch

import oracle
from oracle import FLOOR, assert_close_to_oracle, half_ulp
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


def test_the_bound_holds_half_an_ulp_of_the_result_dtype():
    """Where the same math in the test dtype rounds exactly, the bound is still one ulp of the
    result's dtype at its magnitude (+ floor): a result one ulp off passes, two ulps fail."""
    ref = torch.tensor([3000.0, -1.5], dtype=torch.float64)
    low = ref.float()  # exact: no error to double
    ulp = torch.finfo(torch.float32).eps * 2048  # float32's spacing in [2048, 4096)
    one_off = (ref + torch.tensor([ulp, 0.0], dtype=torch.float64)).float()
    assert_close_to_oracle("one ulp", one_off, ref, low, FLOOR[torch.float32])
    two_off = (ref + torch.tensor([2 * ulp, 0.0], dtype=torch.float64)).float()
    with pytest.raises(AssertionError, match="exceeds bound"):
        assert_close_to_oracle("two ulps", two_off, ref, low, FLOOR[torch.float32])
    assert half_ulp(torch.tensor([0.0, float("-inf")]), torch.float32) == 0.0
