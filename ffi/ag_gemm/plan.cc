// ag_gemm's plan: the config's rules and the shape rules of its kernels, in one place, and the
// loading of every ag_gemm kernel module at setup.
#include "ag_gemm/ag_gemm.h"

namespace entwine {

namespace {

// A chunk is whole tile rows and every shard has the same chunks: the largest divisor of the
// shard's tile rows that is at most max_chunks (a prime number of tile rows travels in one chunk
// or in one chunk per tile row).
int32_t chunk_count(int32_t tile_rows, int32_t max_chunks) {
  for (int32_t c = max_chunks < tile_rows ? max_chunks : tile_rows; c > 1; --c) {
    if (tile_rows % c == 0) return c;
  }
  return 1;
}

}  // namespace

AgPlan ag_plan(const AgProblem& p, const AgGemmConfig& c) {
  AgPlan plan{};
  plan.config = c;
  auto fail = [&](const char* rule) {
    plan.error = rule;
    return plan;
  };
  if (p.world < 1 || p.world > kMaxWorld) return fail("world size must be in [1, 8]");
  if (p.rank < 0 || p.rank >= p.world) return fail("rank must be in [0, world)");
  if (c.block_n != 128 && c.block_n != 256) return fail("config.block_n must be 128 or 256");
  // One CTA per block could fill every SM with CTAs waiting for chunks whose release kernels (or
  // push CTAs) then find no SM: the grid is persistent, and the handler checks that plan.sms_needed
  // fits the GPU.
  if (c.gemm_sms < 1) return fail("config.gemm_sms must be >= 1");
  if (c.raster_rows < 1) return fail("config.raster_rows must be >= 1");
  if (c.max_chunks < 1 || c.max_chunks > 64) return fail("config.max_chunks must be in [1, 64]");
  if (c.push_sms < 0 || c.push_sms > 64) return fail("config.push_sms must be in [0, 64]");
  if (p.rows <= 0 || p.cols <= 0 || p.n <= 0) return fail("rows, cols and N must be positive");
  bool const fp8 = is_fp8(p.input);
  if (fp8 && c.block_n != kFp8BlockN) {
    return fail("config.block_n must be 128 with FP8 operands (the promoted accumulator of a wider block does "
                "not fit the registers)");
  }
  bool const block_scaled = p.scaling == Scaling::kBlock;
  if (block_scaled) {
    if (!fp8) return fail("block scaling needs FP8 operands");
    if (p.cols % kScaleBlock != 0) {
      return fail("block-scaled FP8 needs cols (each shard's K) % 128 == 0 (one k-tile per scale block)");
    }
  }
  auto round_up = [](int64_t v, int64_t m) { return (v + m - 1) / m * m; };
  int64_t const rows_pad = round_up(p.rows, kBlockM), cols_pad = round_up(p.cols, align_k(p.input)),
                n_pad = round_up(p.n, c.block_n);
  // int32 coordinates in the kernels (the gathered operand's rows, w's rows and columns).
  if (int64_t(p.world) * rows_pad >= (int64_t(1) << 31) || int64_t(p.world) * cols_pad >= (int64_t(1) << 31) ||
      n_pad >= (int64_t(1) << 31)) {
    return fail("the gathered operand has 2^31 rows or columns or more");
  }
  plan.rows_pad = int32_t(rows_pad);
  plan.cols_pad = int32_t(cols_pad);
  plan.n_pad = int32_t(n_pad);
  plan.tile_rows = plan.rows_pad / kBlockM;
  plan.chunks = chunk_count(plan.tile_rows, c.max_chunks);
  plan.chunk_tiles = plan.tile_rows / plan.chunks;
  plan.n_blocks = plan.n_pad / c.block_n;
  plan.k_tiles = (plan.cols_pad + block_k(p.input) - 1) / block_k(p.input);
  plan.num_blocks = (p.gather_k ? 1 : p.world) * plan.tile_rows * plan.n_blocks;
  plan.grid = c.gemm_sms < plan.num_blocks ? int32_t(c.gemm_sms) : plan.num_blocks;
  plan.shard_bytes = rows_pad * cols_pad * element_bytes(p.input);
  plan.scales_offset = p.world * plan.shard_bytes;
  plan.scale_k_blocks = block_scaled ? int32_t(cols_pad / kScaleBlock) : 0;
  int64_t const scale_bytes = block_scaled ? int64_t(plan.scale_k_blocks) * p.world * rows_pad * int64_t(sizeof(float))
                                           : p.world * kScaleSlotBytes;
  plan.inbox_bytes = plan.scales_offset + (fp8 ? scale_bytes : 0);
  // The contraction layout with a scale per shard scales each K slice on its own (gemm.h, kSlice).
  plan.scaling = fp8 && !block_scaled && p.gather_k && !p.shared_scale ? Scaling::kSlice : p.scaling;
  plan.flags = int64_t(p.world) * plan.chunks;
  // The SM push splits each chunk over the CTAs of a peer's group, kPushThreads 16-byte vectors at a
  // time: a CTA beyond one vector per thread of a chunk, for every peer, would only wait and count.
  int64_t const chunk_vectors = plan.shard_bytes / plan.chunks / 16;
  int64_t const useful = (chunk_vectors + kPushThreads - 1) / kPushThreads * (p.world > 1 ? p.world - 1 : 1);
  plan.push_grid = int32_t(c.push_sms < useful ? c.push_sms : useful);
  // Every CTA of the GEMM may wait for a chunk that only a running push CTA (or, on the copy
  // engines, a one-warp release kernel) releases: they all must be resident at once.
  plan.sms_needed = plan.grid + (plan.push_grid > 0 ? plan.push_grid : 1);
  plan.shape = AgProblem{plan.rows_pad, plan.cols_pad, plan.n_pad, p.world, p.rank, p.gather_k, p.input, p.shared_scale,
                         p.scaling};
  plan.order = TileOrder{plan.chunk_tiles, plan.n_blocks,
                         c.raster_rows < plan.chunk_tiles ? int32_t(c.raster_rows) : plan.chunk_tiles};
  // Contraction layout: a block's K loop runs over every source's k-tiles. Nothing splits.
  plan.schedule = WorkSchedule{plan.num_blocks, plan.grid, (p.gather_k ? p.world : 1) * plan.k_tiles,
                               plan.num_blocks};
  return plan;
}

namespace ag_gemm {

cudaError_t prepare_kernels() {
  cudaError_t err = prepare_gemms();
  return err != cudaSuccess ? err : prepare_transfer_kernels();
}

}  // namespace ag_gemm

}  // namespace entwine
