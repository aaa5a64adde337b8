#!/bin/bash
# One device call: install the wheel given as $1 (with the harness), overlay the current Python
# sources, then harness test, GPU tests (a subset), the benchmark suite, and the sanitizers.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site "$1" || exit 1
cp "$REPO"/entwine_jax/*.py "$REPO"/entwine_jax/*.json /tmp/site/entwine_jax/ 2>/dev/null
export PYTHONPATH=/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
H=/tmp/site/entwine_jax/bin/entwine_harness
echo "== harness test"; timeout 80 $H test > /tmp/harness.log 2>&1; echo "rc=$?"; grep -E "FAIL|failure|scatter=cols" /tmp/harness.log
echo "== gpu tests"; ENTWINE_GPU_TIMEOUT=90 bash "$REPO/scripts/gpu_check.sh" "" -k "${GPU_K:-columns or suite_shapes or never_calls or one_process_per_gpu}" 2>&1 | tail -6
echo "== bench"; (cd /tmp && timeout ${BENCH_T:-100} python3 -P -m entwine_jax.bench --suite design --json $OUT/bench.json --plot $OUT/bench.png 2>/dev/null | tail -11)
echo "== sanitize"; ENTWINE_SANITIZE_TIMEOUT=30 bash "$REPO/scripts/sanitize.sh" $H 2>&1 | tail -12
