// The SM push of ag_gemm's transfers (config.push_sms > 0): one kernel waits, copies and releases
// everything (push_shard); it reads the call's epoch from the device, so a CUDA graph can replay it
// (docs/design.md, "Graph safety"). On the copy engines (push_sms = 0) the handler enqueues each
// transfer stream's receiver wait, then each chunk's copy and release (comm/transfer.h). Every kernel
// that starts a call announces it before it waits (the GEMM too), so an announcement never waits
// behind another rank's.
#include "ag_gemm/ag_gemm.h"
#include "comm/ptx.cuh"
#include "comm/push.cuh"
#include "comm/wait.cuh"

namespace entwine {
namespace {

// The CTAs form min(W-1, grid) groups, group g serving the peers rank + d with (d - 1) % groups == g,
// so that every link carries a push from the start. A group's CTAs copy their shares of each (chunk,
// peer) unit, chunk-major, so that chunk c reaches the group's peers before chunk c + 1 goes anywhere
// (the receivers' GEMMs consume chunks in order), then count themselves done with the unit; the last
// to arrive releases it. Release across CTAs: each CTA's stores, its barrier, its thread 0's system
// fence and relaxed arrival; the last arrival reads every earlier one (one RMW chain), fences and
// stores the flag, so every CTA's stores are visible to a reader that acquired the flag. The last CTA
// also zeroes the counter for the next call, which starts after this kernel ends (stream order); a
// graph replays the same counters the same way.
// Pitfalls: every CTA of a group arrives at every unit of the group, even with nothing to copy or
// after a failed wait, or the counters stop returning to zero; no flag of a peer whose announcement
// never came is written (its GEMM reports the deadline, or already did).
__global__ void __launch_bounds__(kPushThreads) push_shard(PushArgs a) {
  __shared__ int peer_ok[kMaxWorld];
  // The GEMM, launched after this grid as its programmatic dependent, may start once every CTA of
  // this grid got here. This rank's announcement comes first: the receivers' pushes wait for it,
  // and it must not wait behind the GEMM's start, which needs SMs that waiting kernels may hold.
  if (blockIdx.x == 0 && threadIdx.x == 0) wait::announce(a.call);
  ptx::launch_dependents();
  uint64_t const epoch = ptx::load_relaxed_sys(a.call.epoch);
  push::Group const g = push::group_of(a.world);
  push::wait_destinations(g, peer_ok, a.ready, epoch, a.call, a.timeout_ns, a.error, a.error_mirror, a.rank, a.world,
                          kWaitInboxReady);

  int64_t const chunk_vectors = a.shard_bytes / a.chunks / 16;
  int64_t const stride = int64_t(g.members) * kPushThreads;
  auto const* shard = static_cast<const uint4*>(a.shard);
  for (int chunk = 0; chunk < a.chunks; ++chunk) {
    for (int d = 1 + g.group; d <= g.peers; d += g.groups) {
      int const peer = (a.rank + d) % a.world;
      if (peer_ok[peer] && chunk == 0 && g.member == 0 && a.scale != nullptr) {
        // The FP8 shard's scale, before this CTA's fenced arrival at chunk 0 (the barrier below
        // orders every thread's stores before thread 0's fence): every release of a chunk to this
        // peer reads an arrival chain that follows it, so each publishes the scale. Block-scaled:
        // the shard's [k_blocks, rows] scales into columns rank*rows .. of the peer's
        // [k_blocks, world * rows] (AgPlan).
        if (a.scale_k_blocks == 0) {
          if (threadIdx.x == 0) {
            *reinterpret_cast<float*>(a.inbox[peer] + a.scales_offset + a.rank * kScaleSlotBytes) = *a.scale;
          }
        } else {
          // 16-byte vectors: rows is a multiple of 128, the inbox's scales and x_scale 16-byte aligned.
          auto* const to = reinterpret_cast<float4*>(a.inbox[peer] + a.scales_offset) + int64_t(a.rank) * (a.rows / 4);
          auto const* const from = reinterpret_cast<const float4*>(a.scale);
          int64_t const row_vectors = a.rows / 4, count = int64_t(a.scale_k_blocks) * row_vectors;
          for (int64_t i = threadIdx.x; i < count; i += kPushThreads) {
            to[i / row_vectors * a.world * row_vectors + i % row_vectors] = __ldg(from + i);
          }
        }
      }
      if (peer_ok[peer]) {
        uint4* to = reinterpret_cast<uint4*>(a.inbox[peer] + a.rank * a.shard_bytes) + chunk * chunk_vectors;
        push::copy_vectors(shard + chunk * chunk_vectors, to, chunk_vectors, int64_t(g.member) * kPushThreads + threadIdx.x,
                           stride);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        push::arrive(a.arrivals + chunk * g.peers + (d - 1), g.members, a.flags[peer] + a.rank * a.chunks + chunk,
                     peer_ok[peer], a.call, epoch);
      }
    }
  }
}

}  // namespace

cudaError_t launch_push(const AgPlan& plan, const PushArgs& args, cudaStream_t stream) {
  push_shard<<<plan.push_grid, kPushThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t prepare_transfer_kernels() {
  cudaFuncAttributes attr;
  cudaError_t err = comm::prepare_transfer_kernels();
  return err != cudaSuccess ? err : cudaFuncGetAttributes(&attr, push_shard);
}

}  // namespace entwine
