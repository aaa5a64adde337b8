// ag_gemm's schedule of the shared GEMM (gemm/gemm_kernel.cuh): the kernel announces the call to
// every peer as it starts, blocks visit the gathered operand in arrival order (the local shard
// first), and the TMA warp waits on a chunk's flag before it loads a byte of that chunk. Stored
// blocks need no release: y is read after the call joins. Protocol: docs/design.md, "ag_gemm".
#pragma once

#include "ag_gemm/ag_gemm.h"
#include "comm/wait.cuh"
#include "gemm/gemm_kernel.cuh"

namespace entwine::ag_gemm {

struct GemmSchedule : gemm::QuietHooks {
  using Plan = GemmPlan;
  using Args = GemmArgs;
  static constexpr bool kLocalOperand = true;  // A: the local shard (x) or the gathered inbox
  static constexpr int kMaxGroup = kMaxWeights;  // B: w, or a group of weights (AgGemmArgs)
  static constexpr bool kStoresToPeers = false;  // the kernel's output is this rank's

  struct Cursor {};  // block_coord keeps no state between units

  struct Params {
    const uint64_t* gather_flags;   // flags[source * chunks + chunk] of this rank, parity 0
    bool gather_k;                  // contraction layout (AgProblem)
    int world, rank;
    int chunks, chunk_tiles, shard_tiles, blocks_per_chunk, k_tiles_per_source;
    DeviceError* error;
    DeviceError* error_mirror;
    uint64_t timeout_ns;
    const float* x_scale;      // FP8 (AgGemmArgs)
    const float* w_scale;
    const char* peer_scales;   // FP8: the inbox's scale slots, source-major (kScaleSlotBytes apart)
    bool shared_scale;         // FP8: every block is scaled by x_scale (AgProblem)
  };

  // Position p -> (source shard, tile row inside it, block column), in arrival order. Rows layout:
  // the local shard's blocks first (no wait), then chunk by chunk, for each chunk the peers in the
  // order their pushes start (rank r-1 pushes to r first, see the handler). Contraction layout:
  // chunk by chunk (every block loops over all shards; source is unused).
  static __device__ BlockCoord block_coord(int p, Params const& op, TileOrder const& order, Cursor&) {
    int const per_chunk = op.blocks_per_chunk;
    int source = 0, chunk, i;
    if (op.gather_k) {
      chunk = p / per_chunk;
      i = p % per_chunk;
    } else if (p < op.chunks * per_chunk) {
      source = op.rank;
      chunk = p / per_chunk;
      i = p % per_chunk;
    } else {
      int const j = p - op.chunks * per_chunk, per_round = (op.world - 1) * per_chunk;
      chunk = j / per_round;
      source = (op.rank + op.world - 1 - (j % per_round) / per_chunk) % op.world;
      i = j % per_chunk;
    }
    BlockCoord c{source, 0, 0};
    order.block(i, c.tile_m, c.n_block);
    c.tile_m += chunk * op.chunk_tiles;
    return c;
  }

  // Announce the call to every peer first (ready words; see CallEpoch::announce). This kernel
  // starts after everything of this rank's earlier calls is complete; the fence orders that (their
  // reads of the inbox) before the announcement.
  template <class Kernel>
  static __device__ void start(typename Kernel::Params const& params) {
    if (blockIdx.x == 0 && threadIdx.x == 0) wait::announce(params.call);
  }

