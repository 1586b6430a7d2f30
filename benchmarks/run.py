"""The GPU benchmark harness: `python -m benchmarks.run --out DIR` (README.md has the flags).

For each pass, shape and variant, every implementation is
1. set up outside the timed region (block masks, torch.compile, keyword arguments), or skipped
   with a printed reason;
2. run once on fresh random inputs and checked against the chunked reference (`reference.py`):
   a wrong answer is reported as wrong and not timed;
3. timed with `triton.testing.do_bench` (median of events around each call), inputs rotating
   through enough copies that they cannot sit in the 60 MB L2 (do_bench also flushes L2
   before every call, so the rotation is belt and braces); a call that outlasts --rep-ms (1M
   tokens) is timed three times instead, the median reported.
All baselines run in the same process as flexjit, on the same GPU, minutes apart. FP8 impls
(``impls.FP8_IMPLS``: e4m3 inputs quantised from the same sets outside the timed region) run the
forward only and are checked against the attention of the values they hold (``Refs.fp8_pair``).

DIR/meta.json (versions, clocks) is written first and DIR/results.json after each measurement,
so a run cut short still leaves its data; DIR/results.md (the table) and DIR/results.png (the
chart) come at the end, DIR/log.txt holds everything printed, and the table is printed last.
A wall-clock budget (--budget-s) stops starting new measurements in time to write them: the rest
are recorded as skipped for the budget, and `--resume` measures them in a later call.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import platform
import random
import statistics
import subprocess
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from . import impls as impl_mod
from . import report
from .reference import E4M3, attention_reference, check, fp8_dequantized, fp8_set, mask_density
from .variants import VARIANTS, Case, attention_flops, build, default_scale

ALL_S = (1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_S = (2048, 8192)
# --plain: the masks FA4 has built in (and prefix-LM, Flex-FLASH's), from 2k to 1M tokens
PLAIN_S = (2048, 8192, 32768, 131072, 1 << 20)
PLAIN_VARIANTS = ("full", "causal", "sliding_window", "prefix_lm")
PLAIN_IMPLS = ("flexjit-cute", "fa4", "torch-flex-flash")
# Run the trusted baselines first: a kernel that corrupts the CUDA context ends the run's GPU
# work, and then at least the baselines it came after are in.
RUN_ORDER = ("cudnn", "fa4", "fa4-bhsd", "fa4-nopack", *impl_mod.FP8_BASELINES, "torch-flex-triton",
             "torch-flex-flash", "flexjit-triton", "flexjit-cute", *impl_mod.FLEXJIT_MODES,
             *impl_mod.FLEXJIT_FP8_MODES, "flexjit-reference", "torch-flex-eager")
FATAL_CUDA = ("illegal memory access", "device-side assert", "unspecified launch failure",
              "misaligned address", "illegal instruction", "CUDA error: an illegal")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TUNE_TIMEOUT_S = 300.0  # a case waits this long at most for flexjit's tuner to settle
KNOWN_IMPLS = impl_mod.DEFAULT_IMPLS + impl_mod.EXTRA_IMPLS


_SUFFIX = {"k": 1024, "m": 1024 * 1024}


def parse_sizes(text: str) -> list[int]:
    """'2k,8192,1M' -> [2048, 8192, 1048576] (k and M are powers of 1024)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = _SUFFIX.get(part[-1:], 1)
        number = part[:-1] if scale > 1 else part
        try:
            size = float(number) * scale
        except ValueError:
            raise SystemExit(f"cannot read size {part!r}: write 8192, 8k or 1M") from None
        if size <= 0 or size != int(size):
            raise SystemExit(f"size {part!r} is not a positive whole number of tokens")
        out.append(int(size))
    return out


def parse_head_dims(text: str) -> list[tuple[int, int]]:
    """'64,192/128' -> [(64, 64), (192, 128)]: q/k's head dim, then v's."""
    out = []
    for part in text.split(","):
        qk, _, v = part.strip().partition("/")
        out.append((int(qk), int(v or qk)))
    return out


