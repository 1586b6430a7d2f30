"""The sm90 forward's tuning declarations (``cute_sm90.tuning``), on the CPU: no compile.

For representative calls: the candidates (only close calls: both tiles at head dim 64 unless
the merged tiles are mostly partial, both schedules up to twice the persistent threshold),
the heuristic's default among them (the rule that ran before the tuner), what pins leave, and
the shape class: lengths in log2 buckets (8000 and 8192 share one, 4096 does not), the grid, the
mean kv tiles per q tile, the merged partial share at head dim 64. The jobs that compile the
candidates carry their fields. Lengths 8k: the regime docs/performance.md measured.
"""
import pytest
import torch

from flexjit import create_block_mask, mods
from flexjit.api.attention import prepare_call
from flexjit.backends.base import Config
from flexjit.backends.cute import sm90
from flexjit.runtime import compile_pool
from mods_catalog import make_case

N = 8192


def _mask(mask_mod, L=N):
    return create_block_mask(mask_mod, None, None, L, L, device="cpu")


CAUSAL, WINDOW = _mask(mods.causal()), _mask(mods.sliding_window(1024))


def _tuning(D, bm=None, L=N, B=2, H=16, options=None, dtype=torch.bfloat16):
    q = torch.empty(B, H, L, D, dtype=dtype)
    return sm90.tuning(prepare_call(q, q, q, None, bm, None, False, options))


def _names(t):
    return [str(c) for c in t.candidates]


def _key(t) -> dict:
    return dict(k.split("=", 1) for k in t.key)


def test_head_dim_64_causal_8k_measures_both_tiles_on_one_schedule():
    t = _tuning(64, CAUSAL)
    assert _names(t) == ["tile_m=128", "tile_m=192"] and str(t.default) == "tile_m=192"
    key = _key(t)
    assert {k: key[k] for k in ("L", "S", "grid", "kv_tiles", "partial", "dims", "mask")} == {
        "L": "2^13", "S": "2^13", "grid": "2^11", "kv_tiles": "2^5", "partial": "0.1",
        "dims": "64x64", "mask": "True"}
    assert t.family == "sm90-fwd" and t.pins == ""


def test_head_dim_96_measures_its_192_row_tile_but_runs_128_by_rule():
    """The 192-row tile at D = 96 (P through smem) won on one GPU and lost on another, so the
    tuner measures it beside 128 rows and the rule keeps 128; a TILE_M pin runs either alone.
    D = 32 takes 192 rows by rule, as D = 64 does."""
    t = _tuning(96, CAUSAL)
    assert _names(t) == ["tile_m=128", "tile_m=192"] and str(t.default) == "tile_m=128"
    assert _key(t)["partial"] == "0.1" and _key(t)["dims"] == "96x96"
    assert _names(_tuning(96, None)) == ["tile_m=128", "tile_m=192"]
    t = _tuning(96, CAUSAL, options={"TILE_M": 192})
    assert _names(t) == ["tile_m=192"] and t.pins == "kernel_options TILE_M=192"
    assert _names(_tuning(96, CAUSAL, options={"TILE_M": 128})) == ["tile_m=128"]
    # A 1k window (its merged tiles 40% partial) keeps the 128-row tile alone.
    assert "tile_m=192" not in _names(_tuning(96, WINDOW))
    t = _tuning(32, CAUSAL)
    assert _names(t) == ["tile_m=128", "tile_m=192"] and str(t.default) == "tile_m=192"


def test_head_dim_128_causal_8k_has_nothing_to_measure():
    # 32.5 kv tiles per q tile on average: past twice the persistent threshold.
    t = _tuning(128, CAUSAL)
    assert _names(t) == ["tile_m=128"] and "partial" not in _key(t)


def test_a_short_window_measures_both_schedules_and_keeps_its_tile():
    # A 1k window: ~8.5 kv tiles per q tile (persistent by rule); merged tiles 40% partial (D=64).
    for D in (64, 128):
        t = _tuning(D, WINDOW)
        assert _names(t) == ["tile_m=128", "tile_m=128, persistent"]
        assert str(t.default) == "tile_m=128, persistent" and _key(t)["kv_tiles"] == "2^3"
    assert _key(_tuning(64, WINDOW))["partial"] == "0.4"
    assert _names(_tuning(256, WINDOW)) == ["tile_m=128"]  # no smem for the persistent O buffer


