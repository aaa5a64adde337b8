// What every fused op shares with the communicator: the largest group, the element types, the
// call's epoch and the device error record that a bounded wait fills instead of hanging
// (docs/design.md, "Bounded waits"). Names no op. No kernel syntax: included by handlers, kernels
// and the harness.
#pragma once

#include <cstdint>

namespace entwine {

// Largest mesh axis the fused ops support (one NVLink node).
constexpr int kMaxWorld = 8;

// The kernels' element types: the only list of them on the C++ side. Handlers map XLA's types here
// (handler_util.h), kernels map these to CUDA types (gemm/gemm_kernel.cuh, gemm_rs/consumer.cu), the
// kernel table names them (cmake/gemm_kernels.cmake). The FP8 types are input types only: kE4M3
// has both operands in e4m3; kE5M2 has A (x, or ag_gemm's gathered shards) in e5m2 and B (w_t) in
// e4m3, the hybrid recipe's backward (an e5m2 gradient times an e4m3 weight). Outputs, and so
// gemm_rs's partial slots, are 2 bytes wide (kElementBytes); ag_gemm's inbox holds shards of the
// input type (element_bytes).
enum class DType : int32_t { kBF16 = 0, kFP16 = 1, kE4M3 = 2, kE5M2 = 3 };
constexpr bool is_fp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }
constexpr int kElementBytes = 2;
constexpr int element_bytes(DType t) { return is_fp8(t) ? 1 : 2; }

// Which wait ran past its deadline (DeviceError::site). Each op numbers its own waits from its
// base (OpHooks::wait_site_base, a multiple of kWaitSitesPerOp) and formats its own records.
constexpr int32_t kWaitSitesPerOp = 256;

// A flag or ready word holds a call's stamp: its epoch in the high bits, the call's signature in
// the low kSignatureBits. The signature names what the call is (op, padded shapes, dtype, layout,
// config: Python hashes them, comm.py), so a rank that waits for call e of one kind and sees call e
// of another kind from a peer fails naming both instead of mixing them (docs/design.md, "Per-call
// identity"). Epochs fit in the remaining 40 bits for 10^12 calls.
constexpr int kSignatureBits = 24;
constexpr uint64_t kSignatureMask = (uint64_t(1) << kSignatureBits) - 1;
#if defined(__CUDACC__)
#define ENTWINE_HOST_DEVICE __host__ __device__
#else
#define ENTWINE_HOST_DEVICE
#endif
ENTWINE_HOST_DEVICE constexpr uint64_t stamp(uint64_t epoch, uint32_t signature) {
  return (epoch << kSignatureBits) | (signature & kSignatureMask);
}
ENTWINE_HOST_DEVICE constexpr uint64_t stamp_epoch(uint64_t stamp) { return stamp >> kSignatureBits; }
ENTWINE_HOST_DEVICE constexpr uint32_t stamp_signature(uint64_t stamp) { return uint32_t(stamp & kSignatureMask); }

// How every kernel of a call finds the call's epoch and its half of the double-buffered heap
// regions, what the call is, and where to raise the alarm. The epoch is a device word that the
// call's last kernel advances, in stream order; nothing the host passes changes from call to call,
// so a CUDA graph can replay a call (docs/design.md, "Graph safety"). Parity p = epoch % 2 selects
// `base + p * stride` of each region.
struct CallEpoch {
  const uint64_t* epoch = nullptr;  // this rank's epoch word (device memory): the call's epoch
  int64_t slot_stride = 0;          // bytes from copy 0 to copy 1 of a double-buffered region
  int64_t flags_stride = 0;         // words from flags of parity 0 to parity 1
  bool trap = false;                // a wait that gives up traps: no host check runs inside a graph
  uint32_t signature = 0;           // this call's signature (stamp)
  // This rank's ready words: ready[s] holds the stamp of the last call rank s started. A wait for
  // source s looks there to tell a peer running another call from a slow one (nullptr: not looked).
  const uint64_t* ready = nullptr;
  // ready[rank] in every peer's heap (nullptr at this rank): the call's first kernel stores the
  // call's stamp there as it starts (wait::announce), after every earlier call of this rank is
  // complete (stream order): ag_gemm's senders wait for it before pushing into this rank's inbox.
  uint64_t* announce[kMaxWorld] = {};
  // This rank's abort word, and every rank's (this rank's included; nullptr entries skipped): a wait
  // that fails writes its rank + 1 into all of them, so every rank stops waiting and poisons its
  // outputs from then on (nullptr: no abort protocol, the harness's bare kernels).
  const uint64_t* aborted = nullptr;
  uint64_t* abort[kMaxWorld] = {};
};

// Written by the first CTA whose wait fails (or by the call's last kernel when a peer aborted);
// read by the host.
struct DeviceError {
  uint32_t code;      // 0: none, a kError* below (kErrorClaimed while being written)
  int32_t rank;       // the waiting rank
  int32_t source;     // the rank whose flag never arrived, ran another call, or aborted
  int32_t tile;       // gemm_rs: reduction tile of the waiting rank's partition; ag_gemm: chunk of the source
  uint64_t expected;  // stamp waited for
  uint64_t observed;  // last stamp seen in the flag (or in the source's ready word)
  int32_t site;       // which wait: an op's wait_site_base + its own number
  int32_t pad_;
};
constexpr uint32_t kErrorDeadline = 1;  // the flag did not arrive in time
constexpr uint32_t kErrorMismatch = 2;  // the source ran a different call at this epoch
constexpr uint32_t kErrorAborted = 3;   // another rank's wait failed (source): this rank stopped too
constexpr uint32_t kErrorClaimed = 0xFFFFFFFFu;  // a CTA is filling the record

}  // namespace entwine
