// Bounded waits on epoch flags (docs/design.md, "Bounded waits"): a wait that passes its deadline
// fills the device error record once (rank, source, unit, expected and observed epoch) and returns
// false instead of spinning on; the host turns the record into an exception naming the peer.
#pragma once

#include <cstdint>

#include "comm/protocol.h"
#include "comm/ptx.cuh"

namespace entwine::wait {

// Claims the record (the first failing thread of any CTA wins), fills it, then publishes the code
// last, in device memory and in the host-mapped mirror, so a reader that sees the code sees the fields.
__device__ inline void record_deadline(DeviceError* e, DeviceError* mirror, int rank, int source, int unit,
                                       uint64_t expected, uint64_t observed, int32_t site) {
  if (atomicCAS(&e->code, 0u, kErrorClaimed) != 0u) return;
  auto fill = [&](DeviceError* r) {
    r->rank = rank;
    r->source = source;
    r->tile = unit;
    r->expected = expected;
    r->observed = observed;
    r->site = site;
  };
  fill(e);
  __threadfence();
  atomicExch(&e->code, kErrorDeadline);
  if (mirror != nullptr) {
    fill(mirror);
    __threadfence_system();
    *reinterpret_cast<volatile uint32_t*>(&mirror->code) = kErrorDeadline;
    __threadfence_system();
  }
}

// The calling warp (all 32 lanes) waits until *flag >= epoch: lane 0 polls with relaxed
// system-scope loads and turns the successful poll into an acquire with one fence; the __syncwarp
// after it orders every lane's later accesses after that acquire. Returns false when the deadline
// passed or another wait already recorded an error (then nothing was acquired); with `trap`, traps
// instead (a call inside a CUDA graph: no handler runs between replays to report the record).
__device__ inline bool wait_flag_warp(const uint64_t* flag, uint64_t epoch, uint64_t timeout_ns, DeviceError* error,
                                      DeviceError* mirror, int rank, int source, int unit, int32_t site,
                                      bool trap) {
  constexpr int kCheckEvery = 256;
  int const lane = threadIdx.x % 32;
  int ok = 1;
  if (lane == 0) {
    uint64_t observed = ptx::load_relaxed_sys(flag);
    if (observed < epoch) {
      uint64_t const start = ptx::global_timer_ns();
      for (int polls = 1;; ++polls) {
        __nanosleep(32);
        observed = ptx::load_relaxed_sys(flag);
        if (observed >= epoch) break;
        if (polls % kCheckEvery != 0) continue;
        if (*reinterpret_cast<volatile uint32_t*>(&error->code) != 0) {
          ok = 0;
          break;
        }
        if (ptx::global_timer_ns() - start > timeout_ns) {
          record_deadline(error, mirror, rank, source, unit, epoch, observed, site);
          ok = 0;
          break;
        }
      }
    }
    if (ok) ptx::fence_acq_rel_sys();
    if (!ok && trap) __trap();
  }
  ok = __shfl_sync(0xffffffffu, ok, 0);
  __syncwarp();
  return ok != 0;
}

}  // namespace entwine::wait
