// The SM push's steps that ag_gemm's shard push and moe's segment push share (and moe's combine its
// release): CTAs in groups per destination, each group waiting for its destinations'
// announcements, the vector copy, and a unit's release by the last CTA to arrive. The kernels' own
// comments give the schedules and the memory-ordering argument.
#pragma once

#include <cstdint>

#include "comm/flag.cuh"
#include "comm/ptx.cuh"
#include "comm/wait.cuh"

namespace entwine::push {

// This CTA's place among min(W - 1, grid) groups: group g serves the destinations rank + d with
// (d - 1) % groups == g, so that every link carries a push from the start; `members` CTAs per group.
// (One rank has no peer: one group of every CTA, which serves nothing.)
struct Group {
  int peers, groups, group, members, member;
};

__device__ inline Group group_of(int world) {
  int const peers = world - 1, grid = int(gridDim.x);
  int const groups = peers < 1 ? 1 : peers < grid ? peers : grid, group = int(blockIdx.x) % groups;
  return Group{peers, groups, group, grid / groups + (group < grid % groups ? 1 : 0), int(blockIdx.x) / groups};
}

// Warp d - 1 waits for the announcement of destination rank + d, if it is the group's (its inbox is
// free for this call); ok[destination] (shared memory) says whether it came. Every thread of the CTA
// calls it: it ends with a barrier.
__device__ inline void wait_destinations(Group const& g, int* ok, const uint64_t* ready, uint64_t epoch,
                                         CallEpoch const& call, uint64_t timeout_ns, DeviceError* error,
                                         DeviceError* mirror, int rank, int world, int32_t site) {
  int const warp = threadIdx.x / 32;
  if (warp < g.peers && warp % g.groups == g.group) {
    int const dest = (rank + 1 + warp) % world;
    bool const came = wait::wait_flag_warp(ready + dest, epoch, call, timeout_ns, error, mirror, rank, dest, 0, site);
    if (threadIdx.x % 32 == 0) ok[dest] = came;
  }
  __syncthreads();
}

// This thread's share of copying `count` 16-byte vectors: i = first, first + stride, ..., the loads of
// a batch of kUnroll issued before its stores.
template <int kUnroll = 4>
__device__ inline void copy_vectors(const uint4* from, uint4* to, int64_t count, int64_t first, int64_t stride) {
  int64_t i = first;
  for (; i + (kUnroll - 1) * stride < count; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) v[j] = __ldg(from + i + j * stride);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) to[i + j * stride] = v[j];
  }
  for (; i < count; i += stride) to[i] = __ldg(from + i);
}

// One caller's arrival at a unit after its stores (made visible to it first): a system fence and a
// relaxed count; the last of `members` reads every earlier arrival (one RMW chain), zeroes the
// counter for the next call (which starts after this kernel: stream order), fences and, if
// `release`, stores the unit's flag.
__device__ inline void arrive(uint32_t* counter, int members, uint64_t* flag, bool release, CallEpoch const& call,
                              uint64_t epoch) {
  ptx::fence_acq_rel_sys();
  if (atomicAdd(counter, 1u) == uint32_t(members - 1)) {
    *counter = 0;
    ptx::fence_acq_rel_sys();
    if (release) flag::store(flag, call, epoch);
  }
}

}  // namespace entwine::push
