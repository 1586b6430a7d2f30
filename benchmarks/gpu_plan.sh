#!/usr/bin/env bash
# A GPU session's measurements in device calls of < 10 minutes each, written so that each call
# returns ONE file ($OUT/stageN.tgz: the device returns at most 8 files). This is the seventh
# session's plan; earlier sessions' plans are in git history.
#
#   source .devbundle/env.sh && export PYTHONPATH=$PWD:$PWD/tests:$PYTHONPATH FLEXJIT_CACHE_DIR=/tmp/fjc &&
#   python -m compileall -q /tmp/devsite; FLEXJIT_GIT_SHA=<commit> bash benchmarks/gpu_plan.sh 1 $OUT
#
# 1: every GPU test the sixth session left unrun, side by side (compile-bound: one core each):
#    tests/gpu.sh new (gradient accuracy, issue #14; the sm90 backward at 192 and (192, 128),
#    issue #13) and tests/gpu.sh cute (every sm90 test at the default rescale threshold 0); then,
#    alone on the GPU, the 192 head dims' fwd+bwd beside FA4 and flexjit-triton.
# 2: the forward tests that timed out in stage 1 beside the table-gradient probe (issue #14).
# Issue the next stage at once: the machine is released 30 s after a call.
set -u
stage=${1:?usage: gpu_plan.sh 1|2 OUT_DIR}
out=${2:?usage: gpu_plan.sh 1|2 OUT_DIR}
work=/tmp/gpu_plan_$stage
rm -rf "$work" && mkdir -p "$work"
export PYTHONUNBUFFERED=1
pt() {  # pt LIMIT_S LOG pytest-args...
  local limit=$1 log=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -W ignore "$@" >"$work/$log" 2>&1
  echo "[$log rc=$?] $(tail -1 "$work/$log")"
}
bench() {  # bench NAME LIMIT_S benchmarks.run-args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m benchmarks.run --out "$work/$name" --no-png "$@" >"$work/$name.txt" 2>&1
  echo "[$name rc=$?]"; grep -A40 "^| variant" "$work/$name.txt" | grep -E "^\||^\*\*" | tail -40
}
case $stage in
  1)
    bash tests/gpu.sh new "$work/tests" &
    bash tests/gpu.sh cute "$work/tests" &
    wait
    bench dims192 150 --S 2k,8k --d 192,192/128 --variants full,causal --passes fwdbwd \
      --impls flexjit-cute,flexjit-triton,fa4 --budget-s 130
    ;;
  2)
    # The forward tests that passed stage 1's limit (three processes now), beside the table-
    # gradient probe: flexjit-cute's bias2 (fp32 kv table) gradient error read 1.18x torch's
    # over seeds 0-3; per seed, and with each backend's forward feeding the other's backward.
    bash tests/gpu.sh cute-fwd "$work/tests" &
    timeout 400 python3 -m benchmarks.grad_accuracy --S 1024 --seeds 8 --cases two_tables --per-seed \
      --impls flexjit-cute,flexjit-triton,flexjit-cute+triton,flexjit-triton+cute,torch-flex-triton \
      --out "$work/grad_probe" >"$work/grad_probe.txt" 2>&1 &
    wait
    grep -v '^{' "$work/grad_probe.txt" | tail -10
    ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
tar czf "$out/stage$stage.tgz" -C "$work" .
echo "stage $stage done: $out/stage$stage.tgz"
