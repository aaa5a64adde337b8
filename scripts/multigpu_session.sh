#!/bin/bash
# The several-GPU session (nvidia-h200-x2, -x4 or -x8): build once, then every end-to-end number that
# only real NVLink gives, each step bounded, a one-line summary per step, logs and JSON in $OUT.
# Usage (on the lent machine, from the repository root, .whl/ carried):
#   bash scripts/multigpu_session.sh [steps]     # steps: comma list, default all (see STEPS below)
# W is the machine's GPU count. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
W=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$W" -ge 2 ] || { echo "multigpu_session: needs 2 or more GPUs, found $W"; exit 2; }
STEPS=${1:-build,gemm_rs,ag_gemm,mlp,ranks_procs,ranks_one,train_step,grouped}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
T0=$SECONDS
step() { [[ ",$STEPS," == *",$1,"* ]]; }
say() { echo "== $1 ($((SECONDS - T0)) s)"; }

if step build; then
  say build; bash "$REPO/scripts/device_build.sh" harness | tail -1
fi
export PYTHONPATH=/tmp/site
cd /tmp
if step gemm_rs; then  # the design suite, W = every GPU, one process
  say "gemm_rs design suite W=$W"
  timeout 900 python3 -P "$REPO/benchmarks/bench.py" --suite design --world "$W" --profile \
    --json "$OUT/gemm_rs_w$W.json" > "$OUT/gemm_rs_w$W.log" 2>&1; tail -3 "$OUT/gemm_rs_w$W.log"
fi
if step ag_gemm; then  # both layouts against XLA's all-gather + GEMM and the windowed einsum
  say "ag_gemm W=$W"
  timeout 900 python3 -P "$REPO/benchmarks/bench.py" --op ag_gemm --layout rows,contraction --world "$W" \
    --json "$OUT/ag_gemm_w$W.json" > "$OUT/ag_gemm_w$W.log" 2>&1; tail -3 "$OUT/ag_gemm_w$W.log"
fi
if step mlp; then  # the SwiGLU block against plain XLA, windowed einsum and the perfect-overlap bound
  say "mlp W=$W"
  timeout 900 python3 -P "$REPO/benchmarks/bench.py" --op mlp --layout rows,hidden --world "$W" \
    --json "$OUT/mlp_w$W.json" > "$OUT/mlp_w$W.log" 2>&1; tail -3 "$OUT/mlp_w$W.log"
  say "mlp W=$W, one process per GPU"
  timeout 900 python3 -P "$REPO/benchmarks/bench.py" --op mlp --layout rows,hidden --processes "$W" \
    --gpus "$W" --json "$OUT/mlp_w${W}_procs.json" > "$OUT/mlp_w${W}_procs.log" 2>&1; tail -3 "$OUT/mlp_w${W}_procs.log"
fi
if step ranks_procs; then  # every multi-process suite, one process per GPU
  say "gpu_ranks W=$W, one process per GPU"
  timeout 1500 python3 -P "$REPO/tests/gpu_ranks.py" --world "$W" --gpus "$W" --suite all \
    > "$OUT/ranks_w$W.log" 2>&1; tail -1 "$OUT/ranks_w$W.log" | cut -c1-1500
fi
if step ranks_one; then  # the GPU pytest: one process driving every GPU, W processes, multigpu marks
  say "GPU pytest (ENTWINE_REQUIRE_GPUS=$W)"
  ENTWINE_GPU_TIMEOUT=900 bash "$REPO/scripts/gpu_check.sh" "" > "$OUT/gpu_tests.log" 2>&1; tail -3 "$OUT/gpu_tests.log"
fi
if step train_step; then  # the sequence-parallel training step, fused against XLA
  say "train_step sp-gpu"
  timeout 900 python3 -P "$REPO/examples/train_step.py" --preset sp-gpu > "$OUT/train_step.log" 2>&1
  tail -5 "$OUT/train_step.log"
fi
if step grouped; then  # the grouped ag_gemm's GEMM and weight copy (one GPU; its W > 1 row is not written yet)
  say "grouped ag_gemm (one GPU)"
  timeout 300 python3 -P "$REPO/benchmarks/bench_grouped.py" > "$OUT/grouped.log" 2>&1; tail -4 "$OUT/grouped.log"
fi
say done
