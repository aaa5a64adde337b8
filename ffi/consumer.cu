// The consumer: reduces this rank's partition of the W partial outputs, one 128x128 tile at a time,
// each tile as soon as its W producers have released it. Runs on a high-priority stream next to
// the producer GEMM, with a small grid (the communication budget x).
//
//   producer on rank s (any s)                      consumer on rank r (grid x, block b)
//   ─────────────────────────                       ───────────────────────────────────
//   GEMM block -> stores tile t of partition r      CTA j: blocks j, j+x, j+2x, ... (producer order)
//   into V_s[slot] (its own memory)                   threads 0..W-1: spin on flags_r[s][t] >= e
//   bar.sync; fence.acq_rel.sys;                      __syncthreads
//   st.release.sys flags_r[s][t] = e  ──NVLink──▶     16-byte loads of V_0..V_{W-1}[slot] block
//                                                     fp32 sum in rank order, one store to out
//
// Pitfalls:
//  - The waits need a deadline: a peer that never calls must become an error record, not a hang.
//    The first CTA to time out records (rank, source, tile, expected, observed); the others see
//    the record and leave.
//  - Partial data is read with ld.global.cg (L2 only): L1 is not coherent with peer writes and a
//    stale line from the previous epoch would be silently wrong.
//  - All W loads of a chunk are issued before the first add, so the order of issue does not
//    serialise on one peer; the adds run in rank order, which makes results bitwise repeatable.
//  - The grid must stay well below the SM count: consumer CTAs spin while producers still need
//    SMs to make progress.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gemm_rs.h"
#include "ptx.cuh"

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

