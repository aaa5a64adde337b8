// The two one-warp kernels that an op's copy-engine pushes enqueue around their copies (transfer.cu).
// Names no op. No kernel syntax.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "comm/protocol.h"

namespace entwine::comm {

// The receiver wait opens a transfer stream: this rank announces its call first (its GEMM may not
// have started: it needs SMs that waiting kernels could hold, and the destination's transfers wait
// for this announcement), then waits, bounded, until the destination has announced the call: it has
// finished reading its inbox in every earlier call.
struct ReceiverWait {
  const uint64_t* ready;  // ready[dest] in this rank's heap: the destination's announcement
  int32_t rank, dest;
  int32_t site;           // DeviceError::site of a wait that runs out (the op's)
  DeviceError* error;
  DeviceError* error_mirror;
  CallEpoch call;
  uint64_t timeout_ns;
};
cudaError_t launch_wait_receiver(const ReceiverWait& wait, cudaStream_t stream);

// The release follows each copy on its stream: once the stream's earlier work (the copy engine's
// writes) is complete, a system fence, then the call's stamp into `flag` (of parity 0; the kernel
// adds the parity; docs/design.md, "Memory ordering"). A stream memory operation
// (cuStreamWriteValue64) in its place let a receiving GEMM observe the flag before the copy's data
// (two processes sharing one H200). Both kernels must find an SM while the op's GEMM runs: its
// persistent grid leaves one free.
cudaError_t launch_release(uint64_t* flag, const CallEpoch& call, cudaStream_t stream);

// Loads both kernels' module on the current device (setup: each op's prepare_kernels).
cudaError_t prepare_transfer_kernels();

}  // namespace entwine::comm
