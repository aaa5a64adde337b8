// The two small kernels of ag_gemm's transfer streams; each is one warp and reads the call's epoch
// from the device, so a CUDA graph can replay them (docs/design.md, "Graph safety").
//  - The handshake opens a transfer stream: it tells the peer that pushes into this rank's inbox
//    that this rank has started the call (so it has finished reading the inbox of every earlier
//    call), then waits, bounded, for the same word from the peer this stream pushes to.
//  - The release follows each chunk's copy (so runs after the copy engine completed its writes): one
//    system fence, then the epoch into the receiver's flag (docs/design.md, "Memory ordering"). A
//    stream memory operation (cuStreamWriteValue64) in its place let the receiving GEMM observe the
//    flag before the chunk's data (two processes sharing one H200): the release is an SM sequence.
#include "ag_gemm/ag_gemm.h"
#include "common/ptx.cuh"
#include "common/wait.cuh"

namespace entwine {
namespace {

__global__ void __launch_bounds__(32) handshake(TransferArgs a) {
  uint64_t const epoch = ptx::load_relaxed_sys(a.call.epoch);
  if (threadIdx.x == 0) {
    // Everything this rank did before the call, its reads of the inbox included, is complete
    // (stream order); the fence orders that before the announcement.
    ptx::fence_acq_rel_sys();
    ptx::store_relaxed_sys(a.announce, epoch);
  }
  wait::wait_flag_warp(a.ready, epoch, a.timeout_ns, a.error, a.error_mirror, a.rank, a.peer, 0,
                       WaitSite::kInboxReady, a.call.trap);
}

__global__ void __launch_bounds__(32) release_chunk(uint64_t* flag, CallEpoch call) {
  if (threadIdx.x == 0) {
    uint64_t const epoch = ptx::load_relaxed_sys(call.epoch);
    ptx::fence_acq_rel_sys();
    ptx::store_relaxed_sys(flag + (epoch & 1) * call.flags_stride, epoch);
  }
}

}  // namespace

cudaError_t launch_handshake(const TransferArgs& args, cudaStream_t stream) {
  handshake<<<1, 32, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_release(uint64_t* flag, const CallEpoch& call, cudaStream_t stream) {
  release_chunk<<<1, 32, 0, stream>>>(flag, call);
  return cudaGetLastError();
}

cudaError_t prepare_transfer_kernels() {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, handshake);
  return err != cudaSuccess ? err : cudaFuncGetAttributes(&attr, release_chunk);
}

}  // namespace entwine
