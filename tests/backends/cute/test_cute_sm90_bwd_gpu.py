"""The sm90 CuTeDSL backward on the GPU: dQ, dK, dV against float64 autograd, and determinism.

    python -m pytest -q -m gpu tests/backends/cute/test_cute_sm90_bwd_gpu.py

Runs only on a Hopper GPU (marker ``gpu``). Most tests call the backward directly through the
template (``compile_bwd``) on the out/LSE of the sm90 forward; the last ones go through
``flex_attention(..., backend="cute")`` and autograd, as a user would.
* Gradients: the float64 oracle (``tests/oracle.py``'s ``dense_attention`` + autograd) of the loss
  Σ out·dO + Σ lse·dLSE; tolerance err <= 2·err(the same math in bf16 with plain torch) + floor,
  the floor scaled by the gradient's magnitude (as ``tests/backends/triton/test_triton_gpu.py``).
* dq/dk/dv are filled with NaN first, so an element the kernels never write fails.
* D = 128 runs both GEMM orders: light masks (causal, windows) form P under the dP GEMM, mods
  with loads or transcendentals issue dP after P (``BwdConfig.overlap_dp``).
* Shapes: L = S = 1000 (ragged against the 64-row Q tile and the 128-key tile), GQA 16/4
  (each CTA loops over 4 query heads), head dims 128 and 64 (32, 96, 192 and (192, 128) in
  ``test_more_head_dims``; 192's 64-key tile, in both its forms, also in ``test_head_dim_192_*``);
  L != S once; 2k tokens for the determinism checks (16 kv blocks add into every causal dQ
  tile's last rows).
Compiles: ~2-6 s per new (mods, head dim, mode) on the H200 host.
"""
import importlib
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper GPU", allow_module_level=True)

import cutlass  # noqa: E402

from flexjit import create_block_mask  # noqa: E402
from flexjit.api.attention import explain, flex_attention
from flexjit.planner.block_mask import dq_order  # noqa: E402
from flexjit.backends.cute.sm90 import _aux_tensor, bwd_block_lists, light_mods, load_mods, unit_dscore
from flexjit.ir.nodes import Op, uses  # noqa: E402
from flexjit.frontend.trace import MASK_MOD, trace_mod  # noqa: E402
from mods_catalog import CORE, case_and_oracle, lowered, make_case  # noqa: E402
from oracle import FLOOR, assert_close_to_oracle, dense_attention  # noqa: E402

tpl = importlib.import_module("flexjit.templates.cute.sm90.bwd")
host = importlib.import_module("flexjit.templates.cute.sm90.bwd_host")
tiling_tpl = importlib.import_module("flexjit.templates.cute.sm90.bwd_tiling")
DEV = "cuda"
_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
_COMPILED = {}


def _block_mask(mask_mod, B, H, L, S):
    if mask_mod is None:
        return None
    traced = trace_mod(mask_mod, MASK_MOD).out
    return create_block_mask(mask_mod, B if uses(traced, Op.B) else None,
                             H if uses(traced, Op.H) else None, L, S, device=DEV)


def _compiled(case, D, dtype, sparse, deterministic, Dv=None, config=""):
    program = lowered(case.score_mod, case.mask_mod)
    aux = tuple(_aux_tensor(t, torch.device(DEV)) for t in program.buffers)
    Dv = Dv or D
    key = (program.key, D, Dv, dtype, sparse, deterministic, config)
    if key not in _COMPILED:
        mods = load_mods(program)
        overlap = True if light_mods(program) else None
        cfg = tpl.BwdConfig(D, Dv, _DTYPES[dtype], mods.score_mod_and_grad, mods.mask_mod,
                            has_block_mask=sparse, deterministic=deterministic,
                            overlap_dp=overlap,
                            score_grads=getattr(mods, "score_grads", None),
                            grad_offsets=getattr(mods, "grad_offsets", None),
                            unit_dscore=unit_dscore(program),
                            tiling=tiling_tpl.bwd_tiling(D, Dv, overlap, config) if config else None)
        _COMPILED[key] = host.compile_bwd(cfg, aux, program.scalars)
    return _COMPILED[key], aux, program.scalars


def _inputs(B, Hq, Hkv, L, S, D, dtype, seed, Dv=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=g, device=DEV).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g, device=DEV).to(dtype)
    v = torch.randn(B, Hkv, S, Dv or D, generator=g, device=DEV).to(dtype)
    dout = torch.randn(B, Hq, L, Dv or D, generator=g, device=DEV).to(dtype)
    dlse = torch.randn(B, Hq, L, generator=g, device=DEV)
    return q, k, v, dout, dlse


