// Builds of ag_gemm's FP8 GEMM (e4m3 -> bf16) for `fp8 order` only, each changing ag_gemm's TMA warp
// (where its GEMM differs most from the producer's in the rows layout), to time what the chunk wait
// and the per-block loop cost against the producer's loop on the same GEMM.
#include "ag_gemm/gemm_schedule.cuh"
#include "harness/ag_world.h"

namespace entwine::harness {

namespace {

// A chunk's wait and the proxy fence, as the shipped loop does them, in a function of its own that
// is not inlined.
template <class Op>
__device__ __noinline__ bool wait_chunk_out_of_line(const uint64_t* flag, uint64_t epoch, CallEpoch const& call,
                                                    Op const& op, int source, int chunk) {
  bool const ok = wait::wait_flag_warp(flag, epoch, call, op.timeout_ns, op.error, op.error_mirror, op.rank, source,
                                       chunk, kWaitGatherChunk);
  ptx::fence_proxy_async_global();
  return ok;
}

// How a build waits for a peer's chunk: as the shipped loop does, in a function that is not inlined,
// or not at all (for timing only, every chunk released).
enum class Wait { kInline, kOutOfLine, kNone };

// The shipped loop (for_each_load) with its wait as kWait says. kInboxA: every block's A read from the
// gathered inbox with its descriptors, the local rows too (their own slot, filled by the harness; rows
// layout only); else each block's descriptors chosen at run time, as shipped. Against the shipped loop
// they show what the wait's code costs, and what reading x through descriptors of its own costs.
template <Wait kWait, bool kInboxA>
struct BlockLoop : ag_gemm::GemmSchedule {
  template <class Kernel, class Mainloop, class Pipeline, class State, class Inputs, class Storage>
  static __device__ void load(typename Kernel::Params const& params, Mainloop& mainloop, Pipeline& pipeline,
                              State& write_state, Inputs const& load_inputs, Inputs const& load_local,
                              Storage& smem) {
    Params const& op = params.op;
    int const lane = cutlass::canonical_lane_idx();
    uint64_t const epoch = ptx::load_relaxed_sys(params.call.epoch);
    const uint64_t* const flags = op.gather_flags + int64_t(epoch & 1) * params.call.flags_stride;
    int waited_source = -1, waited_chunk = -1;
    bool ok = true;
    auto k_shape = cute::shape<3>(cute::get<0>(load_inputs));
    for_each_load<Kernel>(params, [&](bool local, int m_block, int n_block, int batch, int source, int chunk) {
      if (kWait != Wait::kNone && !local && (source != waited_source || chunk != waited_chunk)) {
        uint64_t const* const flag = flags + source * op.chunks + chunk;
        if constexpr (kWait == Wait::kOutOfLine) {
          ok = ok && wait_chunk_out_of_line(flag, epoch, params.call, op, source, chunk);
        } else {
          ok = ok && wait::wait_flag_warp(flag, epoch, params.call, op.timeout_ns, op.error, op.error_mirror, op.rank,
                                          source, chunk, kWaitGatherChunk);
          ptx::fence_proxy_async_global();
        }
        waited_source = source;
        waited_chunk = chunk;
      }
      auto k_iter = cute::make_coord_iterator(cute::idx2crd(0, k_shape), k_shape);
      if constexpr (kInboxA) {
        int const row_block = local ? op.rank * op.shard_tiles + m_block : m_block;
        mainloop.load(params.mainloop, pipeline, write_state, load_inputs, cute::make_coord(row_block, n_block, cute::_, 0),
                      k_iter, op.k_tiles_per_source, lane, 0u, smem);
      } else {
        int const weight = Kernel::group_operand(params, n_block);
        mainloop.load(Kernel::mainloop_of(params, weight, local), pipeline, write_state,
                      local ? load_local : load_inputs, cute::make_coord(m_block, n_block, cute::_, batch), k_iter,
                      op.k_tiles_per_source, lane, 0u, smem);
      }
      write_state.advance(op.k_tiles_per_source);
    });
    mainloop.load_tail(pipeline, write_state);
  }
};

// The producer's loop (load_units): every block from params.mainloop, the gathered operand's
// descriptors, without a chunk wait; rows layout only, for timing only, with every chunk released
// (the local blocks read the inbox's own slot).
struct ProducerLoad : ag_gemm::GemmSchedule {
  template <class Kernel, class Mainloop, class Pipeline, class State, class Inputs, class Storage>
  static __device__ void load(typename Kernel::Params const& params, Mainloop& mainloop, Pipeline& pipeline,
                              State& write_state, Inputs const& load_inputs, Inputs const&, Storage& smem) {
    Kernel::load_units(params, mainloop, pipeline, write_state, load_inputs, smem);
  }
};

// The rows layout in the producer's loop over the CTA's units, with the wait out of line and each
// descriptor set loaded from its own call site; one weight, rows layout only.
struct UnitLoop : ag_gemm::GemmSchedule {
  template <class Kernel, class Mainloop, class Pipeline, class State, class Inputs, class Storage>
  static __device__ void load(typename Kernel::Params const& params, Mainloop& mainloop, Pipeline& pipeline,
                              State& write_state, Inputs const& load_inputs, Inputs const& load_local,
                              Storage& smem) {
    Params const& op = params.op;
    int const lane = cutlass::canonical_lane_idx();
    uint64_t const epoch = ptx::load_relaxed_sys(params.call.epoch);
    const uint64_t* const flags = op.gather_flags + int64_t(epoch & 1) * params.call.flags_stride;
    int waited = -1;
    bool ok = true;
    typename Kernel::WorkIter work(params);
    for (typename Kernel::Unit u; work.next(u);) {
      BlockCoord const& c = u.c;
      auto k_iter = Kernel::unit_k_tiles(u, load_inputs);
      if (c.owner == op.rank) {
        mainloop.load(params.mainloop_local, pipeline, write_state, load_local,
                      cute::make_coord(c.tile_m, c.n_block, cute::_, 0), k_iter, op.k_tiles_per_source, lane, 0u, smem);
      } else {
        int const chunk = c.tile_m / op.chunk_tiles, flag = c.owner * op.chunks + chunk;
        if (flag != waited) {
          ok = ok && wait_chunk_out_of_line(flags + flag, epoch, params.call, op, c.owner, chunk);
          waited = flag;
        }
        mainloop.load(params.mainloop, pipeline, write_state, load_inputs,
                      cute::make_coord(c.owner * op.shard_tiles + c.tile_m, c.n_block, cute::_, 0), k_iter,
                      op.k_tiles_per_source, lane, 0u, smem);
      }
      write_state.advance(op.k_tiles_per_source);
    }
    mainloop.load_tail(pipeline, write_state);
  }
};

template <class Schedule>
cudaError_t launch_variant(AgPlan const& plan, AgGemmArgs const& args, cudaStream_t stream) {
  using Kernel = gemm::GemmKernel<DType::kE4M3, DType::kBF16, kFp8BlockN, Schedule>;
  static bool const prepared = gemm::prepare<Kernel>() == cudaSuccess;
  if (!prepared) return cudaErrorInvalidValue;
  PreparedGemm gemm;
  gemm::prepare_launch<Kernel>(plan, args, &gemm);
  return gemm.enqueue(stream);
}

}  // namespace

std::vector<AgVariant> fp8_order_variants() {
  return {{"noinline_wait", launch_variant<BlockLoop<Wait::kOutOfLine, false>>, true},
          {"no_wait", launch_variant<BlockLoop<Wait::kNone, false>>, true},
          {"tma_units", launch_variant<ProducerLoad>, false},
          {"unit_loop", launch_variant<UnitLoop>, false},
          {"inbox_a", launch_variant<BlockLoop<Wait::kInline, true>>, false},
          {"inbox_a_no_wait", launch_variant<BlockLoop<Wait::kNone, true>>, false}};
}

}  // namespace entwine::harness
