// ag_gemm on W virtual ranks: `ag test` (both layouts, both pushes, several epochs, the deadline,
// CUDA graphs), `ag bench` (its GEMM alone against cuBLASLt) and `ag push` (one push alone).
#include "harness/ag_world.h"

namespace entwine::harness {

std::string describe(AgCase const& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "ag W=%d rows=%d cols=%d N=%d %s%s%s %s block_n=%d gemm_sms=%d r=%d chunks<=%d push_sms=%d", c.world,
                c.rows, c.cols, c.n, !c.fp8 ? "" : c.x_e5m2 ? "e5m2xe4m3->" : "e4m3->", c.bf16 ? "bf16" : "fp16",
                !c.fp8 ? "" : c.block_scaled ? " block scales" : c.shared_scale ? " shared scale" : " per-shard scales",
                c.gather_k ? "contraction" : "rows", int(c.config.block_n), int(c.config.gemm_sms),
                int(c.config.raster_rows), int(c.config.max_chunks), int(c.config.push_sms));
  return buf;
}

AgGemmConfig ag_config_for(int world, int block_n, int raster_rows, int max_chunks, int push_sms) {
  return AgGemmConfig{block_n, std::max(1, sm_count() / world - 2 - push_sms), raster_rows, max_chunks, push_sms};
}

void run_ag_case(AgCase const& c, int epochs) {
  AgPlan const plan = ag_plan(c.problem(0), c.config);
  if (plan.error) {
    expect(false, describe(c) + ": " + plan.error);
    return;
  }
  AgWorld world(c);
  double worst = 0;
  for (int e = 0; e < epochs; ++e) {
    world.fill_inputs(2000 + e);
    world.poison_outputs();
    world.call();
    worst = std::max(worst, world.check());
  }
  auto first = world.outputs();
  world.poison_outputs();
  world.call();
  bool const bitwise = world.outputs() == first;
  DeviceError const e = world.read_error();
  double const tol = c.bf16 ? 1e-2 : 2e-3;
  char buf[160];
  std::snprintf(buf, sizeof buf, ": %d chunks, %d epochs, rel err %.2e (tol %.0e), bitwise repeat %s", plan.chunks,
                epochs, worst, tol, bitwise ? "yes" : "NO");
  expect(worst <= tol && bitwise && e.code == 0, describe(c) + buf);
}

// A rank that never pushes: every other rank's GEMM must record the deadline on one of its chunks.
void run_ag_deadline(int world_size, bool gather_k, int push_sms = 0) {
  AgCase c{256, 64, 256, world_size, true, gather_k, ag_config_for(world_size, 128, 8, 8, push_sms)};
  AgWorld world(c);
  world.fill_inputs(9);
  world.call();
  int const missing = world_size - 1;
  world.timeout_ns = 200'000'000ull;
  auto t0 = std::chrono::steady_clock::now();
  world.call(missing);
  double const secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  DeviceError const e = world.read_error();
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "ag deadline W=%d %s push_sms=%d: code=%u op=%d rank=%d source=%d chunk=%d expected=%llu after %.2f s",
                world_size, gather_k ? "contraction" : "rows", push_sms, e.code, e.site, e.rank, e.source, e.tile,
                (unsigned long long)e.expected, secs);
  // Either wait may pass its deadline first: a GEMM's for the absent rank's chunk, or a transfer
  // stream's for the absent rank's announcement of the call.
  bool const site_ok = e.site == kWaitGatherChunk || e.site == kWaitInboxReady;
  expect(e.code == kErrorDeadline && site_ok && e.source == missing && stamp_epoch(e.expected) == 2 && secs < 5, buf);
}