def run_backward(case, q, k, v, dout, dlse, bm, sparse=True, deterministic=False, config=""):
    """Forward on the sm90 kernel, then the sm90 backward (the schedule variants ``config``
    names, ``tiling_tpl.bwd_tiling``); returns (dq, dk, dv)."""
    B, Hq, L, D = q.shape
    with torch.no_grad():
        out, lse = flex_attention(q, k, v, case.score_mod, bm, enable_gqa=Hq != k.shape[1],
                                  return_lse=True, backend="cute")
    fn, aux, scalars = _compiled(case, D, q.dtype, sparse and bm is not None, deterministic,
                                 Dv=v.shape[-1], config=config)
    dq, dk, dv = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    lists = bwd_block_lists(bm, fn.cfg.tiling) if (sparse and bm is not None) else None
    order = dq_order(lists) if deterministic and lists is not None else None
    fn(q, k, v, out, dout, lse, dlse, dq, dk, dv, 1.0 / math.sqrt(D), lists, aux, scalars, q_order=order)
    torch.cuda.synchronize()
    return dq, dk, dv


def _oracle_grads(case, q, k, v, dout, dlse, dtype, scale=None):
    qq, kk, vv = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = dense_attention(qq, kk, vv, case.score_mod, case.mask_mod, scale=scale, dtype=dtype)
    finite = torch.isfinite(lse)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(finite, lse, torch.zeros_like(lse)).double() * dlse.double()).sum()
    return torch.autograd.grad(loss, (qq, kk, vv))


def assert_grads_close(prefix, got, want, low, dtype=torch.bfloat16,
                       labels=("dq", "dk", "dv", "d_captured0")):
    """Each gradient against the float64 oracle: err <= 2·err(the same math in ``dtype``) +
    a floor scaled by the gradient's magnitude."""
    for label, a, b, c in zip(labels, got, want, low):
        assert a.shape == b.shape, (label, a.shape, b.shape)
        assert_close_to_oracle(f"{prefix} {label}", a.to(b.dtype), b, c.to(b.dtype),
                               FLOOR[dtype] * max(1.0, b.abs().max().item()))


def assert_bit_identical(runs, prefix, n=3):
    """The first ``n`` gradients of every run equal the first run's, bit for bit."""
    for r in runs[1:]:
        for label, a, b in zip(("dq", "dk", "dv"), r[:n], runs[0][:n]):
            assert torch.equal(a, b), f"{prefix}: deterministic runs differ in {label}"


def check(name, B, Hq, Hkv, L, S, D, dtype=torch.bfloat16, sparse=True, with_dlse=True, seed=0,
          Dv=None, config=""):
    torch.manual_seed(seed)
    case = make_case(name, B, Hq, L, S, device=DEV)
    q, k, v, dout, dlse = _inputs(B, Hq, Hkv, L, S, D, dtype, seed, Dv=Dv)
    dlse = dlse if with_dlse else None
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    got = run_backward(case, q, k, v, dout, dlse, bm, sparse=sparse, config=config)
    want = _oracle_grads(case, q, k, v, dout, dlse, torch.float64)
    low = _oracle_grads(case, q, k, v, dout, dlse, dtype)
    assert_grads_close(name, got, want, low, dtype)
    return got


@pytest.mark.parametrize("D", [128, 64, 32])
@pytest.mark.parametrize("name", ["causal", "alibi", "document", "softcap", "sliding_window"])
def test_mods_ragged_gqa(name, D):
    check(name, B=2, Hq=16, Hkv=4, L=1000, S=1000, D=D)


_COVERED = {"causal", "alibi", "document", "softcap", "sliding_window", "full", "prefix_lm",
            "head_dependent", "softcap_alibi_window", "learnable_bias", "learnable_alibi"}


@pytest.mark.parametrize("name", [n for n in CORE if n not in _COVERED])
def test_rest_of_the_core_list(name):
    # The core mods not covered above (learnable ones: test_captured_tensor_grads_through_the_api).
    check(name, B=2, Hq=8, Hkv=2, L=1000, S=1000, D=128)


@pytest.mark.parametrize("D", [128, 64])
def test_no_mods_dense(D):
    # No block mask: every q tile is a full tile; the last one is ragged (bounded).
    check("full", B=2, Hq=8, Hkv=2, L=1000, S=1000, D=D)


def test_mask_mod_without_block_lists():
    # The backward visits every q tile as partial (mask_mod per element).
    check("causal", B=1, Hq=4, Hkv=4, L=1000, S=1000, D=128, sparse=False)


def test_q_len_differs_from_kv_len_no_dlse():
    check("prefix_lm", B=2, Hq=8, Hkv=2, L=700, S=1500, D=128, with_dlse=False)


def test_fp16_and_head_dependent():
    check("head_dependent", B=1, Hq=4, Hkv=2, L=1000, S=1000, D=128, dtype=torch.float16)


def test_softcap_alibi_window():
    check("softcap_alibi_window", B=1, Hq=8, Hkv=2, L=1000, S=1000, D=128)


@pytest.mark.parametrize("name,sparse", [("causal", True), ("document", True),
                                         ("sliding_window", True), ("full", False)])