def parse_list(text: str, known) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in items if x not in known]
    if unknown:
        raise SystemExit(f"unknown {unknown}; known: {', '.join(known)}")
    return items


def make_parser() -> argparse.ArgumentParser:
    """The run's flags (``benchmarks.prewarm`` takes the same ones, through this parser)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json/.md/.png and log.txt")
    p.add_argument("--S", default=None, help="sequence lengths, e.g. 2k,8k (default 2k,8k)")
    p.add_argument("--hkv", default=None, help="KV heads, e.g. 16,4 (default 16)")
    p.add_argument("--d", default=None,
                   help="head dims, e.g. 64,128, or q/k over v as 192/128 (default 128)")
    p.add_argument("--hq", type=int, default=16, help="query heads (default 16)")
    p.add_argument("--tokens", type=int, default=16384,
                   help="B*S per case (default 16384); a longer S runs one sequence (B=1)")
    p.add_argument("--passes", default="fwd,fwdbwd", help="fwd, fwdbwd or both (default both)")
    p.add_argument("--variants", default=None, help="default: all seven")
    p.add_argument("--impls", default=None, help=f"default: {','.join(impl_mod.DEFAULT_IMPLS)}")
    p.add_argument("--all", action="store_true",
                   help="every shape: S 1k..32k, Hkv 16 and 4, D 64 and 128 "
                        "(explicit --S/--hkv/--d still win)")
    p.add_argument("--plain", action="store_true",
                   help="the plain cases against FA4: full, causal, sliding window and prefix-LM at "
                        "S 2k, 8k, 32k, 128k and 1M, Hkv 16 and 4, D 64 and 128, on flexjit-cute, "
                        "fa4 and torch-flex-flash (explicit flags still win)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu (smoke runs)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="start no measurement after this many seconds from start (0: no limit)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up (default 25)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time (default 100)")
    p.add_argument("--seed", type=int, default=None, help="default: drawn fresh and printed")
    p.add_argument("--max-errors", type=int, default=4,
                   help="skip an impl for the rest of the run after this many errors in a row (0: never)")
    p.add_argument("--no-png", action="store_true", help="skip the chart")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) for the whole run (flexjit's sm90 "
                        "backward then orders its dQ adds); compare with a run without it")
    p.add_argument("--resume", default=None, metavar="RESULTS_JSON",
                   help="keep that run's rows and measure only what it left out (budget, errors in a row, lost context)")
    return p


def parse_args(argv=None, parser: argparse.ArgumentParser | None = None):
    """The run's arguments, normalised (sizes, lists, device, seed); ``parser``: ``make_parser()``
    with flags added (``benchmarks.prewarm``)."""
    args = (parser or make_parser()).parse_args(argv)
    wide = args.all or args.plain
    args.S = parse_sizes(args.S) if args.S else list(
        PLAIN_S if args.plain else ALL_S if args.all else DEFAULT_S)
    args.hkv = parse_sizes(args.hkv) if args.hkv else ([16, 4] if wide else [16])
    args.d = parse_head_dims(args.d) if args.d else ([(64, 64), (128, 128)] if wide else [(128, 128)])
    args.passes = parse_list(args.passes, ("fwd", "fwdbwd"))
    args.variants = parse_list(args.variants or ",".join(PLAIN_VARIANTS if args.plain else VARIANTS),
                               VARIANTS)
    args.impls = parse_list(args.impls or ",".join(PLAIN_IMPLS if args.plain else impl_mod.DEFAULT_IMPLS),
                            KNOWN_IMPLS)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)
    for S in args.S:
        if S < args.tokens and args.tokens % S:
            raise SystemExit(f"--tokens {args.tokens} is not a multiple of S={S}")
    for hkv in args.hkv:
        if args.hq % hkv:
            raise SystemExit(f"--hq {args.hq} is not a multiple of Hkv={hkv}")
    return args


class Tee:
    """Copy what the run prints into DIR/log.txt as well."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, open(path, "a", buffering=1)

    def write(self, text):
        self.stream.write(text)
        self.file.write(text)

    def flush(self):
        self.stream.flush()
        self.file.flush()


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def environment(args) -> dict:
    """What the rows were measured on, for results.md's header."""
    dev = args.device
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    # The device machine's copy of the tree may carry stale git metadata: FLEXJIT_GIT_SHA wins.
    sha = os.environ.get("FLEXJIT_GIT_SHA")
    try:
        sha = sha or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
    except Exception:
        sha = None
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.run"] + sys.argv[1:]),
        "seed": args.seed,
        "deterministic": bool(getattr(args, "deterministic", False)),
        "git": sha,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "flash-attn-4": _version("flash-attn-4"),
        "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl"),
        "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None,
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env["sm_count"] = props.multi_processor_count
        env["l2_bytes"] = getattr(props, "L2_cache_size", None)
        env["nvidia-smi"] = _nvidia_smi()
    return env


