// The copy-engine pushes' receiver wait and release (comm/transfer.h). Each reads the call's epoch
// from the device, so a CUDA graph can replay it (docs/design.md, "Graph safety").
#include "comm/flag.cuh"
#include "comm/ptx.cuh"
#include "comm/transfer.h"
#include "comm/wait.cuh"

namespace entwine::comm {
namespace {

__global__ void __launch_bounds__(32) wait_receiver(ReceiverWait w) {
  if (threadIdx.x == 0) wait::announce(w.call);
  __syncwarp();
  uint64_t const epoch = ptx::load_relaxed_sys(w.call.epoch);
  wait::wait_flag_warp(w.ready, epoch, w.call, w.timeout_ns, w.error, w.error_mirror, w.rank, w.dest, 0, w.site);
}

__global__ void __launch_bounds__(32) release_flag(uint64_t* flag, CallEpoch call) {
  if (threadIdx.x == 0) {
    uint64_t const epoch = ptx::load_relaxed_sys(call.epoch);
    ptx::fence_acq_rel_sys();
    flag::store(flag, call, epoch);
  }
}

}  // namespace

cudaError_t launch_wait_receiver(const ReceiverWait& wait, cudaStream_t stream) {
  wait_receiver<<<1, 32, 0, stream>>>(wait);
  return cudaGetLastError();
}

cudaError_t launch_release(uint64_t* flag, const CallEpoch& call, cudaStream_t stream) {
  release_flag<<<1, 32, 0, stream>>>(flag, call);
  return cudaGetLastError();
}

cudaError_t prepare_transfer_kernels() {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, wait_receiver);
  return err != cudaSuccess ? err : cudaFuncGetAttributes(&attr, release_flag);
}

}  // namespace entwine::comm
