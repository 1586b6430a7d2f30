"""The disk cache heals itself: a bad entry never fails a call, and never stays bad.

* Each way a generated Triton module on disk can go bad (truncated, emptied, overwritten with
  bytes that are not Python, valid Python without the kernel, a directory in its place): the
  next process (here: the same one with its in-memory modules dropped) gets the right answer
  against the float64 oracle, one ``CacheWarning`` naming the file, and a good entry again, so a
  third process reads it without a warning and without rendering.
* A cache folder that cannot be written (below a regular file; read-only, where the test does
  not run as root) runs from memory with one warning.
* Many processes healing one bad entry at once (a fork pool) leave one good, sealed file and
  nothing else beside it.
* The seal's own checks (``verify``) on each kind of damage.

Shapes: one head of 48 × 48 at D = 16 with 32-blocks, a causal mask over a ragged edge: the
smallest call that renders and interprets a real kernel (about a second); L = S keeps it on the
prefill kernel (a shorter query would go to split-KV decoding).
"""
import multiprocessing
import os
import warnings

import pytest
import torch

from flexjit import create_block_mask, mods
from flexjit.api.attention import flex_attention
from flexjit.backends import kernel_cache as cache
from flexjit.backends.triton import sources
from mods_catalog import lowered
from oracle import FLOOR, assert_close_to_oracle, dense_attention, random_qkv

SHAPE = (1, 1, 48, 48, 16)  # B, H, L, S, D


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """A private disk cache, the interpreter on, no modules in memory."""
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLEXJIT_CACHE", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sources.forget_imported()
    yield tmp_path / "cache"
    sources.forget_imported()


def _call_and_check():
    """One causal call on the Triton interpreter, checked against the float64 oracle."""
    B, H, L, S, D = SHAPE
    q, k, v = (t.detach() for t in random_qkv(B, H, H, L, S, D, D, torch.float32, seed=3))
    bm = create_block_mask(mods.causal(), None, None, L, S, device="cpu", BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, backend="triton")
    ref, ref_lse = dense_attention(q, k, v, None, mods.causal(), dtype=torch.float64)
    low, low_lse = dense_attention(q, k, v, None, mods.causal(), dtype=torch.float32)
    assert_close_to_oracle("out", out, ref, low, FLOOR[torch.float32])
    assert_close_to_oracle("lse", lse, ref_lse, low_lse, FLOOR[torch.float32])


def _entry(root):
    (path,) = (root / "triton").glob("*.py")
    return path


def _damage(path, how):
    text = path.read_text()
    if how == "truncated":
        path.write_text(text[: len(text) // 2])
    elif how == "empty":
        path.write_text("")
    elif how == "garbage":
        path.write_bytes(bytes(range(256)) * 8)
    elif how == "no_kernel":  # valid Python, but not the module the key names
        path.write_text(text.replace("def flex_fwd(", "def another_name("))
    elif how == "directory":
        path.unlink()
        path.mkdir()
        (path / "stray.py").write_text("x = 1\n")
    else:
        raise KeyError(how)


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage", "no_kernel", "directory"])
def test_bad_triton_source_is_rebuilt(cache_root, how):
    _call_and_check()
    path = _entry(cache_root)
    _damage(path, how)
    sources.forget_imported()  # as a later process starts
    rendered = sources.STATS["render"]
    with pytest.warns(cache.CacheWarning, match=path.name) as seen:
        _call_and_check()
    assert len([w for w in seen if issubclass(w.category, cache.CacheWarning)]) == 1
    assert sources.STATS["render"] == rendered + 1
    assert cache.verify(path, "flex_fwd") == cache.OK
    sources.forget_imported()
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        _call_and_check()
    assert sources.STATS["render"] == rendered + 1  # read from disk, not rendered again


@pytest.mark.parametrize("where", ["root", "kind"])
def test_cache_folder_below_a_file_runs_from_memory(tmp_path, monkeypatch, where):
    """The cache root below a regular file, or a file where the Triton folder should be."""
    if where == "root":
        blocker = tmp_path / "a_file"
        root = blocker / "cache"
    else:
        root = tmp_path / "cache"
        root.mkdir()
        blocker = root / "triton"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(root))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sources.forget_imported()
    with pytest.warns(cache.CacheWarning, match="cannot be written"):
        _call_and_check()
    sources.forget_imported()
    with warnings.catch_warnings():  # said once per process
        warnings.simplefilter("error", cache.CacheWarning)
        _call_and_check()
    assert blocker.read_text() == "not a folder"
    sources.forget_imported()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_read_only_cache_folder_runs_from_memory(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o500)
    monkeypatch.setenv("FLEXJIT_CACHE_DIR", str(root))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sources.forget_imported()
    try:
        with pytest.warns(cache.CacheWarning, match="cannot be written"):
            _call_and_check()
        assert list(root.iterdir()) == []
    finally:
        root.chmod(0o700)
        sources.forget_imported()


_FORKED: dict = {}  # what the pool's processes inherit (a Program does not pickle)


def _heal_in_a_child(ready):
    """One pool process: drop the inherited modules and import the (bad) entry, many at once."""
    sources.forget_imported()
    ready.wait(timeout=120)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mod = sources.load_module(_FORKED["program"], "fwd", interpret=True)
    return (callable(getattr(mod, "flex_fwd", None)),
            sum(issubclass(w.category, cache.CacheWarning) for w in seen))


def test_concurrent_writers_leave_one_good_entry(cache_root):
    program = _FORKED["program"] = lowered(None, mods.causal())
    sources.load_module(program, "fwd", interpret=True)
    path = _entry(cache_root)
    path.write_bytes(b"\x00garbage" * 64)  # every process finds it bad and races to mend it
    workers = 6
    ctx = multiprocessing.get_context("fork")  # the parent's lowered Program and settings
    with ctx.Manager() as manager:
        ready = manager.Barrier(workers)
        with ctx.Pool(workers) as pool:
            results = pool.map_async(_heal_in_a_child, [ready] * workers, chunksize=1).get(300)
    assert all(ok for ok, _ in results), results
    assert all(n <= 1 for _, n in results) and sum(n for _, n in results) >= 1, results
    assert cache.verify(path, "flex_fwd") == cache.OK
    left = sorted(p.name for p in path.parent.iterdir())
    assert left == sorted([path.name, path.name + ".meta", path.name + ".lock"]), left


def test_verify_names_each_damage(tmp_path):
    path = tmp_path / "entry.py"
    assert cache.verify(path) == cache.ABSENT
    cache.atomic_write(path, "def flex_fwd():\n    return 1\n")
    assert "no seal" in cache.verify(path)
    cache.seal(path, "flex_fwd")
    assert cache.verify(path, "flex_fwd") == cache.OK
    assert "flex_bwd" in cache.verify(path, "flex_bwd")  # sealed for another symbol
    path.write_text("def flex_fwd():\n    return 2\n")  # same size, other bytes
    assert "checksum" in cache.verify(path, "flex_fwd")
    path.write_text("def flex_fwd():\n")
    assert "bytes" in cache.verify(path, "flex_fwd")
    cache.seal_path(path).write_text("{not json")
    assert "seal" in cache.verify(path, "flex_fwd")
    cache.discard(path)
    assert cache.verify(path) == cache.ABSENT and not cache.seal_path(path).exists()
