#!/bin/bash
# compute-sanitizer (memcheck, racecheck, synccheck) over the kernels on small cases: two virtual
# ranks on one GPU; gemm_rs's producer + consumer, two epochs (entwine_harness sanitize: results and
# the producers' partial outputs checked under every tool), then ag_gemm's pushes, releases and
# GEMM in both layouts (entwine_harness ag sanitize).
# Usage: scripts/sanitize.sh [path/to/entwine_harness]   (default: the installed package's)
set -u
HARNESS=${1:-$(python3 -c 'import entwine_jax, os; print(os.path.join(os.path.dirname(entwine_jax.__file__), "bin", "entwine_harness"))')}
status=0
for tool in memcheck racecheck synccheck; do
  echo "== compute-sanitizer --tool $tool"
  log=$(mktemp)
  # racecheck slows the producer's shared-memory traffic by orders of magnitude: run the producers
  # to completion before the consumers there (it checks hazards inside each kernel).
  mode=""
  [ $tool = racecheck ] && mode=sequential
  timeout ${ENTWINE_SANITIZE_TIMEOUT:-300} compute-sanitizer --tool $tool --error-exitcode 9 "$HARNESS" sanitize $mode >"$log" 2>&1
  rc=$?
  timeout ${ENTWINE_SANITIZE_TIMEOUT:-300} compute-sanitizer --tool $tool --error-exitcode 9 "$HARNESS" ag sanitize >>"$log" 2>&1
  rc2=$?
  [ $rc -eq 0 ] && rc=$rc2
  if [ $rc -eq 0 ]; then
    tail -4 "$log"
  else  # the first reports in full: where, which kernel, which accesses
    grep -v '^PASS' "$log" | head -60
    status=1
  fi
done
echo "sanitize: $([ $status -eq 0 ] && echo clean || echo ERRORS)"
exit $status