def _nvidia_smi() -> str | None:
    """Clocks, load and memory in use at the start: the GPU is shared, so note its state."""
    query = "clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu,memory.used,driver_version"
    try:
        p = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return f"{query}: {p.stdout.strip()}" if p.returncode == 0 else None
    except Exception:
        return None


# ---- inputs ------------------------------------------------------------------------------------


def rotation_count(case: Case, device: torch.device, l2_bytes: int | None) -> int:
    """Input sets to cycle through so that the bytes read between two uses of one set exceed 2× L2."""
    if device.type != "cuda":
        return 1
    itemsize = torch.tensor([], dtype=case.dtype).element_size()
    one_set = case.B * case.S * (case.D + case.dv) * (case.Hq + case.Hkv) * itemsize  # q, dout, k, v
    return max(1, min(8, math.ceil(2 * (l2_bytes or 60 << 20) / one_set)))


def make_inputs(case: Case, device, n_sets: int) -> list[dict]:
    """n_sets of fresh random q, k, v (leaves that require grad) and dout, all [B, H, S, D] (v and
    dout: [B, H, S, Dv])."""
    sets = []
    for _ in range(n_sets):
        q = torch.randn(case.B, case.Hq, case.S, case.D, device=device, dtype=case.dtype)
        k = torch.randn(case.B, case.Hkv, case.S, case.D, device=device, dtype=case.dtype)
        v = torch.randn(case.B, case.Hkv, case.S, case.dv, device=device, dtype=case.dtype)
        do = torch.randn(case.B, case.Hq, case.S, case.dv, device=device, dtype=case.dtype)
        sets.append({"q": q.requires_grad_(), "k": k.requires_grad_(), "v": v.requires_grad_(), "do": do})
    return sets


def in_layout(sets: list[dict], layout: str) -> list[dict]:
    """The same values as new leaves in `layout` ("bhsd" as made, or "bshd"), copied outside timing."""
    if layout == "bhsd":
        return sets
    return [{n: (t.detach().transpose(1, 2).contiguous().requires_grad_(n != "do")) for n, t in s.items()}
            for s in sets]


def for_pass(sets: list[dict], pass_: str) -> list[dict]:
    """The sets as a pass takes them: the forward gets leaves that need no grad, as in inference
    (torch Flex on the CPU insists)."""
    if pass_ == "fwd":
        return [{n: t.detach() for n, t in s.items()} for s in sets]
    return sets


def to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "bhsd" else t.transpose(1, 2)


# ---- one measurement ---------------------------------------------------------------------------


def poison_allocator(case: Case, device) -> None:
    """Leave NaN in the caching allocator's free blocks of the output's and gradients' sizes.

    The next implementation's outputs are likely to land in these blocks (best fit), so an
    element its kernel never writes reads as NaN and fails the check, instead of showing the
    previous implementation's right answer from the same memory. Where they do not all fit
    beside the inputs (1M tokens on an 80 GB card), the ones that fit are poisoned.
    """
    if device.type != "cuda":
        return
    shapes = [(case.B, case.Hq, case.S, case.D), (case.B, case.Hq, case.S, case.dv),
              (case.B, case.Hkv, case.S, case.D), (case.B, case.Hkv, case.S, case.dv)]
    blocks = []
    try:
        for shape in shapes:
            for dt in (case.dtype, torch.float32):
                blocks.append(torch.full(shape, float("nan"), dtype=dt, device=device))
    except torch.OutOfMemoryError:
        pass
    del blocks