int ag_test_main() {
  CHECK_CUDA(ag_gemm::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  for (int world : {1, 2, 4, 8}) {
    for (bool gather_k : {false, true}) {
      for (bool bf16 : {true, false}) run_ag_case(AgCase{256, 320, 512, world, bf16, gather_k, ag_config_for(world, 256)}, 3);
    }
  }
  // Tails of K inside a shard (cols % 64 != 0), narrow blocks, one chunk per tile row, odd chunk
  // counts (6 tile rows in 3 or 6 chunks), raster groups smaller than a chunk.
  run_ag_case(AgCase{768, 200, 384, 2, true, false, ag_config_for(2, 128, 2, 3)}, 2);
  run_ag_case(AgCase{768, 200, 384, 4, false, true, ag_config_for(4, 128, 4, 6)}, 2);
  run_ag_case(AgCase{1024, 1024, 2048, 2, true, false, ag_config_for(2, 256, 8, 8)}, 2);
  run_ag_case(AgCase{1024, 512, 1024, 8, true, true, ag_config_for(8, 256, 8, 8)}, 2);
  run_ag_case(AgCase{640, 136, 256, 4, true, false, ag_config_for(4, 256, 16, 64)}, 2);
  // The SM push: every world, both layouts, a K tail, odd chunk counts, one CTA or more than a
  // chunk has vectors for (the plan caps the grid).
  for (int world : {2, 4, 8}) {
    for (bool gather_k : {false, true}) {
      run_ag_case(AgCase{256, 320, 512, world, true, gather_k, ag_config_for(world, 256, 8, 8, 4)}, 3);
    }
  }
  run_ag_case(AgCase{768, 200, 384, 2, true, false, ag_config_for(2, 128, 2, 3, 1)}, 2);
  run_ag_case(AgCase{768, 200, 384, 4, false, true, ag_config_for(4, 128, 4, 6, 8)}, 2);
  run_ag_case(AgCase{2048, 1024, 1024, 2, true, false, ag_config_for(2, 256, 8, 8, 16)}, 2);
  run_ag_deadline(2, false);
  run_ag_deadline(4, true);
  run_ag_deadline(2, false, 4);
  run_graph<AgWorld>(AgCase{768, 200, 384, 2, true, false, ag_config_for(2, 128, 2, 3)}, 6);
  run_graph<AgWorld>(AgCase{1024, 512, 1024, 4, false, true, ag_config_for(4, 256, 8, 8)}, 6);
  run_graph<AgWorld>(AgCase{1024, 512, 1024, 2, true, true, ag_config_for(2, 256, 8, 8, 4)}, 6);
  std::printf("harness ag test: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

// The consuming GEMM alone, every chunk already released (flags hold the largest epoch), against
// cuBLASLt's fastest algorithm on the same gathered GEMM, in interleaved rounds: the cost of the
// two operands' descriptors, the arrival order and the flag checks (the pushes: `ag push`).
int ag_bench_main() {
  CHECK_CUDA(ag_gemm::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  CublasLt* lt = CublasLt::load();
  struct Shape {
    int tokens, embed, mlp;
  };
  std::printf("# ag_gemm GEMM alone (chunks released) vs cuBLASLt, W = 2, bf16; median ms of interleaved rounds\n");
  // Variants (raster rows, max chunks) of the persistent 128x256 GEMM on all SMs but one.
  std::array<std::array<int, 2>, 3> const variants{{{8, 8}, {16, 4}, {4, 8}}};
  std::printf("%-11s %6s %6s %6s %6s %9s %9s %9s %9s %7s\n", "layout", "M", "N", "K", "rows", "r8c8_ms", "r16c4_ms",
              "r4c8_ms", "cublas_ms", "best");
  for (bool gather_k : {false, true}) {
    for (Shape sh : {Shape{8192, 4096, 14336}, Shape{16384, 4096, 14336}, Shape{8192, 8192, 28672}, Shape{16384, 8192, 28672}}) {
      int const world = 2, n = sh.mlp / world;
      // Gate/up projections: rows layout x [T/W, D] -> [T, F/W]; contraction x [T, D/W] -> [T, F/W].
      AgCase c{gather_k ? sh.tokens : sh.tokens / world, gather_k ? sh.embed / world : sh.embed, n, world, true, gather_k,
               AgGemmConfig{256, sm_count() - 1, 8, 8}};
      AgWorld wd(c);
      wd.fill_inputs(5);
      CHECK_CUDA(cudaMemset(wd.ranks[0].flags, 0xFF, 2 * wd.plan.flags * sizeof(uint64_t)));
      fill_random<<<264, 256>>>(reinterpret_cast<uint16_t*>(wd.ranks[0].inbox), wd.plan.inbox_bytes / 2, 77, true);
      CHECK_CUDA(cudaDeviceSynchronize());
      auto& r0 = wd.ranks[0];
      cudaStream_t const stream = r0.gemm;
      AgGemmArgs const a{r0.x, r0.inbox, r0.w, r0.y, r0.flags, wd.error, nullptr, wd.call_epoch(), wd.timeout_ns};
      int64_t const m = c.y_rows(), k = gather_k ? int64_t(world) * c.cols : c.cols;
      std::vector<std::function<void()>> launches;
      for (auto const& v : variants) {
        AgGemmConfig const cfg{256, sm_count() - 1, v[0], v[1]};
        AgPlan const plan = ag_plan(c.problem(0), cfg);
        // The flags were set for max_chunks 8; fewer chunks index a prefix of them.
        launches.push_back([&, a, cfg, plan]() {
          CHECK_CUDA(ag_gemm::launch_gemm(DType::kBF16, DType::kBF16, plan, a, stream));
        });
      }
      uint16_t* ref_out = nullptr;
      if (lt) {
        // The gathered operand as one [M, K] matrix: the inbox (rows layout) is exactly that; for the
        // contraction layout the shards are source-major, so time the same FLOPs on [M, K] data.
        CHECK_CUDA(cudaMalloc(&ref_out, size_t(m) * n * 2));
        void* a_full = nullptr;
        CHECK_CUDA(cudaMalloc(&a_full, size_t(m) * k * 2));
        fill_random<<<264, 256>>>(static_cast<uint16_t*>(a_full), m * k, 78, true);
        void* w_full = nullptr;
        CHECK_CUDA(cudaMalloc(&w_full, size_t(k) * n * 2));
        fill_random<<<264, 256>>>(static_cast<uint16_t*>(w_full), k * n, 79, true);
        CHECK_CUDA(cudaDeviceSynchronize());
        launches.push_back(lt->gemm(int(m), n, int(k), a_full, w_full, ref_out, stream));
      }
      std::vector<float> const ms = interleaved_median_ms(launches, stream, 10, 30, 5);
      float const cublas = ms.size() > variants.size() ? ms[variants.size()] : NAN;
      std::printf("%-11s %6lld %6d %6lld %6d %9.4f %9.4f %9.4f %9.4f %7.3f\n", gather_k ? "contraction" : "rows",
                  (long long)m, n, (long long)k, c.rows, ms[0], ms[1], ms[2], cublas,
                  cublas / *std::min_element(ms.begin(), ms.begin() + variants.size()));
      if (wd.read_error().code != 0) std::printf("  device error recorded!\n");
    }
  }
  return 0;
}

// One push alone, rank 0 -> rank 1 of this GPU (HBM to HBM, not NVLink), for shards of 0.25 to 67 MB
// (1024 bf16 columns, 8 chunks): the copy engines (a copy and a release kernel per chunk, as the
// handler enqueues them) against the SM push (one kernel) of several CTA budgets, in interleaved
// rounds. Goal: 1 MB within 15 us. The largest shard where the SM push (at tuning/crossover.py's push_sms) is faster is what
// crossover.py's sm_push_max_shard_bytes should be.
int ag_push_main() {
  CHECK_CUDA(ag_gemm::prepare_kernels());
  std::array<int, 3> const budgets{8, 16, 32};
  std::printf("# push alone, rank 0 -> rank 1 on this GPU, W = 2, bf16; median ms of interleaved rounds\n");
  // Last two columns: the SM push of 16 CTAs with the shard in 1 and in 2 chunks (each chunk's
  // release is a grid-wide arrival, a fence and a flag: what fewer chunks save on small shards).
  std::printf("%9s %6s %9s %9s %9s %9s %9s %9s %5s\n", "shard_MB", "chunks", "ce_ms", "sm8_ms", "sm16_ms", "sm32_ms",
              "sm16_1ch", "sm16_2ch", "best");
  double sm_wins_up_to = 0;
  for (int rows : {128, 512, 4096, 16384, 32768}) {
    AgCase c{rows, 1024, 256, 2, true, false, AgGemmConfig{256, 1, 8, 8, 0}};
    AgWorld wd(c);
    // Rank 1 has announced every call: the SM push's wait passes at its first poll.
    CHECK_CUDA(cudaMemset(wd.ranks[0].ready, 0x7F, kMaxWorld * sizeof(uint64_t)));
    CHECK_CUDA(cudaDeviceSynchronize());
    int64_t const chunk_bytes = wd.plan.shard_bytes / wd.plan.chunks;
    cudaStream_t const s = wd.ranks[0].transfer[1];
    std::vector<std::function<void()>> launches;
    launches.push_back([&]() {
      for (int k = 0; k < wd.plan.chunks; ++k) {
        CHECK_CUDA(cudaMemcpyAsync(wd.ranks[1].inbox + k * chunk_bytes, reinterpret_cast<char*>(wd.ranks[0].x) + k * chunk_bytes,
                                   chunk_bytes, cudaMemcpyDeviceToDevice, s));
        CHECK_CUDA(comm::launch_release(wd.ranks[1].flags + k, wd.call_epoch(), s));
      }
    });
    std::vector<AgPlan> plans;
    for (int sms : budgets) plans.push_back(ag_plan(c.problem(0), AgGemmConfig{256, 1, 8, 8, sms}));
    plans.push_back(ag_plan(c.problem(0), AgGemmConfig{256, 1, 8, 1, 16}));
    plans.push_back(ag_plan(c.problem(0), AgGemmConfig{256, 1, 8, 2, 16}));
    for (AgPlan const& plan : plans) {
      launches.push_back([&wd, plan]() {
        AgWorld::Rank const& r0 = wd.ranks[0];
        PushArgs a{};
        a.shard = r0.x;
        a.inbox[1] = wd.ranks[1].inbox;
        a.flags[1] = wd.ranks[1].flags;
        a.ready = r0.ready;
        a.arrivals = r0.arrivals;
        a.shard_bytes = plan.shard_bytes;
        a.chunks = plan.chunks;
        a.rank = 0;
        a.world = 2;
        a.error = wd.error;
        a.call = wd.call_epoch();
        a.timeout_ns = wd.timeout_ns;
        CHECK_CUDA(launch_push(plan, a, r0.transfer[1]));
      });
    }
    // One push per timed interval: its latency, enqueueing included, as a call sees it.
    std::vector<float> const ms = interleaved_median_ms(launches, s, 10, 50, 1);
    size_t const best = size_t(std::min_element(ms.begin(), ms.begin() + 4) - ms.begin());
    double const mb = wd.plan.shard_bytes / 1e6;
    std::printf("%9.2f %6d %9.4f %9.4f %9.4f %9.4f %9.4f %9.4f %5s\n", mb, wd.plan.chunks, ms[0], ms[1], ms[2], ms[3],
                ms[4], ms[5], best == 0 ? "ce" : ("sm" + std::to_string(budgets[best - 1])).c_str());
    if (ms[2] < ms[0]) sm_wins_up_to = mb;
    if (wd.read_error().code != 0) std::printf("  device error recorded!\n");
  }
  std::printf("# the SM push (16 CTAs) is faster up to %.2f MB here\n", sm_wins_up_to);
  return 0;
}

}  // namespace entwine::harness
