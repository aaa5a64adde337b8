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
  int least = 0, greatest = 0;
  keep(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t a = nullptr, hi = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  CallEnd end;
  keep(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  keep(cudaStreamCreateWithPriority(&hi, cudaStreamNonBlocking, greatest));  // as the consumer's
  keep(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  keep(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  keep(cudaMalloc(reinterpret_cast<void**>(&end.epoch), sizeof(uint64_t)));
  std::vector<double> us;
  for (int i = 0; i < reps && err == cudaSuccess; ++i) {
    if (i % 16 == 0) keep(cudaStreamSynchronize(a));
    auto const t0 = std::chrono::steady_clock::now();
    keep(cudaEventRecord(fork, a)) && keep(cudaStreamWaitEvent(hi, fork, 0)) && keep(launch_end_call(end, hi)) &&
        keep(launch_end_call(end, a)) && keep(cudaEventRecord(join, hi)) && keep(cudaStreamWaitEvent(a, join, 0)) &&
        keep(launch_end_call(end, a));
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  if (a) keep(cudaStreamSynchronize(a));
  if (end.epoch) cudaFree(end.epoch);
  for (cudaEvent_t e : {fork, join}) {
    if (e) cudaEventDestroy(e);
  }
  for (cudaStream_t s : {hi, a}) {
    if (s) cudaStreamDestroy(s);
  }
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
