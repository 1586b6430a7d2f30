"""Compile-only tests of the Blackwell CuTeDSL backward (CPU, no GPU needed), and of what its
backend does without one (its refusal, its argument checks).

Each compile builds the backward's kernels for sm_100a (the template passes ``--gpu-arch
sm_100a`` itself, whatever CUTE_DSL_ARCH says) with real generated mods (traced and lowered by
flexjit, rendered by ``cute_sm90.load_mods``, the module the sm90 kernels use) and checks the PTX
for what the design depends on: tcgen05.mma (a kernel that fell back to wgmma or mma.sync fails)
issued from rolled k-block loops, tensor memory allocated, read, written and freed, tcgen05
commits, TMA loads (cp.async.bulk.tensor), setmaxnreg, exp2, dQ added into fp32 by
``red.global.add.f32``, dS stored to smem as 16-byte vectors. ptxas (from Triton's wheel) must
report no spills and no stack frame.

Measured on the dev CPU (cutlass-dsl 4.8.1, a shared 2-core machine): the main kernel 4-6 s
without mods, more with mods (see the core-mod test); pre/postprocess ~1 s each; ptxas ~1 s.
Sizes never matter (runtime values), so no example tensors are built except captured buffers.
The kernels have never run on a Blackwell GPU; nothing here checks their numbers (the last test
does, on a Blackwell GPU, against float64 autograd).
"""

import importlib
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # the other CuTe tests' default; see the forward's test

torch = pytest.importorskip("torch")
cutlass = pytest.importorskip("cutlass")

from flexjit.backends.cute import sm100_bwd as cute_sm100_bwd  # noqa: E402
from flexjit.backends.cute.sm90 import _aux_tensor, load_mods  # noqa: E402
from mods_catalog import CORE, lowered, make_case  # noqa: E402
from sm100_ptx import (assert_blackwell_path, assert_scalars_not_baked, ptx_text as _ptx_text,  # noqa: E402
                       spill_bytes)

tpl = importlib.import_module("flexjit.templates.cute.sm100.bwd")
cute_host = importlib.import_module("flexjit.templates.cute.host")

if not tpl.tvm_ffi_enabled():
    pytest.skip("the sm100 backward compiles through TVM-FFI only", allow_module_level=True)


def _compile(tmp_path, head_dim, program=None, sparse=False, deterministic=False,
             parts=("main",), grads=False):
    mods = load_mods(program) if program is not None else None
    cfg = tpl.BwdConfig(
        head_dim, head_dim, cutlass.BFloat16,
        mods.score_mod_and_grad if mods else None, mods.mask_mod if mods else None,
        has_block_mask=sparse, deterministic=deterministic,
        score_grads=getattr(mods, "score_grads", None) if grads else None,
        grad_offsets=getattr(mods, "grad_offsets", None) if grads else None)
    aux = tuple(_aux_tensor(t, torch.device("cpu")) for t in program.buffers) if program else ()
    scalars = program.scalars if program else ()
    fn = tpl.compile_bwd(cfg, aux, scalars, options=f"--keep-ptx --dump-dir {tmp_path}",
                         parts=parts)
    return cfg, {name: _ptx_text(p.compiled) for name, p in fn.parts.items()}


def _assert_blackwell_main(ptx: str) -> None:
    assert_blackwell_path(ptx)
    assert re.search(r"red(\.relaxed)?(\.gpu)?\.global\.add\.f32", ptx), "dQ is not added in fp32"
    assert "st.shared.v4" in ptx, "dS does not reach smem as 16-byte vectors"


# tcgen05.mma instructions in the PTX: the MMA warp issues each GEMM from a rolled k-block loop
# (one instruction each for Sᵀ, dPᵀ and dQ, two for dV and dK: the low and high halves of their
# A operand in TMEM): the first tile's Sᵀ (1), the loop body with the next tile's Sᵀ (7) and the
# peeled last tile (6). More would mean a GEMM unrolled (its descriptors hoisted and spilled).
_MMA_INSNS = 1 + 7 + 6


