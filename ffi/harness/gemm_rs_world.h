// gemm_rs's W virtual ranks on one GPU (every rank's partials and flags in this GPU's memory, each
// rank's producer and consumer on its own streams), with the float64 host reference that checks them.
#pragma once

#include <cmath>

#include "gemm_rs/gemm_rs.h"
#include "harness/harness.h"

namespace entwine::harness {

struct Case {
  int m, n, k, world;
  bool bf16;  // the output's type (and the inputs', unless fp8)
  GemmRsConfig config;
  bool scatter_cols = false;
  bool fp8 = false;  // x [M, K] and w_t [N, K] in e4m3, with each rank's fp8_scales
  bool x_e5m2 = false;  // FP8: x in e5m2 instead (the backward's gradient; w_t stays e4m3)
  bool block_scaled = false;  // FP8: per-block scales (block_scales) instead of fp8_scales
  ProblemShape shape(int rank) const {
    ProblemShape s{m, n, k, world, rank};
    s.scatter_cols = scatter_cols;
    return s;
  }
  DType output() const { return bf16 ? DType::kBF16 : DType::kFP16; }
  DType input() const { return !fp8 ? output() : x_e5m2 ? DType::kE5M2 : DType::kE4M3; }
  // Rank r's plan: the cases are aligned, so it plans the case's own shape (run_case checks that).
  GemmRsPlan plan(int rank) const { return plan_of(shape(rank), config, input(), scaling()); }
  Scaling scaling() const { return block_scaled ? Scaling::kBlock : Scaling::kTensor; }
  static GemmRsPlan plan_of(ProblemShape const& s, GemmRsConfig const& config, DType input = DType::kBF16,
                            Scaling scaling = Scaling::kTensor) {
    return gemm_rs_plan(GemmRsProblem{s.m, s.n, s.k, s.world, s.rank, s.scatter_cols, input, scaling}, config);
  }
};

struct VirtualRank {
  // partial[1] = partial[0] + M*N and flags holds two parities: the layout the kernels assume
  // (CallEpoch's strides).
  uint16_t *x = nullptr, *w = nullptr, *partial[2] = {nullptr, nullptr}, *out = nullptr;  // FP8: x, w_t bytes
  uint64_t* flags = nullptr;
  float* scales = nullptr;          // FP8: x's and w's dequantisation scales
  float *x_block_scales = nullptr, *w_block_scales = nullptr;  // block-scaled FP8 (BlockScales layouts)
  std::unique_ptr<BlockScales> block_scales;                   // their host copy, for the reference
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
      if (c.block_scaled) {
        BlockScales const shape_only(c.m, c.n, c.k, 0, 0);
        CHECK_CUDA(cudaMalloc(&r.x_block_scales, shape_only.x.size() * sizeof(float)));
        CHECK_CUDA(cudaMalloc(&r.w_block_scales, shape_only.w.size() * sizeof(float)));
      }
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
      cudaFree(r.x_block_scales);
      cudaFree(r.w_block_scales);
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
        if (c.block_scaled) {
          ranks[r].block_scales = std::make_unique<BlockScales>(c.m, c.n, c.k, seed, r);
          BlockScales const& b = *ranks[r].block_scales;
          CHECK_CUDA(cudaMemcpy(ranks[r].x_block_scales, b.x.data(), b.x.size() * sizeof(float), cudaMemcpyHostToDevice));
          CHECK_CUDA(cudaMemcpy(ranks[r].w_block_scales, b.w.data(), b.w.size() * sizeof(float), cudaMemcpyHostToDevice));
        }
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
    a.x_scale = c.block_scaled ? ranks[r].x_block_scales : ranks[r].scales;
    a.w_scale = c.block_scaled ? ranks[r].w_block_scales : ranks[r].scales + 1;
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

