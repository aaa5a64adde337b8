// The MoE weight gradients' GEMM (moe.wgrad: dw[e] = a[e]^T dy[e] over each segment's received rows):
// `moe wgrad test` checks dw against float64 on the host for ragged counts (empty segments and
// experts, a row, k-tile edges, all rows, counts past C or negative), with the rows past each count's
// k-tile NaN in both operands (a kernel that read them would show) and dw poisoned before the call;
// `moe wgrad bench` times it with a quarter and an eighth of the rows against itself with every row
// (what XLA's GEMM over the whole layout multiplies) and against cuBLASLt on the whole layout.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "harness/harness.h"
#include "moe/moe.h"

namespace entwine::harness {

namespace {

constexpr uint16_t kNanBits = 0xFFFF;  // NaN in bf16 and fp16

struct WgradCase {
  int world, e_local, capacity, m, n, block_n;
  bool bf16;
  int pattern;  // which counts (wgrad_rows)
};

// Segment (e, s)'s count: empty, one row, a k-tile edge (63, 64, 65), half, all, past C, negative;
// one pattern (3) leaves expert 0 without rows at all.
int wgrad_rows(WgradCase const& c, int e, int s) {
  if (c.pattern == 3 && e == 0) return 0;
  int const choices[] = {0, 1, 63, 64, 65, c.capacity / 2 + 1, c.capacity, c.capacity + 7, -5};
  return choices[(c.pattern * 5 + e * 3 + s * 7) % 9];
}

uint16_t to_bits(double v, bool bf16) {
  float const f = float(v);
  uint16_t u;
  if (bf16) {
    __nv_bfloat16 const b = __float2bfloat16_rn(f);
    std::memcpy(&u, &b, 2);
  } else {
    __half const h = __float2half_rn(f);
    std::memcpy(&u, &h, 2);
  }
  return u;
}

bool run_wgrad_case(WgradCase const& c, uint64_t seed) {
  int const k = c.world * c.capacity;
  MoeWgradProblem const problem{c.world, c.e_local, c.capacity, c.m, c.n, c.bf16 ? DType::kBF16 : DType::kFP16};
  MoeWgradPlan const plan = moe_wgrad_plan(problem, MoeConfig{c.block_n, sm_count(), 8, 0});
  char name[160];
  std::snprintf(name, sizeof name, "moe wgrad W=%d E_local=%d C=%d M=%d N=%d block_n=%d %s counts=%d", c.world,
                c.e_local, c.capacity, c.m, c.n, c.block_n, c.bf16 ? "bf16" : "fp16", c.pattern);
  if (plan.error) {
    expect(false, std::string(name) + ": plan refused: " + plan.error);
    return false;
  }
  std::vector<int32_t> received(size_t(c.e_local) * c.world);
  for (int e = 0; e < c.e_local; ++e) {
    for (int s = 0; s < c.world; ++s) received[e * c.world + s] = wgrad_rows(c, e, s);
  }
  // a [E_local, W*C, M] and dy [E_local, W*C, N]: random rows up to each count, a's rows past it and
  // up to its k-tile's end zero (dy's random: the contract needs one of them zero), NaN past that.
  size_t const a_elems = size_t(c.e_local) * k * c.m, dy_elems = size_t(c.e_local) * k * c.n;
  std::vector<double> a(a_elems), dy(dy_elems);
  std::vector<uint16_t> a_t_bits(a_elems), dy_bits(dy_elems);
  for (int e = 0; e < c.e_local; ++e) {
    for (int row = 0; row < k; ++row) {
      int const s = row / c.capacity, i = row % c.capacity;
      int const count = std::max(0, std::min(c.capacity, received[e * c.world + s]));
      int const read = (count + 63) / 64 * 64;
      for (int j = 0; j < c.m; ++j) {
        size_t const at = (size_t(e) * k + row) * c.m + j;
        uint16_t const bits = i < count ? to_bits(hash_uniform(seed, at), c.bf16) : i < read ? 0 : kNanBits;
        a_t_bits[(size_t(e) * c.m + j) * k + row] = bits;
        a[at] = i < count ? to_double(bits, c.bf16) : 0.0;
      }
      for (int j = 0; j < c.n; ++j) {
        size_t const at = (size_t(e) * k + row) * c.n + j;
        dy_bits[at] = i < read ? to_bits(hash_uniform(seed + 1, at), c.bf16) : kNanBits;
        dy[at] = i < read ? to_double(dy_bits[at], c.bf16) : 0.0;
      }
    }
  }
  void *a_t_d, *dy_d, *dw_d;
  int32_t* received_d;
  size_t const dw_elems = size_t(c.e_local) * c.m * c.n;
  CHECK_CUDA(cudaMalloc(&a_t_d, a_elems * 2));
  CHECK_CUDA(cudaMalloc(&dy_d, dy_elems * 2));
  CHECK_CUDA(cudaMalloc(&dw_d, dw_elems * 2));
  CHECK_CUDA(cudaMalloc(&received_d, received.size() * 4));
  CHECK_CUDA(cudaMemcpy(a_t_d, a_t_bits.data(), a_elems * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dy_d, dy_bits.data(), dy_elems * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(received_d, received.data(), received.size() * 4, cudaMemcpyHostToDevice));
  bool ok = true;
  std::vector<uint16_t> first;
  for (int call = 0; call < 2; ++call) {
    CHECK_CUDA(cudaMemset(dw_d, 0xFF, dw_elems * 2));  // poison: NaN everywhere
    MoeWgradArgs const args{a_t_d, dy_d, dw_d, received_d};
    CHECK_CUDA(moe::wgrad::launch_gemm(problem.input, problem.input, plan, args, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> got(dw_elems);
    CHECK_CUDA(cudaMemcpy(got.data(), dw_d, dw_elems * 2, cudaMemcpyDeviceToHost));
    if (call == 0) {
      double err2 = 0, ref2 = 0;
      bool finite = true, zeros = true;
      for (int e = 0; e < c.e_local; ++e) {
        bool has_rows = false;
        for (int s = 0; s < c.world; ++s) has_rows = has_rows || received[e * c.world + s] > 0;
        for (int i = 0; i < c.m; ++i) {
          for (int j = 0; j < c.n; ++j) {
            double ref = 0;
            for (int row = 0; row < k; ++row) {
              ref += a[(size_t(e) * k + row) * c.m + i] * dy[(size_t(e) * k + row) * c.n + j];
            }
            double const v = to_double(got[(size_t(e) * c.m + i) * c.n + j], c.bf16);
            finite = finite && std::isfinite(v);
            if (!has_rows) zeros = zeros && v == 0.0;
            err2 += (v - ref) * (v - ref);
            ref2 += ref * ref;
          }
        }
      }
      double const rel = std::sqrt(err2 / std::max(ref2, 1e-30));
      ok = finite && zeros && rel <= 1e-2;
      std::printf("%-96s rel_err %.2e %s%s%s\n", name, rel, finite ? "" : "NaN ", zeros ? "" : "empty expert not zero ",
                  ok ? "PASS" : "FAIL");
      first = got;
    } else {
      bool const same = got == first;
      if (!same) std::printf("%-96s repeat not bitwise equal FAIL\n", name);
      ok = ok && same;
    }
  }
  CHECK_CUDA(cudaFree(a_t_d));
  CHECK_CUDA(cudaFree(dy_d));
  CHECK_CUDA(cudaFree(dw_d));
  CHECK_CUDA(cudaFree(received_d));
  expect(ok, name);
  return ok;
}

}  // namespace

int moe_wgrad_test_main() {
  CHECK_CUDA(moe::wgrad::prepare_gemms());  // the kernels' shared memory (a handler's setup does this)
  int bad = 0;
  uint64_t seed = 11;
  for (int world : {1, 2, 3, 4}) {
    for (int pattern : {0, 1, 2, 3}) {
      WgradCase const c{world, world == 3 ? 3 : 2, pattern % 2 ? 256 : 128, 128 * (1 + pattern % 2),
                        pattern == 2 ? 384 : 256, pattern == 2 ? 128 : 256, pattern != 1, pattern};
      bad += !run_wgrad_case(c, seed++);
    }
  }
  std::printf("moe wgrad test: %s (%d failed)\n", bad ? "FAIL" : "PASS", bad);
  return bad ? 1 : 0;
}

// dw1 of the MLP step's shapes (bench_moe.py): per rank E_local experts, segments of C rows, dw
// [H, N]; each timed with every row (the dense work), a quarter and an eighth of each segment's
// rows, and cuBLASLt on the whole layout (E_local GEMMs [H, W*C] x [W*C, N]).
int moe_wgrad_bench_main() {
  struct Shape {
    int world, e_local, capacity, m, n;
  };
  Shape const shapes[] = {{1, 8, 4096, 4096, 28672}, {2, 4, 2048, 4096, 28672}, {1, 32, 4096, 7168, 4096}};
  CHECK_CUDA(moe::wgrad::prepare_gemms());
  CublasLt const* lt = CublasLt::load();
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("# moe wgrad (dw[e] = a[e]^T dy[e] over each segment's first R rows), bf16, block_n 256, every SM;\n"
              "# median ms: R = C (the whole layout), C/4, C/8; cublas_ms: cuBLASLt on the whole layout\n");
  std::printf("%-48s %9s %9s %9s %9s %8s %8s\n", "case", "all_ms", "quarter", "eighth", "cublas", "all/q", "cub/all");
  for (Shape const sh : shapes) {
    int const k = sh.world * sh.capacity;
    size_t const a_elems = size_t(sh.e_local) * sh.m * k, dy_elems = size_t(sh.e_local) * k * sh.n;
    void *a_t, *dy, *dw;
    int32_t* received;
    CHECK_CUDA(cudaMalloc(&a_t, a_elems * 2));
    CHECK_CUDA(cudaMalloc(&dy, dy_elems * 2));
    CHECK_CUDA(cudaMalloc(&dw, size_t(sh.e_local) * sh.m * sh.n * 2));
    CHECK_CUDA(cudaMalloc(&received, 3 * sh.e_local * sh.world * 4));
    fill_random<<<1024, 256, 0, stream>>>(static_cast<uint16_t*>(a_t), int64_t(a_elems), 5, true);
    fill_random<<<1024, 256, 0, stream>>>(static_cast<uint16_t*>(dy), int64_t(dy_elems), 6, true);
    std::vector<int32_t> counts;
    for (int div : {1, 4, 8}) {
      for (int i = 0; i < sh.e_local * sh.world; ++i) counts.push_back(sh.capacity / div);
    }
    CHECK_CUDA(cudaMemcpy(received, counts.data(), counts.size() * 4, cudaMemcpyHostToDevice));
    MoeWgradProblem const problem{sh.world, sh.e_local, sh.capacity, sh.m, sh.n, DType::kBF16};
    MoeWgradPlan const plan = moe_wgrad_plan(problem, MoeConfig{256, sm_count(), 8, 0});
    std::vector<std::function<void()>> launches;
    for (int v = 0; v < 3; ++v) {
      MoeWgradArgs const args{a_t, dy, dw, received + v * sh.e_local * sh.world};
      launches.push_back([=] { CHECK_CUDA(moe::wgrad::launch_gemm(DType::kBF16, DType::kBF16, plan, args, stream)); });
    }
    std::vector<float> const ms = interleaved_median_ms(launches, stream, 3, 10, 3);
    float cublas = NAN;
    if (lt) {
      std::vector<std::function<void()>> gemms;
      for (int e = 0; e < sh.e_local; ++e) {
        gemms.push_back(lt->gemm(sh.m, sh.n, k, static_cast<char*>(a_t) + size_t(e) * sh.m * k * 2,
                                 static_cast<char*>(dy) + size_t(e) * k * sh.n * 2,
                                 static_cast<char*>(dw) + size_t(e) * sh.m * sh.n * 2, stream));
      }
      cublas = median_ms([&] { for (auto const& g : gemms) g(); }, stream, 3, 10);
    }
    char name[96];
    std::snprintf(name, sizeof name, "W=%d E_local=%d C=%d M=%d N=%d", sh.world, sh.e_local, sh.capacity, sh.m, sh.n);
    std::printf("%-48s %9.3f %9.3f %9.3f %9.3f %8.2f %8.3f\n", name, ms[0], ms[1], ms[2], cublas, ms[0] / ms[1],
                cublas / ms[0]);
    CHECK_CUDA(cudaFree(a_t));
    CHECK_CUDA(cudaFree(dy));
    CHECK_CUDA(cudaFree(dw));
    CHECK_CUDA(cudaFree(received));
  }
  return 0;
}

}  // namespace entwine::harness
