// ag_gemm's W virtual ranks on one GPU, with the float64 host reference that checks them.
#pragma once

#include <cmath>

#include "ag_gemm/ag_gemm.h"
#include "harness/harness.h"

namespace entwine::harness {

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
  bool block_scaled = false;  // FP8: per-block scales (BlockScales; always pushed) instead of fp8_scales
  DType output() const { return bf16 ? DType::kBF16 : DType::kFP16; }
  DType input() const { return !fp8 ? output() : x_e5m2 ? DType::kE5M2 : DType::kE4M3; }
  AgProblem problem(int rank) const {
    return AgProblem{rows, cols, n, world, rank, gather_k, input(), shared_scale,
                     block_scaled ? Scaling::kBlock : Scaling::kTensor};
  }
  float x_scale(int rank) const { return fp8_scales(shared_scale ? 0 : rank)[0]; }
  int64_t w_rows() const { return gather_k ? int64_t(world) * cols : cols; }
  int64_t y_rows() const { return gather_k ? rows : int64_t(world) * rows; }
};

struct AgWorld {
  struct Rank {
    uint16_t *x = nullptr, *w = nullptr, *y = nullptr;  // FP8: x and w_t bytes
    float* scales = nullptr;                            // FP8: x's and w's dequantisation scales
    float *x_block_scales = nullptr, *w_block_scales = nullptr;  // block-scaled FP8 (BlockScales layouts)
    std::unique_ptr<BlockScales> block_scales;                   // their host copy, for the reference
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
      if (c.block_scaled) {
        BlockScales const shape_only(c.rows, c.n, c.cols, 0, 0, c.w_rows());
        CHECK_CUDA(cudaMalloc(&r.x_block_scales, shape_only.x.size() * sizeof(float)));
        CHECK_CUDA(cudaMalloc(&r.w_block_scales, shape_only.w.size() * sizeof(float)));
      }
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
      cudaFree(r.x_block_scales);
      cudaFree(r.w_block_scales);
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
        if (c.block_scaled) {
          ranks[r].block_scales = std::make_unique<BlockScales>(c.rows, c.n, c.cols, seed, r, c.w_rows());
          BlockScales const& b = *ranks[r].block_scales;
          CHECK_CUDA(cudaMemcpy(ranks[r].x_block_scales, b.x.data(), b.x.size() * sizeof(float), cudaMemcpyHostToDevice));
          CHECK_CUDA(cudaMemcpy(ranks[r].w_block_scales, b.w.data(), b.w.size() * sizeof(float), cudaMemcpyHostToDevice));
        }
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
    a.scale = !c.fp8 ? nullptr : c.block_scaled ? ranks[r].x_block_scales : c.shared_scale ? nullptr : ranks[r].scales;
    a.scales_offset = plan.scales_offset;
    a.scale_k_blocks = plan.scale_k_blocks;
    a.rows = plan.rows_pad;
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
      a.x_scale = c.block_scaled ? ranks[r].x_block_scales : ranks[r].scales;
      a.w_scale = c.block_scaled ? ranks[r].w_block_scales : ranks[r].scales + 1;
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
        comm::ReceiverWait const receiver{ranks[r].ready + q, r, q, kWaitInboxReady, error, nullptr, call_epoch(),
                                          timeout_ns};
        CHECK_CUDA(comm::launch_wait_receiver(receiver, ranks[r].transfer[d]));
        if (c.fp8 && c.block_scaled) {
          // The shard's [k_blocks, rows] scales into columns r*rows .. of q's [k_blocks, W * rows].
          size_t const row_bytes = size_t(plan.rows_pad) * sizeof(float);
          CHECK_CUDA(cudaMemcpy2DAsync(ranks[q].inbox + plan.scales_offset + r * row_bytes, c.world * row_bytes,
                                       ranks[r].x_block_scales, row_bytes, row_bytes, size_t(plan.scale_k_blocks),
                                       cudaMemcpyDeviceToDevice, ranks[r].transfer[d]));
        } else if (c.fp8 && !c.shared_scale) {
          CHECK_CUDA(cudaMemcpyAsync(ranks[q].inbox + plan.scales_offset + r * kScaleSlotBytes, ranks[r].scales,
                                     sizeof(float), cudaMemcpyDeviceToDevice, ranks[r].transfer[d]));
        }
        for (int k = 0; k < plan.chunks; ++k) {
          CHECK_CUDA(cudaMemcpyAsync(ranks[q].inbox + r * plan.shard_bytes + k * chunk_bytes,
                                     reinterpret_cast<char*>(ranks[r].x) + k * chunk_bytes, chunk_bytes,
                                     cudaMemcpyDeviceToDevice, ranks[r].transfer[d]));
          CHECK_CUDA(comm::launch_release(ranks[q].flags + r * plan.chunks + k, call_epoch(), ranks[r].transfer[d]));
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

  // Rank r's shard (or its w [w_rows, n], w_t for FP8, as [w_rows, n]) in float64, dequantised
  // (by block scales where the case has them).
  std::vector<double> shard(int r) {
    size_t const count = size_t(c.rows) * c.cols;
    std::vector<double> x(count);
    if (c.fp8) {
      std::vector<uint8_t> bytes(count);
      CHECK_CUDA(cudaMemcpy(bytes.data(), ranks[r].x, count, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < count; ++i) {
        double const s = c.block_scaled ? double(ranks[r].block_scales->x_scale(i / c.cols, i % c.cols)) : c.x_scale(r);
        x[i] = s * fp8_to_double(bytes[i], c.x_e5m2);
      }
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
      BlockScales const* const blocks = ranks[r].block_scales.get();
      for (int j = 0; j < c.n; ++j) {
        for (int64_t kk = 0; kk < k; ++kk) {
          double const s = c.block_scaled ? double(blocks->w_scale(j, kk)) : scale;
          w[size_t(kk) * c.n + j] = s * fp8_to_double(w_t[size_t(j) * k + kk]);
        }
      }
      return w;
    }
    auto const bits = download(ranks[r].w, w.size());
    for (size_t i = 0; i < w.size(); ++i) w[i] = to_double(bits[i], c.bf16);
    return w;
  }

  // Relative error of every rank's y against float64 over about 40 rows per rank. Block-scaled: the
  // worst of that and of each row's 128-column segments on their own (as gemm_rs's World::check).
  double check() {
    std::vector<std::vector<double>> xs;
    for (int r = 0; r < c.world; ++r) xs.push_back(shard(r));
    double err2 = 0, ref2 = 0, worst_segment = 0;
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
        double seg_err2 = 0, seg_ref2 = 0;
        for (int j = 0; j < c.n; ++j) {
          double const o = to_double(y[size_t(i) * c.n + j], c.bf16);
          if (std::isnan(o)) return INFINITY;
          err2 += (o - ref[j]) * (o - ref[j]);
          ref2 += ref[j] * ref[j];
          seg_err2 += (o - ref[j]) * (o - ref[j]);
          seg_ref2 += ref[j] * ref[j];
          if (c.block_scaled && (j % kScaleBlock == kScaleBlock - 1 || j == c.n - 1)) {
            worst_segment = std::max(worst_segment, std::sqrt(seg_err2 / std::max(seg_ref2, 1e-30)));
            seg_err2 = seg_ref2 = 0;
          }
        }
      }
    }
    return std::max(worst_segment, std::sqrt(err2 / std::max(ref2, 1e-30)));
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

std::string describe(AgCase const& c);

// W ranks' GEMMs share this GPU: each gets a grid that leaves SMs free for the others and for the
// release kernels or its SM push (on a real node each GPU runs one GEMM on all SMs the push leaves).
AgGemmConfig ag_config_for(int world, int block_n, int raster_rows = 8, int max_chunks = 8, int push_sms = 0);

void run_ag_case(AgCase const& c, int epochs);

// A build of ag_gemm's GEMM (fp8_order_variants.cu): its name, its launch of a plan, and whether it
// runs the contraction layout (else the rows layout only).
struct AgVariant {
  const char* name;
  cudaError_t (*launch)(AgPlan const&, AgGemmArgs const&, cudaStream_t);
  bool contraction;
};
std::vector<AgVariant> fp8_order_variants();

}  // namespace entwine::harness
