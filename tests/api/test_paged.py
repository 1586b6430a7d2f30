"""flexjit.PagedAttention: bookkeeping, paged attention against dense attention on the logical K/V
(the float64 oracle, tests/oracle.py), and the errors.

The scenario: a pool whose pages are handed out interleaved between the batch entries (reserved in
rounds, one entry erased and its pages reused), entries of ragged lengths, caches initialised with
large garbage so that any read of a position an entry does not own shows in the output. Queries sit
at the end of each sequence (decode: 1-16 tokens) or cover it (prefill); the mods are written for
logical positions, the query offset per entry captured as a tensor, as a serving loop writes them.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import flexjit
from flexjit.api.paged import PagedAttention
from flexjit import create_block_mask
from flexjit.api.attention import flex_attention
from flexjit import mods
from flexjit.api.paged import OutOfPagesError
from oracle import FLOOR, assert_close_to_oracle, dense_attention, max_err

DEV = "cpu"


# --------------------------------------------------------------------------- scenario


class Scenario:
    """A filled pool: ``lens`` tokens per entry, logical K/V ``k``/``v`` (B, Hkv, S, D)."""

    def __init__(self, lens, page_size=32, n_pages=24, Hkv=2, D=16, dtype=torch.float64, seed=0,
                 rows=None, device=DEV, chunk=1):
        g = torch.Generator().manual_seed(seed)
        self.lens, self.B, self.S = list(lens), len(lens), max(lens)
        self.rows = list(range(self.B)) if rows is None else list(rows)
        self.device = torch.device(device)
        self.pa = PagedAttention(n_pages, page_size, max_batch_size=max(self.rows) + 2, device=device)
        pa = self.pa
        # A squatter takes pages between everyone's, then leaves: the pool is fragmented.
        squat = max(self.rows) + 1
        for step in range(1, self.S // page_size + 2):
            for r, n in zip(self.rows, self.lens):
                pa.reserve(r, min(n, step * page_size))
            if step == 1:
                pa.reserve(squat, page_size)
        pa.erase(squat)
        def randn(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        self.k, self.v = randn(self.B, Hkv, self.S, D), randn(self.B, Hkv, self.S, D)
        garbage = 1e3 * randn(1, Hkv, pa.kv_len, D)
        self.k_cache, self.v_cache = garbage, garbage.flip(2)
        # Prefill the first half of each sequence in one call, then the rest ``chunk`` tokens at a
        # time (chunk 1: the batch's decode steps, one assign for every entry still growing).
        half = [n // 2 for n in self.lens]
        for i, (r, n) in enumerate(zip(self.rows, self.lens)):
            pos = torch.arange(half[i], device=device).unsqueeze(0)
            pa.assign(torch.tensor([r]), pos, self.k[i:i + 1, :, :half[i]], self.v[i:i + 1, :, :half[i]],
                      self.k_cache, self.v_cache)
        if chunk == 1:
            for t in range(min(half), self.S):
                who = [i for i in range(self.B) if half[i] <= t < self.lens[i]]
                if who:
                    pa.assign(torch.tensor([self.rows[i] for i in who]),
                              torch.full((len(who), 1), t, device=device),
                              self.k[who, :, t:t + 1], self.v[who, :, t:t + 1], self.k_cache, self.v_cache)
        else:
            for i, (r, n) in enumerate(zip(self.rows, self.lens)):
                for t in range(half[i], n, chunk):
                    e = min(n, t + chunk)
                    pa.assign(torch.tensor([r]), torch.arange(t, e, device=device).unsqueeze(0),
                              self.k[i:i + 1, :, t:e], self.v[i:i + 1, :, t:e], self.k_cache, self.v_cache)

    def kv_len(self):
        return torch.tensor(self.lens, device=self.device)


def _logical_mods(name, sc: Scenario, q_off: torch.Tensor, Hq: int):
    """(score_mod, mask_mod) over logical positions; query i of entry b is at q_off[b] + i."""
    if name == "none":
        return None, None
    if name == "causal":
        def causal(b, h, q_idx, kv_idx):
            return q_idx + q_off[b] >= kv_idx
        return None, causal
    if name == "sliding_window":
        w = 21

        def window(b, h, q_idx, kv_idx):
            q = q_idx + q_off[b]
            return (q >= kv_idx) & (q - kv_idx <= w)
        return None, window
    if name == "alibi":
        slopes = mods.alibi_slopes(Hq).to(sc.device)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - (q_idx + q_off[b]))

        def causal(b, h, q_idx, kv_idx):
            return q_idx + q_off[b] >= kv_idx
        return alibi, causal
    if name == "document":
        g = torch.Generator().manual_seed(7)
        doc = torch.cumsum((torch.rand(sc.B, sc.S, generator=g) < 0.06).long(), 1).to(sc.device)

        def document(b, h, q_idx, kv_idx):
            q = q_idx + q_off[b]
            return (doc[b, q] == doc[b, kv_idx]) & (q >= kv_idx)
        return None, document
    raise KeyError(name)


MODS = ["none", "causal", "sliding_window", "alibi", "document"]


def _run(sc: Scenario, name: str, L: int, block=(16, 16), Hq=4, backend="reference", dtype=torch.float64,
         seed=1, decode=True, contiguous=False):
    """Paged attention vs the oracle on the logical K/V; returns the paged (block mask, out, lse).
    ``contiguous``: also run flex_attention on the logical K/V (per-entry, unpaged), which must meet
    the same bound and pick the same backend."""
    dev = sc.device
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sc.B, Hq, L, sc.k.shape[-1], generator=g, dtype=torch.float64).to(device=dev, dtype=dtype)
    q_off = torch.tensor([n - L for n in sc.lens] if decode else [0] * sc.B, device=dev)
    score_mod, mask_mod = _logical_mods(name, sc, q_off, Hq)
    lens = sc.kv_len()
    logical = create_block_mask(mask_mod or flexjit.noop_mask, sc.B, None, L, sc.S, device=dev,
                                BLOCK_SIZE=block)
    rows = None if sc.rows == list(range(sc.B)) else torch.tensor(sc.rows, device=dev)
    bm = sc.pa.convert_logical_block_mask(logical, batch_idx=rows, kv_len=lens)
    paged_score = sc.pa.get_score_mod(score_mod, kv_len=lens, batch_idx=rows) if score_mod else None
    args = dict(enable_gqa=True, backend=backend)
    out, lse = flex_attention(q, sc.k_cache, sc.v_cache, score_mod=paged_score, block_mask=bm,
                              return_lse=True, **args)

    def live(b, h, q_idx, kv_idx):
        keep = kv_idx < lens[b]
        return keep if mask_mod is None else keep & mask_mod(b, h, q_idx, kv_idx)
    ref, ref_lse = dense_attention(q, sc.k, sc.v, score_mod, live)
    low, low_lse = dense_attention(q, sc.k, sc.v, score_mod, live, dtype=dtype)
    assert_close_to_oracle("out", out, ref, low, FLOOR[dtype])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[dtype])
    if contiguous:
        dense_bm = create_block_mask(live, sc.B, None, L, sc.S, device=dev, BLOCK_SIZE=block)
        c_out, c_lse = flex_attention(q, sc.k, sc.v, score_mod=score_mod, block_mask=dense_bm,
                                      return_lse=True, **args)
        assert_close_to_oracle("contiguous out", c_out, ref, low, FLOOR[dtype])
        assert_close_to_oracle("contiguous lse", c_lse, ref_lse, low_lse, FLOOR[dtype])
        paged_choice = flexjit.explain(q, sc.k_cache, sc.v_cache, score_mod=paged_score, block_mask=bm, **args)
        dense_choice = flexjit.explain(q, sc.k, sc.v, score_mod=score_mod, block_mask=dense_bm, **args)
        assert paged_choice.name == dense_choice.name, f"paged: {paged_choice}\ncontiguous: {dense_choice}"
    return bm, out, lse


# --------------------------------------------------------------------------- bookkeeping


def _owned(pa, row):
    return [int(p) for p in pa.page_table[row] if p >= 0]


def test_reserve_assign_erase_bookkeeping():
    pa = PagedAttention(n_pages=8, page_size=16, max_batch_size=3, device=DEV)
    pa.reserve(0, 20)                       # 2 pages
    pa.reserve(torch.tensor([1]), torch.tensor([16]))  # torch's shape-(1,) tensors: 1 page
    pa.reserve(0, 32)                       # already enough: no-op
    pa.reserve(0, 33)                       # a third page
    assert pa.capacity.tolist() == [48, 16, 0] and len(pa.empty_pages) == 4
    assert pa.reserved(0) == 48 and pa.reserved(2) == 0
    for row in (0, 1):
        pages = _owned(pa, row)
        assert pa.physical_to_logical[row, pages].tolist() == list(range(len(pages)))
        assert (pa.physical_to_logical[row] >= 0).sum() == len(pages)
    assert not set(_owned(pa, 0)) & set(_owned(pa, 1)) and not set(_owned(pa, 0)) & set(pa.empty_pages)

    # assign writes each token at page_table[row, pos // 16] * 16 + pos % 16.
    kc = torch.zeros(1, 2, 128, 4)
    vc = torch.zeros(1, 2, 128, 3)
    k = torch.randn(2, 2, 5, 4)
    v = torch.randn(2, 2, 5, 3)
    pos = torch.tensor([[0, 15, 16, 40, 47], [1, 2, 3, 4, 15]])
    pa.assign(torch.tensor([0, 1]), pos, k, v, kc, vc)
    for i, row in enumerate((0, 1)):
        for j, p in enumerate(pos[i].tolist()):
            addr = int(pa.page_table[row, p // 16]) * 16 + p % 16
            assert torch.equal(kc[0, :, addr], k[i, :, j]) and torch.equal(vc[0, :, addr], v[i, :, j])
    assert int((kc != 0).any(-1).sum()) == 2 * 10  # nothing else written

    freed = set(_owned(pa, 0))
    pa.erase(0)
    pa.erase(0)                             # erasing an empty entry is a no-op
    assert pa.capacity.tolist() == [0, 16, 0] and len(pa.empty_pages) == 7
    assert (pa.page_table[0] == -1).all() and (pa.physical_to_logical[0] == -1).all()
    pa.reserve(2, 7 * 16)                   # every free page, the freed ones included
    assert set(_owned(pa, 2)) == set(range(8)) - set(_owned(pa, 1)) and freed <= set(_owned(pa, 2))
    assert pa.physical_to_logical[2, _owned(pa, 2)].tolist() == list(range(7))


def test_scenario_cache_holds_logical_kv():
    """Gathering every entry's pages back gives the logical K/V that was assigned."""
    sc = Scenario([70, 33, 96])
    for i, (r, n) in enumerate(zip(sc.rows, sc.lens)):
        pos = torch.arange(n)
        addr = sc.pa.page_table[r, pos // sc.pa.page_size] * sc.pa.page_size + pos % sc.pa.page_size
        assert torch.equal(sc.k_cache[0][:, addr], sc.k[i, :, :n])
        assert torch.equal(sc.v_cache[0][:, addr], sc.v[i, :, :n])
    # Interleaved: no entry got one contiguous run of pages.
    assert any(sorted(_owned(sc.pa, r)) != list(range(min(_owned(sc.pa, r)), max(_owned(sc.pa, r)) + 1))
               for r in sc.rows)


# --------------------------------------------------------------------------- numerics (reference)


@pytest.mark.parametrize("name", MODS)
@pytest.mark.parametrize("L", [1, 5, 16])
def test_decode_matches_dense(name, L):
    _run(Scenario([70, 33, 96]), name, L)


@pytest.mark.parametrize("name", MODS)
def test_prefill_matches_dense(name):
    _run(Scenario([70, 33, 96]), name, 96, decode=False)


@pytest.mark.parametrize("name", ["causal", "alibi", "document"])
def test_page_holds_several_kv_blocks(name):
    """page_size 64 over 16-wide KV blocks: four blocks per page; Q blocks of 32."""
    _run(Scenario([150, 40, 97], page_size=64, n_pages=12), name, 7, block=(32, 16))
    _run(Scenario([150, 40, 97], page_size=64, n_pages=12), name, 150, block=(32, 16), decode=False)


def test_batch_idx_maps_to_page_table_rows():
    """The call's batch entries live in page-table rows 3, 0, 5: masks and scores follow them."""
    sc = Scenario([70, 33, 96], rows=[3, 0, 5])
    for name in ("causal", "alibi", "document"):
        _run(sc, name, 4)


def test_converted_lists_only_name_owned_pages_and_demote_ragged_full_blocks():
    sc = Scenario([70, 33, 96])
    bm, _, _ = _run(sc, "none", 3)
    ps, bkv = sc.pa.page_size, bm.BLOCK_SIZE[1]
    for i, (r, n) in enumerate(zip(sc.rows, sc.lens)):
        owned = {p * (ps // bkv) + j for p in _owned(sc.pa, r)[: -(-n // ps)] for j in range(ps // bkv)}
        part = bm.kv_indices[i, 0, 0, : bm.kv_num_blocks[i, 0, 0]].tolist()
        full = bm.full_kv_indices[i, 0, 0, : bm.full_kv_num_blocks[i, 0, 0]].tolist()
        assert set(part) | set(full) <= owned
        # Exactly the blocks holding live tokens; the one cut by kv_len is partial.
        assert len(part) + len(full) == -(-n // bkv) and len(part) == (1 if n % bkv else 0)


def test_torch_block_mask_is_accepted():
    from torch.nn.attention import flex_attention as tfa
    sc = Scenario([70, 33, 96])
    lens = sc.kv_len()
    q_off = torch.tensor([n - 2 for n in sc.lens])

    def causal(b, h, q_idx, kv_idx):
        return q_idx + q_off[b] >= kv_idx
    logical = tfa.create_block_mask(causal, sc.B, None, 2, sc.S, device="cpu", BLOCK_SIZE=16)
    bm = sc.pa.convert_logical_block_mask(logical, kv_len=lens)
    q = torch.randn(sc.B, 2, 2, 16, dtype=torch.float64)
    out = flex_attention(q, sc.k_cache, sc.v_cache, block_mask=bm, backend="reference")
    ref, _ = dense_attention(q, sc.k, sc.v, None, lambda b, h, qi, ki: causal(b, h, qi, ki) & (ki < lens[b]))
    assert max_err(out, ref) <= 1e-12


def test_without_kv_len_the_mask_must_fit_the_reservation():
    """No kv_len: every reserved position counts; the mask's KV_LEN bounds the rest."""
    pa = PagedAttention(n_pages=6, page_size=16, max_batch_size=2, device=DEV)
    pa.reserve(1, 40)                       # 48 tokens reserved in row 1 only
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 40, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, 40, 16, generator=g, dtype=torch.float64)
    kc = 1e3 * torch.randn(1, 1, 96, 16, generator=g, dtype=torch.float64)
    vc = kc.clone()
    pa.assign(torch.tensor([1]), torch.arange(40)[None], k, v, kc, vc)
    q = torch.randn(1, 1, 3, 16, generator=g, dtype=torch.float64)
    logical = create_block_mask(flexjit.noop_mask, 1, None, 3, 40, device=DEV, BLOCK_SIZE=16)
    bm = pa.convert_logical_block_mask(logical, batch_idx=torch.tensor([1]))
    out = flex_attention(q, kc, vc, block_mask=bm, backend="reference")
    ref, _ = dense_attention(q, k, v)
    assert max_err(out, ref) <= 1e-12
    too_long = create_block_mask(flexjit.noop_mask, 1, None, 3, 64, device=DEV, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="past its reserved capacity of 48"):
        pa.convert_logical_block_mask(too_long, batch_idx=torch.tensor([1]))


def test_a_converted_mask_warns_as_its_stale_logical_mask():
    # The physical mask keeps the logical one's planning record: document ids edited in place
    # after planning warn through it too. 40 tokens in pages of 16: three pages, ragged.
    pa = PagedAttention(n_pages=6, page_size=16, max_batch_size=2, device=DEV)
    pa.reserve(1, 40)
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(1, 1, 40, 16, generator=g, dtype=torch.float64) for _ in range(2))
    kc, vc = (1e3 * torch.randn(1, 1, 96, 16, generator=g, dtype=torch.float64) for _ in range(2))
    pa.assign(torch.tensor([1]), torch.arange(40)[None], k, v, kc, vc)
    q = torch.randn(1, 1, 40, 16, generator=g, dtype=torch.float64)
    doc_ids = torch.tensor([0] * 20 + [1] * 20)
    logical = create_block_mask(mods.document(doc_ids), 1, None, 40, 40, device=DEV, BLOCK_SIZE=16)
    bm = pa.convert_logical_block_mask(logical, batch_idx=torch.tensor([1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", flexjit.StaleBlockMaskWarning)
        out = flex_attention(q, kc, vc, block_mask=bm, backend="reference")
    assert max_err(out, dense_attention(q, k, v, mask_mod=mods.document(doc_ids))[0]) <= 1e-12
    doc_ids[:10] = 1
    with pytest.warns(flexjit.StaleBlockMaskWarning, match="`doc_ids`"):
        flex_attention(q, kc, vc, block_mask=bm, backend="reference")


# --------------------------------------------------------------------------- Triton (interpreter)


def _triton_interpreter_ok() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9)


@pytest.mark.skipif(not _triton_interpreter_ok(), reason="needs triton >= 3.9's interpreter")
@pytest.mark.parametrize("name,L,decode", [("none", 1, True), ("causal", 3, True), ("sliding_window", 8, True),
                                           ("alibi", 16, True), ("document", 5, True), ("causal", 48, False),
                                           ("document", 48, False)])
def test_triton_interpreter_matches_dense(monkeypatch, tmp_path, name, L, decode):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path))
    sc = Scenario([40, 21, 48], page_size=16, n_pages=10, dtype=torch.float32)
    _run(sc, name, L, backend="triton", dtype=torch.float32, decode=decode)


# --------------------------------------------------------------------------- errors


def test_constructor_errors():
    with pytest.raises(ValueError, match="n_pages must be a positive int"):
        PagedAttention(0, 16, 1, device=DEV)
    with pytest.raises(ValueError, match="multiple of 16"):
        PagedAttention(4, 24, 1, device=DEV)


def test_reserve_errors():
    pa = PagedAttention(n_pages=4, page_size=16, max_batch_size=2, device=DEV)
    with pytest.raises(OutOfPagesError, match="needs 5 more page.*only 4 of 4 are free"):
        pa.reserve(0, 65)
    assert pa.capacity.tolist() == [0, 0] and len(pa.empty_pages) == 4  # nothing half-done
    with pytest.raises(IndexError, match="out of range for max_batch_size=2"):
        pa.reserve(2, 1)
    with pytest.raises(ValueError, match="seq_len must be >= 0"):
        pa.reserve(0, -1)
    with pytest.raises(TypeError, match="one-element integer tensor"):
        pa.reserve(torch.tensor([0, 1]), 4)
    with pytest.raises(TypeError, match="one-element integer tensor"):
        pa.reserve(0, 4.0)


def _assign_setup():
    pa = PagedAttention(n_pages=4, page_size=16, max_batch_size=3, device=DEV)
    pa.reserve(0, 20)
    kc, vc = torch.zeros(1, 2, 64, 8), torch.zeros(1, 2, 64, 8)
    return pa, kc, vc, torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)


@pytest.mark.parametrize("bad,exc,match", [
    (dict(batch_idx=torch.tensor([1])), ValueError, r"batch entry 1 has no reservation; call reserve\(1"),
    (dict(batch_idx=torch.tensor([3])), IndexError, "out of range"),
    (dict(batch_idx=torch.tensor([0, 0])), ValueError, "batch_idx has 2 entries but k_val has batch 1"),
    (dict(input_pos=torch.tensor([[30, 31, 32]])), ValueError,
     r"input_pos\[0, 2\] = 32 is outside batch entry 0's reserved capacity of 32.*reserve\(0, 33\)"),
    (dict(input_pos=torch.tensor([[-1, 0, 1]])), ValueError, "outside batch entry 0's reserved capacity"),
    (dict(input_pos=torch.tensor([[0, 1]])), ValueError, r"input_pos must have shape \(B, S\)"),
    (dict(input_pos=torch.tensor([[0.0, 1.0, 2.0]])), TypeError, "input_pos must hold integers"),
    (dict(k_val=torch.randn(1, 2, 3, 8, dtype=torch.float64)), TypeError, "k_cache is torch.float32 but"),
    (dict(k_val=torch.randn(1, 3, 3, 8)), ValueError, "must agree in"),
    (dict(k_cache=torch.zeros(1, 2, 60, 8)), ValueError, r"k_cache must have shape \(1, 2, 64, 8\)"),
    (dict(v_cache=torch.zeros(2, 2, 64, 8)), ValueError, r"v_cache must have shape"),
    (dict(k_val=torch.randn(2, 3, 8)), ValueError, "k_val must be 4-D"),
    (dict(v_val=torch.randn(1, 2, 3, 8, requires_grad=True)), ValueError, "must not require grad"),
])
def test_assign_errors(bad, exc, match):
    pa, kc, vc, k, v = _assign_setup()
    args = dict(batch_idx=torch.tensor([0]), input_pos=torch.tensor([[0, 1, 2]]), k_val=k, v_val=v,
                k_cache=kc, v_cache=vc)
    args.update(bad)
    with pytest.raises(exc, match=match):
        pa.assign(**args)
    assert not kc.any() and not vc.any()  # nothing written


def test_convert_errors():
    pa = PagedAttention(n_pages=4, page_size=32, max_batch_size=3, device=DEV)
    pa.reserve(0, 40)
    bm = create_block_mask(mods.causal(), 1, None, 64, 64, device=DEV, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match=r"page_size 32 must be a multiple of the block mask's KV block size 64"):
        pa.convert_logical_block_mask(create_block_mask(mods.causal(), 1, None, 64, 64, device=DEV,
                                                        BLOCK_SIZE=64))
    with pytest.raises(ValueError, match="batch entry 1 has no reservation"):
        pa.convert_logical_block_mask(bm, batch_idx=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"kv_len\[0\] = 65 is outside batch entry 0's reserved capacity of 64"):
        pa.convert_logical_block_mask(bm, kv_len=torch.tensor([65]))
    with pytest.raises(ValueError, match="kv_len has 2 entries but the batch has 1"):
        pa.convert_logical_block_mask(bm, kv_len=torch.tensor([3, 4]))
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        pa.convert_logical_block_mask("causal")
    pa.reserve(1, 10)
    bm2 = create_block_mask(mods.causal(), 2, None, 64, 64, device=DEV, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="block_mask has batch 2 but batch_idx has 3 entries"):
        pa.convert_logical_block_mask(bm2, batch_idx=torch.tensor([0, 1, 0]))
    # A block mask of batch 1 planned for B=None broadcasts to every entry of batch_idx.
    out = pa.convert_logical_block_mask(bm, batch_idx=torch.tensor([0, 1]), kv_len=torch.tensor([40, 10]))
    assert out.kv_num_blocks.shape[0] == 2 and out.seq_lengths == (64, 128)
    # ... unless its mask_mod reads b: it was planned for b = 0 only.
    prefix = torch.tensor([3, 9])
    per_batch = create_block_mask(mods.prefix_lm(prefix), None, None, 64, 64, device=DEV, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="depends on the batch index b.*create it with B=2"):
        pa.convert_logical_block_mask(per_batch, batch_idx=torch.tensor([0, 1]), kv_len=torch.tensor([40, 10]))


def test_paged_mask_on_the_logical_cache_length_is_refused_by_flex_attention():
    """The converted mask is over n_pages * page_size keys: passing a cache of another length is
    flex_attention's clear error, not a silent read."""
    sc = Scenario([40, 21], page_size=16, n_pages=8)
    bm = sc.pa.convert_logical_block_mask(
        create_block_mask(mods.causal(), 2, None, 4, 40, device=DEV, BLOCK_SIZE=16), kv_len=sc.kv_len())
    q = torch.randn(2, 2, 4, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="block_mask was created for"):
        flex_attention(q, sc.k, sc.v, block_mask=bm)


def test_decode_loop_with_kv_len_updated_in_place():
    """A serving loop: the score_mod is made once over a kv_len tensor that grows in place; each
    step plans the logical block mask (its blocks move with q_off) and converts it again."""
    sc = Scenario([40, 21, 33], page_size=16, n_pages=12)
    pa, lens = sc.pa, torch.tensor([30, 11, 23])
    Hq, steps = 4, 10
    slopes = mods.alibi_slopes(Hq)
    q_off = lens - 1                          # the one query sits at the last live position

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - (q_idx + q_off[b]))

    def causal(b, h, q_idx, kv_idx):
        return q_idx + q_off[b] >= kv_idx
    paged_score = pa.get_score_mod(alibi, kv_len=lens)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        lens += 1                             # the step's token is already in the cache
        q_off += 1
        q = torch.randn(sc.B, Hq, 1, 16, generator=g, dtype=torch.float64)
        logical = create_block_mask(causal, sc.B, None, 1, sc.S, device=DEV, BLOCK_SIZE=16)
        bm = pa.convert_logical_block_mask(logical, kv_len=lens)
        out = flex_attention(q, sc.k_cache, sc.v_cache, score_mod=paged_score, block_mask=bm,
                             enable_gqa=True, backend="reference")
        ref, _ = dense_attention(q, sc.k, sc.v, alibi,
                                 lambda b, h, qi, ki: causal(b, h, qi, ki) & (ki < lens[b]))
        assert max_err(out, ref) <= 1e-12


