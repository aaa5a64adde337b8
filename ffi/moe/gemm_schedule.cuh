// moe_dispatch_gemm's schedule of the shared GEMM (gemm/gemm_kernel.cuh): a GEMM batched over the
// local experts (CUTLASS's L mode: A and B batch e are expert e's rows and weight). The kernel
// announces the call as it starts; blocks visit the local source's rows first (read in place from
// x_send, no wait), then expert by expert the peers' segments stacked, rank - 1 first (the order the
// pushes arrive); the TMA warp waits on a segment's flag before it loads a byte of it.
#pragma once

#include "comm/wait.cuh"
#include "gemm/gemm_kernel.cuh"
#include "moe/moe.h"

namespace entwine::moe {

struct GemmSchedule : gemm::QuietHooks {
  using Plan = GemmPlan;
  using Args = GemmArgs;
  static constexpr bool kLocalOperand = true;  // A: the local source's x_send slice, or the inbox
  static constexpr int kMaxGroup = 1;
  static constexpr bool kStoresToPeers = false;  // the kernel's output is this rank's

  struct Params {
    const uint64_t* flags;  // flags[source * e_local + expert] of this rank, parity 0
    int world, rank, e_local;
    int seg_tiles, k_tiles;
    DeviceError* error;
    DeviceError* error_mirror;
    uint64_t timeout_ns;
    const float* x_scales;  // FP8: every source's x_scale [world]
    const float* w_scale;   // FP8: w's scale
    const int32_t* received;  // rows of segment (expert, source) at expert * world + source, or nullptr: all C
  };

  // Block c lies wholly past the rows its source sent its expert: nothing to load or multiply, and
  // its rows of y are stored as zeros (what the zero rows of x_send there would give).
  template <class Kernel>
  static __device__ bool empty(typename Kernel::Params const& params, BlockCoord const& c) {
    return past_received(params.op.received, c);
  }

  // Position p -> (segment, tile row inside it, block column): the local source's segments first
  // (read in place, no wait), expert by expert, then each expert's peer segments stacked, rank - 1
  // first (the order the pushes arrive: both transfers send expert-major, the copy engines from rank
  // r - d on its d-th stream, the SM push expert by expert to all its destinations at once, and rank
  // r is the first destination of r - 1); the lead blocks first, then the empty ones (segment_block,
  // ExpertGroups). The store warp writes block (owner, tile, column) at y row owner * C + tile * 128,
  // which is y[e, s * C + tile * 128] of y [E_local, world * C, n].
  using Cursor = SegmentCursor;
  static __device__ BlockCoord block_coord(int p, Params const& op, TileOrder const& order, Cursor& cursor) {
    return segment_block(p, cursor, ExpertGroups(op.e_local, op.world, op.rank, -1, true), op.received, op.seg_tiles,
                         order);
  }

  // Announce the call to every peer first (the pushes into this rank's inbox wait for it). This
  // kernel starts after everything of this rank's earlier calls is complete (stream order), the
  // GEMM's reads of the inbox included; announce's fence orders them before the announcement.
  template <class Kernel>
  static __device__ void start(typename Kernel::Params const& params) {
    if (blockIdx.x == 0 && threadIdx.x == 0) wait::announce(params.call);
  }

