// Shared pieces of the one-GPU harness (main.cu lists its commands): error checks, seeded inputs
// and their float64 conversions, PASS/FAIL lines, CUDA-graph capture of a call, timing in interleaved
// rounds and cuBLASLt as the reference GEMM. Each op's world of virtual ranks is in <op>_world.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "gemm/gemm.h"

#define CHECK_CUDA(expr)                                                                        \
  do {                                                                                          \
    cudaError_t err_ = (expr);                                                                  \
    if (err_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      std::exit(2);                                                                             \
    }                                                                                           \
  } while (0)

namespace entwine::harness {

// Deterministic uniform values in [-1, 1) from (seed, index), identical on host and device.
__host__ __device__ inline float hash_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return float(z >> 40) / float(1ull << 23) - 1.0f;
}

__global__ void fill_random(uint16_t* out, int64_t count, uint64_t seed, bool bf16);

// FP8 operands: hash_uniform scaled to [-4, 4), rounded to float8_e4m3fn, or to float8_e5m2 (a
// gradient's format, x of the e5m2 kernels), one byte each.
__global__ void fill_random_fp8(uint8_t* out, int64_t count, uint64_t seed, bool e5m2 = false);

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7F/0xFF are NaN.
// float8_e5m2 (e5m2): 1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like infinities and NaNs.
double fp8_to_double(uint8_t bits, bool e5m2 = false);

// Each rank's dequantisation scales (x's, w's): exact in binary, different per rank, so a block
// scaled with another rank's factor shows.
std::array<float, 2> fp8_scales(int rank);

// Block-scaled FP8 scales of one rank (the FFI layouts): x_scale [K/128, M] (M-major) and w_scale
// [N/128, w_k/128] (w_k: w_t's K, K unless given: ag_gemm's contraction layout has W shards' K).
// Each a power of two from 2^-8 to 2^2, drawn per block from (seed, rank), so that neighbouring
// blocks differ by up to three orders of magnitude (a scale read from the wrong row, K block or
// block column shows) while the products stay exact and inside fp16's range.
struct BlockScales {
  int x_k_blocks, m, n_blocks, w_k_blocks;
  std::vector<float> x, w;
  BlockScales(int m_, int n, int k, uint64_t seed, int rank, int64_t w_k = 0)
      : x_k_blocks((k + kScaleBlock - 1) / kScaleBlock), m(m_), n_blocks((n + kScaleBlock - 1) / kScaleBlock),
        w_k_blocks(int(((w_k > 0 ? w_k : k) + kScaleBlock - 1) / kScaleBlock)), x(size_t(x_k_blocks) * m_),
        w(size_t(n_blocks) * w_k_blocks) {
    auto power = [](float u) { return std::ldexp(1.0f, int(std::floor((u + 1.0f) * 5.5f)) - 8); };  // u in [-1, 1)
    for (size_t i = 0; i < x.size(); ++i) x[i] = power(hash_uniform(seed * 977 + 2 * rank, i));
    for (size_t i = 0; i < w.size(); ++i) w[i] = power(hash_uniform(seed * 977 + 2 * rank + 1, i));
  }
  float x_scale(int64_t row, int64_t kk) const { return x[size_t(kk / kScaleBlock) * m + row]; }
  float w_scale(int64_t col, int64_t kk) const { return w[size_t(col / kScaleBlock) * w_k_blocks + kk / kScaleBlock]; }
};

double to_double(uint16_t bits, bool bf16);

// Checks count into `failures`; each prints one PASS or FAIL line.
extern int failures;
void expect(bool ok, std::string const& what);

int sm_count();
double host_seconds();

// One call of every virtual rank captured into a CUDA graph from `origin`, as a handler's call
// would be: fork into `streams`, `enqueue` the call's work on them, join back, advance the epoch.
// Nothing in the graph changes between replays.
template <class Enqueue>
cudaGraphExec_t capture_call(cudaStream_t origin, std::vector<cudaStream_t> const& streams, uint64_t* epoch_word,
                             Enqueue&& enqueue) {
  cudaEvent_t fork;
  std::vector<cudaEvent_t> joins(streams.size());
  CHECK_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  for (auto& e : joins) CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CHECK_CUDA(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal));
  CHECK_CUDA(cudaEventRecord(fork, origin));
  for (cudaStream_t s : streams) CHECK_CUDA(cudaStreamWaitEvent(s, fork, 0));
  enqueue();
  for (size_t i = 0; i < streams.size(); ++i) {
    CHECK_CUDA(cudaEventRecord(joins[i], streams[i]));
    CHECK_CUDA(cudaStreamWaitEvent(origin, joins[i], 0));
  }
  CHECK_CUDA(comm::launch_end_call(comm::CallEnd{epoch_word}, origin));
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamEndCapture(origin, &graph));
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaEventDestroy(fork));
  for (auto e : joins) CHECK_CUDA(cudaEventDestroy(e));
  return exec;
}