@pytest.mark.parametrize("head_dim", [64, 128])
def test_no_mods_all_parts(tmp_path, head_dim):
    cfg, ptx = _compile(tmp_path, head_dim, parts=tpl.PARTS)
    _assert_blackwell_main(ptx["main"])
    assert ptx["main"].count("tcgen05.mma") == _MMA_INSNS
    for part in tpl.PARTS:
        assert spill_bytes(tmp_path, ptx[part]) == 0, part
    assert "tcgen05" not in ptx["pre"] and "tcgen05" not in ptx["post"]


@pytest.mark.parametrize("head_dim,sparse", [(128, True), (64, False)])
def test_deterministic(tmp_path, head_dim, sparse):
    # The semaphore protocol: an acquire spin before the adds, a release increment after them.
    program = lowered(None, make_case("causal", 2, 4, 300, 500).mask_mod)
    _, ptx = _compile(tmp_path, head_dim, program, sparse=sparse, deterministic=True,
                      parts=("pre", "main"))
    main = ptx["main"]
    _assert_blackwell_main(main)
    assert "ld.acquire.gpu" in main or "ld.global.acquire.gpu" in main, "no acquire spin"
    assert re.search(r"(atom|red)(\.global)?\.release", main), "no release increment"
    assert spill_bytes(tmp_path, main) == 0


# Every core mod compiles for sm_100a with a block mask where it has a mask_mod (the way a call
# reaches the kernel): in CI at D = 128 (every mod a user can pass is checked there, ~4 s a compile);
# FLEXJIT_COMPILE_ALL=1 adds every core mod at 64.
_EVERY = os.environ.get("FLEXJIT_COMPILE_ALL") == "1"
_CASES = [(n, d) for d in (128, 64) for n in CORE if _EVERY or d == 128]


@pytest.mark.parametrize("name,head_dim", _CASES, ids=[f"{n}-d{d}" for n, d in _CASES])
def test_core_mod_compiles_for_sm100a(tmp_path, name, head_dim):
    case = make_case(name, 2, 4, 300, 500)
    program = lowered(case.score_mod, case.mask_mod)
    _, ptx = _compile(tmp_path, head_dim, program, sparse=case.mask_mod is not None)
    main = ptx["main"]
    _assert_blackwell_main(main)
    assert_scalars_not_baked(program, main)
    assert spill_bytes(tmp_path, main) == 0


@pytest.mark.parametrize("name,head_dim", [("learnable_bias", 128), ("learnable_alibi", 128),
                                           ("learnable_bias", 64)])
def test_captured_tensor_grads(tmp_path, name, head_dim):
    # A bias table's index varies per element (one predicated fp64 add each), ALiBi's slope is
    # uniform over the tile (a warp butterfly, one add per warp). The bias table's path is the
    # register-tight one (it spilled 108-448 bytes before its indices were recomputed behind
    # dPᵀ from opaque values), so it runs at both head dims.
    case = make_case(name, 2, 4, 300, 500)
    program = lowered(case.score_mod, case.mask_mod)
    assert program.grad_loads
    cfg, ptx = _compile(tmp_path, head_dim, program, sparse=case.mask_mod is not None,
                        grads=True)
    assert cute_host.num_grad_accs(cfg) == 1
    main = ptx["main"]
    _assert_blackwell_main(main)
    assert re.search(r"(red|atom)(\.\w+)*\.global(\.\w+)*\.add\.f64", main), "no fp64 atomic add"
    if name == "learnable_alibi":
        assert "shfl.sync.bfly" in main, "uniform-index gradient not warp-reduced"
    assert spill_bytes(tmp_path, main) == 0


# --------------------------------------------------------------- configuration


