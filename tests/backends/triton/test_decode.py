"""The split-KV decode kernel (templates/triton/decode.py) on the CPU, under TRITON_INTERPRET=1.

* Numerics against the float64 oracle (tests/oracle.py), err <= 2·err(plain torch in the test
  dtype) + floor, for out, lse and max_scores: no mod, causal with the queries at the end of the
  KV (as a decode step writes it: ``q_idx + offset >= kv_idx``), sliding window, ALiBi, softcap,
  document mask, GQA 4:1 and 1:1, per-head block lists (heads not packed), ragged KV_LEN,
  split counts 1, a few and more than the kv tiles, and a paged KV cache (block lists pointing
  at shuffled physical pages of a batch-1 cache, the mask mapping them back), so the kernel is
  shown to read K/V only through the lists. Outputs are NaN-poisoned (FLEXJIT_POISON=1).
* Routing: decode-shaped calls without gradients run the decode kernel, calls that need
  gradients (or Q_LEN > 128, or FORCE_USE_FLEX_ATTENTION) the prefill forward; explain() shows
  the split count; the split heuristic fills the SMs without splits shorter than 2 tiles.

Sizes: D = 32, KV_LEN <= 400 and 32-key mask blocks keep each interpreted case to a few
seconds while giving 7-13 kv tiles, so several splits each get a partial and a full tile.
"""
import math
import re

import pytest
import torch

import flexjit
from flexjit import create_block_mask
from flexjit.api.attention import flex_attention
from flexjit import mods
from flexjit.api.attention import prepare_call
from flexjit.backends.triton import prefill as tb
from flexjit.backends.triton import decode as td
from flexjit.planner.block_mask import BlockMask
from oracle import FLOOR, assert_close_to_oracle, dense_attention, dense_scores


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEXJIT_POISON", "1")
        mp.setenv("FLEXJIT_CACHE_DIR", str(tmp_path_factory.mktemp("flexjit-cache")))
        yield


@pytest.fixture
def interp(monkeypatch):
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("interpreter tests need triton >= 3.9")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _qkv(B, Hq, Hkv, L, S, E, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).to(dtype)
                 for shape in ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, E)))


def _decode_mods(name, B, Hq, L, S, device="cpu"):
    """(score_mod, mask_mod) of a decode step: the L queries are the last L positions of S.
    Captured tables live on ``device`` (the oracle evaluates the mods eagerly there)."""
    off = S - L

    def causal(b, h, q_idx, kv_idx):
        return q_idx + off >= kv_idx
    if name == "full":
        return None, None
    if name == "causal":
        return None, causal
    if name == "sliding_window":
        def window(b, h, q_idx, kv_idx):
            return (q_idx + off >= kv_idx) & (q_idx + off - kv_idx < 100)
        return None, window
    if name == "alibi":
        slopes = mods.alibi_slopes(Hq).to(device)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx - off)
        return alibi, causal
    if name == "softcap":
        return mods.softcap(3.0), causal
    if name == "document":
        ids = torch.repeat_interleave(torch.arange(8), torch.tensor([40, 7, 90, 33, 61, 80, 50, 100]))[:S].to(device)

        def doc(b, h, q_idx, kv_idx):
            return (ids[q_idx + off] == ids[kv_idx]) & (q_idx + off >= kv_idx)
        return None, doc
    if name == "head_window":  # per-head lists: GQA heads cannot share a program
        def head_window(b, h, q_idx, kv_idx):
            return (q_idx + off >= kv_idx) & (q_idx + off - kv_idx < 40 + 60 * h)
        return None, head_window
    if name == "batch_length":  # ragged batch: each sequence has its own length
        lengths = torch.tensor([S, S - 77, 45, S - 1])[:B].to(device)

        def padding(b, h, q_idx, kv_idx):
            return kv_idx < lengths[b]
        return None, padding
    raise KeyError(name)


def _mask(mask_mod, B, H, L, S, block=32, per_head=False, per_batch=False):
    if mask_mod is None:
        return None
    return create_block_mask(mask_mod, B if per_batch else None, H if per_head else None, L, S,
                             device="cpu", BLOCK_SIZE=block)


