"""The FP8 forward's Vᵀ operand (``cute_sm90.fp8_value_transposed``) on the CPU: key j of every
32-key block at slot KEY_SLOT[j] of the transposed tile, zeros past S; and KEY_SLOT matches the
wgmma register fragments it stands for (accumulator register i of a thread meets A register i)."""
import pytest
import torch

pytest.importorskip("cutlass")
from flexjit.backends.cute import sm90 as cute_sm90, templates  # noqa: E402

KEY_SLOT = templates("sm90").fp8.KEY_SLOT


def test_key_slot_matches_the_register_fragments():
    # Accumulator register order of thread t (quad lane) for one row over 32 keys: pairs
    # (2t, 2t+1) of each 8-key group; A fragment order (8-bit, k32): keys 4t..4t+3, 16+4t..19+4t.
    for t in range(4):
        acc = [8 * g + 2 * t + c for g in range(4) for c in range(2)]
        a = [4 * t + e for e in range(4)] + [16 + 4 * t + e for e in range(4)]
        assert [KEY_SLOT[j] for j in acc] == a
    assert sorted(KEY_SLOT) == list(range(32))


@pytest.mark.parametrize("S", [1, 31, 32, 100, 128, 300])
def test_value_transposed(S):
    B, H, D = 2, 3, 16
    v = (torch.randn(B, H, S, D) * 4).to(torch.float8_e4m3fn)
    vt = cute_sm90.fp8_value_transposed(v)
    Sp = -(-S // 128) * 128
    assert vt.shape == (B, H, D, Sp) and vt.dtype == torch.float8_e4m3fn and vt.is_contiguous()
    got = vt.view(torch.uint8)
    want = torch.zeros(B, H, D, Sp, dtype=torch.uint8)
    for j in range(S):
        want[..., 32 * (j // 32) + KEY_SLOT[j % 32]] = v.view(torch.uint8)[:, :, j, :]
    assert torch.equal(got, want)
