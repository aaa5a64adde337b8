// The GEMM both fused ops run: CUTLASS 3.x SM90 TMA + wgmma mainloop, warp-specialised (TMA warp,
// store warp copying staged blocks out with bulk copies, block-scaled FP8: a scale-load warp; two
// math warpgroups). What differs between the ops (block order, what the TMA warp waits for, how a
// stored block is released) is the op's Schedule, a template parameter. One instantiation per
// generated file (cmake/gemm_kernels.cmake).
#pragma once

#include <new>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include "comm/protocol.h"
#include "comm/ptx.cuh"
#include "gemm/gemm.h"

namespace entwine::gemm {

using namespace cute;

// The CUTLASS element type of each DType of the table (cmake/gemm_kernels.cmake): A's (x) for an
// input type; kE5M2's B (w_t) is e4m3 (GemmKernel::ElementB).
template <DType>
struct ElementOf;
template <>
struct ElementOf<DType::kBF16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct ElementOf<DType::kFP16> {
  using type = cutlass::half_t;
};
template <>
struct ElementOf<DType::kE4M3> {
  using type = cutlass::float_e4m3_t;
};
template <>
struct ElementOf<DType::kE5M2> {
  using type = cutlass::float_e5m2_t;
};

// The hooks a schedule leaves empty when its GEMM announces nothing, publishes nothing and loads no
// scales: a schedule derives from it and defines the others (a derived hook hides the empty one).
struct QuietHooks {
  template <class Kernel>
  static __device__ void start(typename Kernel::Params const&) {}
  template <class Kernel>
  static __device__ void release(typename Kernel::Params const&, BlockCoord const&, uint64_t, int64_t) {}
  template <class Kernel>
  static __device__ void finish(typename Kernel::Params const&, int) {}
  template <class Kernel, class... Loaders>
  static __device__ void load_scales(typename Kernel::Params const&, Loaders&...) {}
};

// Whether a schedule gives each block a k-tile count of its own (Schedule::kRaggedK).
template <class S, class = void>
struct RaggedK : std::false_type {};
template <class S>
struct RaggedK<S, std::void_t<decltype(S::kRaggedK)>> : std::bool_constant<S::kRaggedK> {};

// The GEMM of one (input, output, BLOCK_N, op schedule) row of the kernel table. What is the op's is
// its Schedule (gemm_rs/gemm_schedule.cuh, ag_gemm/gemm_schedule.cuh), a type with:
//   Params                 what only the schedule reads (Params::op)
//   kMaxGroup              how many operands side by side B may be (Params::group; 1: one)
//   kStoresToPeers         true: destination() places each block (moe.combine: in peers' memory)
//   Plan, Args             the op's plan and launch arguments (host)
//   Cursor                           what one role keeps between its units (moe: where its walk over
//                                    the ragged segments stands; else empty)
//   block_coord(p, op, order, cursor)  block p of the call's order -> (owner, tile row, block column);
//                                    a role asks for its units in increasing p (WorkIter)
//   start<Kernel>(params)            first thing of every CTA (ag_gemm: announce the call)
//   load<Kernel>(params, ...)        the TMA warp's loop over its units (ag_gemm: waits on chunks)
//   release<Kernel>(params, c, e, parity)  after the store warp's copies of block c completed
//   destination<Kernel>(params, c, e, &ld)  where block c's rows go, pitch ld (kStoresToPeers only)
//   finish<Kernel>(params, lane)     the store warp's last act, every lane (gemm_rs: the folded end)
//   alpha<Kernel>(params, c)         FP8 per tensor: the factor that dequantises block c's fp32 sum
//   empty<Kernel>(params, c)         true: block c has no rows to multiply (its sum is zero; the
//                                    schedule's load() loads nothing for it)
//   kRaggedK, k_tiles<Kernel>(params, c)  optional (moe.wgrad): block c's own k-tile count, which the
//                                    math warps take instead of the unit's (whole blocks: no split)
//   KSlice, k_slice<Kernel>(params, c, t)  Scaling::kSlice rows only (ag_gemm): the K slice of block c's
//                                    k-tile t: the k-tiles left in it from t, and where its factor lies,
//                                    applied as their sums are promoted (alpha leaves it out)
//   load_scales<Kernel>(params, ...) FP8 per block: the scale-load warp's loop over the TMA warp's units
//   make_params<Kernel>(plan, args)  the kernel parameters of a plan (host)
// (QuietHooks above holds empty start, release, finish and load_scales for a schedule to derive from.)
template <DType kInput, DType kOutput, int BLOCK_N_, class Schedule_, Scaling kScaling = Scaling::kTensor>
struct GemmKernel {
  // ---- core config ---------------------------------------------------------------------------
  // A (x, the gathered shards): bf16, fp16, e4m3 or e5m2. B (w): A's type, except that kE5M2 pairs
  // an e5m2 A with an e4m3 B (Hopper's FP8 wgmma takes either type for either operand).
  using ElementA = typename ElementOf<kInput>::type;
  using ElementB = cute::conditional_t<kInput == DType::kE5M2, cutlass::float_e4m3_t, ElementA>;
  using Element = typename ElementOf<kOutput>::type;   // the output: bf16 or fp16; fp32 accumulation
  using Schedule = Schedule_;                          // the op's block order, loads and releases
  // FP8: wgmma reads both operands K-major (B is w transposed, [N, K]), and the block's sum is
  // dequantised by the schedule's alpha in the epilogue.
  static constexpr bool kFp8 = is_fp8(kInput);
  static constexpr bool kBlockScaled = kScaling == Scaling::kBlock;
  static_assert(!kBlockScaled || kFp8, "block scaling is for FP8 operands");
  static constexpr bool kSliceScaled = kScaling == Scaling::kSlice;
  static_assert(!kSliceScaled || kFp8, "per-slice scaling is for FP8 operands");
  // B's operands side by side (Params::group): block-scaled kernels read one (the op joins a group).
  static constexpr int kMaxGroup = kBlockScaled ? 1 : Schedule::kMaxGroup;
  static_assert(!is_fp8(kOutput), "FP8 is an input type only");
  static_assert(kFp8 || kInput == kOutput, "16-bit inputs produce their own type");
  static constexpr int BLOCK_M = kBlockM;             // two math warpgroups of 64 rows each
  static constexpr int BLOCK_N = BLOCK_N_;            // 128 or 256 (FP8: 128, gemm.h)
  static constexpr int BLOCK_K = block_k(kInput);     // one 128-byte TMA swizzle row of the input type
  static_assert(!kFp8 || BLOCK_N == kFp8BlockN, "FP8 blocks are 128 wide (gemm.h)");
  static_assert(!kBlockScaled || (BLOCK_K == kScaleBlock && BLOCK_N == kScaleBlock),
                "block scaling: a k-tile is one K scale block, a block column one w_t scale block");
  // warp 0: TMA, warp 1: stores, warp 2: block scales (kBlockScaled) or exit, warp 3: exit,
  // warpgroups 1-2: math
  static constexpr int kThreads = 384;
  static constexpr int kScaleLoadWarp = 2;
  static constexpr int kMathThreads = 256;            // cooperative: both warpgroups on every block
  using TileShape = Shape<Int<BLOCK_M>, Int<BLOCK_N>, Int<BLOCK_K>>;
  using ClusterShape = Shape<_1, _1, _1>;

