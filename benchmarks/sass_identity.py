"""Does a refactor change the sm90 kernels? Compile them from two source trees on the CPU and
compare their SASS instruction by instruction (tinygrad's "process replay", for CuTeDSL).

    git worktree add /tmp/before <commit>
    python -m benchmarks.sass_identity /tmp/before .        # prints one line per kernel, exit 1 on a diff

For each tree (in a child process that imports flexjit from that tree alone) it builds, with
CUTE_DSL_ARCH=sm_90a and no GPU, the forward and the backward's main kernel, dense and causal
(``sass_compare._ours``: D=128, bf16), disassembles each cubin with the cuobjdump Triton ships
and keeps the instruction text (addresses stripped). Equal text means the GPU runs the same
kernel, whatever moved in the Python around it.

Then the backward's matrix (``BWD_CASES``), built the way a training step builds it: through
``flexjit.backends.cute_sm90.compile_backward`` (the backend's config choices included:
``overlap_dp`` for light mods, the captured-gradient holes), all three parts (pre, main, post),
with the disk cache off so that every part is compiled here. Head dims 64, 128, 192 and
(192, 128), causal block lists, a learnable relative-bias table and learnable ALiBi slopes
(captured gradients), and the deterministic mode, dense and with heavy mods. The cases use only
interfaces that both trees have (the backend's ``compile_backward``, the tracer, ``mods``), so
an older tree compares too. ``--no-backward-matrix`` leaves them out (about a minute per tree
on two CPU cores).

``--arch sm_100a`` compares the Blackwell kernels instead, by their PTX (no sm_100a disassembler
ships with Triton): the forward and the backward's main and post kernels of ``SM100_CASES``,
compiled from each tree's templates, with ``.loc``/``.file`` lines and comments dropped (they
name source lines, which a refactor moves). About two minutes per tree.

The forward's matrix (``FWD_CASES``) likewise goes through the backend's ``compile_program``:
head dims 32 to 256 and (192, 128), the one-tile-per-CTA and the persistent (dynamic) kernels,
D = 64's three-consumer dense tile, ``write_max``, and the heavy mods. ``--no-forward-matrix``
leaves it out (about a minute per tree).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap

# The backward matrix: (name, head_dim, head_dim_v, mods, deterministic), ``mods`` naming a
# builder in the child. D = 128 is the register-tight tile and (192, 128) the dim split with a
# narrower V; the learnable cases exercise the captured-gradient holes (a per-element and a
# tile-uniform index); "heavy" is softcap + ALiBi + document ids (captured tensors in both
# holes and a runtime scalar), the mods that turn overlap_dp off.
BWD_CASES = (
    ("d64_causal", 64, 64, "causal", False),
    ("d128_dense", 128, 128, "none", False),
    ("d128_causal", 128, 128, "causal", False),
    ("d192_causal", 192, 192, "causal", False),
    ("d192x128_causal", 192, 128, "causal", False),
    ("d128_learnable_bias", 128, 128, "learnable_bias", False),
    ("d64_learnable_alibi", 64, 64, "learnable_alibi", False),
    ("d192_learnable_bias", 192, 192, "learnable_bias", False),
    ("d128_det_dense", 128, 128, "none", True),
    ("d128_det_causal", 128, 128, "causal", True),
    ("d128_det_heavy", 128, 128, "heavy", True),
    ("d192x128_det_causal", 192, 128, "causal", True),
)

# The forward matrix: (name, head_dim, head_dim_v, mods, persistent, write_max). Block-sparse
# whenever the mods have a mask; persistent kernels take the dynamic scheduler (the default).
FWD_CASES = (
    ("d128_dense", 128, 128, "none", False, False),
    ("d128_causal", 128, 128, "causal", False, False),
    ("d128_causal_persistent", 128, 128, "causal", True, False),
    ("d64_dense", 64, 64, "none", False, False),
    ("d64_causal_persistent", 64, 64, "causal", True, False),
    ("d32_causal", 32, 32, "causal", False, False),
    ("d96_causal", 96, 96, "causal", False, False),
    ("d192x128_causal", 192, 128, "causal", False, False),
    ("d256_causal", 256, 256, "causal", False, False),
    ("d128_alibi_write_max", 128, 128, "learnable_alibi", False, True),
    ("d128_heavy_persistent", 128, 128, "heavy", True, False),
)

# The sm100 matrix: (name, head_dim, mods, block-sparse, deterministic, captured gradients).
SM100_CASES = (
    ("d128_dense", 128, "none", False, False, False),
    ("d128_causal", 128, "causal", True, False, False),
    ("d64_causal_det", 64, "causal", True, True, False),
    ("d128_learnable_bias", 128, "learnable_bias", True, False, True),
    ("d128_heavy", 128, "heavy", True, False, False),
)

# A child's imports from its own tree only: no editable install, and flexjit.templates mapped
# to the tree's templates/ folder as its pyproject maps it. It replaces each child's ``# {this tree}`` line, after ``tree`` is set.
_THIS_TREE = textwrap.dedent('''
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # this tree only
    sys.path.insert(0, tree)
    import importlib, importlib.abc, importlib.util


    class TreeTemplates(importlib.abc.MetaPathFinder):
        """flexjit.templates from this tree's templates/ folder (what its pyproject maps)."""

        def find_spec(self, name, path, target=None):
            if name != "flexjit.templates" and not name.startswith("flexjit.templates."):
                return None
            base = os.path.join(tree, "templates", *name.split(".")[2:])
            if os.path.isdir(base):
                return importlib.util.spec_from_file_location(
                    name, os.path.join(base, "__init__.py"), submodule_search_locations=[base])
            if os.path.exists(base + ".py"):
                return importlib.util.spec_from_file_location(name, base + ".py")
            return None
    sys.meta_path.insert(0, TreeTemplates())
