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
// kernel table names them (cmake/gemm_kernels.cmake). kE4M3 is an input type only (FP8 operands):
// outputs, and so gemm_rs's partial slots, are 2 bytes wide (kElementBytes); ag_gemm's inbox holds
// shards of the input type (element_bytes).
enum class DType : int32_t { kBF16 = 0, kFP16 = 1, kE4M3 = 2 };
constexpr int kElementBytes = 2;
constexpr int element_bytes(DType t) { return t == DType::kE4M3 ? 1 : 2; }

// Which wait ran past its deadline (DeviceError::site). Each op numbers its own waits from its
// base (OpHooks::wait_site_base, a multiple of kWaitSitesPerOp) and formats its own records.
constexpr int32_t kWaitSitesPerOp = 256;

// How every kernel of a call finds the call's epoch and its half of the double-buffered heap
// regions. The epoch is a device word that a one-thread kernel advances after each call, in stream
// order; nothing the host passes changes from call to call, so a CUDA graph can replay a call
// (docs/design.md, "Graph safety"). Parity p = epoch % 2 selects `base + p * stride` of each region.
struct CallEpoch {
  const uint64_t* epoch = nullptr;  // this rank's epoch word (device memory): the call's epoch
  int64_t slot_stride = 0;          // bytes from partial slot 0 to slot 1
  int64_t flags_stride = 0;         // words from flags of parity 0 to parity 1
  bool trap = false;                // a wait that gives up traps: no host check runs inside a graph
};

// Written by the first CTA whose wait passes its deadline; read by the host.
struct DeviceError {
  uint32_t code;      // 0: none, kErrorDeadline (kErrorClaimed while being written)
  int32_t rank;       // the waiting rank
  int32_t source;     // the rank whose flag never arrived
  int32_t tile;       // gemm_rs: reduction tile of the waiting rank's partition; ag_gemm: chunk of the source
  uint64_t expected;  // epoch waited for
  uint64_t observed;  // last epoch seen in the flag
  int32_t site;       // which wait: an op's wait_site_base + its own number
  int32_t pad_;
};
constexpr uint32_t kErrorDeadline = 1;
constexpr uint32_t kErrorClaimed = 0xFFFFFFFFu;  // a CTA is filling the record

}  // namespace entwine