def test_deterministic_bit_identical(name, sparse):
    # The sliding window interleaves full and partial q blocks in every kv block's merged list.
    B, Hq, Hkv, L, S, D = 2, 8, 2, 2048, 2048, 128
    torch.manual_seed(3)
    case = make_case(name, B, Hq, L, S, device=DEV)
    q, k, v, dout, dlse = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 3)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    runs = []
    for _ in range(5):
        dq, dk, dv = run_backward(case, q, k, v, dout, dlse, bm, sparse, deterministic=True)
        runs.append((dq, dk, dv))
    assert_bit_identical(runs, name)
    # ... and it is the right answer (same tolerance as the default mode).
    want = _oracle_grads(case, q, k, v, dout, dlse, torch.float64)
    low = _oracle_grads(case, q, k, v, dout, dlse, torch.bfloat16)
    assert_grads_close(f"{name} det", runs[0], want, low)


def test_empty_kv_blocks_get_zero_gradients():
    # Causal with S > L: kv blocks past the last query are listed for no q block; their dK/dV
    # must be written as zeros, not left as the NaN poison.
    B, Hq, Hkv, L, S, D = 1, 2, 2, 256, 1024, 128
    case = make_case("causal", B, Hq, L, S, device=DEV)
    q, k, v, dout, dlse = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 5)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    dq, dk, dv = run_backward(case, q, k, v, dout, dlse, bm)
    assert torch.count_nonzero(dk[:, :, L:]) == 0 and torch.count_nonzero(dv[:, :, L:]) == 0
    assert not torch.isnan(dq).any()


# The schedule variants (``tiling_tpl.bwd_tiling``) on every tile kind: ragged L and S against the
# 64- and 80-row tiles, GQA, a causal block mask (partial and full tiles) and no mask.
_VARIANTS = [(c, D) for c in ("late", "dksmem", "late+dksmem", "shuffle", "late+dksmem+shuffle",
                              "psmem", "psmem+dksmem+shuffle")
             for D in (128, 64)] + [("swapdq", 128), ("late+dksmem+swapdq", 128),
                                    ("lpt", 128), ("lpt2", 128), ("lpt2", 64), ("late+lpt", 64),
                                    ("m128+shuffle+dvafter+lpt", 64),
                                    ("m128+shuffle+dvafter+lpt2", 64), ("m128+dvafter+lpt", 32)]


@pytest.mark.parametrize("config,D", _VARIANTS)
@pytest.mark.parametrize("name", ["causal", "full"])
def test_schedule_variants(config, D, name):
    check(name, B=2, Hq=8, Hkv=2, L=1000, S=1000, D=D, config=config)


# The 128-row tile's variants that compile clean with score mods
# (test_m128_score_mods_compile_clean): P converted after dS where d score/d score is 1 ("late"),
# dP issued after P ("dpafter"), P read from smem ("psmem").
_TALL_SCORE_MODS = [
    ("m128+shuffle+late+dvafter", 64, "alibi"), ("m128+shuffle+late+dvafter", 64, "t5_bias"),
    ("m128+shuffle+late+dvafter+dpafter", 64, "alibi"),
    ("m128+shuffle+late+dvafter+dpafter", 64, "relative_bias"),
    ("m128+shuffle+late+dvafter+dpafter", 64, "t5_bias"),
    ("m128+shuffle+late+dvafter+dpafter", 32, "alibi"),
    ("m128+shuffle+late+dvafter+dpafter", 32, "relative_bias"),
    ("m128+psmem+dksmem+shuffle+dpafter", 64, "softcap"),
    ("m128+psmem+dksmem+shuffle+dpafter", 64, "softcap_alibi_window"),
    ("m128+psmem+dksmem+shuffle+dpafter", 64, "relative_bias"),
    ("m128+psmem+dksmem+shuffle+dpafter", 32, "softcap")]


@pytest.mark.parametrize("config,D,name", [("m80+late+dksmem+shuffle", 128, "full"),
                                           ("m128+psmem+dksmem+shuffle", 64, "full"),
                                           ("m128+psmem+dksmem+shuffle", 64, "causal"),
                                           ("m128+psmem+dksmem+shuffle", 64, "alibi"),
                                           ("m128", 32, "full"), ("m128", 32, "causal"),
                                           ("m128", 32, "alibi"), ("m128", 32, "document"),
                                           ("m128+shuffle", 32, "causal"),
                                           ("m128+shuffle+dvafter", 64, "full"),
                                           ("m128+shuffle+dvafter", 64, "causal"),
                                           ("m128+shuffle+dvafter", 64, "document"),
                                           ("m128+shuffle+dvafter", 64, "alibi"),
                                           ("m128+shuffle+late+dvafter", 64, "causal"),
                                           *_TALL_SCORE_MODS])
def test_taller_tiles(config, D, name):
    # 80 rows: no multiple of the 128-row mask block, dense launches only.
    check(name, B=2, Hq=8, Hkv=2, L=1000, S=1000, D=D, config=config)


