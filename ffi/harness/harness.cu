// The shared harness helpers declared in harness.h.
#include "harness/harness.h"

#include <cuda_fp8.h>

#include <cmath>
#include <cstring>

namespace entwine::harness {

__global__ void fill_random(uint16_t* out, int64_t count, uint64_t seed, bool bf16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    float v = hash_uniform(seed, i);
    if (bf16) {
      __nv_bfloat16 b = __float2bfloat16_rn(v);
      out[i] = *reinterpret_cast<uint16_t*>(&b);
    } else {
      __half h = __float2half_rn(v);
      out[i] = *reinterpret_cast<uint16_t*>(&h);
    }
  }
}

__global__ void fill_random_fp8(uint8_t* out, int64_t count, uint64_t seed, bool e5m2) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    float const v = 4.0f * hash_uniform(seed, i);
    out[i] = e5m2 ? __nv_fp8_e5m2(v).__x : __nv_fp8_e4m3(v).__x;
  }
}

double fp8_to_double(uint8_t bits, bool e5m2) {
  double const sign = bits & 0x80 ? -1.0 : 1.0;
  if (e5m2) {
    int const exponent = (bits >> 2) & 0x1F, mantissa = bits & 0x3;
    if (exponent == 0x1F) return mantissa == 0 ? sign * INFINITY : NAN;
    if (exponent == 0) return sign * std::ldexp(mantissa / 4.0, -14);
    return sign * std::ldexp(1.0 + mantissa / 4.0, exponent - 15);
  }
  int const exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return NAN;
  if (exponent == 0) return sign * std::ldexp(mantissa / 8.0, -6);
  return sign * std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
}

std::array<float, 2> fp8_scales(int rank) { return {0.5f + 0.125f * rank, 0.25f * float(1 + rank % 3)}; }

double to_double(uint16_t bits, bool bf16) {
  if (bf16) {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half h;
  std::memcpy(&h, &bits, 2);
  return double(__half2float(h));
}

int failures = 0;

void expect(bool ok, std::string const& what) {
  std::printf("%s  %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok) ++failures;
}

int sm_count() {
  int device = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

double host_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<float> interleaved_median_ms(std::vector<std::function<void()>> const& launches, cudaStream_t stream, int warmup,
                                         int rounds, int per_round) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (auto const& launch : launches)
    for (int i = 0; i < warmup; ++i) launch();
  std::vector<std::vector<float>> t(launches.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < launches.size(); ++i) {
      size_t const v = (r + i) % launches.size();
      CHECK_CUDA(cudaEventRecord(a, stream));
      for (int j = 0; j < per_round; ++j) launches[v]();
      CHECK_CUDA(cudaEventRecord(b, stream));
      CHECK_CUDA(cudaEventSynchronize(b));
      float ms;
      CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
      t[v].push_back(ms / per_round);
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::vector<float> medians;
  for (auto& times : t) {
    std::sort(times.begin(), times.end());
    medians.push_back(times[times.size() / 2]);
  }
  return medians;
}

float median_ms(std::function<void()> const& launch, cudaStream_t stream, int warmup, int iters) {
  return interleaved_median_ms({launch}, stream, warmup, iters, 1)[0];
}

}  // namespace entwine::harness