def test_the_default_is_the_rule_that_ran_before():
    cases = [(64, CAUSAL), (64, WINDOW), (64, None), (128, CAUSAL), (128, WINDOW), (96, None)]
    for D, bm in cases:
        t = _tuning(D, bm)
        want = Config.of(tile_m=sm90.forward_tile_m(D, bm),
                         persistent=sm90._persistent_fwd(D, sm90.block_sparse_args(bm), N, owner=bm))
        assert t.default == want, (D, bm)


def test_pins_leave_their_value_alone():
    t = _tuning(64, WINDOW, options={"PERSISTENT": False})
    assert _names(t) == ["tile_m=128"] and t.pins == "kernel_options PERSISTENT=False"
    t = _tuning(64, CAUSAL, options={"TILE_M": 128})
    assert _names(t) == ["tile_m=128"] and t.pins == "kernel_options TILE_M=128"
    t = _tuning(64, _mask(mods.causal(), 2048), L=2048, options={"TILE_M": 192})
    assert _names(t) == ["tile_m=192", "tile_m=192, persistent"]
    with pytest.raises(ValueError, match="TILE_M=192"):
        _tuning(128, CAUSAL, options={"TILE_M": 192})


def test_the_shape_class_buckets_lengths_and_separates_regimes():
    base = _tuning(128, None, L=8192)
    assert _tuning(128, None, L=8000).key == base.key  # a nearby length: the same class
    assert _key(_tuning(128, None, L=4096))["L"] == "2^12"
    assert _key(_tuning(128, None, L=8192, B=4))["grid"] == "2^12"
    assert _tuning(128, None, dtype=torch.float16).key != base.key
    assert _tuning(128, CAUSAL).key != base.key  # a mask, and its density


def test_candidate_jobs_carry_the_configs():
    q = torch.empty(1, 4, 2048, 64, dtype=torch.bfloat16)
    call = prepare_call(q, q, q, None, _mask(mods.causal(), 2048), None, False, None)
    t = sm90.tuning(call)
    # 8.5 kv tiles per q tile, merged tiles 20% partial: within twice each threshold, and past
    # MERGED_MAX_PARTIAL, so the rule picks 128 rows.
    assert len(t.candidates) == 4 and str(t.default) == "tile_m=128, persistent"
    jobs = compile_pool.candidate_jobs(call, t.family, t.candidates)
    assert [(j.kind, j.tile_m, j.persistent, j.write_max, j.deterministic) for j in jobs.values()] \
        == [("fwd", m, p, False, False) for m in (128, 192) for p in (False, True)]
    assert len({j.ident for j in jobs.values()}) == 4
    assert jobs[Config.of(tile_m=192, persistent=True)].what().endswith("(tile_m=192, persistent)")
    assert compile_pool.candidate_jobs(call, "sm100-fwd", t.candidates) == {}


def _bwd_tuning(D, bm=None, score_mod=None, L=N, B=2, H=16, Hkv=16, options=None):
    q = torch.empty(B, H, L, D, dtype=torch.bfloat16)
    k = torch.empty(B, Hkv, L, D, dtype=torch.bfloat16)
    return sm90.backward_tuning(prepare_call(q, k, k, score_mod, bm, None, Hkv != H, options))