  // The TMA warp: every block's A comes from the local shard (x) or from a peer's chunk in the
  // gathered inbox, which is loaded only after the whole warp has seen the chunk's flag carry this
  // call's epoch (wait_flag_warp: acquire, then the proxy fence that orders the TMA engine's reads
  // after it). A CTA's consecutive blocks mostly share a chunk, so the wait is skipped when it repeats.
  template <class Kernel, class Mainloop, class Pipeline, class State, class Inputs, class Storage>
  static __device__ void load(typename Kernel::Params const& params, Mainloop& mainloop, Pipeline& pipeline,
                              State& write_state, Inputs const& load_inputs, Inputs const& load_local,
                              Storage& smem) {
    Params const& op = params.op;
    int const lane = cutlass::canonical_lane_idx();
    uint64_t const epoch = ptx::load_relaxed_sys(params.call.epoch);
    const uint64_t* const flags = op.gather_flags + int64_t(epoch & 1) * params.call.flags_stride;
    int waited_source = -1, waited_chunk = -1;
    bool ok = true;  // false once a wait ran past its deadline: the rest loads without waiting
    auto k_shape = cute::shape<3>(cute::get<0>(load_inputs));
    for_each_load<Kernel>(params, [&](bool local, int m_block, int n_block, int batch, int source, int chunk) {
      if (!local && (source != waited_source || chunk != waited_chunk)) {
        ok = ok && wait::wait_flag_warp(flags + source * op.chunks + chunk, epoch, params.call, op.timeout_ns, op.error,
                                        op.error_mirror, op.rank, source, chunk, kWaitGatherChunk);
        // The TMA engine (async proxy) reads what the acquire made visible to this thread.
        ptx::fence_proxy_async_global();
        waited_source = source;
        waited_chunk = chunk;
      }
      auto k_iter = cute::make_coord_iterator(cute::idx2crd(0, k_shape), k_shape);
      // B: the weight of a group that owns the block column, read where it lies.
      int const weight = Kernel::group_operand(params, n_block);
      mainloop.load(Kernel::mainloop_of(params, weight, local), pipeline, write_state,
                    local ? load_local : load_inputs, cute::make_coord(m_block, n_block, cute::_, batch), k_iter,
                    op.k_tiles_per_source, lane, 0u, smem);
      write_state.advance(op.k_tiles_per_source);
    });
    mainloop.load_tail(pipeline, write_state);
  }

  // Block-scaled FP8: the scale-load warp loads w_t's scales of the TMA warp's loads, in its order
  // (for_each_load), from the same operand (the local shard's or the inbox's parameters: in the
  // contraction layout they hold different slices of w_t). It waits for no chunk: w's scales are
  // ready at launch, and its stages are the TMA warp's, so it runs at most a pipeline ahead.
  template <class Kernel, class Mainloop, class Pipeline, class State, class Inputs, class Storage>
  static __device__ void load_scales(typename Kernel::Params const& params, Mainloop& mainloop, Pipeline& pipeline,
                                     State& write_state, Inputs const& load_inputs, Inputs const& load_local,
                                     Storage& smem) {
    int const lane = cutlass::canonical_lane_idx();
    int const k_tiles = params.op.k_tiles_per_source;
    auto k_shape = cute::shape<3>(cute::get<0>(load_inputs));
    for_each_load<Kernel>(params, [&](bool local, int m_block, int n_block, int batch, int, int) {
      auto k_iter = cute::make_coord_iterator(cute::idx2crd(0, k_shape), k_shape);
      mainloop.load_auxiliary(local ? params.mainloop_local : params.mainloop, pipeline, write_state,
                              local ? load_local : load_inputs, cute::make_coord(m_block, n_block, cute::_, batch),
                              k_iter, k_tiles, lane, 0u, smem);
      write_state.advance(k_tiles);
    });
  }

  // A CTA's loads, in order, as visit(local, m_block, n_block, batch, source, chunk): every block's
  // A from the local shard (x) or from source's rows of the gathered inbox, chunk `chunk`.
  template <class Kernel, class Visit>
  static __device__ void for_each_load(typename Kernel::Params const& params, Visit&& visit) {
    Params const& op = params.op;
    typename Kernel::WorkIter work(params);
    for (typename Kernel::Unit u; work.next(u);) {
      BlockCoord const& c = u.c;
      int const chunk = c.tile_m / op.chunk_tiles;
      if (!op.gather_k) {
        bool const local = c.owner == op.rank;
        visit(local, (local ? 0 : c.owner * op.shard_tiles) + c.tile_m, c.n_block, 0, c.owner, chunk);
      } else {
        // The K loop: the local shard, then the peers in arrival order (r-1 first).
        for (int d = 0; d < op.world; ++d) {
          int const source = slice_source(op, d);
          visit(d == 0, c.tile_m, c.n_block, d == 0 ? 0 : source, source, chunk);
        }
      }
    }
  }

  // release, finish: QuietHooks'. y is read after the call (stream order); the call's end is its own
  // kernel (the copy-engine path's release kernels read the epoch on their own streams): nothing to fold.

  // Every block has rows to multiply.
  template <class Kernel>
  static __device__ bool empty(typename Kernel::Params const&, BlockCoord const&) {
    return false;
  }

