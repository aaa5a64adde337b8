// The GEMM of both fused ops: a Hopper GEMM (CUTLASS 3.x SM90 TMA + wgmma mainloop,
// warp-specialised: one TMA warp, one store warp, two math warpgroups; warps 2-3 exit at once).
// The math warps stage each block in shared memory; the store warp copies it out with bulk copies
// (the TMA engine) while the next block's mainloop runs. Two modes (docs/design.md):
//  - gemm_rs producer: blocks visit the output in the Entwine interleaved order and publish every
//    finished 128x128 reduction tile with an epoch flag pushed into its owner's memory. With
//    config.split_tail, a persistent grid splits its last waves in K.
//  - ag_gemm consumer: blocks visit the gathered operand in arrival order (local shard first), and
//    the TMA warp waits on a chunk's flag before it loads a byte of that chunk.
// Included once per (dtype, BLOCK_N) translation unit: each instantiation costs ~35 s to compile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/pipeline/pipeline.hpp>

#include "ag_gemm/ag_gemm.h"
#include "common/ptx.cuh"
#include "common/wait.cuh"
#include "gemm_rs/gemm_rs.h"

namespace entwine::producer {

using namespace cute;

template <class Element_, int BLOCK_N_>
struct ProducerGemm {
  // ---- core config ---------------------------------------------------------------------------
  using Element = Element_;                           // bf16 or fp16 in and out, fp32 accumulation
  static constexpr int BLOCK_M = 128;                 // two math warpgroups of 64 rows each
  static constexpr int BLOCK_N = BLOCK_N_;            // 128 or 256: publishes BLOCK_N / 128 tiles
  static constexpr int BLOCK_K = kProducerBlockK;     // one 128-byte TMA swizzle row of 2-byte types
  static constexpr int kThreads = 384;                // warp 0: TMA, warp 1: stores, warps 2-3: exit, warpgroups 1-2: math
  static constexpr int kMathThreads = 256;            // cooperative: both warpgroups on every block
  static constexpr int kTilesPerBlock = BLOCK_N / kTileN;
  using TileShape = Shape<Int<BLOCK_M>, Int<BLOCK_N>, Int<BLOCK_K>>;
  using ClusterShape = Shape<_1, _1, _1>;
  static_assert(BLOCK_M == kTileM && BLOCK_N % kTileN == 0, "a GEMM block covers whole reduction tiles");

  // ---- epilogue staging: the finished block in shared memory, each row contiguous (one bulk copy
  //      per row) and padded by 16 bytes, so the math warps' fragment stores (8 rows x 16 bytes per
  //      instruction) hit 32 distinct banks ----------------------------------------------------
  static constexpr int kStagePitch = BLOCK_N + 8;  // elements
  struct EpilogueStorage {
    alignas(128) Element tile[BLOCK_M * kStagePitch];
    uint32_t split_arrival;  // math thread 0 -> math threads: this CTA's arrival at a split slot
    uint32_t skip;           // math -> store warp: the staged unit was a first-arriving split piece
  };

