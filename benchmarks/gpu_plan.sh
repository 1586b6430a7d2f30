#!/usr/bin/env bash
# The next GPU session's measurements, in three device calls of < 10 minutes each, written so
# that each call returns ONE file ($OUT/stageN.tgz: the device returns at most 8 files).
#
#   source .devbundle/env.sh && export PYTHONPATH=$PWD:$PWD/tests:$PYTHONPATH FLEXJIT_CACHE_DIR=/tmp/fjc &&
#   FLEXJIT_GIT_SHA=<commit> bash benchmarks/gpu_plan.sh 1 $OUT     # then 2, then 3
#
# 1: the GPU tests of code no GPU has run yet (tests/gpu.sh new), then ncu of the final sm90
#    forward where issue #5's targets are missed or need a comparison: full beside FA4's own
#    kernel on the same [B, H, S, D] memory (FA4 there was 12% faster: same tiles, same hot-loop
#    SASS, so look at stalls, L2 and DRAM), causal beside ALiBi, document, sliding window.
# 2: the full benchmark with the final code, forward and forward+backward, every baseline, and
#    deterministic mode beside the default (issues #4, #5, #6: numbers from one run).
# 3: ncu of the sm90 backward for the variants whose #6 targets are missed, and of the Triton
#    forward where #4's 1.1x is missed.
# Issue the next stage at once: the machine is released 30 s after a call.
set -u
stage=${1:?usage: gpu_plan.sh 1|2|3 OUT_DIR}
out=${2:?usage: gpu_plan.sh 1|2|3 OUT_DIR}
work=/tmp/gpu_plan_$stage
rm -rf "$work" && mkdir -p "$work"
export PYTHONUNBUFFERED=1
case $stage in
  1)
    bash tests/gpu.sh new "$work/tests"
    timeout 180 bash benchmarks/profile_kernels.sh "$work/ncu_fwd.txt" cute:full:8192:fwd \
      fa4-bhsd:full:8192:fwd cute:causal:8192:fwd cute:alibi:8192:fwd cute:document:8192:fwd \
      cute:sliding_window:8192:fwd
    ;;
  2)
    timeout 420 python3 -m benchmarks.run --out "$work/bench" --S 2k,8k --no-png \
      --variants full,causal,alibi,sliding_window,document,softcap \
      --impls flexjit-cute,flexjit-triton,torch-flex-triton,torch-flex-flash,fa4,fa4-bhsd,cudnn \
      --budget-s 400
    timeout 120 python3 -m benchmarks.run --out "$work/det" --S 8k --no-png --passes fwdbwd \
      --variants full,causal,sliding_window,document --impls flexjit-cute,flexjit-cute-det \
      --budget-s 100
    ;;
  3)
    timeout 300 bash benchmarks/profile_kernels.sh "$work/ncu_bwd.txt" cute:causal:8192:fwdbwd \
      cute:sliding_window:8192:fwdbwd cute:document:8192:fwdbwd
    timeout 240 bash benchmarks/profile_kernels.sh "$work/ncu_triton.txt" triton:full:8192:fwd \
      triton:alibi:8192:fwd triton:document:8192:fwd triton:sliding_window:2048:fwd
    ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
tar czf "$out/stage$stage.tgz" -C "$work" .
echo "stage $stage done: $out/stage$stage.tgz"
