// moe_gemm_combine's schedule of the shared GEMM (gemm/gemm_kernel.cuh): o[e] = h[e] @ w2[e] for
// this rank's experts (CUTLASS's L mode, as the dispatch's), each finished block stored by the store
// warp straight into its source rank's inbox, at the rows of expert rank * E_local + e, and each
// (expert, source) segment released by one flag in that source's memory once its last block landed.
// Expert by expert the peers' segments stacked (from rank + 1; the expert's weight read once for
// all of them), the local ones last: remote ranks wait for theirs.
// FP8 per tensor: h (e4m3, or e5m2 for a gradient) and w2_t (e4m3, K-major) with this rank's two
// scales, one alpha for every block; the rows travel in the 16-bit output type.
//
//   rank r, h [E_local, W*C, F]                 source s's inbox, o_recv [E, C, H]
//   expert e: | s=0: C rows | s=1: C rows | ..   ---->  rows (r*E_local + e)*C .. + C
//
// Pitfalls: a block's stores go to a peer only after that peer announced the call (its inbox is
// free: it finished reading its last call's); after a failed wait the block is not stored and no
// flag is released (the outputs are poisoned), but every lead block of a peer's segment still
// arrives at the segment's counter, or the counters stop returning to zero. Every CTA announces the
// call before it may wait: a CTA that waits for a peer's announcement may hold the last free SM
// while this grid's first CTA has not started.
#pragma once

#include "comm/push.cuh"
#include "comm/wait.cuh"
#include "gemm/gemm_kernel.cuh"
#include "moe/moe.h"

namespace entwine::moe::combine {

struct GemmSchedule : gemm::QuietHooks {
  using Plan = GemmPlan;
  using Args = GemmArgs;
  static constexpr bool kLocalOperand = false;  // A is h alone
  static constexpr int kMaxGroup = 1;
  static constexpr bool kStoresToPeers = true;  // each block goes to its source's inbox

  struct Params {
    char* inbox[kMaxWorld];      // every rank's inbox (this rank's too): o_recv [E, C, H]
    uint64_t* flags[kMaxWorld];  // every rank's flags, parity 0: word source * E_local + expert
    const uint64_t* ready;       // this rank's ready words: ready[s] = rank s's announcement
    uint32_t* arrivals;          // one counter per (local expert, source), zero between calls
    int world, rank, e_local, capacity, n;
    int seg_tiles, k_tiles;
    DeviceError* error;
    DeviceError* error_mirror;
    uint64_t timeout_ns;
    const float* x_scale;  // FP8: h's scale (this rank's, one float)
    const float* w_scale;  // FP8: w2's scale
    const int32_t* received;  // rows of segment (expert, source) at expert * world + source, or nullptr: all C
  };

  // Block c lies wholly past the rows its source reads back: nothing to load, multiply or send (the
  // store warp still counts it at its segment, so the segment's flag is released).
  template <class Kernel>
  static __device__ bool empty(typename Kernel::Params const& params, BlockCoord const& c) {
    return past_received(params.op.received, c);
  }

  // Position p -> (segment, tile row inside it, block column): expert by expert the peers'
  // segments stacked, from rank + 1 round, then the local ones; the lead blocks first, then the empty
  // ones (segment_block, ExpertGroups).
  using Cursor = SegmentCursor;
  static __device__ BlockCoord block_coord(int p, Params const& op, TileOrder const& order, Cursor& cursor) {
    return segment_block(p, cursor, ExpertGroups(op.e_local, op.world, op.rank, 1, false), op.received, op.seg_tiles,
                         order);
  }

  // Announce the call to every peer first, from every CTA (the pitfalls above; the stamp is the same
  // each time): their stores into this rank's inbox wait for it. This kernel starts after this rank's
  // earlier calls completed (stream order), their reads of the inbox included.
  template <class Kernel>
  static __device__ void start(typename Kernel::Params const& params) {
    if (threadIdx.x == 0) wait::announce(params.call);
  }

  // The TMA warp: A is batch `expert` of h at tile row source * seg_tiles + tile (all local: no
  // wait), B batch `expert` of w2.
  template <class Kernel, class Mainloop, class Pipeline, class State, class Inputs, class Storage>
  static __device__ void load(typename Kernel::Params const& params, Mainloop& mainloop, Pipeline& pipeline,
                              State& write_state, Inputs const& load_inputs, Inputs const&, Storage& smem) {
    Params const& op = params.op;
    int const lane = cutlass::canonical_lane_idx();
    auto k_shape = cute::shape<3>(cute::get<0>(load_inputs));
    typename Kernel::WorkIter work(params);
    for (typename Kernel::Unit u; work.next(u);) {
      BlockCoord const& c = u.c;
      if (empty<Kernel>(params, c)) continue;
      int const expert = c.owner / op.world, source = c.owner % op.world;
      auto k_iter = cute::make_coord_iterator(cute::idx2crd(0, k_shape), k_shape);
      mainloop.load(params.mainloop, pipeline, write_state, load_inputs,
                    cute::make_coord(source * op.seg_tiles + c.tile_m, c.n_block, cute::_, expert), k_iter,
                    op.k_tiles, lane, 0u, smem);
      write_state.advance(op.k_tiles);
    }
    mainloop.load_tail(pipeline, write_state);
  }

  // load_scales, finish: QuietHooks' (per-tensor scales only: no block-scaled rows in the table for
  // this schedule).

