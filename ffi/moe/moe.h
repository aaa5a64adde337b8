// Host-side contract of moe_dispatch_gemm with static capacity: the config, one rank's problem, its
// plan (the kernels run exactly this), the GEMM's and the transfers' arguments and launchers. No
// kernel syntax. Protocol: docs/design.md, "Mixture of experts"; this is its static
// capacity form (a fixed C rows per (source, expert), so no counts phase and no prefix sums).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "comm/config.h"
#include "comm/protocol.h"
#include "gemm/gemm.h"

namespace entwine {

// The config of moe_dispatch_gemm, fields as X(type, name, default) (comm/config.h).
#define ENTWINE_MOE_CONFIG_FIELDS(X)                                                                  \
  X(int64_t, block_n, 256)    /* GEMM block: 128 x block_n x 64, block_n in {128, 256} */              \
  X(int64_t, gemm_sms, 131)   /* persistent grid; leaves an SM for the release kernels */             \
  X(int64_t, raster_rows, 8)  /* an expert's blocks run in groups of this many tile rows (L2 reuse) */ \
  X(int64_t, push_sms, 0)     /* 0: copy engines push the segments; > 0: one SM push kernel of that many CTAs */
struct MoeConfig {
  ENTWINE_MOE_CONFIG_FIELDS(ENTWINE_CONFIG_MEMBER)
};

// One rank's problem, inside a mesh axis of `world` ranks with `experts` experts, expert g on rank
// g / E_local (E_local = experts / world). Every rank holds
//   x_send [experts, capacity, k]: the rows it sends to each global expert, `capacity` per expert
//     (the op's rows past those sent are zeros: a block partly past them is multiplied whole);
//   w [E_local, k, n]: its experts' weights (16-bit: row-major, N-major; FP8: w_t [E_local, n, k],
//     K-major, e4m3, as the FP8 wgmma reads B);
// and computes y [E_local, world * capacity, n] with
//   y[e, q * capacity + i, :] = x_send_q[rank * E_local + e, i, :] @ w[e]
// (zeros in the 128-row blocks wholly past the rows source q sent, MoeGemmArgs::received)
// (FP8 per tensor: x_send e4m3 or e5m2, each source's rows times its x_scale, w's times w_scale,
// y bf16 or fp16: a 128-row block has one source, so one alpha per block dequantises its sum)
// (the receive pool is expert-major: expert e's A is the world * capacity rows that every source
// sent it, contiguous, each source's capacity rows in source order).
struct MoeProblem {
  int32_t world = 1, rank = 0;
  int32_t experts = 1;    // E, a multiple of world
  int32_t capacity = 0;   // C, rows per (source, expert): a multiple of 128
  int32_t k = 0, n = 0;   // x's columns (w's rows), w's columns
  DType input = DType::kBF16;
};

#ifdef __CUDACC__
// Both GEMM schedules' segments: `segments` of seg_tiles tile rows, with received[owner] rows each
// (nullptr: every segment full). A segment's lead tile rows are those holding rows, and at least
// one: an empty segment's first tile row stands for it (its flag is waited for, or released, there).
// Host-callable too: tests/segment_order_check.cu checks the order on a CPU.
__host__ __device__ inline int lead_tiles(const int32_t* received, int owner, int seg_tiles) {
  if (received == nullptr) return seg_tiles;
  int const rows = received[owner];
  int const tiles = rows <= 0 ? 1 : rows / kBlockM + (rows % kBlockM != 0);
  return tiles < seg_tiles ? tiles : seg_tiles;
}

// Block c lies wholly past the rows its source sent: both schedules' empty() hook.
__host__ __device__ inline bool past_received(const int32_t* received, BlockCoord const& c) {
  return received != nullptr && c.tile_m * kBlockM >= received[c.owner];
}

// Where one role's walk over the segment groups stands (the schedules' Cursor): step = pass * groups +
// the group's index in the schedule's order (pass 0: lead blocks, pass 1: the others), first = the
// position of that group's first block of the pass.
struct SegmentCursor {
  int step = 0, first = 0;
};

// Position p -> block. The segments come in groups (Groups: count, size(g), owner(g, j): the owner
// of group g's j-th segment; the schedules group one expert's segments of several sources), and a
// group's tile rows of a pass are its segments' stacked in order, run in `order`'s raster over the
// stack: the blocks in flight at once then share the expert's weight columns across those sources,
// read from HBM once instead of once per source (a segment of few tile rows shares little by itself).
// First every group's lead tile rows, then every group's other tile rows (all empty), groups in the
// schedule's order. The persistent grid deals positions round-robin, so every CTA gets an even
// share of the blocks with rows whatever the counts; dealt group by group, the rows would fall to the
// CTAs whose index matches a group's raster. With every segment full this is the group order alone.
// The roles ask for increasing p (WorkIter), so the walk moves forward only, once over the groups
// per call and role; a smaller p starts it again. Per block, two loops over one group's segments.
template <class Groups>
__host__ __device__ BlockCoord segment_block(int p, SegmentCursor& cursor, Groups const& groups,
                                             const int32_t* received, int seg_tiles, TileOrder const& order) {
  if (p < cursor.first) cursor = SegmentCursor{};
  for (; cursor.step < 2 * groups.count; ++cursor.step) {
    bool const lead = cursor.step < groups.count;
    int const group = lead ? cursor.step : cursor.step - groups.count;
    int const size = groups.size(group);
    // A segment's rows of this pass: its lead tile rows, or the others after them.
    auto rows_of = [&](int owner, int& skip) {
      int const lead_rows = lead_tiles(received, owner, seg_tiles);
      skip = lead ? 0 : lead_rows;
      return lead ? lead_rows : seg_tiles - lead_rows;
    };
    int tiles = 0, skip = 0;
    for (int j = 0; j < size; ++j) tiles += rows_of(groups.owner(group, j), skip);
    if (p - cursor.first < tiles * order.n_blocks) {
      int tile = 0, n_block = 0;
      TileOrder{tiles, order.n_blocks, order.raster_rows}.block(p - cursor.first, tile, n_block);
      for (int j = 0;; ++j) {
        int const owner = groups.owner(group, j);
        int const rows = rows_of(owner, skip);
        if (tile < rows || j == size - 1) return BlockCoord{owner, skip + tile, n_block};
        tile -= rows;
      }
    }
    cursor.first += tiles * order.n_blocks;
  }
  return BlockCoord{groups.owner(0, 0), 0, 0};  // p past the call's blocks: never asked
}

// The two schedules' groups, one expert's segments each (owner = expert * world + source): one group
// per local expert holding the local source's segment alone, and one per local expert holding its
// W - 1 peers' segments stacked, peers in `step` order from the rank (step -1: rank - 1, rank - 2,
// ..., the order the dispatch's pushes arrive; +1: rank + 1, ...). local_first: the local groups,
// expert by expert, before the peers' (the dispatch: its local rows need no wait and cover the
// pushes' time); else after them (the combine: the rows remote ranks wait for go first). The
// local segments stay alone so that this slack is kept; the peers' stacks share the weight reads
// (W - 1 sources: none at W = 2).
struct ExpertGroups {
  int e_local, world, rank, step;
  bool local_first;
  int count;  // groups: e_local, and e_local more with peers
  __host__ __device__ ExpertGroups(int e_local_, int world_, int rank_, int step_, bool local_first_)
      : e_local(e_local_), world(world_), rank(rank_), step(step_), local_first(local_first_),
        count(world_ > 1 ? 2 * e_local_ : e_local_) {}
  __host__ __device__ bool local(int g) const { return world == 1 || (g < e_local) == local_first; }
  __host__ __device__ int size(int g) const { return local(g) ? 1 : world - 1; }
  __host__ __device__ int owner(int g, int j) const {
    int const expert = g % e_local;
    int const source = local(g) ? rank : ((rank + step * (j + 1)) % world + world) % world;
    return expert * world + source;
  }
};
#endif

// Everything static about one call. The inbox of rank r is [E_local][world][C][k] (source-slot s of
// expert e at ((e * world + s) * C) rows); flag (s, e) of rank r, word s * E_local + e of each
// parity, says source s has written its C rows of expert e for the call of the stamp. The local
// source's rows are read from x_send in place (never copied), so its flags are never written.
// A 128-row GEMM block lies inside one (source, expert) segment (C % 128 == 0): it waits for one flag.
struct MoePlan {
  const char* error;      // nullptr, or the rule the problem or config violates
  MoeConfig config;       // the config the plan was made with
  MoeProblem shape;       // the problem
  int32_t e_local;        // experts per rank
  int32_t seg_tiles;      // tile rows of one (source, expert) segment: C / 128
  int32_t n_blocks;       // n / block_n
  int32_t k_tiles;        // ceil(k / BLOCK_K) (TMA zero-fills the tail)
  int32_t num_blocks;     // e_local * world * seg_tiles * n_blocks
  int32_t grid;           // GEMM CTAs
  int64_t slice_bytes;    // one segment's rows in bytes: C * k elements
  int64_t inbox_bytes;    // e_local * world segments (the local source's slots stay unused)
  int64_t flags;          // flag words per parity: world * e_local
  int32_t push_grid;      // CTAs of the SM push (launch_push), 0: the copy engines push
  int32_t sms_needed;     // SMs the call needs at once: the GEMM's and the push's (or one for the releases)
  TileOrder order;        // the blocks of one stack of an expert's segments (ExpertGroups), in production order
  WorkSchedule schedule;  // the GEMM's blocks, grid and k-tiles (no split tail)
  Scaling scaling = Scaling::kTensor;  // picks the GEMM instantiation (per tensor only)
};
MoePlan moe_plan(const MoeProblem& problem, const MoeConfig& config);
// The plan of moe_transfer, the segments' all-to-all alone (no GEMM): the moves of the MoE ops
// whose GEMM runs before the move (the combine's return, the backward's moves). Every rank sends
// send [world][E_local][C] rows of row_bytes bytes; rank r's segment (d, e) lands in rank d's inbox
// at segment (e, r), and rank d's recv is [E_local][world][C] rows (its own segments copied from
// send). Only the transfer fields are set (shape.k = row_bytes, n = 0; no GEMM).
MoePlan moe_transfer_plan(int32_t world, int32_t rank, int32_t experts, int32_t capacity, int64_t row_bytes,
                          int64_t push_sms);

// The GEMM's arguments.
struct MoeGemmArgs {
  const void* x_send;         // this rank's x_send [experts, C, k]: its own experts' slice is read in place
  const void* inbox;          // this rank's inbox [E_local][world][C][k]: the peers push into it
  const void* w;              // [E_local, k, n] (FP8: w_t [E_local, n, k])
  void* y;                    // [E_local, world * C, n]
  const uint64_t* flags;      // this rank's flags of parity 0: flags[source * E_local + expert]
  DeviceError* error;         // device memory, claimed by the first failing wait
  DeviceError* error_mirror;  // host-mapped copy written once on failure (nullptr: none)
  CallEpoch call;
  uint64_t timeout_ns;
  const float* x_scales = nullptr;  // FP8: every source's x_scale [world] (device)
  const float* w_scale = nullptr;   // FP8: w's scale (device, one float)
  // [E_local, world] (device): the rows source s sent expert e, at e * world + s (nullptr: all C).
  // A block wholly past them is neither loaded nor multiplied; y's rows there are stored as zeros.
  const int32_t* received = nullptr;
};

// One source's transfer to one destination on the copy engines (launch_push_copy): the receiver
// wait (the destination has announced the call, so it no longer reads its inbox of the last call),
// then per local expert of the destination one copy of the segment and one release of its flag.
struct MoeTransferArgs {
  const void* x_send;        // the source's x_send [experts, C, k]
  char* inbox;               // the destination's inbox
  uint64_t* flags;           // the destination's flags of parity 0 (the release adds the parity)
  const uint64_t* ready;     // ready[destination] in the source's heap: the destination's announcement
  int32_t rank, dest;        // source and destination (dest != rank)
  DeviceError* error;
  DeviceError* error_mirror;
  CallEpoch call;
  uint64_t timeout_ns;
};

// The SM push (config.push_sms > 0): one kernel, launched before the GEMM on the GEMM's stream (the
// GEMM is its programmatic dependent: it starts once every push CTA is resident, on the SMs they
// leave), copies every segment of every peer with 16-byte stores and releases each itself. Its CTAs
// wait only for the receivers' announcements, which every rank makes before it waits for anything.
constexpr int kMoePushThreads = 512;
// Arrival counters of the SM push, one per (local expert of the destination, peer), zero between calls.
constexpr int kMoePushCounters = 1024;
constexpr size_t kMoePushArrivalsBytes = size_t(kMoePushCounters) * sizeof(uint32_t);
struct MoePushArgs {
  const void* x_send;              // this rank's x_send [experts, C, k], 16-byte aligned
  char* inbox[kMaxWorld];          // every rank's inbox (this rank's entry unused)
  uint64_t* flags[kMaxWorld];      // every rank's flags of parity 0 (the kernel adds the parity)
  const uint64_t* ready;           // ready[0 .. world) in this rank's heap: the receivers' announcements
  uint32_t* arrivals;              // kMoePushCounters counters, zero between calls (the op's workspace)
  int64_t slice_bytes;             // MoePlan::slice_bytes
  int64_t row_bytes;               // one row's bytes (k elements)
  // [experts] (device): the rows this rank sends expert d * E_local + e (nullptr: all C). A segment
  // moves them rounded up to whole 128-row blocks (segment_rows): the receiver's GEMM reads every
  // block holding a row, and the rows past those sent in it are the send buffer's zeros.
  const int32_t* sent = nullptr;
  int32_t e_local, rank, world;
  DeviceError* error;
  DeviceError* error_mirror;
  CallEpoch call;
  uint64_t timeout_ns;
};

// The rows of a segment that move, and that the pool copies: `rows` (sent or received) rounded up to
// whole 128-row blocks, at most C (nullptr counts: all C).
__host__ __device__ inline int64_t segment_rows(const int32_t* counts, int index, int32_t capacity) {
  if (counts == nullptr) return capacity;
  int64_t const rows = counts[index] <= 0 ? 0 : (int64_t(counts[index]) + kBlockM - 1) / kBlockM * kBlockM;
  return rows < capacity ? rows : capacity;
}

// The receive pool as an output [E_local, world * C, k] (launch_copy_pool, after the GEMM acquired
// every segment): segment (e, s) from this rank's x_send (s == rank) or its inbox, its received rows
// rounded up to whole blocks copied (the rows that moved) and the rest zeros, as the op's send
// buffer has them: the inbox past the rows that moved holds older calls' rows.
struct MoePoolArgs {
  const char* own_rows;     // x_send's segments of this rank's experts: [E_local][C] rows
  const char* inbox;        // this rank's inbox [E_local][world][C] rows
  char* pool;               // [E_local][world][C] rows
  const int32_t* received;  // [E_local, world] (device), as MoeGemmArgs::received (nullptr: all C)
  int64_t slice_bytes, row_bytes;  // one segment (C rows), one row
  int32_t e_local, rank, world;
};

// The waits of moe_dispatch_gemm (DeviceError::site; tile: the expert of the waited segment).
constexpr int32_t kMoeWaitSiteBase = 3 * kWaitSitesPerOp;
constexpr int32_t kMoeWaitSegment = kMoeWaitSiteBase + 0;     // the GEMM: a source's rows of an expert
constexpr int32_t kMoeWaitInboxReady = kMoeWaitSiteBase + 1;  // a transfer: the receiver has not started the call
constexpr int32_t kMoeWaitTransfer = kMoeWaitSiteBase + 2;    // moe_transfer's receiver: a source's rows of an expert
constexpr int32_t kMoeWaitCombineReady = kMoeWaitSiteBase + 3;  // the combine GEMM: a source has not started the call

// moe_transfer's receiver: one kernel on XLA's stream announces the call, then waits for every
// peer's segments (a warp per segment at a time), so that the copies of recv after it read them.
struct MoeWaitArgs {
  const uint64_t* flags;  // this rank's flags of parity 0: flags[source * E_local + expert]
  int32_t e_local, rank, world;
  DeviceError* error;
  DeviceError* error_mirror;
  CallEpoch call;
  uint64_t timeout_ns;
};

// moe_gemm_combine's GEMM (moe/combine_schedule.cuh): o[e] = h[e] @ w2[e] for this rank's experts,
// h [E_local, world * C, k] (every source's rows, source-major), w2 [E_local, k, n] (16-bit; FP8 per
// tensor: h e4m3 or e5m2, w2_t [E_local, n, k] e4m3, o = (h @ w2) * x_scale * w_scale in bf16/fp16), each
// block stored into its source's inbox, o_recv [experts, C, n], at the rows of expert rank * E_local +
// e; the segment's flag (word rank * E_local + e of the source's flags) once its last block landed.
// MoeProblem: experts, capacity C, k = F, n = H (the plan: moe_combine_plan).
struct MoeCombineArgs {
  const void* h;               // [E_local, world * C, k]
  const void* w;               // [E_local, k, n] (FP8: w2_t [E_local, n, k])
  char* inbox[kMaxWorld];      // every rank's inbox, this rank's included
  uint64_t* flags[kMaxWorld];  // every rank's flags of parity 0 (the release adds the parity)
  const uint64_t* ready;       // ready[0 .. world) in this rank's heap: the sources' announcements
  uint32_t* arrivals;          // kMoePushCounters counters, zero between calls (the op's workspace)
  DeviceError* error;
  DeviceError* error_mirror;
  CallEpoch call;
  uint64_t timeout_ns;
  const float* x_scale = nullptr;  // FP8: h's scale (device, one float)
  const float* w_scale = nullptr;  // FP8: w2's scale (device, one float)
  // [E_local, world] (device): the rows of h's segment (e, s) that its source reads back, at
  // e * world + s (nullptr: all C). A block wholly past them is neither multiplied nor sent.
  const int32_t* received = nullptr;
};
MoePlan moe_combine_plan(const MoeProblem& problem, const MoeConfig& config);

// The experts' weight gradients over the rows received (moe/wgrad_schedule.cuh): for each local expert
// e, dw[e] = a[e]^T dy[e] over the rows of its segments that hold rows, a [E_local, world * C, m] and
// dy [E_local, world * C, n] in the pool's layout. The GEMM reads a transposed, a_t [E_local, m,
// world * C] (K-major A), and dy as B [E_local, world * C, n] (N-major), 16-bit; its K loop visits,
// per source segment, the k-tiles up to its received rows (rounded up to whole k-tiles: the rows past
// them inside the last k-tile must be zero in a or dy), so it multiplies the rows routed instead of
// E/k times them. An expert with no rows gets zeros. dw [E_local, m, n] in the operands' type.
struct MoeWgradProblem {
  int32_t world = 1;
  int32_t e_local = 1;
  int32_t capacity = 0;  // C, rows per (source, expert) segment: a multiple of 128
  int32_t m = 0, n = 0;  // dw's rows (a's columns) and columns (dy's)
  DType input = DType::kBF16;
};
struct MoeWgradPlan {
  const char* error;        // nullptr, or the rule the problem or config violates
  MoeConfig config;         // block_n, gemm_sms and raster_rows are read
  MoeWgradProblem shape;
  int32_t seg_k_tiles;      // k-tiles of one segment: C / BLOCK_K
  TileOrder order;          // one expert's blocks in production order
  WorkSchedule schedule;    // every expert's blocks, expert by expert; no split tail
  Scaling scaling = Scaling::kTensor;  // picks the GEMM instantiation (16-bit only)
};
MoeWgradPlan moe_wgrad_plan(const MoeWgradProblem& problem, const MoeConfig& config);
struct MoeWgradArgs {
  const void* a_t;          // [E_local, m, world * C]
  const void* dy;           // [E_local, world * C, n]
  void* dw;                 // [E_local, m, n]
  const int32_t* received;  // [E_local, world] (device): rows of segment (e, s) at e * world + s
};

namespace comm {
struct OpHooks;
}

namespace moe {

// What moe_dispatch_gemm asks of every communicator entry (handler.cc), registered by bind.cc.
extern const comm::OpHooks kHooks;

// Enqueues on `stream` the source's whole transfer to args.dest (copy engines and two one-warp
// kernels: the receiver wait first, one release per segment). Each release must find an SM while
// the destination's GEMM runs: its persistent grid leaves one (plan.sms_needed). Transfers to the
// destinations rank + 1, rank + 2, ... on streams of their own stagger the links: every receiver
// gets its first segments from rank - 1 (the GEMM's order, gemm_schedule.cuh).
cudaError_t launch_push_copy(const MoePlan& plan, const MoeTransferArgs& args, cudaStream_t stream);
// The SM push of a plan with push_grid > 0 (world > 1): on the GEMM's stream, before the GEMM
// (enqueued with `dependent`: PreparedGemm::enqueue(stream, true)).
cudaError_t launch_push(const MoePlan& plan, const MoePushArgs& args, cudaStream_t stream);
// The pool copy (MoePoolArgs) on `stream`.
cudaError_t launch_copy_pool(const MoePoolArgs& args, cudaStream_t stream);
cudaError_t prepare_transfer_kernels();
// moe_transfer's wait for every peer's segments (MoeWaitArgs), on the receiver's stream.
cudaError_t launch_wait_segments(const MoeWaitArgs& args, cudaStream_t stream);

// The GEMM over the inbox as it arrives (moe/gemm_schedule.cuh), dispatched to the instantiation of
// (input, output, plan.config.block_n) by code generated from the kernel table.
using GemmPlan = MoePlan;
using GemmArgs = MoeGemmArgs;
cudaError_t launch_gemm(DType input, DType output, const GemmPlan& plan, const GemmArgs& args, cudaStream_t stream);
cudaError_t prepare_gemm(DType input, DType output, const GemmPlan& plan, const GemmArgs& args, PreparedGemm* out);
cudaError_t prepare_gemms();

// Loads every kernel module of the op on the current device (once per device at setup).
cudaError_t prepare_kernels();

// The combine's GEMM (moe/combine_schedule.cuh), from the kernel table's "moe.combine" rows.
namespace combine {
using GemmPlan = MoePlan;
using GemmArgs = MoeCombineArgs;
cudaError_t launch_gemm(DType input, DType output, const GemmPlan& plan, const GemmArgs& args, cudaStream_t stream);
cudaError_t prepare_gemm(DType input, DType output, const GemmPlan& plan, const GemmArgs& args, PreparedGemm* out);
cudaError_t prepare_gemms();
}  // namespace combine

// The weight gradients' GEMM (moe/wgrad_schedule.cuh), from the kernel table's "moe.wgrad" rows.
namespace wgrad {
using GemmPlan = MoeWgradPlan;
using GemmArgs = MoeWgradArgs;
cudaError_t launch_gemm(DType input, DType output, const GemmPlan& plan, const GemmArgs& args, cudaStream_t stream);
cudaError_t prepare_gemm(DType input, DType output, const GemmPlan& plan, const GemmArgs& args, PreparedGemm* out);
cudaError_t prepare_gemms();
}  // namespace wgrad

}  // namespace moe

}  // namespace entwine
