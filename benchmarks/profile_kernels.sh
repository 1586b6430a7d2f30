#!/usr/bin/env bash
# Nsight Compute over flexjit's kernels at the benchmark shape (bf16, 16 heads, D=128, 16k
# tokens), one profile_one process per case: where the time goes when a target is missed.
#
#   source .devbundle/env.sh && export PYTHONPATH=$PWD:$PYTHONPATH FLEXJIT_CACHE_DIR=/tmp/fjc &&
#   bash benchmarks/profile_kernels.sh OUT/ncu.txt [case ...]
#
# A case is backend:variant:S:pass[:D] (e.g. cute:causal:8192:fwd, or cute:full:8192:fwdbwd:192 at
# head dim 192; D defaults to 128; backend fa4-bhsd profiles FA4's own
# kernels on the same memory layout: its forward, or its backward's three kernels; an FP8 impl,
# e.g. flexjit-cute-fp8:full:8192:fwd, the e4m3 forward; a flexjit mode, e.g.
# flexjit-cute-bwd-lpt:causal:2048:fwdbwd:64, a pinned backward schedule). Per kernel: Speed Of Light,
# warp stall reasons, and every pipe's utilisation (tensor = wgmma/mma, xu = MUFU: exp2, tanh,
# int<->float conversions; fma/alu = FP32/integer), issue-slot use, and every stall reason per
# issued instruction.
set -u
out=${1:?usage: profile_kernels.sh OUT_FILE [backend:variant:S:pass ...]}
shift
cases=("$@")
if [ ${#cases[@]} -eq 0 ]; then
  cases=(cute:causal:8192:fwd cute:alibi:8192:fwd cute:sliding_window:8192:fwd cute:causal:2048:fwd
         cute:full:8192:fwdbwd cute:causal:8192:fwdbwd triton:causal:8192:fwd triton:causal:8192:fwdbwd)
fi
metrics="regex:sm__pipe_(tensor_op_gmma|tensor_op_hmma|fma|alu|xu|fmaheavy)_cycles_active.avg.pct_of_peak_sustained_active"
metrics+=",regex:sm__inst_executed_pipe_(xu|fma|alu|lsu|uniform).avg.pct_of_peak_sustained_active"
metrics+=",sm__instruction_throughput.avg.pct_of_peak_sustained_active"
# Every stall reason, as warps stalled per issued instruction (they add up to the warp cycles per
# issued instruction): what a latency-bound loop waits on.
metrics+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"
for c in "${cases[@]}"; do
  IFS=: read -r backend variant S pass D <<<"$c"
  D=${D:-128}
  if [ "$pass" = fwd ]; then
    # Three forward calls: profile the third (compiled, caches warm).
    sel=(-k "regex:flex_fwd|FlexAttentionFwd|FlashAttentionForward" -s 2 -c 1)
  else
    # Three forward+backward calls: profile every backward kernel of the second.
    case $backend in
      cute|flexjit-cute*) sel=(-k "regex:Bwd" -s 3 -c 3) ;;  # pre, main, post
      fa4*) sel=(-k "regex:FlashAttentionBackward" -s 3 -c 3) ;;  # FA4's pre, main, post
      *) sel=(-k "regex:flex_bwd" -s 2 -c 2) ;;
    esac
  fi
  echo "=== $c" >>"$out"
  timeout 150 ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section LaunchStats --section Occupancy --metrics "$metrics" "${sel[@]}" \
    python3 -m benchmarks.profile_one --backend "$backend" --variant "$variant" --S "$S" \
    --D "$D" --pass "$pass" >>"$out" 2>&1 || echo "(ncu exited $?)" >>"$out"
done
