// The consumer: reduces this rank's partition of the W partial outputs, one producer block
// (128 x block_n) at a time, each as soon as its W producers have released it. Runs beside the
// producer GEMM as its programmatic dependent on XLA's stream, with a small grid (the
// communication budget x): its CTAs start only once every CTA of the GEMM is resident.
//
//   producer on rank s (any s)                      consumer on rank r (grid x, block b + 32)
//   ─────────────────────────                       ───────────────────────────────────
//   GEMM block -> stores tile t of partition r      CTA j: blocks j, j+x, j+2x, ... (producer order)
//   into V_s[slot] (its own memory)                   waiter warp: spins on flags_r[s][t] >= e of
//   bar.sync; fence.acq_rel.sys;                        block i+1, fence, bar.arrive
//   st.release.sys flags_r[s][t] = e  ──NVLink──▶     b data threads (meanwhile on block i):
//                                                       bar.sync, 16-byte loads of V_0..V_{W-1},
//                                                       fp32 sum in rank order, one store to out
//
// Pitfalls:
//  - The waits need a deadline: a peer that never calls must become an error record, not a hang.
//    The first CTA to time out records (rank, source, tile, expected, observed); the others see
//    the record and leave.
//  - Partial data is read with ld.global.cg (L2 only): L1 is not coherent with peer writes and a
//    stale line from the previous epoch would be silently wrong.
//  - All W loads of a chunk are issued before the first add, so the order of issue does not
//    serialise on one peer; the adds run in rank order, which makes results bitwise repeatable.
//  - The waiter may run one block ahead, never two: the named barrier of a parity and its leave
//    flag are reused only after the data threads have passed them (see consumer_kernel).
//  - 544 threads per CTA cap ptxas at 96 registers: 16 loads in flight (64 registers) leave little
//    room, so each round addresses its unrolled chunks from one base offset (no spills).
//  - Forward progress (docs/design.md, "Forward progress"): a consumer CTA spins while holding its
//    SM, so it may only wait for work that needs no SM it holds. The local GEMM: the consumer is
//    its programmatic dependent, launched once every GEMM CTA is resident, and the GEMM never
//    waits for the consumer. Peers' GEMMs: they never wait either, so they progress on any SM that
//    no waiting consumer holds; ranks sharing one GPU (MPS) keep their consumers' grids together
//    below its SM count (the handler clamps the grid).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "comm/call_end.cuh"
#include "comm/ptx.cuh"
#include "comm/wait.cuh"
#include "gemm_rs/gemm_rs.h"

namespace entwine::consumer {

constexpr int kMaxBlock = 512;
constexpr int kChunkElems = 8;                                   // 16 bytes of 2-byte elements
constexpr int kChunksPerRow = kTileN / kChunkElems;              // 16

struct Params {
  ConsumerArgs args;
  int n;                  // leading dimension of the partials (N)
  int out_cols;           // leading dimension of the output (part_cols)
  int64_t part_row0, part_col0;  // this rank's partition inside the partials
  int tiles_n, tiles, rank;
  TileOrder order;        // the producer's block order inside a partition
  int tiles_per_block;    // reduction tiles per producer block (block_n / 128)
};

// The CUDA type of each DType and its packed conversions to and from fp32 pairs.
template <DType>
struct Pack;
template <>
struct Pack<DType::kBF16> {
  using Element = __nv_bfloat16;
  static __device__ float2 to_float2(uint32_t v) { return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v)); }
  static __device__ uint32_t from_float2(float2 f) {
    __nv_bfloat162 h = __float22bfloat162_rn(f);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct Pack<DType::kFP16> {
  using Element = __half;
  static __device__ float2 to_float2(uint32_t v) { return __half22float2(*reinterpret_cast<__half2*>(&v)); }
  static __device__ uint32_t from_float2(float2 f) {
    __half2 h = __float22half2_rn(f);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// Spin until the tile's flag carries this call's stamp (wait::poll_flag). Returns false when the
// CTA must leave (or traps, inside a CUDA graph). On success the producer's partial tile is visible.
__device__ bool wait_flag(const uint64_t* flag, uint64_t epoch, Params const& p, int source, int tile) {
  return wait::poll_flag(flag, epoch, p.args.call, p.args.timeout_ns, p.args.error, p.args.error_mirror, p.rank,
                         source, tile, kWaitReduceTile, 64);
}

// Reduces one step (one producer block: tiles_per_block 128x128 tiles) with `threads` threads,
// `thread` being this thread's index among them, from the partial slot `slot` elements past slot 0
// (the call's parity). Its releases must have been acquired.
template <DType kDType, int W>
__device__ void reduce_step(Params const& p, int64_t slot, int step, int thread, int threads) {
  // Chunks per thread per round: about 16 16-byte loads in flight whatever W is (the reads cross
  // NVLink: ~2 us of latency to cover per CTA); 8 for W = 1, whose reads are all local.
  using Element = typename Pack<kDType>::Element;
  constexpr int kUnroll = W == 1 ? 8 : W >= 8 ? 2 : 16 / W;
  int const chunks_per_row = p.tiles_per_block * kChunksPerRow;
  int const chunks = kTileM * chunks_per_row;
  // threads is a multiple of 32 and chunks_per_row divides 32: chunk c + threads sits
  // `rows_per_pass` rows below chunk c, so one base offset per round serves every unrolled chunk.
  int const rows_per_pass = threads / chunks_per_row;
  int tile_m, block_n;
  p.order.block(step, tile_m, block_n);
  int const col0 = block_n * p.tiles_per_block * kTileN;
  int64_t const src0 = slot + (p.part_row0 + int64_t(tile_m) * kTileM) * p.n + p.part_col0 + col0;
  int64_t const dst0 = int64_t(tile_m) * kTileM * p.out_cols + col0;
  int64_t const src_pass = int64_t(rows_per_pass) * p.n, dst_pass = int64_t(rows_per_pass) * p.out_cols;

  for (int base = thread; base < chunks; base += threads * kUnroll) {
    int const row = base / chunks_per_row, col = (base % chunks_per_row) * kChunkElems;
    int64_t const src = src0 + int64_t(row) * p.n + col;
    uint4 v[kUnroll][W];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * threads < chunks) {
#pragma unroll
        for (int s = 0; s < W; ++s) v[u][s] = ptx::load_cg_16(static_cast<const Element*>(p.args.partial[s]) + src + u * src_pass);
      }
    }
    Element* const dst = static_cast<Element*>(p.args.out) + dst0 + int64_t(row) * p.out_cols + col;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * threads >= chunks) continue;
      float2 acc[4];
      uint32_t const* first = reinterpret_cast<uint32_t const*>(&v[u][0]);
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[j] = Pack<kDType>::to_float2(first[j]);
#pragma unroll
      for (int s = 1; s < W; ++s) {
        uint32_t const* next = reinterpret_cast<uint32_t const*>(&v[u][s]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float2 f = Pack<kDType>::to_float2(next[j]);
          acc[j].x += f.x;
          acc[j].y += f.y;
        }
      }
      uint4 out;
      out.x = Pack<kDType>::from_float2(acc[0]);
      out.y = Pack<kDType>::from_float2(acc[1]);
      out.z = Pack<kDType>::from_float2(acc[2]);
      out.w = Pack<kDType>::from_float2(acc[3]);
      *reinterpret_cast<uint4*>(dst + u * dst_pass) = out;
    }
  }
}

