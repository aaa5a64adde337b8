// The call's last kernel, on XLA's stream once the whole call (every side stream joined) is done:
// it advances the call's epoch, kept in device memory, so the next call's kernels read the next
// epoch. A CUDA graph that replays a call replays this kernel too, which is what makes the calls
// graph safe (docs/design.md, "Graph safety"). When this rank has failed, or a peer raised its
// abort word, it first fills the call's outputs with NaN (all bits set: NaN in bf16, fp16, f32,
// e4m3 and e5m2), so that no output computed after a failure looks plausible, on any rank (docs/design.md,
// "After a failure").
#include "comm/call_end.cuh"
#include "comm/comm.h"

namespace entwine::comm {
namespace {

constexpr int kEndThreads = 256;

__global__ void __launch_bounds__(kEndThreads) end_call(CallEnd end) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = end_failed(end);
  __syncthreads();
  if (failed) poison_outputs(end, int(threadIdx.x), kEndThreads);
  __syncthreads();
  if (threadIdx.x == 0) advance_epoch(end);
}

}  // namespace

cudaError_t launch_end_call(const CallEnd& end, cudaStream_t stream) {
  end_call<<<1, kEndThreads, 0, stream>>>(end);
  return cudaGetLastError();
}

cudaError_t prepare_epoch_kernel() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, end_call);
}

}  // namespace entwine::comm
