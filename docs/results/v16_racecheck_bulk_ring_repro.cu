// Minimal mbarrier-paced bulk-copy ring: 1 loader thread, 1 data warp, 2 stages, 16 uses (PERF.md v16).
// Build: nvcc -O2 -arch=sm_90a -lineinfo v16_racecheck_bulk_ring_repro.cu -o rc; run: compute-sanitizer --tool racecheck ./rc
#include <cstdio>
#include <cstdint>
__device__ __forceinline__ void init(uint32_t b, uint32_t c) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(b), "r"(c) : "memory"); }
__device__ __forceinline__ void arrive(uint32_t b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b) : "memory"); }
__device__ __forceinline__ void arrive_tx(uint32_t b, uint32_t n) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(n) : "memory"); }
__device__ __forceinline__ void wait(uint32_t b, uint32_t p) {
  uint32_t done = 0;
  while (!done) asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }" : "=r"(done) : "r"(b), "r"(p) : "memory");
}
__device__ __forceinline__ void copy(uint32_t d, const void* s, uint32_t n, uint32_t b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d), "l"(s), "r"(n), "r"(b) : "memory");
}
constexpr int S = 2, B = 512, U = 16;
__global__ void ring(const uint4* in, uint4* out) {
  __shared__ alignas(128) uint4 stage[S][B / 16];
  __shared__ uint64_t full[S], empty[S];
  if (threadIdx.x == 0) {
    for (int k = 0; k < S; ++k) { init(__cvta_generic_to_shared(&full[k]), 1); init(__cvta_generic_to_shared(&empty[k]), 1); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // loader (warp 0, lane 0)
    for (int u = 0; u < U; ++u) {
      int k = u % S; uint32_t ph = (u / S) & 1;
      wait(__cvta_generic_to_shared(&empty[k]), ph ^ 1);
      arrive_tx(__cvta_generic_to_shared(&full[k]), B);
      copy(__cvta_generic_to_shared(stage[k]), in + u * (B / 16), B, __cvta_generic_to_shared(&full[k]));
    }
  } else if (threadIdx.x >= 32) {  // data warp
    int t = threadIdx.x - 32;
    for (int u = 0; u < U; ++u) {
      int k = u % S; uint32_t ph = (u / S) & 1;
      wait(__cvta_generic_to_shared(&full[k]), ph);
      out[u * (B / 16) + t] = stage[k][t];
      __syncwarp();
      if (t == 0) arrive(__cvta_generic_to_shared(&empty[k]));
    }
  }
}
int main() {
  uint4 *in, *out;
  cudaMalloc(&in, U * B); cudaMalloc(&out, U * B);
  cudaMemset(in, 7, U * B); cudaMemset(out, 0, U * B);
  ring<<<1, 64>>>(in, out);
  cudaError_t e = cudaDeviceSynchronize();
  static unsigned char h[U * B];
  cudaMemcpy(h, out, U * B, cudaMemcpyDeviceToHost);
  int bad = 0; for (int i = 0; i < U * B; ++i) bad += h[i] != 7;
  std::printf("ring: %s, %d bad bytes\n", cudaGetErrorString(e), bad);
  return bad != 0;
}