// Lane l < W * tiles_per_block of the calling warp waits for the release of (source l % W, tile
// l / W of the step's block). Returns whether every release arrived (false: the CTA must leave).
template <int W>
__device__ bool wait_step(Params const& p, const uint64_t* flags, uint64_t epoch, int step, int lane) {
  bool ok = true;
  if (lane < W * p.tiles_per_block) {
    int tile_m, block_n;
    p.order.block(step, tile_m, block_n);
    int const source = lane % W;
    int const tile = tile_m * p.tiles_n + block_n * p.tiles_per_block + lane / W;
    ok = wait_flag(flags + int64_t(source) * p.tiles + tile, epoch, p, source, tile);
  }
  return __all_sync(0xffffffffu, ok);
}

// One step = one producer block (its tiles are released together), in production order, so the
// first tiles reduced are the first ones released and each wait and fence is paid once per block.
//
// Warp 0 only waits: it acquires the releases of step i+1 while the other `consumer_block` threads
// (the data threads) still load and sum step i, so the flag round trip and the system fence leave
// the data path. Handshake per step i, on named barriers of parity s = i % 2:
//   warp 0:  wait flags(i) -> [i >= 2: sync kStepFree+s] -> leave[s] = !ok -> arrive kStepReady+s
//   data:    sync kStepReady+s -> read leave[s] -> [i+2 < steps: arrive kStepFree+s] -> reduce(i)
// kStepFree keeps warp 0 from reusing barrier s and leave[s] before the data threads passed step
// i-2; the barrier pair carries the acquire from warp 0 to the data threads (arrive/sync
// synchronise at CTA scope).
constexpr int kStepReady = 1;  // +parity: ids 1, 2
constexpr int kStepFree = 3;   // +parity: ids 3, 4
constexpr int kWaiterThreads = 32;