# --------------------------------------------------------------------------- sm90 (compile only)


def test_sm90_forward_compiles_the_paged_mods(monkeypatch, tmp_path):
    """The wrapped mods (the 2-D int32 page lookup, clamps, live checks; ALiBi's score wrapper is
    the heaviest) render into the sm90 forward and compile for sm_90a on the Hopper path
    (numerics: tests/api/test_paged_gpu.py). Not asserted: spills. ptxas reports 324 B of spill stores
    for this kernel (40 B with the plain ALiBi score_mod under the same paged mask): the sm90 holes
    compute the per-column page lookup for every score element (see DESIGN, paged KV cache)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    pytest.importorskip("cutlass")
    from flexjit.api.attention import _broadcast_batch, prepare_call
    from flexjit.backends.cute.sm90 import _aux_tensor, block_sparse_args, compile_program
    sc = Scenario([300, 129, 400], page_size=128, n_pages=12, D=128, dtype=torch.bfloat16)
    q = torch.randn(sc.B, 4, 16, 128, dtype=torch.bfloat16)
    q_off = torch.tensor([n - 16 for n in sc.lens])
    score_mod, mask_mod = _logical_mods("alibi", sc, q_off, 4)
    logical = create_block_mask(mask_mod, sc.B, None, 16, sc.S, device=DEV)
    bm = sc.pa.convert_logical_block_mask(logical, kv_len=sc.kv_len())
    paged_score = sc.pa.get_score_mod(score_mod, kv_len=sc.kv_len())
    k, v = _broadcast_batch(q, sc.k_cache, sc.v_cache)  # as flex_attention passes a kv batch of 1
    call = prepare_call(q, k, v, paged_score, bm, None, True, None)
    aux = tuple(_aux_tensor(t, q.device) for t in call.program.buffers)
    fn = compile_program(call.program, q, k, v, block_sparse_args(bm), aux,
                         options=f"--keep-ptx --dump-dir {tmp_path}")
    ptx = fn.compiled.__ptx__
    assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx and "cp.async.bulk.tensor" in ptx


def test_block_mask_without_full_lists():
    """A logical mask listing every block as partial (separate_full_blocks=False) converts to one
    without full lists."""
    sc = Scenario([70, 33, 96])
    lens = sc.kv_len()
    q_off = torch.tensor([n - 4 for n in sc.lens])

    def window(b, h, q_idx, kv_idx):
        q = q_idx + q_off[b]
        return (q >= kv_idx) & (q - kv_idx <= 40)
    logical = create_block_mask(window, sc.B, None, 4, sc.S, device=DEV, BLOCK_SIZE=16,
                                separate_full_blocks=False)
    bm = sc.pa.convert_logical_block_mask(logical, kv_len=lens)
    assert bm.full_kv_num_blocks is None
    q = torch.randn(sc.B, 2, 4, 16, dtype=torch.float64)
    out = flex_attention(q, sc.k_cache, sc.v_cache, block_mask=bm, backend="reference")
    ref, _ = dense_attention(q, sc.k, sc.v, None, lambda b, h, qi, ki: window(b, h, qi, ki) & (ki < lens[b]))
    assert max_err(out, ref) <= 1e-12