@pytest.mark.parametrize("config,D,name", [("psmem", 128, "alibi")])
def test_psmem_without_overlap(config, D, name):
    # P read from smem with the overlap off (the D=128 row's for heavy mods): the dV GEMM reads
    # dO before any dP GEMM has waited for it, so it must wait for dO itself.
    check(name, B=2, Hq=8, Hkv=2, L=1000, S=1000, D=D, config=config)


@pytest.mark.parametrize("config,D", [("swapdq", 128), ("m80+late+dksmem+shuffle", 128),
                                      ("m128+psmem+dksmem+shuffle", 64), ("m128", 32),
                                      ("m128+shuffle+dvafter", 64), ("m128+dvafter", 32)])
def test_schedule_variants_deterministic(config, D):
    # The transposed dQ boxes and 80-row tiles' semaphores (a tile count that does not divide
    # the padded length) keep deterministic mode bit-identical.
    B, Hq, L = 1, 4, 1100
    case = make_case("causal", B, Hq, L, L, device=DEV)
    q, k, v, dout, dlse = _inputs(B, Hq, Hq, L, L, D, torch.bfloat16, 3)
    sparse = not config.startswith("m80")
    bm = _block_mask(case.mask_mod, B, Hq, L, L)
    runs = [run_backward(case, q, k, v, dout, dlse, bm, sparse=sparse, deterministic=True,
                         config=config) for _ in range(3)]
    want = _oracle_grads(case, q, k, v, dout, dlse, torch.float64)
    low = _oracle_grads(case, q, k, v, dout, dlse, torch.bfloat16)
    assert_grads_close(f"deterministic {config}", runs[0], want, low)
    assert_bit_identical(runs, config)


def _api_grads(case, q, k, v, dout, bm, gqa, scale=None):
    qq, kk, vv = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flex_attention(qq, kk, vv, case.score_mod, bm, scale=scale, enable_gqa=gqa, backend="cute")
    return torch.autograd.grad(out, (qq, kk, vv), dout)


@pytest.mark.parametrize("D", [128, 64, 32])
@pytest.mark.parametrize("name", ["causal", "softcap", "document", "sliding_window"])
def test_autograd_through_the_api(name, D):
    # The dispatch path: the cute backend's autograd Function runs the sm90 backward its rule
    # picks (at head dims 32 and 64 the 128-row tile for causal and sliding window).
    B, Hq, Hkv, L, S = 2, 8, 2, 1000, 1000
    case = make_case(name, B, Hq, L, S, device=DEV)
    q, k, v, dout, _ = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 7)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    got = _api_grads(case, q, k, v, dout, bm, True)
    want = _oracle_grads(case, q, k, v, dout, None, torch.float64)
    low = _oracle_grads(case, q, k, v, dout, None, torch.bfloat16)
    assert_grads_close(f"api {name}", got, want, low)


@pytest.mark.parametrize("scale", [0.0, -0.2])
@pytest.mark.parametrize("name", ["alibi", "softcap"])
def test_nonpositive_scales_through_the_api(name, scale):
    # Beside a score_mod the sm90 kernels take any scale (without one, Triton does: see
    # test_cute_gpu); at 0 no gradient reaches q or k through the scores.
    B, Hq, Hkv, L, S, D = 1, 4, 2, 1000, 1000, 128
    case = make_case(name, B, Hq, L, S, device=DEV)
    q, k, v, dout, _ = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 3)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    got = _api_grads(case, q, k, v, dout, bm, True, scale)
    want = _oracle_grads(case, q, k, v, dout, None, torch.float64, scale)
    low = _oracle_grads(case, q, k, v, dout, None, torch.bfloat16, scale)
    assert_grads_close(f"api {name} scale {scale}", got, want, low)


def test_api_deterministic_mode_is_bit_identical():
    B, Hq, Hkv, L, S, D = 1, 8, 8, 2048, 2048, 128
    case = make_case("causal", B, Hq, L, S, device=DEV)
    q, k, v, dout, _ = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 9)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_api_grads(case, q, k, v, dout, bm, False) for _ in range(5)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert_bit_identical(runs, "api")


# The head dims beyond 64 and 128 with a backward tile: causal (light: P under dP) and two heavier mods
# (softcap's tanh, document's loads; at D <= 96 and 192 they overlap too). Ragged L = S = 1000,
# GQA 8/2. 192 and (192, 128): the 64-key tile (two kv tiles per mask block; S = 1000 leaves
# the last mask block's second tile with 104 - 64 = 40 keys, and the dense relative_bias and
# full run without block lists), in both forms (D192_FORMS); alibi adds a per-head slope load.
D192_FORMS = ("sdpdup", "qsplit")


