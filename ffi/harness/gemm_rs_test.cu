// gemm_rs on W virtual ranks against float64: `entwine_harness test` (protocol and kernels, W in
// {1,2,4,8}, several epochs, the deadline, CUDA graphs).
#include "harness/gemm_rs_world.h"

namespace entwine::harness {

std::string describe(Case const& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "W=%d M=%d N=%d K=%d %s%s%s scatter=%s block_n=%d producer_sms=%d x=%d b=%d r=%d",
                c.world, c.m, c.n, c.k, c.block_scaled ? "block-scaled " : "", !c.fp8 ? "" : c.x_e5m2 ? "e5m2xe4m3->" : "e4m3->", c.bf16 ? "bf16" : "fp16", c.scatter_cols ? "cols" : "rows", int(c.config.block_n),
                int(c.config.producer_sms), int(c.config.consumer_grid), int(c.config.consumer_block),
                int(c.config.raster_rows));
  return buf;
}

// Several epochs in a row with no resets: fresh inputs and poisoned outputs each epoch, checked
// against float64; then the same inputs again must give bitwise identical outputs.
void run_case(Case const& c, int epochs, bool sequential, bool check_partials) {
  GemmRsPlan const plan = c.plan(0);
  if (plan.error != nullptr) {
    expect(false, describe(c) + ": " + plan.error);
    return;
  }
  if (plan.shape.m != c.m || plan.shape.n != c.n || plan.shape.k != c.k) {
    expect(false, describe(c) + ": the case is not aligned (its plan pads it)");
    return;
  }
  // A case that asks for the split tail is built to split: make sure it does (rank 0's plan).
  if (c.config.split_tail) expect(plan.split, describe(c) + ": split_tail set but nothing splits");
  World world(c);
  world.sequential = sequential;
  double worst = 0, worst_partial = 0;
  for (int e = 0; e < epochs; ++e) {
    world.fill_inputs(1000 + e);
    world.poison_outputs();
    world.call();
    worst = std::max(worst, world.check());
    if (check_partials) worst_partial = std::max(worst_partial, world.check_partials(int(world.epoch % 2)));
  }
  auto first = world.outputs();
  world.poison_outputs();
  world.call();
  bool const bitwise = world.outputs() == first;
  DeviceError const e = world.read_error();
  double const tol = c.bf16 ? 1e-2 : 2e-3;
  char buf[128];
  std::snprintf(buf, sizeof buf, ": %d epochs, rel err %.2e (tol %.0e), bitwise repeat %s", epochs, worst, tol,
                bitwise ? "yes" : "NO");
  std::string what = describe(c) + buf;
  if (check_partials) {
    std::snprintf(buf, sizeof buf, ", partials rel err %.2e", worst_partial);
    what += buf;
  }
  expect(worst <= tol && bitwise && e.code == 0 && worst_partial <= tol, what);
}

// A rank whose producer never runs: every other consumer must record the deadline and return.
void run_deadline(int world_size) {
  Case c{world_size * 128, 256, 64, world_size, true, GemmRsConfig{128, 0, 4, 256}};
  World world(c);
  world.fill_inputs(7);
  world.call();  // a healthy epoch first
  int const missing = world_size - 1;
  auto t0 = std::chrono::steady_clock::now();
  world.timeout_ns = 200'000'000ull;
  world.call(missing);
  double const secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  DeviceError const e = world.read_error();
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "deadline W=%d: code=%u rank=%d source=%d tile=%d expected=%llu observed=%llu after %.2f s",
                world_size, e.code, e.rank, e.source, e.tile, (unsigned long long)e.expected,
                (unsigned long long)e.observed, secs);
  // Parity 0's flags (epoch 2) were never written: the healthy call used parity 1.
  expect(e.code == kErrorDeadline && e.source == missing && stamp_epoch(e.expected) == 2 && e.observed == 0 && secs < 5, buf);
}

int test_main() {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  GemmRsConfig const base{128, 0, 8, 512};
  for (int world : {1, 2, 4, 8}) {
    for (bool bf16 : {true, false}) {
      Case c{world * 256, 512, 320, world, bf16, base};  // K = 5 blocks of 64
      run_case(c, 3);
    }
  }
  // Block shape, persistent grid, block sizes, K tail (K % 64 != 0), larger tiles counts.
  run_case(Case{2 * 512, 1024, 200, 2, true, GemmRsConfig{256, 0, 16, 512}}, 3);
  run_case(Case{4 * 256, 768, 136, 4, true, GemmRsConfig{128, 100, 8, 256}}, 3);
  run_case(Case{2 * 1024, 2048, 1024, 2, true, GemmRsConfig{256, 120, 8, 128}}, 2);
  run_case(Case{8 * 128, 2560, 512, 8, false, GemmRsConfig{256, 0, 4, 512}}, 2);
  run_case(Case{2 * 2048, 4096, 1024, 2, true, GemmRsConfig{128, 0, 32, 512}}, 2);
  // Persistent grids G that split their tail in K: B blocks, R = B % G, T k-tiles with
  // (G - R) * T >= 16 * G (kSplitMinIdleKTiles, gemm_rs/plan.cc). Odd grids, K tails, both widths and dtypes, rows and columns.
  run_case(Case{2 * 1024, 1024, 2000, 2, true, GemmRsConfig{128, 7, 8, 512, 8, 1}}, 3);     // B 128, R 2, T 32
  run_case(Case{2 * 1024, 1024, 2000, 2, false, GemmRsConfig{128, 7, 8, 512, 8, 1}}, 2);    // B 128, R 2, T 32
  run_case(Case{4 * 512, 1024, 1480, 4, false, GemmRsConfig{256, 7, 8, 256, 8, 1}}, 2);     // B 64, R 1, T 24
  run_case(Case{8 * 256, 1024, 1152, 8, true, GemmRsConfig{256, 9, 8, 512, 2, 1}}, 2);      // B 64, R 1, T 18
  run_case(Case{512, 2 * 1024, 1600, 2, true, GemmRsConfig{256, 6, 8, 512, 8, 1}, true}, 2);  // B 32, R 2, T 25
  // Raster groups with a partial last group (5 tile rows per partition, groups of 2 and 3).
  run_case(Case{2 * 640, 1024, 256, 2, true, GemmRsConfig{256, 60, 8, 512, 2}}, 2);
  run_case(Case{4 * 640, 640, 128, 4, false, GemmRsConfig{128, 0, 8, 256, 3}}, 2);
  // Scatter over columns (partition q = columns q*N/W ..): W in {1, 2, 4, 8}, both block widths.
  run_case(Case{384, 512, 192, 1, true, GemmRsConfig{256, 0, 4, 512}, true}, 2);
  run_case(Case{640, 2 * 512, 320, 2, true, GemmRsConfig{256, 60, 8, 512, 2}, true}, 3);
  run_case(Case{512, 4 * 384, 136, 4, false, GemmRsConfig{128, 0, 8, 256, 3}, true}, 2);
  run_case(Case{256, 8 * 256, 256, 8, true, GemmRsConfig{256, 0, 4, 512}, true}, 2);
  run_deadline(2);
  run_deadline(4);
  run_graph<World>(Case{2 * 512, 1024, 200, 2, true, GemmRsConfig{256, 0, 16, 512}}, 6);
  run_graph<World>(Case{4 * 256, 768, 136, 4, false, GemmRsConfig{128, 100, 8, 256}}, 6);
  run_graph<World>(Case{2 * 1024, 1024, 2000, 2, true, GemmRsConfig{128, 7, 8, 512, 8, 1}}, 5);
  std::printf("harness test: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace entwine::harness