  // ---- epilogue staging: the finished block in shared memory, each row contiguous (one bulk copy
  //      per row) and padded by 16 bytes, so the math warps' fragment stores (8 rows x 16 bytes per
  //      instruction) hit 32 distinct banks ----------------------------------------------------
  static constexpr int kStagePitch = BLOCK_N + 8;  // elements
  struct EpilogueStorage {
    alignas(128) Element tile[BLOCK_M * kStagePitch];
    uint32_t split_arrival;  // math thread 0 -> math threads: this CTA's arrival at a split slot
    uint32_t skip;           // math -> store warp: the staged unit was a first-arriving split piece
  };

  // ---- mainloop: A = x [M, K] row-major (K-major); B = w [K, N] row-major (N-major), or for FP8
  //      w_t [N, K] row-major (K-major: the only FP8 wgmma layout). 16-byte aligned rows (TMA).
  //      For per-tensor FP8 the builder picks CUTLASS's FP8 mainloop for its loads and shared-memory layouts;
  //      the math warpgroups run fp8_mma below, which adds the tensor cores' partial sum into the
  //      fp32 accumulator at least once per 128 products (FP8 wgmma keeps fewer mantissa bits in its
  //      accumulator than fp32, so a long K loop without the promotion loses accuracy; training
  //      shapes have K of 8k-32k). cuBLASLt's FP8 default promotes as often: its error statistics
  //      equal ours (entwine_harness fp8 accuracy).
  //      Block-scaled FP8 runs CUTLASS's blockwise mainloop instead: each k-tile's wgmma sum is
  //      multiplied by its scales (x's per row, w_t's per block) as it is added into accum. Its
  //      scales travel with the k-tile through the same pipeline stage: x's [K/128, M] (M-major: a
  //      k-tile's 128 row scales are contiguous) by the TMA warp's TMA, w_t's one scale per stage
  //      ([N/128, K/128], K-major) by cp.async from the scale-load warp, whose 32 lanes arrive on
  //      the stage's full barrier beside the TMA warp's transaction (33 producer arrivals).
  using LayoutB = cute::conditional_t<kFp8, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static_assert(sizeof(ElementA) == sizeof(ElementB), "A and B share BLOCK_K and the alignment");
  static constexpr int kAlignment = 16 / int(sizeof(ElementA));
  using BlockScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock, cute::GMMA::Major::MN,
                                                                     cute::GMMA::Major::K>;
  using LayoutSFA = decltype(BlockScaleConfig::deduce_layoutSFA());  // x_scale [K/128, M]
  using LayoutSFB = decltype(BlockScaleConfig::deduce_layoutSFB());  // w_scale [N/128, K/128]
  using GmemLayoutA = cute::conditional_t<kBlockScaled, cute::tuple<cutlass::layout::RowMajor, LayoutSFA>,
                                          cutlass::layout::RowMajor>;
  using GmemLayoutB = cute::conditional_t<kBlockScaled, cute::tuple<LayoutB, LayoutSFB>, LayoutB>;
  using MainloopSchedule = cute::conditional_t<kBlockScaled, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
                                               cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, GmemLayoutA, kAlignment,
      ElementB, GmemLayoutB, kAlignment,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(EpilogueStorage))>,
      MainloopSchedule>::CollectiveOp;
  using TiledMma = typename CollectiveMainloop::TiledMma;
  using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
  using PipelineState = typename CollectiveMainloop::PipelineState;
  using StrideA = typename CollectiveMainloop::StrideA;
  using StrideB = typename CollectiveMainloop::StrideB;
  static_assert(size(TiledMma{}) == kMathThreads, "cooperative mainloop: two math warpgroups");