template <DType kDType, int W>
__global__ void __launch_bounds__(kMaxBlock + kWaiterThreads) consumer_kernel(__grid_constant__ const Params p) {
  using Element = typename Pack<kDType>::Element;
  __shared__ uint32_t leave[2];
  int const steps = p.tiles / p.tiles_per_block;
  int const my_steps = int(blockIdx.x) < steps ? (steps - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x) : 0;
  int const threads = int(blockDim.x);                 // waiter warp + data threads
  int const data_threads = threads - kWaiterThreads;
  // The call's epoch and its parity's flags and partial slot (CallEpoch).
  uint64_t const epoch = ptx::load_relaxed_sys(p.args.call.epoch);
  int64_t const parity = int64_t(epoch & 1);
  int64_t const slot = parity * p.args.call.slot_stride / int64_t(sizeof(Element));  // in elements

  if (threadIdx.x < kWaiterThreads) {
    const uint64_t* flags = p.args.flags + parity * p.args.call.flags_stride;
    for (int i = 0; i < my_steps; ++i) {
      int const s = i & 1;
      bool const ok = wait_step<W>(p, flags, epoch, int(blockIdx.x) + i * int(gridDim.x), int(threadIdx.x));
      if (i >= 2) ptx::named_barrier_sync(kStepFree + s, threads);
      if (threadIdx.x == 0) ptx::store_shared_word(&leave[s], !ok);
      ptx::named_barrier_arrive(kStepReady + s, threads);
      if (!ok) break;
    }
  } else {
    for (int i = 0; i < my_steps; ++i) {
      int const s = i & 1;
      ptx::named_barrier_sync(kStepReady + s, threads);
      if (ptx::load_shared_word(&leave[s])) break;
      if (i + 2 < my_steps) ptx::named_barrier_arrive(kStepFree + s, threads);
      reduce_step<kDType, W>(p, slot, int(blockIdx.x) + i * int(gridDim.x), int(threadIdx.x) - kWaiterThreads,
                              data_threads);
    }
  }
  // This grid completes after the GEMM's, whose CTAs are all resident by now and never wait for
  // this one: XLA's next work sees both kernels' writes (a no-op when launched plainly).
  ptx::wait_primary();
  if (p.args.end.done == nullptr) return;
  // The folded end: every thread's writes of y fenced; the consumer's last CTA checks for a failure
  // and poisons y; then this CTA's arrival at the call's end.
  __shared__ int last, failed;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = comm::arrive(p.args.consumers_done, gridDim.x);
    failed = last && comm::end_failed(p.args.end);
  }
  __syncthreads();
  if (failed) comm::poison_outputs(p.args.end, int(threadIdx.x), threads);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 && comm::arrive(p.args.end.done, p.args.end.expected)) comm::advance_epoch(p.args.end);
}

// `dependent`: as the programmatic dependent of the stream's previous kernel (the GEMM).
template <DType kDType, int W>
cudaError_t launch_world(Params const& p, int grid, int block, cudaStream_t stream, bool dependent) {
  cudaLaunchAttribute attr = ptx::programmatic_dependent();
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block + kWaiterThreads);
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&config, consumer_kernel<kDType, W>, p);
}

// Runs the plan's consumer: its block order, its grid and block from the config.
template <DType kDType>
cudaError_t launch_typed(GemmRsPlan const& plan, ConsumerArgs const& args, cudaStream_t stream, bool dependent) {
  ProblemShape const& shape = plan.shape;
  Params p{args,
           shape.n,
           shape.part_cols(),
           shape.part_row0(shape.rank),
           shape.part_col0(shape.rank),
           shape.part_cols() / kTileN,
           plan.tiles_per_partition,
           shape.rank,
           plan.order,
           int(plan.config.block_n) / kTileN};
  int const grid = int(plan.config.consumer_grid), block = int(plan.config.consumer_block);
  switch (shape.world) {
    case 1: return launch_world<kDType, 1>(p, grid, block, stream, dependent);
    case 2: return launch_world<kDType, 2>(p, grid, block, stream, dependent);
    case 3: return launch_world<kDType, 3>(p, grid, block, stream, dependent);
    case 4: return launch_world<kDType, 4>(p, grid, block, stream, dependent);
    case 5: return launch_world<kDType, 5>(p, grid, block, stream, dependent);
    case 6: return launch_world<kDType, 6>(p, grid, block, stream, dependent);
    case 7: return launch_world<kDType, 7>(p, grid, block, stream, dependent);
    case 8: return launch_world<kDType, 8>(p, grid, block, stream, dependent);
    default: return cudaErrorInvalidValue;
  }
}

template <DType kDType>
cudaError_t prepare_typed() {
  // cudaFuncGetAttributes forces the module load now, not while a peer's consumer spins.
  cudaFuncAttributes attr;
  cudaError_t err = cudaSuccess;
  auto load = [&](auto kernel) {
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, kernel);
  };
  load(consumer_kernel<kDType, 1>);
  load(consumer_kernel<kDType, 2>);
  load(consumer_kernel<kDType, 3>);
  load(consumer_kernel<kDType, 4>);
  load(consumer_kernel<kDType, 5>);
  load(consumer_kernel<kDType, 6>);
  load(consumer_kernel<kDType, 7>);
  load(consumer_kernel<kDType, 8>);
  return err;
}

}  // namespace entwine::consumer

namespace entwine {

cudaError_t launch_consumer(DType dtype, GemmRsPlan const& plan, ConsumerArgs const& args, cudaStream_t stream,
                            bool dependent) {
  switch (dtype) {
    case DType::kBF16: return consumer::launch_typed<DType::kBF16>(plan, args, stream, dependent);
    case DType::kFP16: return consumer::launch_typed<DType::kFP16>(plan, args, stream, dependent);
  }
  return cudaErrorInvalidValue;
}

cudaError_t prepare_consumer_kernels() {
  cudaError_t err = consumer::prepare_typed<DType::kBF16>();
  return err != cudaSuccess ? err : consumer::prepare_typed<DType::kFP16>();
}

}  // namespace entwine
