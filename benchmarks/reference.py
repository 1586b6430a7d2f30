"""The yardstick every implementation is checked against before it is timed.

- `attention_reference` computes attention row-chunk by row-chunk with plain torch, calling the
  variant's own mods on broadcast index grids. Softmax is per query row, so splitting the rows is
  exact; each chunk's [B, Hq, rows, S] scores fit a fixed memory budget, which keeps S = 32k on
  one GPU (torch Flex in eager mode materialises far more and is too slow at 8k).
  Gradients come from autograd on each chunk, summed for K and V.
- `check` compares an implementation with it. The tolerance comes from the data (STYLE.md):
  the reference is run twice, in float32 (TF32 off: its error against float64 is ~1e-6, far below
  bf16's) and with the same math in the test dtype (scores, probabilities and outputs rounded to
  bf16 as a kernel rounds them; gradients of each chunk summed in fp32, as kernels accumulate).
  An implementation passes when, for the output and every gradient, both its relative L2 error
  and its largest elementwise error against float32 are at most twice those of the bf16 math plus
  a small floor. A fused kernel keeps scores and accumulators in fp32, so a correct one lands
  below the bf16 math; a wrong mask on even one row moves the largest error by O(|v|), far
  above bf16 rounding (2^-8), so the elementwise bound catches what the L2 norm would dilute.
- `mask_density` counts the mask's true entries exactly, chunk by chunk, for the FLOP count.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from .variants import Variant

# Elements of one [B, H, rows, S] chunk: 2^28 fp32 is 1 GiB per live copy on the GPU.
GPU_CHUNK_ELEMS = 1 << 28
CPU_CHUNK_ELEMS = 1 << 24

REL_FLOOR = 1e-4  # relative L2 error always allowed
MAX_FLOOR = 1e-3  # elementwise error always allowed, as a fraction of max |reference|


def chunk_elems(device: torch.device) -> int:
    return GPU_CHUNK_ELEMS if device.type == "cuda" else CPU_CHUNK_ELEMS


def index_grids(B: int, H: int, row0: int, rows: int, S: int, device):
    """int32 index tensors b [B,1,1,1], h [1,H,1,1], q [1,1,rows,1], kv [1,1,1,S] (flex's dtype)."""
    i32 = dict(dtype=torch.int32, device=device)
    b = torch.arange(B, **i32).view(B, 1, 1, 1)
    h = torch.arange(H, **i32).view(1, H, 1, 1)
    q = torch.arange(row0, row0 + rows, **i32).view(1, 1, rows, 1)
    kv = torch.arange(S, **i32).view(1, 1, 1, S)
    return b, h, q, kv


@contextlib.contextmanager
def _full_fp32_matmul():
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def _attend(q_rows, k, v, row0: int, variant: Variant, scale: float, p_dtype=None):
    """Attention of query rows [row0, row0 + rows) against all keys; k, v already hold Hq heads.
    ``p_dtype``: the unnormalised probabilities exp(s - rowmax), in [0, 1], are rounded to it
    before P·V and the row sums taken before that rounding, as an FP8 kernel that feeds P to an
    e4m3 MMA does (every variant keeps a key in each row)."""
    B, H, rows, _ = q_rows.shape
    S = k.shape[2]
    b, h, qi, ki = index_grids(B, H, row0, rows, S, q_rows.device)
    s = (q_rows @ k.transpose(-2, -1)) * scale
    if variant.score_mod is not None:
        s = variant.score_mod(s, b, h, qi, ki).to(s.dtype)
    if variant.mask_mod is not None:
        s = s.masked_fill(~variant.mask_mod(b, h, qi, ki), float("-inf"))
    if p_dtype is None:
        return torch.softmax(s, dim=-1) @ v
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e.to(p_dtype).to(s.dtype) @ v) / e.sum(-1, keepdim=True)