def check(q, k, v, score_mod, mask_mod, bm, splits, max_scores=True, oracle_kv=None):
    """The decode kernel (``splits`` splits) against the float64 oracle: out, lse, max_scores.
    ``oracle_kv``: the logical (k, v) when the kernel's k, v are a paged cache."""
    call = prepare_call(q, k, v, score_mod, bm, None, q.shape[1] != k.shape[1], None,
                        max_scores=max_scores)
    ok, why = td.routes(call)
    assert ok, why
    out, lse, mx = td.forward(call, splits=splits)
    ko, vo = oracle_kv or (k, v)
    ref, ref_lse = dense_attention(q, ko, vo, score_mod, mask_mod, dtype=torch.float64)
    low, low_lse = dense_attention(q, ko, vo, score_mod, mask_mod, dtype=q.dtype)
    floor = FLOOR[q.dtype]
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close_to_oracle("out", out, ref, low, floor)
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, floor)
    if max_scores:
        ref_max = dense_scores(q, ko, score_mod, mask_mod, dtype=torch.float64).amax(-1)
        low_max = dense_scores(q, ko, score_mod, mask_mod, dtype=q.dtype).amax(-1)
        assert_close_to_oracle("max_scores", mx, ref_max, low_max, floor)
    return out, lse


# --------------------------------------------------------------------------- numerics

# B=2, 8 query heads on 2 kv heads (GQA 4:1), Q_LEN 3, KV_LEN 300 (ragged: 9.4 blocks of 32).
SHAPE = dict(B=2, Hq=8, Hkv=2, L=3, S=300, E=32)


@pytest.mark.parametrize("name", ["full", "causal", "sliding_window", "alibi", "softcap", "document"])
@pytest.mark.parametrize("splits", [1, 4])
def test_core_mods(interp, name, splits):
    s = SHAPE
    q, k, v = _qkv(s["B"], s["Hq"], s["Hkv"], s["L"], s["S"], s["E"], torch.bfloat16, seed=1)
    score_mod, mask_mod = _decode_mods(name, s["B"], s["Hq"], s["L"], s["S"])
    check(q, k, v, score_mod, mask_mod, _mask(mask_mod, s["B"], s["Hq"], s["L"], s["S"]), splits)


@pytest.mark.parametrize("Hq,Hkv,L", [(4, 4, 1), (4, 1, 1), (8, 2, 16), (2, 2, 40), (8, 2, 40)])
def test_gqa_and_query_lengths(interp, Hq, Hkv, L):
    """1:1 and 4:1 at Q_LEN 1; 4·16 = 64 packed rows; Q_LEN 40 over two 32-row query blocks, with
    one head a program (one row tile each) and with 4 packed (4·32 = 128 rows: BLOCK_M 128,
    then 4·8 rows in the second query block)."""
    S = 257  # one key past 8 blocks: the last tile holds a single valid key
    q, k, v = _qkv(2, Hq, Hkv, L, S, 32, torch.float32, seed=2)
    score_mod, mask_mod = _decode_mods("alibi", 2, Hq, L, S)
    check(q, k, v, score_mod, mask_mod, _mask(mask_mod, 2, Hq, L, S), splits=3)


@pytest.mark.parametrize("splits", [1, 2, 7, 40])
def test_split_counts(interp, splits):
    """7 is not a divisor of the 10 tiles; 40 is more splits than tiles (empty splits merge as
    nothing); no block mask (dense walk), ragged S."""
    q, k, v = _qkv(1, 4, 2, 2, 301, 32, torch.bfloat16, seed=3)
    check(q, k, v, None, None, None, splits)


def test_per_head_lists(interp):
    """A head-dependent mask under GQA: one query head per program (GP = 1)."""
    B, Hq, Hkv, L, S = 2, 4, 2, 2, 300
    q, k, v = _qkv(B, Hq, Hkv, L, S, 32, torch.bfloat16, seed=4)
    score_mod, mask_mod = _decode_mods("head_window", B, Hq, L, S)
    bm = _mask(mask_mod, B, Hq, L, S, per_head=True)
    assert td.make_plan(prepare_call(q, k, v, None, bm, None, True, None)).GP == 1
    check(q, k, v, score_mod, mask_mod, bm, splits=3)


def test_uniform_and_head_bools(interp):
    """A bool uniform over the tile (a table read at a fixed index) combined with one that varies
    with the head: the decode tile's rows span heads, so the second is a row vector there."""
    B, Hq, Hkv, L, S = 1, 4, 2, 2, 76
    q, k, v = _qkv(B, Hq, Hkv, L, S, 32, torch.bfloat16, seed=6)
    flags, on = torch.tensor([True, False, True, False]), torch.tensor([-1.0, 2.0])
    rows = torch.tensor([[True, False, False, True, False]])

    def mask_mod(b, h, q_idx, kv_idx):
        return ~rows[b, q_idx % 5] | ((on[1] > 0.0) & flags[h]) | ((kv_idx < 9) ^ (on[0] > 0.0))
    check(q, k, v, None, mask_mod, _mask(mask_mod, B, Hq, L, S, per_head=True), splits=2)