def _more_head_dims_cases():
    for D, Dv, name in [(32, 32, "causal"), (32, 32, "softcap"), (96, 96, "causal"),
                        (96, 96, "softcap"), (96, 96, "document")]:
        yield pytest.param(D, Dv, name, "", id=f"{D}-{Dv}-{name}")
    for form in D192_FORMS:
        for D, Dv, name in [(192, 192, "causal"), (192, 192, "softcap"), (192, 192, "full"),
                            (192, 128, "causal"), (192, 128, "document"),
                            (192, 128, "relative_bias"), (192, 128, "alibi")]:
            yield pytest.param(D, Dv, name, form, id=f"{D}-{Dv}-{name}-{form}")


@pytest.mark.parametrize("D,Dv,name,config", list(_more_head_dims_cases()))
def test_more_head_dims(name, D, Dv, config):
    check(name, B=2, Hq=8, Hkv=2, L=1000, S=1000, D=D, Dv=Dv, config=config)


@pytest.mark.parametrize("config", D192_FORMS)
@pytest.mark.parametrize("D,Dv", [(192, 192), (192, 128)])
def test_head_dim_192_ragged_last_mask_block(D, Dv, config):
    # S = 960 = 7.5 mask blocks: block 7's first 64-key tile is the last in range, so the
    # grid's last CTA (block 7's second tile, keys 960..1023) has no key in range; it must add
    # zeros to dQ and write nothing (dk/dv are NaN-poisoned). L != S, causal block lists, no dLSE.
    # L = 700 leaves the last 64-row Q tile with 60 rows: in the qsplit form warpgroup 1's
    # 32 rows hold 28 in range.
    check("causal", B=1, Hq=4, Hkv=2, L=700, S=960, D=D, Dv=Dv, with_dlse=False, seed=4,
          config=config)


@pytest.mark.parametrize("config", D192_FORMS)
@pytest.mark.parametrize("D,Dv,name,sparse", [(192, 192, "causal", True), (192, 128, "document", True),
                                              (192, 128, "full", False)])
def test_head_dim_192_deterministic_bit_identical(D, Dv, name, sparse, config):
    # Two kv tiles per mask block: the dQ semaphore ranks count kv tiles (2·rank + which half).
    # S = 1984 = 15.5 mask blocks: the last block's second tile is empty and still adds.
    B, Hq, Hkv, L, S = 1, 4, 2, 2048, 1984
    torch.manual_seed(3)
    case = make_case(name, B, Hq, L, S, device=DEV)
    q, k, v, dout, dlse = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 3, Dv=Dv)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    runs = [run_backward(case, q, k, v, dout, dlse, bm, sparse, deterministic=True, config=config)
            for _ in range(4)]
    assert_bit_identical(runs, f"{name} D={D}/{Dv} {config}")
    want = _oracle_grads(case, q, k, v, dout, dlse, torch.float64)
    low = _oracle_grads(case, q, k, v, dout, dlse, torch.bfloat16)
    assert_grads_close(f"{name} D={D}/{Dv} det", runs[0], want, low)


@pytest.mark.parametrize("config", D192_FORMS)
@pytest.mark.parametrize("D,Dv,name", [(192, 192, "causal"), (192, 128, "causal"),
                                       (192, 128, "softcap")])
def test_head_dim_192_through_the_api_on_cute(D, Dv, name, config, monkeypatch):
    # flex_attention + autograd at 192 and (192, 128): the sm90 forward and, since the 64-key
    # tile, the sm90 backward (no hand-off to Triton). dq, dk, dv against the float64 oracle.
    from flexjit.api.attention import prepare_call
    from flexjit.backends.cute import sm90 as cute_sm90

    _no_triton_backward(monkeypatch)
    B, Hq, Hkv, L, S = 2, 8, 2, 1000, 1000
    torch.manual_seed(5)
    case = make_case(name, B, Hq, L, S, device=DEV)
    q, k, v, dout, _ = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 5, Dv=Dv)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    call = prepare_call(*leaves, case.score_mod, bm, None, True, None)
    assert cute_sm90.supports(call)[0]
    assert cute_sm90.backward_supports(call)[0]
    options = {"BWD_CONFIG": config}  # kernel_options pins the form
    choice = explain(*leaves, case.score_mod, bm, enable_gqa=True, kernel_options=options)
    assert (choice.name, choice.backward) == ("cute", "cute"), str(choice)
    out = flex_attention(*leaves, case.score_mod, bm, enable_gqa=True, kernel_options=options)
    got = torch.autograd.grad(out, leaves, dout)
    want = _oracle_grads(case, q, k, v, dout, None, torch.float64)
    low = _oracle_grads(case, q, k, v, dout, None, torch.bfloat16)
    assert_grads_close(f"{name} D={D}/{Dv}", got, want, low)


def _no_triton_backward(monkeypatch):
    """Make any hand-off to the Triton backward fail the test (the sm90 backward must
    produce the captured tensors' gradients itself)."""
    from flexjit.backends import triton as triton_backend_entry

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton backward ran; the sm90 backward should have")
    monkeypatch.setattr(triton_backend_entry, "backward", refuse)


