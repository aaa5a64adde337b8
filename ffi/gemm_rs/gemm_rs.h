// Host-side contract of the fused GEMM + ReduceScatter kernels: the config, the problem of one rank
// and its plan (every shape rule of the kernels, computed once per call for the handler, the
// harness and Python alike), the argument structs and the two launchers. Shared by the XLA FFI
// handler, the one-GPU harness and the kernels; contains no kernel syntax.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/protocol.h"

namespace entwine {

// Reduction tile: the unit of release (one flag per tile and source rank) and of reduction.
constexpr int kTileM = 128;
constexpr int kTileN = 128;
// K is padded to this (zeros add nothing): 16-byte rows for TMA, with 2-byte elements.
constexpr int kAlignK = 8;
// Both dtypes (bf16, fp16) have 2-byte elements: the partial slot's size follows from it.
constexpr int kElementBytes = 2;

// The one config of the fused op, mirrored by entwine_jax.GemmRsConfig (Python).
struct GemmRsConfig {
  int32_t block_n = 128;         // producer GEMM block: 128 x block_n x 64, block_n in {128, 256}
  int32_t producer_sms = 0;      // 0: one CTA per GEMM block (shared SM pool); >0: persistent grid
  int32_t consumer_grid = 16;    // the communication budget x: consumer CTAs
  int32_t consumer_block = 512;  // consumer threads per CTA, in {128, 256, 512}
  int32_t raster_rows = 8;       // blocks of a partition run in groups of this many tile rows
  int32_t split_tail = 0;        // 1: a persistent grid splits its partial last wave in K (gemm_kernel.cuh)
};

// The config's own rules (whatever the shape): nullptr when they hold, else the violated rule.
const char* check_config(const GemmRsConfig& config);

// Production order of the GEMM blocks inside one partition, shared by producer and consumer:
// groups of `raster_rows` tile rows, each group visited column by column, so the blocks in flight
// at once share rows of x and columns of w in L2. Block i -> (tile row, block column).
struct TileOrder {
  int32_t m_blocks, n_blocks, raster_rows;
#ifdef __CUDACC__
  __host__ __device__
#endif
  void block(int32_t i, int32_t& tile_m, int32_t& n_block) const {
    int32_t const per_group = raster_rows * n_blocks;
    int32_t const group = i / per_group, j = i % per_group;
    int32_t const rows = m_blocks - group * raster_rows < raster_rows ? m_blocks - group * raster_rows : raster_rows;
    tile_m = group * raster_rows + j % rows;
    n_block = j / rows;
  }
};

// Problem of one rank. x: [M, K] row-major, w: [K, N] row-major. The M x N product is split into W
// partitions: by rows (partition q = rows q*M/W .. (q+1)*M/W, the default) or by columns
// (scatter_cols: columns q*N/W .. (q+1)*N/W). Rank q receives partition q, reduced over all ranks,
// as a row-major [part_rows, part_cols] array. Requires part_rows % 128 == 0,
// part_cols % block_n == 0, K % 8 == 0.
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

// The one block order of a call: the producer runs it and the consumer walks it, so both build it
// here (a raster group never spans more tile rows than the partition has).
inline TileOrder tile_order(const ProblemShape& s, const GemmRsConfig& c) {
  int32_t const m_blocks = s.part_rows() / kTileM;
  int32_t const n_blocks = s.part_cols() / c.block_n;
  return TileOrder{m_blocks, n_blocks, c.raster_rows < m_blocks ? c.raster_rows : m_blocks};
}

// Split tail of a persistent producer grid (gemm_kernel.cuh): the last one-and-a-fraction waves of
// blocks are divided evenly in K over the grid, and a block computed in two pieces by two CTAs
// meets in one slot of this workspace: an arrival counter, a ready sequence and an fp32 partial
// block. One workspace per producer stream (calls on one stream run one after the other), zeroed
// once at allocation; the counters are never reset (each call adds two arrivals per used slot).
constexpr int kSplitSlots = 160;  // a grid of G CTAs uses slots 0 .. G-2: grids above 161 do not split
constexpr size_t kSplitCountersBytes = 4096;  // u32 arrive[kSplitSlots], u32 ready[kSplitSlots]
constexpr size_t kSplitSlotBytes = size_t(kTileM) * 256 * sizeof(float);  // the widest block, fp32
constexpr size_t kSplitWorkspaceBytes = kSplitCountersBytes + kSplitSlots * kSplitSlotBytes;

// The producer's grid and work split for one call: computed on the host for the kernel's
// parameters, and by the harness (which checks that its split-tail cases do split).
constexpr int kProducerBlockK = 64;  // the producer GEMM block's K extent
struct ProducerSchedule {
  int32_t num_blocks;         // GEMM blocks of all W partitions
  int32_t grid;               // CTAs: num_blocks, or a persistent grid of config.producer_sms
  int32_t k_tiles;            // ceil(K / kProducerBlockK): TMA zero-fills the K tail
  int32_t split_first_block;  // blocks from here on are split in K over the grid (num_blocks: none)
};
ProducerSchedule producer_schedule(const ProblemShape& s, const GemmRsConfig& c);

// One rank's call as the op sees it, before any padding: x [m, k] (the rows before the scatter),
// w [k, n], scattered over rows (partition q: rows q*m/W ..) or columns (columns q*n/W ..).
struct GemmRsProblem {
  int64_t m = 0, n = 0, k = 0;
  int32_t world = 1, rank = 0;
  bool scatter_cols = false;
};

// Everything static about one call, from the problem and the config (docs/design.md, "gemm_rs"):
// the handler runs exactly this, Python pads the operands and sizes the communicator with it, and
// the heuristic and tune() read the blocks and the split from it.
struct GemmRsPlan {
  const char* error = nullptr;  // nullptr, or the rule the problem or the config violates
  bool config_error = false;    // the violated rule is one of the config's own (check_config)
  ProblemShape shape;           // the kernels' problem: each partition padded to whole 128 x block_n
                                // blocks, K to kAlignK (a padded problem plans to itself)
  TileOrder order{};            // the blocks of one partition, in production order
  int32_t tiles_per_partition = 0;  // reduction tiles of one partition: flag words per source rank
  ProducerSchedule schedule{};  // the producer's blocks, grid, k-tiles and split region
  bool split = false;           // the schedule splits its tail in K (given a split workspace)
  int64_t slot_bytes = 0;       // one partial slot: the whole padded M x N product of this rank
};
GemmRsPlan gemm_rs_plan(const GemmRsProblem& problem, const GemmRsConfig& config);

// Flag array of one owner rank: flags[source * tiles_per_partition + tile] holds the epoch of the
// last call whose producer on `source` published that tile of the owner's partition.
struct ProducerArgs {
  const void* x;
  const void* w;
  void* partial;                  // this rank's M x N partial output, slot 0 (the kernel adds the parity)
  uint64_t* flags[kMaxWorld];     // flag array of each owner rank, parity 0 (peer pointers)
  CallEpoch call;
  void* split_workspace = nullptr;  // kSplitWorkspaceBytes, zeroed once, one per producer stream
                                    // (nullptr: nothing splits, whatever config.split_tail says)
  // Benchmark switches of the harness's producer-alone runs; production keeps both true. They stay
  // in these args because the kernel's parameters read them from here (gemm_kernel.cuh).
  bool interleave = true;         // false: plain row-major tile order
  bool publish = true;            // false: no flags
};

struct ConsumerArgs {
  const void* partial[kMaxWorld];  // partial output of each source rank, slot 0 (the kernel adds the parity)
  const uint64_t* flags;           // this rank's flag array, parity 0
  void* out;                       // [part_rows, part_cols] row-major: this rank's reduced partition
  DeviceError* error;         // device memory: polled by every waiting CTA, claimed by the first
  DeviceError* error_mirror;  // host-mapped copy written once on failure (nullptr: none)
  CallEpoch call;
  uint64_t timeout_ns;
};

// Validate a padded shape and the config against the kernels' requirements; returns nullptr when
// they hold, else a static message naming the violated rule. gemm_rs_plan() runs it on the shape it
// pads; the harness runs it on its own (already aligned) cases.
const char* check_problem(const ProblemShape& shape, const GemmRsConfig& config);

// Launch the interleaved producer GEMM. Loads nothing lazily once prepare_kernels() has run.
cudaError_t launch_producer(DType dtype, const ProblemShape& shape, const GemmRsConfig& config,
                            const ProducerArgs& args, cudaStream_t stream);

// Launch the tile-reduction consumer (grid config.consumer_grid, block config.consumer_block).
cudaError_t launch_consumer(DType dtype, const ProblemShape& shape, const GemmRsConfig& config,
                            const ConsumerArgs& args, cudaStream_t stream);

// Load every kernel's module and set its attributes on the current device (call once per device
// at setup: lazy loading while a consumer spins can deadlock).
cudaError_t prepare_kernels();

}  // namespace entwine
