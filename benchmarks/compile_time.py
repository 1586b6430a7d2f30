"""Where a cold CuTe compile spends its time, on the CPU (no GPU: ``CUTE_DSL_ARCH=sm_90a``).

    python -m benchmarks.compile_time [--variant alibi] [--head-dim 128] [--out DIR]

Compiles the sm90 forward and the backward's three kernels of a built-in variant
(``flexjit.integrations.aot``) into an empty disk cache and splits each ``cute.compile`` into

* ``python``: the DSL's Python side: the AST preprocessor, tracing the kernel's Python into MLIR
  (every ``cute.*`` call builds IR), the argument adapters;
* ``backend``: CuTeDSL's compiler call (MLIR passes, LLVM's NVPTX code generation, ptxas and the
  host launcher), one C++ call;
* ``ptxas``: within ``backend``, estimated by running Triton's bundled ``ptxas`` on the PTX the
  compile kept (the DSL links its own; the two differ in version, not in kind of work),

plus the import of cutlass and the templates, the export of each object file and, in a second
pass over the now warm cache, each kernel's load. Prints a table; ``--out DIR`` also writes
``DIR/results.json`` (one row per variant and kernel) and ``DIR/meta.json``, the output
``benchmarks.records`` turns into a record. ``--variant`` takes a comma-separated list.

``--compare``: instead, a training call's four kernels compiled as the first step meets them,
in two fresh processes on empty caches: ``serial`` (the forward, then the backward, in the
caller) and ``ahead`` (``compile_pool.ahead`` sends the backward to a worker, the caller
compiles the forward, then waits), seconds from the first compile to the last.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _ptxas() -> str | None:
    try:
        import triton
    except ImportError:
        return shutil.which("ptxas")
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return str(path) if path.exists() else shutil.which("ptxas")


class _Clock:
    """Wraps ``cute.compile`` and the DSL's compiler call; one record per ``cute.compile``."""

    def __init__(self):
        self.records: list[dict] = []
        self.spent = {"backend": 0.0, "jit": 0.0}

    def install(self):
        import cutlass.cute as cute
        from cutlass.base_dsl import compiler, dsl as base

        real_compile = cute.compile
        clock = self

        def timed_compile(kernel, *args, **kw):
            clock.spent = {"backend": 0.0, "jit": 0.0}
            t0 = time.perf_counter()
            out = real_compile(kernel, *args, **kw)
            total = time.perf_counter() - t0
            backend = clock.spent["backend"]
            jit = max(clock.spent["jit"] - backend, 0.0)  # compile_and_jit wraps the passes
            clock.records.append({"kernel": type(kernel).__name__, "total_s": total,
                                  "backend_s": backend, "jit_s": jit,
                                  "python_s": total - backend - jit})
            return out

        def wrap(method, field):
            def timed(self, *a, **kw):
                t0 = time.perf_counter()
                try:
                    return method(self, *a, **kw)
                finally:
                    clock.spent[field] += time.perf_counter() - t0
            return timed

        real = (real_compile, compiler.Compiler.compile, base.BaseDSL.compile_and_jit)
        cute.compile = timed_compile
        # The pass pipeline (MLIR passes, LLVM NVPTX, ptxas: one C++ call, pm.run) and, around
        # it on the JIT path, building the host execution engine.
        compiler.Compiler.compile = wrap(compiler.Compiler.compile, "backend")
        base.BaseDSL.compile_and_jit = wrap(base.BaseDSL.compile_and_jit, "jit")

        def uninstall():  # so that a later clock (the next variant) is the only one timing
            cute.compile, compiler.Compiler.compile, base.BaseDSL.compile_and_jit = real
        return uninstall


def measure(variant: str, head_dim: int) -> dict:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    cache = tempfile.mkdtemp(prefix="flexjit-compile-time-")
    os.environ["FLEXJIT_CACHE_DIR"] = cache
    t0 = time.perf_counter()
    import torch  # noqa: F401
    t_torch = time.perf_counter()
    from flexjit import config
    config.reload()
    from flexjit.backends.cute import templates
    from flexjit.backends.cute import objects
    from flexjit.integrations import aot
    templates("sm90").fwd, templates("sm90").bwd_host
    t_import = time.perf_counter()
    clock = _Clock()
    uninstall = clock.install()
    exports: list[float] = []
    real_store = objects.store

    def timed_store(key, export):
        t = time.perf_counter()
        try:
            return real_store(key, export)
        finally:
            exports.append(time.perf_counter() - t)
    objects.store = timed_store
    dumps = Path(tempfile.mkdtemp(prefix="flexjit-ptx-"))
    walls = {}
    for pass_ in ("fwd", "bwd"):
        t = time.perf_counter()
        aot.compile_variant(variant, arch="sm_90a", head_dim=head_dim, passes=(pass_,),
                            seq_len=4096, heads=16, out=dumps)
        walls[pass_] = time.perf_counter() - t
    objects.store = real_store
    uninstall()
    ptxas = _ptxas()
    ptx_s = {}
    if ptxas:
        for ptx in sorted(dumps.rglob("*.sm_90a.ptx")):
            t = time.perf_counter()
            subprocess.run([ptxas, "-arch=sm_90a", "-O3", str(ptx), "-o", os.devnull], check=True,
                           capture_output=True)
            ptx_s[ptx.parent.name] = time.perf_counter() - t
    loads = {}
    for key in sorted(p.stem for p in Path(cache, "cute").glob("*.o")):
        t = time.perf_counter()
        objects._load(key)
        loads[key] = time.perf_counter() - t
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(dumps, ignore_errors=True)
    names = {"FlexAttentionFwdSm90": "fwd-main", "FlexAttentionBwdPreSm90": "bwd-pre",
             "FlexAttentionBwdSm90": "bwd-main", "FlexAttentionBwdPostSm90": "bwd-post"}
    for r in clock.records:
        r["part"] = names.get(r["kernel"], r["kernel"])
        r["ptxas_s"] = ptx_s.get(r["part"])
    result = {"variant": variant, "head_dim": head_dim, "import_torch_s": t_torch - t0,
              "import_cutlass_and_templates_s": t_import - t_torch, "wall_s": walls,
              "kernels": clock.records, "export_s": exports, "load_s": list(loads.values())}
    return result