def _captured_grads_check(name, B, Hq, Hkv, L, S, D, seed, run_kernel):
    """dq, dk, dv and d(captured) from ``run_kernel(case, q, k, v, dout, bm)`` against the float64
    oracle, which differentiates the float64-captures twin (autograd sums a float32 table's
    gradient in float32: no better than the kernel)."""
    case, twin = case_and_oracle(name, B, Hq, L, S, device=DEV, seed=seed)
    q, k, v, dout, _ = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, seed)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)

    def oracle(c, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = dense_attention(*leaves, c.score_mod, c.mask_mod, dtype=dtype)[0]  # GQA inside
        return torch.autograd.grad(out, leaves + list(c.learnable), dout.to(out.dtype))

    got = run_kernel(case, q, k, v, dout, bm)
    want = oracle(twin, torch.float64)
    low = oracle(case, torch.bfloat16)
    for label, a in zip(("dq", "dk", "dv", "d_captured0"), got):
        assert torch.isfinite(a).all(), f"{name} {label}: non-finite"
    assert_grads_close(name, got, want, low)
    return got


@pytest.mark.parametrize("name", ["learnable_bias", "learnable_alibi"])
def test_captured_tensor_grads_through_the_api(name, monkeypatch, capsys):
    # A captured tensor that requires grad; the cute backend's backward computes its
    # gradient on the sm90 backward (no Triton hand-off), D = 128, GQA 8/2, ragged L = S = 1000.
    from flexjit.api.attention import prepare_call
    from flexjit.backends.cute import sm90 as cute_sm90

    _no_triton_backward(monkeypatch)
    monkeypatch.setenv("FLEXJIT_DEBUG", "1")
    B, Hq, Hkv, L, S, D = 2, 8, 2, 1000, 1000, 128

    def run(case, q, k, v, dout, bm):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        call = prepare_call(*leaves, case.score_mod, bm, None, True, None)
        ok, why = cute_sm90.backward_supports(call)
        assert ok, why
        assert cute_sm90.supports(call)[0]
        out = flex_attention(*leaves, case.score_mod, bm, enable_gqa=True, backend="cute")
        return torch.autograd.grad(out, leaves + list(case.learnable), dout)

    _captured_grads_check(name, B, Hq, Hkv, L, S, D, 11, run)
    printed = capsys.readouterr().out
    assert "backward on cute" in printed and "backward on triton" not in printed, printed


@pytest.mark.parametrize("D,config", [(128, ""), (64, ""), (192, "sdpdup"), (192, "qsplit"),
                                      (64, "m128+psmem+dksmem+shuffle+dpafter"),
                                      (64, "m128+shuffle+late+dvafter+dpafter+dksmem")])
@pytest.mark.parametrize("name", ["learnable_bias", "learnable_alibi"])
def test_captured_tensor_grads_through_the_template(name, D, config):
    # 192 "sdpdup": both MMA warpgroups hold the same elements; only warpgroup 0 adds them.
    # "qsplit": each holds its own query rows and adds them.
    # The 128-row tile at 64: P from smem, or P converted after the gradients' dS (learnable_bias
    # spills 8 bytes there, learnable_alibi is clean: test_m128_score_mods_compile_clean).
    # The template directly: compile_bwd with score_grads/grad_offsets and fp64 accumulators.
    from flexjit.backends.cute.sm90 import grad_slots

    B, Hq, Hkv, L, S = 2, 8, 2, 1000, 1000

    def run(case, q, k, v, dout, bm):
        program = lowered(case.score_mod, case.mask_mod)
        assert grad_slots(program) == [0]
        with torch.no_grad():
            out, lse = flex_attention(q, k, v, case.score_mod, bm, enable_gqa=True,
                                      return_lse=True, backend="cute")
        fn, aux, scalars = _compiled(case, D, q.dtype, True, False, config=config)
        acc = torch.zeros(aux[0].shape, dtype=torch.float64, device=DEV)
        dq, dk, dv = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        fn(q, k, v, out, dout, lse, None, dq, dk, dv, 1.0 / math.sqrt(D), bwd_block_lists(bm),
           aux, scalars, grad_accs=(acc,))
        torch.cuda.synchronize()
        return dq, dk, dv, acc.reshape(case.learnable[0].shape)

    _captured_grads_check(name, B, Hq, Hkv, L, S, D, 13, run)


def test_captured_tensor_grads_deterministic_mode_runs_on_cute(monkeypatch):
    # Deterministic mode keeps the sm90 backward: dq/dk/dv bit-identical; the captured gradient
    # (fp64 atomics, order not fixed) agrees to well below its float32 rounding.
    _no_triton_backward(monkeypatch)
    B, Hq, Hkv, L, S, D = 1, 4, 4, 1000, 1000, 128
    case, _ = case_and_oracle("learnable_bias", B, Hq, L, S, device=DEV, seed=17)
    q, k, v, dout, _ = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 17)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)

    def once():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = flex_attention(*leaves, case.score_mod, bm, backend="cute")
        return torch.autograd.grad(out, leaves + list(case.learnable), dout)

    torch.use_deterministic_algorithms(True)
    try:
        runs = [once() for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert_bit_identical(runs, "captured")
    for r in runs[1:]:
        torch.testing.assert_close(r[3], runs[0][3], rtol=1e-6, atol=1e-6)


# One CTA per query head ("qhead", ``BwdTiling.q_head``): each CTA adds its fp32 dK/dV into the
# per-kv-head workspaces by TMA reduce-add and the postprocess converts them. Groups of 4 (16/4)
# and 8 (8/1: every query head adds into the one kv head); ragged L = S = 1000 (the last kv
# tile's rows past S land in the workspace's padding and are never converted); causal and
# documents (partial and full tiles), ALiBi (a score_mod with a per-query-head load: the head
# index each CTA passes), no mask (a dense launch).
_QHEAD_GROUPS = [(16, 4), (8, 1)]


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("Hq,Hkv", _QHEAD_GROUPS)
@pytest.mark.parametrize("name", ["causal", "document", "alibi", "full"])
def test_qhead(name, Hq, Hkv, D):
    check(name, B=2, Hq=Hq, Hkv=Hkv, L=1000, S=1000, D=D, config="qhead")


@pytest.mark.parametrize("name", ["causal", "alibi"])
def test_qhead_without_block_lists(name):
    # Every q tile visited (a mask_mod: partial ones), the launch without lists.
    check(name, B=2, Hq=8, Hkv=1, L=1000, S=1000, D=128, sparse=False, config="qhead")


@pytest.mark.parametrize("L,S", [(700, 1500), (1500, 700)])
@pytest.mark.parametrize("name", ["causal", "prefix_lm"])
def test_qhead_q_len_differs_from_kv_len(name, L, S):
    # S > L: kv tiles no query reaches (causal) still add zeros, so their dK/dV are zeros from
    # the zeroed workspace; S < L: the query rows past S.
    check(name, B=2, Hq=16, Hkv=4, L=L, S=S, D=128, with_dlse=False, config="qhead")


@pytest.mark.parametrize("config,D", [("qhead+lpt", 64), ("qhead+lpt2", 128), ("qhead+lpt", 128),
                                      ("qhead+psmem+dksmem+shuffle", 64), ("qhead", 32),
                                      ("qhead", 96)])
def test_qhead_combined_and_more_head_dims(config, D):
    # The tuner's combined candidates (the longest-first order then walks query heads), P and
    # dS from smem, and the narrow and 96-wide boxes (96: 12 column groups per box).
    check("causal", B=2, Hq=16, Hkv=4, L=1000, S=1000, D=D, config=config)


def test_qhead_empty_kv_blocks_get_zero_gradients():
    # Causal with S > L: kv blocks past the last query are listed for no q block; their dK/dV
    # come out of the zeroed workspaces as zeros, not as the NaN poison.
    B, Hq, Hkv, L, S, D = 1, 8, 2, 256, 1024, 128
    case = make_case("causal", B, Hq, L, S, device=DEV)
    q, k, v, dout, dlse = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 5)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    dq, dk, dv = run_backward(case, q, k, v, dout, dlse, bm, config="qhead")
    assert torch.count_nonzero(dk[:, :, L:]) == 0 and torch.count_nonzero(dv[:, :, L:]) == 0
    assert not torch.isnan(dq).any() and not torch.isnan(dk).any() and not torch.isnan(dv).any()


