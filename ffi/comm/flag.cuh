// The one writer of epoch flags (the chunk and tile releases of both ops): which word of the two
// parities a call writes and the value it writes are decided here alone, so the value's form (the
// call's epoch, with whatever identifies the call) changes in one line. Device code only.
#pragma once

#include <cstdint>

#include "comm/protocol.h"
#include "comm/ptx.cuh"

namespace entwine::flag {

// Releases `flag` (its parity-0 word; the call's parity picks the word) for the call of `epoch`:
// the call's stamp (protocol.h: epoch and signature) by a relaxed system-scope store, so the caller's
// earlier fence.acq_rel.sys makes it a release (docs/design.md, "Memory ordering").
__device__ __forceinline__ void store(uint64_t* flag, CallEpoch const& call, uint64_t epoch) {
  ptx::store_relaxed_sys(flag + int64_t(epoch & 1) * call.flags_stride, stamp(epoch, call.signature));
}

}  // namespace entwine::flag
