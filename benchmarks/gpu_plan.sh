#!/usr/bin/env bash
# A GPU session's measurements in device calls of < 10 minutes each, written so that each call
# returns ONE file ($OUT/stageN.tgz: the device returns at most 8 files). This is the sixth
# session's plan (issue #13: speed and head dims; #14: max_scores on sm90, gradient accuracy);
# earlier sessions' plans are in git history.
#
#   source .devbundle/env.sh && export PYTHONPATH=$PWD:$PWD/tests:$PYTHONPATH FLEXJIT_CACHE_DIR=/tmp/fjc &&
#   python -m compileall -q /tmp/devsite; FLEXJIT_GIT_SHA=<commit> bash benchmarks/gpu_plan.sh 2 $OUT
#
# (Stage 1 was tests/gpu.sh new + cute and benchmarks.grad_accuracy: gpu-s6-call1.)
# 2: the GPU tests of this session's kernel changes side by side (compile-bound: one core each):
#    max_scores on the sm90 forward, the backward's shorter hot loop (bwd-desc, bwd-desc2);
#    gradient accuracy over four seeds; then, alone on the GPU, the D=128 benchmark of every
#    variant at 2k and 8k beside FA4 and torch Flex-FLASH.
# 3: the new head dims' GPU tests and the lazy-rescale accuracy probe side by side; then GQA
#    (Hkv=4) at D=64 and 128 and the new head dims (32, 96, 192, 192/128) beside FA4.
# 4: Nsight Compute of the backward (every stall reason), ours beside FA4's; long context (32k,
#    128k causal).
# Issue the next stage at once: the machine is released 30 s after a call.
set -u
stage=${1:?usage: gpu_plan.sh 2|3|4 OUT_DIR}
out=${2:?usage: gpu_plan.sh 2|3|4 OUT_DIR}
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
  2)
    pt 330 new.txt tests/test_cute_gpu.py tests/test_triton_gpu.py -k "max_scores or negative_scale" &
    pt 330 bwd_a.txt tests/test_cute_sm90_bwd_gpu.py -k "mods_ragged or rest_of_the_core" &
    pt 330 bwd_b.txt tests/test_cute_sm90_bwd_gpu.py -k "not (mods_ragged or rest_of_the_core)" &
    timeout 330 python3 -m benchmarks.grad_accuracy --S 1024 --seeds 4 --out "$work/grad" >"$work/grad.txt" 2>&1 &
    wait
    grep -v '^{' "$work/grad.txt" | tail -34
    bench bench 240 --S 2k,8k --passes fwd,fwdbwd --impls flexjit-cute,fa4,torch-flex-flash --budget-s 215
    ;;
  3)
    # The new head dims' tests (forward: 32/96 and 192 in two processes; backward 32/96 and 192
    # on Triton), the negative-scale test, and the cute forward's output error with the lazy
    # rescale off, side by side; then the benchmarks alone on the GPU.
    pt 300 hd_fwd_a.txt tests/test_cute_gpu.py -k "(more_head_dims and not 192) or negative_scale" &
    pt 300 hd_fwd_b.txt tests/test_cute_gpu.py -k "more_head_dims and 192" &
    pt 300 hd_bwd.txt tests/test_cute_sm90_bwd_gpu.py -k "more_head_dims or head_dim_192" &
    FLEXJIT_CUTE_RESCALE_THRESHOLD=0 timeout 300 python3 -m benchmarks.grad_accuracy --S 1024 --seeds 2 \
      --impls flexjit-cute,torch-flex-triton --out "$work/grad_rescale0" >"$work/grad_rescale0.txt" 2>&1 &
    wait
    grep -v '^{' "$work/grad_rescale0.txt" | grep -E "out \|" | head -8
    bench gqa 170 --S 8k --hkv 4 --d 64,128 --variants full,causal,document --impls flexjit-cute,fa4,torch-flex-flash --budget-s 150
    bench dims 130 --S 8k --d 32,96,192,192/128 --variants full,causal --impls flexjit-cute,flexjit-triton,fa4 --budget-s 110
    ;;
  4)
    # The forward's speed with the lazy rescale off (it costs 3-10% of output accuracy against
    # torch's kernel, call 3); where the backward's time goes now that its loop is 23% shorter and
    # no faster (Nsight Compute with every stall reason, ours beside FA4's); long context.
    bench rescale 110 --S 2k,8k --variants full,causal,softcap,document --passes fwd \
      --impls flexjit-cute,flexjit-cute-rescale0,fa4 --budget-s 95
    bash benchmarks/profile_kernels.sh "$work/ncu_bwd.txt" cute:full:8192:fwdbwd fa4-bhsd:full:8192:fwdbwd
    python3 -m benchmarks.ncu_summary "$work/ncu_bwd.txt" | tail -8
    bench long128k 100 --S 128k --variants causal --passes fwdbwd --impls flexjit-cute,fa4 --budget-s 80
    bench long 110 --S 32k --variants causal,full,sliding_window,prefix_lm --passes fwdbwd --impls flexjit-cute,fa4 --budget-s 90
    ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
tar czf "$out/stage$stage.tgz" -C "$work" .
echo "stage $stage done: $out/stage$stage.tgz"
