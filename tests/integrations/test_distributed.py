"""flexjit.distributed (context parallelism) on the CPU: gloo, the reference backend.

2 and 4 spawned processes each run every case once (a module fixture per world size) and
compare, on their own shard, the output, the LSE and the gradients (q, k, v and a learnable
bias table) of the ring with the single-process ``flexjit.flex_attention`` call, both against
the float64 oracle (tests/oracle.py: eager mods, dense math): err(ring) <= 2 * err(single) +
FLOOR, the rule every kernel test follows; in float64 the ring must equal the single call to
1e-9. The skip test reads the ring's counters (document vs causal). Errors for bad input are
checked in the workers (those that need two ranks) and here, in one process with a world of 1.

Shapes: S=512 in all, B=1, 2 query heads (4 over 2 for GQA), D=16: big enough that a zigzag
layout over 2 ranks has 4 chunks of 128 (block 128: partial, full and empty blocks) and over 4
ranks 8 chunks of 64 (block 64), small enough that each case is about a second. The references
(float64 oracle, single call) are computed once in the test process; each world's fixture took
35-55 s of wall time on the shared 2-core machine (about 20 s of CPU), most of it the workers'
imports and the reference backend's autograd; every test after it reads its results.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import traceback

import pytest
import torch
import torch.distributed as dist

import flexjit
import flexjit.integrations.distributed as cp
from flexjit import mods
from oracle import FLOOR, dense_attention, max_err

S, B, D = 512, 1, 16
DOC_LENS = (100, 37, 200, 175)  # ragged against every chunk and block: documents cross ranks
WINDOW = 100


def _doc_ids(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def make_mods(name: str, table: torch.Tensor | None):
    """(mask_mod or None, score_mod or None) of case ``name``; ``table``: the learnable
    relative-position bias table (2S-1,) where the case has one."""
    causal = mods.causal()
    if name == "causal":
        return causal, None
    if name == "full":
        return None, mods.softcap(20.0)
    if name == "document":
        return mods.document(_doc_ids(DOC_LENS)), None
    if name == "doc64":  # documents of 64 tokens: inside every chunk of 64 or 128
        return mods.document(_doc_ids([64] * (S // 64))), None
    if name == "window":
        return mods.sliding_window(WINDOW), None
    if name == "alibi":
        return causal, mods.alibi(mods.alibi_slopes(4))
    if name == "bias":
        return causal, mods.relative_bias(table)
    if name == "bias_window":
        return mods.sliding_window(WINDOW), mods.relative_bias(table)
    raise KeyError(name)


CASES = [  # (mods, layout, dtype, GQA)
    *[(m, lay, torch.float32, False) for m in ("causal", "document", "window", "alibi", "bias")
      for lay in ("zigzag", "contiguous")],
    ("full", "zigzag", torch.float32, True),
    ("doc64", "zigzag", torch.float32, False),
    ("bias_window", "zigzag", torch.float64, False),
    ("document", "contiguous", torch.float64, True),
]
CASES4 = [  # a subset at 4 ranks (4 processes share the 2-core machine)
    ("causal", "zigzag", torch.float32, False), ("document", "contiguous", torch.float32, False),
    ("bias_window", "zigzag", torch.float32, False), ("alibi", "contiguous", torch.float32, True),
    ("doc64", "zigzag", torch.float32, False), ("bias", "zigzag", torch.float64, False),
]


def case_id(case) -> str:
    name, layout, dtype, gqa = case
    return f"{name}-{layout}-{str(dtype).split('.')[-1]}" + ("-gqa" if gqa else "")


def _loss(out, lse, g_out, g_lse):
    finite = torch.isfinite(lse)
    return (out.double() * g_out).sum() + (torch.where(finite, lse.double(), 0) * g_lse).sum()


def _inputs(case):
    """The case's full float64 tensors, the same on every rank (a fixed seed)."""
    name, layout, dtype, gqa = case
    hq, hkv = (4, 2) if gqa else (2, 2)
    g = torch.Generator().manual_seed(1234)
    shapes = [(B, hq, S, D), (B, hkv, S, D), (B, hkv, S, D), (2 * S - 1,), (B, hq, S, D), (B, hq, S)]
    q, k, v, table, g_out, g_lse = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    return q, k, v, 0.5 * table, g_out, g_lse


def _leaves(tensors, dtype):
    return [t.to(dtype).requires_grad_(True) for t in tensors]


def _block_mask(mask_mod, block):
    if mask_mod is None:
        return None
    return flexjit.create_block_mask(mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=block)


