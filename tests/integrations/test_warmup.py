"""``flexjit.warmup`` and ``flexjit.warmup_model``, on the CPU (kernels for sm_90a).

* ``warmup`` compiles a training call's forward (on every configuration the tuner measures) and
  the backward's three kernels on the pool's workers; this process then builds the same call as a run does and loads all four from disk
  with ``cute.compile`` forbidden; a second warmup (in this process, and in a fresh worker)
  finds all four cached.
* ``warmup_model``'s calls are the calls a transformers model makes: the jobs built from them
  have the identities of the jobs built from the calls a real forward of a tiny Llama and a
  tiny Gemma 2 (softcap, sliding-window layers) sends to flexjit, and the same forward tiling.
* A call no sm90 kernel takes (a head dim it lacks, float32) is reported, not compiled.
"""
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
torch = pytest.importorskip("torch")

import flexjit  # noqa: E402
from flexjit import mods  # noqa: E402
from flexjit.backends.cute import sm90  # noqa: E402
from flexjit.integrations import warmup as wu  # noqa: E402
from flexjit.runtime import compile_pool  # noqa: E402

S, D, H = 512, 64, 4  # D=64: the sm90 kernels' shortest compile


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    compile_pool.shutdown()
    yield tmp_path / "cache"
    compile_pool.shutdown()


def test_calls_no_sm90_kernel_takes_are_reported(cache):
    calls = [flexjit.WarmupCall(1, H, S, 40, mask_mod=mods.causal()),
             flexjit.WarmupCall(1, H, S, D, torch.float32, mask_mod=mods.causal())]
    summary = flexjit.warmup(calls, progress=False)
    assert (summary.compiled, summary.cached, len(summary.skipped)) == (0, 0, 2)
    assert "head dims (40, 40)" in summary.skipped[0] and "float32" in summary.skipped[1]
    assert compile_pool._POOL is None  # nothing was sent to a worker


@pytest.mark.slow
def test_warmup_compiles_forward_and_backward_and_a_run_loads_them(cache):
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    import cutlass.cute as cute
    from flexjit.api.attention import prepare_call
    from flexjit.backends.cute import objects

    alibi, causal = mods.alibi(H), mods.causal()
    # AUTOTUNE=False: the kernels a call runs (the tuner's other candidate is the next test's).
    call = flexjit.WarmupCall(2, H, S, D, score_mod=alibi, mask_mod=causal, requires_grad=True,
                              kernel_options={"AUTOTUNE": False})
    sm90._COMPILED.clear()  # a forked worker would find another test's kernels in memory
    sm90._COMPILED_BWD.clear()
    first = flexjit.warmup([call], progress=False)
    assert (first.compiled, first.cached) == (4, 0), first
    assert len(list((cache / "cute").glob("*.o"))) == 4

    # The run's own path: its call (another batch: a runtime value), memory empty, no compiling.
    q = torch.empty(3, H, S, D, dtype=torch.bfloat16)
    bm = flexjit.create_block_mask(causal, None, None, S, S, device="cpu")
    run = prepare_call(q, q, q, alibi, bm, None, False, None)
    aux = tuple(sm90._aux_tensor(t, q.device) for t in run.program.buffers)
    sparse = sm90.block_sparse_args(bm)
    real, hits = cute.compile, objects.STATS["hits"]
    cute.compile = lambda *a, **k: pytest.fail("a kernel was compiled after the warmup")
    try:
        sm90._COMPILED.clear()
        sm90._COMPILED_BWD.clear()
        sm90.compile_program(run.program, q, q, q, sparse, aux,
                             persistent=sm90._persistent_fwd(D, sparse, S, owner=bm))
        sm90.compile_backward(run.program, q.dtype, D, True, False, aux, head_dim_v=D)
    finally:
        cute.compile = real
    assert objects.STATS["hits"] - hits == 4

    again = flexjit.warmup([call], progress=False)  # this process: its jobs are done
    assert (again.compiled, again.cached) == (0, 4)
    compile_pool.shutdown()  # a fresh worker, which looks on disk
    fresh = flexjit.warmup([call], progress=False)
    assert (fresh.compiled, fresh.cached) == (0, 4)


