#!/bin/bash
# End-to-end A/B on the GPUs of one host: installs each wheel .devbin/<name>/*.whl, overlays the
# current Python sources, and runs `python -m entwine_jax.bench --suite design` RUNS times per wheel,
# the wheels alternating. Usage: [RUNS=2] scripts/ab_e2e.sh NAME... ; JSON under $OUT (or /tmp/ab).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
LOGS=${OUT:-/tmp/ab}
mkdir -p "$LOGS" /tmp/ab_logs
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for v in "$@"; do
  python3 -m pip install -q --upgrade --no-deps --no-index --no-compile --target /tmp/e2e_$v "$REPO"/.devbin/$v/*.whl || exit 1
  cp "$REPO"/entwine_jax/*.py "$REPO"/entwine_jax/*.json /tmp/e2e_$v/entwine_jax/ 2>/dev/null
done
SUMMARY="$LOGS/e2e_summary.txt"; : > "$SUMMARY"
for r in $(seq 1 "${RUNS:-2}"); do
  for v in "$@"; do
    (cd /tmp && PYTHONPATH=/tmp/e2e_$v timeout 300 python3 -P -m entwine_jax.bench --suite design \
      --json "$LOGS/e2e_${v}_r$r.json" > /tmp/ab_logs/e2e_${v}_r$r.log 2>&1)
    echo "== $v run $r rc=$?" >> "$SUMMARY"
    grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ \||geomean" /tmp/ab_logs/e2e_${v}_r$r.log | cut -c1-110 >> "$SUMMARY"
  done
done
cat "$SUMMARY"