def call_once(fn, s: dict, pass_: str, layout: str) -> dict:
    """One call on input set `s`; the output (and gradients) back in [B, H, S, D]."""
    if pass_ == "fwd":
        with torch.no_grad():
            got = {"out": fn(s["q"], s["k"], s["v"])}
    else:
        out = fn(s["q"], s["k"], s["v"])
        dq, dk, dv = torch.autograd.grad(out, (s["q"], s["k"], s["v"]), s["do"])
        got = {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}
    if s["q"].is_cuda:
        torch.cuda.synchronize()  # surface asynchronous launch errors here, not in the timer
    return {n: to_bhsd(t, layout) for n, t in got.items()}


def tuner_undecided() -> frozenset:
    """flexjit's shape classes still being tuned in this process (empty without flexjit)."""
    try:
        from flexjit.runtime import autotune
    except ImportError:
        return frozenset()
    return autotune.undecided()


def settle_tuner(opened: frozenset, call, timeout_s: float = TUNE_TIMEOUT_S) -> float:
    """Call again until the shape classes that the first call ``opened`` are decided: their
    candidates compile in the background and a later call measures them. Timed before that,
    a case mixes the heuristic's configuration, the tuner's measuring call and the compiles'
    CPU load. Returns the seconds it took; raises once ``timeout_s`` pass."""
    t0 = time.perf_counter()
    while opened & tuner_undecided():
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"the tuner left {len(opened & tuner_undecided())} shape "
                               f"class(es) undecided after {timeout_s:.0f} s")
        time.sleep(0.25)
        call()
    return round(time.perf_counter() - t0, 3)


def make_step(fn, sets: list[dict], pass_: str):
    """The timed closure: one call (fwd) or one call and its backward (fwdbwd), rotating sets."""
    cycle = itertools.cycle(sets)
    if pass_ == "fwd":
        def step():
            s = next(cycle)
            fn(s["q"], s["k"], s["v"])
    else:
        def step():
            s = next(cycle)
            out = fn(s["q"], s["k"], s["v"])
            torch.autograd.grad(out, (s["q"], s["k"], s["v"]), s["do"])
    return step


def event_ms(step) -> float:
    """One call's milliseconds between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def time_ms(step, device, warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds per call: do_bench on the GPU, a wall clock on the CPU (smoke runs)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        first = event_ms(step)
        if first >= rep_ms:
            # One call outlasts the repetition time (1M tokens: 26 s fwd+bwd), where do_bench
            # would spend seven calls on estimates and warm-up to time one: the median of three.
            return statistics.median([first, event_ms(step), event_ms(step)])
        return float(do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    step()
    times = []
    t_end = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 100):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# From this S on, the references cover the first KV head and its query heads only: a head's
# output and gradients depend on no other head, and the fp32 reference of all 16 heads of a 128k
# sequence would take minutes (it computes every score, masked or not).
REF_ONE_HEAD_FROM_S = 32768


class Refs:
    """The float32 and test-dtype references of one (pass, case, variant), computed on first need.
    Long sequences: of the first KV head's group of heads (``restrict`` cuts results to match)."""

    def __init__(self, s: dict, variant, scale: float, pass_: str, dtype):
        self.s, self.variant, self.scale, self.pass_, self.dtype = s, variant, scale, pass_, dtype
        q, k = s["q"], s["k"]
        self.group = q.shape[1] // k.shape[1] if q.shape[2] >= REF_ONE_HEAD_FROM_S else None
        self._pair = self._fp8_pair = None

    def _first_group(self, tensors: dict, kv_names: tuple) -> dict:
        """The first KV head (``kv_names``) and its query heads of each tensor; all without
        ``group``."""
        if self.group is None:
            return tensors
        return {n: t[:, :1] if n in kv_names else t[:, :self.group] for n, t in tensors.items()}

    def restrict(self, got: dict) -> dict:
        return self._first_group(got, ("dk", "dv"))

    def fp8_pair(self):
        """The FP8 rows' references: float32 attention of the values the quantised set holds
        (``reference.fp8_set``, dequantised), and the bar's math: the same with P rounded to e4m3
        before P·V and the output to bf16, as an FP8 kernel with an e4m3 P·V MMA computes (it
        errs more than bf16 math on those values, and a road that dequantises to bf16 less)."""
        if self._fp8_pair is None:
            real = self._first_group(fp8_dequantized(fp8_set(self.s)), ("k", "v"))
            args = (real["q"], real["k"], real["v"], self.variant, self.scale, torch.float32)
            low = attention_reference(*args, p_dtype=E4M3)
            low["out"] = low["out"].to(torch.bfloat16).float()
            self._fp8_pair = (attention_reference(*args), low)
        return self._fp8_pair

    def pair(self):
        if self._pair is None:
            s = self._first_group(self.s, ("k", "v"))
            dout = s["do"] if self.pass_ == "fwdbwd" else None
            args = (s["q"], s["k"], s["v"], self.variant, self.scale)
            self._pair = (attention_reference(*args, torch.float32, dout),
                          attention_reference(*args, self.dtype, dout))
        return self._pair


