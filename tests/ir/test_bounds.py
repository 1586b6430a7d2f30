"""Index bounds of captured tensors (``ir.bounds``): out of range raises, in range runs.

A mod indexing a captured tensor out of range anywhere in the call's grid raises ``IndexError``
on every backend, as eager torch does for the same mod on broadcast index tensors, naming the
mod, the tensor, the dim and the index's range; a kernel never answers with a clamped read.
In range (negative indices counting from the end), values match the float64 oracle on the
reference backend and on the Triton kernels under the interpreter. Which of the three steps
decides is checked too: a proof by intervals reads no tensor, and is remembered.

Shapes: 48 queries against 80 keys, ragged against the Triton tests' 32-blocks; D = 16 keeps
the interpreter's cases to about a second.
"""
import pytest
import torch

from flexjit import create_block_mask, flex_attention
from flexjit.ir import bounds
from oracle import FLOOR, assert_close_to_oracle, dense_attention, random_qkv

B, H, L, S, D = 1, 2, 48, 80, 16


def _triton_ok() -> bool:
    import triton
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9)


BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not _triton_ok(), reason="the interpreter tests need triton >= 3.9"))]


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLEXJIT_POISON", "1")
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path))


def _qkv(seed=0):
    return random_qkv(B, H, H, L, S, D, D, torch.float32, seed)


def _eager_torch_raises(mod, mask=False):
    """Whether the mod, run by torch on broadcast index tensors, raises IndexError."""
    s = torch.randn(B, H, L, S)
    idx = (torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1),
           torch.arange(L).view(1, 1, -1, 1), torch.arange(S).view(1, 1, 1, -1))
    try:
        mod(*idx) if mask else mod(s, *idx)
    except IndexError:
        return True
    return False


def _matches_oracle(backend, score_mod=None, mask_mod=None):
    q, k, v = _qkv()
    bm = create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=32) if mask_mod else None
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True,
                              backend=backend)
    ref, ref_lse = dense_attention(q, k, v, score_mod, mask_mod, dtype=torch.float64)
    low, low_lse = dense_attention(q, k, v, score_mod, mask_mod, dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.float32])


# ------------------------------------------------------------------------- out of range raises

def _short_table():
    table = torch.randn(S - 1)

    def short_bias(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]
    return short_bias


def _too_negative():
    table = torch.randn(S)

    def from_the_end(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx - S - 1]  # -S - 1 .. -2: one past the front
    return from_the_end


def _bias_3d():
    bias = torch.randn(H, L, S - 2)

    def full_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]
    return full_bias


def _rows_2d():
    pos = torch.randn(L - 1, 3)  # one query short

    def distance(score, b, h, q_idx, kv_idx):
        return score - (pos[q_idx] - pos[kv_idx % (L - 1)]).abs().sum(-1)
    return distance


def _untaken_branch():
    table = torch.randn(40)

    def guarded(score, b, h, q_idx, kv_idx):
        # torch evaluates both branches of a where: the read past 39 raises there too
        return torch.where(kv_idx < 40, score + table[kv_idx], score)
    return guarded


def _through_contents():
    offsets = torch.randn(4)
    doc = torch.randint(0, 4, (S,))
    doc[57] = 4  # one document id past the table

    def by_document(score, b, h, q_idx, kv_idx):
        return score + offsets[doc[kv_idx]]
    return by_document