def test_config_table():
    """Head dims 64 and 128 only; each fits the smem and the 512 TMEM columns; the register
    split fills the register file exactly (setmaxnreg moves registers between warpgroups)."""
    assert cute_sm100_bwd.HEAD_DIMS == tpl.HEAD_DIMS
    for d, dv in tpl.HEAD_DIMS:
        cfg = tpl.BwdConfig(d, dv, cutlass.BFloat16, has_block_mask=True)
        assert tpl.smem_bytes(cfg) <= tpl.SMEM_CAPACITY
        assert tpl.tmem_columns(cfg) <= tpl.TMEM_COLUMNS
        tpl.FlexAttentionBwdSm100(cfg)
    assert 128 * (tpl._REDUCE_REGS + 2 * tpl._COMPUTE_REGS + tpl._OTHER_REGS) == 65536
    for d, dv in ((32, 32), (96, 96), (192, 128), (256, 256), (128, 64)):
        with pytest.raises(NotImplementedError, match="head dims"):
            tpl.BwdConfig(d, dv, cutlass.BFloat16)
    with pytest.raises(ValueError, match="come together"):
        tpl.BwdConfig(128, 128, cutlass.BFloat16, score_grads=lambda *a: a)


class _Call:
    def __init__(self, q, v=None, program=None):
        self.q = self.k = q
        self.v = q if v is None else v
        self.program = program
        self.block_mask = None


def test_backend_offers_only_what_it_serves_and_only_through_the_gate():
    # backward_supports refuses what why_not names and accepts the rest: whether the kernel may
    # run is cute_sm100's first-use self-check's to say (test_sm100_gate: a wrong backward
    # falls back to Triton's); dispatch never lists this module itself.
    prog = lowered(None, None)
    ok, why = cute_sm100_bwd.backward_supports(_Call(torch.randn(1, 1, 8, 128, dtype=torch.bfloat16),
                                                     program=prog))
    assert ok is True and "self-checked" in why
    ok, why = cute_sm100_bwd.backward_supports(_Call(torch.randn(1, 1, 8, 96, dtype=torch.bfloat16),
                                                     program=prog))
    assert ok is False and "head dims" in why
    from flexjit.runtime import dispatch
    from flexjit.backends.cute import sm100 as cute_sm100
    assert cute_sm100_bwd not in dispatch._MODULES.values() and cute_sm100.SELF_CHECKED
    assert cute_sm100.self_check(_Call(torch.randn(1, 1, 8, 128, dtype=torch.bfloat16), program=prog),
                                 "backward").run is cute_sm100_bwd.backward


def test_kernel_key_separates_what_the_compile_separates():
    class Call(_Call):
        block_mask = None
    q = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16)
    plain, causal = lowered(None, None), lowered(None, lambda b, h, qi, kv: qi >= kv)
    key = cute_sm100_bwd.kernel_key(Call(q, program=plain))
    assert key == cute_sm100_bwd.kernel_key(Call(q.clone(), program=plain))
    assert key != cute_sm100_bwd.kernel_key(Call(q.half(), program=plain))
    assert key != cute_sm100_bwd.kernel_key(Call(q, program=causal))
    with _deterministic():
        assert key != cute_sm100_bwd.kernel_key(Call(q, program=plain))


class _deterministic:
    def __enter__(self):
        self.was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.was)


def test_why_not():
    prog = lowered(None, None)
    assert cute_sm100_bwd.why_not(_Call(torch.randn(1, 1, 8, 128, dtype=torch.bfloat16),
                                        program=prog)) is None
    assert "head dims" in cute_sm100_bwd.why_not(
        _Call(torch.randn(1, 1, 8, 96, dtype=torch.bfloat16), program=prog))
    assert "dtype" in cute_sm100_bwd.why_not(
        _Call(torch.randn(1, 1, 8, 64, dtype=torch.float32), program=prog))


