// gemm_rs's schedule of the shared GEMM (gemm/gemm_kernel.cuh): blocks visit the W partitions of
// the output interleaved, every block's A is ready at launch, and each stored block is published by
// an epoch flag per 128x128 reduction tile, pushed into the partition owner's memory
// (docs/design.md, "Memory ordering").
#pragma once

#include "comm/call_end.cuh"
#include "comm/flag.cuh"
#include "comm/wait.cuh"
#include "gemm/gemm_kernel.cuh"
#include "gemm_rs/gemm_rs.h"

namespace entwine::gemm_rs {

struct GemmSchedule {
  using Plan = GemmPlan;
  using Args = GemmArgs;
  static constexpr bool kLocalOperand = false;  // A is x alone
  static constexpr int kMaxGroup = 1;           // B is w alone
  static constexpr bool kStoresToPeers = false;  // the kernel's output is this rank's

  struct Cursor {};  // block_coord keeps no state between units

  struct Params {
    uint64_t* flags[kMaxWorld];  // parity 0 of each owner's flag array
    int blocks_per_partition;
    int tiles_n;                 // part_cols / 128: reduction tiles per row of a partition
    int tiles_per_partition;
    int world, rank;
    bool interleave, publish;    // harness switches (ProducerArgs)
    const float* x_scale;        // FP8 per tensor: one dequantisation scale per operand (ProducerArgs;
    const float* w_scale;        // per block, the mainloop's parameters hold them)
    comm::CallEnd end;           // the folded end (ProducerArgs; end.done nullptr: none)
  };

  // Logical block p -> (owner partition, tile row inside it, block column). Interleaved: block p
  // goes to partition (p + rank + 1) mod W, so every wave feeds all W owners at an even pace and
  // the ranks start on different owners; inside a partition, blocks run in the consumer's N-major
  // TileOrder (grouped rows for L2 reuse), which the consumer walks in the same order.
  static __device__ BlockCoord block_coord(int p, Params const& op, TileOrder const& order, Cursor&) {
    int owner, i;
    if (op.interleave) {
      owner = (p % op.world + op.rank + 1) % op.world;
      i = p / op.world;
    } else {
      owner = p / op.blocks_per_partition;
      i = p % op.blocks_per_partition;
    }
    BlockCoord c{owner, 0, 0};
    order.block(i, c.tile_m, c.n_block);
    return c;
  }

  // Announce the call to every peer (ready words, CallEpoch): a peer waiting for one of this
  // call's tiles can then tell this rank running another call from a slow one.
  template <class Kernel>
  static __device__ void start(typename Kernel::Params const& params) {
    if (params.op.publish && blockIdx.x == 0 && threadIdx.x == 0) wait::announce(params.call);
  }

  template <class Kernel, class Mainloop, class Pipeline, class State, class Inputs, class Storage>
  static __device__ void load(typename Kernel::Params const& params, Mainloop& mainloop, Pipeline& pipeline,
                              State& write_state, Inputs const& load_inputs, Inputs const&, Storage& smem) {
    Kernel::load_units(params, mainloop, pipeline, write_state, load_inputs, smem);
  }

  // Block-scaled FP8: w_t's scales beside the TMA warp's units (A's scales come with A's TMA).
  template <class Kernel, class Mainloop, class Pipeline, class State, class Inputs, class Storage>
  static __device__ void load_scales(typename Kernel::Params const& params, Mainloop& mainloop, Pipeline& pipeline,
                                     State& write_state, Inputs const& load_inputs, Inputs const&, Storage& smem) {
    Kernel::template load_units<true>(params, mainloop, pipeline, write_state, load_inputs, smem);
  }

  // Publish: after the copies' writes completed, order them before the generic proxy; one system
  // fence then releases all of the block's flags, pushed into the owner's flag array (remote
  // stores: push, not pull).
  template <class Kernel>
  static __device__ void release(typename Kernel::Params const& params, BlockCoord const& c, uint64_t epoch,
                                 int64_t) {
    constexpr int kTilesPerBlock = Kernel::BLOCK_N / kTileN;
    static_assert(Kernel::BLOCK_N % kTileN == 0, "a GEMM block covers whole reduction tiles");
    Params const& op = params.op;
    if (!op.publish) return;
    ptx::fence_proxy_async_global();
    ptx::fence_acq_rel_sys();
    uint64_t* owner_flags = op.flags[c.owner] + int64_t(op.rank) * op.tiles_per_partition;
    int const tile0 = c.tile_m * op.tiles_n + c.n_block * kTilesPerBlock;
    CUTLASS_PRAGMA_UNROLL
    for (int t = 0; t < kTilesPerBlock; ++t) flag::store(owner_flags + tile0 + t, params.call, epoch);
  }

  // The store warp's last act: this CTA's arrival at the folded end (comm/call_end.cuh), after its
  // last release, the CTA's last read of the epoch (start's announce came before the CTA's first
  // barrier). The producer writes none of the call's outputs (the consumer poisons y).
  template <class Kernel>
  static __device__ void finish(typename Kernel::Params const& params, int lane) {
    comm::CallEnd const& end = params.op.end;
    if (lane == 0 && end.done != nullptr && comm::arrive(end.done, end.expected)) comm::advance_epoch(end);
  }

  // Every block has rows to multiply.
  template <class Kernel>
  static __device__ bool empty(typename Kernel::Params const&, BlockCoord const&) {
    return false;
  }

  // FP8 per tensor: every block of the call has the same factor, x's scale times w's (device
  // scalars, written before the call: stream order).
  template <class Kernel>
  static __device__ float alpha(typename Kernel::Params const& params, BlockCoord const&) {
    return *params.op.x_scale * *params.op.w_scale;
  }

  template <class Kernel>
  static typename Kernel::Params make_params(Plan const& plan, Args const& args) {
    using Element = typename Kernel::Element;
    using ElementA = typename Kernel::ElementA;
    using ElementB = typename Kernel::ElementB;
    ProblemShape const& shape = plan.shape;
    typename Kernel::Params p{};
    p.mainloop = Kernel::mainloop_params(shape.m, shape.n, shape.k, 1, static_cast<ElementA const*>(args.x), 0,
                                         static_cast<ElementB const*>(args.w), Kernel::kFp8 ? shape.k : shape.n, 0,
                                         Kernel::ScaleOperands::packed(args.x_scale, args.w_scale, shape.m, shape.n,
                                                                       shape.k));
    p.mainloop_local = p.mainloop;
    p.l = 1;
    p.m_local = shape.m;
    p.m = shape.m;
    p.n = shape.n;
    p.k = shape.k;
    p.part_row_step = shape.part_row0(1);
    p.part_col_step = shape.part_col0(1);
    p.order = plan.order;
    p.schedule = plan.schedule;
    p.split_workspace = static_cast<char*>(args.split_workspace);
    if (!p.split_workspace) p.schedule.split_first_block = p.schedule.num_blocks;
    p.out = static_cast<Element*>(args.partial);
    p.call = args.call;
    for (int q = 0; q < kMaxWorld; ++q) p.op.flags[q] = args.flags[q];
    p.op.blocks_per_partition = plan.order.m_blocks * plan.order.n_blocks;
    p.op.tiles_n = shape.part_cols() / kTileN;
    p.op.tiles_per_partition = plan.tiles_per_partition;
    p.op.world = shape.world;
    p.op.rank = shape.rank;
    p.op.interleave = args.interleave;
    p.op.publish = args.publish;
    p.op.x_scale = args.x_scale;
    p.op.w_scale = args.w_scale;
    p.op.end = args.end;
    return p;
  }
};

}  // namespace entwine::gemm_rs