def measure(impl, variant, case: Case, pass_: str, sets_by_layout: dict, refs: Refs, args) -> dict:
    """One row: set up, check, time. Never raises: failures become the row's status and error."""
    row = {"status": "ok", "ms": None, "tflops": None, "correct": False, "error": None}
    fp8 = getattr(impl, "fp8", False)
    if fp8 and pass_ != "fwd":
        return {**row, "status": "skipped",
                "error": "skipped: FP8 inputs have no backward (train on bf16 inputs)"}
    try:
        fn = impl.setup(variant, case, args.device)
    except (impl_mod.Skip, NotImplementedError) as e:
        return {**row, "status": "skipped", "error": f"skipped: {e}"}
    except Exception as e:
        return {**row, "status": "error", "error": f"setup: {type(e).__name__}: {e}"}
    if impl.layout not in sets_by_layout:
        sets_by_layout[impl.layout] = in_layout(sets_by_layout["bhsd"], impl.layout)
    sets = sets_by_layout[impl.layout]
    sets = for_pass(sets, pass_)
    if fp8:
        try:
            impl.prepare(sets)  # quantised once, outside the timed region
        except Exception as e:
            return {**row, "status": "error", "error": f"quantise: {type(e).__name__}: {e}"}
    poison_allocator(case, args.device)
    mode = getattr(impl, "context", contextlib.nullcontext)  # flexjit's switches (impls.FLEXJIT_MODES)
    open_before = tuner_undecided()
    t0 = time.perf_counter()
    try:
        with mode():
            got = call_once(fn, sets[0], pass_, impl.layout)
    except NotImplementedError as e:
        return {**row, "status": "skipped", "error": f"skipped: {e}"}
    except Exception as e:
        return {**row, "status": "error", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=6)}
    row["first_call_s"] = round(time.perf_counter() - t0, 3)
    opened = tuner_undecided() - open_before
    if opened:
        try:
            with mode():
                row["tune_s"] = settle_tuner(opened, lambda: call_once(fn, sets[0], pass_, impl.layout))
        except Exception as e:
            return {**row, "status": "error", "error": f"tuning: {type(e).__name__}: {e}"}
    ref, low = refs.fp8_pair() if fp8 else refs.pair()
    verdict = check(refs.restrict(got), ref, low)
    del got
    row["check"] = verdict.detail
    if not verdict.ok:
        return {**row, "status": "wrong", "error": f"wrong: {verdict.message}"}
    step = make_step(fn, sets, pass_)
    try:
        with torch.set_grad_enabled(pass_ == "fwdbwd"), mode():
            ms = time_ms(step, args.device, args.warmup_ms, args.rep_ms)
    except Exception as e:
        return {**row, "status": "error", "error": f"timing: {type(e).__name__}: {e}"}
    return {**row, "correct": True, "ms": ms}


