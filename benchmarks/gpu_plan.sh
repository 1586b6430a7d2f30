#!/usr/bin/env bash
# A GPU session's measurements in device calls of < 10 minutes each, written so that each call
# returns ONE file ($OUT/stageN.tgz: the device returns at most 8 files). This is the fifth
# session's plan (issue #18: real training scripts); the fourth's is in git history.
#
#   source .devbundle/env.sh && export PYTHONPATH=$PWD:$PWD/tests:$PYTHONPATH FLEXJIT_CACHE_DIR=/tmp/fjc &&
#   FLEXJIT_GIT_SHA=<commit> bash benchmarks/gpu_plan.sh 1 $OUT     # then 2, then 3
#
# 1: the GPU tests of issue #18 (autocast, torch.compile with inductor/aot_eager/CUDA graphs on
#    cute and Triton, fp32, transformers), the dispatch refactor's GPU paths (the sm90 backward
#    and Triton through the API), and the warm-start probe (where a fresh process's first
#    forward spends its time).
# 2: stage 1's failures again after their fixes, the warm start with byte-compiled sources, and
#    benchmarks/train_step.py: Llama and Gemma 2 training steps with sdpa, eager, flex_attention
#    and flexjit.
# 3: benchmarks/fp32.py with its block-config sweep: flexjit's fp32 Triton kernels beside torch
#    Flex-Triton's under both matmul precisions.
# 4: stage 3's fp32 tables verified: the fp32 test and benchmarks/fp32.py without the sweep.
# 5: issue #12's refactor on the GPU: sm90 tests and the 2k/8k benchmark beside FA4.
# Issue the next stage at once: the machine is released 30 s after a call.
set -u
stage=${1:?usage: gpu_plan.sh 1|2|3 OUT_DIR}
out=${2:?usage: gpu_plan.sh 1|2|3 OUT_DIR}
work=/tmp/gpu_plan_$stage
rm -rf "$work" && mkdir -p "$work"
export PYTHONUNBUFFERED=1
pt() {  # pt LIMIT_S LOG pytest-args...
  local limit=$1 log=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -W ignore "$@" >"$work/$log" 2>&1
  echo "[$log rc=$?] $(tail -1 "$work/$log")"
}
case $stage in
  1)
    pt 330 training.txt tests/test_training_gpu.py
    pt 130 refactor.txt tests/test_cute_sm90_bwd_gpu.py tests/test_triton_gpu.py \
      -k "autograd or through_the_api or dispatch"
    timeout 100 python3 -m benchmarks.warm_start --out "$work/warm" --repeats 2 >"$work/warm.txt" 2>&1
    tail -6 "$work/warm.txt"
    ;;
  2)
    pt 200 training.txt tests/test_training_gpu.py -k "autocast or reduce_overhead"
    # The warm start again, with the bundle's sources byte-compiled first (as pip does at install):
    # stage 1's profile spent 2.0 of the first forward's 2.6 s compiling cutlass-dsl's .py files.
    echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-unset}"
    python3 -m compileall -q -j 8 /tmp/devsite >/dev/null 2>&1
    timeout 100 python3 -m benchmarks.warm_start --out "$work/warm" --repeats 2 >"$work/warm.txt" 2>&1
    tail -4 "$work/warm.txt"
    timeout 400 python3 -m benchmarks.train_step --out "$work/train" --budget-s 330 2>&1 | tail -22
    ;;
  3)
    timeout 540 python3 -m benchmarks.fp32 --out "$work/fp32" --sweep --budget-s 480 2>&1 | tail -12
    ;;
  4)
    # The fp32 tables from stage 3's sweep, measured as a user gets them (no kernel_options).
    pt 120 fp32_test.txt tests/test_training_gpu.py -k fp32
    timeout 300 python3 -m benchmarks.fp32 --out "$work/fp32" --budget-s 260 2>&1 | tail -11
    ;;
  5)
    # Issue #12 (templates split into cute_common, one compile-cache helper, renderer module):
    # the sm90 forward's core mods and the backward through the API, then the benchmark at
    # 2k/8k beside FA4, to compare with the fourth session's run (s4-bench).
    pt 170 cute_fwd.txt tests/test_cute_gpu.py -k core_mods
    pt 90 cute_bwd.txt tests/test_cute_sm90_bwd_gpu.py -k "autograd or through_the_api"
    timeout 150 python3 -m benchmarks.run --out "$work/bench" --S 2k,8k --variants full,causal \
      --impls flexjit-cute,fa4 --no-png --budget-s 125 2>&1 | tail -12
    ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
tar czf "$out/stage$stage.tgz" -C "$work" .
echo "stage $stage done: $out/stage$stage.tgz"