@pytest.mark.parametrize("Hkv", [4, 16])
def test_qhead_through_the_api(Hkv):
    # kernel_options pins "qhead"; at Hq = Hkv the backward keeps its head loop, and explain
    # says so. Values against the oracle either way.
    B, Hq, L, S, D = 2, 16, 1000, 1000, 64
    case = make_case("causal", B, Hq, L, S, device=DEV)
    q, k, v, dout, _ = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 11)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    opts = {"BWD_CONFIG": "qhead"}
    qq, kk, vv = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flex_attention(qq, kk, vv, case.score_mod, bm, enable_gqa=Hq != Hkv, backend="cute",
                         kernel_options=opts)
    got = torch.autograd.grad(out, (qq, kk, vv), dout)
    want = _oracle_grads(case, q, k, v, dout, None, torch.float64)
    low = _oracle_grads(case, q, k, v, dout, None, torch.bfloat16)
    assert_grads_close(f"api qhead Hkv={Hkv}", got, want, low)
    said = explain(qq, kk, vv, case.score_mod, bm, enable_gqa=Hq != Hkv, backend="cute",
                   kernel_options=opts).backward_config
    assert ("runs as the head loop (Hq = Hkv)" in said) == (Hkv == Hq), said


# The 96-key tile (BWD_CONFIG "keys96", templates/cute/sm90/bwd_keys.py) at 192 and (192, 128).
# L = S = 1000 is ragged against the 64-row Q tile and the 96-key tile (10 tiles and 40 keys),
# and its tiles straddle mask blocks (tile 1 holds keys 96..191: blocks 0 and 1), so the q
# lists per tile (``tile_q_lists``) decide which tiles run partial, full or not at all.
KEYS96_DIMS = [(192, 192), (192, 128)]


