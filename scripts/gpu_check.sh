#!/bin/bash
# GPU checks of the fused path on the machine this runs on (one H200: one process + W processes
# sharing it; two H200s: also one process per GPU). Installs a wheel given as $1 (optional) into
# /tmp/site, then runs the GPU tests from outside the source tree so the installed package is used.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -ge 1 ] && [ -n "$1" ]; then
  python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site "$1" || exit 1
  export PYTHONPATH=/tmp/site
fi
# Tests that need more GPUs than this machine has skip; fewer GPUs visible than nvidia-smi lists fails.
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
export ENTWINE_REQUIRE_GPUS=${ENTWINE_REQUIRE_GPUS:-$((GPUS > 0 ? GPUS : 1))}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd /tmp
python3 -P -c "import entwine_jax, entwine_jax._entwine as e; print('entwine_jax from', entwine_jax.__file__)"
SEL=${ENTWINE_GPU_TESTS:-"gpu or multigpu"}
timeout ${ENTWINE_GPU_TIMEOUT:-540} python3 -P -m pytest -p no:cacheprovider -q -rfEs "$REPO/tests/test_gpu_gemm_rs.py" "$REPO/tests/test_gpu_layers.py" "$REPO/tests/test_moe_fp8.py" -m "$SEL" "${@:2}" 2>&1 | tail -40
