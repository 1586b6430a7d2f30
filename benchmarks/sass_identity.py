"""Does a refactor change the sm90 kernels? Compile them from two source trees on the CPU and
compare their SASS instruction by instruction (tinygrad's "process replay", for CuTeDSL).

    git worktree add /tmp/before <commit>
    python -m benchmarks.sass_identity /tmp/before .        # prints one line per kernel, exit 1 on a diff

For each tree (in a child process that imports flexjit from that tree alone) it builds, with
CUTE_DSL_ARCH=sm_90a and no GPU, the forward and the backward's main kernel, dense and causal
(``sass_compare._ours``: D=128, bf16), disassembles each cubin with the cuobjdump Triton ships
and keeps the instruction text (addresses stripped). Equal text means the GPU runs the same
kernel, whatever moved in the Python around it.
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

_CHILD = textwrap.dedent('''
    import json, os, pathlib, re, subprocess, sys, tempfile
    tree = sys.argv[1]
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # this tree only
    sys.path.insert(0, tree)
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["FLEXJIT_CACHE_DIR"] = tempfile.mkdtemp()
    import triton
    from benchmarks import sass_compare
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    out = {}
    for pass_ in ("fwd", "bwd"):
        for causal in (False, True):
            cubin = sass_compare._ours(pass_, causal, tempfile.mkdtemp())
            sass = subprocess.run([str(cuobjdump), "-sass", cubin], capture_output=True, text=True).stdout
            out[f"{pass_}_{'causal' if causal else 'dense'}"] = [
                re.sub(r"/\\*[0-9a-f]{4,}\\*/", "", line).strip()
                for line in sass.splitlines() if line.strip().startswith("/*")]
    print(json.dumps(out))
''')


def sass_of(tree: str) -> dict[str, list[str]]:
    res = subprocess.run([sys.executable, "-c", _CHILD, os.path.abspath(tree)], capture_output=True,
                         text=True, cwd=tempfile.gettempdir())
    if res.returncode:
        raise SystemExit(f"building from {tree} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sass_identity", description=__doc__.split("\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    args = p.parse_args(argv)
    a, b = sass_of(args.before), sass_of(args.after)
    same = True
    for name in sorted(a):
        digest = lambda lines: hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]  # noqa: E731
        equal = a[name] == b.get(name)
        same &= equal
        print(f"{name}: {len(a[name])} / {len(b.get(name, []))} instructions, "
              f"{digest(a[name])} / {digest(b.get(name, []))}: {'identical' if equal else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
