"""The eager call path's per-signature cache (a decode step's host time).

An eager ``flex_attention`` call validates its inputs, traces and lowers the mods, asks every
backend whether it can run the call and plans the launches; on a decode step that host work
took longer than the kernel. A repeated call with the same signature reuses the first call's
validated :class:`~flexjit.api.Call` parts (the Program, the backend Choice) and a ``memo``
dict that the backends fill with their plans and ready launches, so only what changes per call
(q, k, v and the output buffers) is touched.

The signature (``signature``, the dict key: what is cheap to compare) holds
    q, k, v: shape, strides, dtype, device, requires_grad and 16-byte alignment of the data
    (TMA descriptors and Triton's pointer specialisation depend on it);
    the score_mod and the BlockMask by identity; scale, enable_gqa, kernel_options (by value),
    the backend asked for, whether the row max is returned;
    grad mode, deterministic mode, torch's float32 matmul precision (fp32 inputs only), and the
    values of every environment variable a backend reads while choosing or planning
    (``ENV_GUARDED``; a test checks that the list is complete), and the first-use self-check's
    epoch (``selfcheck.epoch``: a choice made before a gated kernel passed, failed or could be
    checked is made again).
An entry is then used only if its guards still hold (``Entry.valid``):
    the score_mod and the BlockMask are the same live objects (weak references: an id reused
    by a new object never matches); the mods' fingerprints (``captures.fingerprint``: code,
    defaults, closure contents, named globals, captured tensors by identity and
    requires_grad, captured numbers by value) are unchanged, so a new captured number or
    tensor misses; the BlockMask's lengths, block size, mask_mod and list tensors are the same
    objects at the same version counter (an in-place edit of a list misses).
Captured tensors' values are never cached: kernels read them at run time (a device copy of a
captured tensor on another device is remembered by its version counter, ``device_buffers``).
What is not cached: a call whose mods cannot be fingerprinted, whose kernel_options hold an
unhashable value, inputs that are not plain tensors, and anything inside ``torch.compile``.
Entries are kept in LRU order, at most ``MAX_ENTRIES``.
"""
from __future__ import annotations

import collections
import weakref

import torch

from flexjit.runtime import selfcheck
from flexjit import config
from flexjit.backends.base import version
from flexjit.backends.triton.sources import interpret_setting
from flexjit.frontend.captures import Unfingerprintable, fingerprint

MAX_ENTRIES = 64

def env_state() -> tuple:
    """What of the environment a cached choice depends on: flexjit's settings (``config``, whose
    generation moves on every reload) and Triton's interpreter switch, as the user set it."""
    return (config.settings.generation, interpret_setting())


STATS = {"hit": 0, "miss": 0, "uncached": 0}
"""Eager calls served from an entry, prepared afresh (and stored), and not cacheable (tests)."""

_ENTRIES: "collections.OrderedDict[tuple, Entry]" = collections.OrderedDict()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def clear() -> None:
    """Forget every entry (the next call of each signature prepares afresh); zero ``STATS``."""
    _ENTRIES.clear()
    for name in STATS:
        STATS[name] = 0


def _tensor_sig(t) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() % 16)


def _fp32_mode(dtype) -> object:
    if dtype != torch.float32:
        return None
    return (torch.get_float32_matmul_precision(),
            getattr(torch.backends.cuda.matmul, "fp32_precision", None))


def signature(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, backend,
              want_max: bool):
    """The dict key of a normalised call (after autocast and BlockMask conversion), or None
    when the call is not cacheable."""
    if type(q) not in _PLAIN or type(k) not in _PLAIN or type(v) not in _PLAIN:
        return None
    try:
        opts = tuple(sorted(kernel_options.items())) if kernel_options else ()
        hash(opts)
        hash(scale)
        return (_tensor_sig(q), _tensor_sig(k), _tensor_sig(v), id(score_mod), id(block_mask),
                scale, bool(enable_gqa), opts, backend, want_max, torch.is_grad_enabled(),
                torch.are_deterministic_algorithms_enabled(), _fp32_mode(q.dtype), env_state(),
                selfcheck.epoch())
    except (TypeError, RuntimeError):  # unhashable options; a sparse or storage-less tensor
        return None




def block_mask_state(bm) -> tuple:
    """What a cached call depends on in a BlockMask: lengths, block size, mask_mod and each list
    tensor's identity and version counter (any in-place edit bumps it)."""
    lists = [getattr(bm, a) for a in bm._TENSOR_ATTRS]
    try:
        versions = tuple([None if t is None else t._version for t in lists])
    except RuntimeError:  # an inference tensor among them
        versions = tuple([None if t is None else version(t) for t in lists])
    return (tuple(bm.seq_lengths), tuple(bm.BLOCK_SIZE), id(bm.mask_mod), tuple(map(id, lists)), versions)


def _ref(obj):
    if obj is None:
        return None
    try:
        return weakref.ref(obj)
    except TypeError:
        return False  # not weak-referenceable: not cacheable


class Entry:
    """One prepared signature: what ``api.prepare_call`` and ``dispatch.select`` produced,
    the guards that make it valid, and the backends' shared ``memo``."""
    __slots__ = ("score_ref", "score_fp", "bm_ref", "bm_state", "mask_ref", "mask_fp", "program",
                 "choice", "scale", "kernel_options", "max_scores", "memo", "__weakref__")

    def valid(self, score_mod, block_mask) -> bool:
        if self.score_ref is not None and self.score_ref() is not score_mod:
            return False
        if self.bm_ref is not None:
            if self.bm_ref() is not block_mask or block_mask_state(block_mask) != self.bm_state:
                return False
            if self.mask_ref() is not block_mask.mask_mod:
                return False
        try:
            if self.score_ref is not None and fingerprint(score_mod) != self.score_fp:
                return False
            if self.bm_ref is not None and fingerprint(block_mask.mask_mod) != self.mask_fp:
                return False
        except (Unfingerprintable, ValueError, TypeError):
            return False
        return True


def lookup(sig, score_mod, block_mask) -> Entry | None:
    """The valid entry of ``sig``, or None (a stale one is dropped)."""
    entry = _ENTRIES.get(sig)
    if entry is None:
        return None
    if not entry.valid(score_mod, block_mask):
        del _ENTRIES[sig]
        return None
    _ENTRIES.move_to_end(sig)
    STATS["hit"] += 1
    return entry


def store(sig, score_mod, block_mask, call, choice) -> None:
    """Remember a freshly prepared call under ``sig`` (when its mods can be fingerprinted and
    its objects weakly referenced) and share the entry's memo with it."""
    entry = Entry()
    try:
        entry.score_fp = fingerprint(score_mod) if score_mod is not None else None
        entry.mask_fp = fingerprint(block_mask.mask_mod) if block_mask is not None else None
    except (Unfingerprintable, ValueError, TypeError):
        STATS["uncached"] += 1
        return
    entry.score_ref, entry.bm_ref = _ref(score_mod), _ref(block_mask)
    entry.mask_ref = _ref(block_mask.mask_mod) if block_mask is not None else None
    if False in (entry.score_ref, entry.bm_ref, entry.mask_ref):
        STATS["uncached"] += 1
        return
    entry.bm_state = block_mask_state(block_mask) if block_mask is not None else None
    entry.program, entry.choice = call.program, choice
    entry.scale, entry.kernel_options, entry.max_scores = call.scale, call.kernel_options, call.max_scores
    entry.memo = call.memo
    STATS["miss"] += 1
    _ENTRIES[sig] = entry
    while len(_ENTRIES) > MAX_ENTRIES:
        _ENTRIES.popitem(last=False)
