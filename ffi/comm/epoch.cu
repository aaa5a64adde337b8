// The call's epoch, kept in device memory and advanced in stream order: after every fused call a
// one-thread kernel on XLA's stream adds 1, once the whole call (every side stream joined) is done,
// so the next call's kernels read the next epoch. A CUDA graph that replays a call replays this
// kernel too, which is what makes the calls graph safe (docs/design.md, "Graph safety").
#include "comm/comm.h"

namespace entwine::comm {
namespace {

__global__ void __launch_bounds__(32) advance_epoch(uint64_t* epoch) {
  if (threadIdx.x == 0) *epoch += 1;
}

}  // namespace

cudaError_t launch_advance_epoch(uint64_t* epoch, cudaStream_t stream) {
  advance_epoch<<<1, 32, 0, stream>>>(epoch);
  return cudaGetLastError();
}

cudaError_t prepare_epoch_kernel() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, advance_epoch);
}

}  // namespace entwine::comm