template <class Element>
struct Pack;
template <>
struct Pack<__nv_bfloat16> {
  static __device__ float2 to_float2(uint32_t v) { return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v)); }
  static __device__ uint32_t from_float2(float2 f) {
    __nv_bfloat162 h = __float22bfloat162_rn(f);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct Pack<__half> {
  static __device__ float2 to_float2(uint32_t v) { return __half22float2(*reinterpret_cast<__half2*>(&v)); }
  static __device__ uint32_t from_float2(float2 f) {
    __half2 h = __float22half2_rn(f);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// Spin until flag >= epoch or the deadline passes. Returns false when the CTA must leave.
// Polls with relaxed system-scope loads and one acquire fence on success (an acquire load per
// iteration is a stronger, costlier access than the poll needs); the error record and the timer
// are looked at only every kCheckEvery polls.
__device__ bool wait_flag(const uint64_t* flag, Params const& p, int source, int tile) {
  constexpr int kCheckEvery = 256;
  uint64_t observed = ptx::load_relaxed_sys(flag);
  if (observed >= p.args.epoch) {
    ptx::fence_acq_rel_sys();
    return true;
  }
  uint64_t const start = ptx::global_timer_ns();
  for (int polls = 1;; ++polls) {
    __nanosleep(64);
    observed = ptx::load_relaxed_sys(flag);
    if (observed >= p.args.epoch) break;
    if (polls % kCheckEvery != 0) continue;
    // Another CTA already recorded a failure (or an earlier call did: the error is sticky).
    if (*reinterpret_cast<volatile uint32_t*>(&p.args.error->code) != 0) return false;
    if (ptx::global_timer_ns() - start > p.args.timeout_ns) {
      // Claim the record, fill it, then publish the code last so a host read that sees the code
      // also sees the fields.
      DeviceError* e = p.args.error;
      if (atomicCAS(&e->code, 0u, kErrorClaimed) == 0u) {
        e->rank = p.rank;
        e->source = source;
        e->tile = tile;
        e->expected = p.args.epoch;
        e->observed = observed;
        __threadfence();
        atomicExch(&e->code, kErrorDeadline);
        // The host reads the mirror without synchronising: fields first, code last.
        if (DeviceError* m = p.args.error_mirror) {
          m->rank = e->rank;
          m->source = source;
          m->tile = tile;
          m->expected = e->expected;
          m->observed = observed;
          __threadfence_system();
          *reinterpret_cast<volatile uint32_t*>(&m->code) = kErrorDeadline;
          __threadfence_system();
        }
      }
      return false;
    }
  }
  // Pairs with the producer's release: the partial tile it published is visible from here on.
  ptx::fence_acq_rel_sys();
  return true;
}

template <class Element, int W>
__global__ void __launch_bounds__(kMaxBlock) consumer_kernel(__grid_constant__ const Params p) {
  // Chunks per thread per round: keep about 16 16-byte loads in flight whatever W is (the reads
  // cross NVLink: ~2 us of latency to cover per CTA).
  constexpr int kUnroll = W >= 8 ? 2 : 16 / W;
  __shared__ int leave;
  if (threadIdx.x == 0) leave = 0;
  __syncthreads();

  // One step = one producer block (tiles_per_block 128x128 tiles released together), in
  // production order, so the first tiles reduced are the first ones released and each wait and
  // fence is paid once per block, not per tile.
  int const steps = p.tiles / p.tiles_per_block;
  int const chunks_per_row = p.tiles_per_block * kChunksPerRow;
  int const chunks = kTileM * chunks_per_row;
  for (int step = blockIdx.x; step < steps; step += gridDim.x) {
    int tile_m, block_n;
    p.order.block(step, tile_m, block_n);
    int const tile0 = tile_m * p.tiles_n + block_n * p.tiles_per_block;
    // One thread per (source rank, tile of the block) waits for that release.
    if (threadIdx.x < W * p.tiles_per_block) {
      int const source = threadIdx.x % W;
      int const tile = tile0 + threadIdx.x / W;
      if (!wait_flag(p.args.flags + int64_t(source) * p.tiles + tile, p, source, tile)) leave = 1;
    }
    // Orders the acquires above before every thread's reads below.
    __syncthreads();
    if (leave) return;

    int const col0 = block_n * p.tiles_per_block * kTileN;
    int64_t const src0 = (p.part_row0 + int64_t(tile_m) * kTileM) * p.n + p.part_col0 + col0;
    int64_t const dst0 = int64_t(tile_m) * kTileM * p.out_cols + col0;

    for (int base = threadIdx.x; base < chunks; base += blockDim.x * kUnroll) {
      uint4 v[kUnroll][W];
      int row[kUnroll], col[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        int const chunk = base + u * blockDim.x;
        row[u] = chunk / chunks_per_row;
        col[u] = (chunk % chunks_per_row) * kChunkElems;
        if (chunk < chunks) {
#pragma unroll
          for (int s = 0; s < W; ++s) {
            v[u][s] = ptx::load_cg_16(static_cast<const Element*>(p.args.partial[s]) + src0 + int64_t(row[u]) * p.n + col[u]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        int const chunk = base + u * blockDim.x;
        if (chunk >= chunks) continue;
        float2 acc[4];
        uint32_t const* first = reinterpret_cast<uint32_t const*>(&v[u][0]);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[j] = Pack<Element>::to_float2(first[j]);
#pragma unroll
        for (int s = 1; s < W; ++s) {
          uint32_t const* next = reinterpret_cast<uint32_t const*>(&v[u][s]);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float2 f = Pack<Element>::to_float2(next[j]);
            acc[j].x += f.x;
            acc[j].y += f.y;
          }
        }
        uint4 out;
        out.x = Pack<Element>::from_float2(acc[0]);
        out.y = Pack<Element>::from_float2(acc[1]);
        out.z = Pack<Element>::from_float2(acc[2]);
        out.w = Pack<Element>::from_float2(acc[3]);
        *reinterpret_cast<uint4*>(static_cast<Element*>(p.args.out) + dst0 + int64_t(row[u]) * p.out_cols + col[u]) = out;
      }
    }
  }
}

template <class Element>
cudaError_t launch_typed(ProblemShape const& shape, GemmRsConfig const& config, ConsumerArgs const& args,
                         cudaStream_t stream) {
  Params p{args,
           shape.n,
           shape.part_cols(),
           shape.part_row0(shape.rank),
           shape.part_col0(shape.rank),
           shape.part_cols() / kTileN,
           shape.tiles_per_partition(),
           shape.rank,
           tile_order(shape, config),
           config.block_n / kTileN};
  dim3 grid(config.consumer_grid), block(config.consumer_block);
  switch (shape.world) {
    case 1: consumer_kernel<Element, 1><<<grid, block, 0, stream>>>(p); break;
    case 2: consumer_kernel<Element, 2><<<grid, block, 0, stream>>>(p); break;
    case 3: consumer_kernel<Element, 3><<<grid, block, 0, stream>>>(p); break;
    case 4: consumer_kernel<Element, 4><<<grid, block, 0, stream>>>(p); break;
    case 5: consumer_kernel<Element, 5><<<grid, block, 0, stream>>>(p); break;
    case 6: consumer_kernel<Element, 6><<<grid, block, 0, stream>>>(p); break;
    case 7: consumer_kernel<Element, 7><<<grid, block, 0, stream>>>(p); break;
    case 8: consumer_kernel<Element, 8><<<grid, block, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <class Element>
cudaError_t prepare_typed() {
  // cudaFuncGetAttributes forces the module load now, not while a peer's consumer spins.
  cudaFuncAttributes attr;
  cudaError_t err = cudaSuccess;
  auto load = [&](auto kernel) {
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, kernel);
  };
  load(consumer_kernel<Element, 1>);
  load(consumer_kernel<Element, 2>);
  load(consumer_kernel<Element, 3>);
  load(consumer_kernel<Element, 4>);
  load(consumer_kernel<Element, 5>);
  load(consumer_kernel<Element, 6>);
  load(consumer_kernel<Element, 7>);
  load(consumer_kernel<Element, 8>);
  return err;
}

}  // namespace entwine::consumer

namespace entwine {

cudaError_t launch_consumer(DType dtype, ProblemShape const& shape, GemmRsConfig const& config,
                            ConsumerArgs const& args, cudaStream_t stream) {
  return dtype == DType::kBF16 ? consumer::launch_typed<__nv_bfloat16>(shape, config, args, stream)
                               : consumer::launch_typed<__half>(shape, config, args, stream);
}

cudaError_t prepare_consumer_kernels() {
  cudaError_t err = consumer::prepare_typed<__nv_bfloat16>();
  return err != cudaSuccess ? err : consumer::prepare_typed<__half>();
}

}  // namespace entwine
