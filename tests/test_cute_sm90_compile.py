"""Compile-only tests of the Hopper CuTeDSL forward template (CPU, no GPU needed).

Each test builds the kernel for sm_90a from CPU example tensors and checks the PTX for the
instructions the design depends on: wgmma (a silent fall back to mma.sync/SIMT fails),
setmaxnreg (warp specialisation with register reallocation) and cp.async.bulk.tensor (TMA).
It also runs ptxas (from Triton's wheel, when present) to check that nothing spills.

Measured on the dev CPU (cutlass-dsl 4.8.1): ~1-2 s per compile without mods, ~3-4 s with a
causal mask_mod and a block mask, ~5-6 s with score_mod + mask_mod reading aux buffers (ptxas
adds ~0.3 s each). The whole file takes 35-60 s, so nothing is marked slow. Shapes are tiny on purpose: sizes and strides are runtime
values, so they do not change the generated code.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

torch = pytest.importorskip("torch")
cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402

from flexjit.cache import load_template  # noqa: E402
from ptx_checks import assert_no_spills  # noqa: E402

_tpl = load_template("cute_sm90_fwd")
FwdConfig, compile_fwd = _tpl.FwdConfig, _tpl.compile_fwd


# Test mods, hand-written in CuTeDSL until the code generator emits them.
@cute.jit
def causal_mask(b, h, q_idx, kv_idx, aux):
    return q_idx >= kv_idx


@cute.jit
def alibi_softcap_score(score, b, h, q_idx, kv_idx, aux):
    slopes = aux.tensors[0]  # (Hq,) fp32
    slope = slopes[cutlass.min(h, slopes.shape[0] - 1)]
    cap = aux.scalars[0]  # runtime Float32
    s = score + slope * Float32(kv_idx - q_idx)
    return cap * cute.math.tanh(s / cap)


@cute.jit
def document_mask(b, h, q_idx, kv_idx, aux):
    doc = aux.tensors[1]  # (S,) int32
    last = doc.shape[0] - 1
    return doc[cutlass.min(q_idx, last)] == doc[cutlass.min(kv_idx, last)]


def _block_mask(nq, nk):
    """A BlockMask with one partial and one full block per query row (content is irrelevant
    for compilation, only dtypes and ranks)."""
    ones = torch.ones(1, 1, nq, dtype=torch.int32)
    idx = torch.zeros(1, 1, nq, nk, dtype=torch.int32)
    return ones, idx, ones.clone(), idx.clone()


def _compile(tmp_path, head_dim, score_mod=None, mask_mod=None, sparse=False, aux=(), scalars=()):
    # L != S and neither a multiple of 128; GQA 4/2: the compile must not depend on any of it.
    b, hq, hkv, seq_q, seq_k = 2, 4, 2, 300, 500
    q = torch.randn(b, hq, seq_q, head_dim, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, seq_k, head_dim, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, seq_k, head_dim, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    lse = torch.empty(b, hq, seq_q)
    bm = _block_mask((seq_q + 127) // 128, (seq_k + 127) // 128) if sparse else None
    cfg = FwdConfig(head_dim, head_dim, cutlass.BFloat16, score_mod, mask_mod, has_block_mask=sparse)
    fn = compile_fwd(cfg, q, k, v, o, lse, bm, aux, scalars,
                     options=f"--keep-ptx --dump-dir {tmp_path}")
    ptx = fn.compiled.__ptx__
    assert ptx, "no PTX produced"
    return ptx


def _assert_hopper_path(ptx):
    assert "wgmma.mma_async" in ptx, "no wgmma: the kernel fell off the Hopper tensor-core path"
    assert "mma.sync" not in ptx, "mma.sync found: Ampere-style MMA instead of wgmma"
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx, "no register reallocation"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads/stores"
    assert "stmatrix" in ptx, "epilogue does not use stmatrix"
    assert "ex2.approx" in ptx, "softmax is not in the exp2 domain"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_no_mods(tmp_path, head_dim):
    ptx = _compile(tmp_path, head_dim)
    _assert_hopper_path(ptx)
    assert_no_spills(tmp_path, ptx)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_causal_block_sparse(tmp_path, head_dim):
    ptx = _compile(tmp_path, head_dim, mask_mod=causal_mask, sparse=True)
    _assert_hopper_path(ptx)
    assert_no_spills(tmp_path, ptx)


def test_causal_dense_mask_mod(tmp_path):
    # mask_mod without a block mask: every kv tile is treated as partial.
    _assert_hopper_path(_compile(tmp_path, 128, mask_mod=causal_mask))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_score_and_mask_mods_with_aux(tmp_path, head_dim):
    slopes = torch.rand(4)
    docs = torch.zeros(500, dtype=torch.int32)
    ptx = _compile(tmp_path, head_dim, alibi_softcap_score, document_mask, sparse=True,
                   aux=(slopes, docs), scalars=(30.0,))
    _assert_hopper_path(ptx)
    assert_no_spills(tmp_path, ptx)
    # The softcap is a runtime kernel parameter, not a constant folded into the code.
    assert "tanh" in ptx or "ex2" in ptx
    assert "30.0" not in ptx and "0f41F00000" not in ptx, "runtime scalar was baked in"
