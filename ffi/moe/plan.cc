// moe_dispatch_gemm's plan (static capacity): the config's rules and the shape rules of its
// kernels in one place, and the loading of every kernel module of the op at setup.
#include "moe/moe.h"

namespace entwine {

namespace {

// The SM push's grid (plan->push_grid) for plan->slice_bytes and plan->e_local: it splits each
// segment over the CTAs of a destination's group, kMoePushThreads 16-byte vectors at a time, so a
// CTA beyond one vector per thread of a segment, for every peer, would only wait and count; one
// counter per (expert, peer). A violated rule, or nullptr.
const char* plan_push(int32_t world, int64_t push_sms, MoePlan* plan) {
  int32_t const peers = world - 1;
  if (push_sms <= 0 || peers == 0) return nullptr;
  if (int64_t(plan->e_local) * peers > kMoePushCounters) {
    return "the SM push counts arrivals per (local expert, peer): E_local * (world - 1) <= 1024";
  }
  int64_t const vectors = plan->slice_bytes / 16;
  int64_t const useful = (vectors + kMoePushThreads - 1) / kMoePushThreads * peers;
  plan->push_grid = int32_t(push_sms < useful ? push_sms : useful);
  return nullptr;
}

}  // namespace

MoePlan moe_transfer_plan(int32_t world, int32_t rank, int32_t experts, int32_t capacity, int64_t row_bytes,
                          int64_t push_sms) {
  MoePlan plan{};
  plan.config = MoeConfig{128, 0, 1, push_sms};
  plan.shape = MoeProblem{world, rank, experts, capacity, int32_t(row_bytes), 0, DType::kBF16};
  auto fail = [&](const char* rule) {
    plan.error = rule;
    return plan;
  };
  if (world < 1 || world > kMaxWorld) return fail("world size must be in [1, 8]");
  if (rank < 0 || rank >= world) return fail("rank must be in [0, world)");
  if (push_sms < 0 || push_sms > 64) return fail("config.push_sms must be in [0, 64]");
  if (experts < 1 || experts % world != 0) return fail("experts must be a positive multiple of world");
  if (capacity <= 0 || row_bytes <= 0) return fail("capacity and the rows' bytes must be positive");
  // The SM push moves 16-byte vectors, and every segment starts 16-byte aligned.
  if ((int64_t(capacity) * row_bytes) % 16 != 0) return fail("a segment (capacity rows) must be a multiple of 16 bytes");
  if (row_bytes >= (int64_t(1) << 31)) return fail("a row of 2^31 bytes or more");
  plan.e_local = experts / world;
  plan.slice_bytes = int64_t(capacity) * row_bytes;
  plan.inbox_bytes = int64_t(plan.e_local) * world * plan.slice_bytes;
  plan.flags = int64_t(world) * plan.e_local;
  if (const char* rule = plan_push(world, push_sms, &plan)) return fail(rule);
  // The receiver's wait kernel, and the push's CTAs or the copy engines' release kernels.
  plan.sms_needed = 1 + (plan.push_grid > 0 ? plan.push_grid : 1);
  return plan;
}

namespace {

// The rules and the GEMM's geometry both GEMMs share (the dispatch's over the pool, the combine's
// over h): every block's rows lie in one (source, expert) segment of C rows, a multiple of 128. Sets
// the plan's GEMM fields; returns the violated rule, or nullptr.
const char* plan_gemm(const MoeProblem& p, const MoeConfig& c, MoePlan* plan) {
  if (p.world < 1 || p.world > kMaxWorld) return "world size must be in [1, 8]";
  if (p.rank < 0 || p.rank >= p.world) return "rank must be in [0, world)";
  if (c.block_n != 128 && c.block_n != 256) return "config.block_n must be 128 or 256";
  if (is_fp8(p.input) && c.block_n != kFp8BlockN) return "FP8 operands run 128-wide blocks: config.block_n = 128";
  // Every GEMM CTA may wait (a segment, or a source's announcement) holding its SM: the grid is
  // persistent, and the caller checks that plan.sms_needed fits the GPU.
  if (c.gemm_sms < 1) return "config.gemm_sms must be >= 1";
  if (c.raster_rows < 1) return "config.raster_rows must be >= 1";
  if (p.experts < 1 || p.experts % p.world != 0) return "experts must be a positive multiple of world";
  if (p.capacity <= 0 || p.k <= 0 || p.n <= 0) return "capacity, K and N must be positive";
  // One flag (or one destination) per block: a block never straddles two sources' rows.
  if (p.capacity % kBlockM != 0) return "capacity % 128 == 0 (a GEMM block must not straddle two sources' rows)";
  if (p.k % align_k(p.input) != 0) return "K must make 16-byte rows (K % 8 == 0 for 16-bit inputs, % 16 for FP8; TMA)";
  // The store warp writes whole blocks at the output's row pitch n.
  if (p.n % c.block_n != 0) return "N must be a multiple of config.block_n";
  plan->e_local = p.experts / p.world;
  // int32 coordinates in the kernels (rows of one expert's A, w's rows and columns).
  if (int64_t(p.world) * p.capacity >= (int64_t(1) << 31) || int64_t(p.experts) * p.capacity >= (int64_t(1) << 31)) {
    return "world * capacity (or experts * capacity) is 2^31 rows or more";
  }
  plan->seg_tiles = p.capacity / kBlockM;
  plan->n_blocks = int32_t(p.n / c.block_n);
  plan->k_tiles = (p.k + block_k(p.input) - 1) / block_k(p.input);
  int64_t const blocks = int64_t(plan->e_local) * p.world * plan->seg_tiles * plan->n_blocks;
  if (blocks >= (int64_t(1) << 31)) return "the GEMM has 2^31 blocks or more";
  plan->num_blocks = int32_t(blocks);
  plan->grid = c.gemm_sms < plan->num_blocks ? int32_t(c.gemm_sms) : plan->num_blocks;
  plan->flags = int64_t(p.world) * plan->e_local;
  // The raster runs over a stack of an expert's segments (segment_block: at most W - 1 of them).
  int32_t const stack_tiles = (p.world > 1 ? p.world - 1 : 1) * plan->seg_tiles;
  plan->order = TileOrder{stack_tiles, plan->n_blocks,
                          c.raster_rows < stack_tiles ? int32_t(c.raster_rows) : stack_tiles};
  plan->schedule = WorkSchedule{plan->num_blocks, plan->grid, plan->k_tiles, plan->num_blocks};
  plan->scaling = Scaling::kTensor;
  return nullptr;
}

}  // namespace

MoePlan moe_plan(const MoeProblem& p, const MoeConfig& c) {
  MoePlan plan{};
  plan.config = c;
  plan.shape = p;
  auto fail = [&](const char* rule) {
    plan.error = rule;
    return plan;
  };
  if (c.push_sms < 0 || c.push_sms > 64) return fail("config.push_sms must be in [0, 64]");
  if (const char* rule = plan_gemm(p, c, &plan)) return fail(rule);
  plan.slice_bytes = int64_t(p.capacity) * p.k * element_bytes(p.input);
  plan.inbox_bytes = int64_t(plan.e_local) * p.world * plan.slice_bytes;
  if (const char* rule = plan_push(p.world, c.push_sms, &plan)) return fail(rule);
  // Every GEMM CTA may wait for a segment that only a running push CTA (or, on the copy engines, a
  // one-warp release kernel) releases: they all must be resident at once.
  plan.sms_needed = plan.grid + (plan.push_grid > 0 ? plan.push_grid : 1);
  return plan;
}

MoePlan moe_combine_plan(const MoeProblem& p, const MoeConfig& c) {
  MoePlan plan{};
  plan.config = c;
  plan.shape = p;
  auto fail = [&](const char* rule) {
    plan.error = rule;
    return plan;
  };
  if (const char* rule = plan_gemm(p, c, &plan)) return fail(rule);
  if (int64_t(plan.e_local) * p.world > kMoePushCounters) {
    return fail("the combine counts arrivals per (local expert, source): E_local * world <= 1024");
  }
  // One segment of the output, and o_recv [E, C, H] at every source; the rows are 16-bit (an FP8
  // call's output type is bf16 or fp16).
  plan.slice_bytes = int64_t(p.capacity) * p.n * 2;
  plan.inbox_bytes = int64_t(p.experts) * plan.slice_bytes;
  // The GEMM's store warps wait for sources' announcements, which their own GEMMs make as they
  // start; the receiver's wait kernel follows the GEMM on its stream.
  plan.sms_needed = plan.grid;
  return plan;
}

MoeWgradPlan moe_wgrad_plan(const MoeWgradProblem& p, const MoeConfig& c) {
  MoeWgradPlan plan{};
  plan.config = c;
  plan.shape = p;
  auto fail = [&](const char* rule) {
    plan.error = rule;
    return plan;
  };
  if (is_fp8(p.input)) return fail("the weight gradients' GEMM takes bf16 or fp16 operands");
  if (p.world < 1 || p.world > kMaxWorld) return fail("world size must be in [1, 8]");
  if (c.block_n != 128 && c.block_n != 256) return fail("config.block_n must be 128 or 256");
  if (c.gemm_sms < 1) return fail("config.gemm_sms must be >= 1");
  if (c.raster_rows < 1) return fail("config.raster_rows must be >= 1");
  if (p.e_local < 1 || p.m <= 0 || p.n <= 0) return fail("E_local, M and N must be positive");
  // A segment's first k-tile starts a k-tile (BLOCK_K divides 128), its rows 16-byte aligned (TMA).
  if (p.capacity <= 0 || p.capacity % kBlockM != 0) return fail("capacity % 128 == 0 (a segment of whole k-tiles)");
  // The store warp writes whole 128 x block_n blocks of dw at its row pitch n.
  if (p.m % kBlockM != 0) return fail("M (dw's rows) must be a multiple of 128");
  if (p.n % c.block_n != 0) return fail("N must be a multiple of config.block_n");
  if (int64_t(p.world) * p.capacity >= (int64_t(1) << 31) || int64_t(p.e_local) * p.m >= (int64_t(1) << 31)) {
    return fail("world * capacity (or E_local * M) is 2^31 rows or more");
  }
  plan.seg_k_tiles = p.capacity / block_k(p.input);
  int32_t const m_blocks = p.m / kBlockM, n_blocks = int32_t(p.n / c.block_n);
  int64_t const blocks = int64_t(p.e_local) * m_blocks * n_blocks;
  if (blocks >= (int64_t(1) << 31)) return fail("the GEMM has 2^31 blocks or more");
  plan.order = TileOrder{m_blocks, n_blocks, c.raster_rows < m_blocks ? int32_t(c.raster_rows) : m_blocks};
  // A persistent grid dealing blocks round-robin: every CTA gets blocks of every expert, so its share
  // of the ragged work is near the mean whatever the counts. k_tiles: the most a block can have (the
  // units are whole blocks; the math warps take each block's own count).
  int32_t const grid = c.gemm_sms < blocks ? int32_t(c.gemm_sms) : int32_t(blocks);
  plan.schedule = WorkSchedule{int32_t(blocks), grid, p.world * plan.seg_k_tiles, int32_t(blocks)};
  return plan;
}

namespace moe {

cudaError_t prepare_kernels() {
  cudaError_t err = prepare_gemms();
  if (err == cudaSuccess) err = combine::prepare_gemms();
  if (err == cudaSuccess) err = wgrad::prepare_gemms();
  return err != cudaSuccess ? err : prepare_transfer_kernels();
}

}  // namespace moe

}  // namespace entwine