OUT_OF_RANGE = {  # name -> (mod, the message's range and dim)
    "short_table": (_short_table, r"tensor #0 of shape \(79,\) with values in \[0, 79\] along dim 0"),
    "too_negative": (_too_negative, r"tensor #0 of shape \(80,\) with values in \[-81, -2\] along dim 0: index -81"),
    "bias_3d": (_bias_3d, r"tensor #0 of shape \(2, 48, 78\) with values in \[0, 79\] along dim 2"),
    "rows_2d": (_rows_2d, r"tensor #0 of shape \(47, 3\) with values in \[0, 47\] along dim 0"),
    "untaken_branch": (_untaken_branch, r"tensor #0 of shape \(40,\) with values in \[0, 79\] along dim 0: index 79"),
    "through_contents": (_through_contents, r"tensor #1 of shape \(4,\) with values in \[0, 4\]"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OUT_OF_RANGE)
def test_an_index_out_of_range_raises_like_torch(name, backend):
    make, where = OUT_OF_RANGE[name]
    mod = make()
    assert _eager_torch_raises(mod)
    q, k, v = _qkv()
    with pytest.raises(IndexError, match=f"score_mod `{mod.__name__}` indexes captured " + where):
        flex_attention(q, k, v, score_mod=mod, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mask_mod_out_of_range_raises(backend):
    doc = torch.arange(S - 1) // 20

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    assert _eager_torch_raises(same_doc, mask=True)
    with pytest.raises(IndexError, match=r"mask_mod `same_doc` indexes .* values in \[0, 79\]"):
        create_block_mask(same_doc, B, H, L, S, device="cpu", BLOCK_SIZE=32)
    q, k, v = _qkv()
    # A block mask planned for the valid prefix only: the call itself must still refuse.
    bm = create_block_mask(lambda b, h, qi, ki: qi >= 0, B, H, L, S, device="cpu", BLOCK_SIZE=32)
    bm.mask_mod = same_doc
    with pytest.raises(IndexError, match=r"mask_mod `same_doc` indexes captured tensor #0 of shape \(79,\)"):
        flex_attention(q, k, v, block_mask=bm, backend=backend)


def test_a_new_scalar_value_is_checked_again():
    table = torch.randn(S)
    shift = 0

    def shifted(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx + shift]
    q, k, v = _qkv()
    flex_attention(q, k, v, score_mod=shifted, backend="reference")
    shift = 1  # the same compiled program, a new runtime scalar
    with pytest.raises(IndexError, match=r"values in \[1, 80\]"):
        flex_attention(q, k, v, score_mod=shifted, backend="reference")


def test_an_index_computed_from_the_score_must_be_clamped():
    table = torch.randn(4)

    def by_score(score, b, h, q_idx, kv_idx):
        return score + table[(score * 10).long()]
    q, k, v = _qkv()
    with pytest.raises(IndexError, match="computed from the score.*clamp"):
        flex_attention(q, k, v, score_mod=by_score, backend="reference")

    def clamped(score, b, h, q_idx, kv_idx):
        return score + table[(score * 10).long().clamp(0, 3)]
    flex_attention(q, k, v, score_mod=clamped, backend="reference")


# ------------------------------------------------------------------------- in range runs

def _negative_indices():
    table = torch.randn(S)

    def from_the_end(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx - S]  # -S .. -1: torch wraps them onto 0 .. S - 1
    return from_the_end


def _negative_2d():
    rel = torch.randn(H, L + S)

    def relative(score, b, h, q_idx, kv_idx):
        return score + rel[h - H, kv_idx - q_idx]  # kv - q < 0 counts from the end
    return relative


def _contents_in_range():
    offsets = torch.randn(4)
    doc = torch.randint(0, 4, (S,))

    def by_document(score, b, h, q_idx, kv_idx):
        return score + offsets[doc[kv_idx]]
    return by_document


def _loose_intervals():
    table = torch.randn(2)

    def parity(score, b, h, q_idx, kv_idx):
        # intervals bound kv - 2 * (kv // 2) by [-79, 79]; its values are 0 and 1
        return score + table[kv_idx - 2 * (kv_idx // 2)]
    return parity


IN_RANGE = {"negative": _negative_indices, "negative_2d": _negative_2d,
            "contents": _contents_in_range, "loose_intervals": _loose_intervals}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", IN_RANGE)
def test_an_index_in_range_matches_the_oracle(name, backend):
    mod = IN_RANGE[name]()
    assert not _eager_torch_raises(mod)
    _matches_oracle(backend, score_mod=mod)


def test_which_step_decides(monkeypatch):
    """A proof by intervals reads no tensor and is remembered; an index through a tensor's
    values reads its min and max; only what those leave open is evaluated."""
    steps = []
    real_contents, real_exact = bounds._contents, bounds._exact_range
    monkeypatch.setattr(bounds, "_contents", lambda *a: steps.append("contents") or real_contents(*a))
    monkeypatch.setattr(bounds, "_exact_range", lambda *a: steps.append("exact") or real_exact(*a))
    q, k, v = _qkv()
    for make, want in ((_negative_indices, []), (_negative_2d, []), (_contents_in_range, ["contents"]),
                       (_loose_intervals, ["contents", "exact"])):
        mod = make()
        steps.clear()
        flex_attention(q, k, v, score_mod=mod, backend="reference")
        assert steps == want, make.__name__
        steps.clear()
        flex_attention(q, k, v, score_mod=mod, backend="reference")
        assert steps == want, f"{make.__name__}, a second call"