def test_backward_candidates_follow_the_mask_and_the_mods():
    # Causal, GQA 16/4, head dim 128: the table's schedule, the longest-first launches and one
    # CTA per query head.
    t = _bwd_tuning(128, CAUSAL, Hkv=4)
    assert [c["bwd_config"] for c in t.candidates] == ["", "lpt", "lpt2", "qhead"]
    assert t.family == "sm90-bwd" and t.default["bwd_config"] == "" and t.pins == ""
    key = _key(t)
    assert {k: key[k] for k in ("group", "L", "grid", "mask", "deterministic")} == {
        "group": "4", "L": "2^13", "grid": "2^9", "mask": "True", "deterministic": "False"}
    # No mask: every kv tile does the same work, so no launch order to choose; under GQA at head
    # dim 128 the query-head CTAs still are a candidate (g times the CTAs); at 64, and without
    # GQA, not.
    tall = "m128+shuffle+dvafter"  # D = 64 with light mods: the 128-row tile (TALL_BWD)
    assert [c["bwd_config"] for c in _bwd_tuning(64).candidates] == [tall]
    assert [c["bwd_config"] for c in _bwd_tuning(64, Hkv=4).candidates] == [tall]
    assert [c["bwd_config"] for c in _bwd_tuning(64, CAUSAL, Hkv=4).candidates] == [
        tall, f"{tall}+lpt", f"{tall}+lpt2"]
    assert [c["bwd_config"] for c in _bwd_tuning(32, CAUSAL).candidates] == [
        "m128+dvafter", "m128+dvafter+lpt", "m128+dvafter+lpt2"]
    # Mods with loads or transcendentals spill on it: the 64-row tile.
    assert [c["bwd_config"] for c in _bwd_tuning(64, CAUSAL, mods.alibi(16)).candidates] == [
        "", "lpt", "lpt2"]
    assert [c["bwd_config"] for c in _bwd_tuning(128, Hkv=4).candidates] == ["", "qhead"]
    assert [c["bwd_config"] for c in _bwd_tuning(128, CAUSAL, Hkv=16).candidates] == [
        "", "lpt", "lpt2"]
    alibi = mods.alibi(16)
    assert [c["bwd_config"] for c in _bwd_tuning(128, CAUSAL, alibi).candidates] == ["", "lpt", "lpt2"]
    # D = 192: the 96-key tile alone (no query-head CTAs there, GQA or not); deterministic mode
    # keeps its own launch order (and the 64-key tile: test_keys96_pin_routes_deterministic_mode).
    assert [c["bwd_config"] for c in _bwd_tuning(192, CAUSAL).candidates] == ["keys96"]
    assert [c["bwd_config"] for c in _bwd_tuning(192, CAUSAL, Hkv=4).candidates] == ["keys96"]
    torch.use_deterministic_algorithms(True)
    try:
        t_det = _bwd_tuning(128, CAUSAL)
        t_det_gqa = _bwd_tuning(128, CAUSAL, Hkv=4)
        t_det_64 = _bwd_tuning(64, CAUSAL)
    finally:
        torch.use_deterministic_algorithms(False)
    assert [c["bwd_config"] for c in t_det.candidates] == [""]
    assert [c["bwd_config"] for c in t_det_gqa.candidates] == [""]
    assert [c["bwd_config"] for c in t_det_64.candidates] == [tall]
    assert _key(t_det)["deterministic"] == "True"


def test_a_backward_pin_leaves_one_candidate_and_jobs_carry_it():
    t = _bwd_tuning(128, CAUSAL, options={"BWD_CONFIG": "late"})
    assert [c["bwd_config"] for c in t.candidates] == ["late"] and "BWD_CONFIG='late'" in t.pins
    q = torch.empty(2, 16, N, 128, dtype=torch.bfloat16, requires_grad=True)
    call = prepare_call(q, q, q, None, CAUSAL, None, False, None)
    tuning = sm90.backward_tuning(call)
    jobs = compile_pool.candidate_jobs(call, sm90.BWD_FAMILY, tuning.candidates)
    assert {c["bwd_config"]: j.bwd_config for c, j in jobs.items()} == {
        n: n for n in ("", "lpt", "lpt2")}
    assert all(j.kind == "bwd" for j in jobs.values())
    assert jobs[tuning.default] == compile_pool.backward_job(call)  # the default's job is ahead()'s


def _fp8_call(D, bm=None, options=None):
    e4m3 = torch.float8_e4m3fn
    q = torch.empty(2, 16, N, D, dtype=e4m3)
    one = torch.ones(())
    return prepare_call(q, q, q, None, bm, None, False, options, fp8=(one, one, one, None))


def test_fp8_measures_both_tiles_only_at_head_dim_64_without_a_mask():
    """The FP8 forward runs one tile per CTA: 192 rows by rule at head dim 64 without a block
    mask, both tiles measured there; elsewhere one 128-row candidate. A TILE_M pin keeps its
    value alone; one the FP8 kernel has no tile for sends the call to the dequantising road."""
    t = sm90.tuning(_fp8_call(64))
    assert _names(t) == ["tile_m=128", "tile_m=192"] and str(t.default) == "tile_m=192"
    assert _names(sm90.tuning(_fp8_call(64, CAUSAL))) == ["tile_m=128"]
    assert _names(sm90.tuning(_fp8_call(128))) == ["tile_m=128"]
    pinned = sm90.tuning(_fp8_call(64, options={"TILE_M": 128}))
    assert _names(pinned) == ["tile_m=128"] and pinned.pins == "kernel_options TILE_M=128"
    assert sm90.fp8_native(_fp8_call(64, options={"TILE_M": 192}))[0]
    for D, bm in ((64, CAUSAL), (128, None)):
        native, why = sm90.fp8_native(_fp8_call(D, bm, options={"TILE_M": 192}))
        assert not native and "192 at head dim 64 without a block mask" in why
    native, why = sm90.fp8_native(_fp8_call(64, options={"PERSISTENT": True}))
    assert not native and "PERSISTENT" in why


