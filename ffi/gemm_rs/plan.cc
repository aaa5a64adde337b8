// gemm_rs's plan: the config's rules, the shape rules of its kernels and the padding that meets
// them, the producer's schedule; and the loading of every gemm_rs kernel module at setup. Every
// shape rule of the op is here, once.
#include "gemm_rs/gemm_rs.h"

namespace entwine {

cudaError_t prepare_consumer_kernels();  // consumer.cu

namespace {

// The config's own rules (whatever the shape): nullptr when they hold, else the violated rule.
const char* check_config(const GemmRsConfig& c) {
  if (c.block_n != 128 && c.block_n != 256) return "config.block_n must be 128 or 256";
  if (c.consumer_block != 128 && c.consumer_block != 256 && c.consumer_block != 512)
    return "config.consumer_block must be 128, 256 or 512";
  // The consumer spins while the producer still needs SMs: its grid stays a small share of the GPU.
  if (c.consumer_grid < 1 || c.consumer_grid > 64) return "config.consumer_grid must be in [1, 64]";
  if (c.producer_sms < 0) return "config.producer_sms must be >= 0";
  if (c.raster_rows < 1) return "config.raster_rows must be >= 1";
  return nullptr;
}

// A split costs a CTA one more block start, 128 KB of fp32 written or read and the wait for the
// other piece: split only when the last wave leaves at least this many k-tiles per CTA idle on
// average. Measured at 15.5 (16384x8192x1024): 0.8% slower; at 27: 0.9% faster; at 31: 2% faster
// (docs/performance.md, "What was tried": the split tail).
constexpr int kSplitMinIdleKTiles = 16;

// The one block order of a call: the producer runs it and the consumer walks it (a raster group
// never spans more tile rows than the partition has).
TileOrder tile_order(const ProblemShape& s, const GemmRsConfig& c) {
  int32_t const m_blocks = s.part_rows() / kTileM;
  int32_t const n_blocks = s.part_cols() / int32_t(c.block_n);
  return TileOrder{m_blocks, n_blocks, c.raster_rows < m_blocks ? int32_t(c.raster_rows) : m_blocks};
}

WorkSchedule producer_schedule(const ProblemShape& s, const GemmRsConfig& c, DType input) {
  TileOrder const order = tile_order(s, c);
  WorkSchedule p{};
  p.num_blocks = s.world * order.m_blocks * order.n_blocks;
  // A persistent grid (the handler resolves producer_sms = 0 to the SMs the consumer leaves; a plan
  // asked without a GPU keeps one CTA per block). The consumer starts once every CTA of it is
  // resident (docs/design.md, "Forward progress"), so a grid of one CTA per block would keep the
  // consumer waiting until the GEMM's last wave.
  p.grid = c.producer_sms > 0 && c.producer_sms < p.num_blocks ? int32_t(c.producer_sms) : p.num_blocks;
  p.k_tiles = (s.k + block_k(input) - 1) / block_k(input);
  // Split tail: whole waves run as before, except the last full one, which joins the partial last
  // wave in the split region, divided evenly in k-tiles over the grid. So every CTA does about
  // (1 + remainder / grid) blocks' work there instead of one or two whole blocks.
  int32_t const remainder = p.num_blocks % p.grid;
  bool const split = c.split_tail && p.grid < p.num_blocks && p.grid - 1 <= kSplitSlots && remainder != 0 &&
                     int64_t(p.grid - remainder) * p.k_tiles >= int64_t(kSplitMinIdleKTiles) * p.grid;
  p.split_first_block = split ? (p.num_blocks / p.grid - 1) * p.grid : p.num_blocks;
  return p;
}

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

GemmRsPlan gemm_rs_plan(const GemmRsProblem& p, const GemmRsConfig& c) {
  GemmRsPlan plan;
  plan.config = c;
  plan.scaling = p.scaling;
  auto fail = [&](const char* rule, bool config_error = false) {
    plan.error = rule;
    plan.config_error = config_error;
    return plan;
  };
  if (const char* rule = check_config(c)) return fail(rule, true);
  if (p.world < 1 || p.world > kMaxWorld) return fail("world size must be in [1, 8]");
  if (p.rank < 0 || p.rank >= p.world) return fail("rank must be in [0, world)");
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) return fail("M, N and K must be positive");
  if (is_fp8(p.input) && c.block_n != kFp8BlockN) {
    return fail("config.block_n must be 128 with FP8 operands (the promoted accumulator of a wider block "
                "does not fit the registers)", true);
  }
  // Block scaling: the mainloop scales whole k-tiles, so K must be whole scale blocks (no padding:
  // the scales' K/128 rows would have to be padded alike); M and N are padded to whole blocks below
  // and the scales with them (x_scale [K/128, padded M], w_scale [padded N/128, K/128]).
  if (p.scaling == Scaling::kBlock) {
    if (!is_fp8(p.input)) return fail("block scaling needs FP8 operands");
    if (p.k % kScaleBlock != 0) return fail("block-scaled FP8 needs K % 128 == 0 (one k-tile per scale block)");
  }
  // Padding: each partition to whole 128 x block_n blocks, on its own, so that partition q of the
  // padded product holds partition q of the real one; K to align_k (16-byte rows). Zeros add nothing.
  // The scattered dimension divides by the world here, and only here: the padded shape then meets
  // every rule of the kernels by construction.
  int64_t m, n;
  if (p.scatter_cols) {
    if (p.n % p.world != 0) return fail("N must be divisible by the world size (the scattered dim)");
    m = round_up(p.m, kTileM);
    n = p.world * round_up(p.n / p.world, c.block_n);
  } else {
    if (p.m % p.world != 0) return fail("M must be divisible by the world size (the scattered dim)");
    m = p.world * round_up(p.m / p.world, kTileM);
    n = round_up(p.n, c.block_n);
  }
  int64_t const k = round_up(p.k, align_k(p.input));
  // The kernels index rows, columns and K with int32.
  if (m >= (int64_t(1) << 31) || n >= (int64_t(1) << 31) || k >= (int64_t(1) << 31)) {
    return fail("a padded dimension of the product is 2^31 or more (the kernels index with int32)");
  }
  plan.shape = ProblemShape{int32_t(m), int32_t(n), int32_t(k), p.world, p.rank, p.scatter_cols};
  plan.order = tile_order(plan.shape, c);
  plan.tiles_per_partition = plan.shape.tiles_per_partition();
  plan.schedule = producer_schedule(plan.shape, c, p.input);
  plan.split = plan.schedule.split_first_block < plan.schedule.num_blocks;
  plan.slot_bytes = m * n * kElementBytes;
  return plan;
}

namespace gemm_rs {

cudaError_t prepare_kernels() {
  cudaError_t err = prepare_gemms();
  return err != cudaSuccess ? err : prepare_consumer_kernels();
}

}  // namespace gemm_rs

}  // namespace entwine
