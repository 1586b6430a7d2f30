"""The sm90 CuTeDSL forward on the GPU: output and LSE against float64 math, every core mod.

Runs only on a Hopper GPU (marker `gpu`). Outputs are poisoned first: the caching allocator's
next blocks are filled with NaN, so an element the kernel never writes shows up as NaN.
Shapes: S=1000 (ragged against 128), S=4096, GQA 16/4, head dims 128 and 64, bf16; one causal
case at S=16384; head dims 32, 96, 192 and (192, 128) at S=1000 (``test_more_head_dims``). Each new mod compiles once (~3 s on the H200 host).

Every test runs twice: with the one-tile-per-CTA kernel and with the persistent one
(min(tiles, SMs) CTAs looping over the tiles; ``kernel_options={"PERSISTENT": True}`` pins it). The persistent
kernel also gets grids far smaller than the tile count (``num_sms`` = 1, 3, 7), so each CTA
carries its pipeline states, ping-pong token and O buffer across many tiles, empty ones
included. A hang here is a pipeline/barrier bug: run with ``timeout`` (e.g. ``timeout 600
pytest ...``) and ``-x``; the test id names the variant.

The persistent kernel's tiles after the first come from a global atomic counter, published to
the consumers with each tile's Q; the persistent-only tests check as well that every launch
leaves its counter at zero (the next launch on the stream depends on it) and that launches on
two streams at once do not share a counter.
"""
import importlib
import math

import pytest
import torch

from flexjit.backends import kernel_cache as cache
from flexjit import create_block_mask, mods
from flexjit.api.attention import explain, flex_attention
from flexjit.backends.cute import sm90 as backend
from flexjit.backends.cute.sm90 import _aux_tensor, block_sparse_args, compile_program
from mods_catalog import CORE, lowered, make_case
from oracle import FLOOR, assert_close_to_oracle, dense_attention

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper GPU", allow_module_level=True)


@pytest.fixture(autouse=True, params=[False, True], ids=["per_tile", "persistent"])
def persistent(request, monkeypatch):
    """Both forward variants for every test, whatever the schedule rule would pick (the
    backend's caches key on the choice)."""
    real = backend._persistent_fwd
    monkeypatch.setattr(backend, "_persistent_fwd",
                        lambda D, lists, S, owner=None, pinned=None: real(D, lists, S, owner, request.param))
    return request.param


def assert_counter_reset(fn, device, stream=None):
    """After a dynamic launch has finished, its (device, stream) counter is back at [0, 0]."""
    with torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(
            torch.cuda.current_stream()):
        counter = importlib.import_module("flexjit.templates.cute.tile_scheduler").scheduler_counter(device)
    assert counter.tolist() == [0, 0], f"tile counter not reset: {counter.tolist()}"


def poison_allocator(nbytes=1 << 30):
    x = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del x


def run_case(name, B, Hq, Hkv, L, S, D, dtype=torch.bfloat16, seed=0, Dv=None, kernel_options=None,
             scale=None):
    torch.manual_seed(seed)
    case = make_case(name, B, Hq, L, S, device="cuda")
    q = torch.randn(B, Hq, L, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, S, Dv or D, device="cuda", dtype=dtype)
    bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cuda") if case.mask_mod else None
    choice = explain(q, k, v, case.score_mod, bm, scale=scale, enable_gqa=Hq != Hkv)
    assert choice.name == "cute", str(choice)
    poison_allocator()
    with torch.no_grad():
        out, lse = flex_attention(q, k, v, case.score_mod, bm, scale=scale, enable_gqa=Hq != Hkv,
                                  return_lse=True, kernel_options=kernel_options)
        ref, ref_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, scale=scale,
                                       dtype=torch.float64)
        low, low_lse = dense_attention(q, k, v, case.score_mod, case.mask_mod, scale=scale, dtype=dtype)
    assert_close_to_oracle(f"{name} out", out, ref, low, FLOOR[dtype])
    assert_close_to_oracle(f"{name} lse", lse, ref_lse, low_lse, FLOOR[dtype])


@pytest.mark.parametrize("name", CORE)
def test_core_mods_d128_ragged_gqa(name):
    run_case(name, B=2, Hq=16, Hkv=4, L=1000, S=1000, D=128)


@pytest.mark.parametrize("name", ["causal", "document", "alibi", "softcap", "sliding_window"])
def test_d64_and_4k(name):
    run_case(name, B=1, Hq=16, Hkv=16, L=4096, S=4096, D=64)