@pytest.mark.parametrize("Hkv,deterministic,D,runs,why", [
    (4, False, 128, "qhead+lpt", ""),
    (16, False, 128, "lpt", "Hq = Hkv"),
    (4, True, 128, "lpt", "deterministic algorithms"),
    (4, False, 192, "lpt", "head dim 192"),
])
def test_a_qhead_pin_runs_the_head_loop_where_it_must_and_says_so(Hkv, deterministic, D, runs, why):
    # A pinned "qhead" runs as pinned under GQA; without GQA, in deterministic mode and at head
    # dim 192 the backward keeps the head loop, and explain's text (the pins) gives the reason.
    # Every backward job (what the warmup compiles) carries what runs.
    q = torch.empty(2, 16, N, D, dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(2, Hkv, N, D, dtype=torch.bfloat16, requires_grad=True)
    call = prepare_call(q, k, k, None, CAUSAL, None, Hkv != 16, {"BWD_CONFIG": "qhead+lpt"})
    torch.use_deterministic_algorithms(deterministic)
    try:
        t = sm90.backward_tuning(call)
        job = compile_pool.backward_job(call)
    finally:
        torch.use_deterministic_algorithms(False)
    assert [c["bwd_config"] for c in t.candidates] == [runs] and t.default["bwd_config"] == runs
    assert job.bwd_config == runs
    assert "BWD_CONFIG='qhead+lpt'" in t.pins
    if why:
        assert f"'qhead' runs as the head loop ({why}" in t.pins
    else:
        assert "head loop" not in t.pins
    assert sm90.bwd_config_for(call, "", deterministic) == ("", "")


def test_keys96_pin_routes_deterministic_mode():
    # The 96-key tile has no deterministic dQ order: pinned in deterministic mode, the 64-key
    # tile runs, and the pins (explain's text) say why.
    t = _bwd_tuning(192, CAUSAL, options={"BWD_CONFIG": "keys96"})
    assert [c["bwd_config"] for c in t.candidates] == ["keys96"]
    torch.use_deterministic_algorithms(True)
    try:
        t_det = _bwd_tuning(192, CAUSAL, options={"BWD_CONFIG": "keys96"})
        assert _bwd_tuning(192, CAUSAL).candidates == t_det.candidates
        q = torch.empty(2, 16, N, 192, dtype=torch.bfloat16, requires_grad=True)
        call = prepare_call(q, q, q, None, CAUSAL, None, False, {"BWD_CONFIG": "keys96"})
        assert compile_pool.backward_job(call).bwd_config == ""  # the kernel the backward runs
    finally:
        torch.use_deterministic_algorithms(False)
    assert [c["bwd_config"] for c in t_det.candidates] == [""]
    assert "64-key tile serves deterministic algorithms" in t_det.pins


def test_keys96_pin_routes_captured_tensor_gradients():
    # Nor has the 96-key tile the captured tensors' gradients: a learnable bias keeps the
    # 64-key tile, pinned or tuned.
    case = make_case("learnable_bias", 2, 16, N, N)
    pinned = _bwd_tuning(192, score_mod=case.score_mod, options={"BWD_CONFIG": "keys96"})
    assert [c["bwd_config"] for c in pinned.candidates] == [""]
    assert "64-key tile serves captured-tensor gradients" in pinned.pins
    assert [c["bwd_config"] for c in _bwd_tuning(192, score_mod=case.score_mod).candidates] == [""]


def test_the_backward_builds_its_choice_once_per_configuration(monkeypatch):
    # A training step must not rebuild the heuristic, the tiling and the kernel lookup every call
    # (0.3 ms of host time per step on an H100 host): they are kept in the call's memo, one entry
    # per (configuration, deterministic mode).
    built, ran = [], []
    monkeypatch.setattr(sm90, "compile_backward", lambda *a, **kw: built.append(kw["tiling"]) or len(built))
    monkeypatch.setattr(sm90, "run_backward", lambda fn, *a: ran.append(fn))
    q = torch.empty(2, 16, 2048, 64, dtype=torch.bfloat16)
    call = prepare_call(q, q, q, None, _mask(mods.causal(), 2048), None, False, None)
    args = (q, q, q, q, q[..., 0], q, None)
    for _ in range(3):
        sm90.backward(call, *args)
    sm90.backward(call, *args, config=Config.of(bwd_config="m128+shuffle+dvafter+lpt"))
    sm90.backward(call, *args)
    torch.use_deterministic_algorithms(True)
    try:
        sm90.backward(call, *args)
    finally:
        torch.use_deterministic_algorithms(False)
    assert ran == [1, 1, 1, 2, 1, 3] and len(built) == 3
