// Stock CUTLASS 3.x SM90 GEMMs (bf16, x row-major [M, K], w row-major [K, N], fp32 accumulation),
// timed like the harness times the producer: 20 warm-up launches, then the median over 15 batches
// of 20 back-to-back launches, and the steady state (~1 s back to back), on hashed random inputs
// (zero-filled inputs draw less power and run at a higher clock: they read up to 19% faster and are
// not a valid reference).
// One schedule per binary:
//   nvcc -O3 -DNDEBUG -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -DCUTLASS_ENABLE_GDC_FOR_SM90=0 \
//     -I<cutlass>/include -I<cutlass>/tools/util/include -DPINGPONG=1 -DCLUSTER_M=2 -DTILE_N=128 \
//     scripts/cutlass_reference.cu -o cutlass_pp_2x1
// (<cutlass> = the nvidia-cutlass wheel's cutlass_library/source). PINGPONG=0 builds the cooperative
// schedule; CLUSTER_M=2 pairs CTAs along M and multicasts w's tiles. TRANSPOSED=1 computes the same y
// as y^T = w^T x^T (cuBLAS's view of row-major operands): the tile is TILE_M columns of y by TILE_N
// rows, w is the M-major A operand and x the K-major B operand.
// ENTWINE=1 (with PINGPONG=1 TRANSPOSED=1 TILE_N=192, no cluster) keeps the stock ping-pong kernel and
// adds the Entwine producer's two costs, to measure them on the core that passes 0.97x: a tile
// scheduler that interleaves the W row partitions (raster groups of ENTWINE_RASTER block rows,
// env, default 8), and an epilogue node whose end() publishes the block like the library's
// producer (bulk-store completion, proxy fence, one system fence, relaxed system-scope flags; the
// 128-row tile shared by a pair of 192-row blocks is published by the second of the pair through a
// per-pair counter). Each shape runs the variants listed in main() (PERF v20): plain raster,
// interleaved, + flags, + flags published one block late, the store wait alone or with the system
// fence, partition 1's order rotated by half a partition, and partitions alternating every two
// blocks. W = 2; partition q's blocks are block rows [q*P, (q+1)*P),
// P = ceil(M/2/192), so at M/2 = 8192 the last block of a partition straddles the next one: right
// for timing, not a library layout. ENTWINE_STOCK_SCHEDULER=1 / ENTWINE_STOCK_FUSION=1 swap one of
// the two pieces back to stock's.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

using namespace cute;
using Element = cutlass::bfloat16_t;
#ifndef ENTWINE
#define ENTWINE 0
#endif
#if ENTWINE
constexpr int kEntwineWorld = 2;  // partitions (W)

// What end() does after a block's last bulk store (see Publish below).
enum PublishMode : int {
  kNoPublish,     // nothing
  kPublish,       // wait for the block's stores, then publish it
  kDeferred,      // publish the warpgroup's previous block instead (its stores are long complete)
  kWaitOnly,      // diagnostic: the wait alone
  kWaitAndFence,  // diagnostic: the wait and the system fence, no counter or flags
};

// What the scheduler and the publishing epilogue read: set with cudaMemcpyToSymbol before a run.
struct EntwineRun {
  int world, rank, raster, part_blocks, m_blocks;  // part_blocks: block rows (192 rows of y) per partition
  int interleave;  // 0: partitions one after the other; 1: alternating every block; 2: every two blocks
  PublishMode publish;
  int rotate;  // blocks: partition q's order starts q * rotate blocks in (kDeferred assumes 0)
  uint64_t epoch;
  uint64_t* flags;     // one per 128x128 tile: [tile row][m block]
  uint32_t* counters;  // one per pair of 192-row blocks: [pair][m block]
};
__constant__ EntwineRun kRun;

// Logical block p -> its (m block, n block), in the Entwine order (see the scheduler below).
__device__ void entwine_block_coord(int p, int& m_block, int& n_block) {
  int const per_part = kRun.part_blocks * kRun.m_blocks;
  int const run = kRun.interleave == 2 ? 2 : 1, r = p / run;
  int const q = kRun.interleave ? (r % kRun.world + kRun.rank + 1) % kRun.world : p / per_part;
  int i = kRun.interleave ? r / kRun.world * run + p % run : p % per_part;
  i = (i + q * kRun.rotate) % per_part;  // partition q starts kRun.rotate blocks into its order
  int const per_group = kRun.raster * kRun.m_blocks, group = i / per_group, j = i % per_group;
  int const rows = min(kRun.raster, kRun.part_blocks - group * kRun.raster);
  m_block = j / rows;
  n_block = q * kRun.part_blocks + group * kRun.raster + j % rows;
}