  // The TMA warp: a local block's A is batch `expert` of the rank's own x_send slice [E_local][C, k]
  // (mainloop_local); a peer's block's A is batch `expert` of the inbox [E_local][world * C, k], at
  // tile row source * seg_tiles + tile, loaded only after the whole warp has seen the segment's flag
  // carry this call's stamp (acquire, then the proxy fence that orders the TMA engine's reads after
  // it). B is batch `expert` of w either way. A wait for the segment this CTA waited for last is
  // skipped (consecutive blocks of a CTA often share one). An empty block loads nothing, but its segment's flag is still waited
  // for: the pool's copy after the GEMM reads every segment, and every call must acquire a flag from
  // every peer (the double-buffer argument).
  template <class Kernel, class Mainloop, class Pipeline, class State, class Inputs, class Storage>
  static __device__ void load(typename Kernel::Params const& params, Mainloop& mainloop, Pipeline& pipeline,
                              State& write_state, Inputs const& load_inputs, Inputs const& load_local,
                              Storage& smem) {
    Params const& op = params.op;
    int const lane = cutlass::canonical_lane_idx();
    uint64_t const epoch = ptx::load_relaxed_sys(params.call.epoch);
    const uint64_t* const flags = op.flags + int64_t(epoch & 1) * params.call.flags_stride;
    int waited = -1;  // the segment (owner) last waited for
    bool ok = true;   // false once a wait failed: the rest loads without waiting (the outputs are poisoned)
    auto k_shape = cute::shape<3>(cute::get<0>(load_inputs));
    typename Kernel::WorkIter work(params);
    for (typename Kernel::Unit u; work.next(u);) {
      BlockCoord const& c = u.c;
      int const expert = c.owner / op.world, source = c.owner % op.world;
      bool const local = source == op.rank;
      if (!local && c.owner != waited) {
        ok = ok && wait::wait_flag_warp(flags + source * op.e_local + expert, epoch, params.call, op.timeout_ns,
                                        op.error, op.error_mirror, op.rank, source, expert, kMoeWaitSegment);
        // The TMA engine (async proxy) reads what the acquire made visible to this thread.
        ptx::fence_proxy_async_global();
        waited = c.owner;
      }
      if (empty<Kernel>(params, c)) continue;
      int const m_block = (local ? 0 : source * op.seg_tiles) + c.tile_m;
      auto k_iter = cute::make_coord_iterator(cute::idx2crd(0, k_shape), k_shape);
      mainloop.load(local ? params.mainloop_local : params.mainloop, pipeline, write_state,
                    local ? load_local : load_inputs, cute::make_coord(m_block, c.n_block, cute::_, expert), k_iter,
                    op.k_tiles, lane, 0u, smem);
      write_state.advance(op.k_tiles);
    }
    mainloop.load_tail(pipeline, write_state);
  }

  // load_scales, release, finish: QuietHooks'. The op's FP8 is per tensor (no scale loads), and y is
  // read after the call joins (stream order): a stored block needs no release.

  // FP8 per tensor: block c's factor, its source's x scale times w's (a block lies in one source's
  // segment). The scales are inputs of the call, written before it (stream order).
  template <class Kernel>
  static __device__ float alpha(typename Kernel::Params const& params, BlockCoord const& c) {
    Params const& op = params.op;
    return op.x_scales[c.owner % op.world] * *op.w_scale;
  }

  // A = the inbox as E_local batches of [world * C, k] (batch stride world * C * k), or for the
  // local source x_send's slice of this rank's experts as E_local batches of [C, k] (stride C * k);
  // B = w as E_local batches of [k, n] (16-bit, pitch n) or w_t's of [n, k] (FP8, pitch k), batch
  // stride k * n, for both.
  template <class Kernel>
  static typename Kernel::Params make_params(Plan const& plan, Args const& args) {
    using Element = typename Kernel::Element;
    using ElementA = typename Kernel::ElementA;
    using ElementB = typename Kernel::ElementB;
    MoeProblem const& pr = plan.shape;
    int64_t const seg = int64_t(pr.capacity) * pr.k;
    auto const* inbox = static_cast<ElementA const*>(args.inbox);
    auto const* local = static_cast<ElementA const*>(args.x_send) + int64_t(pr.rank) * plan.e_local * seg;
    auto const* w = static_cast<ElementB const*>(args.w);
    typename Kernel::Params p{};
    p.n = pr.n;
    p.k = pr.k;
    p.m = pr.world * pr.capacity;
    p.l = plan.e_local;
    p.m_local = pr.capacity;
    p.l_local = plan.e_local;
    int64_t const ldb = Kernel::kFp8 ? pr.k : pr.n;
    p.mainloop = Kernel::mainloop_params(p.m, p.n, p.k, p.l, inbox, int64_t(pr.world) * seg, w, ldb,
                                         int64_t(pr.k) * pr.n);
    p.mainloop_local = Kernel::mainloop_params(p.m_local, p.n, p.k, p.l_local, local, seg, w, ldb,
                                               int64_t(pr.k) * pr.n);
    // The store warp writes block (owner = e * world + s, tile, column) at y row owner * C + tile * 128.
    p.part_row_step = pr.capacity;
    p.part_col_step = 0;
    p.order = plan.order;
    p.schedule = plan.schedule;
    p.split_workspace = nullptr;
    p.out = static_cast<Element*>(args.y);
    p.call = args.call;
    p.call.slot_stride = 0;  // y has one copy
    p.op.flags = args.flags;
    p.op.world = pr.world;
    p.op.rank = pr.rank;
    p.op.e_local = plan.e_local;
    p.op.seg_tiles = plan.seg_tiles;
    p.op.k_tiles = plan.k_tiles;
    p.op.error = args.error;
    p.op.error_mirror = args.error_mirror;
    p.op.timeout_ns = args.timeout_ns;
    p.op.x_scales = args.x_scales;
    p.op.w_scale = args.w_scale;
    p.op.received = args.received;
    return p;
  }
};

}  // namespace entwine::moe