// Graph safety (docs/design.md, "Graph safety"): the whole call of every rank captured once into a
// CUDA graph, then replayed with fresh inputs at the same addresses and poisoned outputs, every
// replay checked. Then the negative control: a graph in which the last rank takes no part. Its
// peers' waits must run into the deadline with the current epoch; were the epoch a value recorded
// at capture, the flags of earlier replays would satisfy them and the call would end without error.
// Serves both worlds (gemm_rs's World, ag_gemm's AgWorld).
template <class WorldT, class CaseT>
void run_graph(CaseT const& c, int replays) {
  WorldT world(c);
  cudaStream_t origin;
  CHECK_CUDA(cudaStreamCreateWithFlags(&origin, cudaStreamNonBlocking));
  cudaGraphExec_t const exec = world.capture(origin);
  double worst = 0;
  for (int i = 0; i < replays; ++i) {
    world.fill_inputs(3000 + i);
    world.poison_outputs();
    CHECK_CUDA(cudaGraphLaunch(exec, origin));
    CHECK_CUDA(cudaStreamSynchronize(origin));
    ++world.epoch;
    worst = std::max(worst, world.check());
  }
  DeviceError const healthy = world.read_error();
  double const tol = c.bf16 ? 1e-2 : 2e-3;
  char buf[256];
  std::snprintf(buf, sizeof buf, " graph: %d replays, rel err %.2e (tol %.0e)", replays, worst, tol);
  expect(worst <= tol && healthy.code == 0, describe(c) + buf);

  world.timeout_ns = 200'000'000ull;
  int const absent = c.world - 1;
  cudaGraphExec_t const without = world.capture(origin, absent);
  auto t0 = std::chrono::steady_clock::now();
  CHECK_CUDA(cudaGraphLaunch(without, origin));
  CHECK_CUDA(cudaStreamSynchronize(origin));
  double const secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++world.epoch;
  DeviceError const e = world.read_error();
  std::snprintf(buf, sizeof buf, " graph without rank %d: code=%u source=%d expected=%llu (epoch %llu) after %.2f s",
                absent, e.code, e.source, (unsigned long long)e.expected, (unsigned long long)world.epoch, secs);
  expect(e.code == kErrorDeadline && e.source == absent && stamp_epoch(e.expected) == world.epoch && secs < 5, describe(c) + buf);
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphExecDestroy(without));
  CHECK_CUDA(cudaStreamDestroy(origin));
}

// Median per-launch ms of each launcher, timed in interleaved rounds (one batch of `per_round`
// launches of each in turn, round r starting with launcher r mod n): back-to-back GEMMs run an
// H200 at its power cap, where a kernel's time depends on what ran just before it, so every variant
// gets the same history and no variant always follows the same one (docs/performance.md, "Reading
// the numbers").
std::vector<float> interleaved_median_ms(std::vector<std::function<void()>> const& launches, cudaStream_t stream,
                                         int warmup = 10, int rounds = 20, int per_round = 5);

// Median ms of `iters` single launches, each timed on its own, after `warmup` launches.
float median_ms(std::function<void()> const& launch, cudaStream_t stream, int warmup = 20, int iters = 100);

