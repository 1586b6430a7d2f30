"""PagedAttention on the GPU: paged against contiguous attention for the default backend (cute on
Hopper, with 128-wide KV blocks) and for Triton, both against the float64 oracle.

The scenario is tests/api/test_paged.py's: a fragmented pool, garbage-filled caches, entries of ragged
lengths (one shorter than a page, one a page plus one token), GQA 8/2, head dim 128, bf16. Decode
(1 and 16 query tokens at the end of each sequence) and prefill. Each mod compiles once per
backend (paged and contiguous mods are different programs): about 2 minutes cold on the H200.

On Hopper a paged prefill and a paged training step run the sm90 kernels on the caches' batch
broadcast (``kv_batch_broadcast``: K/V loaded at batch 0); the tests assert those kernels ran
(``passes_run``) and check the caches' gradients (summed over the batch by autograd) against the
oracle's gradients of the logical K/V, placed at each token's page.
"""
import pytest
import torch

import flexjit
from flexjit.backends.cute import sm90 as cute_sm90
from oracle import FLOOR, assert_close_to_oracle, dense_attention
from test_paged import MODS, Scenario, _logical_mods, _run

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

LENS = [1000, 129, 2048, 77]
HOPPER = torch.cuda.get_device_capability() == (9, 0)


def _scenario(page_size: int) -> Scenario:
    pages = sum(-(-n // page_size) for n in LENS) + 3
    return Scenario(LENS, page_size=page_size, n_pages=pages, Hkv=2, D=128, dtype=torch.bfloat16,
                    device="cuda", chunk=97)


@pytest.fixture(scope="module")
def pool128():
    return _scenario(128)


@pytest.fixture(scope="module")
def pool256():
    return _scenario(256)


@pytest.mark.parametrize("L", [1, 16])
@pytest.mark.parametrize("name", MODS)
def test_decode_default_backend(pool128, name, L):
    _run(pool128, name, L, block=(128, 128), Hq=8, backend="auto", dtype=torch.bfloat16, contiguous=True)


@pytest.mark.parametrize("name", MODS)
def test_prefill_default_backend(pool128, name, passes_run):
    _run(pool128, name, max(LENS), block=(128, 128), Hq=8, backend="auto", dtype=torch.bfloat16,
         decode=False, contiguous=True)
    if HOPPER:  # the paged call (K/V broadcast) and the contiguous one, both on the sm90 kernel
        ran = [(p, n, cute_sm90.kv_broadcast(c)) for p, n, c in passes_run]
        assert ran == [("fwd", "cute", True), ("fwd", "cute", False)], ran


@pytest.mark.parametrize("name", ["causal", "alibi", "document"])
def test_two_blocks_per_page(pool256, name):
    _run(pool256, name, 16, block=(128, 128), Hq=8, backend="auto", dtype=torch.bfloat16, contiguous=True)


@pytest.mark.parametrize("name", ["none", "causal", "sliding_window", "alibi", "document"])
def test_decode_triton(pool128, name):
    _run(pool128, name, 16, block=(128, 128), Hq=8, backend="triton", dtype=torch.bfloat16, contiguous=True)


@pytest.mark.skipif(not HOPPER, reason="the sm90 backend needs Hopper")
def test_default_backend_on_hopper_is_cute(pool128):
    """The paged call runs on the sm90 kernel when it trains, not a fallback; without gradients
    this decode-shaped call (Q_LEN 16) runs the split-KV decode kernel (Triton) instead."""
    import flexjit
    from test_paged import _logical_mods
    sc = pool128
    q = torch.randn(sc.B, 8, 16, 128, device="cuda", dtype=torch.bfloat16)
    q_off = torch.tensor([n - 16 for n in sc.lens], device="cuda")
    _, causal = _logical_mods("causal", sc, q_off, 8)
    logical = flexjit.create_block_mask(causal, sc.B, None, 16, sc.S, device="cuda")
    bm = sc.pa.convert_logical_block_mask(logical, kv_len=sc.kv_len())
    choice = flexjit.explain(q, sc.k_cache, sc.v_cache, block_mask=bm, enable_gqa=True)
    assert choice.name == "triton" and "split-KV decode kernel" in choice.reason, str(choice)
    choice = flexjit.explain(q.requires_grad_(), sc.k_cache, sc.v_cache, block_mask=bm, enable_gqa=True)
    assert choice.name == "cute" and choice.backward == "cute", str(choice)
    assert "batch broadcast" in choice.reason, str(choice)


def _cache_grad(sc: Scenario, g_logical: torch.Tensor) -> torch.Tensor:
    """A gradient of the logical K/V (B, Hkv, S, D) placed in the cache (1, Hkv, N, D): token t
    of entry i lives at page_table[row, t // page_size] * page_size + t % page_size."""
    out = torch.zeros(1, *g_logical.shape[1:2], sc.k_cache.shape[2], g_logical.shape[-1],
                      dtype=g_logical.dtype, device=g_logical.device)
    ps = sc.pa.page_size
    for i, (r, n) in enumerate(zip(sc.rows, sc.lens)):
        t = torch.arange(n, device=g_logical.device)
        addr = sc.pa.page_table[r].to(g_logical.device)[t // ps] * ps + t % ps
        out[0, :, addr] += g_logical[i, :, :n]
    return out


@pytest.mark.skipif(not HOPPER, reason="the sm90 backend needs Hopper")
@pytest.mark.parametrize("name", ["causal", "alibi", "document"])
def test_paged_training_on_hopper(pool128, name, passes_run):
    """A prefill training step on the paged caches: the sm90 forward and backward ran on the
    broadcast caches, and dq plus the caches' gradients (zero wherever no live token is: the
    garbage around each entry's pages) match the oracle on the logical K/V."""
    sc, Hq, L = pool128, 8, max(LENS)
    g = torch.Generator(device="cuda").manual_seed(11)
    bf = torch.bfloat16
    q = torch.randn(sc.B, Hq, L, 128, generator=g, device="cuda").to(bf).requires_grad_(True)
    dout = torch.randn(sc.B, Hq, L, 128, generator=g, device="cuda").to(bf)
    dlse = torch.randn(sc.B, Hq, L, generator=g, device="cuda")
    score_mod, mask_mod = _logical_mods(name, sc, torch.zeros(sc.B, dtype=torch.long, device="cuda"), Hq)
    lens = sc.kv_len()
    logical = flexjit.create_block_mask(mask_mod or flexjit.noop_mask, sc.B, None, L, sc.S, device="cuda")
    bm = sc.pa.convert_logical_block_mask(logical, kv_len=lens)
    paged_score = sc.pa.get_score_mod(score_mod, kv_len=lens) if score_mod else None
    kc, vc = [t.clone().requires_grad_(True) for t in (sc.k_cache, sc.v_cache)]

    def loss(out, lse):
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        return (out.double() * dout.double()).sum() + (lse.double() * dlse.double()).sum()

    out, lse = flexjit.flex_attention(q, kc, vc, score_mod=paged_score, block_mask=bm, enable_gqa=True,
                                      return_lse=True)
    got = (out, lse, *torch.autograd.grad(loss(out, lse), (q, kc, vc)))
    ran = [(p, n, cute_sm90.kv_broadcast(c)) for p, n, c in passes_run]
    assert ran == [("fwd", "cute", True), ("bwd", "cute", True)], ran

    def live(b, h, q_idx, kv_idx):
        keep = kv_idx < lens[b]
        return keep if mask_mod is None else keep & mask_mod(b, h, q_idx, kv_idx)

    def oracle(dtype):
        qq, kk, vv = [t.detach().to(dtype).requires_grad_(True) for t in (q, sc.k, sc.v)]
        o, s = dense_attention(qq, kk, vv, score_mod, live, dtype=dtype)
        dq, dk, dv = torch.autograd.grad(loss(o, s), (qq, kk, vv))
        return o.detach(), s.detach(), dq, _cache_grad(sc, dk), _cache_grad(sc, dv)
    want, low = oracle(torch.float64), oracle(bf)
    for label, a, b, c in zip(("out", "lse", "dq", "dk_cache", "dv_cache"), got, want, low):
        assert a.shape == b.shape, (label, a.shape, b.shape)
        floor = FLOOR[bf] * (1.0 if label in ("out", "lse") else max(1.0, b.abs().max().item()))
        assert_close_to_oracle(f"paged {name} {label}", a.to(b.dtype), b, c.to(b.dtype), floor)