def references(case, block: int) -> dict:
    """Full-sequence results of the case, computed once (in the test process): the float64
    oracle (independent of flexjit) and the single-process flexjit call in the case's dtype,
    each as [out, lse, dq, dk, dv, dtable or None]."""
    name, layout, dtype, gqa = case
    q, k, v, table, g_out, g_lse = _inputs(case)
    oq, ok, ov, ot = _leaves((q, k, v, table), torch.float64)
    mask_mod, score_mod = make_mods(name, ot)
    out, lse = dense_attention(oq, ok, ov, score_mod, mask_mod)
    ref = [out, lse, *torch.autograd.grad(_loss(out, lse, g_out, g_lse), (oq, ok, ov, ot), allow_unused=True)]
    sq, sk, sv, st = _leaves((q, k, v, table), dtype)
    mask_mod, score_mod = make_mods(name, st)
    out, lse = flexjit.flex_attention(sq, sk, sv, score_mod, _block_mask(mask_mod, block), enable_gqa=gqa,
                                      return_lse=True, backend="reference")
    single = [out, lse, *torch.autograd.grad(_loss(out, lse, g_out, g_lse), (sq, sk, sv, st), allow_unused=True)]
    detach = lambda ts: [t.detach() if t is not None else None for t in ts]  # noqa: E731
    return {"ref": detach(ref), "single": detach(single)}


def run_case(case, block: int, refs: dict) -> dict:
    """One case on this rank: {quantity: (err ring, err single, |ring - single|, scale)}, the
    errors against the float64 oracle on this rank's shard, plus the ring's counters."""
    name, layout, dtype, gqa = case
    q, k, v, table, g_out, g_lse = _inputs(case)
    rq, rk, rv = (cp.shard(t.to(dtype), layout=layout).requires_grad_(True) for t in (q, k, v))
    rt = table.to(dtype).requires_grad_(True)
    mask_mod, score_mod = make_mods(name, rt)
    out, lse = cp.flex_attention(rq, rk, rv, score_mod, _block_mask(mask_mod, block), layout=layout,
                                 enable_gqa=gqa, return_lse=True, backend="reference")
    loss = _loss(out, lse, cp.shard(g_out, layout=layout), cp.shard(g_lse, layout=layout))
    ring = [out, lse, *torch.autograd.grad(loss, (rq, rk, rv, rt), allow_unused=True)]
    result = {"stats": {k: vars(v) for k, v in cp.last_stats().items()}}
    for i, what in enumerate(("out", "lse", "dq", "dk", "dv", "dtable")):
        ref, single = refs["ref"][i], refs["single"][i]
        if ref is None:
            assert single is None and ring[i] is None, f"{what}: a gradient where none flows"
            continue
        cut = (lambda t: t) if what == "dtable" else (lambda t: cp.shard(t, layout=layout))
        r64, one, got = cut(ref), cut(single), ring[i].detach()
        result[what] = (max_err(got, r64), max_err(one, r64), max_err(got, one), r64.abs().max().item())
    return result


