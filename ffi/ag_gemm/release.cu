// The release of one pushed chunk: a one-warp kernel, run on the transfer stream after the chunk's
// copy (so after the copy engine has completed its writes), that makes them visible system-wide
// with one fence and then stores the epoch into the receiver's flag (docs/design.md, "Memory
// ordering"). A stream memory operation (cuStreamWriteValue64) in its place let the GEMM on the
// receiving side observe the flag before the chunk's data (seen with two processes sharing one
// H200), so the release is an SM instruction sequence, like gemm_rs's producer publish.
#include "ag_gemm/ag_gemm.h"
#include "common/ptx.cuh"

namespace entwine {
namespace {

__global__ void __launch_bounds__(32) release_chunk(uint64_t* flag, uint64_t epoch) {
  if (threadIdx.x == 0) {
    ptx::fence_acq_rel_sys();
    ptx::store_relaxed_sys(flag, epoch);
  }
}

}  // namespace

cudaError_t launch_release(uint64_t* flag, uint64_t epoch, cudaStream_t stream) {
  release_chunk<<<1, 32, 0, stream>>>(flag, epoch);
  return cudaGetLastError();
}

cudaError_t prepare_release_kernel() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, release_chunk);
}

}  // namespace entwine