def test_merged_q_lists_for_deterministic_mode_only():
    """The host's block-list contract (the sm90 host's): presence must match the config, the
    deterministic mode needs ``dq_order``'s lists."""
    cfg = tpl.BwdConfig(64, 64, cutlass.BFloat16, has_block_mask=True, deterministic=True)
    with pytest.raises(ValueError, match="presence"):
        cute_host.block_args(cfg, None, None)
    lists = tuple(torch.zeros(1, 1, 2, dtype=torch.int32) for _ in range(8))
    with pytest.raises(ValueError, match="q_order"):
        cute_host.block_args(cfg, lists, None)
    with pytest.raises(ValueError, match="full_q_idx"):
        cute_host.block_args(cfg, lists[:4], None)


def test_launch_marshalling():
    """The launch path with recording stand-ins for the three kernels (no GPU): workspace shapes
    (whole mask blocks of rows; the semaphores the sm90 preprocess zeroes cover this kernel's one
    per q tile), the dLSE flag, the GQA group, the lists (deterministic: ``dq_order``'s), and
    the order preprocess -> main -> postprocess."""
    from flexjit import mods as fmods
    from flexjit.planner.block_mask import dq_order
    from flexjit import create_block_mask

    calls = []

    def recorder(name):
        return lambda *args: calls.append((name, args))

    cfg = tpl.BwdConfig(128, 128, cutlass.BFloat16, None, None, has_block_mask=True,
                        deterministic=True)
    fn = tpl.CompiledBwd(cfg, {n: cute_host.Part(None, recorder(n)) for n in tpl.PARTS}, ())
    B, Hq, Hkv, L, S, D = 2, 8, 2, 300, 500, 128
    q, out = torch.randn(B, Hq, L, D).bfloat16(), torch.randn(B, Hq, L, D).bfloat16()
    k, v = torch.randn(B, Hkv, S, D).bfloat16(), torch.randn(B, Hkv, S, D).bfloat16()
    dout = torch.randn(1, 1, 1, 1).bfloat16().expand(B, Hq, L, D)  # stride 0, like out.sum()
    lse, dlse = torch.randn(B, Hq, L), torch.randn(B, Hq, L)
    bm = create_block_mask(fmods.causal(), None, None, L, S, device="cpu")
    lists = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
             bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with pytest.raises(ValueError, match="q_order"):
        fn(q, k, v, out, dout, lse, dlse, dq, dk, dv, 0.125, lists, (), ())
    with pytest.raises(ValueError, match="inconsistent shapes"):
        fn(q, k, v, out, dout, lse[:, :, 1:], dlse, dq, dk, dv, 0.125, lists, (), (),
           q_order=dq_order(lists))
    with pytest.raises(TypeError, match="aux scalar"):
        fn(q, k, v, out, dout, lse, dlse, dq, dk, dv, 0.125, lists, (), (True,),
           q_order=dq_order(lists))
    calls.clear()
    order = dq_order(lists)
    fn(q, k, v, out, dout, lse, dlse, dq, dk, dv, 0.125, lists, (), (), q_order=order)
    assert [n for n, _ in calls] == ["pre", "main", "post"]
    o, do, lse_arg, dlse_arg, has_dlse, lse2, delta, dqacc, sem = calls[0][1]
    assert has_dlse == 1 and torch.equal(dlse_arg, dlse) and lse_arg is lse
    assert do.stride(-1) == 1 and torch.equal(do, dout)  # made contiguous for TMA
    assert lse2.shape == delta.shape == (B, Hq, 384) and dqacc.shape == (B, Hq, 384, D)
    assert sem.dtype == torch.int32 and sem.shape[-1] >= 384 // tpl.TILE_M
    main = calls[1][1]
    assert main[9] == 0.125 and main[10] == Hq // Hkv and main[13] is sem
    assert all(a is b for a, b in zip(main[11], order[0]))  # deterministic: the merged lists
    assert all(a is b for a, b in zip(main[12], order[1]))
    assert len(main[11]) == 4 and len(main[12]) == 2
    dqacc_post, dq_post, scale_post = calls[2][1]
    assert dqacc_post is dqacc and dq_post is dq and scale_post == 0.125