def test_batch_dependent_and_empty_rows(interp):
    """Per-batch lengths, and a batch whose rows see no key in some splits (45 keys, 5 splits)."""
    B, Hq, Hkv, L, S = 3, 4, 2, 1, 290
    q, k, v = _qkv(B, Hq, Hkv, L, S, 32, torch.bfloat16, seed=5)
    _, mask_mod = _decode_mods("batch_length", B, Hq, L, S)
    check(q, k, v, None, mask_mod, _mask(mask_mod, B, Hq, L, S, per_batch=True), splits=5)


def test_fully_masked_rows(interp):
    """A row with nothing kept gives out 0, lse -inf, max -inf, no NaN, with and without splits."""
    B, Hq, Hkv, L, S = 1, 2, 1, 2, 200

    def none_for_second_query(b, h, q_idx, kv_idx):
        return (q_idx == 0) & (kv_idx < 150)
    bm = _mask(none_for_second_query, B, Hq, L, S)
    q, k, v = _qkv(B, Hq, Hkv, L, S, 32, torch.float32, seed=6)
    for splits in (1, 3):
        out, lse = check(q, k, v, None, none_for_second_query, bm, splits)
        assert torch.all(out[:, :, 1] == 0) and torch.all(lse[:, :, 1] == -math.inf)


