// The end of a call (comm.h, CallEnd) as device functions: by the end kernel of its own
// (epoch.cu), or folded into the call's own kernels, where the last CTA to finish does it and the
// call saves a launch (gemm_rs: CallEnd::done). Either way it runs once every kernel of the call
// has read the epoch for the last time: the next call's kernels see the next epoch.
#pragma once

#include "comm/comm.h"
#include "comm/wait.cuh"

namespace entwine::comm {

// One thread: whether the call failed here or anywhere (a peer's abort word); a peer's failure is
// recorded here too, so this rank's host raises on its next call.
__device__ inline bool end_failed(CallEnd const& end) {
  uint64_t const aborted_by = end.aborted != nullptr ? ptx::load_relaxed_sys(end.aborted) : 0;
  bool const own = end.error != nullptr && *reinterpret_cast<volatile uint32_t*>(&end.error->code) != 0;
  if (aborted_by != 0 && !own) {
    wait::record_error(CallEpoch{}, end.error, end.mirror, kErrorAborted, end.rank, int(aborted_by) - 1, -1, 0, 0, -1);
  }
  return own || aborted_by != 0;
}

// Threads [0, threads) of a group: the call's outputs filled with all bits set (NaN in bf16, fp16,
// f32, e4m3 and e5m2). XLA's buffers are at least 16-byte aligned: vector stores for the body,
// bytes for the tail.
__device__ inline void poison_outputs(CallEnd const& end, int thread, int threads) {
  uint4 const ones = make_uint4(~0u, ~0u, ~0u, ~0u);
  for (int o = 0; o < end.outputs; ++o) {
    if (end.out[o] == nullptr) continue;
    int64_t const bytes = end.bytes[o];
    uint4* const body = static_cast<uint4*>(end.out[o]);
    for (int64_t i = thread; i < bytes / 16; i += threads) body[i] = ones;
    unsigned char* const tail = static_cast<unsigned char*>(end.out[o]);
    for (int64_t i = bytes / 16 * 16 + thread; i < bytes; i += threads) tail[i] = 0xFF;
  }
}

// One thread, after the group's poison stores: the next call's epoch.
__device__ inline void advance_epoch(CallEnd const& end) {
  __threadfence();
  *end.epoch += 1;
}

// One thread per arriving unit (a CTA, or a CTA's store warp), after the unit's last read of the
// epoch and its last write of an output (fenced by every thread that wrote one): whether it is the
// last of `expected` arrivals at `counter`. The last one resets the counter for the next call
// (which starts after every kernel of this one ended).
__device__ inline bool arrive(uint64_t* counter, uint64_t expected) {
  __threadfence();
  bool const last = atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull) == expected - 1;
  if (last) {
    *counter = 0;
    __threadfence();  // the other arrivals' writes before whatever the last one does next
  }
  return last;
}

}  // namespace entwine::comm
