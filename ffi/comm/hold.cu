// A test's stand-in for another stream's kernel that holds SMs while it waits for something outside
// the GPU's control (a collective of another mesh axis waiting for another GPU): `ctas` CTAs, one
// per SM (each asks for most of an SM's shared memory), on a stream of their own, spinning until the
// host releases them or a bound passes. Used by the forward-progress tests (docs/testing.md).
#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "comm/comm.h"
#include "comm/ptx.cuh"

namespace entwine::comm {
namespace {

constexpr int kHoldSmemBytes = 200 * 1024;  // above half an H100/H200 SM's 227 KB: one CTA per SM

__global__ void __launch_bounds__(32) hold_kernel(volatile uint32_t* release, uint64_t bound_ns, uint32_t* started) {
  extern __shared__ char smem[];
  smem[threadIdx.x] = 0;
  if (threadIdx.x == 0) atomicAdd(started, 1u);
  uint64_t const until = ptx::global_timer_ns() + bound_ns;
  while (*release == 0u && ptx::global_timer_ns() < until) __nanosleep(1000);
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("entwine hold_sms: ") + what + ": " + cudaGetErrorString(err));
}

}  // namespace

SmHold::SmHold(int device, int ctas, uint64_t bound_ms) : device_(device), ctas_(ctas) {
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaHostAlloc(reinterpret_cast<void**>(&words_), 2 * sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc");
  words_[0] = words_[1] = 0;
  uint32_t* device_words = nullptr;
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_words), words_, 0), "cudaHostGetDevicePointer");
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaFuncSetAttribute(hold_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kHoldSmemBytes),
        "cudaFuncSetAttribute");
  hold_kernel<<<ctas, 32, kHoldSmemBytes, stream_>>>(device_words, bound_ms * 1000000ull, device_words + 1);
  check(cudaGetLastError(), "launch");
}

int SmHold::started() const { return int(*reinterpret_cast<volatile uint32_t*>(words_ + 1)); }

void SmHold::release() {
  if (stream_ == nullptr) return;
  *reinterpret_cast<volatile uint32_t*>(words_) = 1u;
  cudaSetDevice(device_);
  cudaError_t const err = cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
  stream_ = nullptr;
  cudaFreeHost(words_);
  words_ = nullptr;
  check(err, "cudaStreamSynchronize");
}

SmHold::~SmHold() {
  try {
    release();
  } catch (...) {
  }
}

}  // namespace entwine::comm
