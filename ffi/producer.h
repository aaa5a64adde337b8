// Entry points of the producer instantiations (one per translation unit, see producer.cuh).
#pragma once

#include "gemm_rs.h"

namespace entwine::producer {

#define ENTWINE_DECLARE_PRODUCER(NAME)                                                               \
  cudaError_t prepare_##NAME();                                                                      \
  cudaError_t launch_##NAME(ProblemShape const& s, GemmRsConfig const& c, ProducerArgs const& a,     \
                            cudaStream_t stream);

ENTWINE_DECLARE_PRODUCER(bf16_n128)
ENTWINE_DECLARE_PRODUCER(bf16_n256)
ENTWINE_DECLARE_PRODUCER(fp16_n128)
ENTWINE_DECLARE_PRODUCER(fp16_n256)

#undef ENTWINE_DECLARE_PRODUCER

}  // namespace entwine::producer
