"""kv_range: a mask's kept keys as one interval per row, checked against the mask itself."""
import pytest
import torch

from flexjit import mods
from flexjit.frontend.trace import MASK_MOD, trace_mod
from flexjit.ir.interp import Env, evaluate
from flexjit.ir.kv_range import kv_interval
from flexjit.ir.passes import lower
from flexjit.planner.block_mask import and_masks, or_masks
from tests.mods_catalog import CORE, make_case

B, H, L, S = 2, 3, 70, 90
LENGTHS = torch.tensor([37, 90])


def _program(mask_mod):
    return lower(None, trace_mod(mask_mod, MASK_MOD), float_index=True)


def _grids(program):
    env = Env(b=torch.arange(B).view(B, 1, 1, 1), h=torch.arange(H).view(1, H, 1, 1),
              q_idx=torch.arange(L, dtype=torch.int32).view(1, 1, L, 1),
              kv_idx=torch.arange(S, dtype=torch.int32).view(1, 1, 1, S),
              buffers=program.buffers, scalars=program.scalars)
    keep = evaluate(program.mask, env).expand(B, H, L, S)
    iv = kv_interval(program.mask)
    assert iv is not None
    kv = env.kv_idx.to(torch.int64)
    ours = torch.ones(B, H, L, S, dtype=torch.bool)
    if iv.lo is not None:
        ours &= kv >= evaluate(iv.lo, env)
    if iv.hi is not None:
        ours &= kv <= evaluate(iv.hi, env)
    return keep, ours


EXTRA = {
    "window_two_sided": mods.sliding_window(7, causal=False),
    "not_future": lambda b, h, q, kv: ~(kv > q),
    "padding_rows_and_keys": lambda b, h, q, kv: (q < LENGTHS[b]) & (kv < LENGTHS[b]),
    "offset_causal": lambda b, h, q, kv: kv - 5 <= q + h,
    "point": lambda b, h, q, kv: kv == q // 2,
    "chunked_prefix": or_masks(lambda b, h, q, kv: kv < 10, lambda b, h, q, kv: kv <= q - 3),
    "window_and_padding": and_masks(mods.sliding_window(11), lambda b, h, q, kv: kv < LENGTHS[b]),
    "empty_rows": lambda b, h, q, kv: (q > 200) & (kv <= q),
    "abs_flipped": lambda b, h, q, kv: 4 >= torch.abs(kv - q),
}
INTERVAL_CORE = ["causal", "sliding_window", "prefix_lm", "prefix_lm_per_batch", "alibi", "softcap",
                 "head_dependent", "batch_dependent", "causal_or_global", "learnable_bias",
                 "softcap_alibi_window"]


@pytest.mark.parametrize("name", INTERVAL_CORE)
def test_core_masks_as_intervals(name):
    torch.manual_seed(0)
    keep, ours = _grids(_program(make_case(name, B, H, L, S).mask_mod))
    assert torch.equal(keep, ours)


@pytest.mark.parametrize("name", sorted(EXTRA))
def test_interval_forms(name):
    keep, ours = _grids(_program(EXTRA[name]))
    assert torch.equal(keep, ours)


@pytest.mark.parametrize("name", ["document", "dilated_window", "natten_2d"])
def test_masks_that_are_no_interval(name):
    torch.manual_seed(0)
    assert kv_interval(_program(make_case(name, B, H, L, S).mask_mod).mask) is None


@pytest.mark.parametrize("mask_mod", [
    lambda b, h, q, kv: q != kv,  # two intervals
    lambda b, h, q, kv: torch.abs(kv - q) >= 3,  # two intervals
    lambda b, h, q, kv: (kv < 3) | (kv > q),  # a gap between them
    lambda b, h, q, kv: 2 * kv <= q,  # coefficient 2: a rounding the row limit would need
])
def test_forms_refused(mask_mod):
    assert kv_interval(_program(mask_mod).mask) is None
