// The call's last kernel, on XLA's stream once the whole call (every side stream joined) is done:
// it advances the call's epoch, kept in device memory, so the next call's kernels read the next
// epoch. A CUDA graph that replays a call replays this kernel too, which is what makes the calls
// graph safe (docs/design.md, "Graph safety"). When this rank has failed, or a peer raised its
// abort word, it first fills the call's outputs with NaN (all bits set: NaN in bf16, fp16, f32,
// e4m3 and e5m2), so that no output computed after a failure looks plausible, on any rank (docs/design.md,
// "After a failure").
#include <algorithm>
#include <chrono>
#include <vector>

#include "comm/call_end.cuh"
#include "comm/comm.h"
#include "comm/ptx.cuh"

namespace entwine::comm {
namespace {

constexpr int kEndThreads = 256;

__global__ void __launch_bounds__(kEndThreads) end_call(CallEnd end) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = end_failed(end);
  __syncthreads();
  if (failed) poison_outputs(end, int(threadIdx.x), kEndThreads);
  __syncthreads();
  if (threadIdx.x == 0) advance_epoch(end);
}

}  // namespace

cudaError_t launch_end_call(const CallEnd& end, cudaStream_t stream) {
  end_call<<<1, kEndThreads, 0, stream>>>(end);
  return cudaGetLastError();
}

cudaError_t call_sequence_us(int device, int reps, double* median_us) {
  *median_us = 0;
  cudaError_t err = cudaSetDevice(device);
  // Every call's status kept, the first failure returned after everything is released.
  auto keep = [&err](cudaError_t e) {
    if (err == cudaSuccess) err = e;
    return err == cudaSuccess;
  };
  cudaStream_t stream = nullptr;
  CallEnd end;
  keep(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  keep(cudaMalloc(reinterpret_cast<void**>(&end.epoch), sizeof(uint64_t)));
  // The second launch as the first's programmatic dependent, as gemm_rs launches its consumer.
  cudaLaunchAttribute attr = ptx::programmatic_dependent();
  cudaLaunchConfig_t dependent{};
  dependent.gridDim = dim3(1);
  dependent.blockDim = dim3(kEndThreads);
  dependent.stream = stream;
  dependent.attrs = &attr;
  dependent.numAttrs = 1;
  std::vector<double> us;
  for (int i = 0; i < reps && err == cudaSuccess; ++i) {
    if (i % 16 == 0) keep(cudaStreamSynchronize(stream));
    auto const t0 = std::chrono::steady_clock::now();
    keep(launch_end_call(end, stream)) && keep(cudaLaunchKernelEx(&dependent, end_call, end));
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  if (stream) keep(cudaStreamSynchronize(stream));
  if (end.epoch) cudaFree(end.epoch);
  if (stream) cudaStreamDestroy(stream);
  if (!us.empty()) {
    std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
    *median_us = us[us.size() / 2];
  }
  return err;
}

cudaError_t prepare_epoch_kernel() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, end_call);
}

}  // namespace entwine::comm