@pytest.mark.parametrize("D,Dv", KEYS96_DIMS)
@pytest.mark.parametrize("name", ["full", "causal", "alibi", "softcap", "document", "sliding_window"])
def test_keys96_mods_ragged_gqa(name, D, Dv):
    # GQA 16/4: each CTA loops over its 4 query heads, accumulating dKᵀ/dVᵀ.
    check(name, B=2, Hq=16, Hkv=4, L=1000, S=1000, D=D, Dv=Dv, config="keys96")


@pytest.mark.parametrize("D,Dv", KEYS96_DIMS)
@pytest.mark.parametrize("name,L,S", [("causal", 700, 960), ("document", 1300, 500),
                                      ("full", 300, 1100)])
def test_keys96_q_len_differs_from_kv_len(name, L, S, D, Dv):
    # L != S both ways, no dLSE. S = 960 = 10 whole tiles (7.5 mask blocks); S = 500 leaves the
    # last tile 20 keys; L = 700 leaves the last Q tile 60 rows.
    check(name, B=1, Hq=4, Hkv=2, L=L, S=S, D=D, Dv=Dv, with_dlse=False, seed=4, config="keys96")


@pytest.mark.parametrize("D,Dv", KEYS96_DIMS)
def test_keys96_mask_mod_without_block_lists(D, Dv):
    # mask_mod with no block lists: every (q tile, kv tile) pair runs as partial.
    check("causal", B=1, Hq=4, Hkv=4, L=1000, S=1000, D=D, Dv=Dv, sparse=False, config="keys96")


@pytest.mark.parametrize("D,Dv,name", [(192, 192, "causal"), (192, 128, "softcap")])
def test_keys96_through_the_api(D, Dv, name, monkeypatch):
    # flex_attention + autograd with BWD_CONFIG pinned: the backend derives the per-tile lists
    # from the BlockMask itself (``bwd_block_lists``).
    _no_triton_backward(monkeypatch)
    B, Hq, Hkv, L, S = 2, 8, 2, 1000, 1000
    torch.manual_seed(6)
    case = make_case(name, B, Hq, L, S, device=DEV)
    q, k, v, dout, _ = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 6, Dv=Dv)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    options = {"BWD_CONFIG": "keys96"}
    choice = explain(*leaves, case.score_mod, bm, enable_gqa=True, kernel_options=options)
    assert (choice.name, choice.backward) == ("cute", "cute"), str(choice)
    assert "keys96" in choice.backward_config, choice.backward_config
    out = flex_attention(*leaves, case.score_mod, bm, enable_gqa=True, kernel_options=options)
    got = torch.autograd.grad(out, leaves, dout)
    want = _oracle_grads(case, q, k, v, dout, None, torch.float64)
    low = _oracle_grads(case, q, k, v, dout, None, torch.bfloat16)
    assert_grads_close(f"{name} D={D}/{Dv} keys96", got, want, low)


def test_keys96_deterministic_mode_runs_the_64_key_tile(monkeypatch):
    # Pinned keys96 under deterministic algorithms: the 64-key tile (which has a dQ order) runs,
    # explain says so, and the gradients are bit-identical run to run.
    _no_triton_backward(monkeypatch)
    B, Hq, Hkv, L, S, D = 1, 4, 2, 1000, 1000, 192
    torch.manual_seed(7)
    case = make_case("causal", B, Hq, L, S, device=DEV)
    q, k, v, dout, _ = _inputs(B, Hq, Hkv, L, S, D, torch.bfloat16, 7)
    bm = _block_mask(case.mask_mod, B, Hq, L, S)
    options = {"BWD_CONFIG": "keys96"}
    torch.use_deterministic_algorithms(True)
    try:
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        choice = explain(*leaves, case.score_mod, bm, enable_gqa=True, kernel_options=options)
        assert "64-key tile serves deterministic algorithms" in choice.backward_config
        runs = []
        for _ in range(3):
            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            out = flex_attention(*leaves, case.score_mod, bm, enable_gqa=True, kernel_options=options)
            runs.append(torch.autograd.grad(out, leaves, dout))
    finally:
        torch.use_deterministic_algorithms(False)
    assert_bit_identical(runs, "keys96 pinned, deterministic")
    want = _oracle_grads(case, q, k, v, dout, None, torch.float64)
    low = _oracle_grads(case, q, k, v, dout, None, torch.bfloat16)
    assert_grads_close("keys96 pinned, deterministic", runs[0], want, low)