def test_warmup_compiles_every_candidate_the_tuner_measures(cache, monkeypatch):
    # Causal at 512, D=64: 2.5 kv tiles per q tile (both schedules measured), merged tiles mostly
    # partial (128 rows only). The jobs are the run's: a run's tuner finds each one done.
    import concurrent.futures as cf
    import dataclasses

    from flexjit.api.attention import prepare_call
    from flexjit.runtime import autotune

    call = flexjit.WarmupCall(2, H, S, D, score_mod=mods.alibi(H), mask_mod=mods.causal(),
                              requires_grad=True)
    fields = lambda jobs: [(j.kind, j.tile_m, j.persistent, j.bwd_config) for j in jobs]  # noqa: E731
    assert fields(wu.jobs(call)[0]) == [("fwd", 128, True, ""), ("bwd", 128, False, "")]
    found, why = wu.jobs(call, candidates=True)
    # The defaults, the forward's other schedule, the backward's two longest-first launches.
    assert not why and sorted(fields(found)) == sorted([
        ("fwd", 128, True, ""), ("bwd", 128, False, ""), ("fwd", 128, False, ""),
        ("bwd", 128, False, "lpt"), ("bwd", 128, False, "lpt2")])
    assert fields(found[:2]) == fields(wu.jobs(call)[0])
    off = dataclasses.replace(call, kernel_options={"AUTOTUNE": False})
    assert fields(wu.jobs(off, candidates=True)[0]) == fields(found[:2])

    sent = []

    def submit(job, background=False):
        sent.append(job.ident)
        fut = cf.Future()
        fut.set_result({"compiled": 1 if job.kind == "fwd" else 3, "cached": 0, "seconds": 0.0})
        return fut
    monkeypatch.setattr(compile_pool, "submit", submit)
    summary = flexjit.warmup([call], progress=False)
    assert sorted(sent) == sorted(j.ident for j in found) and (summary.compiled, summary.cached) == (11, 0)
    q = torch.empty(3, H, S, D, dtype=torch.bfloat16)  # the run's call: another batch
    bm = flexjit.create_block_mask(mods.causal(), None, None, S, S, device="cpu")
    run = prepare_call(q, q, q, call.score_mod, bm, None, False, None)
    tuning = autotune.declared(sm90, run, "fwd")
    jobs = compile_pool.candidate_jobs(run, tuning.family, tuning.candidates)
    assert {j.ident for j in jobs.values()} == {j.ident for j in found if j.kind == "fwd"}


def _tiny(family: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=1024, attention_dropout=0.0)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Gemma2Config(**common, sliding_window=128, attn_logit_softcapping=5.0,
                                     query_pre_attn_scalar=64,
                                     layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_warmup_model_makes_the_calls_the_model_makes(family, passes_run):
    transformers = pytest.importorskip("transformers")
    import flexjit.integrations.transformers as fjt  # noqa: F401  (registers "flexjit")

    cfg = _tiny(family)
    L, B = 384, 2  # three 128-blocks: the sliding window (128) differs from causal
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="flexjit")
    model.to(torch.bfloat16)
    model(torch.randint(0, 96, (B, L))).logits.float().sum().backward()
    ran = {}
    for pass_, _, call in passes_run:
        if pass_ == "fwd":
            ran[compile_pool.backward_job(call).ident] = sm90._persistent_fwd(
                D, sm90.block_sparse_args(call.block_mask), L, owner=call.block_mask)
    warmed = {}
    for call in fjt.warmup_calls(model, [L], B, torch.bfloat16):
        found, why = wu.jobs(call)
        assert not why, why
        fwd, bwd = found
        warmed[bwd.ident] = fwd.persistent
    assert warmed == ran and len(ran) == (2 if family == "gemma2" else 1)


