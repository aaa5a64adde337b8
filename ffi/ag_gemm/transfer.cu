// The two small kernels of ag_gemm's transfer streams; each is one warp and reads the call's epoch
// from the device, so a CUDA graph can replay them (docs/design.md, "Graph safety").
//  - The receiver wait opens a transfer stream: bounded, until the receiver's GEMM has announced
//    the call (so the receiver has finished reading its inbox in every earlier call). The announce
//    is the GEMM's, not a kernel of this stream: a spinning kernel and the copy queued behind it can
//    hold up other streams' work that shares their hardware queue, and the announcement must never
//    wait behind a wait for another rank's announcement.
//  - The release follows each chunk's copy (so runs after the copy engine completed its writes): one
//    system fence, then the epoch into the receiver's flag (docs/design.md, "Memory ordering"). A
//    stream memory operation (cuStreamWriteValue64) in its place let the receiving GEMM observe the
//    flag before the chunk's data (two processes sharing one H200): the release is an SM sequence.
#include "ag_gemm/ag_gemm.h"
#include "comm/ptx.cuh"
#include "comm/wait.cuh"

namespace entwine {
namespace {

__global__ void __launch_bounds__(32) wait_receiver(TransferArgs a) {
  uint64_t const epoch = ptx::load_relaxed_sys(a.call.epoch);
  wait::wait_flag_warp(a.ready, epoch, a.call, a.timeout_ns, a.error, a.error_mirror, a.rank, a.peer, 0,
                       kWaitInboxReady);
}

__global__ void __launch_bounds__(32) release_chunk(uint64_t* flag, CallEpoch call) {
  if (threadIdx.x == 0) {
    uint64_t const epoch = ptx::load_relaxed_sys(call.epoch);
    wait::release_stamp(flag + (epoch & 1) * call.flags_stride, epoch, call);
  }
}

}  // namespace

cudaError_t launch_wait_receiver(const TransferArgs& args, cudaStream_t stream) {
  wait_receiver<<<1, 32, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_release(uint64_t* flag, const CallEpoch& call, cudaStream_t stream) {
  release_chunk<<<1, 32, 0, stream>>>(flag, call);
  return cudaGetLastError();
}

cudaError_t prepare_transfer_kernels() {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, wait_receiver);
  return err != cudaSuccess ? err : cudaFuncGetAttributes(&attr, release_chunk);
}

}  // namespace entwine