# ---- the run -----------------------------------------------------------------------------------


ROW_KEY = ("impl", "variant", "S", "B", "Hq", "Hkv", "D", "Dv", "dtype", "pass")


def row_key(r: dict) -> tuple:
    """A row's ROW_KEY values."""
    return tuple(report.row_value(r, k) for k in ROW_KEY)


def _never_tried(row: dict) -> bool:
    """Skipped for the run's own reasons (budget, errors in a row, lost context), not the case's."""
    err = row["error"] or ""
    return err.startswith(("skipped: time budget", "skipped: CUDA context lost")) or " errors in a row, the last: " in err


def previous_rows(path: str | None) -> dict:
    """Rows of an earlier run worth keeping, by ROW_KEY: all but those it never got to."""
    if not path:
        return {}
    rows = json.loads(Path(path).read_text())
    return {row_key(r): r for r in rows if not _never_tried(r)}


class Runner:
    """The run's state across cases: rows so far, the budget, errors in a row, a lost context."""

    def __init__(self, args, env: dict, out: Path):
        self.args, self.env, self.out = args, env, out
        self.start = time.monotonic()
        self.order = [n for n in RUN_ORDER if n in args.impls]
        self.adapters = {n: impl_mod.make(n) for n in self.order}
        self.gen = torch.Generator().manual_seed(args.seed)
        self.built: dict = {}  # (case, variant name) -> (variant, density): one instance for both passes
        self.kept = previous_rows(args.resume)
        outside = [k for k in self.kept if k not in grid_keys(args, self.order)]
        if outside and Path(args.resume).resolve() == (out / "results.json").resolve():
            # results.json is rewritten with this run's grid: rows outside it would be lost.
            raise SystemExit(f"--resume {args.resume}: {len(outside)} of its rows lie outside this "
                             f"run's grid (e.g. {dict(zip(ROW_KEY, outside[0]))}) and would be lost "
                             "from the same --out; resume with the grid flags of the run it "
                             "continues, or write to another --out")
        self.rows: list[dict] = []
        self.fatal = None
        self.failing: dict[str, list[str]] = {n: [] for n in self.order}  # errors since the last result

    def run_case(self, pass_: str, case: Case, vname: str) -> None:
        """Every impl on one (pass, case, variant); inputs and references are made on first need."""
        args = self.args
        keys = {n: (n, vname, case.S, case.B, case.Hq, case.Hkv, case.D, case.dv, args.dtype, pass_)
                for n in self.order}
        self.rows += [self.kept[keys[n]] for n in self.order if keys[n] in self.kept]
        prep = None
        for name in (n for n in self.order if keys[n] not in self.kept):
            res = self.reason_not_to_run(name)
            if res is None:
                prep = prep or self.prepare(pass_, case, vname)
                res = prep.get("error") or measure(self.adapters[name], prep["variant"], case, pass_,
                                                   prep["sets"], prep["refs"], args)
            self.record({"impl": name, "variant": vname, "S": case.S, "B": case.B, "Hq": case.Hq,
                         "Hkv": case.Hkv, "D": case.D, "Dv": case.dv, "dtype": args.dtype, "pass": pass_, "ms": None,
                         "tflops": None, "correct": False, **res, "date": self.env["date"],
                         "gpu": self.env["gpu"], "density": (prep or {}).get("density"),
                         "flops": (prep or {}).get("flops"), "seed": args.seed})
        del prep
        if args.device.type == "cuda" and not self.fatal:
            torch.cuda.empty_cache()

    def reason_not_to_run(self, name: str) -> dict | None:
        if self.fatal:
            return {"status": "skipped", "error": f"skipped: CUDA context lost earlier ({self.fatal})"}
        if self.args.budget_s and time.monotonic() - self.start > self.args.budget_s:
            return {"status": "skipped", "error": f"skipped: time budget of {self.args.budget_s:.0f} s spent"}
        errors = self.failing[name]
        if self.args.max_errors and len(errors) >= self.args.max_errors:
            # A compile that fails still costs its compile time: stop paying it.
            return {"status": "skipped", "error": f"skipped: {len(errors)} errors in a row, the last: {errors[-1][:300]}"}
        return None

    def prepare(self, pass_: str, case: Case, vname: str) -> dict:
        """The variant, its density and FLOPs, rotating inputs and lazy references; or an error row."""
        args = self.args
        try:
            if (case, vname) not in self.built:
                v = build(vname, case, args.device, self.gen)
                self.built[(case, vname)] = (v, mask_density(v, case.B, case.Hq, case.S, args.device))
            variant, density = self.built[(case, vname)]
            sets = {"bhsd": make_inputs(case, args.device, rotation_count(case, args.device, self.env.get("l2_bytes")))}
            refs = Refs(sets["bhsd"][0], variant, default_scale(case), pass_, case.dtype)
        except Exception as e:
            return {"error": {"status": "error", "error": f"case setup: {type(e).__name__}: {e}"}}
        return {"variant": variant, "density": density, "flops": attention_flops(case, density, pass_),
                "sets": sets, "refs": refs}

    def record(self, row: dict) -> None:
        if row["ms"]:
            row["tflops"] = row["flops"] / row["ms"] / 1e9
        self.rows.append(row)
        print(report.row_line(row), flush=True)
        name = row["impl"]
        if row["status"] == "error":
            self.failing[name].append(row["error"])
            if any(m in row["error"] for m in FATAL_CUDA):
                self.fatal = f"{name} {row['variant']} S={row['S']} {row['pass']}"
        elif row["status"] in ("ok", "wrong"):
            self.failing[name].clear()
        (self.out / "results.json").write_text(json.dumps(self.rows, indent=1))