// cuBLASLt (the library behind XLA's GEMM), loaded at run time so the harness builds without it:
// the producer bench times it in the same interleaved rounds as the producer, so both see the same
// power-cap history. Like XLA's autotuner, it times the heuristic's candidate algorithms once per
// shape and keeps the fastest. Searched as libcublasLt.so.13 on the loader path (LD_LIBRARY_PATH).
struct CublasLt {
  struct Algo {
    uint64_t data[8];
  };
  struct HeuristicResult {
    Algo algo;
    size_t workspace_size;
    int state;
    float waves_count;
    int reserved[4];
  };
  using Create = int (*)(void**);
  using DescCreate = int (*)(void**, int, int);
  using LayoutCreate = int (*)(void**, int, uint64_t, uint64_t, int64_t);
  using PrefCreate = int (*)(void**);
  using Destroy = int (*)(void*);
  using PrefSet = int (*)(void*, int, void const*, size_t);
  using DescSet = int (*)(void*, int, void const*, size_t);
  using Heuristic = int (*)(void*, void*, void*, void*, void*, void*, void*, int, HeuristicResult*, int*);
  using Matmul = int (*)(void*, void*, void const*, void const*, void*, void const*, void*, void const*, void const*,
                         void*, void*, void*, Algo const*, void*, size_t, cudaStream_t);
  static constexpr int kBF16 = 14 /* CUDA_R_16BF */, kF32 = 0 /* CUDA_R_32F */, kE4M3 = 28 /* CUDA_R_8F_E4M3 */,
                       kCompute32F = 68;
  // cublasLtMatmulDescAttributes_t, cublasOperation_t and cublasLtMatmulMatrixScale_t values
  // (cublasLt.h of CUDA 13: CUBLASLT_MATMUL_DESC_A/B_SCALE_MODE, CUBLASLT_MATMUL_MATRIX_SCALE_
  // VEC128_32F and BLK128x128_32F).
  static constexpr int kDescTransA = 3, kDescAScale = 17, kDescBScale = 18, kOpT = 1;
  static constexpr int kDescAScaleMode = 31, kDescBScaleMode = 32, kScaleVec128 = 4, kScaleBlock128x128 = 5;
  static constexpr size_t kWorkspaceBytes = size_t(32) << 20;

  void* handle = nullptr;
  DescCreate desc_create = nullptr;
  LayoutCreate layout_create = nullptr;
  PrefCreate pref_create = nullptr;
  PrefSet pref_set = nullptr;
  DescSet desc_set = nullptr;
  Heuristic heuristic = nullptr;
  Matmul matmul = nullptr;
  Destroy desc_destroy = nullptr, layout_destroy = nullptr, pref_destroy = nullptr;
  void* workspace = nullptr;
  // Own copies of an FP8 GEMM's two scales, 256 bytes apart (the heuristic assumes aligned pointers;
  // the harness's scales sit 4 bytes apart), and a C matrix of its own (the FP8 GEMM out of place).
  float* scales = nullptr;

  static CublasLt* load() {
    void* lib = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return nullptr;
    static CublasLt lt;
    auto create = reinterpret_cast<Create>(dlsym(lib, "cublasLtCreate"));
    lt.desc_create = reinterpret_cast<DescCreate>(dlsym(lib, "cublasLtMatmulDescCreate"));
    lt.layout_create = reinterpret_cast<LayoutCreate>(dlsym(lib, "cublasLtMatrixLayoutCreate"));
    lt.pref_create = reinterpret_cast<PrefCreate>(dlsym(lib, "cublasLtMatmulPreferenceCreate"));
    lt.pref_set = reinterpret_cast<PrefSet>(dlsym(lib, "cublasLtMatmulPreferenceSetAttribute"));
    lt.desc_set = reinterpret_cast<DescSet>(dlsym(lib, "cublasLtMatmulDescSetAttribute"));
    lt.heuristic = reinterpret_cast<Heuristic>(dlsym(lib, "cublasLtMatmulAlgoGetHeuristic"));
    lt.matmul = reinterpret_cast<Matmul>(dlsym(lib, "cublasLtMatmul"));
    lt.desc_destroy = reinterpret_cast<Destroy>(dlsym(lib, "cublasLtMatmulDescDestroy"));
    lt.layout_destroy = reinterpret_cast<Destroy>(dlsym(lib, "cublasLtMatrixLayoutDestroy"));
    lt.pref_destroy = reinterpret_cast<Destroy>(dlsym(lib, "cublasLtMatmulPreferenceDestroy"));
    if (!create || !lt.desc_create || !lt.layout_create || !lt.pref_create || !lt.pref_set || !lt.desc_set || !lt.heuristic ||
        !lt.matmul || !lt.desc_destroy || !lt.layout_destroy || !lt.pref_destroy || create(&lt.handle) != 0)
      return nullptr;
    CHECK_CUDA(cudaMalloc(&lt.workspace, kWorkspaceBytes));
    CHECK_CUDA(cudaMalloc(&lt.scales, 512));
    return &lt;
  }

