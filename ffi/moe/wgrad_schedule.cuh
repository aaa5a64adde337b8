// The MoE weight gradients' schedule of the shared GEMM (gemm/gemm_kernel.cuh): dw[e] = a[e]^T dy[e]
// batched over the local experts (CUTLASS's L mode), with a ragged K: each expert's K loop visits,
// segment by segment, only the k-tiles that hold received rows (MoeWgradPlan). A local GEMM: it
// waits for nothing and releases nothing (dw is read after the call, stream order).
#pragma once

#include "gemm/gemm_kernel.cuh"
#include "moe/moe.h"

namespace entwine::moe::wgrad {

struct GemmSchedule : gemm::QuietHooks {
  using Plan = GemmPlan;
  using Args = GemmArgs;
  static constexpr bool kLocalOperand = false;   // A is a_t alone (the pool or h, transposed)
  static constexpr int kMaxGroup = 1;            // B is dy alone
  static constexpr bool kStoresToPeers = false;  // dw is this rank's
  static constexpr bool kRaggedK = true;         // k_tiles() gives each block's count

  struct Cursor {};  // block_coord keeps no state between units

  struct Params {
    const int32_t* received;  // [E_local, world]: rows of segment (e, s) at e * world + s
    int world, capacity, seg_k_tiles, blocks_per_expert;
  };

  // The k-tiles of expert e's segment s: its received rows (clamped to [0, C]) in whole k-tiles.
  template <class Kernel>
  static __device__ int segment_k_tiles(Params const& op, int e, int s) {
    int rows = op.received[e * op.world + s];
    rows = rows < 0 ? 0 : (rows > op.capacity ? op.capacity : rows);
    return (rows + Kernel::BLOCK_K - 1) / Kernel::BLOCK_K;
  }

  // Block c's k-tiles: the sum over its expert's segments (the math warps' count, WorkIter's units
  // being whole blocks).
  template <class Kernel>
  static __device__ int k_tiles(typename Kernel::Params const& params, BlockCoord const& c) {
    int tiles = 0;
    for (int s = 0; s < params.op.world; ++s) tiles += segment_k_tiles<Kernel>(params.op, c.owner, s);
    return tiles;
  }

  // Position p -> (expert, tile row of dw[e], block column): expert by expert, each in `order`'s raster.
  static __device__ BlockCoord block_coord(int p, Params const& op, TileOrder const& order, Cursor&) {
    BlockCoord c{p / op.blocks_per_expert, 0, 0};
    order.block(p % op.blocks_per_expert, c.tile_m, c.n_block);
    return c;
  }

  // The TMA warp: per block, one load per segment with rows, from that segment's first k-tile.
  template <class Kernel, class Mainloop, class Pipeline, class State, class Inputs, class Storage>
  static __device__ void load(typename Kernel::Params const& params, Mainloop& mainloop, Pipeline& pipeline,
                              State& write_state, Inputs const& load_inputs, Inputs const&, Storage& smem) {
    Params const& op = params.op;
    int const lane = cutlass::canonical_lane_idx();
    auto k_shape = cute::shape<3>(cute::get<0>(load_inputs));
    typename Kernel::WorkIter work(params);
    for (typename Kernel::Unit u; work.next(u);) {
      BlockCoord const& c = u.c;
      for (int s = 0; s < op.world; ++s) {
        int const tiles = segment_k_tiles<Kernel>(op, c.owner, s);
        if (tiles == 0) continue;
        auto k_iter = cute::make_coord_iterator(cute::idx2crd(s * op.seg_k_tiles, k_shape), k_shape);
        mainloop.load(params.mainloop, pipeline, write_state, load_inputs,
                      cute::make_coord(c.tile_m, c.n_block, cute::_, c.owner), k_iter, tiles, lane, 0u, smem);
        write_state.advance(tiles);
      }
    }
    mainloop.load_tail(pipeline, write_state);
  }

  // start, load_scales, release, finish: QuietHooks' (16-bit operands; dw is read after the call).

  // An expert without rows: its blocks load nothing and are stored as zeros.
  template <class Kernel>
  static __device__ bool empty(typename Kernel::Params const& params, BlockCoord const& c) {
    return k_tiles<Kernel>(params, c) == 0;
  }

  template <class Kernel>
  static __device__ float alpha(typename Kernel::Params const&, BlockCoord const&) {
    return 1.0f;
  }

  // A = a_t as E_local batches of [m, world * C] (K-major, batch stride m * world * C); B = dy as
  // E_local batches of [world * C, n] (N-major, pitch n); dw block (e, tile, column) at row
  // e * m + tile * 128 of dw [E_local * m, n].
  template <class Kernel>
  static typename Kernel::Params make_params(Plan const& plan, Args const& args) {
    using Element = typename Kernel::Element;
    using ElementA = typename Kernel::ElementA;
    using ElementB = typename Kernel::ElementB;
    static_assert(!Kernel::kFp8, "the weight gradients' GEMM takes 16-bit operands");
    MoeWgradProblem const& pr = plan.shape;
    int const k = pr.world * pr.capacity;
    typename Kernel::Params p{};
    p.m = pr.m;
    p.n = pr.n;
    p.k = k;
    p.l = pr.e_local;
    p.m_local = pr.m;
    p.l_local = pr.e_local;
    p.mainloop = Kernel::mainloop_params(p.m, p.n, k, p.l, static_cast<ElementA const*>(args.a_t),
                                         int64_t(pr.m) * k, static_cast<ElementB const*>(args.dy), pr.n,
                                         int64_t(k) * pr.n);
    p.mainloop_local = p.mainloop;
    p.part_row_step = pr.m;
    p.part_col_step = 0;
    p.order = plan.order;
    p.schedule = plan.schedule;
    p.split_workspace = nullptr;
    p.out = static_cast<Element*>(args.dw);
    p.call = CallEpoch{};  // no epoch: the kernel reads it as 0 (a local GEMM)
    p.op.received = args.received;
    p.op.world = pr.world;
    p.op.capacity = pr.capacity;
    p.op.seg_k_tiles = plan.seg_k_tiles;
    p.op.blocks_per_expert = plan.order.m_blocks * plan.order.n_blocks;
    return p;
  }
};

}  // namespace entwine::moe::wgrad