def attention_reference(q, k, v, variant: Variant, scale: float, dtype: torch.dtype, dout=None,
                        p_dtype=None):
    """Attention of q [B,Hq,S,D] over k [B,Hkv,S,D], v [B,Hkv,S,Dv], computed in `dtype`, chunked
    over rows; `p_dtype` (forward only): P rounded to it before P·V (`_attend`).

    Returns float32 tensors: {"out"} and, when `dout` is given, also {"dq", "dk", "dv"}.
    """
    B, Hq, S, D = q.shape
    group = Hq // k.shape[1]
    rows_per_chunk = max(1, min(S, chunk_elems(q.device) // (B * Hq * S)))
    want_grad = dout is not None
    qc, kc, vc = (t.detach().to(dtype) for t in (q, k, v))
    kc.requires_grad_(want_grad)
    vc.requires_grad_(want_grad)
    res = {"out": torch.empty(B, Hq, S, v.shape[-1], dtype=torch.float32, device=q.device)}
    if want_grad:
        res["dq"] = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        res["dk"] = torch.zeros(kc.shape, dtype=torch.float32, device=q.device)
        res["dv"] = torch.zeros(vc.shape, dtype=torch.float32, device=q.device)
    with _full_fp32_matmul(), torch.set_grad_enabled(want_grad):
        for r0 in range(0, S, rows_per_chunk):
            rows = slice(r0, min(S, r0 + rows_per_chunk))
            q_rows = qc[:, :, rows].detach().requires_grad_(want_grad)
            k_all = kc.repeat_interleave(group, dim=1) if group > 1 else kc
            v_all = vc.repeat_interleave(group, dim=1) if group > 1 else vc
            o = _attend(q_rows, k_all, v_all, r0, variant, scale, p_dtype)
            res["out"][:, :, rows] = o.float()
            if want_grad:
                gq, gk, gv = torch.autograd.grad(o, (q_rows, kc, vc), dout[:, :, rows].to(dtype))
                res["dq"][:, :, rows] = gq.float()
                res["dk"] += gk.float()
                res["dv"] += gv.float()
            del o
    return res


def mask_density(variant: Variant, B: int, H: int, S: int, device) -> float:
    """The exact fraction of (b, h, q, kv) entries the mask keeps; 1.0 without a mask."""
    if variant.mask_mod is None:
        return 1.0
    rows_per_chunk = max(1, min(S, chunk_elems(torch.device(device)) // (B * S)))
    kept = 0
    for r0 in range(0, S, rows_per_chunk):
        rows = min(rows_per_chunk, S - r0)
        m = variant.mask_mod(*index_grids(B, H, r0, rows, S, device))
        full = (B, H, rows, S)
        if torch.broadcast_shapes(m.shape, full) != full:
            raise ValueError(f"mask_mod returned shape {tuple(m.shape)}, not broadcastable to {full}")
        # Broadcasting repeats entries, so the count of the small tensor scales exactly.
        kept += int(m.sum()) * (math.prod(full) // m.numel())
    return kept / (B * H * S * S)


@dataclass
class Check:
    ok: bool
    message: str  # empty when ok
    detail: dict = field(default_factory=dict)  # per tensor: rel, max, tol_rel, tol_max


def check(got: dict, ref: dict, low: dict) -> Check:
    """Compare `got` (any dtype, layout [B,H,S,D]) with the float32 `ref`; `low` sets the bar."""
    detail, bad = {}, []
    for name, g in got.items():
        r, lo = ref[name], low[name]
        if tuple(g.shape) != tuple(r.shape):
            bad.append(f"{name}: shape {tuple(g.shape)} != {tuple(r.shape)}")
            continue
        g = g.float()
        if not bool(torch.isfinite(g).all()):
            bad.append(f"{name}: {int((~torch.isfinite(g)).sum())} non-finite values")
            continue
        ref_norm = float(torch.linalg.vector_norm(r)) or 1.0
        ref_max = float(r.abs().max())
        rel = float(torch.linalg.vector_norm(g - r)) / ref_norm
        mx = float((g - r).abs().max())
        tol_rel = 2 * float(torch.linalg.vector_norm(lo - r)) / ref_norm + REL_FLOOR
        tol_max = 2 * float((lo - r).abs().max()) + MAX_FLOOR * ref_max
        detail[name] = {"rel": rel, "max": mx, "tol_rel": tol_rel, "tol_max": tol_max}
        if rel > tol_rel or mx > tol_max:
            bad.append(f"{name}: rel {rel:.2e} (tol {tol_rel:.2e}), max {mx:.2e} (tol {tol_max:.2e})")
    return Check(not bad, "; ".join(bad), detail)


# ---- FP8 inputs --------------------------------------------------------------------------------

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_e4m3(x: torch.Tensor, group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x stored as float8_e4m3fn, its float32 descale (B, H // group)): one factor per batch row
    and run of ``group`` heads (a query's heads share their kv head's: pass the GQA ratio),
    amax / 448, so that x ≈ stored.float() × descale (FlashAttention-3's convention, flexjit's).
    x / descale is formed in float32 and rounded once to e4m3."""
    B, H = x.shape[:2]
    amax = x.detach().reshape(B, H // group, -1).abs().amax(-1).float()
    descale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    d = descale.repeat_interleave(group, 1)[:, :, None, None]
    return (x.detach().float() / d).to(E4M3), descale


def dequantize_e4m3(x8: torch.Tensor, descale: torch.Tensor, group: int = 1) -> torch.Tensor:
    """The float32 values ``x8`` stands for: stored × descale (``quantize_e4m3``'s inverse)."""
    return x8.float() * descale.repeat_interleave(group, 1)[:, :, None, None]


def fp8_set(s: dict) -> dict:
    """Input set ``s`` (bf16 q, k, v) quantised with per-(batch, kv head) descales: {"q8", "k8",
    "v8", "q_descale", "k_descale", "v_descale"}; every FP8 impl of a case gets these values."""
    g = s["q"].shape[1] // s["k"].shape[1]
    (q8, qd), (k8, kd), (v8, vd) = (quantize_e4m3(s[n], g if n == "q" else 1) for n in "qkv")
    return {"q8": q8, "k8": k8, "v8": v8, "q_descale": qd, "k_descale": kd, "v_descale": vd}


def fp8_dequantized(f: dict) -> dict:
    """float32 q, k, v of an ``fp8_set``: the values the FP8 rows are checked against."""
    g = f["q8"].shape[1] // f["k8"].shape[1]
    return {n: dequantize_e4m3(f[f"{n}8"], f[f"{n}_descale"], g if n == "q" else 1) for n in "qkv"}