  // The scales of an FP8 GEMM: device scalars, y = x_scale * w_scale * (x @ w_t^T); or `block`:
  // DeepSeek-V3 block scaling, x's one per row and 128-wide K block (VEC128_32F), w_t's one per
  // 128x128 block (BLK128x128_32F), device arrays in cuBLASLt's layouts.
  struct Fp8Scales {
    float const* x;
    float const* w;
    bool block = false;
  };

  // Row-major bf16 y[M, N] = x[M, K] @ w[K, N] with fp32 accumulation (column-major: y^T = w^T x^T),
  // or with fp8 scales set: e4m3 x[M, K] and w_t[N, K] (FP8's one layout, "TN": column-major
  // y^T = (w_t viewed K x N)^T x), dequantised by the scales and promoted as cuBLASLt does by default
  // (CUBLASLT_MATMUL_DESC_FAST_ACCUM off, the kernels' choice too); with the fastest of the
  // heuristic's algorithms (timed in interleaved rounds); returns the launcher, or an empty one (with
  // the reason printed) where cublasLtMatmul refuses every algorithm.
  std::function<void()> gemm(int m, int n, int k, void const* x, void const* w, void* y, cudaStream_t stream,
                             Fp8Scales const* fp8 = nullptr) const {
    std::vector<std::function<void()>> const all = candidates(m, n, k, x, w, y, stream, fp8);
    if (all.empty()) {
      if (!fp8) check(-1, "every algorithm refused");
      return {};
    }
    std::vector<float> const ms = interleaved_median_ms(all, stream, 3, 5, 3);
    return all[std::min_element(ms.begin(), ms.end()) - ms.begin()];
  }

