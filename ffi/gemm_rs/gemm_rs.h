// Host-side contract of the fused GEMM + ReduceScatter (gemm_rs): the config, the problem of one
// rank and its plan (every shape rule of the kernels, computed once per call for the handler, the
// harness and Python alike), the argument structs and the launchers, which run the plan they are
// given. Shared by the XLA FFI handler, the one-GPU harness and the kernels; no kernel syntax.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "comm/comm.h"
#include "comm/config.h"
#include "comm/protocol.h"
#include "gemm/gemm.h"

namespace entwine {

// Reduction tile: the unit of release (one flag per tile and source rank) and of reduction.
constexpr int kTileM = 128;
constexpr int kTileN = 128;
static_assert(kTileM == kBlockM, "a GEMM block covers whole reduction tiles");

// The one config of the fused op, mirrored by entwine_jax.GemmRsConfig (Python). It crosses the FFI
// boundary as the dictionary attribute `config`, decoded by name into this struct; its fields are
// listed here only, as X(type, name, default) (comm/config.h). Rules: check_config() (gemm_rs/plan.cc).
#define ENTWINE_GEMM_RS_CONFIG_FIELDS(X)                                                                  \
  X(int64_t, block_n, 128)        /* GEMM block: 128 x block_n x 64, block_n in {128, 256} */              \
  X(int64_t, producer_sms, 0)     /* persistent GEMM grid; 0: the SMs the consumer and the reserve leave */ \
  X(int64_t, consumer_grid, 16)   /* the communication budget x: consumer CTAs */                          \
  X(int64_t, consumer_block, 512) /* consumer threads per CTA, in {128, 256, 512} */                       \
  X(int64_t, raster_rows, 8)      /* blocks of a partition run in groups of this many tile rows */         \
  X(bool, split_tail, false)      /* a persistent grid splits its partial last wave in K (gemm_kernel.cuh) */
struct GemmRsConfig {
  ENTWINE_GEMM_RS_CONFIG_FIELDS(ENTWINE_CONFIG_MEMBER)
};

// Problem of one rank, padded. x: [M, K] row-major, w: [K, N] row-major. The M x N product is split
// into W partitions: by rows (partition q = rows q*M/W .. (q+1)*M/W, the default) or by columns
// (scatter_cols: columns q*N/W .. (q+1)*N/W). Rank q receives partition q, reduced over all ranks,
// as a row-major [part_rows, part_cols] array.
struct ProblemShape {
  int32_t m = 0, n = 0, k = 0;
  int32_t world = 1, rank = 0;
  bool scatter_cols = false;
  int32_t part_rows() const { return scatter_cols ? m : m / world; }
  int32_t part_cols() const { return scatter_cols ? n / world : n; }
  // Offset of partition q inside the M x N partial output.
  int64_t part_row0(int q) const { return scatter_cols ? 0 : int64_t(q) * part_rows(); }
  int64_t part_col0(int q) const { return scatter_cols ? int64_t(q) * part_cols() : 0; }
  int32_t tiles_per_partition() const { return (part_rows() / kTileM) * (part_cols() / kTileN); }
};

// One rank's call as the op sees it, before any padding: x [m, k] (the rows before the scatter),
// w [k, n] (FP8: w_t [n, k]), scattered over rows (partition q: rows q*m/W ..) or columns (columns
// q*n/W ..). `input` is the operands' type; the output's (bf16 or fp16) changes no shape rule.
// FP8 block scaling (gemm.h, Scaling) needs K % 128 == 0: a k-tile is one scale block.
struct GemmRsProblem {
  int64_t m = 0, n = 0, k = 0;
  int32_t world = 1, rank = 0;
  bool scatter_cols = false;
  DType input = DType::kBF16;
  Scaling scaling = Scaling::kTensor;
};

// Everything static about one call, from the problem and the config (docs/design.md, "gemm_rs"):
// the handler computes it once and the launchers run exactly this; Python pads the operands and
// sizes the communicator with it, and the heuristic and tune() read the blocks and the split from it.
struct GemmRsPlan {
  const char* error = nullptr;  // nullptr, or the rule the problem or the config violates
  bool config_error = false;    // the violated rule is one of the config's own (check_config)
  GemmRsConfig config;          // the config the plan was made with
  Scaling scaling = Scaling::kTensor;  // the problem's: picks the GEMM instantiation
  ProblemShape shape;           // the kernels' problem: each partition padded to whole 128 x block_n
                                // blocks, K to align_k(input) (a padded problem plans to itself)
  TileOrder order{};            // the blocks of one partition, in production order
  int32_t tiles_per_partition = 0;  // reduction tiles of one partition: flag words per source rank
  WorkSchedule schedule{};      // the producer's blocks, grid, k-tiles and split region
  bool split = false;           // the schedule splits its tail in K (given a split workspace)
  int64_t slot_bytes = 0;       // one partial slot: the whole padded M x N product of this rank
};
GemmRsPlan gemm_rs_plan(const GemmRsProblem& problem, const GemmRsConfig& config);

// Flag array of one owner rank: flags[source * tiles_per_partition + tile] holds the epoch of the
// last call whose producer on `source` published that tile of the owner's partition.
struct ProducerArgs {
  const void* x;
  const void* w;                  // w [K, N]; FP8: w_t [N, K]
  const float* x_scale = nullptr;  // FP8: the dequantisation scales. Per tensor: device scalars, the
  const float* w_scale = nullptr;  // output is x_scale * w_scale * (x @ w). Per block: x_scale
                                   // [K/128, M] (one per row and K block, M-major), w_scale
                                   // [N/128, K/128] (one per 128x128 block of w_t)
  void* partial;                  // this rank's M x N partial output, slot 0 (the kernel adds the parity)
  uint64_t* flags[kMaxWorld];     // flag array of each owner rank, parity 0 (peer pointers)
  CallEpoch call;
  void* split_workspace = nullptr;  // kSplitWorkspaceBytes, zeroed once, one per stream running producers
                                    // (nullptr: nothing splits, whatever the plan says)
  // Benchmark switches of the harness's producer-alone runs; production keeps both true. They stay
  // in these args because the kernel's parameters read them from here (gemm_rs/gemm_schedule.cuh).
  bool interleave = true;         // false: plain row-major tile order
  bool publish = true;            // false: no flags
  comm::CallEnd end;              // the folded end, as in ConsumerArgs: no outputs (end.done nullptr: none)
};

struct ConsumerArgs {
  const void* partial[kMaxWorld];  // partial output of each source rank, slot 0 (the kernel adds the parity)
  const uint64_t* flags;           // this rank's flag array, parity 0
  void* out;                       // [part_rows, part_cols] row-major: this rank's reduced partition
  DeviceError* error;         // device memory: polled by every waiting CTA, claimed by the first
  DeviceError* error_mirror;  // host-mapped copy written once on failure (nullptr: none)
  CallEpoch call;
  uint64_t timeout_ns;
  // With end.done set, the call's end (comm/call_end.cuh) is folded into the kernels (no end
  // kernel): the consumer's last CTA (consumers_done counts them) checks for a failure and poisons y,
  // then the last arrival of the consumer's CTAs and the producer's store warps advances the epoch.
  comm::CallEnd end;
  uint64_t* consumers_done = nullptr;
};

// The waits of gemm_rs (DeviceError::site): its consumer waits for a 128x128 tile of a peer's partial.
constexpr int32_t kGemmRsWaitSiteBase = 1 * kWaitSitesPerOp;
constexpr int32_t kWaitReduceTile = kGemmRsWaitSiteBase + 0;

// Launch the tile-reduction consumer of a plan (grid config.consumer_grid, block
// config.consumer_block); `dependent`: as the programmatic dependent of the GEMM just enqueued on
// `stream`.
cudaError_t launch_consumer(DType dtype, const GemmRsPlan& plan, const ConsumerArgs& args, cudaStream_t stream,
                            bool dependent);

namespace comm {
struct OpHooks;
}

namespace gemm_rs {

// What gemm_rs asks of every communicator entry (handler.cc), registered by bind.cc.
extern const comm::OpHooks kHooks;

// The producer GEMM (gemm_rs/gemm_schedule.cuh), dispatched to the instantiation of (input, output,
// plan.config.block_n) by code generated from the kernel table (cmake/gemm_kernels.cmake), which
// also loads every instantiation's module (prepare_gemms). `output` is the partial's type, which the
// consumer reduces (launch_consumer's dtype).
using GemmPlan = GemmRsPlan;
using GemmArgs = ProducerArgs;
cudaError_t launch_gemm(DType input, DType output, const GemmPlan& plan, const GemmArgs& args, cudaStream_t stream);
// The same launch prepared, to be enqueued any number of times (handlers keep it per call site).
cudaError_t prepare_gemm(DType input, DType output, const GemmPlan& plan, const GemmArgs& args, PreparedGemm* out);
cudaError_t prepare_gemms();

// Load every kernel module of gemm_rs and set its attributes on the current device (once per
// device at setup: lazy loading while a consumer spins can deadlock).
cudaError_t prepare_kernels();

}  // namespace gemm_rs

}  // namespace entwine
