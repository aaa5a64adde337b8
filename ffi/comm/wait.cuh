// Bounded waits on stamped flags (docs/design.md, "Bounded waits", "Per-call identity"): a wait
// ends when the flag carries this call's stamp; it fails when the deadline passes, when the source
// is seen running another call at this epoch, or when any rank already failed. The first failure
// fills the device error record once (rank, source, unit, expected and observed stamps) and writes
// the abort word of every rank, whose calls then poison their outputs (epoch.cu); the host turns the
// record into an exception naming the peer and, for a mismatch, both calls.
#pragma once

#include <cstdint>

#include "comm/protocol.h"
#include "comm/ptx.cuh"

namespace entwine::wait {

// Claims the record (the first failing thread of any CTA wins), fills it, then publishes the code
// last, in device memory and in the host-mapped mirror, so a reader that sees the code sees the
// fields. Whoever fails first also raises every rank's abort word (this rank's included).
__device__ inline void record_error(CallEpoch const& call, DeviceError* e, DeviceError* mirror, uint32_t code,
                                    int rank, int source, int unit, uint64_t expected, uint64_t observed,
                                    int32_t site) {
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
  atomicExch(&e->code, code);
  if (mirror != nullptr) {
    fill(mirror);
    __threadfence_system();
    *reinterpret_cast<volatile uint32_t*>(&mirror->code) = code;
    __threadfence_system();
  }
  for (int q = 0; q < kMaxWorld; ++q) {
    if (call.abort[q] != nullptr) ptx::store_relaxed_sys(call.abort[q], uint64_t(rank) + 1);
  }
  __threadfence_system();
}

// Whether the call must stop waiting: this rank recorded an error (sticky, from any call) or a
// peer raised this rank's abort word.
__device__ inline bool stopped(CallEpoch const& call, DeviceError const* error) {
  if (*reinterpret_cast<volatile const uint32_t*>(&error->code) != 0) return true;
  return call.aborted != nullptr && ptx::load_relaxed_sys(call.aborted) != 0;
}

// One thread polls `flag` until it carries stamp(epoch, call.signature). Relaxed system-scope
// loads, and one acquire fence on success (an acquire load per poll is a stronger, costlier access
// than the poll needs); the failure checks run every kCheckEvery polls. Returns false on failure
// (nothing acquired); with call.trap, traps instead (a call inside a CUDA graph: no handler runs
// between replays to report the record).
__device__ inline bool poll_flag(const uint64_t* flag, uint64_t epoch, CallEpoch const& call, uint64_t timeout_ns,
                                 DeviceError* error, DeviceError* mirror, int rank, int source, int unit,
                                 int32_t site, unsigned sleep_ns) {
  constexpr int kCheckEvery = 256;
  uint64_t const expected = stamp(epoch, call.signature);
  uint64_t observed = ptx::load_relaxed_sys(flag);
  uint64_t const start = stamp_epoch(observed) >= epoch ? 0 : ptx::global_timer_ns();
  for (int polls = 1; stamp_epoch(observed) < epoch; ++polls) {
    __nanosleep(sleep_ns);
    observed = ptx::load_relaxed_sys(flag);
    if (polls % kCheckEvery != 0 || stamp_epoch(observed) >= epoch) continue;
    // The source may already be running another call at this epoch, whose flags land elsewhere.
    uint64_t const peer = call.ready != nullptr ? ptx::load_relaxed_sys(call.ready + source) : 0;
    if (stamp_epoch(peer) == epoch && stamp_signature(peer) != call.signature) {
      record_error(call, error, mirror, kErrorMismatch, rank, source, unit, expected, peer, site);
    } else if (ptx::global_timer_ns() - start > timeout_ns) {
      record_error(call, error, mirror, kErrorDeadline, rank, source, unit, expected, observed, site);
    }
    if (stopped(call, error)) {
      if (call.trap) __trap();
      return false;
    }
  }
  if (stamp_epoch(observed) == epoch && stamp_signature(observed) != call.signature) {
    record_error(call, error, mirror, kErrorMismatch, rank, source, unit, expected, observed, site);
    if (call.trap) __trap();
    return false;
  }
  ptx::fence_acq_rel_sys();
  return true;
}

// The calling warp (all 32 lanes) waits as poll_flag says; the __syncwarp after lane 0's poll
// orders every lane's later accesses after its acquire.
__device__ inline bool wait_flag_warp(const uint64_t* flag, uint64_t epoch, CallEpoch const& call,
                                      uint64_t timeout_ns, DeviceError* error, DeviceError* mirror, int rank,
                                      int source, int unit, int32_t site) {
  int ok = 1;
  if (threadIdx.x % 32 == 0) ok = poll_flag(flag, epoch, call, timeout_ns, error, mirror, rank, source, unit, site, 32);
  ok = __shfl_sync(0xffffffffu, ok, 0);
  __syncwarp();
  return ok != 0;
}

// Stores this call's stamp in every peer's ready word for this rank (CallEpoch::announce), after
// everything this rank did before (its earlier calls' reads of the inbox included).
__device__ inline void announce(CallEpoch const& call) {
  uint64_t const epoch = ptx::load_relaxed_sys(call.epoch);
  ptx::fence_acq_rel_sys();
  for (int q = 0; q < kMaxWorld; ++q) {
    if (call.announce[q] != nullptr) ptx::store_relaxed_sys(call.announce[q], stamp(epoch, call.signature));
  }
}

}  // namespace entwine::wait