// The persistent scheduler with the Entwine order. The GEMM's M blocks are y's 128-column blocks, its
// N blocks y's 192-row blocks. Block p goes to partition (p + rank + 1) mod W; inside a partition,
// raster groups of `raster` block rows are walked column by column, rows fastest.
class EntwineScheduler : public cutlass::gemm::kernel::detail::StaticPersistentTileScheduler<EntwineScheduler> {
  using Base = cutlass::gemm::kernel::detail::StaticPersistentTileScheduler<EntwineScheduler>;

 public:
  using Base::Base;
  using Params = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;
  using RasterOrder = typename Params::RasterOrder;
  using RasterOrderOptions = typename Params::RasterOrderOptions;
  using Arguments = typename Base::Arguments;
  static constexpr bool IsDynamicPersistent = false;
  using Pipeline = cutlass::PipelineEmpty;
  using PipelineStorage = typename Pipeline::SharedStorage;
  using ThrottlePipeline = cutlass::PipelineEmpty;
  using ThrottlePipelineStorage = typename ThrottlePipeline::SharedStorage;
  struct CLCResponse {};
  class SharedStorage {
   public:
    CUTLASS_DEVICE PipelineStorage pipeline() { return PipelineStorage{}; }
    CUTLASS_DEVICE ThrottlePipelineStorage throttle_pipeline() { return ThrottlePipelineStorage{}; }
    CUTLASS_DEVICE CLCResponse* data() { return nullptr; }
  };

  static CUTLASS_DEVICE cute::tuple<int32_t, int32_t> get_work_idx_m_and_n(
      uint64_t p, cutlass::FastDivmodU64Pow2 const&, cutlass::FastDivmodU64Pow2 const&, cutlass::FastDivmodU64 const&,
      int32_t, RasterOrder) {
    int m_block, n_block;
    entwine_block_coord(int(p), m_block, n_block);
    return {m_block, n_block};
  }

  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const&, ProblemShape, cutlass::KernelHardwareInfo const&, uint32_t,
                                   const uint32_t = 1, uint32_t = 1) {
    return 0;
  }
  template <class ProblemShape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const&, void*, cudaStream_t, ProblemShape,
                                              cutlass::KernelHardwareInfo const&, uint32_t, const uint32_t = 1,
                                              uint32_t = 1, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
};
struct EntwineSchedulerTag {};
namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<EntwineSchedulerTag, ArchTag, TileShape, ClusterShape, Stages> {
  using Scheduler = EntwineScheduler;
};
}  // namespace cutlass::gemm::kernel::detail

// Logical block index p of the block at (m_block, n_block): the inverse of the scheduler's order
// (interleave 0 or 1, rotate 0: the cases kDeferred runs with).
__device__ int entwine_block_index(int m_block, int n_block) {
  int const q = n_block / kRun.part_blocks, row = n_block % kRun.part_blocks, group = row / kRun.raster;
  int const rows = min(kRun.raster, kRun.part_blocks - group * kRun.raster);
  int const i = group * kRun.raster * kRun.m_blocks + m_block * rows + row % kRun.raster;
  return kRun.interleave ? i * kRun.world + (q - kRun.rank - 1 + 2 * kRun.world) % kRun.world
                         : q * kRun.part_blocks * kRun.m_blocks + i;
}

// Publishes a block whose bulk stores are complete: proxy fence, the pair's counter (GPU-scope
// acquire-release), one system fence, then the flags of its own tile and, for the second of the
// pair, of the shared middle tile.
__device__ void entwine_publish(int m_block, int n_block) {
  int const pair = n_block / 2, own = 3 * pair + (n_block % 2 ? 2 : 0);
  asm volatile("fence.proxy.async.global;" ::: "memory");
  uint32_t* counter = kRun.counters + size_t(pair) * kRun.m_blocks + m_block;
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  uint64_t* flags = kRun.flags + m_block;
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(flags + size_t(own) * kRun.m_blocks), "l"(kRun.epoch) : "memory");
  if (old & 1)  // the second of the pair: the shared middle tile is complete
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(flags + size_t(3 * pair + 1) * kRun.m_blocks), "l"(kRun.epoch) : "memory");
}

