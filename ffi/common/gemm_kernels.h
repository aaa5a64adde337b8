// Entry points of the GEMM instantiations (one per translation unit, see gemm_kernel.cuh): the
// gemm_rs producer and the ag_gemm consumer of each (dtype, BLOCK_N).
#pragma once

#include "ag_gemm/ag_gemm.h"
#include "gemm_rs/gemm_rs.h"

namespace entwine::producer {

#define ENTWINE_DECLARE_PRODUCER(NAME)                                                               \
  cudaError_t prepare_##NAME();                                                                      \
  cudaError_t launch_##NAME(ProblemShape const& s, GemmRsConfig const& c, ProducerArgs const& a,     \
                            cudaStream_t stream);                                                    \
  cudaError_t launch_gather_##NAME(AgProblem const& s, AgGemmConfig const& c, AgPlan const& p,       \
                                   AgGemmArgs const& a, cudaStream_t stream);

ENTWINE_DECLARE_PRODUCER(bf16_n128)
ENTWINE_DECLARE_PRODUCER(bf16_n256)
ENTWINE_DECLARE_PRODUCER(fp16_n128)
ENTWINE_DECLARE_PRODUCER(fp16_n256)

#undef ENTWINE_DECLARE_PRODUCER

}  // namespace entwine::producer