# The head dims beyond 64/128/256: each with causal (block-sparse, 128-row tiles) and one more mod;
# relative_bias has no mask_mod, so it runs the dense path (every kv tile visited, a gathered
# bias). (192, 128): q/k wider than v. Ragged L = S = 1000, GQA 8/2. 192 has no
# persistent variant: both fixture runs launch the same per-tile kernel.
@pytest.mark.parametrize("D,Dv,name", [
    (32, 32, "causal"), (32, 32, "relative_bias"),
    (96, 96, "causal"), (96, 96, "alibi"),
    (192, 192, "causal"), (192, 192, "softcap"),
    (192, 128, "causal"), (192, 128, "document"), (192, 128, "relative_bias"),
], ids=lambda x: str(x))
def test_more_head_dims(D, Dv, name):
    run_case(name, B=2, Hq=8, Hkv=2, L=1000, S=1000, D=D, Dv=Dv)


def test_q_len_differs_from_kv_len():
    run_case("prefix_lm", B=2, Hq=8, Hkv=2, L=700, S=1500, D=128)


def test_causal_16k():
    run_case("causal", B=1, Hq=2, Hkv=2, L=16384, S=16384, D=128)


def _empty_rows_mask(b, h, q_idx, kv_idx):
    # Rows >= 600 see nothing: q-tiles 5..7 have no kv block at all (O = 0, LSE = -inf).
    return (q_idx < 600) & (kv_idx <= q_idx)