def run_errors(rank: int, world: int, block: int) -> dict:
    """Bad input that needs several ranks to see: {check: (exception type, message)}."""
    out = {}
    x = torch.randn(B, 2, S // world, D)
    bm = flexjit.create_block_mask(mods.causal(), None, None, S, S, device="cpu", BLOCK_SIZE=block)

    def attempt(key, fn):
        try:
            fn()
            out[key] = (None, "")
        except Exception as e:  # recorded and asserted on in the test
            out[key] = (type(e).__name__, str(e))

    short = x[:, :, :S // world - 32] if rank == world - 1 else x  # the last rank's shards shorter
    attempt("unequal_no_mask", lambda: cp.flex_attention(short, short, short, backend="reference"))
    attempt("unequal_mask", lambda: cp.flex_attention(short, short, short, block_mask=bm, backend="reference"))
    other = bm if rank else flexjit.create_block_mask(mods.sliding_window(8), None, None, S, S,
                                                      device="cpu", BLOCK_SIZE=block)
    attempt("different_masks", lambda: cp.flex_attention(x, x, x, block_mask=other, backend="reference"))
    layout = "zigzag" if rank else "contiguous"
    attempt("different_layouts", lambda: cp.flex_attention(x, x, x, layout=layout, backend="reference"))
    full = torch.randn(B, 2, S, D, generator=torch.Generator().manual_seed(7))
    for layout in cp.LAYOUTS:
        back = cp.unshard(cp.shard(full, layout=layout), layout=layout)
        out[f"roundtrip_{layout}"] = (None, str(torch.equal(back, full)))
    return out


def _worker(rank, world, init_file, out_dir, cases, block):
    try:
        torch.set_num_threads(1)  # W processes on a 2-core machine
        refs = torch.load(os.path.join(out_dir, "refs.pt"), weights_only=False)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        results = {"errors": run_errors(rank, world, block)}
        for case in cases:
            results[case_id(case)] = run_case(case, block, refs[case_id(case)])
        dist.destroy_process_group()
    except BaseException:
        results = {"crash": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(target, world: int, args: tuple, tmp, timeout: float) -> list[dict]:
    """``target(rank, *args)`` in ``world`` spawned processes (each saves ``tmp/rank<r>.pt``);
    a rank still running after ``timeout`` s is terminated and fails the test; each rank's
    results, none of them a crash. Also tests/integrations/test_distributed_gpu.py's."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.terminate()
    assert not hung, f"{len(hung)} of {world} ranks hung"
    results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r} crashed:\n{res['crash']}"
    return results


def spawn(world: int, cases, block: int, tmp) -> list[dict]:
    """Run ``cases`` on ``world`` spawned gloo ranks; each rank's results."""
    torch.save({case_id(c): references(c, block) for c in cases}, tmp / "refs.pt")
    return run_ranks(_worker, world, (world, str(tmp / "init"), str(tmp), cases, block), tmp, 300)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn(2, CASES, 128, tmp_path_factory.mktemp("cp2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return spawn(4, CASES4, 64, tmp_path_factory.mktemp("cp4"))


def _check(results, case):
    dtype = case[2]
    for rank, res in enumerate(results):
        metrics = res[case_id(case)]
        for what, values in metrics.items():
            if what == "stats":
                continue
            err_ring, err_single, ring_vs_single, scale = values
            assert math.isfinite(err_ring), f"rank {rank} {what}: NaN or inf"
            if dtype == torch.float64:  # the same math in another order: equal to rounding
                assert ring_vs_single <= 1e-9 * max(1.0, scale), \
                    f"rank {rank} {what}: ring differs from the single call by {ring_vs_single:.3g}"
            bound = 2 * err_single + FLOOR[dtype] * max(1.0, scale)
            assert err_ring <= bound, (f"rank {rank} {what}: error {err_ring:.3g} against float64 exceeds "
                                       f"{bound:.3g} (single call's error {err_single:.3g})")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_two_ranks_equal_single_call(world2, case):
    _check(world2, case)


@pytest.mark.parametrize("case", CASES4, ids=case_id)
def test_four_ranks_equal_single_call(world4, case):
    _check(world4, case)


def _stats(results, case, which="forward"):
    return [r[case_id(case)]["stats"][which] for r in results]


@pytest.mark.parametrize("fixture", ["world2", "world4"])
def test_document_mask_skips_steps_and_sends_less_than_causal(fixture, request):
    results = request.getfixturevalue(fixture)
    world = len(results)
    causal = ("causal", "zigzag", torch.float32, False)
    doc = ("doc64", "zigzag", torch.float32, False)
    for which in ("forward", "backward"):
        c, d = _stats(results, causal, which), _stats(results, doc, which)
        # zigzag causal: every rank needs every shard (W steps); documents inside chunks: only its own
        assert [s["steps_computed"] for s in c] == [world] * world
        assert [s["steps_computed"] for s in d] == [1] * world
        assert all(s["bytes_sent"] > 0 for s in c) and all(s["bytes_sent"] == 0 for s in d)
        assert sum(s["pairs_computed"] for s in d) < sum(s["pairs_computed"] for s in c)
    # zigzag balances causal work: rank r computes its diagonal shard (3 pairs) and 2 per other one
    assert [s["pairs_computed"] for s in _stats(results, causal)] == [3 + 2 * (world - 1)] * world


def test_contiguous_causal_sends_only_what_later_ranks_need(world2):
    st = _stats(world2, ("causal", "contiguous", torch.float32, False))
    # rank 0's shard goes to rank 1; rank 1's is needed by nobody after it: never sent
    assert st[0]["bytes_sent"] > 0 and st[1]["bytes_sent"] == 0
    assert [s["steps_computed"] for s in st] == [1, 2]


@pytest.mark.parametrize("fixture", ["world2", "world4"])
def test_errors_that_need_several_ranks(fixture, request):
    results = request.getfixturevalue(fixture)
    world = len(results)
    for rank, res in enumerate(results):
        err = res["errors"]
        kind, msg = err["unequal_no_mask"]
        assert kind == "ValueError" and "differ in query length" in msg, (rank, kind, msg)
        kind, msg = err["unequal_mask"]
        assert kind == "ValueError", (rank, kind, msg)
        if rank == world - 1:  # its own shards make the wrong global length
            assert "create the GLOBAL mask" in msg, msg
        else:
            assert f"rank(s) [{world - 1}]" in msg, msg
        kind, msg = err["different_masks"]
        assert kind == "ValueError" and "block masks (or layouts) differ" in msg, (rank, kind, msg)
        kind, msg = err["different_layouts"]
        assert kind == "ValueError" and "block masks (or layouts) differ" in msg, (rank, kind, msg)
        for layout in cp.LAYOUTS:
            assert err[f"roundtrip_{layout}"] == (None, "True")


# --------------------------------------------------------------------------- one process


def test_no_process_group_is_an_error():
    assert not dist.is_initialized()
    x = torch.randn(1, 1, 64, 16)
    with pytest.raises(ValueError, match="init_process_group"):
        cp.flex_attention(x, x, x)
    with pytest.raises(ValueError, match="init_process_group"):
        cp.shard(x)


@pytest.fixture
def world1(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bad_input_errors(world1):
    x = torch.randn(1, 2, 256, 16)
    bm = flexjit.create_block_mask(mods.causal(), None, None, 256, 256, device="cpu", BLOCK_SIZE=128)
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.flex_attention(x, x, x, layout="ring")
    odd = torch.randn(1, 2, 255, 16)
    with pytest.raises(ValueError, match="must be even"):
        cp.flex_attention(odd, odd, odd)
    with pytest.raises(ValueError, match="split into 2 equal chunks"):
        cp.shard(odd)
    small = flexjit.create_block_mask(mods.causal(), None, None, 128, 128, device="cpu", BLOCK_SIZE=64)
    with pytest.raises(ValueError, match=r"created for \(Q_LEN, KV_LEN\) = \(128, 128\)"):
        cp.flex_attention(x, x, x, block_mask=small)
    coarse = flexjit.create_block_mask(mods.causal(), None, None, 256, 256, device="cpu", BLOCK_SIZE=256)
    with pytest.raises(ValueError, match="BLOCK_SIZE"):  # zigzag chunks of 128 cut 256-blocks
        cp.flex_attention(x, x, x, block_mask=coarse)
    cp.flex_attention(x, x, x, block_mask=coarse, layout="contiguous")  # one chunk of 256: fine
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        cp.flex_attention(x, x, x, block_mask="causal")
    with pytest.raises(ValueError, match="either return_lse"):
        cp.flex_attention(x, x, x, block_mask=bm, return_lse=True, return_aux=flexjit.AuxRequest(lse=True))
    with pytest.raises(ValueError, match="enable_gqa"):
        cp.flex_attention(x, x[:, :1], x[:, :1])


def test_pairs_share_one_program(world1, programs_run):
    # zigzag at world 1: two chunks, so 3 causal pairs with 3 different (q, kv) offsets; the
    # offsets are runtime scalars, so all pairs run one Program (one kernel on a GPU).
    x = torch.randn(1, 4, 256, 16)
    bm = flexjit.create_block_mask(mods.causal(), None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    cp.flex_attention(x, x, x, mods.alibi(mods.alibi_slopes(4)), bm, backend="reference")
    assert len(programs_run) == 3
    assert len({key for _, key in programs_run}) == 1


def test_world1_equals_single_call_with_max_scores(world1):
    # The pair merge of out/lse/max_scores at world 1 (zigzag: two chunks), float64: equal to rounding.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=g, dtype=torch.float64) for _ in range(3))
    bm = flexjit.create_block_mask(mods.sliding_window(40), None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    aux = flexjit.AuxRequest(lse=True, max_scores=True)
    out, a = cp.flex_attention(q, k, v, mods.softcap(5.0), bm, return_aux=aux, backend="reference")
    ref, b = flexjit.flex_attention(q, k, v, mods.softcap(5.0), bm, return_aux=aux, backend="reference")
    assert max_err(out, ref) < 1e-12 and max_err(a.lse, b.lse) < 1e-12
    assert max_err(a.max_scores, b.max_scores) < 1e-12
    stats = cp.last_stats()["forward"]
    # window 40 over chunks of 128: the (late q, early kv) pair is listed, (early q, late kv) is not
    assert (stats.pairs_computed, stats.pairs_skipped) == (3, 1)


@pytest.fixture
def interp(monkeypatch):
    """Triton kernels in the interpreter (CPU tensors), as tests/backends/triton/test_triton_backend.py runs them."""
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("interpreter tests need triton >= 3.9")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_world1_triton_backward_reads_the_global_out_and_lse(world1, interp):
    # The GPU backends' pair backward is the standard one given the GLOBAL out/LSE (the
    # reference's recomputes its own softmax and takes the rescaled path). Here on Triton,
    # interpreted: zigzag at world 1 = 2 chunks of 128, 3 causal pairs, a learnable table.
    # S = 256, D = 16, one head pair: what the interpreter runs in seconds.
    n, hq = 256, 2
    g = torch.Generator().manual_seed(11)
    q, k, v, g_out = (torch.randn(1, hq, n, D, generator=g, dtype=torch.float64) for _ in range(4))
    table64 = 0.5 * torch.randn(2 * n - 1, generator=g, dtype=torch.float64)
    bm = flexjit.create_block_mask(mods.causal(), None, None, n, n, device="cpu", BLOCK_SIZE=64)

    def grads(fn, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v, table64)]
        out = fn(*leaves[:3], mods.relative_bias(leaves[3]))
        return [out.detach(), *torch.autograd.grad((out.double() * g_out).sum(), leaves)]

    ref = grads(lambda q, k, v, sm: dense_attention(q, k, v, sm, mods.causal())[0], torch.float64)
    single = grads(lambda q, k, v, sm: flexjit.flex_attention(q, k, v, sm, bm, backend="triton"), torch.float32)
    ring = grads(lambda q, k, v, sm: cp.flex_attention(q, k, v, sm, bm, backend="triton"), torch.float32)
    assert cp.last_stats()["backward"].backend == "triton"
    for what, r64, one, got in zip(("out", "dq", "dk", "dv", "dtable"), ref, single, ring):
        bound = 2 * max_err(one, r64) + FLOOR[torch.float32] * max(1.0, r64.abs().max().item())
        assert max_err(got, r64) <= bound, f"{what}: {max_err(got, r64):.3g} > {bound:.3g}"


def test_benchmark_runs_on_the_cpu(tmp_path):
    # benchmarks/context_parallel.py at a world of one (no torchrun: it makes its own gloo group)
    # and tiny shapes: its rows exist and its counters are the ring's (zigzag at world 1: 2 chunks,
    # 3 causal pairs; documents of ~64 tokens inside chunks of 256 at most, fewer pairs).
    import json
    from benchmarks import context_parallel as bench
    assert not dist.is_initialized()
    bench.main(["--device", "cpu", "--S", "512", "--heads", "2", "--dim", "16", "--block", "64",
                "--doc-mean", "64", "--iters", "1", "--warmup", "0", "--layouts", "zigzag",
                "--backend", "reference", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    ring = {(r["variant"], r["pass"]): r for r in rows if r["mode"] == "ring"}
    assert set(ring) == {(v, p) for v in ("causal", "document") for p in ("fwd", "fwdbwd")}
    assert ring[("causal", "fwd")]["pairs_computed"] == [3]
    assert ring[("document", "fwd")]["pairs_computed"][0] <= 3
    assert all(r["ms"] > 0 and r["fwd_bytes_sent"] == [0] for r in ring.values())
    assert {r["mode"] for r in rows} == {"ring", "plain"}
    assert not dist.is_initialized()


def test_a_chunk_mask_warns_as_its_stale_global_mask():
    # The ring's per-chunk masks keep the global mask's planning record: document ids edited in
    # place after planning warn in a chunk's call too. 128 tokens in two chunks of 64, blocks
    # of 32: a chunk spans two blocks.
    g = torch.Generator().manual_seed(6)
    doc_ids = torch.tensor([0] * 50 + [1] * 78)
    bm = flexjit.create_block_mask(mods.document(doc_ids), None, None, 128, 128, device="cpu",
                                   BLOCK_SIZE=32)
    q, k, v = (torch.randn(1, 1, 128, 16, generator=g, dtype=torch.float64) for _ in range(3))
    sub = cp._sub_mask(bm, 2, 1, 0)  # the second query chunk against the first kv chunk
    out = flexjit.flex_attention(q[:, :, 64:], k[:, :, :64], v[:, :, :64], block_mask=sub)
    ref = dense_attention(q[:, :, 64:], k[:, :, :64], v[:, :, :64],
                          mask_mod=lambda b, h, qi, ki: mods.document(doc_ids)(b, h, qi + 64, ki))[0]
    assert max_err(out, ref) <= 1e-12
    doc_ids[40:50] = 1
    with pytest.warns(flexjit.StaleBlockMaskWarning, match="`doc_ids`"):
        flexjit.flex_attention(q[:, :, 64:], k[:, :, :64], v[:, :, :64], block_mask=sub)
