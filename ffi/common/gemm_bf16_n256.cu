// Producer GEMM instantiation: bf16, 128 x 256 x 64 blocks (one CUTLASS instantiation per file).
#include "common/gemm_kernel.cuh"

ENTWINE_DEFINE_PRODUCER(bf16_n256, cutlass::bfloat16_t, 256)