def _paged(k, v, page, seed):
    """A batch-1 physical cache holding each sequence's pages at shuffled places, with its page
    table: physical page of (b, logical page)."""
    B, H, S, E = k.shape
    n = -(-S // page)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(B * n + 3, generator=g)[:B * n].view(B, n)  # 3 unused pages
    kc = torch.randn(1, H, (B * n + 3) * page, E, generator=g).to(k.dtype)  # garbage elsewhere
    vc = torch.randn(1, H, (B * n + 3) * page, E, generator=g).to(v.dtype)
    for b in range(B):
        for j in range(n):
            lo, hi = j * page, min(S, (j + 1) * page)
            p = int(perm[b, j]) * page
            kc[0, :, p:p + hi - lo] = k[b, :, lo:hi]
            vc[0, :, p:p + hi - lo] = v[b, :, lo:hi]
    return kc, vc, perm


def test_paged_kv(interp):
    """K/V in a shuffled page pool (the layout flexjit.PagedAttention produces): the lists hold
    physical pages, the mask maps a physical key back to (batch, logical position)."""
    B, Hq, Hkv, L, S, page = 2, 4, 2, 1, 200, 32
    q, k, v = _qkv(B, Hq, Hkv, L, S, 32, torch.bfloat16, seed=7)
    kc, vc, table = _paged(k, v, page, seed=7)
    n, P = table.shape[1], kc.shape[2] // page
    owner = torch.full((P,), -1)
    logical = torch.zeros(P, dtype=torch.int64)
    for b in range(B):
        owner[table[b]] = b
        logical[table[b]] = torch.arange(n)
    off = S - L

    def paged_causal(b, h, q_idx, kv_idx):
        pos = logical[kv_idx // page] * page + kv_idx % page
        return (owner[kv_idx // page] == b) & (q_idx + off >= pos)

    # Every logical page is listed as partial (its physical page is the list entry), in
    # logical order; the mask_mod decides within it.
    kv_num = torch.full((B, 1, 1), n, dtype=torch.int32)
    kv_idx = torch.zeros(B, 1, 1, P, dtype=torch.int32)
    kv_idx[:, 0, 0, :n] = table.to(torch.int32)
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=page, mask_mod=paged_causal,
                                  seq_lengths=(L, P * page))
    kx, vx = kc.expand(B, -1, -1, -1), vc.expand(B, -1, -1, -1)  # the cache broadcast over batch

    def causal(b, h, q_idx, kv_idx):
        return q_idx + off >= kv_idx
    for splits in (1, 4):
        check(q, kx, vx, None, causal, bm, splits, oracle_kv=(k, v))


def test_full_blocks_in_any_order(interp):
    """Full-block lists in shuffled order (and no mask_mod call on them): same result."""
    B, Hq, Hkv, L, S = 1, 2, 2, 1, 256
    q, k, v = _qkv(B, Hq, Hkv, L, S, 32, torch.float32, seed=8)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(8)).to(torch.int32)
    zero = torch.zeros(1, 1, 1, dtype=torch.int32)

    def never(b, h, q_idx, kv_idx):  # only partial blocks consult it, and none is listed
        return q_idx < 0
    bm = BlockMask.from_kv_blocks(zero, torch.zeros(1, 1, 1, 8, dtype=torch.int32),
                                  torch.full((1, 1, 1), 8, dtype=torch.int32), order.view(1, 1, 1, 8),
                                  BLOCK_SIZE=32, mask_mod=never, seq_lengths=(L, S))
    out, lse, _ = td.forward(prepare_call(q, k, v, None, bm, None, False, None), splits=3)
    ref, ref_lse = dense_attention(q, k, v)
    low, low_lse = dense_attention(q, k, v, dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.float32])


# --------------------------------------------------------------------------- routing


def _count(monkeypatch):
    seen = []
    real_decode, real_fwd = td.forward, tb.run_forward
    monkeypatch.setattr(td, "forward", lambda call, splits=None: seen.append("decode") or
                        real_decode(call, splits))
    monkeypatch.setattr(tb, "run_forward", lambda *a, **kw: seen.append("prefill") or real_fwd(*a, **kw))
    return seen


def test_routing(interp, monkeypatch):
    """No gradient -> decode kernel; gradients, Q_LEN > 128 or FORCE_USE_FLEX_ATTENTION -> the
    prefill forward. Both answers equal the oracle's."""
    seen = _count(monkeypatch)
    B, Hq, Hkv, L, S = 1, 4, 2, 2, 200
    q, k, v = _qkv(B, Hq, Hkv, L, S, 32, torch.float32, seed=9)
    _, mask_mod = _decode_mods("causal", B, Hq, L, S)
    bm = _mask(mask_mod, B, Hq, L, S)
    ref, ref_lse = dense_attention(q, k, v, None, mask_mod)
    low, _ = dense_attention(q, k, v, None, mask_mod, dtype=torch.float32)
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, backend="triton")
    assert seen == ["decode"]
    assert_close_to_oracle("decode out", out, ref, low, FLOOR[torch.float32])
    qg = q.clone().requires_grad_(True)
    out = flex_attention(qg, k, v, block_mask=bm, enable_gqa=True, backend="triton")
    assert seen == ["decode", "prefill"]
    assert_close_to_oracle("prefill out", out.detach(), ref, low, FLOOR[torch.float32])
    with torch.no_grad():  # grad mode off: decode again, though q requires grad
        flex_attention(qg, k, v, block_mask=bm, enable_gqa=True, backend="triton")
    assert seen[-1] == "decode"
    flex_attention(q, k, v, block_mask=bm, enable_gqa=True, backend="triton",
                   kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
    assert seen[-1] == "prefill"
    long_q = _qkv(1, 2, 2, 129, 256, 32, torch.float32, seed=10)
    assert not td.routes(prepare_call(*long_q, None, None, None, False, None))[0]


def test_auto_puts_triton_first_for_decode(interp, monkeypatch):
    """On a GPU the auto order is cute, triton, reference; a decode call moves triton first
    (the order is faked here: on the CPU auto only runs the reference)."""
    from flexjit.runtime import dispatch
    monkeypatch.setattr(dispatch, "_preference", lambda device: ("cute", "triton", "reference"))
    q, k, v = _qkv(1, 4, 2, 1, 200, 32, torch.float32, seed=11)
    choice = dispatch.select("auto", prepare_call(q, k, v, None, None, None, True, None))
    assert choice.name == "triton" and "split-KV decode kernel" in choice.reason
    qg = q.clone().requires_grad_(True)
    choice = dispatch.select("auto", prepare_call(qg, k, v, None, None, None, True, None))
    assert choice.name == "cute" or choice.passed_over[0][0] == "cute"


def test_explain_shows_splits(interp):
    q, k, v = _qkv(1, 8, 2, 1, 4096, 32, torch.float32, seed=12)
    text = str(flexjit.explain(q, k, v, enable_gqa=True, backend="triton"))
    plan = td.make_plan(prepare_call(q, k, v, None, None, None, True, None))
    assert f"split-KV decode kernel: {plan.splits} splits" in text
    assert plan.splits > 1 and f"for {td.DEFAULT_SMS} SMs" in text


@pytest.mark.parametrize("programs,tiles", [(8, 64), (8, 512), (8, 2048), (16, 2048), (17, 2048),
                                            (64, 64), (64, 65), (65, 64), (64, 512), (512, 512),
                                            (8, 4), (100, 1000), (1, 100000), (4096, 2048)])
def test_choose_splits(programs, tiles):
    """One wave (grids of at most FEW_PROGRAMS programs per split, or within SHORT_GRID): the
    most splits whose programs fit the slots. WAVES waves otherwise: the fewest that fill them.
    Either way no split shorter than MIN_TILES_PER_SPLIT tiles, at most MAX_SPLITS, at least 1."""
    sms = 132
    slots = sms * td.CTAS_PER_SM
    one = programs <= td.FEW_PROGRAMS or (programs <= td.SHORT_GRID[0] and tiles <= td.SHORT_GRID[1])
    s = td.choose_splits(programs, tiles, sms)
    capped = tiles // (s + 1) < td.MIN_TILES_PER_SPLIT or s == td.MAX_SPLITS
    assert 1 <= s <= td.MAX_SPLITS
    assert s == 1 or tiles // s >= td.MIN_TILES_PER_SPLIT
    if one:
        assert s == 1 or programs * s <= slots  # the wave holds every program
        assert programs * (s + 1) > slots or capped  # and one more split would not fit
    else:
        assert s == 1 or programs * (s - 1) < td.WAVES * slots  # no more than needed
        assert programs * s >= td.WAVES * slots or capped  # no fewer than allowed


def test_choose_splits_measured_points():
    """The split counts the H200 measurements stand behind (Hq 32 / Hkv 8, D 128, 64-key tiles:
    8 programs per split at batch 1, 64 at batch 8, 512 at batch 64): one wave at batch 1 (33
    splits at 32k and 128k; 16 at 4k, capped by the tile count) and at batch 8 / 4k (4 splits,
    the sweep's best), four waves at batch 8 / 32k and 128k and at batch 64."""
    assert td.choose_splits(8, 512, 132) == 33
    assert td.choose_splits(8, 2048, 132) == 33
    assert td.choose_splits(8, 64, 132) == 16
    assert td.choose_splits(64, 64, 132) == 4
    assert td.choose_splits(64, 512, 132) == 17
    assert td.choose_splits(64, 2048, 132) == 17
    assert td.choose_splits(512, 64, 132) == 3
    assert td.choose_splits(512, 512, 132) == 3


def test_benchmark_smoke(interp, tmp_path):
    """benchmarks/decode.py end to end at CPU sizes: every flexjit and torch row, the FP8 cache's
    too, is checked against the fp64 reference (contiguous and paged) before it is timed."""
    import json
    from benchmarks import decode
    out = tmp_path / "bench"
    decode.main(["--out", str(out), "--device", "cpu", "--batch", "2", "--kv", "256",
                 "--impls", "flexjit,flexjit-fp8,torch-flex,fa4", "--variants", "causal,sliding_window",
                 "--flexjit-modes", "splits=3,BLOCK_N=32"])
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 5 * 2 * 2
    for r in rows:
        if r["impl"] == "fa4":
            assert r["error"].startswith("skipped: needs a CUDA GPU"), r
        else:
            assert r["correct"] and r["ms"] > 0 and r["error"] is None, r
    assert all("split-KV decode kernel" in r["note"] and r["splits"] >= 1 for r in rows
               if r["impl"].startswith("flexjit"))
    assert all(r["splits"] == 3 and "BLOCK_N=32" in r["note"] for r in rows
               if r["impl"] == "flexjit[splits=3,BLOCK_N=32]")
    # The FP8-cache rows ran the kernel's e4m3 path (not a dequantised copy), checked against the
    # attention of the values the cache holds.
    assert all("reads the FP8 tiles" in r["note"] for r in rows if r["impl"] == "flexjit-fp8")


@pytest.mark.parametrize("arch", [80, 90])
def test_compiles_for_gpus(arch):
    """The rendered decode and merge kernels build for sm_80 and sm_90 without a GPU (the
    interpreter accepts code the compiler would not), with tensor-core MMAs for q·kᵀ and p·v;
    a softcap score_mod over a causal block mask, GQA 4:1, bf16, D=128 (the benchmark's shape)."""
    B, Hq, Hkv, L, S = 8, 32, 8, 1, 32768
    q = torch.empty(B, Hq, L, 128, dtype=torch.bfloat16)
    k = torch.empty(B, Hkv, S, 128, dtype=torch.bfloat16)
    score_mod, mask_mod = _decode_mods("softcap", B, Hq, L, S)
    bm = create_block_mask(mask_mod, None, None, L, S, device="cpu")
    call = prepare_call(q, k, k, score_mod, bm, None, True, None, max_scores=True)
    launches = td.launches_for(call, arch)
    assert [l.kernel for l in launches] == ["flex_decode", "flex_decode_merge"]
    for launch in launches:
        ptx = tb.compile_launch(tb.make_plan(call, arch=arch, interpret=False), launch, arch).asm["ptx"]
        if launch.kernel == "flex_decode":
            assert re.search(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16", ptx) or "wgmma" in ptx