// Bulk-store groups one block's epilogue commits per issuing thread (checked against the
// collective's epilogue tile below).
constexpr int kEpilogueSubtiles = 12;

// The epilogue's output conversion plus the publication in end(), which the collective calls after
// it has issued the block's last bulk store. Warp 0 of the math warpgroup issued the stores, so its
// lanes wait for their completion (wait_group, not .read). kDeferred: wait_group kEpilogueSubtiles
// leaves this block's groups pending, and the warpgroup's last block is published at once.
struct Publish : cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, Element, float,
                                                         cutlass::FloatRoundStyle::round_to_nearest> {
  using Base = cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, Element, float,
                                                       cutlass::FloatRoundStyle::round_to_nearest>;
  using Base::Base;
  struct ConsumerStoreCallbacks : Base::ConsumerStoreCallbacks {
    int m_block, n_block, thread_idx;
    CUTLASS_DEVICE ConsumerStoreCallbacks(Params const& params, int m, int n, int t)
        : Base::ConsumerStoreCallbacks(params), m_block(m), n_block(n), thread_idx(t) {}
    CUTLASS_DEVICE void end() {
      if (kRun.publish == kNoPublish || thread_idx >= 32) return;
      if (kRun.publish != kDeferred) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        __syncwarp();
        if (thread_idx == 0 && kRun.publish == kPublish) entwine_publish(m_block, n_block);
        if (thread_idx == 0 && kRun.publish == kWaitAndFence) asm volatile("fence.acq_rel.sys;" ::: "memory");
        return;
      }
      int const grid = int(gridDim.x * gridDim.y * gridDim.z);
      int const p = entwine_block_index(m_block, n_block);
      int const total = kRun.part_blocks * kRun.world * kRun.m_blocks;
      bool const last = p + 2 * grid >= total;
      if (last)
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      else
        asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kEpilogueSubtiles) : "memory");
      __syncwarp();
      if (thread_idx != 0) return;
      // The warpgroup's blocks are p, p + 2 grid, ... (the ping-pong's two warpgroups alternate).
      if (p >= 2 * grid) {
        int m_prev, n_prev;
        entwine_block_coord(p - 2 * grid, m_prev, n_prev);
        entwine_publish(m_prev, n_prev);
      }
      if (last) entwine_publish(m_block, n_block);
    }
  };
  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    return ConsumerStoreCallbacks(this->params, int(get<0>(args.tile_coord_mnkl)), int(get<1>(args.tile_coord_mnkl)), args.thread_idx);
  }
};
#if ENTWINE_STOCK_FUSION  // diagnostics: stock epilogue, or stock scheduler
using Fusion = cutlass::epilogue::fusion::LinearCombination<Element, float>;
#else
using Fusion = cutlass::epilogue::fusion::Sm90EVT<Publish, cutlass::epilogue::fusion::Sm90AccFetch>;
#endif
#if ENTWINE_STOCK_SCHEDULER
using SchedulerTag = void;
#else
using SchedulerTag = EntwineSchedulerTag;
#endif
#else
using Fusion = cutlass::epilogue::fusion::LinearCombination<Element, float>;
using SchedulerTag = void;
#endif
#ifndef TRANSPOSED
#define TRANSPOSED 0
#endif
#ifndef TILE_M
#define TILE_M 128
#endif
using TileShape = Shape<Int<TILE_M>, Int<TILE_N>, _64>;
#if TRANSPOSED
using LayoutA = cutlass::layout::ColumnMajor;  // w: [K, N] row-major is w^T [N, K] M-major
using LayoutB = cutlass::layout::ColumnMajor;  // x: [M, K] row-major is x^T [K, M] K-major
using LayoutD = cutlass::layout::ColumnMajor;  // y: [M, N] row-major is y^T [N, M] column-major
#else
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::RowMajor;
using LayoutD = cutlass::layout::RowMajor;
#endif
#ifndef CLUSTER_N
#define CLUSTER_N 1
#endif
using ClusterShape = Shape<Int<CLUSTER_M>, Int<CLUSTER_N>, _1>;
#if PINGPONG
using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    Element, LayoutD, 8, Element, LayoutD, 8, EpilogueSchedule, Fusion>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    Element, LayoutA, 8, Element, LayoutB, 8, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;
#if ENTWINE
static_assert(TILE_M / size<0>(typename Epilogue::EpilogueTile{}) * (TILE_N / size<1>(typename Epilogue::EpilogueTile{})) == kEpilogueSubtiles,
              "kEpilogueSubtiles: one bulk-store group per epilogue subtile");