  // FP8 per tensor: every block's factor is h's scale times w2's (both this rank's, inputs of the
  // call written before it in stream order). Not called for 16-bit operands.
  template <class Kernel>
  static __device__ float alpha(typename Kernel::Params const& params, BlockCoord const&) {
    return *params.op.x_scale * *params.op.w_scale;
  }

  // Block c's rows in its source's inbox (pitch n), once that source announced the call (lane 0 of
  // the store warp; a repeated poll of an announced source passes at its first load), or nullptr
  // when that wait failed (recorded; the block is not stored), or for an empty block (nothing to
  // send: its source never reads those rows).
  template <class Kernel>
  static __device__ typename Kernel::Element* destination(typename Kernel::Params const& params, BlockCoord const& c,
                                                          uint64_t epoch, int64_t* ld) {
    Params const& op = params.op;
    if (empty<Kernel>(params, c)) return nullptr;
    int const expert = c.owner / op.world, source = c.owner % op.world;
    if (source != op.rank) {
      if (!wait::poll_flag(op.ready + source, epoch, params.call, op.timeout_ns, op.error, op.error_mirror, op.rank,
                           source, 0, kMoeWaitCombineReady, 64)) {
        return nullptr;
      }
      // The bulk copies (async proxy) write what the acquire of the announcement ordered them after.
      ptx::fence_proxy_async_global();
    }
    *ld = op.n;
    int64_t const row = (int64_t(op.rank) * op.e_local + expert) * op.capacity + int64_t(c.tile_m) * Kernel::BLOCK_M;
    return reinterpret_cast<typename Kernel::Element*>(op.inbox[source]) + row * op.n +
           int64_t(c.n_block) * Kernel::BLOCK_N;
  }

  // After block c's stores completed: count a lead block at its segment; the segment's last lead
  // block releases the segment's flag in the source's memory (one system fence orders every block's
  // stores, each made visible by its own CTA's fence before its arrival, before the flag) and zeroes
  // the counter; not once this rank's call failed (a wait ran out). The other blocks are empty (no
  // rows stored), so the flag goes out as soon as the rows landed, before the grid's empty blocks.
  // The local segments need no flag: this rank reads them after the GEMM in stream order.
  template <class Kernel>
  static __device__ void release(typename Kernel::Params const& params, BlockCoord const& c, uint64_t epoch,
                                 int64_t) {
    Params const& op = params.op;
    int const expert = c.owner / op.world, source = c.owner % op.world;
    int const lead = lead_tiles(op.received, c.owner, op.seg_tiles);
    if (source == op.rank || c.tile_m >= lead) return;
    ptx::fence_proxy_async_global();
    push::arrive(op.arrivals + expert * op.world + source, lead * params.order.n_blocks,
                 op.flags[source] + int64_t(op.rank) * op.e_local + expert, !wait::stopped(params.call, op.error),
                 params.call, epoch);
  }

  // A = h as E_local batches of [world * C, F] (batch stride world * C * F); B = w2 as E_local batches
  // of [F, H] (16-bit: pitch H) or w2_t's of [H, F] (FP8, K-major: pitch F), batch stride F * H. The
  // output pointer is unused: destination() places blocks.
  template <class Kernel>
  static typename Kernel::Params make_params(Plan const& plan, Args const& args) {
    using Element = typename Kernel::Element;
    using ElementA = typename Kernel::ElementA;
    using ElementB = typename Kernel::ElementB;
    MoeProblem const& pr = plan.shape;
    int64_t const rows = int64_t(pr.world) * pr.capacity;
    typename Kernel::Params p{};
    p.n = pr.n;
    p.k = pr.k;
    p.m = int32_t(rows);
    p.l = plan.e_local;
    p.m_local = p.m;
    p.l_local = p.l;
    p.mainloop = Kernel::mainloop_params(p.m, p.n, p.k, p.l, static_cast<ElementA const*>(args.h), rows * pr.k,
                                         static_cast<ElementB const*>(args.w), Kernel::kFp8 ? pr.k : pr.n,
                                         int64_t(pr.k) * pr.n);
    p.mainloop_local = p.mainloop;
    p.part_row_step = 0;
    p.part_col_step = 0;
    p.order = plan.order;
    p.schedule = plan.schedule;
    p.split_workspace = nullptr;
    p.out = static_cast<Element*>(static_cast<void*>(args.inbox[pr.rank]));
    p.call = args.call;
    p.call.slot_stride = 0;
    for (int q = 0; q < kMaxWorld; ++q) {
      p.op.inbox[q] = args.inbox[q];
      p.op.flags[q] = args.flags[q];
    }
    p.op.ready = args.ready;
    p.op.arrivals = args.arrivals;
    p.op.world = pr.world;
    p.op.rank = pr.rank;
    p.op.e_local = plan.e_local;
    p.op.capacity = pr.capacity;
    p.op.n = pr.n;
    p.op.seg_tiles = plan.seg_tiles;
    p.op.k_tiles = plan.k_tiles;
    p.op.error = args.error;
    p.op.error_mirror = args.error_mirror;
    p.op.timeout_ns = args.timeout_ns;
    p.op.x_scale = args.x_scale;
    p.op.w_scale = args.w_scale;
    p.op.received = args.received;
    return p;
  }
};

}  // namespace entwine::moe::combine
