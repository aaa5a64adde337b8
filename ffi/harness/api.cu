// `entwine_harness api`: the host cost of the CUDA runtime calls a handler makes.
#include "harness/harness.h"

namespace entwine::harness {

// The host cost of each CUDA runtime call a handler makes, on this machine: the floor under a
// handler's time (comm::HostPhase). Each call is timed alone after the stream drained (as a call
// at a time sees it: `idle`) and back to back (`busy`, 64 in a row, the GPU still working off the
// queue), median of 200 samples, microseconds.
struct ApiParams {
  unsigned char bytes[1024];  // about a prepared GEMM's parameters
};
__global__ void api_empty() {}
__global__ void api_big(ApiParams const p) {
  if (p.bytes[threadIdx.x] == 255 && threadIdx.x == 1000) asm volatile("trap;");
}

int api_main() {
  cudaStream_t a, b;
  CHECK_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  cudaEvent_t e;
  CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  void *src, *dst;
  CHECK_CUDA(cudaMalloc(&src, 1 << 20));
  CHECK_CUDA(cudaMalloc(&dst, 1 << 20));
  ApiParams params{};
  using Clock = std::chrono::steady_clock;
  struct Op {
    const char* name;
    std::function<void()> run;
  };
  std::vector<Op> const ops{
      {"launch, empty kernel", [&] { api_empty<<<1, 32, 0, a>>>(); }},
      {"launch, 1 KB parameters", [&] { api_big<<<1, 32, 0, a>>>(params); }},
      {"launch, 132 CTAs 1 KB", [&] { api_big<<<132, 384, 0, a>>>(params); }},
      {"cudaEventRecord", [&] { CHECK_CUDA(cudaEventRecord(e, a)); }},
      {"cudaStreamWaitEvent", [&] { CHECK_CUDA(cudaStreamWaitEvent(b, e, 0)); }},
      {"cudaMemcpyAsync 64 KB", [&] { CHECK_CUDA(cudaMemcpyAsync(dst, src, 1 << 16, cudaMemcpyDeviceToDevice, a)); }},
      {"cudaStreamIsCapturing", [&] {
         cudaStreamCaptureStatus st;
         CHECK_CUDA(cudaStreamIsCapturing(a, &st));
       }},
      {"cudaGetDevice", [&] {
         int d;
         CHECK_CUDA(cudaGetDevice(&d));
       }},
  };
  std::printf("# host microseconds per call (median of 200): idle = after the streams drained; busy = 64 in a row\n");
  std::printf("%-26s %8s %8s\n", "call", "idle_us", "busy_us");
  for (Op const& op : ops) {
    std::vector<double> idle, busy;
    for (int i = 0; i < 200; ++i) {
      CHECK_CUDA(cudaDeviceSynchronize());
      auto t0 = Clock::now();
      op.run();
      idle.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    for (int i = 0; i < 200; ++i) {
      if (i % 64 == 0) CHECK_CUDA(cudaDeviceSynchronize());
      auto t0 = Clock::now();
      op.run();
      busy.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::nth_element(idle.begin(), idle.begin() + 100, idle.end());
    std::nth_element(busy.begin(), busy.begin() + 100, busy.end());
    std::printf("%-26s %8.2f %8.2f\n", op.name, idle[100], busy[100]);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  // gemm_rs's handler's CUDA calls in its order, without its host work (comm::call_sequence_us, as
  // gpu_ranks' hostcost times them inside a JAX process): against the sum of the calls alone above,
  // what the sequence itself adds.
  int device = 0;
  double sequence_us = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(comm::call_sequence_us(device, 200, &sequence_us));
  std::printf("%-26s %8.2f\n", "gemm_rs handler sequence", sequence_us);
  return 0;
}

}  // namespace entwine::harness