#endif
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, SchedulerTag>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

// Values in [-1, 1) from a hash of the index.
__global__ void fill_random(Element* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = Element(float(int(h & 0xffff) - 32768) / 32768.0f);
  }
}

// Checks y after a run that followed a poisoning memset (0xFF bytes: NaN): counts entries still NaN
// and the largest error of 512 sampled entries against an fp32 dot product.
__global__ void check_y(Element const* x, Element const* w, Element const* y, int m, int n, int k,
                        unsigned long long* nan_count, float* max_err) {
  size_t const total = size_t(m) * n;
  unsigned long long nans = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x)
    nans += isnan(float(y[i]));
  atomicAdd(nan_count, nans);
  if (blockIdx.x == 0 && threadIdx.x < 512) {
    uint32_t h = (threadIdx.x + 1) * 2654435761u;
    h ^= h >> 15;
    int const row = int(h % uint32_t(m)), col = int((h / 7) % uint32_t(n));
    float ref = 0;
    for (int kk = 0; kk < k; ++kk) ref += float(x[size_t(row) * k + kk]) * float(w[size_t(kk) * n + col]);
    atomicMax(reinterpret_cast<int*>(max_err), __float_as_int(fabsf(ref - float(y[size_t(row) * n + col]))));
  }
}

// Median of 15 batches of 20 launches, then the steady state under the power cap, as
// `entwine_harness energy` measures the producer and cuBLASLt: back to back for ~1 s after a ~0.3 s ramp.
static void time_gemm(Gemm& gemm, char const* label, int m, int n, int k) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 20; ++i) gemm.run();
  std::vector<float> ms;
  for (int batch = 0; batch < 15; ++batch) {
    cudaEventRecord(start);
    for (int i = 0; i < 20; ++i) gemm.run();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t / 20);
  }
  std::sort(ms.begin(), ms.end());
  int const ramp = int(300.0f / ms[ms.size() / 2]) + 1, timed = int(1000.0f / ms[ms.size() / 2]) + 1;
  for (int i = 0; i < ramp; ++i) gemm.run();
  cudaEventRecord(start);
  for (int i = 0; i < timed; ++i) gemm.run();
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float steady = 0;
  cudaEventElapsedTime(&steady, start, stop);
  std::printf("%s%s %dx%d cluster %dx%d%s %dx%dx%d: %.4f ms batches, %.4f ms steady (%s)\n", PINGPONG ? "pingpong" : "cooperative",
              TRANSPOSED ? " transposed" : "", TILE_M, TILE_N, CLUSTER_M, CLUSTER_N, label, m, n, k, ms[ms.size() / 2],
              steady / timed, cudaGetErrorString(cudaGetLastError()));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

int main() {
  int const shapes[][3] = {{16384, 8192, 1024}, {8192, 8192, 1024}, {4096, 8192, 1024}, {16384, 16384, 2048}};
  for (auto const& s : shapes) {
    int const m = s[0], n = s[1], k = s[2];
#if ENTWINE
    // The scheduler's partitions must tile the GEMM's block rows exactly.
    if ((m / kEntwineWorld + TILE_N - 1) / TILE_N * kEntwineWorld != (m + TILE_N - 1) / TILE_N) {
      std::printf("%dx%dx%d: W * ceil(M/W/192) != ceil(M/192), skipped\n", m, n, k);
      continue;
    }
#endif
    Element *x, *w, *y;
    cudaMalloc(&x, size_t(m) * k * sizeof(Element));
    cudaMalloc(&w, size_t(k) * n * sizeof(Element));
    cudaMalloc(&y, size_t(m) * n * sizeof(Element));
    fill_random<<<1024, 256>>>(x, size_t(m) * k, 1);
    fill_random<<<1024, 256>>>(w, size_t(k) * n, 2);
#if TRANSPOSED
    int const gm = n, gn = m;  // the GEMM's own M and N
    Element *a = w, *b = x;
#else
    int const gm = m, gn = n;
    Element *a = x, *b = w;
#endif
    auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(gm, k, 1));
    auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(gn, k, 1));
    auto stride_y = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(gm, gn, 1));
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    typename Epilogue::FusionCallbacks::Arguments fusion{};
#if !ENTWINE || ENTWINE_STOCK_FUSION
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;
#endif
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {gm, gn, k, 1}, {a, stride_a, b, stride_b},
                                  {fusion, y, stride_y, y, stride_y}, hw};
    Gemm gemm;
    void* workspace = nullptr;
    if (size_t bytes = Gemm::get_workspace_size(args)) cudaMalloc(&workspace, bytes);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess || gemm.initialize(args, workspace) != cutlass::Status::kSuccess) {
      std::printf("%dx%dx%d: CUTLASS cannot run this configuration\n", m, n, k);
      return 1;
    }
    unsigned long long* nan_count;
    float* max_err;
    cudaMalloc(&nan_count, sizeof(unsigned long long));
    cudaMalloc(&max_err, sizeof(float));
