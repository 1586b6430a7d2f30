"""Every core mod, rendered by our code generator into the sm90 kernel, compiles for sm_90a.

CPU only (CUTE_DSL_ARCH=sm_90a). The PTX must hold the Hopper machinery: wgmma, setmaxnreg and
TMA (cp.async.bulk.tensor); a kernel that silently fell back to mma.sync or SIMT fails.
Each compile takes ~2-5 s on the dev CPU; lengths are tiny because they are runtime values.
"""
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")

from flexjit import create_block_mask, mods  # noqa: E402
from flexjit.backends.cute_sm90 import _aux_tensor, block_sparse_args, compile_program  # noqa: E402
from mods_catalog import CORE, lowered, make_case  # noqa: E402


def _forward_ptx(name, tmp_path, B=2, Hq=4, Hkv=2, persistent=None) -> str:
    """The sm90 forward's PTX for a core mod, through the backend's own compile path."""
    L, S, D = 300, 500, 128
    case = make_case(name, B, Hq, L, S)
    program = lowered(case.score_mod, case.mask_mod)
    bm = create_block_mask(case.mask_mod, B, Hq, L, S, device="cpu") if case.mask_mod else None
    q = torch.randn(B, Hq, L, D, dtype=torch.bfloat16)
    k, v = [torch.randn(B, Hkv, S, D, dtype=torch.bfloat16) for _ in range(2)]
    aux = tuple(_aux_tensor(t, q.device) for t in program.buffers)
    fn = compile_program(program, q, k, v, block_sparse_args(bm), aux, persistent=persistent,
                         options=f"--keep-ptx --dump-dir {tmp_path}")
    ptx = fn.compiled.__ptx__
    assert "wgmma.mma_async" in ptx, "no wgmma in the PTX"
    return ptx


@pytest.mark.parametrize("name", CORE)
def test_core_mod_compiles_for_sm90a(name, tmp_path):
    ptx = _forward_ptx(name, tmp_path)
    assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert "cp.async.bulk.tensor" in ptx


def test_persistent_forward_is_chosen_for_short_kv_loops(monkeypatch):
    # Persistent up to PERSISTENT_MAX_KV_TILES kv tiles per q tile on average (short loops:
    # windows, S <= 2k); one CTA per tile for long ones (8k causal / full). The env var forces.
    from flexjit.backends.cute_sm90 import PERSISTENT_MAX_KV_TILES, _persistent_fwd
    monkeypatch.delenv("FLEXJIT_CUTE_PERSISTENT", raising=False)
    window = create_block_mask(mods.sliding_window(1024), None, None, 8192, 8192, device="cpu")
    causal = create_block_mask(mods.causal(), None, None, 8192, 8192, device="cpu")
    assert _persistent_fwd(128, block_sparse_args(window), 8192, owner=window)
    assert window._remembered("mean_kv_tokens") <= 128 * PERSISTENT_MAX_KV_TILES  # one sync per mask
    assert not _persistent_fwd(128, block_sparse_args(causal), 8192)
    assert _persistent_fwd(128, None, 2048) and not _persistent_fwd(128, None, 8192)
    assert not _persistent_fwd(256, None, 1024)  # no smem for a separate O buffer
    monkeypatch.setenv("FLEXJIT_CUTE_PERSISTENT", "1")
    assert _persistent_fwd(64, block_sparse_args(causal), 8192)
    monkeypatch.setenv("FLEXJIT_CUTE_PERSISTENT", "0")
    assert not _persistent_fwd(128, None, 1024)


def test_captured_tensor_grads_run_on_the_sm90_backward_unless_switched_off(monkeypatch):
    from flexjit.api import prepare_call
    from flexjit.backends.cute_sm90 import backward_supports
    table = torch.randn(4, 33).requires_grad_(True)
    q = torch.randn(1, 4, 64, 128, dtype=torch.bfloat16)
    call = prepare_call(q, q, q, mods.relative_bias(table), None, None, False, None)
    monkeypatch.setenv("FLEXJIT_CUTE_BWD_GRADS", "0")
    ok, why = backward_supports(call)
    assert not ok and "FLEXJIT_CUTE_BWD_GRADS=0" in why
    monkeypatch.delenv("FLEXJIT_CUTE_BWD_GRADS")
    assert backward_supports(call)[0]
    # Without captured tensors needing grad, the sm90 backward serves as before.
    plain = prepare_call(q, q, q, mods.relative_bias(table.detach()), None, None, False, None)
    monkeypatch.setenv("FLEXJIT_CUTE_BWD_GRADS", "0")
    assert backward_supports(plain)[0]


def test_alibi_bias_is_cheap_per_score(tmp_path):
    # ALiBi = causal + slope[h]·(kv − q). Per score its bias must cost one FFMA: no int->float
    # conversion (they issue on the MUFU pipe beside exp2; passes.float_indices: 378 -> 10), and
    # no separate FADD + FMUL (kv_minus_q_parts: cute.fma(slope, offset, slope·base), slope·base
    # shared: mul.f32 484 -> 286 against causal's 283). Counts are over the whole kernel.
    causal, alibi = (_forward_ptx(n, tmp_path, 1, 4, 4, persistent=False) for n in ("causal", "alibi"))
    count = lambda ptx, op: len(re.findall(rf"\b{re.escape(op)}\b", ptx))  # noqa: E731
    assert count(alibi, "cvt.rn.f32.s32") <= 16
    for op in ("mul.f32", "add.f32"):
        assert count(alibi, op) <= count(causal, op) + 32, (op, count(alibi, op), count(causal, op))
    assert count(alibi, "fma.rn.f32") > count(causal, "fma.rn.f32") + 128  # the bias, per score