# --------------------------------------------------------------- on a Blackwell GPU (none yet)


_BLACKWELL = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


@pytest.mark.gpu
@pytest.mark.skipif(not _BLACKWELL, reason="needs a Blackwell (sm_100) GPU; none has run this")
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", ["full", "causal", "document", "alibi", "softcap",
                                  "relative_bias", "learnable_bias", "learnable_alibi"])
@pytest.mark.parametrize("D", [64, 128])
def test_backward_matches_float64_on_blackwell(name, D, deterministic):
    """The self-check's content, by hand: the kernels called directly (``backward_supports``
    refuses them) on the reference backend's out/LSE, against float64 autograd of
    Σ out·dO + Σ lse·dLSE. L = 700 (ragged against 128), S = 1000, GQA 4:2; outputs poisoned
    with NaN. Tolerance: err <= 2·err(the same math in bf16 with plain torch) + a floor scaled
    by the gradient's magnitude (the sm90 GPU test's rule)."""
    import math

    from flexjit import create_block_mask
    from flexjit.api.attention import flex_attention
    from flexjit.runtime.call import Call
    from mods_catalog import case_and_oracle
    from oracle import FLOOR, assert_close_to_oracle, dense_attention

    B, Hq, Hkv, L, S = 2, 4, 2, 700, 1000
    case, case64 = case_and_oracle(name, B, Hq, L, S, device="cuda")
    program = lowered(case.score_mod, case.mask_mod)
    bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cuda") if case.mask_mod else None
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, h, n, D, generator=g, device="cuda").to(torch.bfloat16)
               for h, n in ((Hq, L), (Hkv, S), (Hkv, S)))
    dout = torch.randn(B, Hq, L, D, generator=g, device="cuda").to(torch.bfloat16)
    dlse = torch.randn(B, Hq, L, generator=g, device="cuda")
    scale = 1 / math.sqrt(D)
    with torch.no_grad():
        out, lse = flex_attention(q, k, v, case.score_mod, bm, enable_gqa=True, return_lse=True,
                                  backend="reference")
    call = Call(q, k, v, program, bm, scale, {}, grad=True, max_scores=False)
    torch.full((1 << 28,), float("nan"), device="cuda")  # poison the allocator's next blocks
    torch.use_deterministic_algorithms(deterministic)
    try:
        got = cute_sm100_bwd.backward(call, q, k, v, out, lse, dout, dlse)
        if deterministic:
            again = cute_sm100_bwd.backward(call, q, k, v, out, lse, dout, dlse)
            for label, a, b in zip(("dq", "dk", "dv"), got[:3], again[:3]):
                assert torch.equal(a, b), f"{name}: deterministic runs differ in {label}"
    finally:
        torch.use_deterministic_algorithms(False)

    def oracle(dtype, c):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        learn = [t for t in c.learnable]
        o, lse_ = dense_attention(*leaves, c.score_mod, c.mask_mod, scale, dtype=dtype)
        finite = torch.isfinite(lse_)
        loss = (o.double() * dout.double()).sum() + (
            torch.where(finite, lse_, torch.zeros_like(lse_)).double() * dlse.double()).sum()
        return torch.autograd.grad(loss, leaves + learn)

    want = oracle(torch.float64, case64)
    low = oracle(torch.bfloat16, case)
    learned = [x for x in got[3:] if x is not None]
    for label, a, b, c in zip(("dq", "dk", "dv", "d_captured"), list(got[:3]) + learned, want,
                              low):
        assert_close_to_oracle(f"{name} {label}", a.to(b.dtype), b, c.to(b.dtype),
                               FLOOR[torch.bfloat16] * max(1.0, b.abs().max().item()))