#if ENTWINE
    static_assert(TRANSPOSED && PINGPONG && TILE_M == 128 && TILE_N == 192 && CLUSTER_M == 1 && CLUSTER_N == 1,
                  "ENTWINE=1 is the transposed 128x192 ping-pong without clusters");
    int const world = kEntwineWorld, part_blocks = (m / world + TILE_N - 1) / TILE_N, m_blocks = n / TILE_M;
    char const* raster_env = std::getenv("ENTWINE_RASTER");
    int const raster = raster_env ? std::atoi(raster_env) : 8;
    size_t const tile_rows = size_t(part_blocks) * world * 3 / 2 + 2, pairs = size_t(part_blocks) * world / 2 + 1;
    EntwineRun run{world, 0, raster, part_blocks, m_blocks, 0, kNoPublish, 0, 1, nullptr, nullptr};
    cudaMalloc(&run.flags, tile_rows * m_blocks * sizeof(uint64_t));
    cudaMalloc(&run.counters, pairs * m_blocks * sizeof(uint32_t));
    cudaMemset(run.flags, 0, tile_rows * m_blocks * sizeof(uint64_t));
    cudaMemset(run.counters, 0, pairs * m_blocks * sizeof(uint32_t));
    int const half = part_blocks / 2 * m_blocks;  // a rotation by half a partition, in whole block rows
    struct Variant {
      int interleave;
      PublishMode publish;
      int rotate;
      char const* name;
    };
    Variant const variants[] = {
        {0, kNoPublish, 0, "plain"},
        {1, kNoPublish, 0, "inter"},
        {1, kPublish, 0, "inter+flags"},
        {1, kDeferred, 0, "inter+deferred flags"},
        {1, kWaitOnly, 0, "inter+wait"},
        {1, kWaitAndFence, 0, "inter+wait+sysfence"},
        {1, kNoPublish, half, "inter"},
        {1, kPublish, half, "inter+flags"},
        {2, kNoPublish, 0, "inter"},
        {2, kPublish, 0, "inter+flags"},
    };
    for (Variant const& v : variants) {
      run.interleave = v.interleave;
      run.publish = v.publish;
      run.rotate = v.rotate;
      cudaMemcpyToSymbol(kRun, &run, sizeof(run));
      char label[64];
      std::snprintf(label, sizeof label, " r%d%s%s %s", raster, v.rotate ? " rotated" : "",
                    v.interleave == 2 ? " runs of 2" : "", v.name);
#else
    {
      char const* label = "";
#endif
      cudaMemset(y, 0xFF, size_t(m) * n * sizeof(Element));
      cudaMemset(nan_count, 0, sizeof(unsigned long long));
      cudaMemset(max_err, 0, sizeof(float));
      gemm.run();
      check_y<<<1024, 512>>>(x, w, y, m, n, k, nan_count, max_err);
      unsigned long long nans = 0;
      float err = 0;
      cudaMemcpy(&nans, nan_count, sizeof nans, cudaMemcpyDeviceToHost);
      cudaMemcpy(&err, max_err, sizeof err, cudaMemcpyDeviceToHost);
      std::printf("check%s %dx%dx%d: %llu entries unwritten, max error of 512 samples %.4f\n", label, m, n, k, nans, err);
      time_gemm(gemm, label, m, n, k);
    }
#if ENTWINE
    uint64_t flag0 = 0;
    cudaMemcpy(&flag0, run.flags, sizeof flag0, cudaMemcpyDeviceToHost);
    std::printf("flag of tile 0 after the runs: %llu (expected 1)\n", (unsigned long long)flag0);
    cudaFree(run.flags);
    cudaFree(run.counters);
#endif
    cudaFree(nan_count);
    cudaFree(max_err);
    cudaFree(x);
    cudaFree(w);
    cudaFree(y);
    if (workspace) cudaFree(workspace);
  }
  return 0;
}
