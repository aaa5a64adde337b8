// One-GPU harness for the producer and consumer kernels: W virtual ranks on one GPU (every rank's
// partials and flags in this GPU's memory, each rank's producer and consumer on its own streams),
// checked against a float64 host reference, plus the kernel benchmarks.
//   entwine_harness test              protocol + kernels, W in {1,2,4,8}, several epochs, deadline
//   entwine_harness ag test           ag_gemm: both layouts, W in {1,2,4,8}, both pushes, several
//                                     epochs, deadline, graphs
//   entwine_harness ag bench          ag_gemm's GEMM alone (chunks released) vs cuBLASLt
//   entwine_harness ag push           one push alone, copy engines vs SM push, shards of 0.25-67 MB
//   entwine_harness sanitize [sequential]   two small cases (for compute-sanitizer)
//   entwine_harness bench [out.jsonl] [fused|producer|consumer]   fused one-rank grid sweep,
//                                     producer alone (order/flag costs), consumer bandwidth sweep
//   entwine_harness producer M N K block_n producer_sms raster_rows [plain]   (three launches, for ncu)
//   entwine_harness energy M N K [seconds] [names]   steady-state time, board power and energy per
//                                     GEMM of the producer and of every cuBLASLt algorithm
//   entwine_harness energy suite [seconds] [shapes]   the same on the design suite (its first
//                                     `shapes` shapes): order and flag costs and the ratio to
//                                     cuBLASLt's fastest algorithm, one line per shape
//   entwine_harness fp8 test          FP8 operands (e4m3, or x in e5m2 with w_t in e4m3; f32 scales)
//                                     of both ops against float64 of the dequantised inputs:
//                                     W in {1,2,4,8}, bf16/fp16 outputs,
//                                     per-shard and shared scales, both pushes, split tail, graphs,
//                                     a failed call's three outputs poisoned
//   entwine_harness api               the host cost of each CUDA call a handler makes
//   entwine_harness fp8 bench         the FP8 producer and ag_gemm's FP8 GEMM vs cuBLASLt's FP8 GEMM
//                                     on the design suite; an FP8 shard's push time vs a bf16 one
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ag_gemm/ag_gemm.h"
#include "comm/comm.h"
#include "gemm_rs/gemm_rs.h"

using namespace entwine;

#define CHECK_CUDA(expr)                                                                        \
  do {                                                                                          \
    cudaError_t err_ = (expr);                                                                  \
    if (err_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      std::exit(2);                                                                             \
    }                                                                                           \
  } while (0)

namespace {

// Deterministic uniform values in [-1, 1) from (seed, index), identical on host and device.
__host__ __device__ inline float hash_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return float(z >> 40) / float(1ull << 23) - 1.0f;
}

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

