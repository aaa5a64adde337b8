// Producer GEMM instantiation: fp16, 128 x 256 x 64 blocks (one CUTLASS instantiation per file).
#include "common/gemm_kernel.cuh"

ENTWINE_DEFINE_PRODUCER(fp16_n256, cutlass::half_t, 256)
