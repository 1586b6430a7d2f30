"""Mods that ignore the score or the indices run on every backend that claims them.

A score_mod whose value is a constant (``torch.full_like(s, 1.0)``), a captured scalar or 0-d
tensor, or varies with one index only (``h + 0.5``, ``q_idx * 0.01``, ``kv_idx * 0.01``), and a
mask_mod of one index, or of none: the Triton kernels broadcast such a value to the tile (the
softmax reduces a whole tile), the CuTe kernels evaluate mods per element anyway.

* Triton under the interpreter, and the reference: out, LSE and every gradient (q, k, v and a
  learnable 0-d tensor) against the float64 oracle, err <= 2·err(plain torch in fp32) + floor.
* CuTe: the sm90 and sm100 forward and backward of two representatives compile on the CPU; on a
  GPU (``-m gpu``) every mod's values against the oracle.

Shapes: 48 queries against 80 keys with GQA (4 query heads on 2), ragged against the 32-blocks;
D = 16 keeps each interpreter case near a second.
"""
import pytest
import torch

from flexjit import create_block_mask, flex_attention
from oracle import FLOOR, assert_close_to_oracle, dense_attention, random_qkv

B, Hq, Hkv, L, S = 1, 4, 2, 48, 80
CAP = 0.75


def _score_mods(device="cpu"):
    """name -> (the mod flexjit runs, the same mod as eager torch evaluates it on tensors, the
    captured tensors that require grad)."""
    weight = torch.tensor(0.3, device=device, requires_grad=True)
    return {
        "full_like": (lambda s, b, h, q, kv: torch.full_like(s, 1.0),) * 2 + ((),),
        "head_only": (lambda s, b, h, q, kv: h + 0.5,) * 2 + ((),),
        "row_only": (lambda s, b, h, q, kv: q * 0.01,) * 2 + ((),),
        "column_only": (lambda s, b, h, q, kv: torch.sin(kv * 0.1),) * 2 + ((),),
        "captured_scalar": (lambda s, b, h, q, kv: CAP,
                            lambda s, b, h, q, kv: torch.full_like(s, CAP), ()),
        "captured_0d_tensor": (lambda s, b, h, q, kv: weight * 2.0,
                               lambda s, b, h, q, kv: torch.zeros_like(s) + weight * 2.0, (weight,)),
    }


MASK_MODS = {
    "head_mask": lambda b, h, q, kv: h < 3,
    "row_mask": lambda b, h, q, kv: q % 3 != 1,
    "column_mask": lambda b, h, q, kv: kv >= 7,
}


def _triton_ok() -> bool:
    import triton
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9)


BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not _triton_ok(), reason="the interpreter tests need triton >= 3.9"))]


@pytest.fixture
def _interpreter(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLEXJIT_POISON", "1")
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path))


def _check(backend, mods, mask_mod, device="cpu", dtype=torch.float32, D=16, seed=0, block=32):
    score_mod, oracle_mod, learnable = mods
    q, k, v = (t.detach().to(device).requires_grad_() for t in
               random_qkv(B, Hq, Hkv, L, S, D, D, dtype, seed))
    bm = (create_block_mask(mask_mod, B, Hq, L, S, device=device, BLOCK_SIZE=block) if mask_mod
          else None)
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                              return_lse=True, backend=backend)
    ref, ref_lse = dense_attention(q, k, v, oracle_mod, mask_mod, dtype=torch.float64)
    low, low_lse = dense_attention(q, k, v, oracle_mod, mask_mod, dtype=dtype)
    floor = FLOOR[dtype]
    assert_close_to_oracle("out", out, ref, low, floor)
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, floor)
    dout = torch.randn_like(out)
    inputs = [q, k, v, *learnable]
    got = torch.autograd.grad(out, inputs, dout)
    # Where the score is ignored, q and k do not reach the oracle's output: their gradient is 0.
    want = _or_zeros(torch.autograd.grad(ref, inputs, dout.double(), allow_unused=True), inputs)
    lowg = _or_zeros(torch.autograd.grad(low, inputs, dout, allow_unused=True), inputs)
    for name, a, b, c in zip(["dq", "dk", "dv", "dweight"], got, want, lowg):
        assert_close_to_oracle(name, a, b, c, floor * max(1.0, b.abs().max().item()))


def _or_zeros(grads, inputs):
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(_score_mods()))
def test_score_mods_that_ignore_score_or_indices(_interpreter, backend, name):
    _check(backend, _score_mods()[name], None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(MASK_MODS))
def test_mask_mods_of_one_index(_interpreter, backend, name):
    _check(backend, _score_mods()["row_only"], MASK_MODS[name])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", ["full_like", "row_only"])
def test_cute_kernels_compile(tmp_path, monkeypatch, arch, name):
    # The constant and the row-only score, with a one-index mask: the generated functions are
    # per element, so these stand for the rest (every value is checked on the GPU below).
    monkeypatch.setenv("CUTE_DSL_ARCH", arch)  # read once, when cutlass is first imported
    pytest.importorskip("cutlass")
    from flexjit.integrations.aot import compile_kernels
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    mod = _score_mods()[name][0]
    # AUTOTUNE off: the run's own kernels, not the tuner's other candidates
    kernels = compile_kernels(mod, MASK_MODS["row_mask"], arch=arch, head_dim=64, seq_len=256,
                              heads=2, out=tmp_path / "out",
                              kernel_options={"AUTOTUNE": False})
    passes = {(k.pass_, k.part) for k in kernels}
    assert ("fwd", "main") in passes and ("bwd", "main") in passes
    mma = "wgmma.mma_async" if arch == "sm_90a" else "tcgen05.mma"
    fwd = next(k for k in kernels if k.pass_ == "fwd")
    assert fwd.ptx is not None and mma in fwd.ptx.read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cute", "triton"])
@pytest.mark.parametrize("name", list(_score_mods()))
def test_on_the_gpu(monkeypatch, backend, name):
    monkeypatch.setenv("FLEXJIT_POISON", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check(backend, _score_mods("cuda")[name], MASK_MODS["column_mask"], device="cuda",
           dtype=torch.bfloat16, D=64, block=128)  # the sm90 kernel's tiles are 128x128
