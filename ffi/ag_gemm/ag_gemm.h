// Host-side contract of the fused AllGather + GEMM (ag_gemm): the config, the problem of one rank,
// its plan (computed once per call, here, for the handler, the kernels and Python alike), the
// kernel arguments and the launchers, which run the plan they are given. No kernel syntax.
// Protocol: docs/design.md, "ag_gemm".
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "comm/config.h"
#include "comm/protocol.h"
#include "comm/transfer.h"
#include "gemm/gemm.h"

namespace entwine {

// The one config of ag_gemm, mirrored by entwine_jax.AgGemmConfig (Python). It crosses the FFI
// boundary as the dictionary attribute `config`, decoded by name into this struct; its fields are
// listed here only, as X(type, name, default) (comm/config.h).
#define ENTWINE_AG_GEMM_CONFIG_FIELDS(X)                                                                  \
  X(int64_t, block_n, 256)    /* GEMM block: 128 x block_n x 64, block_n in {128, 256} */                  \
  X(int64_t, gemm_sms, 131)   /* persistent grid; gemm_sms + max(push_sms, 1) <= SMs (see launch_push) */   \
  X(int64_t, raster_rows, 8)  /* blocks of a chunk run in groups of this many tile rows (L2 reuse) */      \
  X(int64_t, max_chunks, 8)   /* a shard travels in at most this many chunks of whole tile rows, one flag each */ \
  X(int64_t, push_sms, 0)     /* 0: copy engines push the shard; > 0: one copy kernel of that many CTAs */
struct AgGemmConfig {
  ENTWINE_AG_GEMM_CONFIG_FIELDS(ENTWINE_CONFIG_MEMBER)
};

// One rank's problem. Every rank holds a shard of `rows` x `cols` elements (row-major) and w
// [world * cols, n] (gather_k) or [cols, n]. The kernels run it padded as the plan says (rows to
// whole tile rows, cols to 16-byte rows, n to whole blocks); the Python op pads the operands so.
//   rows layout (gather_k false): A = the W shards stacked, [world * rows, cols]; y = A @ w,
//     [world * rows, n]. Block rows of shard s need only shard s.
//   contraction layout (gather_k true): A = [rows, world * cols], shard s holding columns
//     s*cols .. (s+1)*cols; y = sum_s shard_s @ w[s*cols:(s+1)*cols], [rows, n]. Every block needs
//     every shard, so its K loop runs over the local shard first, then the peers' in arrival order.
// FP8 (input kE4M3 or kE5M2): w is transposed, w_t [n, world * cols] or [n, cols], and each shard
// carries a dequantisation scale. shared_scale: every rank's x_scale is the same, so none travels;
// otherwise each shard's scale is pushed with it and scales that shard's rows (rows layout only: a
// K slice of its own scale would need the accumulator scaled per slice, which the per-tensor
// mainloop does not do).
// Block-scaled FP8 (gemm.h, Scaling): each shard carries x_scale [cols/128, rows] (one per row and
// K block, M-major), which always travels with it (shared_scale changes nothing: equal scales
// arrive equal), and w_t's scale is w_scale
// [N/128, K/128] of the whole w_t; cols % 128 == 0 (a k-tile is one K block); both layouts, since
// the mainloop scales each k-tile by its own source's scales.
struct AgProblem {
  int32_t rows = 0, cols = 0, n = 0;
  int32_t world = 1, rank = 0;
  bool gather_k = false;
  DType input = DType::kBF16;
  bool shared_scale = true;
  Scaling scaling = Scaling::kTensor;
};

// FP8 per tensor: the inbox ends with one 16-byte slot per source (a copy of 16-byte alignment),
// the first 4 bytes of which hold that source's x_scale (pushed before the shard's first chunk).
// Block-scaled: the inbox ends with the gathered operand's x scales, [cols/128, W * rows] (M-major
// over the gathered rows, source s in columns s*rows ..: the rows layout's A-scale as one array),
// each source's [cols/128, rows] pushed there (a strided copy) before its shard's first chunk.
constexpr int64_t kScaleSlotBytes = 16;

// Everything static about one call, from the problem and the config: the kernels run exactly
// this, the handler sizes the transfers with it, Python sizes the heap with it.
struct AgPlan {
  const char* error;      // nullptr, or the rule the problem or config violates
  AgGemmConfig config;    // the config the plan was made with
  AgProblem shape;        // the kernels' problem: rows, cols and n padded
  int32_t rows_pad;       // rows rounded up to 128: every shard padded on its own
  int32_t cols_pad;       // cols rounded up to 16-byte rows (TMA); w's slices padded alike
  int32_t n_pad;          // n rounded up to config.block_n
  int32_t tile_rows;      // rows_pad / 128
  int32_t chunks;         // chunks per shard (divides tile_rows, <= config.max_chunks)
  int32_t chunk_tiles;    // tile rows per chunk
  int32_t n_blocks;       // n / block_n
  int32_t k_tiles;        // k-tiles of one shard: ceil(cols / BLOCK_K) (TMA zero-fills the tail)
  int32_t num_blocks;     // GEMM blocks of the call
  int32_t grid;           // GEMM CTAs
  int64_t shard_bytes;    // one padded shard
  int64_t inbox_bytes;    // the gathered operand: world padded shards (FP8: then world scale slots)
  int64_t scales_offset;  // FP8: bytes from the inbox's start to the scale slots (world * shard_bytes)
  int32_t scale_k_blocks = 0;  // block-scaled: cols / 128, the rows of each source's x scales (else 0)
  int64_t flags;          // flag words per rank: world * chunks
  int32_t push_grid;      // CTAs of the SM push (launch_push), 0: the copy engines push
  int32_t sms_needed;     // SMs the call needs at once: the GEMM's and the push's (or the releases')
  TileOrder order;        // the blocks of one chunk, in production order
  WorkSchedule schedule;  // the GEMM's blocks, grid and k-tiles (every source's in the contraction layout)
  Scaling scaling = Scaling::kTensor;  // FP8: picks the GEMM instantiation
};
AgPlan ag_plan(const AgProblem& problem, const AgGemmConfig& config);

// The most weights of a group (AgGemmArgs): the GEMM's parameters hold two sets of TMA descriptors
// per weight (gemm/gemm.h, PreparedGemm::kParamsBytes); q/k/v and gate/up need 3 and 2.
constexpr int kMaxWeights = 4;

// The kernel's arguments. The inbox holds the W shards at s * shard_bytes (source-major); the local
// shard is read from x itself and never copied before the GEMM.
struct AgGemmArgs {
  const void* x;              // the local shard [rows, cols]
  const void* gathered;       // this rank's inbox: peers push their shards into it
  const void* w;
  void* y;
  const uint64_t* flags;      // this rank's flags of parity 0: flags[source * chunks + chunk]
  DeviceError* error;         // device memory, polled and claimed by waiting CTAs
  DeviceError* error_mirror;  // host-mapped copy written once on failure
  CallEpoch call;
  uint64_t timeout_ns;
  const float* x_scale = nullptr;  // FP8: the local shard's and w's dequantisation scales (device
  const float* w_scale = nullptr;  // scalars, or block-scaled arrays: AgProblem); a peer's x scale is
                                   // read from the inbox (AgPlan::scales_offset)
  // A group of weights side by side, each read where it lies and written to its own y (the grouped
  // call; weights 1: w and y alone). Weight g is weight_n[g] columns of N wide, a multiple of
  // config.block_n (a block belongs to one weight); weight 0 is w and y, weight g > 0 w_more[g - 1]
  // and y_more[g - 1]. The plan's N is the sum of the widths.
  int32_t weights = 1;
  int32_t weight_n[kMaxWeights] = {};
  const void* w_more[kMaxWeights - 1] = {};
  void* y_more[kMaxWeights - 1] = {};
};

// The SM push (push_sms > 0): one kernel copies the local shard into every peer's inbox with 16-byte
// stores and releases each chunk itself, so a call enqueues one launch instead of a copy and a
// release kernel per chunk and peer (whose enqueueing bounds a small push on the copy engines). It
// copies bytes: an FP8 shard (1-byte elements) is a whole number of 16-byte vectors per chunk too.
constexpr int kPushThreads = 512;
struct PushArgs {
  const void* shard;               // the local shard: shard_bytes, 16-byte aligned
  const float* scale;              // FP8 with a per-shard scale: x_scale, for each peer's scale slot; else nullptr
  int64_t scales_offset;           // AgPlan::scales_offset
  int32_t scale_k_blocks = 0;      // block-scaled: AgPlan::scale_k_blocks; scale is [scale_k_blocks, rows]
  int32_t rows = 0;                // block-scaled: the padded shard's rows
  char* inbox[kMaxWorld];          // every peer's inbox (this rank's entry unused)
  uint64_t* flags[kMaxWorld];      // every peer's flags of parity 0 (the kernel adds the parity)
  const uint64_t* ready;           // ready[0 .. world) in this rank's heap: the receivers' announcements
  uint32_t* arrivals;              // one counter per (chunk, peer), zero between calls (ag_gemm's workspace)
  int64_t shard_bytes;
  int32_t chunks, rank, world;
  DeviceError* error;
  DeviceError* error_mirror;
  CallEpoch call;
  uint64_t timeout_ns;
};
// Counters of the SM push: a chunk per flag of one source, for each peer.
constexpr size_t kPushArrivalsBytes = size_t(64) * kMaxWorld * sizeof(uint32_t);

// The waits of ag_gemm (DeviceError::site).
constexpr int32_t kAgGemmWaitSiteBase = 2 * kWaitSitesPerOp;
constexpr int32_t kWaitGatherChunk = kAgGemmWaitSiteBase + 0;  // the GEMM: a chunk of rows of a peer's shard
constexpr int32_t kWaitInboxReady = kAgGemmWaitSiteBase + 1;   // a transfer: the receiver has not started the call

// The copy engines' transfers open each stream with comm::launch_wait_receiver (site
// kWaitInboxReady) and release each chunk with comm::launch_release (comm/transfer.h); the GEMM's
// persistent grid leaves an SM for them (config.gemm_sms). The SM push of a plan with push_grid > 0:
// its CTAs, in one group per peer (or several peers per group when the grid is smaller), wait for
// their receivers' announcements, copy chunk by chunk and the last CTA of a group done with a chunk
// of a peer releases it. Its grid must find SMs beside the GEMM's (plan.sms_needed).
// prepare_transfer_kernels loads the push's module and comm's transfer kernels.
cudaError_t launch_push(const AgPlan& plan, const PushArgs& args, cudaStream_t stream);
cudaError_t prepare_transfer_kernels();

namespace comm {
struct OpHooks;
}

namespace ag_gemm {

// What ag_gemm asks of every communicator entry (handler.cc), registered by bind.cc.
extern const comm::OpHooks kHooks;

// The GEMM that consumes the gathered operand as it arrives (its TMA warp waits on each chunk's
// flag; ag_gemm/gemm_schedule.cuh), dispatched to the instantiation of (input, output,
// plan.config.block_n) by code generated from the kernel table (cmake/gemm_kernels.cmake). The
// transfers are the handler's (the copy engines, or the SM push: launch_push).
using GemmPlan = AgPlan;
using GemmArgs = AgGemmArgs;
cudaError_t launch_gemm(DType input, DType output, const GemmPlan& plan, const GemmArgs& args, cudaStream_t stream);
// The same launch prepared, to be enqueued any number of times (handlers keep it per call site).
cudaError_t prepare_gemm(DType input, DType output, const GemmPlan& plan, const GemmArgs& args, PreparedGemm* out);
cudaError_t prepare_gemms();

// Load every kernel module of ag_gemm on the current device (once per device at setup).
cudaError_t prepare_kernels();

}  // namespace ag_gemm

}  // namespace entwine