def grid_keys(args, impls) -> set:
    """The ROW_KEY of every row this run's grid measures (``Runner.run_case``'s keys)."""
    return {(n, v, c.S, c.B, c.Hq, c.Hkv, c.D, c.dv, args.dtype, p)
            for p, c, v in grid(args) for n in impls}


def cases(args) -> list[Case]:
    """Every shape of the run, in its order."""
    return [Case(max(1, args.tokens // S), S, args.hq, hkv, d, DTYPES[args.dtype], None if dv == d else dv)
            for S, hkv, (d, dv) in itertools.product(args.S, args.hkv, args.d)]


def grid(args):
    """(pass, case, variant name) in the order the run measures them (``benchmarks.prewarm``
    walks the same grid)."""
    return itertools.product(args.passes, cases(args), args.variants)


def cute_disk_cache_line() -> str:
    """How many CuTe kernels this process loaded from the disk cache and how many it looked up
    there and did not find (then compiled): after ``benchmarks.prewarm``, misses should be 0."""
    from flexjit.backends.cute import objects as cute_cache

    return f"cute disk cache: {cute_cache.STATS['hits']} hits, {cute_cache.STATS['misses']} misses"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.stdout = Tee(sys.__stdout__, out / "log.txt")
    sys.stderr = Tee(sys.__stderr__, out / "log.txt")
    torch.manual_seed(args.seed)
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    impl_mod.raise_dynamo_limits()
    env = environment(args)
    runner = Runner(args, env, out)  # refuses a --resume that would lose rows: before any write
    (out / "meta.json").write_text(json.dumps(env, indent=1))
    print("benchmarks.run:", json.dumps(env))
    for pass_, case, vname in grid(args):
        runner.run_case(pass_, case, vname)
    rows = runner.rows
    report.write(rows, env, out, png=not args.no_png)
    print(f"\nbenchmarks.run: {len(rows)} rows in {time.monotonic() - runner.start:.0f} s -> {out}")
    print(cute_disk_cache_line())
    print(report.notes(rows))
    print(report.table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
