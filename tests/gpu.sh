#!/usr/bin/env bash
# The GPU tests, in batches that fit one 10-minute device call each (the lent H200).
#
#   source .devbundle/env.sh && export PYTHONPATH=$PWD:$PWD/tests:$PYTHONPATH FLEXJIT_CACHE_DIR=/tmp/fjc &&
#   bash tests/gpu.sh new $OUT       # code that has never run on a GPU first
#   bash tests/gpu.sh cute $OUT      # every sm90 forward and backward test (cute-fwd, cute-bwd: half)
#   bash tests/gpu.sh triton $OUT    # the Triton backend's GPU tests
#   bash tests/gpu.sh training $OUT  # autocast, torch.compile, CUDA graphs, fp32, transformers
#   bash tests/gpu.sh decode $OUT    # the split-KV decode kernel
#   bash tests/gpu.sh broadcast $OUT # the sm90 kernels on a K/V batch broadcast (paged caches too)
#
# Each pytest run gets a wall-clock limit (a hung kernel fails the batch instead of the call)
# and writes its log to $OUT/<batch>-<n>.txt; a summary line per run is printed.
set -u
batch=${1:?usage: gpu.sh new|cute|cute-fwd|cute-bwd|triton|training|decode|broadcast OUT_DIR}
out=${2:?usage: gpu.sh new|cute|cute-fwd|cute-bwd|triton|training|decode|broadcast OUT_DIR}
mkdir -p "$out"
n=0
run() {  # run LIMIT_S pytest-args...   (one after another)
  n=$((n + 1))
  run_as "$batch-$n" "$@"
}
run_as() {  # run_as NAME LIMIT_S pytest-args...   (NAME: the log's name; may run in the background)
  local name=$1 limit=$2; shift 2
  local log="$out/$name.txt"
  timeout "$limit" python -m pytest -q -p no:cacheprovider -m gpu -W ignore "$@" >"$log" 2>&1
  echo "[$name rc=$?] $* :: $(tail -1 "$log")"
}
case $batch in
  new)
    # The newest code's GPU tests, side by side. Point this at the next change before its first
    # GPU run. For the eleventh session: the decode split rule's SHORT_GRID (batch 8 at 4k keys
    # gets 4 splits), which changed after the tenth session's last call. Everything else passed
    # at a7e2446 (gpu-s10-stage0: the ninth session's merges).
    run_as new-1 280 tests/test_decode_gpu.py -k "core_mods and not L16" &
    run_as new-2 280 tests/test_decode_gpu.py -k "core_mods and L16" &
    run_as new-3 280 tests/test_decode_gpu.py -k "not core_mods" &
    wait
    ;;
  cute|cute-fwd|cute-bwd)
    # Processes side by side: the time is the kernels' compiles (one CPU core each). With the
    # forward tests in one process beside five others, that process passed 420 s (seventh
    # session): they are three now. cute = cute-fwd + cute-bwd.
    if [ "$batch" != cute-bwd ]; then
      run_as cute-1 420 tests/test_cute_gpu.py -k "core_mods or d64 or more_head_dims" &
      run_as cute-5 420 tests/test_cute_gpu.py -k "not (core_mods or d64 or more_head_dims)" &
      run_as cute-6 420 tests/test_cute_cache.py &
    fi
    if [ "$batch" != cute-fwd ]; then
      run_as cute-2 300 tests/test_cute_sm90_bwd_gpu.py -k "mods_ragged or rest_of_the_core" &
      run_as cute-3 300 tests/test_cute_sm90_bwd_gpu.py -k "not (mods_ragged or rest_of_the_core or 192)" &
      run_as cute-4 300 tests/test_cute_sm90_bwd_gpu.py -k "192" &
    fi
    wait
    ;;
  triton)
    run 560 tests/test_triton_gpu.py
    ;;
  training)
    run 330 tests/test_training_gpu.py
    ;;
  broadcast)
    # The sm90 kernels on a K/V batch broadcast over the query's (issue #16, kv_batch_broadcast):
    # torch's batch broadcast through the API, and paged prefill / training on the caches.
    run_as broadcast-1 300 tests/test_cute_broadcast_gpu.py -k "broadcast_mods" &
    run_as broadcast-2 300 tests/test_cute_broadcast_gpu.py -k "not broadcast_mods" &
    run_as broadcast-3 300 tests/test_paged_gpu.py &
    wait
    ;;
  decode)
    # The split-KV decode kernel (issue #16): ~45 Triton compiles, three processes side by side.
    run_as decode-1 280 tests/test_decode_gpu.py -k "core_mods and not L16" &
    run_as decode-2 280 tests/test_decode_gpu.py -k "core_mods and L16" &
    run_as decode-3 280 tests/test_decode_gpu.py -k "not core_mods" &
    wait
    ;;
  *)
    echo "unknown batch $batch" >&2
    exit 2
    ;;
esac
