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
# (3 was a single command: benchmarks.fwd_error_profile --seeds 4.)
# 4: this session's new code's GPU tests (paged, decode, distributed, grad accuracy) beside the
#    forward-error profile over 32 seeds.
# 5: paged after its fix, Triton TMA/WS correctness, the backward's host module; the decode
#    benchmark's target rows; the Triton TMA sweep.
# Issue the next stage at once: the machine is released 30 s after a call.
set -u
stage=${1:?usage: gpu_plan.sh 1|2|4|5 OUT_DIR}
out=${2:?usage: gpu_plan.sh 1|2|4|5 OUT_DIR}
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
  4)
    # This session's new code on the GPU for the first time (tests/gpu.sh new: grad accuracy,
    # paged, decode, distributed at world 1), beside the forward-error profile over 32 seeds
    # (is cute's r_sum centred on 0, with torch's spread?).
    bash tests/gpu.sh new "$work/tests" &
    timeout 250 python3 -m benchmarks.fwd_error_profile --seeds 32 --cases two_tables \
      >"$work/fwd_profile32.txt" 2>&1 &
    wait
    grep '^{' "$work/fwd_profile32.txt" | python3 -c "
import sys, json
for l in sys.stdin:
    d = json.loads(l)
    print(d['impl'], 'r_rms %.4g' % d['r_rms'], 'r_sum mean %.3f std %.3f (expected std %.3f)' % (
        d['r_sum'], d['r_sum_std'], d['r_rms'] * d['rows'] ** 0.5))"
    ;;
  5)
    # Fixes and the rest of the new code on the GPU, side by side: paged (its device check
    # failed every test in stage 4), the Triton TMA / warp-specialised kernels (never run), the
    # backward through its new host module (a pure move, SASS-identical); then alone on the
    # GPU the decode benchmark's target rows and the Triton TMA sweep beside torch Flex-Triton.
    pt 200 paged.txt tests/test_paged_gpu.py &
    pt 200 decode_paged.txt tests/test_decode_gpu.py -k paged &
    pt 200 tma.txt tests/test_triton_gpu.py -k tma_and_warp_specialize &
    pt 240 bwdhost.txt tests/test_cute_sm90_bwd_gpu.py -k "rest_of_the_core or through_the_api or captured or deterministic" &
    wait
    timeout 100 python3 -m benchmarks.decode --out "$work/decode" --batch 8,64 --kv 32k,128k \
      --variants causal --budget-s 80 >"$work/decode.txt" 2>&1
    echo "[decode rc=$?]"; tail -30 "$work/decode.txt"
    timeout 150 python3 -m benchmarks.tune_triton --grid tma --torch --out "$work/tma" \
      --variants full,causal,document,softcap --budget-s 135 >"$work/tma.txt" 2>&1
    echo "[tma rc=$?]"; tail -40 "$work/tma.txt"
    ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
tar czf "$out/stage$stage.tgz" -C "$work" .
echo "stage $stage done: $out/stage$stage.tgz"