@pytest.mark.parametrize("name", ["full", "softcap", "alibi"])
def test_max_scores(name):
    # AuxRequest(max_scores=True) on the sm90 forward: the row max of the modded scores
    # against float64 math (-inf on rows that keep nothing). "full" has no score_mod (the kernel
    # folds the scale: the max is rescaled on the way out), softcap and alibi have one; all
    # three run under _empty_rows_mask so that rows 600.. keep nothing.
    from flexjit.api.attention import AuxRequest
    from oracle import dense_scores

    torch.manual_seed(3)
    case = make_case(name, 2, 8, 1000, 1000, device="cuda")
    q = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    k, v = [torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    bm = create_block_mask(_empty_rows_mask, None, None, 1000, 1000, device="cuda")
    req = AuxRequest(lse=True, max_scores=True)
    choice = explain(q, k, v, case.score_mod, bm, scale=0.07, enable_gqa=True, return_aux=req)
    assert choice.name == "cute", str(choice)
    poison_allocator()
    with torch.no_grad():
        out, aux = flex_attention(q, k, v, case.score_mod, bm, scale=0.07, enable_gqa=True,
                                  return_aux=req)
        ref, ref_lse = dense_attention(q, k, v, case.score_mod, _empty_rows_mask, scale=0.07)
        low, low_lse = dense_attention(q, k, v, case.score_mod, _empty_rows_mask, scale=0.07,
                                       dtype=torch.bfloat16)
        mx64 = dense_scores(q, k, case.score_mod, _empty_rows_mask, scale=0.07).amax(-1)
        mx16 = dense_scores(q, k, case.score_mod, _empty_rows_mask, scale=0.07,
                            dtype=torch.bfloat16).amax(-1)
    assert_close_to_oracle(f"{name} out", out, ref, low, FLOOR[torch.bfloat16])
    assert_close_to_oracle(f"{name} lse", aux.lse, ref_lse, low_lse, FLOOR[torch.bfloat16])
    assert torch.isneginf(aux.max_scores[:, :, 600:]).all()
    assert_close_to_oracle(f"{name} max_scores", aux.max_scores, mx64, mx16, FLOOR[torch.bfloat16])
    plain = flex_attention(q, k, v, case.score_mod, bm, scale=0.07, enable_gqa=True)
    assert torch.equal(plain, out)  # the extra output changes nothing else


@pytest.mark.parametrize("scale", [-0.1, 0.0])
def test_nonpositive_scale_without_a_score_mod_is_routed_off_the_sm90_forward(scale):
    # The kernel folds the scale into exp2's multiplier: right for scale > 0 only (at 0, masked
    # and ragged -inf scores times 0 are NaN). Such a scale goes to Triton (auto says why) and
    # still gives the right answer, here with a causal mask on a ragged length.
    q, k, v = [torch.randn(1, 2, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    bm = create_block_mask(mods.causal(), None, None, 1000, 1000, device="cuda")
    choice = explain(q, k, v, block_mask=bm, scale=scale)
    sign = "<" if scale < 0 else "="
    assert choice.name == "triton" and f"scale {scale} {sign} 0" in str(choice), str(choice)
    with torch.no_grad():
        out = flex_attention(q, k, v, block_mask=bm, scale=scale)
        ref, _ = dense_attention(q, k, v, mask_mod=mods.causal(), scale=scale)
        low, _ = dense_attention(q, k, v, mask_mod=mods.causal(), scale=scale, dtype=torch.bfloat16)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.bfloat16])


@pytest.mark.parametrize("scale", [0.0, -0.2])
@pytest.mark.parametrize("name", ["alibi", "softcap", "softcap_alibi_window"])
def test_nonpositive_scales_beside_a_score_mod(name, scale):
    # With a score_mod the kernel scales the scores before it, so any scale runs here: at 0
    # every score is score_mod(0), below 0 the largest q·k is the smallest score.
    run_case(name, B=1, Hq=4, Hkv=4, L=1000, S=1000, D=128, scale=scale)


@pytest.mark.parametrize("num_sms", [1, 3, 7])
@pytest.mark.parametrize("name", ["causal", "document", "sliding_window", "softcap", "full",
                                  "empty_rows"])
def test_persistent_many_tiles_per_cta(persistent, name, num_sms):
    """The persistent kernel on a grid much smaller than the tile count (2·8·8 = 128 tiles):
    three launches in a row on fresh NaN outputs (each relies on the previous one having reset
    the tile counter)."""
    if not persistent:
        pytest.skip("persistent kernel only")
    B, Hq, Hkv, L, S, D = 2, 8, 2, 1000, 1000, 128
    torch.manual_seed(0)
    if name == "empty_rows":
        score_mod, mask_mod = None, _empty_rows_mask
    else:
        case = make_case(name, B, Hq, L, S, device="cuda")
        score_mod, mask_mod = case.score_mod, case.mask_mod
    q = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16)
    k, v = [torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    bm = create_block_mask(mask_mod, B, Hq, L, S, device="cuda") if mask_mod else None
    program = lowered(score_mod, mask_mod)
    aux = tuple(_aux_tensor(t, q.device) for t in program.buffers)
    lists = block_sparse_args(bm)
    fn = compile_program(program, q, k, v, lists, aux)
    assert fn.cfg.tiling.persistent
    assert fn.cfg.tiling.dynamic_schedule
    with torch.no_grad():
        ref, ref_lse = dense_attention(q, k, v, score_mod, mask_mod, dtype=torch.float64)
        low, low_lse = dense_attention(q, k, v, score_mod, mask_mod, dtype=q.dtype)
    for launch in range(3):
        o = torch.full((B, Hq, L, D), float("nan"), device="cuda", dtype=q.dtype)
        lse = torch.full((B, Hq, L), float("nan"), device="cuda")
        fn(q, k, v, o, lse, 1.0 / math.sqrt(D), lists, aux, program.scalars, num_sms=num_sms)
        torch.cuda.synchronize()
        assert_counter_reset(fn, q.device)
        assert_close_to_oracle(f"{name} out (launch {launch})", o, ref, low, FLOOR[q.dtype])
        assert_close_to_oracle(f"{name} lse (launch {launch})", lse, ref_lse, low_lse,
                               FLOOR[q.dtype])
        if name == "empty_rows":
            assert (o[:, :, 600:] == 0).all() and (lse[:, :, 600:] == -math.inf).all()


def test_persistent_matches_per_tile_kernel(persistent, monkeypatch):
    """Same tiles, same arithmetic: the two variants agree (causal block-sparse, D=64 and the
    dense 192-row D=64 tiling with 3 consumer warpgroups). ``dynamic``: the persistent one
    takes its tiles from the atomic counter (a different tile-to-CTA assignment, the same
    per-tile code)."""
    if not persistent:
        pytest.skip("runs both variants itself")
    torch.manual_seed(1)
    for D, causal in ((64, True), (64, False), (128, True)):
        B, H, L = 1, 4, 3000
        q, k, v = [torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        mask_mod = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx) if causal else None
        bm = create_block_mask(mask_mod, B, H, L, L, device="cuda") if causal else None
        program = lowered(None, mask_mod)
        lists = block_sparse_args(bm)
        outs = []
        for flag in ("0", "1"):
            fn = compile_program(program, q, k, v, lists, (), persistent=flag == "1")
            assert fn.cfg.tiling.persistent == (flag == "1")
            assert fn.cfg.tiling.dynamic_schedule == (flag == "1")
            o = torch.full((B, H, L, D), float("nan"), device="cuda", dtype=q.dtype)
            lse = torch.full((B, H, L), float("nan"), device="cuda")
            fn(q, k, v, o, lse, 1.0 / math.sqrt(D), lists, (), program.scalars,
               num_sms=5 if flag == "1" else None)
            outs.append((o, lse))
        torch.cuda.synchronize()
        (o0, l0), (o1, l1) = outs
        assert not o1.isnan().any() and not l1.isnan().any()
        # Same instructions per tile, so normally bitwise equal; a race shows up as NaN or an
        # error far above these bounds.
        torch.testing.assert_close(o1, o0, rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_sms", [2, None])
def test_dynamic_schedule_two_streams(persistent, monkeypatch, num_sms):
    """Dynamic scheduler launches on two streams at once: each stream has its own counter, both
    results match the per-tile kernel, and both counters are back at zero afterwards."""
    if not persistent:
        pytest.skip("runs both variants itself")
    torch.manual_seed(2)
    B, H, L, D = 2, 8, 2000, 128
    q, k, v = [torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    mask_mod = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    bm = create_block_mask(mask_mod, B, H, L, L, device="cuda")
    program = lowered(None, mask_mod)
    lists = block_sparse_args(bm)
    ref_fn = compile_program(program, q, k, v, lists, (), persistent=False)
    o_ref = torch.full((B, H, L, D), float("nan"), device="cuda", dtype=q.dtype)
    l_ref = torch.full((B, H, L), float("nan"), device="cuda")
    ref_fn(q, k, v, o_ref, l_ref, 1.0 / math.sqrt(D), lists, (), program.scalars)
    fn = compile_program(program, q, k, v, lists, (), persistent=True)
    assert fn.cfg.tiling.persistent and fn.cfg.tiling.dynamic_schedule
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for rep in range(4):  # interleaved, several launches per stream
        for s in streams:
            with torch.cuda.stream(s):
                o = torch.full((B, H, L, D), float("nan"), device="cuda", dtype=q.dtype)
                lse = torch.full((B, H, L), float("nan"), device="cuda")
            fn(q, k, v, o, lse, 1.0 / math.sqrt(D), lists, (), program.scalars, stream=s,
               num_sms=num_sms)
            outs.append((o, lse))
    torch.cuda.synchronize()
    for s in streams:
        assert_counter_reset(fn, q.device, s)
    for o, lse in outs:
        assert not o.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(o, o_ref, rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(lse, l_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("D,Hq,Hkv,L,S", [
    (64, 16, 4, 1000, 1000),  # 192-row tiles of 48 positions × 4 heads; L ragged against 48
    (128, 16, 4, 1000, 777),  # 128-row tiles of 32 positions; S ragged too
    (64, 16, 2, 300, 4096),  # 8 heads a tile: 24 positions (192 rows)
    (128, 32, 2, 500, 1000),  # 16 heads a tile: 8 positions
    (128, 4, 2, 4096, 4096),
], ids=lambda x: str(x))
def test_packed_gqa(persistent, D, Hq, Hkv, L, S):
    """Plain GQA attention with the query heads of a kv head folded into one tile's rows
    (``kernel_options`` PACK_GQA pins it), through the API: out and LSE against float64 math,
    and against the one-head-per-tile kernel (the same per-row arithmetic over the same kv tiles
    in the same order: equal but for a race, which shows as NaN or a large error)."""
    torch.manual_seed(0)
    q = torch.randn(2, Hq, L, D, device="cuda", dtype=torch.bfloat16)
    k, v = [torch.randn(2, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    outs = {}
    for pack in (True, False):
        options = {"PACK_GQA": pack}
        choice = explain(q, k, v, None, None, enable_gqa=True, kernel_options=options)
        assert choice.name == "cute" and ("pack_gqa=" in choice.config) and \
            (f"pack_gqa={Hq // Hkv}" in choice.config) == pack, choice.config
        poison_allocator()
        with torch.no_grad():
            outs[pack] = flex_attention(q, k, v, enable_gqa=True, return_lse=True,
                                        kernel_options=options)
    with torch.no_grad():
        ref, ref_lse = dense_attention(q, k, v, None, None, dtype=torch.float64)
        low, low_lse = dense_attention(q, k, v, None, None, dtype=q.dtype)
    out, lse = outs[True]
    assert_close_to_oracle("packed out", out, ref, low, FLOOR[q.dtype])
    assert_close_to_oracle("packed lse", lse, ref_lse, low_lse, FLOOR[q.dtype])
    torch.testing.assert_close(out, outs[False][0], rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(lse, outs[False][1], rtol=1e-5, atol=1e-5)
