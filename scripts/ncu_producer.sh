#!/bin/bash
# Hardware counters of the producer GEMM against XLA's own GEMM on one shape (one GPU, ncu):
# time, DRAM bytes, L2 hit rate and cross-partition (fabric) traffic, L2 and SM throughput, for the
# producer's plain/interleaved orders and raster groups, then XLA's jnp.dot (cuBLAS) on the same
# M x N x K. Usage: scripts/ncu_producer.sh HARNESS M N K [block_n]
# DETAILS=1: instead, the speed-of-light, warp-state, scheduler and memory sections of the
# interleaved r8 producer and of XLA's GEMM (stall reasons, pipe utilisation).
set -u
H=$1; M=$2; N=$3; K=$4; BN=${5:-256}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,\
lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg
SMS=${SMS:-132}  # persistent grid: every SM of an H100/H200 SXM
NCU="ncu --clock-control none --metrics $METRICS"
FILTER="^\s+(gpu__|dram__|lts__|sm__)"
VARIANTS=("1 plain" "8 plain" "1 inter" "8 inter")
if [ -n "${DETAILS:-}" ]; then
  NCU="ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
--section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats"
  FILTER="^    [A-Za-z]"
  VARIANTS=("8 inter")
fi
for v in "${VARIANTS[@]}"; do
  set -- $v
  echo "== producer ${M}x${N}x${K} n$BN r$1 $2"
  $NCU --kernel-name regex:gemm_kernel --launch-skip 2 --launch-count 1 \
    "$H" producer "$M" "$N" "$K" "$BN" "$SMS" "$1" $([ "$2" = plain ] && echo plain) 2>&1 | grep -E "$FILTER"
done
echo "== XLA jnp.dot ${M}x${N}x${K}"
cat > /tmp/xla_dot.py <<PY
import ctypes, jax, jax.numpy as jnp
x = jax.random.normal(jax.random.key(0), ($M, $K), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), ($K, $N), jnp.bfloat16)
dot = jax.jit(lambda a, b: jnp.dot(a, b))
for _ in range(3): dot(x, w).block_until_ready()
cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuProfilerStart(); dot(x, w).block_until_ready(); cuda.cuProfilerStop()
PY
XLA_PYTHON_CLIENT_PREALLOCATE=false $NCU --profile-from-start off --launch-count 1 python3 -P /tmp/xla_dot.py 2>&1 \
  | grep -E "$FILTER|^  [a-zA-Z_].*\(" | head -${LINES_MAX:-200}
