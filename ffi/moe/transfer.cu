// moe_dispatch_gemm's transfers; every kernel reads the call's epoch from the device, so a CUDA
// graph can replay it (docs/design.md, "Graph safety"). Copy engines (config.push_sms = 0): one
// source's segments for one destination, each copied whole (C rows: their sizes are the host's) into
// the destination's inbox between comm's receiver wait and one release per segment (comm/transfer.h).
// SMs (push_sms > 0): one kernel copies the rows sent and releases every segment (push_segments).
#include <algorithm>

#include "comm/ptx.cuh"
#include "comm/push.cuh"
#include "comm/transfer.h"
#include "comm/wait.cuh"
#include "moe/moe.h"

namespace entwine {
namespace {

// moe_transfer's receiver: announce (the peers' transfers into this rank's inbox wait for it), then
// every (source, expert) segment of the peers, warp by warp; a failed wait records the source and
// expert and the rest go on without waiting (the call's outputs are poisoned).
constexpr int kWaitThreads = 256;
__global__ void __launch_bounds__(kWaitThreads) wait_segments(MoeWaitArgs a) {
  if (threadIdx.x == 0) wait::announce(a.call);
  __syncthreads();
  uint64_t const epoch = ptx::load_relaxed_sys(a.call.epoch);
  const uint64_t* const flags = a.flags + int64_t(epoch & 1) * a.call.flags_stride;
  int const warp = threadIdx.x / 32, warps = kWaitThreads / 32;
  bool ok = true;
  for (int i = warp; i < a.world * a.e_local; i += warps) {
    int const source = i / a.e_local, expert = i % a.e_local;
    if (source == a.rank || !ok) continue;
    ok = wait::wait_flag_warp(flags + i, epoch, a.call, a.timeout_ns, a.error, a.error_mirror, a.rank, source, expert,
                              kMoeWaitTransfer);
  }
}

// The SM push, ag_gemm's (ag_gemm/transfer.cu, push_shard: the groups, the release across CTAs;
// comm/push.cuh) with segments for chunks: a group's CTAs copy their shares of each (expert,
// destination) segment, expert-major, so that expert e's segments reach the group's destinations
// before expert e + 1's go anywhere (the receivers' GEMMs take the peers' segments expert by expert),
// then arrive at the segment; the last to arrive releases it. Pitfalls: every CTA of a group
// arrives at every segment of the group, even with nothing to copy or after a failed wait, or the
// counters stop returning to zero; no flag of a destination whose announcement never came is written.
__global__ void __launch_bounds__(kMoePushThreads) push_segments(MoePushArgs a) {
  __shared__ int dest_ok[kMaxWorld];
  // The GEMM, launched after this grid as its programmatic dependent, may start once every CTA of
  // this grid got here. This rank's announcement comes first: the peers' pushes wait for it, and it
  // must not wait behind the GEMM's start, which needs SMs that waiting CTAs may hold.
  if (blockIdx.x == 0 && threadIdx.x == 0) wait::announce(a.call);
  ptx::launch_dependents();
  uint64_t const epoch = ptx::load_relaxed_sys(a.call.epoch);
  push::Group const g = push::group_of(a.world);
  push::wait_destinations(g, dest_ok, a.ready, epoch, a.call, a.timeout_ns, a.error, a.error_mirror, a.rank, a.world,
                          kMoeWaitInboxReady);

  int64_t const stride = int64_t(g.members) * kMoePushThreads;
  int32_t const capacity = int32_t(a.slice_bytes / a.row_bytes);
  for (int e = 0; e < a.e_local; ++e) {
    for (int d = 1 + g.group; d <= g.peers; d += g.groups) {
      int const dest = (a.rank + d) % a.world;
      if (dest_ok[dest]) {
        // Whole blocks of 128 rows: a multiple of 16 bytes whatever k is (C * row_bytes is one).
        int64_t const vectors = segment_rows(a.sent, dest * a.e_local + e, capacity) * a.row_bytes / 16;
        // Rows x_send[dest * E_local + e] into source slot `rank` of the destination's expert e.
        auto const* from = reinterpret_cast<const uint4*>(static_cast<const char*>(a.x_send) +
                                                          (int64_t(dest) * a.e_local + e) * a.slice_bytes);
        auto* to = reinterpret_cast<uint4*>(a.inbox[dest] + (int64_t(e) * a.world + a.rank) * a.slice_bytes);
        push::copy_vectors(from, to, vectors, int64_t(g.member) * kMoePushThreads + threadIdx.x, stride);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        push::arrive(a.arrivals + e * g.peers + (d - 1), g.members, a.flags[dest] + int64_t(a.rank) * a.e_local + e,
                     dest_ok[dest], a.call, epoch);
      }
    }
  }
}

// MoePoolArgs: blockIdx.y is the segment (e, s); its CTAs stride over its 16-byte vectors.
constexpr int kPoolThreads = 256;
__global__ void __launch_bounds__(kPoolThreads) copy_pool_segments(MoePoolArgs a) {
  int const segment = blockIdx.y, e = segment / a.world, s = segment % a.world;
  char const* const from = s == a.rank ? a.own_rows + e * a.slice_bytes : a.inbox + segment * a.slice_bytes;
  // Whole blocks of 128 rows: the boundary falls on a 16-byte vector whatever k is.
  int64_t const copied = segment_rows(a.received, segment, int32_t(a.slice_bytes / a.row_bytes)) * a.row_bytes / 16;
  auto const* in = reinterpret_cast<const uint4*>(from);
  auto* out = reinterpret_cast<uint4*>(a.pool + segment * a.slice_bytes);
  int64_t const vectors = a.slice_bytes / 16;
  int64_t const stride = int64_t(gridDim.x) * kPoolThreads;
  for (int64_t i = int64_t(blockIdx.x) * kPoolThreads + threadIdx.x; i < vectors; i += stride) {
    out[i] = i < copied ? in[i] : make_uint4(0, 0, 0, 0);
  }
}

}  // namespace

namespace moe {

cudaError_t launch_copy_pool(const MoePoolArgs& args, cudaStream_t stream) {
  // Enough CTAs per segment for the copy to run at memory speed, at most 64 (C / 128 blocks of rows).
  int64_t const vectors = args.slice_bytes / 16;
  int const per_segment = int(std::clamp<int64_t>((vectors + 4 * kPoolThreads - 1) / (4 * kPoolThreads), 1, 64));
  dim3 const grid(per_segment, args.e_local * args.world);
  copy_pool_segments<<<grid, kPoolThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_push(const MoePlan& plan, const MoePushArgs& args, cudaStream_t stream) {
  push_segments<<<plan.push_grid, kMoePushThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

// Segment e of the destination d holds rows x_send[d * E_local + e] of this source, at source slot
// `rank` of expert e's A: experts in order, the order in which every receiver's GEMM takes them.
// A failed receiver wait does not stop the copies (stream order has no branch): they land in an
// inbox whose owner is past this call or failing, and the flags they release carry this call's
// stamp, which only this call reads; every output of a failed call is poisoned.
cudaError_t launch_push_copy(const MoePlan& plan, const MoeTransferArgs& a, cudaStream_t stream) {
  comm::ReceiverWait const receiver{a.ready, a.rank, a.dest, kMoeWaitInboxReady, a.error, a.error_mirror, a.call,
                                    a.timeout_ns};
  cudaError_t err = comm::launch_wait_receiver(receiver, stream);
  int const e_local = plan.e_local, world = plan.shape.world;
  for (int e = 0; e < e_local && err == cudaSuccess; ++e) {
    char const* from = static_cast<char const*>(a.x_send) + (int64_t(a.dest) * e_local + e) * plan.slice_bytes;
    char* to = a.inbox + (int64_t(e) * world + a.rank) * plan.slice_bytes;
    err = cudaMemcpyAsync(to, from, plan.slice_bytes, cudaMemcpyDeviceToDevice, stream);
    if (err == cudaSuccess) err = comm::launch_release(a.flags + int64_t(a.rank) * e_local + e, a.call, stream);
  }
  return err;
}

cudaError_t launch_wait_segments(const MoeWaitArgs& args, cudaStream_t stream) {
  wait_segments<<<1, kWaitThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t prepare_transfer_kernels() {
  cudaFuncAttributes attr;
  cudaError_t err = comm::prepare_transfer_kernels();
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, wait_segments);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, copy_pool_segments);
  return err != cudaSuccess ? err : cudaFuncGetAttributes(&attr, push_segments);
}

}  // namespace moe

}  // namespace entwine