  struct SharedStorage {
    typename CollectiveMainloop::TensorStorage mainloop;
    EpilogueStorage epilogue;
    typename CollectiveMainloop::PipelineStorage pipeline;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));

  struct Params {
    typename CollectiveMainloop::Params mainloop;        // A: x (gemm_rs) or the gathered inbox (ag_gemm)
    typename CollectiveMainloop::Params mainloop_local;  // A: the local shard (ag_gemm; unused by gemm_rs)
    int m, n, k, l, m_local;
    int l_local;                  // batches of the local operand (0 or 1: one; a batched local A)
    int64_t part_row_step;        // block (owner q, ...) is stored at row q * part_row_step ...
    int64_t part_col_step;        // ... and column q * part_col_step of the output
    WorkSchedule schedule;        // blocks, grid, k-tiles, split region (none without a workspace)
    char* split_workspace;        // gemm/gemm.h: arrival counters, ready sequences, fp32 partial blocks
    TileOrder order;              // blocks of one owner's group of tile rows, in production order
    Element* out;                 // slot 0 of the output (gemm_rs: the partial; ag_gemm: y)
    CallEpoch call;               // the epoch word and the parity strides
    typename Schedule::Params op;
    // B as a group of up to kMaxGroup operands side by side, each read where it lies
    // (ag_gemm's grouped weights; count < 2: B is mainloop's alone and blocks go to `out`, row
    // pitch n). Operand g owns block columns [first[g], first[g + 1]), is loaded through its own
    // descriptors (g = 0: mainloop and mainloop_local; else mainloop_more[g - 1], local_more[g - 1])
    // and stored to out_of[g], row pitch ld[g]: one GEMM, no copy of the operands into one B.
    struct Group {
      int count;
      int first[kMaxGroup + 1];
      Element* out_of[kMaxGroup];
      int64_t ld[kMaxGroup];
      cute::array<typename CollectiveMainloop::Params, kMaxGroup - 1> mainloop_more, local_more;
    } group;
  };

  // The group operand that owns block column `n_block` (0 without a group); n_block becomes the
  // block column inside it.
  static __device__ int group_operand(Params const& params, int& n_block) {
    int g = 0;
    while (g + 1 < params.group.count && n_block >= params.group.first[g + 1]) ++g;
    n_block -= params.group.first[g];
    return g;
  }

  // The mainloop parameters (A's and B's descriptors) of group operand g, with A the gathered
  // operand or (local) the local one.
  static __device__ typename CollectiveMainloop::Params const& mainloop_of(Params const& params, int g, bool local) {
    if (g == 0) return local ? params.mainloop_local : params.mainloop;
    return local ? params.group.local_more[g - 1] : params.group.mainloop_more[g - 1];
  }

  // One unit of a CTA's work: k-tiles [k_begin, k_end) of logical block p, at c in the output.
  // slot >= 0: the block is split between this CTA and a neighbour, which meet in that workspace slot.
  struct Unit {
    int p, k_begin, k_end, slot;
    BlockCoord c;
  };

  // A CTA's units, the same sequence for its three roles: the blocks blockIdx.x + i * grid below
  // split_first_block (whole waves), then its 1/grid share of the split region's k-tiles, in order.
  // Every share is at least one block long, so a block has at most two pieces: its head (from
  // k = 0) ends the share of CTA c and its tail starts the share of CTA c + 1; both use slot c.
  struct WorkIter {
    Params const& params;
    WorkSchedule const& s;
    int p, it, end;  // next whole block; this CTA's k-tiles [it, end) of the split region
    typename Schedule::Cursor cursor{};  // the schedule's state between this role's units
    __device__ explicit WorkIter(Params const& params) : params(params), s(params.schedule), p(blockIdx.x) {
      // (< 2^31: the split region holds less than two grids' blocks)
      int64_t const split_iters = int64_t(s.num_blocks - s.split_first_block) * s.k_tiles;
      it = int(split_iters * blockIdx.x / s.grid);
      end = int(split_iters * (blockIdx.x + 1) / s.grid);
    }
    __device__ bool next(Unit& u) {
      if (p < s.split_first_block) {
        u = Unit{p, 0, s.k_tiles, -1};
        p += s.grid;
      } else {
        if (it >= end) return false;
        int const k_begin = it % s.k_tiles;
        int const k_end = k_begin + end - it < s.k_tiles ? k_begin + end - it : s.k_tiles;
        u = Unit{s.split_first_block + it / s.k_tiles, k_begin, k_end, -1};
        if (k_begin > 0) {
          u.slot = int(blockIdx.x) - 1;
        } else if (k_end < s.k_tiles) {
          u.slot = int(blockIdx.x);
        }
        it += k_end - k_begin;
      }
      u.c = Schedule::block_coord(u.p, params.op, params.order, cursor);
      return true;
    }
  };

  // The FP8 mainloop of the math warpgroups: wgmma sums at most 128 products (one k-tile's 4 k-steps)
  // in its own accumulator, whose mantissa is short of fp32's, before the sum is promoted (added into
  // the fp32 accum). A promotion waits for the warpgroup's wgmmas in flight, which idles the tensor
  // pipe when both warpgroups wait at once; so warpgroup 1 promotes half a k-tile out of step with
  // warpgroup 0, and the other warpgroup's wgmmas fill the pipe during each wait. Warpgroup 0's
  // windows are whole k-tiles; warpgroup 1's are the second half of k-tile w-1 with the first half of
  // k-tile w (the first and last windows half). Every window holds at most 128 products. A
  // warpgroup releases a stage once the wgmmas that read it completed. Per-slice scaling (kSliceScaled)
  // runs that loop once per K slice (fp8_run), promoting each slice's sums times its factor.
  template <int kFirst, int kCount, class FragA, class FragB, class Frag>
  static __device__ __forceinline__ void fp8_steps(TiledMma& tiled_mma, FragA const& a, FragB const& b, int stage,
                                                   Frag& partial) {
    CUTLASS_PRAGMA_UNROLL
    for (int k = kFirst; k < kFirst + kCount; ++k) {
      cute::gemm(tiled_mma, a(_, _, k, stage), b(_, _, k, stage), partial);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
  }

  // A window's first wgmma overwrites the partial sum instead of adding to it.
  template <class Frag>
  static __device__ __forceinline__ void fp8_open_window(TiledMma& tiled_mma, Frag& partial) {
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(partial);
    warpgroup_arrive();
  }

  template <class Frag, class Accum>
  static __device__ __forceinline__ void fp8_promote(Frag& partial, Accum& accum, float scale = 1.0f) {
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(partial);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) {
      if constexpr (kSliceScaled) {
        accum(i) = fmaf(partial(i), scale, accum(i));
      } else {
        accum(i) += partial(i);
      }
    }
  }

  // One run of k-tiles whose sums share one factor (per tensor: the whole K loop, factor 1). The
  // run's first window opens on its first k-tile and its last closes on its last, so warpgroup 1's
  // out-of-step windows never straddle two runs.
  template <class FragA, class FragB, class Frag, class Accum>
  static __device__ __forceinline__ void fp8_run(MainloopPipeline& pipeline, PipelineState& read_state,
                                                 PipelineState& release_state, TiledMma& tiled_mma,
                                                 FragA const& tCrA, FragB const& tCrB, Frag& partial, Accum& accum,
                                                 int k_count, int math_group, float const* factor) {
    constexpr int kSteps = size<2>(FragA{});  // wgmma k-steps per k-tile
    constexpr int kHalf = kSteps / 2;
    static_assert(kSteps % 2 == 0, "a window is two halves of a k-tile's steps");
    float scale = 1.0f;
    if (math_group == 0) {
      CUTLASS_PRAGMA_NO_UNROLL
      for (int t = 0; t < k_count; ++t) {
        pipeline.consumer_wait(read_state, pipeline.consumer_try_wait(read_state));
        int const stage = read_state.index();
        ++read_state;
        fp8_open_window(tiled_mma, partial);
        fp8_steps<0, kSteps>(tiled_mma, tCrA, tCrB, stage, partial);
        // read after the run's first stage was acquired (the schedule's ordering argument), and
        // while its wgmmas run
        if constexpr (kSliceScaled) {
          if (t == 0) scale = __ldcv(factor);
        }
        fp8_promote(partial, accum, scale);
        pipeline.consumer_release(release_state);
        ++release_state;
      }
    } else if (k_count > 0) {
      pipeline.consumer_wait(read_state, pipeline.consumer_try_wait(read_state));
      int stage = read_state.index();
      ++read_state;
      fp8_open_window(tiled_mma, partial);
      fp8_steps<0, kHalf>(tiled_mma, tCrA, tCrB, stage, partial);
      if constexpr (kSliceScaled) scale = __ldcv(factor);
      fp8_promote(partial, accum, scale);
      CUTLASS_PRAGMA_NO_UNROLL
      for (int t = 1; t < k_count; ++t) {
        // The first half reads a k-tile already here: issued before waiting for the next one, it
        // keeps the tensor pipe busy while warpgroup 0 promotes and waits.
        fp8_open_window(tiled_mma, partial);
        fp8_steps<kHalf, kHalf>(tiled_mma, tCrA, tCrB, stage, partial);
        pipeline.consumer_wait(read_state, pipeline.consumer_try_wait(read_state));
        int const next = read_state.index();
        ++read_state;
        warpgroup_arrive();  // the wait's loop sits between the two halves' wgmmas
        fp8_steps<0, kHalf>(tiled_mma, tCrA, tCrB, next, partial);
        fp8_promote(partial, accum, scale);
        pipeline.consumer_release(release_state);
        ++release_state;
        stage = next;
      }
      fp8_open_window(tiled_mma, partial);
      fp8_steps<kHalf, kHalf>(tiled_mma, tCrA, tCrB, stage, partial);
      fp8_promote(partial, accum, scale);
      pipeline.consumer_release(release_state);
      ++release_state;
    }
  }

  template <class Accum>
  static __device__ void fp8_mma(MainloopPipeline& pipeline, PipelineState read_state, Accum& accum, int k_count,
                                 int math_group, typename CollectiveMainloop::TensorStorage& shared,
                                 Params const& params, BlockCoord const& c, int k_begin) {
    using SmemLayoutA = typename CollectiveMainloop::SmemLayoutA;
    using SmemLayoutB = typename CollectiveMainloop::SmemLayoutB;
    Tensor sA = make_tensor(make_smem_ptr(shared.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared.smem_B.data()), SmemLayoutB{});
    TiledMma tiled_mma;
    // The operands' shared-memory descriptors depend only on the warpgroup.
    auto thread_mma = tiled_mma.get_slice(math_group * cutlass::NumThreadsPerWarpGroup);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
    Tensor partial = make_fragment_like(accum);
    PipelineState release_state = read_state;
    if constexpr (kSliceScaled) {
      // Runs of k-tiles of one K slice, each scaled by its slice's factor (the schedule's k_slice).
      for (int t = 0; t < k_count;) {
        typename Schedule::KSlice const slice = Schedule::template k_slice<GemmKernel>(params, c, k_begin + t);
        int const run = slice.k_tiles < k_count - t ? slice.k_tiles : k_count - t;
        fp8_run(pipeline, read_state, release_state, tiled_mma, tCrA, tCrB, partial, accum, run, math_group,
                slice.factor);
        t += run;
      }
    } else {
      fp8_run(pipeline, read_state, release_state, tiled_mma, tCrA, tCrB, partial, accum, k_count, math_group,
              nullptr);
    }
    warpgroup_fence_operand(accum);
  }

  static __device__ void run(Params const& params, char* smem) {
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem);
    int const thread_idx = threadIdx.x;
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    int const warp_group = cutlass::canonical_warp_group_idx();
    int const lane_predicate = cute::elect_one_sync();

    // A kernel launched after this grid as its programmatic dependent (gemm_rs: its consumer) may
    // start once every CTA of this grid is resident: whatever it then waits for is computed by CTAs
    // that already hold their SMs and never wait for it (docs/design.md, "Forward progress").
    ptx::launch_dependents();
    Schedule::template start<GemmKernel>(params);

    if (warp_idx == 0 && lane_predicate) {
      CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
      if constexpr (Schedule::kLocalOperand) CollectiveMainloop::prefetch_tma_descriptors(params.mainloop_local);
      for (int g = 1; g < params.group.count; ++g) {
        CollectiveMainloop::prefetch_tma_descriptors(mainloop_of(params, g, false));
        if constexpr (Schedule::kLocalOperand) CollectiveMainloop::prefetch_tma_descriptors(mainloop_of(params, g, true));
      }
    }

    // Mainloop pipeline: warp 0 produces (TMA; block-scaled: with the scale-load warp, whose lanes
    // arrive but never expect transaction bytes: only thread 0 leads), the 256 math threads consume.
    bool const scale_loader = kBlockScaled && warp_idx == kScaleLoadWarp;
    typename MainloopPipeline::Params pipeline_params;
    if (warp_group == 0 && (warp_idx == 0 || scale_loader)) {
      pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    }
    if (warp_group > 0) {
      pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    }
    pipeline_params.is_leader = (thread_idx % cutlass::NumThreadsPerWarpGroup) == 0;
    pipeline_params.num_consumers = kMathThreads;
    if constexpr (kBlockScaled) pipeline_params.num_producers = CollectiveMainloop::NumProducerThreadEvents;
    pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline pipeline(storage.pipeline, pipeline_params, ClusterShape{});
    // Barrier init must be visible to every thread before first use.
    __syncthreads();

    CollectiveMainloop mainloop;
    auto load_inputs = mainloop.load_init(make_shape(params.m, params.n, params.k, params.l), params.mainloop);
    int const l_local = params.l_local > 1 ? params.l_local : 1;
    auto load_local = mainloop.load_init(make_shape(params.m_local, params.n, params.k, l_local), params.mainloop_local);

    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<40>();
      if (warp_idx == 0) {
        PipelineState write_state = cutlass::make_producer_start_state<MainloopPipeline>();
        Schedule::template load<GemmKernel>(params, mainloop, pipeline, write_state, load_inputs, load_local,
                                            storage.mainloop);
      } else if (warp_idx == 1) {
        store_and_release(params, storage.epilogue.tile, &storage.epilogue.skip, cutlass::canonical_lane_idx());
      } else if (scale_loader) {
        if constexpr (kBlockScaled) {
          PipelineState write_state = cutlass::make_producer_start_state<MainloopPipeline>();
          Schedule::template load_scales<GemmKernel>(params, mainloop, pipeline, write_state, load_inputs, load_local,
                                                     storage.mainloop);
        }
      }
      return;
    }

    cutlass::arch::warpgroup_reg_alloc<232>();
    int const math_idx = thread_idx - cutlass::NumThreadsPerWarpGroup;
    PipelineState read_state;
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_thread_slice(math_idx);
    Tensor sC = make_tensor(make_smem_ptr(storage.epilogue.tile),
                            make_layout(make_shape(Int<BLOCK_M>{}, Int<BLOCK_N>{}), make_stride(Int<kStagePitch>{}, _1{})));
    // stmatrix: each instruction stores four 8x8 matrices (16 bytes per thread) of the fragment.
    auto staging_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma);
    auto thread_staging = staging_copy.get_thread_slice(math_idx);
    Tensor tSsC = thread_staging.partition_D(sC);

    WorkIter work(params);
    bool first = true;
    for (Unit u; work.next(u); first = false) {
      BlockCoord const& c = u.c;
      // An empty block (the schedule's word: moe, past its segment's rows) takes no k-tile from the
      // pipeline, as the TMA warp loads none for it; its sum is zero.
      bool const empty = Schedule::template empty<GemmKernel>(params, c);
      int k_count = empty ? 0 : u.k_end - u.k_begin;
      if constexpr (RaggedK<Schedule>::value) k_count = empty ? 0 : Schedule::template k_tiles<GemmKernel>(params, c);
      Tensor accum = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
      // The FP8 mainloops add their promoted (block-scaled: scaled) partial sums into accum, so
      // accum starts at zero.
      if (kFp8 || empty) clear(accum);
      if constexpr (kFp8 && !kBlockScaled) {
        fp8_mma(pipeline, read_state, accum, k_count, warp_group - 1, storage.mainloop, params, c, u.k_begin);
      } else if (!empty) {  // CUTLASS's mma needs a k-tile
        mainloop.mma(pipeline, read_state, accum, k_count, math_idx, storage.mainloop, params.mainloop);
        mainloop.mma_tail(pipeline, read_state, k_count);
      }
      read_state.advance(k_count);
      bool const write = u.slot < 0 || join_split(params, u.slot, accum, math_idx, storage.epilogue.split_arrival);
      if constexpr (kFp8 && !kBlockScaled) {
        // Dequantise the whole sum (after a split block's two pieces met: one rounding, one factor).
        if (write) {
          float const alpha = Schedule::template alpha<GemmKernel>(params, c);
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(accum); ++i) accum(i) *= alpha;
        }
      }

      // The store warp's bulk copies must have read the previous block out of the staging tile.
      if (!first) ptx::named_barrier_sync(kEmptyBarrier, kMathThreads + kStoreThreads);
      if (write) {
        Tensor converted = make_fragment_like<Element>(accum);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) converted(i) = Element(accum(i));
        copy(staging_copy, thread_staging.retile_S(converted), tSsC);
        // The bulk copies read the staging tile through the async proxy.
        cute::tma_store_fence();
      }
      if (math_idx == 0) ptx::store_shared_word(&storage.epilogue.skip, !write);
      // Hand the staged block to the store warp and go on with the next block's mainloop.
      ptx::named_barrier_arrive(kFullBarrier, kMathThreads + kStoreThreads);
    }
  }

  // The two pieces of a split block meet in workspace slot `slot`. The first of the two CTAs to
  // arrive leaves its fp32 sum there and writes nothing else; the second adds it to its own sum and
  // writes and publishes the block. A sum of two terms does not depend on which came first, so the
  // output stays bitwise reproducible. The second waits only for a CTA that has already arrived
  // (running, writing 128 KB), so the wait cannot deadlock even if the two never run at once.
  // Pitfall: the arrival parity assumes every call adds exactly two arrivals per used slot, i.e.
  // no producer launch on this workspace was ever killed half-way (which also kills the context).
  template <class Accum>
  static __device__ bool join_split(Params const& params, int slot, Accum& accum, int math_idx,
                                    uint32_t& arrival_word) {
    uint32_t* const arrive = reinterpret_cast<uint32_t*>(params.split_workspace) + slot;
    uint32_t* const ready = arrive + kSplitSlots;
    if (math_idx == 0) ptx::store_shared_word(&arrival_word, atomicAdd(arrive, 1u));
    ptx::named_barrier_sync(kSplitBarrier, kMathThreads);
    uint32_t const arrival = ptx::load_shared_word(&arrival_word);
    uint32_t const sequence = arrival / 2 + 1;  // this call's use of the slot
    // Vector i of thread t at i * kMathThreads + t: every warp instruction moves 512 contiguous bytes.
    float4* partial = reinterpret_cast<float4*>(params.split_workspace + kSplitCountersBytes + slot * kSplitSlotBytes) + math_idx;
    constexpr int kVectors = decltype(size(accum))::value / 4;
    if (arrival % 2 == 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kVectors; ++i) {
        __stcg(partial + i * kMathThreads, make_float4(accum(4 * i), accum(4 * i + 1), accum(4 * i + 2), accum(4 * i + 3)));
      }
      // Every math thread's stores, then one GPU-scope release (cumulative over the barrier).
      ptx::named_barrier_sync(kSplitBarrier, kMathThreads);
      if (math_idx == 0) {
        __threadfence();
        ptx::store_release_gpu(ready, sequence);
      }
      return false;
    }
    if (math_idx == 0) {
      // A deadline, not a hang: the other CTA has arrived, so only a broken device gets here.
      uint64_t const deadline = ptx::global_timer_ns() + kSplitTimeoutNs;
      while (int32_t(ptx::load_acquire_gpu(ready) - sequence) < 0) {
        if (ptx::global_timer_ns() > deadline) __trap();
      }
    }
    ptx::named_barrier_sync(kSplitBarrier, kMathThreads);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVectors; ++i) {
      float4 const v = __ldcg(partial + i * kMathThreads);
      accum(4 * i) += v.x;
      accum(4 * i + 1) += v.y;
      accum(4 * i + 2) += v.z;
      accum(4 * i + 3) += v.w;
    }
    return true;
  }

  // The TMA warp's loop when every block's A is ready at launch (gemm_rs): each unit's k-tiles of
  // its block, at the block's owner's offset in A (partition offsets are multiples of the block).
  // kScales: the scale-load warp's loop beside it (block-scaled FP8), over the same units so that its
  // stages are the TMA warp's; every lane arrives on each stage's full barrier once its copies landed
  // (lane 0 copies the stage's one w_t scale); no tail: the TMA warp waits for the last stages' release.
  template <bool kScales = false, class Pipeline, class State, class Inputs>
  static __device__ void load_units(Params const& params, CollectiveMainloop& mainloop, Pipeline& pipeline,
                                    State& write_state, Inputs const& load_inputs,
                                    typename CollectiveMainloop::TensorStorage& smem) {
    WorkIter work(params);
    for (Unit u; work.next(u);) {
      auto const k_iter = unit_k_tiles(u, load_inputs);
      int const k_count = u.k_end - u.k_begin;
      if constexpr (kScales) {
        mainloop.load_auxiliary(params.mainloop, pipeline, write_state, load_inputs, unit_block(params, u), k_iter,
                                k_count, cutlass::canonical_lane_idx(), 0u, smem);
      } else {
        mainloop.load(params.mainloop, pipeline, write_state, load_inputs, unit_block(params, u), k_iter, k_count,
                      cutlass::canonical_lane_idx(), 0u, smem);
      }
      write_state.advance(k_count);
    }
    if constexpr (!kScales) mainloop.load_tail(pipeline, write_state);
  }

  // A unit's block in A's and B's tiles (gemm_rs: at its owner's offset) and its first k-tile.
  static __device__ auto unit_block(Params const& params, Unit const& u) {
    BlockCoord const& c = u.c;
    int const m_block = int(c.owner * params.part_row_step / BLOCK_M) + c.tile_m;
    int const n_block = int(c.owner * params.part_col_step / BLOCK_N) + c.n_block;
    return make_coord(m_block, n_block, _, 0);
  }
  template <class Inputs>
  static __device__ auto unit_k_tiles(Unit const& u, Inputs const& load_inputs) {
    auto k_shape = shape<3>(get<0>(load_inputs));
    return cute::make_coord_iterator(idx2crd(u.k_begin, k_shape), k_shape);
  }

  // Warp 1 (idle in the CUTLASS schedule) copies each staged block to the output with one bulk
  // copy per row (the TMA engine: no load/store instructions compete with the mainloop) and lets
  // the schedule release it, overlapped with the next block's mainloop. Lane 0 does the work; the
  // other lanes keep the barrier counts whole-warp.
  static __device__ void store_and_release(Params const& params, Element const* stage, uint32_t* skip_word, int lane) {
    constexpr int kRowBytes = BLOCK_N * sizeof(Element);
    // The call's epoch and its parity's output slot (CallEpoch; slot_stride 0: one output; no epoch
    // word: a local GEMM, epoch 0).
    uint64_t const epoch = params.call.epoch != nullptr ? ptx::load_relaxed_sys(params.call.epoch) : 0;
    int64_t const parity = int64_t(epoch & 1);
    Element* const partial = params.out + parity * params.call.slot_stride / int64_t(sizeof(Element));
    WorkIter work(params);
    Unit next;
    for (bool more = work.next(next); more;) {
      Unit const u = next;
      more = work.next(next);
      BlockCoord const& c = u.c;
      int64_t const row0 = c.owner * params.part_row_step + int64_t(c.tile_m) * BLOCK_M;
      int n_block = c.n_block;
      int const g = group_operand(params, n_block);
      // A group operand's block goes to that operand's own output, at its row pitch.
      int64_t ld = params.group.count > 1 ? params.group.ld[g] : int64_t(params.n);
      Element* const base = params.group.count > 1 ? params.group.out_of[g] : partial;
      Element* dst = base + row0 * ld + c.owner * params.part_col_step + int64_t(n_block) * BLOCK_N;
      // A schedule that stores into peers' memory picks each block's destination (lane 0 alone
      // stores; it may wait there, bounded, for the peer to take the call; nullptr: the wait failed or
      // the block is empty, and it is not stored but still released, which counts it).
      if constexpr (Schedule::kStoresToPeers) {
        if (lane == 0) dst = Schedule::template destination<GemmKernel>(params, c, epoch, &ld);
        __syncwarp();
      }
      ptx::named_barrier_sync(kFullBarrier, kMathThreads + kStoreThreads);
      bool const skip = ptx::load_shared_word(skip_word) != 0;
      if (lane == 0 && !skip && dst != nullptr) {
        for (int row = 0; row < BLOCK_M; ++row) {
          SM90_BULK_COPY_S2G::copy(stage + row * kStagePitch, dst + int64_t(row) * ld, kRowBytes);
        }
        cute::tma_store_arrive();
        cute::tma_store_wait<0>();
      }
      __syncwarp();
      // The copies have read the staging tile: it may take the next block, if there is one, while
      // the release below waits for the copies' writes.
      if (more) ptx::named_barrier_arrive(kEmptyBarrier, kMathThreads + kStoreThreads);
      // Release: the copies' writes are complete (wait_group 0, not .read); the schedule may then
      // publish them (gemm_rs: its flags; ag_gemm: nothing, stream order releases y).
      if (lane == 0 && !skip) {
        ptx::bulk_wait();
        Schedule::template release<GemmKernel>(params, c, epoch, parity);
      }
    }
    __syncwarp();
    Schedule::template finish<GemmKernel>(params, lane);
    // Launched as the programmatic dependent of another kernel (ag_gemm: its SM push, which never
    // waits), the grid completes only after that kernel did: the stream's next work may read both
    // kernels' outputs. A no-op in a grid launched plainly (gemm_rs).
    if (lane == 0) ptx::wait_primary();
  }

  // Named barriers between the math warps and the store warp; ids below 8 are left to CUTLASS.
  static constexpr int kStoreThreads = 32;
  static constexpr int kFullBarrier = 8;   // math -> store: the staging tile holds a block
  static constexpr int kEmptyBarrier = 9;  // store -> math: the staging tile may be overwritten
  static constexpr int kSplitBarrier = 10;  // math threads among themselves, at a split slot
  static constexpr uint64_t kSplitTimeoutNs = 10'000'000'000ull;

  // Block-scaled FP8: where a mainloop's scales are, in floats: x's of row r, K block kb, batch b at
  // x[b * x_batch + kb * x_pitch + r] (M-major), w_t's of block (nb, kb) at
  // w[b * w_batch + nb * w_pitch + kb] (K-major). packed(): one [k/128, m] and one [n/128, k/128]
  // array per batch, the FFI layouts.
  struct ScaleOperands {
    float const* x = nullptr;
    int64_t x_pitch = 0, x_batch = 0;
    float const* w = nullptr;
    int64_t w_pitch = 0, w_batch = 0;
    static ScaleOperands packed(float const* x, float const* w, int m, int n, int k) {
      int64_t const k_blocks = (k + kScaleBlock - 1) / kScaleBlock, n_blocks = (n + kScaleBlock - 1) / kScaleBlock;
      return ScaleOperands{x, m, k_blocks * m, w, k_blocks, n_blocks * k_blocks};
    }
  };

  // A's and B's TMA parameters: A [l][m, k] row-major; B [l][k, n] row-major, or for FP8 [l][n, k]
  // row-major; ldb is B's row pitch (16-bit: n; FP8: k, or more when B is a column slice of a wider
  // w_t); batch strides in elements. Block-scaled: `scales` (x's TMA-loaded: pitches of 16 bytes).
  static typename CollectiveMainloop::Params mainloop_params(int m, int n, int k, int l, ElementA const* a,
                                                             int64_t batch_a, ElementB const* b, int64_t ldb,
                                                             int64_t batch_b, ScaleOperands const& scales = {}) {
    StrideA stride_a{};
    get<0>(stride_a) = int64_t(k);
    StrideB stride_b{};
    if constexpr (kFp8) {
      get<0>(stride_b) = ldb;
    } else {
      get<1>(stride_b) = ldb;
    }
    get<2>(stride_a) = batch_a;
    get<2>(stride_b) = batch_b;
    auto const problem = make_shape(m, n, k, l);
    if constexpr (kBlockScaled) {
      int const k_blocks = (k + kScaleBlock - 1) / kScaleBlock, n_blocks = (n + kScaleBlock - 1) / kScaleBlock;
      LayoutSFA const layout_sfa = make_layout(
          make_shape(make_shape(_1{}, m), make_shape(Int<kScaleBlock>{}, k_blocks), l),
          make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, int32_t(scales.x_pitch)), int32_t(scales.x_batch)));
      LayoutSFB const layout_sfb = make_layout(
          make_shape(make_shape(Int<kScaleBlock>{}, n_blocks), make_shape(Int<kScaleBlock>{}, k_blocks), l),
          make_stride(make_stride(_0{}, int32_t(scales.w_pitch)), make_stride(_0{}, _1{}), int32_t(scales.w_batch)));
      return CollectiveMainloop::to_underlying_arguments(
          problem, {a, stride_a, b, stride_b, scales.x, layout_sfa, scales.w, layout_sfb}, nullptr);
    } else {
      return CollectiveMainloop::to_underlying_arguments(problem, {a, stride_a, b, stride_b}, nullptr);
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1) gemm_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
  extern __shared__ __align__(128) char smem[];
  Kernel::run(params, smem);
}