// FP8 operands: hash_uniform scaled to [-4, 4), rounded to float8_e4m3fn, or to float8_e5m2 (a
// gradient's format, x of the e5m2 kernels), one byte each.
__global__ void fill_random_fp8(uint8_t* out, int64_t count, uint64_t seed, bool e5m2 = false) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    float const v = 4.0f * hash_uniform(seed, i);
    out[i] = e5m2 ? __nv_fp8_e5m2(v).__x : __nv_fp8_e4m3(v).__x;
  }
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7F/0xFF are NaN.
// float8_e5m2 (e5m2): 1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like infinities and NaNs.
double fp8_to_double(uint8_t bits, bool e5m2 = false) {
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

// Each rank's dequantisation scales (x's, w's): exact in binary, different per rank, so a block
// scaled with another rank's factor shows.
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

struct Case {
  int m, n, k, world;
  bool bf16;  // the output's type (and the inputs', unless fp8)
  GemmRsConfig config;
  bool scatter_cols = false;
  bool fp8 = false;  // x [M, K] and w_t [N, K] in e4m3, with each rank's fp8_scales
  bool x_e5m2 = false;  // FP8: x in e5m2 instead (the backward's gradient; w_t stays e4m3)
  ProblemShape shape(int rank) const {
    ProblemShape s{m, n, k, world, rank};
    s.scatter_cols = scatter_cols;
    return s;
  }
  DType output() const { return bf16 ? DType::kBF16 : DType::kFP16; }
  DType input() const { return !fp8 ? output() : x_e5m2 ? DType::kE5M2 : DType::kE4M3; }
  // Rank r's plan: the cases are aligned, so it plans the case's own shape (run_case checks that).
  GemmRsPlan plan(int rank) const { return plan_of(shape(rank), config, input()); }
  static GemmRsPlan plan_of(ProblemShape const& s, GemmRsConfig const& config, DType input = DType::kBF16) {
    return gemm_rs_plan(GemmRsProblem{s.m, s.n, s.k, s.world, s.rank, s.scatter_cols, input}, config);
  }
};

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

struct VirtualRank {
  // partial[1] = partial[0] + M*N and flags holds two parities: the layout the kernels assume
  // (CallEpoch's strides).
  uint16_t *x = nullptr, *w = nullptr, *partial[2] = {nullptr, nullptr}, *out = nullptr;  // FP8: x, w_t bytes
  uint64_t* flags = nullptr;
  float* scales = nullptr;          // FP8: x's and w's dequantisation scales
  void* split_workspace = nullptr;  // the producer's split tail (one per producer stream)
  cudaStream_t producer_stream = nullptr, consumer_stream = nullptr;
};

// All ranks of one problem on this GPU.
struct World {
  Case c;
  std::vector<VirtualRank> ranks;
  DeviceError* error = nullptr;
  uint64_t epoch = 0;                // the last call's epoch, as the host counts it
  uint64_t* epoch_word = nullptr;    // the next call's epoch, on the device (one word for all ranks)
  int64_t flags_per_parity = 0;

  explicit World(Case const& c_) : c(c_), ranks(c_.world) {
    int lo, hi;
    CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    size_t const mn = size_t(c.m) * c.n, mk = size_t(c.m) * c.k, kn = size_t(c.k) * c.n;
    ProblemShape s = c.shape(0);
    for (auto& r : ranks) {
      CHECK_CUDA(cudaMalloc(&r.x, mk * 2));
      CHECK_CUDA(cudaMalloc(&r.w, kn * 2));
      CHECK_CUDA(cudaMalloc(&r.partial[0], 2 * mn * 2));
      r.partial[1] = r.partial[0] + mn;
      CHECK_CUDA(cudaMalloc(&r.out, mn / c.world * 2));
      flags_per_parity = int64_t(c.world) * s.tiles_per_partition();
      CHECK_CUDA(cudaMalloc(&r.flags, 2 * sizeof(uint64_t) * flags_per_parity));
      CHECK_CUDA(cudaMemset(r.flags, 0, 2 * sizeof(uint64_t) * flags_per_parity));
      CHECK_CUDA(cudaMalloc(&r.split_workspace, kSplitWorkspaceBytes));
      CHECK_CUDA(cudaMemset(r.split_workspace, 0, kSplitWorkspaceBytes));
      CHECK_CUDA(cudaMalloc(&r.scales, 2 * sizeof(float)));
      CHECK_CUDA(cudaStreamCreateWithPriority(&r.producer_stream, cudaStreamNonBlocking, lo));
      CHECK_CUDA(cudaStreamCreateWithPriority(&r.consumer_stream, cudaStreamNonBlocking, hi));
    }
    CHECK_CUDA(cudaMalloc(&error, sizeof(DeviceError)));
    CHECK_CUDA(cudaMemset(error, 0, sizeof(DeviceError)));
    CHECK_CUDA(cudaMalloc(&epoch_word, sizeof(uint64_t)));
    set_epoch(1);
    CHECK_CUDA(cudaDeviceSynchronize());  // before any launch on the non-blocking rank streams
  }

  // The device word (benchmarks that hold the epoch still); the host count follows it.
  void set_epoch(uint64_t next) {
    CHECK_CUDA(cudaMemcpy(epoch_word, &next, sizeof(next), cudaMemcpyHostToDevice));
    epoch = next - 1;
  }

  CallEpoch call_epoch(bool trap = false) const {
    return CallEpoch{epoch_word, int64_t(size_t(c.m) * c.n * 2), flags_per_parity, trap};
  }
  ~World() {
    for (auto& r : ranks) {
      cudaFree(r.x);
      cudaFree(r.w);
      cudaFree(r.partial[0]);
      cudaFree(r.out);
      cudaFree(r.flags);
      cudaFree(r.scales);
      cudaFree(r.split_workspace);
      cudaStreamDestroy(r.producer_stream);
      cudaStreamDestroy(r.consumer_stream);
    }
    cudaFree(error);
    cudaFree(epoch_word);
  }

  void fill_inputs(uint64_t seed) {
    for (int r = 0; r < c.world; ++r) {
      if (c.fp8) {
        fill_random_fp8<<<264, 256>>>(reinterpret_cast<uint8_t*>(ranks[r].x), int64_t(c.m) * c.k, seed * 131 + 2 * r,
                                      c.x_e5m2);
        fill_random_fp8<<<264, 256>>>(reinterpret_cast<uint8_t*>(ranks[r].w), int64_t(c.k) * c.n, seed * 131 + 2 * r + 1);
        std::array<float, 2> const scales = fp8_scales(r);
        CHECK_CUDA(cudaMemcpy(ranks[r].scales, scales.data(), sizeof scales, cudaMemcpyHostToDevice));
        continue;
      }
      fill_random<<<264, 256>>>(ranks[r].x, int64_t(c.m) * c.k, seed * 131 + 2 * r, c.bf16);
      fill_random<<<264, 256>>>(ranks[r].w, int64_t(c.k) * c.n, seed * 131 + 2 * r + 1, c.bf16);
    }
    CHECK_CUDA(cudaGetLastError());
    // The ranks' streams are non-blocking: they do not wait for the legacy stream by themselves.
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  // NaN in both dtypes (0xFFFF): an unwritten output element cannot pass the check.
  void poison_outputs() {
    for (auto& r : ranks) CHECK_CUDA(cudaMemset(r.out, 0xFF, size_t(c.m) * c.n / c.world * 2));
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  // Rank r's producer arguments: its inputs, its partial slot 0, every owner's flag array (the
  // kernel adds the parity of the device epoch).
  ProducerArgs producer_args(int r) {
    ProducerArgs a{};
    a.x = ranks[r].x;
    a.w = ranks[r].w;
    a.x_scale = ranks[r].scales;
    a.w_scale = ranks[r].scales + 1;
    a.partial = ranks[r].partial[0];
    a.split_workspace = ranks[r].split_workspace;
    for (int q = 0; q < c.world; ++q) a.flags[q] = ranks[q].flags;
    a.call = call_epoch();
    return a;
  }

  // Rank r's consumer arguments: every source's partial slot 0, its own flags.
  ConsumerArgs consumer_args(int r, bool trap = false) {
    ConsumerArgs a{};
    for (int q = 0; q < c.world; ++q) a.partial[q] = ranks[q].partial[0];
    a.flags = ranks[r].flags;
    a.out = ranks[r].out;
    a.error = error;
    a.call = call_epoch(trap);
    a.timeout_ns = timeout_ns;
    return a;
  }

  // One gemm_rs call on every rank (skip_rank: that rank's producer never runs), then the epoch
  // advance, as the handler orders them.
  // Sequential (sanitizers that serialise or slow kernels by orders of magnitude): every producer
  // runs to completion before the consumers start, so no wait can reach its deadline.
  bool sequential = false;
  uint64_t timeout_ns = 3'000'000'000ull;

  void call(int skip_rank = -1) {
    ++epoch;
    if (sequential) {
      launch_producers(skip_rank);
      launch_consumers();
    } else {
      launch_consumers();
      launch_producers(skip_rank);
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(comm::launch_end_call(comm::CallEnd{epoch_word}, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  void launch_consumers() {
    for (int r = 0; r < c.world; ++r) {
      CHECK_CUDA(launch_consumer(c.output(), c.plan(r), consumer_args(r), ranks[r].consumer_stream, false));
    }
    if (sequential) CHECK_CUDA(cudaDeviceSynchronize());
  }

  void launch_producers(int skip_rank) {
    for (int r = 0; r < c.world; ++r) {
      if (r == skip_rank) continue;
      CHECK_CUDA(gemm_rs::launch_gemm(c.input(), c.output(), c.plan(r), producer_args(r), ranks[r].producer_stream));
    }
    if (sequential) CHECK_CUDA(cudaDeviceSynchronize());
  }

  // The whole call as one CUDA graph (capture_call): every rank's consumer and producer streams.
  cudaGraphExec_t capture(cudaStream_t origin, int skip_rank = -1) {
    std::vector<cudaStream_t> streams;
    for (auto& r : ranks) streams.insert(streams.end(), {r.consumer_stream, r.producer_stream});
    return capture_call(origin, streams, epoch_word, [&] {
      launch_consumers();
      launch_producers(skip_rank);
    });
  }

  std::vector<uint16_t> download(uint16_t const* p, size_t count) {
    std::vector<uint16_t> h(count);
    CHECK_CUDA(cudaMemcpy(h.data(), p, count * 2, cudaMemcpyDeviceToHost));
    return h;
  }

  // Every rank's w [K, N] in float64, for the host references below (FP8: w_t dequantised).
  std::vector<std::vector<double>> weights() {
    std::vector<std::vector<double>> ws;
    for (int r = 0; r < c.world; ++r) {
      ws.emplace_back(size_t(c.k) * c.n);
      if (c.fp8) {
        std::vector<uint8_t> w_t(size_t(c.k) * c.n);
        CHECK_CUDA(cudaMemcpy(w_t.data(), ranks[r].w, w_t.size(), cudaMemcpyDeviceToHost));
        double const scale = fp8_scales(r)[1];
        for (int j = 0; j < c.n; ++j) {
          for (int kk = 0; kk < c.k; ++kk) ws.back()[size_t(kk) * c.n + j] = scale * fp8_to_double(w_t[size_t(j) * c.k + kk]);
        }
        continue;
      }
      auto w = download(ranks[r].w, size_t(c.k) * c.n);
      for (size_t i = 0; i < w.size(); ++i) ws.back()[i] = to_double(w[i], c.bf16);
    }
    return ws;
  }

  // Row i of rank r's x in float64 (FP8: dequantised).
  std::vector<double> x_row(int r, int64_t i) {
    std::vector<double> row(c.k);
    if (c.fp8) {
      std::vector<uint8_t> bytes(c.k);
      CHECK_CUDA(cudaMemcpy(bytes.data(), reinterpret_cast<uint8_t*>(ranks[r].x) + i * c.k, c.k, cudaMemcpyDeviceToHost));
      for (int kk = 0; kk < c.k; ++kk) row[kk] = fp8_scales(r)[0] * fp8_to_double(bytes[kk], c.x_e5m2);
      return row;
    }
    auto const bits = download(ranks[r].x + i * c.k, c.k);
    for (int kk = 0; kk < c.k; ++kk) row[kk] = to_double(bits[kk], c.bf16);
    return row;
  }

  // row += x_row @ w in float64 (x_row: K values, w: K x N).
  void add_product_row(std::vector<double>& row, std::vector<double> const& x_row, std::vector<double> const& w) const {
    for (int kk = 0; kk < c.k; ++kk) {
      double const xv = x_row[kk];
      double const* wr = w.data() + size_t(kk) * c.n;
      for (int j = 0; j < c.n; ++j) row[j] += xv * wr[j];
    }
  }

  // Accumulates ||got - ref||^2 and ||ref||^2 over `count` elements; false on a NaN (an unwritten
  // element).
  bool add_error(uint16_t const* got, double const* ref, int count, double& err2, double& ref2) const {
    for (int j = 0; j < count; ++j) {
      double const o = to_double(got[j], c.bf16);
      if (std::isnan(o)) return false;
      err2 += (o - ref[j]) * (o - ref[j]);
      ref2 += ref[j] * ref[j];
    }
    return true;
  }

  // Relative error ||out - ref|| / ||ref|| over about 48 rows per owner (every row of small
  // partitions; odd stride so the checked rows fall at varying offsets inside the 128-row tiles),
  // against a float64 host reference; NaN (an unwritten element) fails.
  double check() {
    ProblemShape const s = c.shape(0);
    int const rows = s.part_rows(), cols = s.part_cols();
    int const stride = rows <= 48 ? 1 : ((rows / 48) | 1);
    auto const ws = weights();
    double err2 = 0, ref2 = 0;
    std::vector<double> row(c.n);
    for (int owner = 0; owner < c.world; ++owner) {
      auto out = download(ranks[owner].out, size_t(rows) * cols);
      int64_t const row0 = s.part_row0(owner), col0 = s.part_col0(owner);
      for (int i = owner % stride; i < rows; i += stride) {
        std::fill(row.begin(), row.end(), 0.0);
        for (int src = 0; src < c.world; ++src) add_product_row(row, x_row(src, row0 + i), ws[src]);
        if (!add_error(out.data() + size_t(i) * cols, row.data() + col0, cols, err2, ref2)) return INFINITY;
      }
    }
    return std::sqrt(err2 / std::max(ref2, 1e-30));
  }

  // Relative error of every rank's partial output (slot `slot`) against its own x @ w in float64,
  // over every 7th row: tells a wrong producer from a wrong consumer.
  double check_partials(int slot) {
    auto const ws = weights();
    double err2 = 0, ref2 = 0;
    std::vector<double> row(c.n);
    for (int r = 0; r < c.world; ++r) {
      auto part = download(ranks[r].partial[slot], size_t(c.m) * c.n);
      for (int i = 0; i < c.m; i += 7) {
        std::fill(row.begin(), row.end(), 0.0);
        add_product_row(row, x_row(r, i), ws[r]);
        if (!add_error(part.data() + size_t(i) * c.n, row.data(), c.n, err2, ref2)) return INFINITY;
      }
    }
    return std::sqrt(err2 / std::max(ref2, 1e-30));
  }

  std::vector<std::vector<uint16_t>> outputs() {
    std::vector<std::vector<uint16_t>> o;
    for (auto& r : ranks) o.push_back(download(r.out, size_t(c.m) * c.n / c.world));
    return o;
  }

  DeviceError read_error() {
    DeviceError e;
    CHECK_CUDA(cudaMemcpy(&e, error, sizeof e, cudaMemcpyDeviceToHost));
    return e;
  }
};

int failures = 0;

void expect(bool ok, std::string const& what) {
  std::printf("%s  %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok) ++failures;
}

std::string describe(Case const& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "W=%d M=%d N=%d K=%d %s%s scatter=%s block_n=%d producer_sms=%d x=%d b=%d r=%d",
                c.world, c.m, c.n, c.k, !c.fp8 ? "" : c.x_e5m2 ? "e5m2xe4m3->" : "e4m3->", c.bf16 ? "bf16" : "fp16", c.scatter_cols ? "cols" : "rows", int(c.config.block_n),
                int(c.config.producer_sms), int(c.config.consumer_grid), int(c.config.consumer_block),
                int(c.config.raster_rows));
  return buf;
}

// Several epochs in a row with no resets: fresh inputs and poisoned outputs each epoch, checked
// against float64; then the same inputs again must give bitwise identical outputs.
void run_case(Case const& c, int epochs, bool sequential = false, bool check_partials = false) {
  GemmRsPlan const plan = c.plan(0);
  if (plan.error != nullptr) {
    expect(false, describe(c) + ": " + plan.error);
    return;
  }
  if (plan.shape.m != c.m || plan.shape.n != c.n || plan.shape.k != c.k) {
    expect(false, describe(c) + ": the case is not aligned (its plan pads it)");
    return;
  }
  // A case that asks for the split tail is built to split: make sure it does (rank 0's plan).
  if (c.config.split_tail) expect(plan.split, describe(c) + ": split_tail set but nothing splits");
  World world(c);
  world.sequential = sequential;
  double worst = 0, worst_partial = 0;
  for (int e = 0; e < epochs; ++e) {
    world.fill_inputs(1000 + e);
    world.poison_outputs();
    world.call();
    worst = std::max(worst, world.check());
    if (check_partials) worst_partial = std::max(worst_partial, world.check_partials(int(world.epoch % 2)));
  }
  auto first = world.outputs();
  world.poison_outputs();
  world.call();
  bool const bitwise = world.outputs() == first;
  DeviceError const e = world.read_error();
  double const tol = c.bf16 ? 1e-2 : 2e-3;
  char buf[128];
  std::snprintf(buf, sizeof buf, ": %d epochs, rel err %.2e (tol %.0e), bitwise repeat %s", epochs, worst, tol,
                bitwise ? "yes" : "NO");
  std::string what = describe(c) + buf;
  if (check_partials) {
    std::snprintf(buf, sizeof buf, ", partials rel err %.2e", worst_partial);
    what += buf;
  }
  expect(worst <= tol && bitwise && e.code == 0 && worst_partial <= tol, what);
}

// A rank whose producer never runs: every other consumer must record the deadline and return.
void run_deadline(int world_size) {
  Case c{world_size * 128, 256, 64, world_size, true, GemmRsConfig{128, 0, 4, 256}};
  World world(c);
  world.fill_inputs(7);
  world.call();  // a healthy epoch first
  int const missing = world_size - 1;
  auto t0 = std::chrono::steady_clock::now();
  world.timeout_ns = 200'000'000ull;
  world.call(missing);
  double const secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  DeviceError const e = world.read_error();
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "deadline W=%d: code=%u rank=%d source=%d tile=%d expected=%llu observed=%llu after %.2f s",
                world_size, e.code, e.rank, e.source, e.tile, (unsigned long long)e.expected,
                (unsigned long long)e.observed, secs);
  // Parity 0's flags (epoch 2) were never written: the healthy call used parity 1.
  expect(e.code == kErrorDeadline && e.source == missing && stamp_epoch(e.expected) == 2 && e.observed == 0 && secs < 5, buf);
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

int test_main() {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  GemmRsConfig const base{128, 0, 8, 512};
  for (int world : {1, 2, 4, 8}) {
    for (bool bf16 : {true, false}) {
      Case c{world * 256, 512, 320, world, bf16, base};  // K = 5 blocks of 64
      run_case(c, 3);
    }
  }
  // Block shape, persistent grid, block sizes, K tail (K % 64 != 0), larger tiles counts.
  run_case(Case{2 * 512, 1024, 200, 2, true, GemmRsConfig{256, 0, 16, 512}}, 3);
  run_case(Case{4 * 256, 768, 136, 4, true, GemmRsConfig{128, 100, 8, 256}}, 3);
  run_case(Case{2 * 1024, 2048, 1024, 2, true, GemmRsConfig{256, 120, 8, 128}}, 2);
  run_case(Case{8 * 128, 2560, 512, 8, false, GemmRsConfig{256, 0, 4, 512}}, 2);
  run_case(Case{2 * 2048, 4096, 1024, 2, true, GemmRsConfig{128, 0, 32, 512}}, 2);
  // Persistent grids G that split their tail in K: B blocks, R = B % G, T k-tiles with
  // (G - R) * T >= 16 * G (producer.cuh). Odd grids, K tails, both widths and dtypes, rows and columns.
  run_case(Case{2 * 1024, 1024, 2000, 2, true, GemmRsConfig{128, 7, 8, 512, 8, 1}}, 3);     // B 128, R 2, T 32
  run_case(Case{2 * 1024, 1024, 2000, 2, false, GemmRsConfig{128, 7, 8, 512, 8, 1}}, 2);    // B 128, R 2, T 32
  run_case(Case{4 * 512, 1024, 1480, 4, false, GemmRsConfig{256, 7, 8, 256, 8, 1}}, 2);     // B 64, R 1, T 24
  run_case(Case{8 * 256, 1024, 1152, 8, true, GemmRsConfig{256, 9, 8, 512, 2, 1}}, 2);      // B 64, R 1, T 18
  run_case(Case{512, 2 * 1024, 1600, 2, true, GemmRsConfig{256, 6, 8, 512, 8, 1}, true}, 2);  // B 32, R 2, T 25
  // Raster groups with a partial last group (5 tile rows per partition, groups of 2 and 3).
  run_case(Case{2 * 640, 1024, 256, 2, true, GemmRsConfig{256, 60, 8, 512, 2}}, 2);
  run_case(Case{4 * 640, 640, 128, 4, false, GemmRsConfig{128, 0, 8, 256, 3}}, 2);
  // Scatter over columns (partition q = columns q*N/W ..): W in {1, 2, 4, 8}, both block widths.
  run_case(Case{384, 512, 192, 1, true, GemmRsConfig{256, 0, 4, 512}, true}, 2);
  run_case(Case{640, 2 * 512, 320, 2, true, GemmRsConfig{256, 60, 8, 512, 2}, true}, 3);
  run_case(Case{512, 4 * 384, 136, 4, false, GemmRsConfig{128, 0, 8, 256, 3}, true}, 2);
  run_case(Case{256, 8 * 256, 256, 8, true, GemmRsConfig{256, 0, 4, 512}, true}, 2);
  run_deadline(2);
  run_deadline(4);
  run_graph<World>(Case{2 * 512, 1024, 200, 2, true, GemmRsConfig{256, 0, 16, 512}}, 6);
  run_graph<World>(Case{4 * 256, 768, 136, 4, false, GemmRsConfig{128, 100, 8, 256}}, 6);
  run_graph<World>(Case{2 * 1024, 1024, 2000, 2, true, GemmRsConfig{128, 7, 8, 512, 8, 1}}, 5);
  std::printf("harness test: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

// sequential: producers before consumers (racecheck slows the producer past any deadline).
int sanitize_main(bool sequential) {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  run_case(Case{2 * 128, 256, 72, 2, true, GemmRsConfig{128, 0, 2, 128}}, 2, sequential, true);
  run_case(Case{128, 2 * 256, 72, 2, true, GemmRsConfig{256, 0, 2, 128}, true}, 2, sequential, true);
  // Split tail (B 16, G 5, R 1, T 20); 4 consumer steps per CTA reuse the waiter's handoff words.
  run_case(Case{2 * 256, 512, 1280, 2, true, GemmRsConfig{128, 5, 2, 128, 8, 1}}, 2, sequential, true);
  std::printf("harness sanitize: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

// ---- benchmarks -----------------------------------------------------------------------------

// Median per-launch ms of each launcher, timed in interleaved rounds (one batch of `per_round`
// launches of each in turn, round r starting with launcher r mod n): back-to-back GEMMs run an
// H200 at its power cap, where a kernel's time depends on what ran just before it, so every variant
// gets the same history and no variant always follows the same one (docs/performance.md, "Reading
// the numbers").
std::vector<float> interleaved_median_ms(std::vector<std::function<void()>> const& launches, cudaStream_t stream,
                                         int warmup = 10, int rounds = 20, int per_round = 5) {
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

// Median ms of `iters` single launches, each timed on its own, after `warmup` launches.
float median_ms(std::function<void()> const& launch, cudaStream_t stream, int warmup = 20, int iters = 100) {
  return interleaved_median_ms({launch}, stream, warmup, iters, 1)[0];
}

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
  // cublasLtMatmulDescAttributes_t and cublasOperation_t values (cublasLt.h).
  static constexpr int kDescTransA = 3, kDescAScale = 17, kDescBScale = 18, kOpT = 1;
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

  // The scales of an FP8 GEMM (device scalars): y = x_scale * w_scale * (x @ w_t^T).
  struct Fp8Scales {
    float const* x;
    float const* w;
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
      CHECK_CUDA(cudaMemcpy(scales, fp8->w, sizeof(float), cudaMemcpyDeviceToDevice));
      CHECK_CUDA(cudaMemcpy(scales + 64, fp8->x, sizeof(float), cudaMemcpyDeviceToDevice));
      float const* a_scale = scales;
      float const* b_scale = scales + 64;
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
    check(heuristic(handle, desc, a, b, d, d, pref, 16, results, &count), "cublasLtMatmulAlgoGetHeuristic");
    check(pref_destroy(pref));
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
                  fp8 ? "FP8" : "bf16", m, n, k, count, last_status);
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

// The design suite of the benchmarks (entwine_jax/timing.py DESIGN_SUITE; M, N, K of one rank's GEMM;
// W = 2 partitions).
constexpr std::array<int, 3> kDesignSuite[] = {{4096, 8192, 1024},  {8192, 8192, 1024},  {16384, 8192, 1024},
                                               {8192, 8192, 3584},  {16384, 8192, 3584}, {8192, 16384, 2048},
                                               {16384, 16384, 2048}, {16384, 16384, 6656}};

double host_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// NVML, loaded at run time: the board's energy counter (mJ) and the SM clock, for the energy mode.
struct Nvml {
  using Init = int (*)();
  using ByPci = int (*)(char const*, void**);
  using Energy = int (*)(void*, unsigned long long*);
  using Clock = int (*)(void*, int, unsigned*);
  void* device = nullptr;
  Energy energy = nullptr;
  Clock clock = nullptr;

  static Nvml const* load() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return nullptr;
    static Nvml nv;
    auto init = reinterpret_cast<Init>(dlsym(lib, "nvmlInit_v2"));
    auto by_pci = reinterpret_cast<ByPci>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    nv.energy = reinterpret_cast<Energy>(dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    nv.clock = reinterpret_cast<Clock>(dlsym(lib, "nvmlDeviceGetClockInfo"));
    char bus[32];
    CHECK_CUDA(cudaDeviceGetPCIBusId(bus, sizeof bus, 0));
    if (!init || !by_pci || !nv.energy || !nv.clock || init() != 0 || by_pci(bus, &nv.device) != 0) return nullptr;
    return &nv;
  }
  unsigned long long millijoules() const {
    unsigned long long mj = 0;
    energy(device, &mj);
    return mj;
  }
  unsigned sm_mhz() const {
    unsigned mhz = 0;
    clock(device, 1 /* NVML_CLOCK_SM */, &mhz);
    return mhz;
  }
  // The first counter update after now: (host seconds, mJ) at an update boundary, so that a window
  // between two boundaries does not depend on how often the counter updates.
  std::pair<double, unsigned long long> next_update() const {
    unsigned long long const start = millijoules();
    unsigned long long now = start;
    while (now == start) now = millijoules();
    return {host_seconds(), now};
  }
};

// One launcher alone, back to back for `seconds` after a 0.3 s ramp (the power cap's steady state),
// measured over the window after the ramp: ms per launch (GPU time between two events that the
// feeder records at batch boundaries), the mean board power (energy counter between two updates)
// and the mean SM clock.
struct SteadyState {
  double ms, watts, mhz;
};
SteadyState steady_state(Nvml const& nv, std::function<void()> const& launch, float est_ms, cudaStream_t stream,
                         double seconds) {
  // A feeder thread keeps at most two batches of ~20 ms in flight, so the GPU never idles and the
  // queue drains quickly when the window ends. Asked to, it records a timing event after its next
  // batch: marks 0 and 1 bound the window's launches.
  int const batch = std::max(1, int(20.0f / est_ms));
  std::atomic<bool> stop{false};
  std::atomic<int> marks_wanted{0}, marks_done{0};
  long mark_launches[2] = {0, 0};
  cudaEvent_t mark[2], in_flight[2];
  for (auto& e : mark) CHECK_CUDA(cudaEventCreate(&e));
  for (auto& e : in_flight) CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  std::thread feeder([&] {
    // This thread's first CUDA call makes the device's primary context current here; the producer's
    // launch encodes TMA descriptors through the driver API, which needs it.
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaFree(nullptr));
    long launched = 0;
    for (long i = 0; !stop.load(); ++i) {
      if (i >= 2) CHECK_CUDA(cudaEventSynchronize(in_flight[i % 2]));
      for (int j = 0; j < batch; ++j) launch();
      CHECK_CUDA(cudaEventRecord(in_flight[i % 2], stream));
      launched += batch;
      int const m = marks_done.load();
      if (m < marks_wanted.load()) {
        CHECK_CUDA(cudaEventRecord(mark[m], stream));
        mark_launches[m] = launched;
        marks_done = m + 1;
      }
    }
  });
  auto wait_for_mark = [&](int m) {
    marks_wanted = m + 1;
    while (marks_done.load() <= m) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  wait_for_mark(0);
  auto const [t0, e0] = nv.next_update();
  double mhz = 0;
  int samples = 0;
  for (double t = t0; t < t0 + seconds; t = host_seconds()) {
    mhz += nv.sm_mhz();
    ++samples;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto const [t1, e1] = nv.next_update();
  wait_for_mark(1);
  stop = true;
  feeder.join();
  CHECK_CUDA(cudaEventSynchronize(mark[1]));
  float window_ms;
  CHECK_CUDA(cudaEventElapsedTime(&window_ms, mark[0], mark[1]));
  for (auto e : {mark[0], mark[1], in_flight[0], in_flight[1]}) cudaEventDestroy(e);
  return {window_ms / double(mark_launches[1] - mark_launches[0]), double(e1 - e0) / (t1 - t0) / 1e3, mhz / samples};
}

// One producer configuration of rank 0 of `world` as a launcher (a fresh epoch per launch), in
// the world's types.
std::function<void()> producer_launcher(World& world, ProblemShape const& s, GemmRsConfig const& cfg, bool interleave,
                                        bool publish, cudaStream_t stream) {
  ProducerArgs a = world.producer_args(0);
  a.interleave = interleave;
  a.publish = publish;
  DType const input = world.c.input(), output = world.c.output();
  GemmRsPlan const plan = Case::plan_of(s, cfg, input);
  return [=]() mutable { CHECK_CUDA(gemm_rs::launch_gemm(input, output, plan, a, stream)); };
}

// Two passes over the launchers in rotated order, each launcher alone in its steady state.
std::vector<std::vector<SteadyState>> steady_passes(Nvml const& nv, std::vector<std::function<void()>> const& launches,
                                                    cudaStream_t stream, double seconds) {
  std::vector<float> const est = interleaved_median_ms(launches, stream, 3, 5, 3);
  std::vector<std::vector<SteadyState>> runs(launches.size());
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t j = 0; j < launches.size(); ++j) {
      size_t const i = (j + pass * launches.size() / 2) % launches.size();
      runs[i].push_back(steady_state(nv, launches[i], est[i], stream, seconds));
    }
  }
  return runs;
}

// Energy per GEMM under the power cap, each launcher alone in its steady state.
//   energy M N K [seconds] [names]: the shipped producer, two variants that move more or fewer bytes
//     and every cuBLASLt algorithm the heuristic offers (names: one launch of each, in order, for ncu);
//   energy suite [seconds] [shapes]: the design suite (or its first `shapes` shapes), the producer
//     without and with the interleaved order and the flags (and with raster groups of 16 rows)
//     against cuBLASLt's fastest algorithm, one line per shape.
int energy_main(bool suite, std::vector<std::array<int, 3>> const& shapes, double seconds, bool names_only) {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  Nvml const* nv = names_only ? nullptr : Nvml::load();
  if (!names_only && !nv) {
    std::fprintf(stderr, "libnvidia-ml.so.1 not found: no energy counter\n");
    return 2;
  }
  CublasLt const* cublas = CublasLt::load();
  if (!cublas) {
    std::fprintf(stderr, "libcublasLt.so.13 not found\n");
    return 2;
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  int const sms = prop.multiProcessorCount;
  struct Variant {
    char const* name;
    int block_n, raster_rows;
    bool interleave, publish;
  };
  std::vector<Variant> const variants =
      suite ? std::vector<Variant>{{"plain r8", 256, 8, false, false},
                                   {"inter r8", 256, 8, true, false},
                                   {"inter+flags r8 (shipped)", 256, 8, true, true},
                                   {"inter+flags r16", 256, 16, true, true}}
            : std::vector<Variant>{{"n256 inter+flags r8 (shipped)", 256, 8, true, true},
                                   {"n256 plain r1", 256, 1, false, false},
                                   {"n128 inter+flags r8", 128, 8, true, true}};
  if (suite) {
    std::printf("producer alone (W=2, bf16) and cuBLASLt's fastest algorithm, each alone for %.1f s after a 0.3 s ramp,\n"
                "two passes; ms per GEMM (mean of the passes), shipped's and cuBLASLt's board W and SM MHz\n", seconds);
    std::printf("%6s %6s %5s | %8s | %8s | %8s | %8s | %8s | %13s | %13s | %s\n", "M", "N", "K", "plain r8", "inter r8",
                "shipped", "r16", "cuBLASLt", "shipped W/MHz", "cuBLAS W/MHz", "cuBLASLt / shipped");
  }
  for (auto const& sh : shapes) {
    Case c{sh[0], sh[1], sh[2], 2, true, GemmRsConfig{}};
    World world(c);
    world.fill_inputs(3);
    ProblemShape s{c.m, c.n, c.k, 2, 0};
    std::vector<std::string> names;
    std::vector<std::function<void()>> launches;
    for (auto const& v : variants) {
      names.push_back(v.name);
      launches.push_back(producer_launcher(world, s, GemmRsConfig{v.block_n, sms, 16, 512, v.raster_rows}, v.interleave,
                                           v.publish, stream));
    }
    void const* x = world.ranks[0].x;
    void const* w = world.ranks[0].w;
    void* y = world.ranks[0].partial[1];
    if (suite) {
      names.push_back("cuBLASLt (fastest algo)");
      launches.push_back(cublas->gemm(c.m, c.n, c.k, x, w, y, stream));
    } else {
      std::vector<std::function<void()>> const algos = cublas->candidates(c.m, c.n, c.k, x, w, y, stream);
      for (size_t i = 0; i < algos.size(); ++i) {
        names.push_back("cuBLASLt algo " + std::to_string(i));
        launches.push_back(algos[i]);
      }
    }
    if (names_only) {
      for (size_t i = 0; i < launches.size(); ++i) {
        std::printf("launch %zu: %s\n", i, names[i].c_str());
        launches[i]();
        CHECK_CUDA(cudaStreamSynchronize(stream));
      }
      continue;
    }
    std::vector<std::vector<SteadyState>> const runs = steady_passes(*nv, launches, stream, seconds);
    if (suite) {
      auto mean = [&](size_t i, double SteadyState::*field) { return (runs[i][0].*field + runs[i][1].*field) / 2; };
      size_t const shipped = 2, lt = launches.size() - 1;  // the variants' third; cuBLASLt last
      std::printf("%6d %6d %5d", c.m, c.n, c.k);
      for (size_t i = 0; i < launches.size(); ++i) std::printf(" | %8.4f", mean(i, &SteadyState::ms));
      std::printf(" | %6.0f %6.0f | %6.0f %6.0f | %.3f\n", mean(shipped, &SteadyState::watts), mean(shipped, &SteadyState::mhz),
                  mean(lt, &SteadyState::watts), mean(lt, &SteadyState::mhz),
                  mean(lt, &SteadyState::ms) / mean(shipped, &SteadyState::ms));
    } else {
      double const gflop = 2.0 * c.m * c.n * c.k / 1e9;
      std::printf("%dx%dx%d bf16, each launcher alone for %.1f s after a 0.3 s ramp, two passes (rotated):\n", c.m, c.n,
                  c.k, seconds);
      std::printf("%-32s %9s %8s %8s %9s %9s\n", "launcher", "ms", "TFLOP/s", "W", "SM MHz", "mJ/GEMM");
      for (size_t i = 0; i < launches.size(); ++i) {
        for (auto const& r : runs[i]) {
          std::printf("%-32s %9.4f %8.0f %8.1f %9.0f %9.2f\n", names[i].c_str(), r.ms, gflop / r.ms, r.watts, r.mhz,
                      r.watts * r.ms);
        }
      }
    }
  }
  return 0;
}

// A few producer launches of one shape, for ncu: producer M N K block_n producer_sms raster_rows
// [plain] (plain: row-major partitions without flags, else interleaved with flags).
int producer_main(int argc, char** argv) {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  int const m = std::atoi(argv[2]), n = std::atoi(argv[3]), k = std::atoi(argv[4]);
  GemmRsConfig cfg{std::atoi(argv[5]), std::atoi(argv[6]), 16, 512, std::atoi(argv[7])};
  Case c{m, n, k, 2, true, cfg};
  World world(c);
  world.fill_inputs(3);
  ProblemShape s{m, n, k, 2, 0};
  bool const interleave_and_publish = !(argc > 8 && std::string(argv[8]) == "plain");
  std::function<void()> launch = producer_launcher(world, s, cfg, interleave_and_publish, interleave_and_publish, 0);
  for (int i = 0; i < 3; ++i) launch();
  CHECK_CUDA(cudaDeviceSynchronize());
  return 0;
}

// Producer and consumer of one rank (W = 1) run together as the FFI handler runs them (forked from
// a main stream, consumer first on the high-priority stream, joined back): the on-GPU interaction
// of the two kernels without NVLink. Prints end-to-end ms per (x, producer_sms) next to the
// producer alone.
void bench_fused_one_rank(FILE* out, int sms) {
  std::printf("\nfused, one rank (W=1, bf16, r8): end-to-end ms per block width, consumer grid x and producer grid\n");
  for (auto const& sh : {std::array<int, 3>{8192, 8192, 1024}, std::array<int, 3>{8192, 8192, 3584}}) {
    Case c{sh[0], sh[1], sh[2], 1, true, GemmRsConfig{}};
    World world(c);
    world.timeout_ns = 2'000'000'000ull;
    world.fill_inputs(11);
    ProblemShape s{c.m, c.n, c.k, 1, 0};
    auto& r = world.ranks[0];
    cudaStream_t main_stream;
    cudaEvent_t fork, producer_done, consumer_done;
    CHECK_CUDA(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
    CHECK_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventCreateWithFlags(&producer_done, cudaEventDisableTiming));
    CHECK_CUDA(cudaEventCreateWithFlags(&consumer_done, cudaEventDisableTiming));
    std::printf("%5d %5d %5d:", c.m, c.n, c.k);
    for (int block_n : {256, 128})
    for (int x : {4, 8, 16, 24}) {
      for (int producer_sms : {0, sms - x, sms}) {
        GemmRsConfig cfg{block_n, producer_sms, x, 512, 8};
        GemmRsPlan const plan = Case::plan_of(s, cfg);
        auto call = [&](bool with_consumer) {
          CHECK_CUDA(cudaEventRecord(fork, main_stream));
          CHECK_CUDA(cudaStreamWaitEvent(r.producer_stream, fork, 0));
          CHECK_CUDA(cudaStreamWaitEvent(r.consumer_stream, fork, 0));
          if (with_consumer) {
            CHECK_CUDA(launch_consumer(DType::kBF16, plan, world.consumer_args(0), r.consumer_stream, false));
          }
          CHECK_CUDA(gemm_rs::launch_gemm(DType::kBF16, DType::kBF16, plan, world.producer_args(0), r.producer_stream));
          CHECK_CUDA(cudaEventRecord(producer_done, r.producer_stream));
          CHECK_CUDA(cudaEventRecord(consumer_done, r.consumer_stream));
          CHECK_CUDA(cudaStreamWaitEvent(main_stream, producer_done, 0));
          CHECK_CUDA(cudaStreamWaitEvent(main_stream, consumer_done, 0));
          CHECK_CUDA(comm::launch_end_call(comm::CallEnd{world.epoch_word}, main_stream));
        };
        float const alone = median_ms([&] { call(false); }, main_stream, 10, 50);
        float const fused = median_ms([&] { call(true); }, main_stream, 10, 50);
        std::printf(" n%d/x%d/p%d %.3f(%.3f)", block_n, x, producer_sms, fused, alone);
        if (out) std::fprintf(out, "{\"kind\":\"fused1\",\"m\":%d,\"n\":%d,\"k\":%d,\"block_n\":%d,\"grid\":%d,\"producer_sms\":%d,\"ms\":%.5f,\"producer_ms\":%.5f}\n", c.m, c.n, c.k, block_n, x, producer_sms, fused, alone);
      }
    }
    std::printf("\n");
    DeviceError const e = world.read_error();
    if (e.code != 0) std::printf("  device error: code %u tile %d\n", e.code, e.tile);
    cudaStreamDestroy(main_stream);
  }
}

// sections: nullptr (all) or one of "fused", "producer", "consumer".
int bench_main(char const* jsonl, char const* section) {
  auto wanted = [&](char const* name) { return section == nullptr || std::string(section) == name; };
  CHECK_CUDA(gemm_rs::prepare_kernels());
  FILE* out = jsonl ? std::fopen(jsonl, "w") : nullptr;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // Copy ceiling: a large device-to-device copy, bytes read + written.
  size_t const copy_bytes = size_t(2) << 30;
  void *src, *dst;
  CHECK_CUDA(cudaMalloc(&src, copy_bytes));
  CHECK_CUDA(cudaMalloc(&dst, copy_bytes));
  CHECK_CUDA(cudaMemset(src, 1, copy_bytes));
  float const copy_ms = median_ms([&] { CHECK_CUDA(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream)); }, stream, 3, 20);
  double const copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
  cudaFree(src);
  cudaFree(dst);
  std::printf("device %s, %d SMs; copy bandwidth %.0f GB/s (read+write)\n", prop.name, prop.multiProcessorCount, copy_gbs);
  if (out) std::fprintf(out, "{\"kind\":\"copy\",\"gbs\":%.1f,\"device\":\"%s\",\"sms\":%d}\n", copy_gbs, prop.name, prop.multiProcessorCount);

  if (wanted("fused")) bench_fused_one_rank(out, prop.multiProcessorCount);

  // Producer alone on the design's suite (W = 2 partitions, the GEMM of one rank).
  if (wanted("producer")) {
    std::printf("\nproducer alone (W=2, bf16), median ms of 20 rounds of 5 launches, the variants interleaved; TFLOP/s\n");
    int const sms = prop.multiProcessorCount;
    struct Variant {
      char const* name;
      int block_n, producer_sms, raster_rows;
      bool interleave, publish, split = false;
    } const variants[] = {{"n256 pers plain r1", 256, sms, 1, false, false},
                          {"n256 pers plain r8", 256, sms, 8, false, false},
                          {"n256 pers inter r8", 256, sms, 8, true, false},
                          {"n256 pers inter+flags r8", 256, sms, 8, true, true},
                          {"n256 pers inter+flags r8 split", 256, sms, 8, true, true, true},
                          {"n256 pers inter+flags r16", 256, sms, 16, true, true},
                          {"n128 pers plain r8", 128, sms, 8, false, false},
                          {"n128 pers inter r8", 128, sms, 8, true, false},
                          {"n128 pers inter+flags r8", 128, sms, 8, true, true},
                          {"n256 1/CTA inter+flags r8", 256, 0, 8, true, true}};
    // The shipped configuration; plain r8 vs inter r8 is the order's cost, inter r8 vs shipped the flags'.
    size_t const shipped = std::find_if(std::begin(variants), std::end(variants), [](auto const& v) {
                             return std::strcmp(v.name, "n256 pers inter+flags r8") == 0;
                           }) - std::begin(variants);
    CublasLt const* cublas = CublasLt::load();
    if (!cublas) std::printf("(libcublasLt.so.13 not found: no cuBLAS column)\n");
    std::printf("%6s %6s %5s", "M", "N", "K");
    for (auto const& v : variants) std::printf(" | %-25s", v.name);
    if (cublas) std::printf(" | %-25s | %s", "cuBLASLt (fastest algo)", "cuBLAS/shipped");
    std::printf("\n");
    for (auto const& sh : kDesignSuite) {
      Case c{sh[0], sh[1], sh[2], 2, true, GemmRsConfig{}};
      World world(c);
      world.fill_inputs(3);
      ProblemShape s{c.m, c.n, c.k, 2, 0};
      double const flop = 2.0 * c.m * c.n * c.k;
      std::printf("%6d %6d %5d", c.m, c.n, c.k);
      std::vector<std::function<void()>> launches;
      for (auto const& v : variants) {
        GemmRsConfig const cfg{v.block_n, v.producer_sms, 16, 512, v.raster_rows, v.split};
        launches.push_back(producer_launcher(world, s, cfg, v.interleave, v.publish, stream));
      }
      if (cublas) {
        void const* x = world.ranks[0].x;
        void const* w = world.ranks[0].w;
        void* y = world.ranks[0].partial[1];
        launches.push_back(cublas->gemm(c.m, c.n, c.k, x, w, y, stream));
      }
      std::vector<float> const ms = interleaved_median_ms(launches, stream);
      for (size_t i = 0; i < ms.size(); ++i) {
        char const* name = i < std::size(variants) ? variants[i].name : "cublas";
        std::printf(" | %7.3f ms %4.0f TF/s      ", ms[i], flop / (ms[i] * 1e-3) / 1e12);
        if (out) std::fprintf(out, "{\"kind\":\"producer\",\"variant\":\"%s\",\"m\":%d,\"n\":%d,\"k\":%d,\"ms\":%.5f}\n", name, c.m, c.n, c.k, ms[i]);
      }
      if (cublas) std::printf(" | %.3f", ms.back() / ms[shipped]);
      std::printf("\n");
    }
  }

  // Consumer alone with every flag already released: bandwidth vs grid x and block b.
  if (wanted("consumer")) {
    std::printf("\nconsumer alone, inputs ready (bf16, M/W x N = 8192 x 8192 reduced rows), GB/s (read+write)\n");
    for (int world_size : {2, 4, 8}) {
      Case c{8192 * world_size, 8192, 8, world_size, true, GemmRsConfig{}};
      World world(c);
      ProblemShape s{c.m, c.n, c.k, world_size, 0};
      std::vector<uint64_t> ones(2 * size_t(world.flags_per_parity), 1);  // both parities released
      CHECK_CUDA(cudaMemcpy(world.ranks[0].flags, ones.data(), ones.size() * 8, cudaMemcpyHostToDevice));
      world.fill_inputs(5);
      for (int r = 0; r < world_size; ++r)
        CHECK_CUDA(cudaMemcpy(world.ranks[r].partial[0], world.ranks[r].x, size_t(c.m) * c.k * 2, cudaMemcpyDeviceToDevice));
      CHECK_CUDA(cudaDeviceSynchronize());
      double const bytes = double(world_size + 1) * (c.m / world_size) * double(c.n) * 2;
      std::printf("W=%d:", world_size);
      for (int block_n : {128, 256})
      for (int b : {128, 256, 512}) {
        for (int x : {8, 16, 32, 64, 132}) {
          GemmRsConfig cfg{block_n, 0, x, b};
          GemmRsPlan const plan = Case::plan_of(s, cfg);
          world.set_epoch(1);
          ConsumerArgs a = world.consumer_args(0);
          a.timeout_ns = 1'000'000'000ull;
          float ms = median_ms([&] { CHECK_CUDA(launch_consumer(DType::kBF16, plan, a, stream, false)); }, stream);
          double gbs = bytes / (ms * 1e-3) / 1e9;
          std::printf(" n%d/b%d/x%d %.0f", block_n, b, x, gbs);
          if (out) std::fprintf(out, "{\"kind\":\"consumer\",\"block_n\":%d,\"world\":%d,\"grid\":%d,\"block\":%d,\"ms\":%.5f,\"gbs\":%.1f,\"copy_frac\":%.3f}\n", block_n, world_size, x, b, ms, gbs, gbs / copy_gbs);
        }
      }
      std::printf("\n");
    }
  }
  if (out) std::fclose(out);
  return 0;
}

}  // namespace


// ---- ag_gemm: W virtual ranks on one GPU ------------------------------------------------------
// Every rank's shard, gathered slots (two parities), flags (two parities) and output in this GPU's
// memory; each rank pushes its shard to every peer on its own transfer streams (copy engine, then
// one release kernel per chunk, or with config.push_sms the SM push kernel on transfer stream 1, as
// the handler does) and runs its GEMM on its own stream.

struct AgCase {
  int rows, cols, n, world;
  bool bf16, gather_k;  // bf16: the output's type (and the inputs', unless fp8)
  AgGemmConfig config;
  bool fp8 = false;           // shards and w_t [N, w_rows] in e4m3, with fp8_scales
  bool shared_scale = false;  // FP8: every rank's x scale is rank 0's, and none travels
  bool x_e5m2 = false;        // FP8: the shards in e5m2 instead (the backward's gradient; w_t stays e4m3)
  DType output() const { return bf16 ? DType::kBF16 : DType::kFP16; }
  DType input() const { return !fp8 ? output() : x_e5m2 ? DType::kE5M2 : DType::kE4M3; }
  AgProblem problem(int rank) const { return AgProblem{rows, cols, n, world, rank, gather_k, input(), shared_scale}; }
  float x_scale(int rank) const { return fp8_scales(shared_scale ? 0 : rank)[0]; }
  int64_t w_rows() const { return gather_k ? int64_t(world) * cols : cols; }
  int64_t y_rows() const { return gather_k ? rows : int64_t(world) * rows; }
};

std::string describe(AgCase const& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "ag W=%d rows=%d cols=%d N=%d %s%s%s %s block_n=%d gemm_sms=%d r=%d chunks<=%d push_sms=%d", c.world,
                c.rows, c.cols, c.n, !c.fp8 ? "" : c.x_e5m2 ? "e5m2xe4m3->" : "e4m3->", c.bf16 ? "bf16" : "fp16",
                c.fp8 ? (c.shared_scale ? " shared scale" : " per-shard scales") : "",
                c.gather_k ? "contraction" : "rows", int(c.config.block_n), int(c.config.gemm_sms),
                int(c.config.raster_rows), int(c.config.max_chunks), int(c.config.push_sms));
  return buf;
}

struct AgWorld {
  struct Rank {
    uint16_t *x = nullptr, *w = nullptr, *y = nullptr;  // FP8: x and w_t bytes
    float* scales = nullptr;                            // FP8: x's and w's dequantisation scales
    char* inbox = nullptr;
    uint64_t* flags = nullptr;  // two parities of plan.flags words
    uint64_t* ready = nullptr;  // kMaxWorld words: ready[s] = the last call rank s's GEMM announced
    uint32_t* arrivals = nullptr;  // the SM push's counters (the handler's ag_gemm workspace)
    cudaStream_t gemm = nullptr;
    cudaStream_t transfer[kMaxWorld] = {};
  };
  AgCase c;
  AgPlan plan;                  // rank 0's: the sizes every rank shares
  std::vector<AgPlan> plans;    // each rank's, as its launches run them
  std::vector<Rank> ranks;
  DeviceError* error = nullptr;
  uint64_t epoch = 0;              // the last call's epoch, as the host counts it
  uint64_t* epoch_word = nullptr;  // the next call's epoch, on the device (one word for all ranks)
  uint64_t timeout_ns = 3'000'000'000ull;

  explicit AgWorld(AgCase const& c_) : c(c_), plan(ag_plan(c_.problem(0), c_.config)), ranks(c_.world) {
    for (int r = 0; r < c.world; ++r) plans.push_back(ag_plan(c.problem(r), c.config));
    int lo, hi;
    CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    for (auto& r : ranks) {
      CHECK_CUDA(cudaMalloc(&r.x, size_t(c.rows) * c.cols * 2));
      CHECK_CUDA(cudaMalloc(&r.w, size_t(c.w_rows()) * c.n * 2));
      CHECK_CUDA(cudaMalloc(&r.y, size_t(c.y_rows()) * c.n * 2));
      CHECK_CUDA(cudaMalloc(&r.inbox, plan.inbox_bytes));
      CHECK_CUDA(cudaMalloc(&r.scales, 2 * sizeof(float)));
      CHECK_CUDA(cudaMalloc(&r.flags, 2 * plan.flags * sizeof(uint64_t)));
      CHECK_CUDA(cudaMemset(r.flags, 0, 2 * plan.flags * sizeof(uint64_t)));
      CHECK_CUDA(cudaMalloc(&r.ready, kMaxWorld * sizeof(uint64_t)));
      CHECK_CUDA(cudaMemset(r.ready, 0, kMaxWorld * sizeof(uint64_t)));
      CHECK_CUDA(cudaMalloc(&r.arrivals, kPushArrivalsBytes));
      CHECK_CUDA(cudaMemset(r.arrivals, 0, kPushArrivalsBytes));
      CHECK_CUDA(cudaStreamCreateWithPriority(&r.gemm, cudaStreamNonBlocking, lo));
      for (int d = 1; d < c.world; ++d) CHECK_CUDA(cudaStreamCreateWithPriority(&r.transfer[d], cudaStreamNonBlocking, hi));
    }
    CHECK_CUDA(cudaMalloc(&error, sizeof(DeviceError)));
    CHECK_CUDA(cudaMemset(error, 0, sizeof(DeviceError)));
    CHECK_CUDA(cudaMalloc(&epoch_word, sizeof(uint64_t)));
    set_epoch(1);
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  ~AgWorld() {
    for (auto& r : ranks) {
      cudaFree(r.x);
      cudaFree(r.w);
      cudaFree(r.y);
      cudaFree(r.inbox);
      cudaFree(r.scales);
      cudaFree(r.flags);
      cudaFree(r.ready);
      cudaFree(r.arrivals);
      cudaStreamDestroy(r.gemm);
      for (int d = 1; d < c.world; ++d) cudaStreamDestroy(r.transfer[d]);
    }
    cudaFree(error);
    cudaFree(epoch_word);
  }

  void set_epoch(uint64_t next) {
    CHECK_CUDA(cudaMemcpy(epoch_word, &next, sizeof(next), cudaMemcpyHostToDevice));
    epoch = next - 1;
  }

  CallEpoch call_epoch() const { return CallEpoch{epoch_word, 0, plan.flags, false}; }

  void fill_inputs(uint64_t seed) {
    for (int r = 0; r < c.world; ++r) {
      if (c.fp8) {
        fill_random_fp8<<<264, 256>>>(reinterpret_cast<uint8_t*>(ranks[r].x), int64_t(c.rows) * c.cols, seed * 131 + 2 * r,
                                      c.x_e5m2);
        fill_random_fp8<<<264, 256>>>(reinterpret_cast<uint8_t*>(ranks[r].w), c.w_rows() * c.n, seed * 131 + 2 * r + 1);
        float const scales[2] = {c.x_scale(r), fp8_scales(r)[1]};
        CHECK_CUDA(cudaMemcpy(ranks[r].scales, scales, sizeof scales, cudaMemcpyHostToDevice));
        continue;
      }
      fill_random<<<264, 256>>>(ranks[r].x, int64_t(c.rows) * c.cols, seed * 131 + 2 * r, c.bf16);
      fill_random<<<264, 256>>>(ranks[r].w, c.w_rows() * c.n, seed * 131 + 2 * r + 1, c.bf16);
    }
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  void poison_outputs() {
    for (auto& r : ranks) CHECK_CUDA(cudaMemset(r.y, 0xFF, size_t(c.y_rows()) * c.n * 2));
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  // Rank r's SM push (plan.push_grid > 0) to every peer, on its transfer stream 1.
  void enqueue_sm_push(int r) {
    PushArgs a{};
    a.shard = ranks[r].x;
    for (int q = 0; q < c.world; ++q) {
      a.inbox[q] = ranks[q].inbox;
      a.flags[q] = ranks[q].flags;
    }
    a.ready = ranks[r].ready;
    a.arrivals = ranks[r].arrivals;
    a.scale = c.fp8 && !c.shared_scale ? ranks[r].scales : nullptr;
    a.scales_offset = plan.scales_offset;
    a.shard_bytes = plan.shard_bytes;
    a.chunks = plan.chunks;
    a.rank = r;
    a.world = c.world;
    a.error = error;
    a.call = call_epoch();
    a.timeout_ns = timeout_ns;
    CHECK_CUDA(launch_push(plans[r], a, ranks[r].transfer[1]));
  }

  // Every rank's transfers and GEMM, in the handler's order (GEMM first, then per transfer stream
  // the receiver wait and the chunks with their releases, or the SM push); skip_rank neither pushes
  // nor runs its GEMM.
  void enqueue(int skip_rank) {
    int64_t const chunk_bytes = plan.shard_bytes / plan.chunks;
    for (int r = 0; r < c.world; ++r) {
      if (r == skip_rank) continue;
      AgGemmArgs a{ranks[r].x, ranks[r].inbox, ranks[r].w, ranks[r].y, ranks[r].flags, error, nullptr, call_epoch(),
                   timeout_ns};
      for (int q = 0; q < c.world; ++q) a.call.announce[q] = q == r ? nullptr : ranks[q].ready + r;
      a.x_scale = ranks[r].scales;
      a.w_scale = ranks[r].scales + 1;
      CHECK_CUDA(ag_gemm::launch_gemm(c.input(), c.output(), plans[r], a, ranks[r].gemm));
    }
    for (int r = 0; r < c.world; ++r) {
      if (r == skip_rank) continue;
      if (plan.push_grid > 0 && c.world > 1) {
        enqueue_sm_push(r);
        continue;
      }
      for (int d = 1; d < c.world; ++d) {
        int const q = (r + d) % c.world;
        TransferArgs const receiver{ranks[r].ready + q, r, q, error, nullptr, call_epoch(), timeout_ns};
        CHECK_CUDA(launch_wait_receiver(receiver, ranks[r].transfer[d]));
        if (c.fp8 && !c.shared_scale) {
          CHECK_CUDA(cudaMemcpyAsync(ranks[q].inbox + plan.scales_offset + r * kScaleSlotBytes, ranks[r].scales,
                                     sizeof(float), cudaMemcpyDeviceToDevice, ranks[r].transfer[d]));
        }
        for (int k = 0; k < plan.chunks; ++k) {
          CHECK_CUDA(cudaMemcpyAsync(ranks[q].inbox + r * plan.shard_bytes + k * chunk_bytes,
                                     reinterpret_cast<char*>(ranks[r].x) + k * chunk_bytes, chunk_bytes,
                                     cudaMemcpyDeviceToDevice, ranks[r].transfer[d]));
          CHECK_CUDA(launch_release(ranks[q].flags + r * plan.chunks + k, call_epoch(), ranks[r].transfer[d]));
        }
      }
    }
  }

  // One ag_gemm call on every rank, then the epoch advance.
  void call(int skip_rank = -1) {
    ++epoch;
    enqueue(skip_rank);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(comm::launch_end_call(comm::CallEnd{epoch_word}, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  // The whole call as one CUDA graph (capture_call): every rank's GEMM and transfer streams.
  cudaGraphExec_t capture(cudaStream_t origin, int skip_rank = -1) {
    std::vector<cudaStream_t> streams;
    for (auto& r : ranks) {
      streams.push_back(r.gemm);
      for (int d = 1; d < c.world; ++d) streams.push_back(r.transfer[d]);
    }
    return capture_call(origin, streams, epoch_word, [&] { enqueue(skip_rank); });
  }

  std::vector<uint16_t> download(uint16_t const* ptr, size_t count) {
    std::vector<uint16_t> h(count);
    CHECK_CUDA(cudaMemcpy(h.data(), ptr, count * 2, cudaMemcpyDeviceToHost));
    return h;
  }

  // Rank r's shard (or its w [w_rows, n], w_t for FP8, as [w_rows, n]) in float64, dequantised.
  std::vector<double> shard(int r) {
    size_t const count = size_t(c.rows) * c.cols;
    std::vector<double> x(count);
    if (c.fp8) {
      std::vector<uint8_t> bytes(count);
      CHECK_CUDA(cudaMemcpy(bytes.data(), ranks[r].x, count, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < count; ++i) x[i] = c.x_scale(r) * fp8_to_double(bytes[i], c.x_e5m2);
      return x;
    }
    auto const bits = download(ranks[r].x, count);
    for (size_t i = 0; i < count; ++i) x[i] = to_double(bits[i], c.bf16);
    return x;
  }
  std::vector<double> weight(int r) {
    int64_t const k = c.w_rows();
    std::vector<double> w(size_t(k) * c.n);
    if (c.fp8) {
      std::vector<uint8_t> w_t(w.size());
      CHECK_CUDA(cudaMemcpy(w_t.data(), ranks[r].w, w_t.size(), cudaMemcpyDeviceToHost));
      double const scale = fp8_scales(r)[1];
      for (int j = 0; j < c.n; ++j) {
        for (int64_t kk = 0; kk < k; ++kk) w[size_t(kk) * c.n + j] = scale * fp8_to_double(w_t[size_t(j) * k + kk]);
      }
      return w;
    }
    auto const bits = download(ranks[r].w, w.size());
    for (size_t i = 0; i < w.size(); ++i) w[i] = to_double(bits[i], c.bf16);
    return w;
  }

  // Relative error of every rank's y against float64 over about 40 rows per rank.
  double check() {
    std::vector<std::vector<double>> xs;
    for (int r = 0; r < c.world; ++r) xs.push_back(shard(r));
    double err2 = 0, ref2 = 0;
    int64_t const rows = c.y_rows();
    int const stride = rows <= 40 ? 1 : int((rows / 40) | 1);
    std::vector<double> ref(c.n);
    for (int r = 0; r < c.world; ++r) {
      std::vector<double> const w = weight(r);
      auto y = download(ranks[r].y, size_t(rows) * c.n);
      for (int64_t i = r % stride; i < rows; i += stride) {
        std::fill(ref.begin(), ref.end(), 0.0);
        // Rows layout: row i is row i % rows of shard i / rows. Contraction: row i of every shard,
        // shard s against w's rows s * cols ...
        int const first = c.gather_k ? 0 : int(i / c.rows), last = c.gather_k ? c.world : first + 1;
        for (int s = first; s < last; ++s) {
          double const* xrow = xs[s].data() + size_t(i % c.rows) * c.cols;
          double const* wbase = w.data() + (c.gather_k ? size_t(s) * c.cols * c.n : 0);
          for (int kk = 0; kk < c.cols; ++kk) {
            double const xv = xrow[kk];
            double const* wr = wbase + size_t(kk) * c.n;
            for (int j = 0; j < c.n; ++j) ref[j] += xv * wr[j];
          }
        }
        for (int j = 0; j < c.n; ++j) {
          double const o = to_double(y[size_t(i) * c.n + j], c.bf16);
          if (std::isnan(o)) return INFINITY;
          err2 += (o - ref[j]) * (o - ref[j]);
          ref2 += ref[j] * ref[j];
        }
      }
    }
    return std::sqrt(err2 / std::max(ref2, 1e-30));
  }

  std::vector<std::vector<uint16_t>> outputs() {
    std::vector<std::vector<uint16_t>> o;
    for (auto& r : ranks) o.push_back(download(r.y, size_t(c.y_rows()) * c.n));
    return o;
  }

  DeviceError read_error() {
    DeviceError e;
    CHECK_CUDA(cudaMemcpy(&e, error, sizeof e, cudaMemcpyDeviceToHost));
    return e;
  }
};

int sm_count() {
  int device = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// W ranks' GEMMs share this GPU: each gets a grid that leaves SMs free for the others and for the
// release kernels or its SM push (on a real node each GPU runs one GEMM on all SMs the push leaves).
AgGemmConfig ag_config_for(int world, int block_n, int raster_rows = 8, int max_chunks = 8, int push_sms = 0) {
  return AgGemmConfig{block_n, std::max(1, sm_count() / world - 2 - push_sms), raster_rows, max_chunks, push_sms};
}

void run_ag_case(AgCase const& c, int epochs) {
  AgPlan const plan = ag_plan(c.problem(0), c.config);
  if (plan.error) {
    expect(false, describe(c) + ": " + plan.error);
    return;
  }
  AgWorld world(c);
  double worst = 0;
  for (int e = 0; e < epochs; ++e) {
    world.fill_inputs(2000 + e);
    world.poison_outputs();
    world.call();
    worst = std::max(worst, world.check());
  }
  auto first = world.outputs();
  world.poison_outputs();
  world.call();
  bool const bitwise = world.outputs() == first;
  DeviceError const e = world.read_error();
  double const tol = c.bf16 ? 1e-2 : 2e-3;
  char buf[160];
  std::snprintf(buf, sizeof buf, ": %d chunks, %d epochs, rel err %.2e (tol %.0e), bitwise repeat %s", plan.chunks,
                epochs, worst, tol, bitwise ? "yes" : "NO");
  expect(worst <= tol && bitwise && e.code == 0, describe(c) + buf);
}

// A rank that never pushes: every other rank's GEMM must record the deadline on one of its chunks.
void run_ag_deadline(int world_size, bool gather_k, int push_sms = 0) {
  AgCase c{256, 64, 256, world_size, true, gather_k, ag_config_for(world_size, 128, 8, 8, push_sms)};
  AgWorld world(c);
  world.fill_inputs(9);
  world.call();
  int const missing = world_size - 1;
  world.timeout_ns = 200'000'000ull;
  auto t0 = std::chrono::steady_clock::now();
  world.call(missing);
  double const secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  DeviceError const e = world.read_error();
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "ag deadline W=%d %s push_sms=%d: code=%u op=%d rank=%d source=%d chunk=%d expected=%llu after %.2f s",
                world_size, gather_k ? "contraction" : "rows", push_sms, e.code, e.site, e.rank, e.source, e.tile,
                (unsigned long long)e.expected, secs);
  // Either wait may pass its deadline first: a GEMM's for the absent rank's chunk, or a transfer
  // stream's for the absent rank's announcement of the call.
  bool const site_ok = e.site == kWaitGatherChunk || e.site == kWaitInboxReady;
  expect(e.code == kErrorDeadline && site_ok && e.source == missing && stamp_epoch(e.expected) == 2 && secs < 5, buf);
}

int ag_test_main() {
  CHECK_CUDA(ag_gemm::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  for (int world : {1, 2, 4, 8}) {
    for (bool gather_k : {false, true}) {
      for (bool bf16 : {true, false}) run_ag_case(AgCase{256, 320, 512, world, bf16, gather_k, ag_config_for(world, 256)}, 3);
    }
  }
  // Tails of K inside a shard (cols % 64 != 0), narrow blocks, one chunk per tile row, odd chunk
  // counts (6 tile rows in 3 or 6 chunks), raster groups smaller than a chunk.
  run_ag_case(AgCase{768, 200, 384, 2, true, false, ag_config_for(2, 128, 2, 3)}, 2);
  run_ag_case(AgCase{768, 200, 384, 4, false, true, ag_config_for(4, 128, 4, 6)}, 2);
  run_ag_case(AgCase{1024, 1024, 2048, 2, true, false, ag_config_for(2, 256, 8, 8)}, 2);
  run_ag_case(AgCase{1024, 512, 1024, 8, true, true, ag_config_for(8, 256, 8, 8)}, 2);
  run_ag_case(AgCase{640, 136, 256, 4, true, false, ag_config_for(4, 256, 16, 64)}, 2);
  // The SM push: every world, both layouts, a K tail, odd chunk counts, one CTA or more than a
  // chunk has vectors for (the plan caps the grid).
  for (int world : {2, 4, 8}) {
    for (bool gather_k : {false, true}) {
      run_ag_case(AgCase{256, 320, 512, world, true, gather_k, ag_config_for(world, 256, 8, 8, 4)}, 3);
    }
  }
  run_ag_case(AgCase{768, 200, 384, 2, true, false, ag_config_for(2, 128, 2, 3, 1)}, 2);
  run_ag_case(AgCase{768, 200, 384, 4, false, true, ag_config_for(4, 128, 4, 6, 8)}, 2);
  run_ag_case(AgCase{2048, 1024, 1024, 2, true, false, ag_config_for(2, 256, 8, 8, 16)}, 2);
  run_ag_deadline(2, false);
  run_ag_deadline(4, true);
  run_ag_deadline(2, false, 4);
  run_graph<AgWorld>(AgCase{768, 200, 384, 2, true, false, ag_config_for(2, 128, 2, 3)}, 6);
  run_graph<AgWorld>(AgCase{1024, 512, 1024, 4, false, true, ag_config_for(4, 256, 8, 8)}, 6);
  run_graph<AgWorld>(AgCase{1024, 512, 1024, 2, true, true, ag_config_for(2, 256, 8, 8, 4)}, 6);
  std::printf("harness ag test: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

// Small cases of both layouts and both pushes for compute-sanitizer (pushes, releases and GEMMs as
// in `ag test`; the GEMM's waits see the pushes land while it runs).
int ag_sanitize_main() {
  CHECK_CUDA(ag_gemm::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  run_ag_case(AgCase{256, 136, 256, 2, true, false, ag_config_for(2, 128, 8, 2)}, 2);
  run_ag_case(AgCase{256, 136, 512, 2, true, true, ag_config_for(2, 256, 8, 2)}, 2);
  run_ag_case(AgCase{256, 136, 256, 2, true, false, ag_config_for(2, 128, 8, 2, 3)}, 2);  // the SM push
  std::printf("harness ag sanitize: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

// The consuming GEMM alone, every chunk already released (flags hold the largest epoch), against
// cuBLASLt's fastest algorithm on the same gathered GEMM, in interleaved rounds: the cost of the
// two operands' descriptors, the arrival order and the flag checks (the pushes: `ag push`).
int ag_bench_main() {
  CHECK_CUDA(ag_gemm::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  CublasLt* lt = CublasLt::load();
  struct Shape {
    int tokens, embed, mlp;
  };
  std::printf("# ag_gemm GEMM alone (chunks released) vs cuBLASLt, one H200, W = 2, bf16; median ms of interleaved rounds\n");
  // Variants (raster rows, max chunks) of the persistent 128x256 GEMM on all SMs but one.
  std::array<std::array<int, 2>, 3> const variants{{{8, 8}, {16, 4}, {4, 8}}};
  std::printf("%-11s %6s %6s %6s %6s %9s %9s %9s %9s %7s\n", "layout", "M", "N", "K", "rows", "r8c8_ms", "r16c4_ms",
              "r4c8_ms", "cublas_ms", "best");
  for (bool gather_k : {false, true}) {
    for (Shape sh : {Shape{8192, 4096, 14336}, Shape{16384, 4096, 14336}, Shape{8192, 8192, 28672}, Shape{16384, 8192, 28672}}) {
      int const world = 2, n = sh.mlp / world;
      // Gate/up projections: rows layout x [T/W, D] -> [T, F/W]; contraction x [T, D/W] -> [T, F/W].
      AgCase c{gather_k ? sh.tokens : sh.tokens / world, gather_k ? sh.embed / world : sh.embed, n, world, true, gather_k,
               AgGemmConfig{256, sm_count() - 1, 8, 8}};
      AgWorld wd(c);
      wd.fill_inputs(5);
      CHECK_CUDA(cudaMemset(wd.ranks[0].flags, 0xFF, 2 * wd.plan.flags * sizeof(uint64_t)));
      fill_random<<<264, 256>>>(reinterpret_cast<uint16_t*>(wd.ranks[0].inbox), wd.plan.inbox_bytes / 2, 77, true);
      CHECK_CUDA(cudaDeviceSynchronize());
      auto& r0 = wd.ranks[0];
      cudaStream_t const stream = r0.gemm;
      AgGemmArgs const a{r0.x, r0.inbox, r0.w, r0.y, r0.flags, wd.error, nullptr, wd.call_epoch(), wd.timeout_ns};
      int64_t const m = c.y_rows(), k = gather_k ? int64_t(world) * c.cols : c.cols;
      std::vector<std::function<void()>> launches;
      for (auto const& v : variants) {
        AgGemmConfig const cfg{256, sm_count() - 1, v[0], v[1]};
        AgPlan const plan = ag_plan(c.problem(0), cfg);
        // The flags were set for max_chunks 8; fewer chunks index a prefix of them.
        launches.push_back([&, a, cfg, plan]() {
          CHECK_CUDA(ag_gemm::launch_gemm(DType::kBF16, DType::kBF16, plan, a, stream));
        });
      }
      uint16_t* ref_out = nullptr;
      if (lt) {
        // The gathered operand as one [M, K] matrix: the inbox (rows layout) is exactly that; for the
        // contraction layout the shards are source-major, so time the same FLOPs on [M, K] data.
        CHECK_CUDA(cudaMalloc(&ref_out, size_t(m) * n * 2));
        void* a_full = nullptr;
        CHECK_CUDA(cudaMalloc(&a_full, size_t(m) * k * 2));
        fill_random<<<264, 256>>>(static_cast<uint16_t*>(a_full), m * k, 78, true);
        void* w_full = nullptr;
        CHECK_CUDA(cudaMalloc(&w_full, size_t(k) * n * 2));
        fill_random<<<264, 256>>>(static_cast<uint16_t*>(w_full), k * n, 79, true);
        CHECK_CUDA(cudaDeviceSynchronize());
        launches.push_back(lt->gemm(int(m), n, int(k), a_full, w_full, ref_out, stream));
      }
      std::vector<float> const ms = interleaved_median_ms(launches, stream, 10, 30, 5);
      float const cublas = ms.size() > variants.size() ? ms[variants.size()] : NAN;
      std::printf("%-11s %6lld %6d %6lld %6d %9.4f %9.4f %9.4f %9.4f %7.3f\n", gather_k ? "contraction" : "rows",
                  (long long)m, n, (long long)k, c.rows, ms[0], ms[1], ms[2], cublas,
                  cublas / *std::min_element(ms.begin(), ms.begin() + variants.size()));
      if (wd.read_error().code != 0) std::printf("  device error recorded!\n");
    }
  }
  return 0;
}

// One push alone, rank 0 -> rank 1 of this GPU (HBM to HBM, not NVLink), for shards of 0.25 to 67 MB
// (1024 bf16 columns, 8 chunks): the copy engines (a copy and a release kernel per chunk, as the
// handler enqueues them) against the SM push (one kernel) of several CTA budgets, in interleaved
// rounds. Goal: 1 MB within 15 us. The largest shard where the SM push (at tuning/crossover.py's push_sms) is faster is what
// crossover.py's sm_push_max_shard_bytes should be.
int ag_push_main() {
  CHECK_CUDA(ag_gemm::prepare_kernels());
  std::array<int, 3> const budgets{8, 16, 32};
  std::printf("# push alone, rank 0 -> rank 1 on this GPU, W = 2, bf16; median ms of interleaved rounds\n");
  // Last two columns: the SM push of 16 CTAs with the shard in 1 and in 2 chunks (each chunk's
  // release is a grid-wide arrival, a fence and a flag: what fewer chunks save on small shards).
  std::printf("%9s %6s %9s %9s %9s %9s %9s %9s %5s\n", "shard_MB", "chunks", "ce_ms", "sm8_ms", "sm16_ms", "sm32_ms",
              "sm16_1ch", "sm16_2ch", "best");
  double sm_wins_up_to = 0;
  for (int rows : {128, 512, 4096, 16384, 32768}) {
    AgCase c{rows, 1024, 256, 2, true, false, AgGemmConfig{256, 1, 8, 8, 0}};
    AgWorld wd(c);
    // Rank 1 has announced every call: the SM push's wait passes at its first poll.
    CHECK_CUDA(cudaMemset(wd.ranks[0].ready, 0x7F, kMaxWorld * sizeof(uint64_t)));
    CHECK_CUDA(cudaDeviceSynchronize());
    int64_t const chunk_bytes = wd.plan.shard_bytes / wd.plan.chunks;
    cudaStream_t const s = wd.ranks[0].transfer[1];
    std::vector<std::function<void()>> launches;
    launches.push_back([&]() {
      for (int k = 0; k < wd.plan.chunks; ++k) {
        CHECK_CUDA(cudaMemcpyAsync(wd.ranks[1].inbox + k * chunk_bytes, reinterpret_cast<char*>(wd.ranks[0].x) + k * chunk_bytes,
                                   chunk_bytes, cudaMemcpyDeviceToDevice, s));
        CHECK_CUDA(launch_release(wd.ranks[1].flags + k, wd.call_epoch(), s));
      }
    });
    std::vector<AgPlan> plans;
    for (int sms : budgets) plans.push_back(ag_plan(c.problem(0), AgGemmConfig{256, 1, 8, 8, sms}));
    plans.push_back(ag_plan(c.problem(0), AgGemmConfig{256, 1, 8, 1, 16}));
    plans.push_back(ag_plan(c.problem(0), AgGemmConfig{256, 1, 8, 2, 16}));
    for (AgPlan const& plan : plans) {
      launches.push_back([&wd, plan]() {
        AgWorld::Rank const& r0 = wd.ranks[0];
        PushArgs a{};
        a.shard = r0.x;
        a.inbox[1] = wd.ranks[1].inbox;
        a.flags[1] = wd.ranks[1].flags;
        a.ready = r0.ready;
        a.arrivals = r0.arrivals;
        a.shard_bytes = plan.shard_bytes;
        a.chunks = plan.chunks;
        a.rank = 0;
        a.world = 2;
        a.error = wd.error;
        a.call = wd.call_epoch();
        a.timeout_ns = wd.timeout_ns;
        CHECK_CUDA(launch_push(plan, a, r0.transfer[1]));
      });
    }
    // One push per timed interval: its latency, enqueueing included, as a call sees it.
    std::vector<float> const ms = interleaved_median_ms(launches, s, 10, 50, 1);
    size_t const best = size_t(std::min_element(ms.begin(), ms.begin() + 4) - ms.begin());
    double const mb = wd.plan.shard_bytes / 1e6;
    std::printf("%9.2f %6d %9.4f %9.4f %9.4f %9.4f %9.4f %9.4f %5s\n", mb, wd.plan.chunks, ms[0], ms[1], ms[2], ms[3],
                ms[4], ms[5], best == 0 ? "ce" : ("sm" + std::to_string(budgets[best - 1])).c_str());
    if (ms[2] < ms[0]) sm_wins_up_to = mb;
    if (wd.read_error().code != 0) std::printf("  device error recorded!\n");
  }
  std::printf("# the SM push (16 CTAs) is faster up to %.2f MB here\n", sm_wins_up_to);
  return 0;
}

// ---- FP8 operands (both ops) -----------------------------------------------------------------

// The last kernel of a failed FP8 ag_gemm call: all three outputs (y, the gathered e4m3 shards, the
// f32 scales; odd sizes for the byte tail) filled with all bits set, NaN in each type, and the
// epoch advanced.
void run_fp8_poison() {
  size_t const bytes[comm::CallEnd::kOutputs] = {2 * 300, 4 * 128 * 208 + 5, sizeof(float) * 4};
  comm::CallEnd end;
  DeviceError failed{};
  failed.code = kErrorDeadline;
  CHECK_CUDA(cudaMalloc(&end.epoch, sizeof(uint64_t)));
  CHECK_CUDA(cudaMemset(end.epoch, 0, sizeof(uint64_t)));
  CHECK_CUDA(cudaMalloc(&end.error, sizeof(DeviceError)));
  CHECK_CUDA(cudaMemcpy(end.error, &failed, sizeof failed, cudaMemcpyHostToDevice));
  for (int o = 0; o < comm::CallEnd::kOutputs; ++o) {
    CHECK_CUDA(cudaMalloc(&end.out[o], bytes[o]));
    CHECK_CUDA(cudaMemset(end.out[o], 0, bytes[o]));
    end.bytes[o] = int64_t(bytes[o]);
  }
  CHECK_CUDA(comm::launch_end_call(end, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  uint64_t epoch = 0;
  CHECK_CUDA(cudaMemcpy(&epoch, end.epoch, sizeof epoch, cudaMemcpyDeviceToHost));
  bool all_set = true;
  for (int o = 0; o < comm::CallEnd::kOutputs; ++o) {
    std::vector<unsigned char> host(bytes[o]);
    CHECK_CUDA(cudaMemcpy(host.data(), end.out[o], bytes[o], cudaMemcpyDeviceToHost));
    for (unsigned char b : host) all_set = all_set && b == 0xFF;
    cudaFree(end.out[o]);
  }
  cudaFree(end.epoch);
  cudaFree(end.error);
  expect(all_set && epoch == 1, "fp8 aftermath: a failed call's three outputs are all-ones (NaN), the epoch advances");
}

// FP8 cases of both ops, checked against float64 of the dequantised inputs (so only the output's
// rounding and the accumulation order differ: the 16-bit tolerances apply), the plans' FP8 rules and
// the poisoning of a failed call's three outputs.
int fp8_test_main() {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  CHECK_CUDA(ag_gemm::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  GemmRsConfig const base{128, 0, 8, 512};
  for (int world : {1, 2, 4, 8}) {
    for (bool bf16 : {true, false}) run_case(Case{world * 256, 512, 384, world, bf16, base, false, true}, 3);  // 3 k-tiles
  }
  // K tail (K % 128 != 0), persistent grid, scatter over columns, a split tail (B 128, G 7, R 2,
  // T 32), a long K (the promoted accumulator: 128 k-tiles).
  run_case(Case{2 * 512, 1024, 208, 2, true, GemmRsConfig{128, 100, 8, 256}, false, true}, 3);
  run_case(Case{512, 4 * 384, 272, 4, false, GemmRsConfig{128, 0, 8, 256, 3}, true, true}, 2);
  run_case(Case{2 * 1024, 1024, 4000, 2, true, GemmRsConfig{128, 7, 8, 512, 8, 1}, false, true}, 2);
  run_case(Case{2 * 256, 512, 16384, 2, true, base, false, true}, 1);
  run_graph<World>(Case{2 * 512, 1024, 208, 2, true, GemmRsConfig{128, 0, 16, 512}, false, true}, 4);

  // ag_gemm: rows layout with each shard's own scale (gather_k only with a shared one).
  for (int world : {1, 2, 4, 8}) {
    for (bool gather_k : {false, true}) {
      for (bool bf16 : {true, false}) {
        run_ag_case(AgCase{256, 384, 512, world, bf16, gather_k, ag_config_for(world, 128), true, gather_k}, 3);
      }
    }
  }
  run_ag_case(AgCase{256, 384, 512, 4, true, false, ag_config_for(4, 128), true, true}, 2);
  run_ag_case(AgCase{768, 208, 384, 2, true, false, ag_config_for(2, 128, 2, 3), true, false}, 2);
  run_ag_case(AgCase{768, 208, 384, 4, false, true, ag_config_for(4, 128, 4, 6), true, true}, 2);
  run_ag_case(AgCase{1024, 1024, 2048, 8, true, false, ag_config_for(8, 128, 8, 8), true, false}, 2);
  run_graph<AgWorld>(AgCase{768, 208, 384, 2, true, false, ag_config_for(2, 128, 2, 3), true, false}, 4);
  // The SM push of 1-byte shards, each shard's scale in its slot (or none, shared): every world,
  // both layouts, odd chunk counts, one CTA; under a graph.
  for (int world : {2, 4, 8}) {
    for (bool gather_k : {false, true}) {
      run_ag_case(AgCase{256, 384, 512, world, true, gather_k, ag_config_for(world, 128, 8, 8, 4), true, gather_k}, 3);
    }
  }
  run_ag_case(AgCase{768, 208, 384, 2, false, false, ag_config_for(2, 128, 2, 3, 1), true, false}, 2);
  run_ag_case(AgCase{768, 208, 384, 4, true, true, ag_config_for(4, 128, 4, 6, 8), true, true}, 2);
  run_graph<AgWorld>(AgCase{768, 208, 384, 2, true, false, ag_config_for(2, 128, 2, 3, 4), true, false}, 4);

  // x in e5m2, w_t in e4m3 (the hybrid recipe's backward: an e5m2 gradient times the weight), both ops:
  // gemm_rs over rows and columns (K tail, persistent grid, split tail); ag_gemm's rows layout with
  // per-shard scales and its contraction layout with a shared one, on the copy engines and the SM push.
  for (int world : {2, 4}) {
    for (bool bf16 : {true, false}) {
      run_case(Case{world * 256, 512, 384, world, bf16, base, false, true, true}, 2);
    }
  }
  run_case(Case{512, 4 * 384, 272, 4, false, GemmRsConfig{128, 0, 8, 256, 3}, true, true, true}, 2);
  run_case(Case{2 * 1024, 1024, 4000, 2, true, GemmRsConfig{128, 7, 8, 512, 8, 1}, false, true, true}, 2);
  for (bool gather_k : {false, true}) {
    for (bool bf16 : {true, false}) {
      run_ag_case(AgCase{256, 384, 512, 4, bf16, gather_k, ag_config_for(4, 128), true, gather_k, true}, 2);
    }
  }
  run_ag_case(AgCase{768, 208, 384, 2, true, false, ag_config_for(2, 128, 2, 3, 4), true, false, true}, 2);
  run_ag_case(AgCase{768, 208, 384, 4, false, true, ag_config_for(4, 128, 4, 6, 8), true, true, true}, 2);

  // The plans' FP8 rules: K padded to 16 (not 8), 128-wide blocks only, gather_k with a shared scale.
  GemmRsPlan const padded = gemm_rs_plan(GemmRsProblem{256, 256, 200, 1, 0, false, DType::kE4M3}, base);
  expect(padded.error == nullptr && padded.shape.k == 208 && padded.schedule.k_tiles == 2,
         "fp8 gemm_rs plan: K 200 pads to 208, 2 k-tiles of 128");
  expect(gemm_rs_plan(GemmRsProblem{256, 256, 64, 1, 0, false, DType::kE4M3}, GemmRsConfig{256}).config_error,
         "fp8 gemm_rs plan: block_n 256 is a config error");
  AgPlan const ag = ag_plan(AgProblem{128, 200, 256, 2, 0, false, DType::kE4M3, false}, AgGemmConfig{128});
  expect(ag.error == nullptr && ag.cols_pad == 208 && ag.shard_bytes == 128 * 208 &&
             ag.inbox_bytes == 2 * ag.shard_bytes + 2 * kScaleSlotBytes,
         "fp8 ag plan: cols 200 pad to 208, 1-byte shards, one scale slot per source");
  expect(ag_plan(AgProblem{128, 256, 256, 2, 0, true, DType::kE4M3, false}, AgGemmConfig{128}).error != nullptr,
         "fp8 ag plan: gather_k with per-shard scales is refused");
  AgPlan const pushed = ag_plan(AgProblem{128, 208, 256, 2, 0, false, DType::kE4M3, false}, AgGemmConfig{128, 100, 8, 8, 64});
  expect(pushed.error == nullptr && pushed.push_grid == 4 && pushed.sms_needed == pushed.grid + 4,
         "fp8 ag plan: the SM push's grid counts the 16-byte vectors of a 1-byte chunk (26624 bytes: 4 CTAs)");
  GemmRsPlan const padded_e5m2 = gemm_rs_plan(GemmRsProblem{256, 256, 200, 1, 0, false, DType::kE5M2}, base);
  expect(padded_e5m2.error == nullptr && padded_e5m2.shape.k == 208 && padded_e5m2.schedule.k_tiles == 2 &&
             gemm_rs_plan(GemmRsProblem{256, 256, 64, 1, 0, false, DType::kE5M2}, GemmRsConfig{256}).config_error,
         "fp8 gemm_rs plan, x in e5m2: the e4m3 rules (K 200 pads to 208, block_n 256 is a config error)");
  AgPlan const ag_e5m2 = ag_plan(AgProblem{128, 200, 256, 2, 0, false, DType::kE5M2, false}, AgGemmConfig{128});
  expect(ag_e5m2.error == nullptr && ag_e5m2.cols_pad == 208 && ag_e5m2.inbox_bytes == ag.inbox_bytes,
         "fp8 ag plan, shards in e5m2: the e4m3 plan (1-byte shards, one scale slot per source)");
  run_fp8_poison();
  std::printf("harness fp8 test: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

// The FP8 GEMMs against cuBLASLt's FP8 GEMM (same types, scales and accumulation), in interleaved
// rounds: gemm_rs's producer on the design suite (W = 2 partitions), ag_gemm's GEMM alone (chunks
// released, per-shard scales in the rows layout) on its bench shapes; then the push of an FP8 shard
// against a bf16 one.
int fp8_bench_main() {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  CHECK_CUDA(ag_gemm::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  CublasLt const* lt = CublasLt::load();
  if (!lt) std::printf("(libcublasLt.so.13 not found: no cuBLAS column)\n");
  int const sms = sm_count();
  std::printf("# gemm_rs producer, e4m3 -> bf16, W = 2, median ms of interleaved rounds; goal cublas/shipped >= 0.95\n");
  std::printf("%6s %6s %5s %10s %10s %10s %8s %15s\n", "M", "N", "K", "plain_ms", "shipped_ms", "cublas_ms", "TF/s",
              "cublas/shipped");
  for (auto const& sh : kDesignSuite) {
    Case c{sh[0], sh[1], sh[2], 2, true, GemmRsConfig{}, false, true};
    World world(c);
    world.fill_inputs(3);
    cudaStream_t const stream = world.ranks[0].producer_stream;
    ProblemShape const s{c.m, c.n, c.k, 2, 0};
    GemmRsConfig const cfg{128, sms, 16, 512, 8};
    std::vector<std::function<void()>> launches{producer_launcher(world, s, cfg, false, false, stream),
                                                producer_launcher(world, s, cfg, true, true, stream)};
    CublasLt::Fp8Scales const scales{world.ranks[0].scales, world.ranks[0].scales + 1};
    if (lt) {
      auto run = lt->gemm(c.m, c.n, c.k, world.ranks[0].x, world.ranks[0].w, world.ranks[0].partial[1], stream, &scales);
      if (run) launches.push_back(run);
    }
    std::vector<float> const ms = interleaved_median_ms(launches, stream);
    float const cublas = ms.size() > 2 ? ms[2] : NAN;
    std::printf("%6d %6d %5d %10.4f %10.4f %10.4f %8.0f %15.3f\n", c.m, c.n, c.k, ms[0], ms[1], cublas,
                2.0 * c.m * c.n * c.k / (ms[1] * 1e-3) / 1e12, cublas / ms[1]);
  }

  std::printf("# ag_gemm GEMM alone (chunks released), e4m3 -> bf16, W = 2 (rows: per-shard scales)\n");
  std::printf("%-11s %6s %6s %6s %10s %10s %12s\n", "layout", "M", "N", "K", "ms", "cublas_ms", "cublas/ours");
  struct Shape {
    int tokens, embed, mlp;
  };
  for (bool gather_k : {false, true}) {
    for (Shape sh : {Shape{8192, 4096, 14336}, Shape{16384, 4096, 14336}, Shape{8192, 8192, 28672}}) {
      int const world = 2, n = sh.mlp / world;
      AgCase c{gather_k ? sh.tokens : sh.tokens / world, gather_k ? sh.embed / world : sh.embed, n, world, true, gather_k,
               AgGemmConfig{128, sms - 1, 8, 8}, true, gather_k};
      AgWorld wd(c);
      wd.fill_inputs(5);
      CHECK_CUDA(cudaMemset(wd.ranks[0].flags, 0xFF, 2 * wd.plan.flags * sizeof(uint64_t)));
      // The peers' shards and scales in the inbox: e4m3 bytes, scales of 1.
      fill_random_fp8<<<264, 256>>>(reinterpret_cast<uint8_t*>(wd.ranks[0].inbox), wd.plan.scales_offset, 77);
      std::vector<float> const ones(size_t(world) * kScaleSlotBytes / sizeof(float), 1.0f);
      CHECK_CUDA(cudaMemcpy(wd.ranks[0].inbox + wd.plan.scales_offset, ones.data(), ones.size() * sizeof(float),
                            cudaMemcpyHostToDevice));
      auto& r0 = wd.ranks[0];
      cudaStream_t const stream = r0.gemm;
      AgGemmArgs a{r0.x, r0.inbox, r0.w, r0.y, r0.flags, wd.error, nullptr, wd.call_epoch(), wd.timeout_ns};
      a.x_scale = r0.scales;
      a.w_scale = r0.scales + 1;
      AgPlan const plan = wd.plan;
      std::vector<std::function<void()>> launches{
          [&, a, plan]() { CHECK_CUDA(ag_gemm::launch_gemm(DType::kE4M3, DType::kBF16, plan, a, stream)); }};
      int64_t const m = c.y_rows(), k = gather_k ? int64_t(world) * c.cols : c.cols;
      uint8_t *a_full = nullptr, *w_full = nullptr;
      uint16_t* ref_out = nullptr;
      if (lt) {
        // The same FLOPs as one [M, K] x [N, K]^T FP8 GEMM.
        CHECK_CUDA(cudaMalloc(&a_full, size_t(m) * k));
        CHECK_CUDA(cudaMalloc(&w_full, size_t(k) * n));
        CHECK_CUDA(cudaMalloc(&ref_out, size_t(m) * n * 2));
        fill_random_fp8<<<264, 256>>>(a_full, m * k, 78);
        fill_random_fp8<<<264, 256>>>(w_full, k * n, 79);
        CHECK_CUDA(cudaDeviceSynchronize());
        CublasLt::Fp8Scales const scales{r0.scales, r0.scales + 1};
        auto run = lt->gemm(int(m), n, int(k), a_full, w_full, ref_out, stream, &scales);
        if (run) launches.push_back(run);
      }
      std::vector<float> const ms = interleaved_median_ms(launches, stream, 10, 30, 5);
      float const cublas = ms.size() > 1 ? ms[1] : NAN;
      std::printf("%-11s %6lld %6d %6lld %10.4f %10.4f %12.3f\n", gather_k ? "contraction" : "rows", (long long)m, n,
                  (long long)k, ms[0], cublas, cublas / ms[0]);
      if (wd.read_error().code != 0) std::printf("  device error recorded!\n");
      cudaFree(a_full);
      cudaFree(w_full);
      cudaFree(ref_out);
    }
  }

  // An FP8 shard has half a bf16 one's bytes: once the copies are bandwidth bound its push (copy
  // engine + release kernels) should take about half the time.
  std::printf("# push, rank 0 -> rank 1 on this GPU: bf16 vs e4m3 shard of rows x 4096\n");
  for (int rows : {1024, 4096, 8192}) {
    float push_ms[2];
    for (bool fp8 : {false, true}) {
      AgCase c{rows, 4096, 256, 2, true, false, AgGemmConfig{128, sms - 1, 8, 8}, fp8, false};
      AgWorld wd(c);
      int64_t const chunk_bytes = wd.plan.shard_bytes / wd.plan.chunks;
      cudaStream_t const s = wd.ranks[0].transfer[1];
      auto push = [&]() {
        if (fp8) {
          CHECK_CUDA(cudaMemcpyAsync(wd.ranks[1].inbox + wd.plan.scales_offset, wd.ranks[0].scales, sizeof(float),
                                     cudaMemcpyDeviceToDevice, s));
        }
        for (int k = 0; k < wd.plan.chunks; ++k) {
          CHECK_CUDA(cudaMemcpyAsync(wd.ranks[1].inbox + k * chunk_bytes,
                                     reinterpret_cast<char*>(wd.ranks[0].x) + k * chunk_bytes, chunk_bytes,
                                     cudaMemcpyDeviceToDevice, s));
          CHECK_CUDA(launch_release(wd.ranks[1].flags + k, wd.call_epoch(), s));
        }
      };
      push_ms[fp8] = median_ms(push, s, 5, 30);
      std::printf("shard %5d x 4096 %-4s (%6.1f MB, %d chunks): %.4f ms, %.0f GB/s\n", rows, fp8 ? "e4m3" : "bf16",
                  wd.plan.shard_bytes / 1e6, wd.plan.chunks, push_ms[fp8], wd.plan.shard_bytes / (push_ms[fp8] * 1e6));
    }
    std::printf("  e4m3/bf16 push time %.3f\n", push_ms[1] / push_ms[0]);
  }
  return 0;
}

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

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string const mode = argc > 1 ? argv[1] : "test";
  if (mode == "test") return test_main();
  if (mode == "api") return api_main();
  if (mode == "sanitize") return sanitize_main(argc > 2 && std::string(argv[2]) == "sequential");
  if (mode == "ag" && argc > 2 && std::string(argv[2]) == "test") return ag_test_main();
  if (mode == "ag" && argc > 2 && std::string(argv[2]) == "bench") return ag_bench_main();
  if (mode == "ag" && argc > 2 && std::string(argv[2]) == "push") return ag_push_main();
  if (mode == "ag" && argc > 2 && std::string(argv[2]) == "sanitize") return ag_sanitize_main();
  if (mode == "fp8" && argc > 2 && std::string(argv[2]) == "test") return fp8_test_main();
  if (mode == "fp8" && argc > 2 && std::string(argv[2]) == "bench") return fp8_bench_main();
  if (mode == "bench") return bench_main(argc > 2 && argv[2][0] ? argv[2] : nullptr, argc > 3 ? argv[3] : nullptr);
  if (mode == "producer" && (argc == 8 || argc == 9)) return producer_main(argc, argv);
  if (mode == "energy" && argc >= 3 && std::string(argv[2]) == "suite") {
    int const count = argc > 4 ? std::atoi(argv[4]) : 0;
    auto const end = count > 0 && count < int(std::size(kDesignSuite)) ? std::begin(kDesignSuite) + count
                                                                        : std::end(kDesignSuite);
    return energy_main(true, {std::begin(kDesignSuite), end}, argc > 3 ? std::atof(argv[3]) : 1.0, false);
  }
  if (mode == "energy" && argc >= 5) {
    return energy_main(false, {{std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4])}},
                       argc > 5 ? std::atof(argv[5]) : 1.0, argc > 6 && std::string(argv[6]) == "names");
  }
  std::fprintf(stderr,
               "usage: entwine_harness test | sanitize [sequential] | bench [out.jsonl] [fused|producer|consumer]\n"
               "       entwine_harness ag test | ag sanitize | ag bench | ag push | fp8 test | fp8 bench | api\n"
               "       entwine_harness producer M N K block_n producer_sms raster_rows [plain]\n"
               "       entwine_harness energy M N K [seconds] [names] | energy suite [seconds] [shapes]\n");
  return 2;
}
