#!/bin/bash
# The GEMMs of both ops against cuBLASLt, one table per dtype, in one run (docs/performance.md,
# "GEMMs against cuBLASLt, by dtype"): bf16 (the gemm_rs producer on the design suite, steady state;
# ag_gemm's GEMM), FP8 with per-tensor scales, FP8 with block scales. After device_build.sh harness.
# Usage: scripts/gemm_tables.sh [path/to/entwine_harness]   (default: the installed package's)
set -u
H=${1:-$(python3 -c 'import entwine_jax, os; print(os.path.join(os.path.dirname(entwine_jax.__file__), "bin", "entwine_harness"))')}
# cuBLASLt 13 comes with JAX's CUDA wheels; the harness links it at run time.
LT=$(find / -name libcublasLt.so.13 -not -path '*/proc/*' 2>/dev/null | head -1)
[ -n "$LT" ] && export LD_LIBRARY_PATH=$(dirname "$LT"):${LD_LIBRARY_PATH:-}
echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); $(date -u +%F)"
for cmd in "energy suite 0.4" "ag bench" "fp8 bench" "fp8block bench"; do
  echo "== entwine_harness $cmd"
  $H $cmd || echo "gemm_tables: 'entwine_harness $cmd' failed (rc $?)"
done