// Loads the instantiation's module and allows its shared memory (setup, see comm::OpHooks).
template <class Kernel>
cudaError_t prepare() {
  return cudaFuncSetAttribute(gemm_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
}

// Enqueues a launch whose parameters prepare() built; `dependent`: as the programmatic dependent of
// the stream's previous kernel, which may still run (it must let its dependents launch and never
// wait for this grid; the store warp waits for its end: store_and_release).
template <class Kernel>
cudaError_t launch_prepared(void const* prepared, cudaStream_t stream, bool dependent) {
  auto const& params = *static_cast<typename Kernel::Params const*>(prepared);
  cudaLaunchAttribute attr = ptx::programmatic_dependent();
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(params.schedule.grid);
  config.blockDim = dim3(Kernel::kThreads);
  config.dynamicSmemBytes = Kernel::kSmemBytes;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&config, gemm_kernel<Kernel>, params);
}

// Prepares the launch of a plan: the parameters are the schedule's reading of the plan and the
// arguments, kept in `out` (a trivially copyable struct of values and descriptors).
template <class Kernel>
void prepare_launch(typename Kernel::Schedule::Plan const& plan, typename Kernel::Schedule::Args const& args,
                    PreparedGemm* out) {
  using Params = typename Kernel::Params;
  static_assert(sizeof(Params) <= PreparedGemm::kParamsBytes && alignof(Params) <= alignof(PreparedGemm),
                "PreparedGemm must hold the kernel's parameters");
  new (out->params) Params(Kernel::Schedule::template make_params<Kernel>(plan, args));
  out->launch = launch_prepared<Kernel>;
}

}  // namespace entwine::gemm