  // ---- mainloop: A = x [M, K] row-major (K-major), B = w [K, N] row-major (N-major) -----------
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor, 8,
      Element, cutlass::layout::RowMajor, 8,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(EpilogueStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
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

  enum Mode : int { kReduceScatter = 0, kGatherRows = 1, kGatherK = 2 };

  struct Params {
    typename CollectiveMainloop::Params mainloop;        // A: x (gemm_rs) or the gathered slot (ag_gemm)
    typename CollectiveMainloop::Params mainloop_local;  // ag_gemm: A = the local shard, x itself
    int mode;
    int m, n, k, l, m_local, world, rank;
    int64_t part_row_step;        // partition q starts at row q * part_row_step ...
    int64_t part_col_step;        // ... and column q * part_col_step of the partial output
    int blocks_per_partition;
    ProducerSchedule schedule;    // blocks, grid, k-tiles, split region (launch.cu; none without a workspace)
    char* split_workspace;        // gemm_rs.h: arrival counters, ready sequences, fp32 partial blocks
    int tiles_n;                  // part_cols / 128: reduction tiles per row of a partition
    int tiles_per_partition;
    TileOrder order;              // blocks of one partition, in production order
    Element* partial;             // gemm_rs: slot 0 of this rank's partial output; ag_gemm: y
    uint64_t* flags[kMaxWorld];   // parity 0
    CallEpoch call;               // the epoch word and the parity strides (ag_gemm: slot_stride 0)
    bool interleave, publish;
    // ag_gemm: flags[source * chunks + chunk] of this rank, parity 0; blocks of one chunk in `order`
    const uint64_t* gather_flags;
    uint64_t* announce[kMaxWorld];  // ag_gemm: ready[rank] in each peer's heap (AgGemmArgs)
    int chunks, chunk_tiles, shard_tiles, blocks_per_chunk, k_tiles_per_source;
    DeviceError* error;
    DeviceError* error_mirror;
    uint64_t timeout_ns;
  };

  // Logical block p -> (owner partition, tile row inside it, block column). Interleaved: block p
  // goes to partition (p + rank + 1) mod W, so every wave feeds all W owners at an even pace and
  // the ranks start on different owners; inside a partition, blocks run in the consumer's N-major
  // TileOrder (grouped rows for L2 reuse), which the consumer walks in the same order.
  struct BlockCoord {
    int owner, tile_m, n_block;
  };
  static __device__ BlockCoord block_coord(int p, Params const& params) {
    if (params.mode != kReduceScatter) return gather_block_coord(p, params);
    int owner, i;
    if (params.interleave) {
      owner = (p % params.world + params.rank + 1) % params.world;
      i = p / params.world;
    } else {
      owner = p / params.blocks_per_partition;
      i = p % params.blocks_per_partition;
    }
    BlockCoord c{owner, 0, 0};
    params.order.block(i, c.tile_m, c.n_block);
    return c;
  }

  // ag_gemm: position p -> (source shard, tile row inside it, block column), in arrival order. Rows
  // layout: the local shard's blocks first (no wait), then chunk by chunk, for each chunk the peers
  // in the order their pushes start (rank r-1 pushes to r first, see the handler). Contraction
  // layout: chunk by chunk (every block loops over all shards; source is unused).
  static __device__ BlockCoord gather_block_coord(int p, Params const& params) {
    int const per_chunk = params.blocks_per_chunk;
    int source = 0, chunk, i;
    if (params.mode == kGatherK) {
      chunk = p / per_chunk;
      i = p % per_chunk;
    } else if (p < params.chunks * per_chunk) {
      source = params.rank;
      chunk = p / per_chunk;
      i = p % per_chunk;
    } else {
      int const j = p - params.chunks * per_chunk, per_round = (params.world - 1) * per_chunk;
      chunk = j / per_round;
      source = (params.rank + params.world - 1 - (j % per_round) / per_chunk) % params.world;
      i = j % per_chunk;
    }
    BlockCoord c{source, 0, 0};
    params.order.block(i, c.tile_m, c.n_block);
    c.tile_m += chunk * params.chunk_tiles;
    return c;
  }

  // One unit of a CTA's work: k-tiles [k_begin, k_end) of logical block p. slot >= 0: the block is
  // split between this CTA and a neighbour, which meet in that workspace slot.
  struct Unit {
    int p, k_begin, k_end, slot;
  };

  // A CTA's units, the same sequence for its three roles: the blocks blockIdx.x + i * grid below
  // split_first_block (whole waves), then its 1/grid share of the split region's k-tiles, in order.
  // Every share is at least one block long, so a block has at most two pieces: its head (from
  // k = 0) ends the share of CTA c and its tail starts the share of CTA c + 1; both use slot c.
  struct WorkIter {
    ProducerSchedule const& s;
    int p, it, end;  // next whole block; this CTA's k-tiles [it, end) of the split region
    __device__ explicit WorkIter(Params const& params) : s(params.schedule), p(blockIdx.x) {
      // (< 2^31: the split region holds less than two grids' blocks)
      int64_t const split_iters = int64_t(s.num_blocks - s.split_first_block) * s.k_tiles;
      it = int(split_iters * blockIdx.x / s.grid);
      end = int(split_iters * (blockIdx.x + 1) / s.grid);
    }
    __device__ bool next(Unit& u) {
      if (p < s.split_first_block) {
        u = Unit{p, 0, s.k_tiles, -1};
        p += s.grid;
        return true;
      }
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
      return true;
    }
  };

  static __device__ void run(Params const& params, char* smem) {
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem);
    int const thread_idx = threadIdx.x;
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    int const warp_group = cutlass::canonical_warp_group_idx();
    int const lane_predicate = cute::elect_one_sync();

    // ag_gemm: announce the call to every peer first (ready words; see AgGemmArgs::announce). This
    // kernel starts after everything of this rank's earlier calls is complete; the fence orders
    // that (their reads of the inbox) before the announcement.
    if (params.mode != kReduceScatter && blockIdx.x == 0 && thread_idx == 0) {
      uint64_t const epoch = ptx::load_relaxed_sys(params.call.epoch);
      ptx::fence_acq_rel_sys();
      for (int q = 0; q < params.world; ++q) {
        if (params.announce[q] != nullptr) ptx::store_relaxed_sys(params.announce[q], epoch);
      }
    }

    if (warp_idx == 0 && lane_predicate) {
      CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
      if (params.mode != kReduceScatter) CollectiveMainloop::prefetch_tma_descriptors(params.mainloop_local);
    }

    // Mainloop pipeline: warp 0 produces (TMA), the 256 math threads consume.
    typename MainloopPipeline::Params pipeline_params;
    if (warp_group == 0 && warp_idx == 0) {
      pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    }
    if (warp_group > 0) {
      pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    }
    pipeline_params.is_leader = (thread_idx % cutlass::NumThreadsPerWarpGroup) == 0;
    pipeline_params.num_consumers = kMathThreads;
    pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline pipeline(storage.pipeline, pipeline_params, ClusterShape{});
    // Barrier init must be visible to every thread before first use.
    __syncthreads();

    CollectiveMainloop mainloop;
    auto load_inputs = mainloop.load_init(make_shape(params.m, params.n, params.k, params.l), params.mainloop);
    auto load_local = mainloop.load_init(make_shape(params.m_local, params.n, params.k, 1), params.mainloop_local);

    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<40>();
      if (warp_idx == 0) {
        PipelineState write_state = cutlass::make_producer_start_state<MainloopPipeline>();
        if (params.mode != kReduceScatter) {
          load_gathered(params, mainloop, pipeline, write_state, load_inputs, load_local, storage.mainloop);
          return;
        }
        WorkIter work(params);
        for (Unit u; work.next(u);) {
          BlockCoord c = block_coord(u.p, params);
          // TMA coordinates in whole blocks (partition offsets are multiples of the block).
          int m_block = int(c.owner * params.part_row_step / BLOCK_M) + c.tile_m;
          int n_block = int(c.owner * params.part_col_step / BLOCK_N) + c.n_block;
          auto k_shape = shape<3>(get<0>(load_inputs));
          auto k_iter = cute::make_coord_iterator(idx2crd(u.k_begin, k_shape), k_shape);
          mainloop.load(params.mainloop, pipeline, write_state, load_inputs,
                        make_coord(m_block, n_block, _, 0), k_iter, u.k_end - u.k_begin,
                        cutlass::canonical_lane_idx(), 0u, storage.mainloop);
          write_state.advance(u.k_end - u.k_begin);
        }
        mainloop.load_tail(pipeline, write_state);
      } else if (warp_idx == 1) {
        store_and_publish(params, storage.epilogue.tile, &storage.epilogue.skip, cutlass::canonical_lane_idx());
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
      int const k_count = u.k_end - u.k_begin;
      Tensor accum = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
      mainloop.mma(pipeline, read_state, accum, k_count, math_idx, storage.mainloop, params.mainloop);
      mainloop.mma_tail(pipeline, read_state, k_count);
      read_state.advance(k_count);
      bool const write = u.slot < 0 || join_split(params, u.slot, accum, math_idx, storage.epilogue.split_arrival);

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

  // ag_gemm's TMA warp: every block's A comes from the local shard (x) or from a peer's chunk in the
  // gathered slot, which is loaded only after the whole warp has seen the chunk's flag carry this
  // call's epoch (wait_flag: acquire, then the proxy fence that orders the TMA engine's reads after
  // it). A CTA's consecutive blocks mostly share a chunk, so the wait is skipped when it repeats.
  template <class Pipeline, class State, class Inputs>
  static __device__ void load_gathered(Params const& params, CollectiveMainloop& mainloop, Pipeline& pipeline,
                                       State& write_state, Inputs const& load_inputs, Inputs const& load_local,
                                       typename CollectiveMainloop::TensorStorage& smem) {
    int const lane = cutlass::canonical_lane_idx();
    uint64_t const epoch = ptx::load_relaxed_sys(params.call.epoch);
    const uint64_t* const flags = params.gather_flags + int64_t(epoch & 1) * params.call.flags_stride;
    int waited_source = -1, waited_chunk = -1;
    bool ok = true;  // false once a wait ran past its deadline: the rest loads without waiting
    auto k_shape = shape<3>(get<0>(load_inputs));
    auto load = [&](bool local, int m_block, int n_block, int batch, int source, int chunk) {
      if (!local && (source != waited_source || chunk != waited_chunk)) {
        ok = ok && wait::wait_flag_warp(flags + source * params.chunks + chunk, epoch, params.timeout_ns,
                                        params.error, params.error_mirror, params.rank, source, chunk,
                                        WaitSite::kGatherChunk, params.call.trap);
        // The TMA engine (async proxy) reads what the acquire made visible to this thread.
        ptx::fence_proxy_async_global();
        waited_source = source;
        waited_chunk = chunk;
      }
      auto k_iter = cute::make_coord_iterator(idx2crd(0, k_shape), k_shape);
      mainloop.load(local ? params.mainloop_local : params.mainloop, pipeline, write_state,
                    local ? load_local : load_inputs, make_coord(m_block, n_block, _, batch), k_iter,
                    params.k_tiles_per_source, lane, 0u, smem);
      write_state.advance(params.k_tiles_per_source);
    };
    WorkIter work(params);
    for (Unit u; work.next(u);) {
      BlockCoord c = block_coord(u.p, params);
      int const chunk = c.tile_m / params.chunk_tiles;
      if (params.mode == kGatherRows) {
        bool const local = c.owner == params.rank;
        load(local, (local ? 0 : c.owner * params.shard_tiles) + c.tile_m, c.n_block, 0, c.owner, chunk);
      } else {
        // The K loop: the local shard, then the peers in arrival order (r-1 first).
        for (int d = 0; d < params.world; ++d) {
          int const source = (params.rank + params.world - d) % params.world;
          load(d == 0, c.tile_m, c.n_block, d == 0 ? 0 : source, source, chunk);
        }
      }
    }
    mainloop.load_tail(pipeline, write_state);
  }

  // Warp 1 (idle in the CUTLASS schedule) copies each staged block to the partial output with one
  // bulk copy per row (the TMA engine: no load/store instructions compete with the mainloop) and
  // publishes its tiles, overlapped with the next block's mainloop. Lane 0 does the work; the
  // other lanes keep the barrier counts whole-warp.
  static __device__ void store_and_publish(Params const& params, Element const* stage, uint32_t* skip_word, int lane) {
    constexpr int kRowBytes = BLOCK_N * sizeof(Element);
    // The call's epoch and its parity's partial slot and flags (CallEpoch).
    uint64_t const epoch = ptx::load_relaxed_sys(params.call.epoch);
    int64_t const parity = int64_t(epoch & 1);
    Element* const partial = params.partial + parity * params.call.slot_stride / int64_t(sizeof(Element));
    WorkIter work(params);
    Unit next;
    for (bool more = work.next(next); more;) {
      Unit const u = next;
      more = work.next(next);
      BlockCoord c = block_coord(u.p, params);
      int64_t const row0 = c.owner * params.part_row_step + int64_t(c.tile_m) * BLOCK_M;
      int64_t const col0 = c.owner * params.part_col_step + int64_t(c.n_block) * BLOCK_N;
      Element* dst = partial + row0 * params.n + col0;
      ptx::named_barrier_sync(kFullBarrier, kMathThreads + kStoreThreads);
      bool const skip = ptx::load_shared_word(skip_word) != 0;
      if (lane == 0 && !skip) {
        for (int row = 0; row < BLOCK_M; ++row) {
          SM90_BULK_COPY_S2G::copy(stage + row * kStagePitch, dst + int64_t(row) * params.n, kRowBytes);
        }
        cute::tma_store_arrive();
        cute::tma_store_wait<0>();
      }
      __syncwarp();
      // The copies have read the staging tile: it may take the next block, if there is one, while
      // the release below waits for the copies' writes.
      if (more) ptx::named_barrier_arrive(kEmptyBarrier, kMathThreads + kStoreThreads);
      // Publish: the copies' writes are complete (wait_group 0, not .read) and ordered before the
      // generic proxy; one system fence then releases all of the block's flags, pushed into the
      // owner's flag array (remote stores: push, not pull).
      if (lane == 0 && !skip) {
        ptx::bulk_wait();
        if (params.publish) {
          ptx::fence_proxy_async_global();
          ptx::fence_acq_rel_sys();
          uint64_t* owner_flags = params.flags[c.owner] + parity * params.call.flags_stride +
                                  int64_t(params.rank) * params.tiles_per_partition;
          int const tile0 = c.tile_m * params.tiles_n + c.n_block * kTilesPerBlock;
          CUTLASS_PRAGMA_UNROLL
          for (int t = 0; t < kTilesPerBlock; ++t) ptx::store_relaxed_sys(owner_flags + tile0 + t, epoch);
        }
      }
    }
  }

  // Named barriers between the math warps and the store warp; ids below 8 are left to CUTLASS.
  static constexpr int kStoreThreads = 32;
  static constexpr int kFullBarrier = 8;   // math -> store: the staging tile holds a block
  static constexpr int kEmptyBarrier = 9;  // store -> math: the staging tile may be overwritten
  static constexpr int kSplitBarrier = 10;  // math threads among themselves, at a split slot
  static constexpr uint64_t kSplitTimeoutNs = 10'000'000'000ull;

  static Params make_params(ProblemShape const& shape, GemmRsConfig const& config, ProducerArgs const& args) {
    StrideA stride_a{};
    get<0>(stride_a) = int64_t(shape.k);
    StrideB stride_b{};
    get<1>(stride_b) = int64_t(shape.n);
    typename CollectiveMainloop::Arguments mainloop_args{
        static_cast<Element const*>(args.x), stride_a, static_cast<Element const*>(args.w), stride_b};
    Params p{};
    p.mainloop = CollectiveMainloop::to_underlying_arguments(make_shape(shape.m, shape.n, shape.k, 1),
                                                            mainloop_args, nullptr);
    p.mainloop_local = p.mainloop;
    p.mode = kReduceScatter;
    p.l = 1;
    p.m_local = shape.m;
    p.m = shape.m;
    p.n = shape.n;
    p.k = shape.k;
    p.world = shape.world;
    p.rank = shape.rank;
    p.part_row_step = shape.part_row0(1);
    p.part_col_step = shape.part_col0(1);
    p.order = tile_order(shape, config);
    p.blocks_per_partition = p.order.m_blocks * p.order.n_blocks;
    p.schedule = producer_schedule(shape, config);
    p.split_workspace = static_cast<char*>(args.split_workspace);
    if (!p.split_workspace) p.schedule.split_first_block = p.schedule.num_blocks;
    p.tiles_n = shape.part_cols() / kTileN;
    p.tiles_per_partition = shape.tiles_per_partition();
    p.partial = static_cast<Element*>(args.partial);
    for (int q = 0; q < kMaxWorld; ++q) p.flags[q] = args.flags[q];
    p.call = args.call;
    p.interleave = args.interleave;
    p.publish = args.publish;
    return p;
  }

  // ag_gemm. Rows layout: A = the slot [world * rows, cols] (peers) or x [rows, cols] (local), B = w.
  // Contraction layout: A = the slot as a batch of world shards [rows, cols] (peers, batch = source)
  // or x (local), B = w as a batch of world slices [cols, n] (local: the rank's own slice).
  static Params make_gather_params(AgProblem const& pr, AgGemmConfig const& config, AgPlan const& plan,
                                   AgGemmArgs const& args) {
    StrideA stride_a{};
    get<0>(stride_a) = int64_t(pr.cols);
    StrideB stride_b{};
    get<1>(stride_b) = int64_t(pr.n);
    auto const* x = static_cast<Element const*>(args.x);
    auto const* gathered = static_cast<Element const*>(args.gathered);
    auto const* w = static_cast<Element const*>(args.w);
    Params p{};
    p.mode = pr.gather_k ? kGatherK : kGatherRows;
    p.n = pr.n;
    p.k = pr.cols;
    p.m_local = pr.rows;
    if (pr.gather_k) {
      p.m = pr.rows;
      p.l = pr.world;
      get<2>(stride_a) = int64_t(pr.rows) * pr.cols;
      get<2>(stride_b) = int64_t(pr.cols) * pr.n;
      p.mainloop = CollectiveMainloop::to_underlying_arguments(
          make_shape(p.m, p.n, p.k, p.l), {gathered, stride_a, w, stride_b}, nullptr);
      p.mainloop_local = CollectiveMainloop::to_underlying_arguments(
          make_shape(p.m_local, p.n, p.k, 1), {x, stride_a, w + int64_t(pr.rank) * pr.cols * pr.n, stride_b},
          nullptr);
    } else {
      p.m = pr.world * pr.rows;
      p.l = 1;
      p.mainloop = CollectiveMainloop::to_underlying_arguments(
          make_shape(p.m, p.n, p.k, 1), {gathered, stride_a, w, stride_b}, nullptr);
      p.mainloop_local = CollectiveMainloop::to_underlying_arguments(
          make_shape(p.m_local, p.n, p.k, 1), {x, stride_a, w, stride_b}, nullptr);
    }
    p.world = pr.world;
    p.rank = pr.rank;
    // The store warp writes block (source, tile row, column) to y at row source * part_row_step + ...
    p.part_row_step = pr.gather_k ? 0 : pr.rows;
    p.part_col_step = 0;
    p.order = TileOrder{plan.chunk_tiles, plan.n_blocks,
                        config.raster_rows < plan.chunk_tiles ? config.raster_rows : plan.chunk_tiles};
    p.blocks_per_chunk = plan.chunk_tiles * plan.n_blocks;
    p.schedule = ProducerSchedule{plan.num_blocks, plan.grid, (pr.gather_k ? pr.world : 1) * plan.k_tiles,
                                  plan.num_blocks};
    p.k_tiles_per_source = plan.k_tiles;
    p.split_workspace = nullptr;
    p.partial = static_cast<Element*>(args.y);
    p.publish = false;
    p.call = args.call;
    p.call.slot_stride = 0;  // the store warp writes y, which has one copy
    p.gather_flags = args.flags;
    for (int q = 0; q < kMaxWorld; ++q) p.announce[q] = args.announce[q];
    p.chunks = plan.chunks;
    p.chunk_tiles = plan.chunk_tiles;
    p.shard_tiles = plan.tile_rows;
    p.error = args.error;
    p.error_mirror = args.error_mirror;
    p.timeout_ns = args.timeout_ns;
    return p;
  }
};

template <class Gemm>
__global__ void __launch_bounds__(Gemm::kThreads, 1) producer_kernel(CUTE_GRID_CONSTANT typename Gemm::Params const params) {
  extern __shared__ __align__(128) char smem[];
  Gemm::run(params, smem);
}

template <class Gemm>
cudaError_t prepare() {
  return cudaFuncSetAttribute(producer_kernel<Gemm>, cudaFuncAttributeMaxDynamicSharedMemorySize, Gemm::kSmemBytes);
}

template <class Gemm>
cudaError_t launch(ProblemShape const& shape, GemmRsConfig const& config, ProducerArgs const& args, cudaStream_t stream) {
  typename Gemm::Params params = Gemm::make_params(shape, config, args);
  producer_kernel<Gemm><<<params.schedule.grid, Gemm::kThreads, Gemm::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

template <class Gemm>
cudaError_t launch_gather(AgProblem const& problem, AgGemmConfig const& config, AgPlan const& plan,
                          AgGemmArgs const& args, cudaStream_t stream) {
  typename Gemm::Params params = Gemm::make_gather_params(problem, config, plan, args);
  producer_kernel<Gemm><<<params.schedule.grid, Gemm::kThreads, Gemm::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace entwine::producer

// One instantiation per translation unit: defines entwine::producer::prepare_<NAME> / launch_<NAME>.
#define ENTWINE_DEFINE_PRODUCER(NAME, ELEMENT, BLOCK_N)                                               \
  namespace entwine::producer {                                                                       \
  using Gemm_##NAME = ProducerGemm<ELEMENT, BLOCK_N>;                                                 \
  cudaError_t prepare_##NAME() { return prepare<Gemm_##NAME>(); }                                     \
  cudaError_t launch_##NAME(ProblemShape const& s, GemmRsConfig const& c, ProducerArgs const& a,      \
                            cudaStream_t stream) {                                                    \
    return launch<Gemm_##NAME>(s, c, a, stream);                                                      \
  }                                                                                                   \
  cudaError_t launch_gather_##NAME(AgProblem const& s, AgGemmConfig const& c, AgPlan const& p,        \
                                   AgGemmArgs const& a, cudaStream_t stream) {                        \
    return launch_gather<Gemm_##NAME>(s, c, p, a, stream);                                            \
  }                                                                                                   \
  }