  // Every rank's w [K, N] in float64, for the host references below (FP8: w_t dequantised, by
  // block scales where the case has them).
  std::vector<std::vector<double>> weights() {
    std::vector<std::vector<double>> ws;
    for (int r = 0; r < c.world; ++r) {
      ws.emplace_back(size_t(c.k) * c.n);
      if (c.fp8) {
        std::vector<uint8_t> w_t(size_t(c.k) * c.n);
        CHECK_CUDA(cudaMemcpy(w_t.data(), ranks[r].w, w_t.size(), cudaMemcpyDeviceToHost));
        double const scale = fp8_scales(r)[1];
        BlockScales const* const blocks = ranks[r].block_scales.get();
        for (int j = 0; j < c.n; ++j) {
          for (int kk = 0; kk < c.k; ++kk) {
            double const s = c.block_scaled ? double(blocks->w_scale(j, kk)) : scale;
            ws.back()[size_t(kk) * c.n + j] = s * fp8_to_double(w_t[size_t(j) * c.k + kk]);
          }
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
      for (int kk = 0; kk < c.k; ++kk) {
        double const s = c.block_scaled ? double(ranks[r].block_scales->x_scale(i, kk)) : fp8_scales(r)[0];
        row[kk] = s * fp8_to_double(bytes[kk], c.x_e5m2);
      }
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
  // against a float64 host reference; NaN (an unwritten element) fails. Block-scaled: the worst
  // of that and of each row's 128-column segments on their own (a segment's magnitude is its
  // scales': a wrong scale in a small one would vanish in the whole's norm).
  double check() {
    ProblemShape const s = c.shape(0);
    int const rows = s.part_rows(), cols = s.part_cols();
    int const stride = rows <= 48 ? 1 : ((rows / 48) | 1);
    auto const ws = weights();
    double err2 = 0, ref2 = 0, worst_segment = 0;
    std::vector<double> row(c.n);
    for (int owner = 0; owner < c.world; ++owner) {
      auto out = download(ranks[owner].out, size_t(rows) * cols);
      int64_t const row0 = s.part_row0(owner), col0 = s.part_col0(owner);
      for (int i = owner % stride; i < rows; i += stride) {
        std::fill(row.begin(), row.end(), 0.0);
        for (int src = 0; src < c.world; ++src) add_product_row(row, x_row(src, row0 + i), ws[src]);
        if (!add_error(out.data() + size_t(i) * cols, row.data() + col0, cols, err2, ref2)) return INFINITY;
        if (c.block_scaled) worst_segment = std::max(worst_segment, segment_error(out.data() + size_t(i) * cols, row.data() + col0, cols));
      }
    }
    return std::max(worst_segment, std::sqrt(err2 / std::max(ref2, 1e-30)));
  }

  // The worst relative error of the kScaleBlock-wide segments of one row (NaN-free: add_error ran).
  double segment_error(uint16_t const* got, double const* ref, int count) const {
    double worst = 0;
    for (int j0 = 0; j0 < count; j0 += kScaleBlock) {
      double err2 = 0, ref2 = 0;
      add_error(got + j0, ref + j0, std::min(kScaleBlock, count - j0), err2, ref2);
      worst = std::max(worst, std::sqrt(err2 / std::max(ref2, 1e-30)));
    }
    return worst;
  }

  // Relative error of every rank's partial output (slot `slot`) against its own x @ w in float64,
  // over every 7th row: tells a wrong producer from a wrong consumer (block-scaled: as check()).
  double check_partials(int slot) {
    auto const ws = weights();
    double err2 = 0, ref2 = 0, worst_segment = 0;
    std::vector<double> row(c.n);
    for (int r = 0; r < c.world; ++r) {
      auto part = download(ranks[r].partial[slot], size_t(c.m) * c.n);
      for (int i = 0; i < c.m; i += 7) {
        std::fill(row.begin(), row.end(), 0.0);
        add_product_row(row, x_row(r, i), ws[r]);
        if (!add_error(part.data() + size_t(i) * c.n, row.data(), c.n, err2, ref2)) return INFINITY;
        if (c.block_scaled) worst_segment = std::max(worst_segment, segment_error(part.data() + size_t(i) * c.n, row.data(), c.n));
      }
    }
    return std::max(worst_segment, std::sqrt(err2 / std::max(ref2, 1e-30)));
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

std::string describe(Case const& c);

// Several epochs in a row with no resets: fresh inputs and poisoned outputs each epoch, checked
// against float64; then the same inputs again must give bitwise identical outputs.
void run_case(Case const& c, int epochs, bool sequential = false, bool check_partials = false);

// One producer configuration of rank 0 of `world` as a launcher (a fresh epoch per launch), in
// the world's types.
inline std::function<void()> producer_launcher(World& world, ProblemShape const& s, GemmRsConfig const& cfg, bool interleave,
                                        bool publish, cudaStream_t stream) {
  ProducerArgs a = world.producer_args(0);
  a.interleave = interleave;
  a.publish = publish;
  DType const input = world.c.input(), output = world.c.output();
  GemmRsPlan const plan = Case::plan_of(s, cfg, input);
  return [=]() mutable { CHECK_CUDA(gemm_rs::launch_gemm(input, output, plan, a, stream)); };
}

}  // namespace entwine::harness
