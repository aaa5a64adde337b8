#!/bin/bash
# Forward progress on one GPU, both ways of sharing it: the gpu_ranks suites time-sliced (plain
# processes) and concurrent (a private CUDA MPS server), one summary line each; logs in $OUT.
# Usage: scripts/concurrency_check.sh "<world>:<suites>[:mps[:percent]]" ...   (after device_build.sh)
# e.g.   scripts/concurrency_check.sh 1:forward 2:forward 2:quick,ag,forward:mps 4:quick:mps:50
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site} XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
for spec in "$@"; do
  IFS=: read -r world suites mps percent <<< "$spec"
  args=(--world "$world" --gpus 1 --suite "$suites" --timeout "${SUITE_TIMEOUT:-150}")
  [ "${mps:-}" = mps ] && args+=(--mps)
  [ -n "${percent:-}" ] && args+=(--mps-percent "$percent")
  log="$OUT/ranks_w${world}_${suites//,/-}_${mps:-ts}${percent:-}.log"
  (cd /tmp && python3 -P "$REPO/tests/gpu_ranks.py" "${args[@]}") > "$log" 2>&1
  tail -1 "$log"
done