''')

_CHILD_SM100 = textwrap.dedent('''
    import json, os, re, sys, tempfile
    tree, cases = sys.argv[1], json.loads(sys.argv[2])
    # {this tree}
    os.environ["FLEXJIT_CACHE_DIR"] = tempfile.mkdtemp()
    import cutlass, torch
    from flexjit import mods as fmods
    from flexjit.backends.cute.sm90 import _aux_tensor, load_mods
    from flexjit.ir.passes import lower
    from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, trace_mod
    fwd = importlib.import_module("flexjit.templates.cute.sm100.fwd")
    bwd = importlib.import_module("flexjit.templates.cute.sm100.bwd")

    def text(compiled):
        ptx = compiled.__ptx__
        if len(ptx) < 4096 and os.path.exists(ptx):
            ptx = open(ptx).read()
        return [line.strip() for line in ptx.splitlines() if line.strip()
                and not re.match(r"\\s*(\\.loc|\\.file|//)", line)]

    torch.manual_seed(0)
    H, L = 4, 500
    docs = torch.randint(0, 3, (L,)).sort().values

    def heavy_score(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def heavy_mask(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)
    builders = {"none": lambda: (None, None), "causal": lambda: (None, fmods.causal()),
                "learnable_bias": lambda: (fmods.relative_bias(torch.randn(H, 33).requires_grad_(True)),
                                           fmods.causal()),
                "heavy": lambda: (heavy_score, heavy_mask)}
    out = {}
    for name, d, mods, sparse, deterministic, grads in cases:
        score_mod, mask_mod = builders[mods]()
        program = lower(trace_mod(score_mod, SCORE_MOD) if score_mod else None,
                        trace_mod(mask_mod, MASK_MOD) if mask_mod else None, float_index=True)
        m = load_mods(program)
        aux = tuple(_aux_tensor(t, torch.device("cpu")) for t in program.buffers)
        opts = f"--keep-ptx --dump-dir {tempfile.mkdtemp()}"
        if not deterministic and not grads:
            cfg = fwd.FwdConfig(d, d, cutlass.BFloat16, m.score_mod, m.mask_mod, has_block_mask=sparse,
                                score_loads=bool(program.buffers) and score_mod is not None)
            q = torch.randn(2, H, L, d, dtype=torch.bfloat16)
            out[f"sm100_fwd_{name}"] = text(fwd.compile_fwd(cfg, q, aux, program.scalars, options=opts).compiled)
        cfg = bwd.BwdConfig(d, d, cutlass.BFloat16, m.score_mod_and_grad, m.mask_mod, has_block_mask=sparse,
                            deterministic=deterministic,
                            score_grads=getattr(m, "score_grads", None) if grads else None,
                            grad_offsets=getattr(m, "grad_offsets", None) if grads else None)
        fn = bwd.compile_bwd(cfg, aux, program.scalars, options=opts, parts=("main", "post"))
        for part, compiled in fn.parts.items():
            out[f"sm100_bwd_{name}_{part}"] = text(compiled.compiled)
    print(json.dumps(out))
''')

_CHILD = textwrap.dedent('''
    import json, os, pathlib, re, subprocess, sys, tempfile
    tree, matrix, fwd_matrix = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    # {this tree}
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["FLEXJIT_CACHE_DIR"] = tempfile.mkdtemp()
    os.environ["CUTE_DSL_KEEP"] = "cubin"  # each compiled part keeps its cubin (``__cubin__``)
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp()
    import triton
    from benchmarks import sass_compare
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"

    def instructions(cubin):
        sass = subprocess.run([str(cuobjdump), "-sass", cubin], capture_output=True, text=True).stdout
        return [re.sub(r"/\\*[0-9a-f]{4,}\\*/", "", line).strip()
                for line in sass.splitlines() if line.strip().startswith("/*")]

    out = {}
    for pass_ in ("fwd", "bwd"):
        for causal in (False, True):
            cubin = sass_compare._ours(pass_, causal, tempfile.mkdtemp())
            out[f"{pass_}_{'causal' if causal else 'dense'}"] = instructions(cubin)
    if matrix or fwd_matrix:
        import torch
        from flexjit import mods as fmods
        os.environ["FLEXJIT_CACHE"] = "0"  # compile every part here, load none
        try:  # the stage-folder layout
            from flexjit.backends.cute import sm90 as cute_sm90
            from flexjit.ir.passes import lower
            from flexjit.frontend.trace import MASK_MOD, SCORE_MOD, trace_mod
            host = importlib.import_module("flexjit.templates.cute.sm90.bwd_host")
        except ImportError:  # the flat layout of older trees
            from flexjit.backends import cute_sm90
            from flexjit.passes import lower
            from flexjit.trace import MASK_MOD, SCORE_MOD, trace_mod
            host = importlib.import_module("flexjit.templates.cute_sm90_bwd_host")
        compile_bwd, built = host.compile_bwd, {}

        def keeping(*args, **kwargs):  # the backend keeps only the FFI functions; keep the parts
            fn = compile_bwd(*args, **kwargs)
            built.update(fn.parts)
            return fn
        host.compile_bwd = keeping
        torch.manual_seed(0)
        H, L = 4, 500

        def learnable_bias():
            table = torch.randn(H, 33).requires_grad_(True)
            return fmods.relative_bias(table), fmods.causal()

        def learnable_alibi():
            return fmods.alibi(torch.rand(H).requires_grad_(True)), fmods.causal()

        def heavy():
            slopes, docs, cap = torch.rand(H), torch.randint(0, 3, (L,)).sort().values, 30.0

            def score_mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap) + slopes[h] * (kv_idx - q_idx)

            def mask_mod(b, h, q_idx, kv_idx):
                return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)
            return score_mod, mask_mod

        builders = {"none": lambda: (None, None), "causal": lambda: (None, fmods.causal()),
                    "learnable_bias": learnable_bias, "learnable_alibi": learnable_alibi,
                    "heavy": heavy}
        for name, d, dv, mods, deterministic in matrix:
            score_mod, mask_mod = builders[mods]()
            program = lower(trace_mod(score_mod, SCORE_MOD) if score_mod else None,
                            trace_mod(mask_mod, MASK_MOD) if mask_mod else None, float_index=True)
            aux = tuple(cute_sm90._aux_tensor(t, torch.device("cpu")) for t in program.buffers)
            built.clear()
            cute_sm90.compile_backward(program, torch.bfloat16, d, mask_mod is not None,
                                       deterministic, aux, head_dim_v=dv)
            for part, compiled in sorted(built.items()):
                path = os.path.join(tempfile.mkdtemp(), "k.cubin")
                pathlib.Path(path).write_bytes(compiled.compiled.__cubin__)
                out[f"bwd_{name}_{part}"] = instructions(path)
        for name, d, dv, mods, persistent, write_max in fwd_matrix:
            score_mod, mask_mod = builders[mods]()
            program = lower(trace_mod(score_mod, SCORE_MOD) if score_mod else None,
                            trace_mod(mask_mod, MASK_MOD) if mask_mod else None, float_index=True)
            aux = tuple(cute_sm90._aux_tensor(t, torch.device("cpu")) for t in program.buffers)
            q = torch.randn(2, H, L, d, dtype=torch.bfloat16)
            k = torch.randn(2, H // 2, L, d, dtype=torch.bfloat16)
            v = torch.randn(2, H // 2, L, dv, dtype=torch.bfloat16)
            lists = None
            if mask_mod is not None:
                n = -(-L // 128)
                ones, idx = torch.ones(1, 1, n, dtype=torch.int32), torch.zeros(1, 1, n, n, dtype=torch.int32)
                lists = (ones, idx, ones.clone(), idx.clone())
            fn = cute_sm90.compile_program(program, q, k, v, lists, aux,
                                           options=f"--keep-cubin --dump-dir {tempfile.mkdtemp()}",
                                           persistent=persistent, write_max=write_max)
            path = os.path.join(tempfile.mkdtemp(), "k.cubin")
            pathlib.Path(path).write_bytes(fn.compiled.__cubin__)
            out[f"fwd_{name}"] = instructions(path)
    print(json.dumps(out))
''')
_CHILD_SM100, _CHILD = (c.replace("# {this tree}\n", _THIS_TREE) for c in (_CHILD_SM100, _CHILD))


def sass_of(tree: str, matrix=BWD_CASES, fwd_matrix=FWD_CASES) -> dict[str, list[str]]:
    res = subprocess.run([sys.executable, "-c", _CHILD, os.path.abspath(tree), json.dumps(matrix),
                          json.dumps(fwd_matrix)],
                         capture_output=True, text=True, cwd=tempfile.gettempdir())
    if res.returncode:
        raise SystemExit(f"building from {tree} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def ptx_of_sm100(tree: str, cases=SM100_CASES) -> dict[str, list[str]]:
    """The sm100 kernels' PTX lines (the source-location lines dropped), built from ``tree``."""
    res = subprocess.run([sys.executable, "-c", _CHILD_SM100, os.path.abspath(tree),
                          json.dumps(cases)], capture_output=True, text=True,
                         cwd=tempfile.gettempdir())
    if res.returncode:
        raise SystemExit(f"building from {tree} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sass_identity", description=__doc__.split("\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--no-backward-matrix", action="store_true",
                   help="only the four sass_compare kernels (fwd/bwd main, dense/causal, D=128)")
    p.add_argument("--no-forward-matrix", action="store_true",
                   help="leave out the forward's matrix (FWD_CASES)")
    p.add_argument("--arch", choices=("sm_90a", "sm_100a"), default="sm_90a",
                   help="sm_100a: compare the Blackwell kernels' PTX (SM100_CASES) instead")
    args = p.parse_args(argv)
    matrix = () if args.no_backward_matrix else BWD_CASES
    fwd_matrix = () if args.no_forward_matrix else FWD_CASES
    if args.arch == "sm_100a":
        a, b = ptx_of_sm100(args.before), ptx_of_sm100(args.after)
    else:
        a, b = sass_of(args.before, matrix, fwd_matrix), sass_of(args.after, matrix, fwd_matrix)
    same = set(a) == set(b)
    for name in sorted(set(a) | set(b)):
        if name not in a:
            print(f"{name}: only in {args.after}")
            continue
        digest = lambda lines: hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]  # noqa: E731
        equal = a[name] == b.get(name) and len(a[name]) > 0  # no SASS read is no proof
        same &= equal
        print(f"{name}: {len(a[name])} / {len(b.get(name, []))} lines, "
              f"{digest(a[name])} / {digest(b.get(name, []))}: {'identical' if equal else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
