#!/bin/bash
# One device call: install the wheel given as $1 (built with the harness), overlay the current
# Python sources, then: harness test, GPU tests, the benchmark suite (with the GEMM window/tail
# profile), the budget sweep, the harness benchmarks (interleaved rounds, then the producer's steady
# state against cuBLASLt) and the sanitizers. Writes logs, JSON and
# plots to $OUT (default /tmp/out) and prints a short summary of each step.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site "$1" || exit 1
cp -r "$REPO"/entwine_jax/. /tmp/site/entwine_jax/
export PYTHONPATH=/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
H=/tmp/site/entwine_jax/bin/entwine_harness
# The harness loads cuBLASLt (its reference GEMM) at run time: the copy that JAX's CUDA plugin brought.
CUBLAS=$(find / -name 'libcublasLt.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
[ -n "$CUBLAS" ] && export LD_LIBRARY_PATH=$(dirname "$CUBLAS")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "== harness test"; timeout 90 $H test > $OUT/harness_test.log 2>&1; echo "rc=$?"; grep -E "FAIL|failure" $OUT/harness_test.log | tail -3
echo "== gpu tests"; ENTWINE_GPU_TIMEOUT=${GPU_T:-300} bash "$REPO/scripts/gpu_check.sh" "" ${GPU_K:+-k "$GPU_K"} > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log
cd /tmp
echo "== bench"; timeout ${BENCH_T:-150} python3 -P "$REPO"/benchmarks/bench.py --suite design --profile --json $OUT/bench.json --plot $OUT/bench.png 2>/dev/null | tail -21
echo "== sweep"; timeout ${SWEEP_T:-120} python3 -P "$REPO"/benchmarks/bench.py --sweep-budget --json $OUT/sweep.json --plot $OUT/sweep.png 2>/dev/null | tail -17 | cut -c1-80
echo "== harness bench"; timeout 90 $H bench > $OUT/harness_bench.log 2>&1; echo "rc=$?"
echo "== producer steady state"; timeout 200 $H energy suite 1.0 > $OUT/producer_steady.log 2>&1; echo "rc=$?"; tail -9 $OUT/producer_steady.log
echo "== sanitize"; ENTWINE_SANITIZE_TIMEOUT=60 bash "$REPO/scripts/sanitize.sh" $H > $OUT/sanitize.log 2>&1; grep -E "^==|FAIL|SUMMARY|sanitize:" $OUT/sanitize.log
