// Producer GEMM instantiation: fp16, 128 x 128 x 64 blocks (one CUTLASS instantiation per file).
#include "common/gemm_kernel.cuh"

ENTWINE_DEFINE_PRODUCER(fp16_n128, cutlass::half_t, 128)