def rows_of(res: dict) -> list[dict]:
    """``measure``'s result as record rows: one per kernel, its export and load beside it."""
    rows = []
    for i, r in enumerate(res["kernels"]):
        rows.append({"variant": res["variant"], "head_dim": res["head_dim"], "kernel": r["part"],
                     "total_s": r["total_s"], "python_s": r["python_s"],
                     "backend_s": r["backend_s"], "ptxas_s": r["ptxas_s"], "jit_s": r["jit_s"],
                     "export_s": res["export_s"][i] if i < len(res["export_s"]) else None,
                     "load_s": res["load_s"][i] if i < len(res["load_s"]) else None})
    return rows


def _meta(argv: list[str], first: dict) -> dict:
    import platform

    from .cold_start import environment

    meta = environment("benchmarks.compile_time", argv)
    del meta["gpu"]  # none is used: the compile targets sm_90a on this CPU
    return {**meta, "device": f"CPU: {platform.processor() or platform.machine()}, "
                              f"{os.cpu_count()} cores",
            "import_torch_s": first["import_torch_s"],
            "import_cutlass_and_templates_s": first["import_cutlass_and_templates_s"]}


def table(res: dict) -> str:
    lines = [f"{res['variant']} D={res['head_dim']} bf16, sm_90a on the CPU; import torch "
             f"{res['import_torch_s']:.1f} s, cutlass + templates "
             f"{res['import_cutlass_and_templates_s']:.1f} s",
             "| kernel | cute.compile s | python (trace → MLIR) s | backend (passes, LLVM, "
             "ptxas) s | ptxas alone s | JIT engine s |", "|---|---|---|---|---|---|"]
    for r in res["kernels"]:
        ptxas = "–" if r["ptxas_s"] is None else f"{r['ptxas_s']:.2f}"
        lines.append(f"| {r['part']} | {r['total_s']:.2f} | {r['python_s']:.2f} | "
                     f"{r['backend_s']:.2f} | {ptxas} | {r['jit_s']:.2f} |")
    lines.append(f"export per object: {', '.join(f'{x:.2f}' for x in res['export_s'])} s; "
                 f"load per object: {', '.join(f'{x:.3f}' for x in res['load_s'])} s; "
                 f"wall fwd {res['wall_s']['fwd']:.1f} s, bwd {res['wall_s']['bwd']:.1f} s")
    return "\n".join(lines)


COMPARE = r"""
import json, os, sys, time
mode, variant, head_dim = sys.argv[1], sys.argv[2], int(sys.argv[3])
import torch
from flexjit.api.attention import prepare_call
from flexjit.backends.cute import sm90, templates
from flexjit.integrations import aot
from flexjit.runtime import compile_pool
templates("sm90").fwd, templates("sm90").bwd_host
score_mod, mask_mod = aot.builtin_variant(variant, 4096, 16)
q, k, v, bm, program, aux = aot._example(score_mod, mask_mod, head_dim, head_dim, torch.bfloat16,
                                         4096, 16, 16)
q.requires_grad_(True)
call = prepare_call(q, k, v, score_mod, bm, None, False, None)
sparse = sm90.block_sparse_args(bm)
t0 = time.perf_counter()
if mode == "ahead":
    compile_pool.ahead("cute", call)
sm90.compile_program(program, q, k, v, sparse, aux,
                     persistent=sm90._persistent_fwd(head_dim, sparse, 4096, owner=bm))
t_fwd = time.perf_counter() - t0
if mode == "ahead":
    compile_pool.wait("cute", call)
sm90.compile_backward(program, q.dtype, head_dim, True, False, aux, head_dim_v=head_dim)
print(json.dumps({"mode": mode, "forward_s": t_fwd, "total_s": time.perf_counter() - t0}))
"""


def compare(variant: str, head_dim: int) -> list[dict]:
    """``--compare``'s two processes (module doc), each on a fresh empty cache."""
    rows = []
    for mode in ("serial", "ahead"):
        cache = tempfile.mkdtemp(prefix="flexjit-compare-")
        env = dict(os.environ, FLEXJIT_CACHE_DIR=cache, CUTE_DSL_ARCH="sm_90a")
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                             env.get("PYTHONPATH", "")])
        res = subprocess.run([sys.executable, "-c", COMPARE, mode, variant, str(head_dim)],
                             env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        shutil.rmtree(cache, ignore_errors=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_time",
                                description=__doc__.split("\n")[0])
    p.add_argument("--variant", default="alibi")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out")
    p.add_argument("--compare", action="store_true", help="serial against ahead-of-need (doc)")
    a = p.parse_args(argv)
    if a.compare:
        for row in compare(a.variant, a.head_dim):
            print(f"{row['mode']:6}: forward compiled after {row['forward_s']:.1f} s, all four "
                  f"kernels after {row['total_s']:.1f} s", flush=True)
        return 0
    results = []
    for variant in a.variant.split(","):
        results.append(measure(variant, a.head_dim))
        print(table(results[-1]), flush=True)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = [row for res in results for row in rows_of(res)]
        argv = sys.argv[1:] if argv is None else list(argv)
        (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / "meta.json").write_text(json.dumps(_meta(argv, results[0]), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