  // The launchers of every algorithm the heuristic offers, in its order.
  std::vector<std::function<void()>> candidates(int m, int n, int k, void const* x, void const* w, void* y,
                                                cudaStream_t stream, Fp8Scales const* fp8 = nullptr) const {
    void *desc, *a, *b, *d, *pref;
    check(desc_create(&desc, kCompute32F, kF32));
    void* c = y;
    std::shared_ptr<void> c_own;
    if (fp8) {
      int const trans = kOpT;
      float const* a_scale = scales;
      float const* b_scale = scales + 64;
      if (fp8->block) {
        // cuBLASLt's A is w_t (K x N, transposed), its B is x (K x M).
        a_scale = fp8->w;
        b_scale = fp8->x;
        // A cuBLASLt without these modes (or without them on this GPU) refuses here or in the
        // heuristic: then there is no cuBLAS column, not an exit.
        int const a_mode = kScaleBlock128x128, b_mode = kScaleVec128;
        int const status_a = desc_set(desc, kDescAScaleMode, &a_mode, sizeof a_mode);
        int const status_b = desc_set(desc, kDescBScaleMode, &b_mode, sizeof b_mode);
        if (status_a != 0 || status_b != 0) {
          std::printf("(cuBLASLt refuses the block scale modes: status %d, %d: no cuBLAS column)\n", status_a, status_b);
          desc_destroy(desc);
          return {};
        }
      } else {
        CHECK_CUDA(cudaMemcpy(scales, fp8->w, sizeof(float), cudaMemcpyDeviceToDevice));
        CHECK_CUDA(cudaMemcpy(scales + 64, fp8->x, sizeof(float), cudaMemcpyDeviceToDevice));
      }
      check(desc_set(desc, kDescTransA, &trans, sizeof trans));
      check(desc_set(desc, kDescAScale, &a_scale, sizeof a_scale));
      check(desc_set(desc, kDescBScale, &b_scale, sizeof b_scale));
      CHECK_CUDA(cudaMalloc(&c, size_t(m) * n * 2));
      c_own.reset(c, [](void* p) { cudaFree(p); });
      check(layout_create(&a, kE4M3, k, n, k));
      check(layout_create(&b, kE4M3, k, m, k));
    } else {
      check(layout_create(&a, kBF16, n, k, n));
      check(layout_create(&b, kBF16, k, m, k));
    }
    check(layout_create(&d, kBF16, n, m, n));
    check(pref_create(&pref));
    uint64_t const max_workspace = kWorkspaceBytes;
    check(pref_set(pref, 1 /* CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES */, &max_workspace, sizeof max_workspace));
    HeuristicResult results[16];
    int count = 0;
    int const heuristic_status = heuristic(handle, desc, a, b, d, d, pref, 16, results, &count);
    check(pref_destroy(pref));
    if (fp8 && fp8->block && (heuristic_status != 0 || count == 0)) {
      std::printf("(cuBLASLt block-scaled FP8 GEMM %dx%dx%d: heuristic status %d, %d algorithms: no cuBLAS column)\n",
                  m, n, k, heuristic_status, count);
      layout_destroy(a);
      layout_destroy(b);
      layout_destroy(d);
      desc_destroy(desc);
      return {};
    }
    check(heuristic_status, "cublasLtMatmulAlgoGetHeuristic");
    if (count == 0) check(-1, "no algorithm");
    // The descriptors live as long as the launchers that use them.
    Destroy const destroy_desc = desc_destroy, destroy_layout = layout_destroy;
    std::shared_ptr<void> const descriptors(desc, [=](void* p) {
      destroy_layout(a);
      destroy_layout(b);
      destroy_layout(d);
      destroy_desc(p);
    });
    static float const alpha = 1.0f, beta = 0.0f;
    Matmul const run = matmul;
    void* const lt = handle;
    void* const ws = workspace;
    std::vector<std::function<void()>> launchers;
    int last_status = 0;
    for (int i = 0; i < count; ++i) {
      if (results[i].state != 0) continue;
      Algo const algo = results[i].algo;
      // The heuristic has offered FP8 algorithms that cublasLtMatmul then refused (NOT_SUPPORTED):
      // tried once, such a candidate is left out.
      last_status = run(lt, descriptors.get(), &alpha, w, a, x, b, &beta, c, d, y, d, &algo, ws, kWorkspaceBytes, stream);
      if (last_status != 0) continue;
      launchers.push_back([=]() {
        check(run(lt, descriptors.get(), &alpha, w, a, x, b, &beta, c, d, y, d, &algo, ws, kWorkspaceBytes, stream),
              "cublasLtMatmul");
        (void)c_own;
      });
    }
    if (launchers.empty()) {
      std::printf("(cuBLASLt %s GEMM %dx%dx%d: cublasLtMatmul refused all %d algorithms of the heuristic, last status %d;"
                  " CUBLASLT_LOG_LEVEL=5 says why: no cuBLAS column)\n",
                  !fp8 ? "bf16" : fp8->block ? "block-scaled FP8" : "FP8", m, n, k, count, last_status);
    }
    return launchers;
  }

  static void check(int status, const char* what = "") {
    if (status != 0) {
      std::fprintf(stderr, "cuBLASLt call failed: %s: status %d (CUBLASLT_LOG_LEVEL=5 says why)\n", what, status);
      std::exit(2);
    }
  }
};

// The design suite of the benchmarks (entwine_jax/tuning/timing.py DESIGN_SUITE; M, N, K of one rank's GEMM;
// W = 2 partitions).
inline constexpr std::array<int, 3> kDesignSuite[] = {
    {4096, 8192, 1024}, {8192, 8192, 1024},  {16384, 8192, 1024},  {8192, 8192, 3584},
    {16384, 8192, 3584}, {8192, 16384, 2048}, {16384, 16384, 2048}, {16384, 16384, 6656}};

// The commands (main.cu's table), each in the file of its concern.
// gemm_rs_test.cu
int test_main();
// gemm_rs_bench.cu
int bench_main(char const* jsonl, char const* section);
int producer_main(int argc, char** argv);
int energy_main(bool suite, std::vector<std::array<int, 3>> const& shapes, double seconds, bool names_only);
// ag_gemm.cu
int ag_test_main();
int ag_bench_main();
int ag_push_main();
// moe.cu
int moe_test_main();
int moe_bench_main();
int moe_wgrad_test_main();
int moe_wgrad_bench_main();
// fp8.cu
int fp8_test_main();
int fp8_bench_main();
CublasLt const* prepare_fp8_bench();
int fp8_accuracy_main();
int fp8_order_main(bool profile);
// fp8_block.cu
int fp8block_test_main();
int fp8block_bench_main();
// sanitize.cu
int sanitize_main(bool sequential);
int ag_sanitize_main();
// api.cu
int api_main();

}  // namespace entwine::harness