  // FP8 per tensor: block c's factor, its source's x scale times w's (Scaling::kSlice, the contraction
  // layout with per-shard scales: w's alone, each K slice's x scale being k_slice's). A peer's scale was pushed
  // before its shard's first chunk, so the release of the chunk this block's rows came from published
  // it too; this thread is ordered after the TMA warp's acquire of that flag (the mbarrier of the
  // loads it consumed), and reads the slot past L1 (ld.global.cv).
  template <class Kernel>
  static __device__ float alpha(typename Kernel::Params const& params, BlockCoord const& c) {
    Params const& op = params.op;
    if constexpr (Kernel::kSliceScaled) return *op.w_scale;
    // the contraction layout's blocks take every source's rows: one scale, shared (else kSlice)
    float const x_scale = op.shared_scale || op.gather_k || c.owner == op.rank ? *op.x_scale : peer_scale(op, c.owner);
    return x_scale * *op.w_scale;
  }

  // Scaling::kSlice (the contraction layout with per-shard scales): k-tile t of a block lies in K slice
  // t / k_tiles_per_source of the K loop (the local shard, then the peers from r-1 down), whose sums
  // are scaled by its source's x scale as they are promoted. The math warps read the factor after
  // acquiring the slice's first stage, so after the TMA warp's acquire of the chunk's flag (as
  // alpha's read), with ld.global.cv.
  struct KSlice {
    int k_tiles;          // the slice's k-tiles from t on
    float const* factor;  // its x scale: the rank's own, or the source's slot in the inbox
  };
  template <class Kernel>
  static __device__ KSlice k_slice(typename Kernel::Params const& params, BlockCoord const&, int t) {
    Params const& op = params.op;
    int const d = t / op.k_tiles_per_source;
    float const* const factor = d == 0 ? op.x_scale : scale_slot(op, slice_source(op, d));
    return KSlice{(d + 1) * op.k_tiles_per_source - t, factor};
  }

  // Contraction layout: the source of a block's d-th K slice (the local shard, then r-1 down).
  static __device__ int slice_source(Params const& op, int d) { return (op.rank + op.world - d) % op.world; }

  // A source's x scale slot in the inbox; a peer's is read past L1 (ld.global.cv): the peer writes it.
  static __device__ float const* scale_slot(Params const& op, int source) {
    return reinterpret_cast<const float*>(op.peer_scales + source * kScaleSlotBytes);
  }
  static __device__ float peer_scale(Params const& op, int source) { return __ldcv(scale_slot(op, source)); }