@pytest.mark.parametrize("precision", ["bf16", "autocast"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_models_first_call_starts_its_other_layer_kinds(family, precision, monkeypatch):
    # A model's first attention call sends every kernel its layer kinds will need, but its own
    # forward (compiled by the call itself), to the workers at once: Gemma 2's sliding and full
    # layers compile side by side. Once per shape; never for a call with padding. Under a
    # bfloat16 autocast over float32 weights (how training scripts run), Gemma 2's q and k reach
    # attention in float32; the calls are still the bfloat16 ones that run.
    transformers = pytest.importorskip("transformers")
    import flexjit.integrations.transformers as fjt

    started = []
    monkeypatch.setattr(fjt, "_pool_serves", lambda device: True)
    monkeypatch.setattr(compile_pool, "start", started.append)
    monkeypatch.setattr(fjt, "_STARTED", set())
    cfg = _tiny(family)
    L, B = 384, 2
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="flexjit")
    if precision == "bf16":
        model.to(torch.bfloat16)
    amp = lambda: torch.autocast("cpu", torch.bfloat16, enabled=precision == "autocast")  # noqa: E731
    ids = torch.randint(0, 96, (B, L))
    with amp():
        model(ids).logits.float().sum().backward()
    want = [job for call in fjt.warmup_calls(model, [L], B, torch.bfloat16)
            for job in wu.jobs(call)[0]]
    first_kind = cfg.layer_types[0] if family == "gemma2" else "full_attention"
    kinds = sorted(set(getattr(cfg, "layer_types", None) or ["full_attention"]))
    own_fwd = want[2 * kinds.index(first_kind)]
    assert sorted(j.ident for j in started) == sorted(j.ident for j in want if j is not own_fwd)
    assert len(started) == (3 if family == "gemma2" else 1)
    assert {j.kind for j in started} == ({"fwd", "bwd"} if family == "gemma2" else {"bwd"})

    started.clear()
    with amp():
        model(ids).logits.float().sum().backward()  # the same shape: nothing more
    with torch.no_grad(), amp():
        model(ids[:, :256])  # a new shape, no gradients: forwards only
    assert [j.kind for j in started] == (["fwd"] if family == "gemma2" else [])

    started.clear()
    with amp():
        model(ids[:, :128], attention_mask=torch.ones(B, 128).tril(0)[:, :128] > 0)  # padding
    assert started == []


@pytest.mark.slow
def test_the_warmup_command_fills_the_cache_a_model_run_loads(cache, tmp_path):
    # `flexjit warmup --model DIR`, as a user runs it before training: a tiny Llama config saved
    # to a folder, compiled in a fresh process into the cache folder; then a second command
    # finds every kernel cached.
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    import subprocess
    import sys

    _tiny("llama").save_pretrained(tmp_path / "model")
    env = dict(os.environ, FLEXJIT_CACHE_DIR=str(cache), CUTE_DSL_ARCH="sm_90a")
    env["PYTHONPATH"] = os.pathsep.join([str(wu.__file__).rsplit("/flexjit/", 1)[0],
                                         env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "flexjit", "warmup", "--model", str(tmp_path / "model"),
               "--seq-len", "384", "--batch", "2"]
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    # The forward on both schedules the tuner measures at 384 tokens, the backward's three, and
    # the main kernels of its two longest-first launches (each finds the pre/postprocess cached).
    # Its head dim is 64: no query-head CTAs among the candidates.
    assert "flexjit warmup: 7 kernels compiled, 4 cached" in first.stdout, first.stdout
    assert len(list((cache / "cute").glob("*.o"))) == 7
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert "flexjit warmup: 0 kernels compiled, 11 cached" in again.stdout, again.stdout
    bad = subprocess.run(command[:5] + [str(tmp_path / "nowhere"), "--seq-len", "384"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "cannot read a transformers config" in bad.stderr
