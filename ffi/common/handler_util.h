// Small pieces both FFI handlers need: a CUDA-error-to-ffi::Error macro, a printable buffer shape,
// and a guard that restores XLA's current device. Host-only; included by the handlers alone.
#pragma once

#include <string>

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

// Returns an ffi::Error naming the op (`what`, e.g. "entwine gemm_rs"), the call and CUDA's error.
#define ENTWINE_RETURN_IF_CUDA(what, expr)                                                            \
  do {                                                                                                \
    cudaError_t err_ = (expr);                                                                        \
    if (err_ != cudaSuccess) {                                                                        \
      return ::xla::ffi::Error::Internal(std::string(what) + ": " + #expr + ": " + cudaGetErrorString(err_)); \
    }                                                                                                 \
  } while (0)

namespace entwine::handler {

inline std::string dims_string(::xla::ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Restores the caller's current device: XLA's thread may rely on it after we return.
struct DeviceGuard {
  int previous = -1;
  cudaError_t set(int device) {
    cudaGetDevice(&previous);
    return cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous >= 0) cudaSetDevice(previous);
  }
};

}  // namespace entwine::handler