  // Rows layout: A = the inbox [world * rows, cols] (peers) or x [rows, cols] (local), B = w.
  // Contraction layout: A = the inbox as a batch of world shards [rows, cols] (peers, batch =
  // source) or x (local), B = w as a batch of world slices [cols, n] (local: the rank's own slice).
  // FP8: w_t [n, world * cols] holds slice s in columns s*cols .. (s+1)*cols: pitch world * cols,
  // slice stride cols (16-bit: w [world * cols, n], slice stride cols * n).
  // Block-scaled: A's scales are x_scale [cols/128, rows] (local) or the inbox's [cols/128,
  // W * rows] (peers: source s in columns s*rows .., so the rows layout reads it as one array and
  // the contraction layout as a batch of W column slices); w's, w_scale [n/128, K/128], K/128
  // covering every slice in the contraction layout (slice s: columns s*cols/128 ..).
  // A group of weights (args.weights > 1): each weight is such a B of its own width, with its own
  // descriptors and output (Kernel::Params::group); the blocks span the sum of the widths.
  template <class Kernel>
  static typename Kernel::Params make_params(Plan const& plan, Args const& args) {
    using Element = typename Kernel::Element;
    using ElementA = typename Kernel::ElementA;
    using ElementB = typename Kernel::ElementB;
    AgProblem const& pr = plan.shape;
    auto const* x = static_cast<ElementA const*>(args.x);
    auto const* gathered = static_cast<ElementA const*>(args.gathered);
    typename Kernel::Params p{};
    p.n = pr.n;
    p.k = pr.cols;
    p.m_local = pr.rows;
    p.m = pr.gather_k ? pr.rows : pr.world * pr.rows;
    p.l = pr.gather_k ? pr.world : 1;
    // Block-scaled (one weight: the op joins a block-scaled group, whose scales concatenate): the
    // gathered A's scales are the inbox's, the local A's x_scale; w_scale serves both, from the
    // rank's own K slice for the local A in the contraction layout.
    using Scales = typename Kernel::ScaleOperands;
    Scales gathered_scales{}, local_scales{};
    if constexpr (Kernel::kBlockScaled) {
      int64_t const k_blocks = plan.scale_k_blocks, n_blocks = (int64_t(pr.n) + kScaleBlock - 1) / kScaleBlock;
      auto const* inbox_scales =
          reinterpret_cast<const float*>(static_cast<const char*>(args.gathered) + plan.scales_offset);
      int64_t const gathered_rows = int64_t(pr.world) * pr.rows;
      if (pr.gather_k) {
        int64_t const w_pitch = pr.world * k_blocks;
        gathered_scales = Scales{inbox_scales, gathered_rows, pr.rows, args.w_scale, w_pitch, k_blocks};
        local_scales = Scales{args.x_scale, pr.rows, k_blocks * pr.rows,
                              args.w_scale == nullptr ? nullptr : args.w_scale + pr.rank * k_blocks, w_pitch,
                              k_blocks};
      } else {
        gathered_scales = Scales{inbox_scales, gathered_rows, gathered_rows * k_blocks, args.w_scale, k_blocks,
                                 n_blocks * k_blocks};
        local_scales = Scales::packed(args.x_scale, args.w_scale, p.m_local, p.n, p.k);
      }
    }
    // Weight g's mainloop parameters, gathered A and local A.
    auto weight_params = [&](auto const* w, int n, typename Kernel::CollectiveMainloop::Params& gathered_a,
                             typename Kernel::CollectiveMainloop::Params& local_a) {
      if (pr.gather_k) {
        int64_t const shard = int64_t(pr.rows) * pr.cols;
        int64_t const ldb = Kernel::kFp8 ? int64_t(pr.world) * pr.cols : n;
        int64_t const slice = Kernel::kFp8 ? int64_t(pr.cols) : int64_t(pr.cols) * n;
        gathered_a = Kernel::mainloop_params(p.m, n, p.k, p.l, gathered, shard, w, ldb, slice, gathered_scales);
        local_a = Kernel::mainloop_params(p.m_local, n, p.k, 1, x, shard, w + int64_t(pr.rank) * slice, ldb, slice,
                                          local_scales);
      } else {
        int64_t const ldb = Kernel::kFp8 ? pr.cols : n;
        gathered_a = Kernel::mainloop_params(p.m, n, p.k, 1, gathered, 0, w, ldb, 0, gathered_scales);
        local_a = Kernel::mainloop_params(p.m_local, n, p.k, 1, x, 0, w, ldb, 0, local_scales);
      }
    };
    bool const grouped = args.weights > 1;
    weight_params(static_cast<ElementB const*>(args.w), grouped ? args.weight_n[0] : pr.n, p.mainloop,
                  p.mainloop_local);
    if constexpr (Kernel::kMaxGroup > 1) {
      if (grouped) {
        p.group.count = args.weights;
        for (int g = 0; g < args.weights; ++g) {
          if (g > 0) {
            weight_params(static_cast<ElementB const*>(args.w_more[g - 1]), args.weight_n[g],
                          p.group.mainloop_more[g - 1], p.group.local_more[g - 1]);
          }
          p.group.first[g + 1] = p.group.first[g] + args.weight_n[g] / Kernel::BLOCK_N;
          p.group.out_of[g] = static_cast<Element*>(g == 0 ? args.y : args.y_more[g - 1]);
          p.group.ld[g] = args.weight_n[g];
        }
      }
    }
    // The store warp writes block (source, tile row, column) to y at row source * part_row_step + ...
    p.part_row_step = pr.gather_k ? 0 : pr.rows;
    p.part_col_step = 0;
    p.order = plan.order;
    p.schedule = plan.schedule;
    p.split_workspace = nullptr;
    p.out = static_cast<Element*>(args.y);
    p.call = args.call;
    p.call.slot_stride = 0;  // the store warp writes y, which has one copy
    p.op.gather_flags = args.flags;
    p.op.gather_k = pr.gather_k;
    p.op.world = pr.world;
    p.op.rank = pr.rank;
    p.op.chunks = plan.chunks;
    p.op.chunk_tiles = plan.chunk_tiles;
    p.op.shard_tiles = plan.tile_rows;
    p.op.blocks_per_chunk = plan.chunk_tiles * plan.n_blocks;
    p.op.k_tiles_per_source = plan.k_tiles;
    p.op.error = args.error;
    p.op.error_mirror = args.error_mirror;
    p.op.timeout_ns = args.timeout_ns;
    p.op.x_scale = args.x_scale;
    p.op.w_scale = args.w_scale;
    p.op.peer_scales = static_cast<const char*>(args.gathered) + plan.scales_offset;
    p.op.shared_scale = pr.shared_scale;
    return p;
  }
};

}  // namespace entwine::ag_gemm
