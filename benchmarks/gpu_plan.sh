#!/usr/bin/env bash
# A whole GPU session's measurements in three device calls of < 10 minutes each, written so that
# each call returns ONE file ($OUT/stageN.tgz: the device returns at most 8 files). The fourth
# session ran it as is (benchmarks/results/2026-11-30-gpu-s4-NOTES.md: ~15 of the 30 minutes).
#
#   source .devbundle/env.sh && export PYTHONPATH=$PWD:$PWD/tests:$PYTHONPATH FLEXJIT_CACHE_DIR=/tmp/fjc &&
#   FLEXJIT_GIT_SHA=<commit> bash benchmarks/gpu_plan.sh 1 $OUT     # then 2, then 3
#
# 1: the GPU tests of code no GPU has run yet (tests/gpu.sh new; up to 530 s of pytest).
# 2: the full benchmark with the final code, forward and forward+backward, every baseline, and
#    deterministic mode beside the default (issues #4, #5, #6: numbers from one run).
# 3: ncu where targets are missed: the sm90 forward (full beside FA4's own kernel on the same
#    [B, H, S, D] memory: same tiles and the same hot-loop SASS, yet 12% faster; causal beside
#    ALiBi; document; sliding window), the sm90 backward (causal, window, document) and the
#    Triton forward (#4's misses). ~25 s per case.
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
    timeout 200 bash benchmarks/profile_kernels.sh "$work/ncu_fwd.txt" cute:full:8192:fwd \
      fa4-bhsd:full:8192:fwd cute:causal:8192:fwd cute:alibi:8192:fwd cute:document:8192:fwd \
      cute:sliding_window:8192:fwd
    timeout 150 bash benchmarks/profile_kernels.sh "$work/ncu_bwd.txt" cute:causal:8192:fwdbwd \
      cute:sliding_window:8192:fwdbwd cute:document:8192:fwdbwd
    timeout 180 bash benchmarks/profile_kernels.sh "$work/ncu_triton.txt" triton:full:8192:fwd \
      triton:alibi:8192:fwd triton:document:8192:fwd triton:sliding_window:2048:fwd
    ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
tar czf "$out/stage$stage.tgz" -C "$work" .
echo "stage $stage done: $out/stage$stage.tgz"
