// moe_dispatch_gemm's transfers on the copy engines: one source's segments for one destination, each
// copied into the destination's inbox and released by a one-warp kernel; every kernel reads the
// call's epoch from the device, so a CUDA graph can replay it (docs/design.md, "Graph safety").
// The release is an SM sequence (system fence, then the stamp), not a stream memory operation, for
// the reason ag_gemm's transfers give (a stream write could be seen before the copy's data).
#include "comm/flag.cuh"
#include "comm/ptx.cuh"
#include "comm/wait.cuh"
#include "moe/moe.h"

namespace entwine {
namespace {

// Opens a transfer: announces this rank's call first (its own GEMM may not have started: it needs
// SMs that waiting kernels could hold, and a receiver waits for this announcement), then waits,
// bounded, until the destination has announced the call: it has finished reading its inbox in
// every earlier call.
__global__ void __launch_bounds__(32) wait_receiver(MoeTransferArgs a) {
  if (threadIdx.x == 0) wait::announce(a.call);
  __syncwarp();
  uint64_t const epoch = ptx::load_relaxed_sys(a.call.epoch);
  wait::wait_flag_warp(a.ready, epoch, a.call, a.timeout_ns, a.error, a.error_mirror, a.rank, a.dest, 0,
                       kMoeWaitInboxReady);
}

// After the stream's copy of one segment completed: one system fence, then the stamp into the
// destination's flag (docs/design.md, "Memory ordering").
__global__ void __launch_bounds__(32) release_segment(uint64_t* flag, CallEpoch call) {
  if (threadIdx.x == 0) {
    uint64_t const epoch = ptx::load_relaxed_sys(call.epoch);
    ptx::fence_acq_rel_sys();
    flag::store(flag, call, epoch);
  }
}

}  // namespace

namespace moe {

// Segment e of the destination d holds rows x_send[d * E_local + e] of this source, at source slot
// `rank` of expert e's A: experts in order, the order in which every receiver's GEMM takes them.
// A failed receiver wait does not stop the copies (stream order has no branch): they land in an
// inbox whose owner is past this call or failing, and the flags they release carry this call's
// stamp, which only this call reads; every output of a failed call is poisoned.
cudaError_t launch_push_copy(const MoePlan& plan, const MoeTransferArgs& a, cudaStream_t stream) {
  wait_receiver<<<1, 32, 0, stream>>>(a);
  cudaError_t err = cudaGetLastError();
  int const e_local = plan.e_local, world = plan.shape.world;
  for (int e = 0; e < e_local && err == cudaSuccess; ++e) {
    char const* from = static_cast<char const*>(a.x_send) + (int64_t(a.dest) * e_local + e) * plan.slice_bytes;
    char* to = a.inbox + (int64_t(e) * world + a.rank) * plan.slice_bytes;
    err = cudaMemcpyAsync(to, from, plan.slice_bytes, cudaMemcpyDeviceToDevice, stream);
    if (err == cudaSuccess) {
      release_segment<<<1, 32, 0, stream>>>(a.flags + int64_t(a.rank) * e_local + e, a.call);
      err = cudaGetLastError();
    }
  }
  return err;
}

cudaError_t prepare_transfer_kernels() {
  cudaFuncAttributes attr;
  cudaError_t const err = cudaFuncGetAttributes(&attr, wait_receiver);
  return err != cudaSuccess ? err : cudaFuncGetAttributes(&attr, release_segment);
}

}  // namespace moe

}  // namespace entwine
