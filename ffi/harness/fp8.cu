// FP8 operands of both ops: `fp8 test` (against float64 of the dequantised inputs, the plans' FP8
// rules, a failed call's poisoned outputs), `fp8 bench` (against cuBLASLt's FP8 GEMM) and `fp8 accuracy`
// (the FP8 accumulation's error against cuBLASLt's).
#include <algorithm>

#include "harness/ag_world.h"
#include "harness/gemm_rs_world.h"

namespace entwine::harness {

// The last kernel of a failed FP8 ag_gemm call: all three outputs (y, the gathered e4m3 shards, the
// f32 scales; odd sizes for the byte tail) filled with all bits set, NaN in each type, and the
// epoch advanced.
void run_fp8_poison() {
  constexpr int kOutputs = 3;
  size_t const bytes[kOutputs] = {2 * 300, 4 * 128 * 208 + 5, sizeof(float) * 4};
  comm::CallEnd end;
  DeviceError failed{};
  failed.code = kErrorDeadline;
  CHECK_CUDA(cudaMalloc(&end.epoch, sizeof(uint64_t)));
  CHECK_CUDA(cudaMemset(end.epoch, 0, sizeof(uint64_t)));
  CHECK_CUDA(cudaMalloc(&end.error, sizeof(DeviceError)));
  CHECK_CUDA(cudaMemcpy(end.error, &failed, sizeof failed, cudaMemcpyHostToDevice));
  for (int o = 0; o < kOutputs; ++o) {
    void* out = nullptr;
    CHECK_CUDA(cudaMalloc(&out, bytes[o]));
    CHECK_CUDA(cudaMemset(out, 0, bytes[o]));
    end.add_output(out, int64_t(bytes[o]));
  }
  CHECK_CUDA(comm::launch_end_call(end, 0));
  CHECK_CUDA(cudaDeviceSynchronize());
  uint64_t epoch = 0;
  CHECK_CUDA(cudaMemcpy(&epoch, end.epoch, sizeof epoch, cudaMemcpyDeviceToHost));
  bool all_set = true;
  for (int o = 0; o < kOutputs; ++o) {
    std::vector<unsigned char> host(bytes[o]);
    CHECK_CUDA(cudaMemcpy(host.data(), end.out[o], bytes[o], cudaMemcpyDeviceToHost));
    for (unsigned char b : host) all_set = all_set && b == 0xFF;
    cudaFree(end.out[o]);
  }
  cudaFree(end.epoch);
  cudaFree(end.error);
  expect(all_set && epoch == 1, "fp8 aftermath: a failed call's three outputs are all-ones (NaN), the epoch advances");
}

// FP8 cases of both ops, checked against float64 of the dequantised inputs (so only the output's
// rounding and the accumulation order differ: the 16-bit tolerances apply), the plans' FP8 rules and
// the poisoning of a failed call's three outputs.
int fp8_test_main() {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  CHECK_CUDA(ag_gemm::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  GemmRsConfig const base{128, 0, 8, 512};
  for (int world : {1, 2, 4, 8}) {
    for (bool bf16 : {true, false}) run_case(Case{world * 256, 512, 384, world, bf16, base, false, true}, 3);  // 3 k-tiles
  }
  // K tail (K % 128 != 0), persistent grid, scatter over columns, a split tail (B 128, G 7, R 2,
  // T 32), a long K (the promoted accumulator: 128 k-tiles).
  run_case(Case{2 * 512, 1024, 208, 2, true, GemmRsConfig{128, 100, 8, 256}, false, true}, 3);
  run_case(Case{512, 4 * 384, 272, 4, false, GemmRsConfig{128, 0, 8, 256, 3}, true, true}, 2);
  run_case(Case{2 * 1024, 1024, 4000, 2, true, GemmRsConfig{128, 7, 8, 512, 8, 1}, false, true}, 2);
  run_case(Case{2 * 256, 512, 16384, 2, true, base, false, true}, 1);
  run_graph<World>(Case{2 * 512, 1024, 208, 2, true, GemmRsConfig{128, 0, 16, 512}, false, true}, 4);

  // ag_gemm: both layouts with each shard's own scale (the contraction layout scales each K slice by
  // its source's as the k-tile's sum is promoted), and the contraction layout with a shared one.
  for (int world : {1, 2, 3, 4, 8}) {
    for (bool gather_k : {false, true}) {
      for (bool bf16 : {true, false}) {
        run_ag_case(AgCase{256, 384, 512, world, bf16, gather_k, ag_config_for(world, 128), true, false}, 3);
      }
    }
    run_ag_case(AgCase{256, 384, 512, world, true, true, ag_config_for(world, 128), true, true}, 2);
  }
  run_ag_case(AgCase{256, 384, 512, 4, true, false, ag_config_for(4, 128), true, true}, 2);
  run_ag_case(AgCase{768, 208, 384, 2, true, false, ag_config_for(2, 128, 2, 3), true, false}, 2);
  run_ag_case(AgCase{768, 208, 384, 4, false, true, ag_config_for(4, 128, 4, 6), true, false}, 2);
  run_ag_case(AgCase{1024, 1024, 2048, 8, true, false, ag_config_for(8, 128, 8, 8), true, false}, 2);
  run_graph<AgWorld>(AgCase{768, 208, 384, 2, true, false, ag_config_for(2, 128, 2, 3), true, false}, 4);
  // The SM push of 1-byte shards, each shard's scale in its slot (or none, shared): every world,
  // both layouts, odd chunk counts, one CTA; under a graph.
  for (int world : {2, 4, 8}) {
    for (bool gather_k : {false, true}) {
      run_ag_case(AgCase{256, 384, 512, world, true, gather_k, ag_config_for(world, 128, 8, 8, 4), true, false}, 3);
    }
  }
  run_ag_case(AgCase{256, 384, 512, 4, true, true, ag_config_for(4, 128, 8, 8, 4), true, true}, 2);
  run_ag_case(AgCase{768, 208, 384, 2, false, false, ag_config_for(2, 128, 2, 3, 1), true, false}, 2);
  run_ag_case(AgCase{768, 208, 384, 4, true, true, ag_config_for(4, 128, 4, 6, 8), true, true}, 2);
  run_graph<AgWorld>(AgCase{768, 208, 384, 2, true, false, ag_config_for(2, 128, 2, 3, 4), true, false}, 4);

  // x in e5m2, w_t in e4m3 (the hybrid recipe's backward: an e5m2 gradient times the weight), both ops:
  // gemm_rs over rows and columns (K tail, persistent grid, split tail); ag_gemm's rows layout with
  // per-shard scales and its contraction layout with per-shard and shared ones, on the copy engines and
  // the SM push.
  for (int world : {2, 4}) {
    for (bool bf16 : {true, false}) {
      run_case(Case{world * 256, 512, 384, world, bf16, base, false, true, true}, 2);
    }
  }
  run_case(Case{512, 4 * 384, 272, 4, false, GemmRsConfig{128, 0, 8, 256, 3}, true, true, true}, 2);
  run_case(Case{2 * 1024, 1024, 4000, 2, true, GemmRsConfig{128, 7, 8, 512, 8, 1}, false, true, true}, 2);
  for (bool gather_k : {false, true}) {
    for (bool bf16 : {true, false}) {
      run_ag_case(AgCase{256, 384, 512, 4, bf16, gather_k, ag_config_for(4, 128), true, bf16 && gather_k, true}, 2);
    }
  }
  run_ag_case(AgCase{768, 208, 384, 2, true, false, ag_config_for(2, 128, 2, 3, 4), true, false, true}, 2);
  run_ag_case(AgCase{768, 208, 384, 4, false, true, ag_config_for(4, 128, 4, 6, 8), true, false, true}, 2);

  // The plans' FP8 rules: K padded to 16 (not 8), 128-wide blocks only, gather_k with any scales.
  GemmRsPlan const padded = gemm_rs_plan(GemmRsProblem{256, 256, 200, 1, 0, false, DType::kE4M3}, base);
  expect(padded.error == nullptr && padded.shape.k == 208 && padded.schedule.k_tiles == 2,
         "fp8 gemm_rs plan: K 200 pads to 208, 2 k-tiles of 128");
  expect(gemm_rs_plan(GemmRsProblem{256, 256, 64, 1, 0, false, DType::kE4M3}, GemmRsConfig{256}).config_error,
         "fp8 gemm_rs plan: block_n 256 is a config error");
  AgPlan const ag = ag_plan(AgProblem{128, 200, 256, 2, 0, false, DType::kE4M3, false}, AgGemmConfig{128});
  expect(ag.error == nullptr && ag.cols_pad == 208 && ag.shard_bytes == 128 * 208 &&
             ag.inbox_bytes == 2 * ag.shard_bytes + 2 * kScaleSlotBytes,
         "fp8 ag plan: cols 200 pad to 208, 1-byte shards, one scale slot per source");
  AgPlan const sliced = ag_plan(AgProblem{128, 256, 256, 2, 0, true, DType::kE4M3, false}, AgGemmConfig{128});
  expect(sliced.error == nullptr && sliced.scaling == Scaling::kSlice && ag.scaling == Scaling::kTensor &&
             ag_plan(AgProblem{128, 256, 256, 2, 0, true, DType::kE4M3, true}, AgGemmConfig{128}).scaling ==
                 Scaling::kTensor,
         "fp8 ag plan: gather_k with per-shard scales runs the per-slice kernel; shared scales and the rows "
         "layout the per-tensor one");
  AgPlan const pushed = ag_plan(AgProblem{128, 208, 256, 2, 0, false, DType::kE4M3, false}, AgGemmConfig{128, 100, 8, 8, 64});
  expect(pushed.error == nullptr && pushed.push_grid == 4 && pushed.sms_needed == pushed.grid + 4,
         "fp8 ag plan: the SM push's grid counts the 16-byte vectors of a 1-byte chunk (26624 bytes: 4 CTAs)");
  GemmRsPlan const padded_e5m2 = gemm_rs_plan(GemmRsProblem{256, 256, 200, 1, 0, false, DType::kE5M2}, base);
  expect(padded_e5m2.error == nullptr && padded_e5m2.shape.k == 208 && padded_e5m2.schedule.k_tiles == 2 &&
             gemm_rs_plan(GemmRsProblem{256, 256, 64, 1, 0, false, DType::kE5M2}, GemmRsConfig{256}).config_error,
         "fp8 gemm_rs plan, x in e5m2: the e4m3 rules (K 200 pads to 208, block_n 256 is a config error)");
  AgPlan const ag_e5m2 = ag_plan(AgProblem{128, 200, 256, 2, 0, false, DType::kE5M2, false}, AgGemmConfig{128});
  expect(ag_e5m2.error == nullptr && ag_e5m2.cols_pad == 208 && ag_e5m2.inbox_bytes == ag.inbox_bytes,
         "fp8 ag plan, shards in e5m2: the e4m3 plan (1-byte shards, one scale slot per source)");
  run_fp8_poison();
  std::printf("harness fp8 test: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

// Accuracy of the FP8 accumulation: positive e4m3 operands (values in [0.5, 2): sums that only grow,
// so truncation in the tensor cores' accumulator adds up instead of cancelling), one rank's
// producer GEMM and cuBLASLt's FP8 GEMM against float64, mean and max relative error, per K.
int fp8_accuracy_main() {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  CublasLt const* lt = CublasLt::load();
  std::printf("# fp8 accuracy, e4m3 in [0.5, 2) -> bf16, M = N = 256, scales 1; rel err vs float64 (mean / max)\n");
  std::printf("%6s %22s %22s\n", "K", "ours", "cublasLt");
  for (int k : {1024, 4096, 16384, 32768}) {
    Case c{256, 256, k, 1, true, GemmRsConfig{128, 0, 8, 512}, false, true};
    World world(c);
    world.fill_inputs(1);
    auto positive = [](int64_t count, uint64_t seed) {
      std::vector<uint8_t> v(count);
      for (int64_t i = 0; i < count; ++i) {
        float const u = 0.5f * (hash_uniform(seed, i) + 1.0f);  // [0, 1)
        int const e = 6 + int(u * 2.0f);                         // exponent field 6 or 7: [0.5, 2)
        int const m = int(0.5f * (hash_uniform(seed + 1, i) + 1.0f) * 8.0f) & 7;
        v[i] = uint8_t((e << 3) | m);
      }
      return v;
    };
    std::vector<uint8_t> const x = positive(int64_t(c.m) * k, 11), w = positive(int64_t(c.n) * k, 12);
    std::vector<double> xd(x.size()), wd(w.size());
    for (size_t i = 0; i < x.size(); ++i) xd[i] = fp8_to_double(x[i]);
    for (size_t i = 0; i < w.size(); ++i) wd[i] = fp8_to_double(w[i]);
    CHECK_CUDA(cudaMemcpy(world.ranks[0].x, x.data(), x.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(world.ranks[0].w, w.data(), w.size(), cudaMemcpyHostToDevice));
    float const ones[2] = {1.0f, 1.0f};
    CHECK_CUDA(cudaMemcpy(world.ranks[0].scales, ones, sizeof ones, cudaMemcpyHostToDevice));
    std::vector<double> ref(size_t(c.m) * c.n);
    for (int i = 0; i < c.m; ++i)
      for (int j = 0; j < c.n; ++j) {
        double acc = 0;
        for (int kk = 0; kk < k; ++kk) acc += xd[size_t(i) * k + kk] * wd[size_t(j) * k + kk];
        ref[size_t(i) * c.n + j] = acc;
      }
    size_t const mn = size_t(c.m) * c.n;
    auto error_of = [&](uint16_t const* dev) {
      std::vector<uint16_t> y(mn);
      CHECK_CUDA(cudaMemcpy(y.data(), dev, mn * 2, cudaMemcpyDeviceToHost));
      double sum = 0, worst = 0;
      for (size_t i = 0; i < mn; ++i) {
        double const e = std::abs(to_double(y[i], true) - ref[i]) / ref[i];
        sum += e;
        worst = std::max(worst, e);
      }
      return std::array<double, 2>{sum / mn, worst};
    };
    // The producer writes the slot of the call's parity: poison both, then read the written one.
    CHECK_CUDA(cudaMemset(world.ranks[0].partial[0], 0xFF, 2 * mn * 2));
    producer_launcher(world, c.shape(0), c.config, false, false, 0)();
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> probe(1);
    CHECK_CUDA(cudaMemcpy(probe.data(), world.ranks[0].partial[0], 2, cudaMemcpyDeviceToHost));
    auto const ours = error_of(probe[0] == 0xFFFF ? world.ranks[0].partial[1] : world.ranks[0].partial[0]);
    std::array<double, 2> theirs{NAN, NAN};
    if (lt) {
      CublasLt::Fp8Scales const scales{world.ranks[0].scales, world.ranks[0].scales + 1};
      auto run = lt->gemm(c.m, c.n, k, world.ranks[0].x, world.ranks[0].w, world.ranks[0].out, 0, &scales);
      if (run) {
        run();
        CHECK_CUDA(cudaDeviceSynchronize());
        theirs = error_of(world.ranks[0].out);
      }
    }
    std::printf("%6d %10.2e / %9.2e %10.2e / %9.2e\n", k, ours[0], ours[1], theirs[0], theirs[1]);
  }
  return 0;
}

// Both ops' kernels and the epoch kernel loaded, and cuBLASLt (nullptr, said once, where the
// loader does not find it): what every FP8 benchmark starts with.
CublasLt const* prepare_fp8_bench() {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  CHECK_CUDA(ag_gemm::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  CublasLt const* lt = CublasLt::load();
  if (!lt) std::printf("(libcublasLt.so.13 not found: no cuBLAS column)\n");
  return lt;
}

// Rank 0's FP8 ag_gemm GEMM of `wd` as a launcher on `stream`, every chunk released: flags above any
// epoch, the inbox's shards random e4m3 bytes, and where there are peers their scales 1.
// `variant`: a build of the GEMM (fp8_order_variants.cu; nullptr: the shipped e4m3 -> bf16 one).
std::function<void()> released_fp8_gemm(AgWorld& wd, cudaStream_t stream, AgVariant const* variant = nullptr) {
  CHECK_CUDA(cudaMemset(wd.ranks[0].flags, 0xFF, 2 * wd.plan.flags * sizeof(uint64_t)));
  // the whole inbox, the local shard's slot included (a build may read it for the local blocks)
  fill_random_fp8<<<264, 256>>>(reinterpret_cast<uint8_t*>(wd.ranks[0].inbox), wd.plan.scales_offset, 77);
  // rank 0's own slot (at 0) holds its x, so a build reading the local rows there computes the same y
  CHECK_CUDA(cudaMemcpy2D(wd.ranks[0].inbox, wd.plan.cols_pad, wd.ranks[0].x, wd.c.cols, wd.c.cols, wd.c.rows,
                          cudaMemcpyDeviceToDevice));
  if (wd.c.world > 1) {
    std::vector<float> const ones(size_t(wd.c.world) * kScaleSlotBytes / sizeof(float), 1.0f);
    CHECK_CUDA(cudaMemcpy(wd.ranks[0].inbox + wd.plan.scales_offset, ones.data(), ones.size() * sizeof(float),
                          cudaMemcpyHostToDevice));
  }
  auto& r0 = wd.ranks[0];
  AgGemmArgs a{r0.x, r0.inbox, r0.w, r0.y, r0.flags, wd.error, nullptr, wd.call_epoch(), wd.timeout_ns};
  a.x_scale = r0.scales;
  a.w_scale = r0.scales + 1;
  if (variant != nullptr) {
    return [a, plan = wd.plan, stream, launch = variant->launch]() { CHECK_CUDA(launch(plan, a, stream)); };
  }
  return [a, plan = wd.plan, stream]() { CHECK_CUDA(ag_gemm::launch_gemm(DType::kE4M3, DType::kBF16, plan, a, stream)); };
}

// The FP8 GEMMs against cuBLASLt's FP8 GEMM (same types, scales and accumulation), in interleaved
// rounds: gemm_rs's producer on the design suite (W = 2 partitions), ag_gemm's GEMM alone (chunks
// released; per-shard scales in the rows layout, the contraction layout with a shared scale and with
// per-shard ones, the per-slice kernel) on its bench shapes; then the push of an FP8 shard
// against a bf16 one.
int fp8_bench_main() {
  CublasLt const* lt = prepare_fp8_bench();
  int const sms = sm_count();
  std::printf("# gemm_rs producer, e4m3 -> bf16, W = 2, median ms of interleaved rounds; goal cublas/shipped >= 0.95\n");
  // plain: neither the Entwine order nor the flags; order_ms: the order alone; flags_ms: the flags
  // alone (the shipped producer has both): which of the two costs what over plain.
  std::printf("%6s %6s %5s %10s %10s %10s %10s %10s %8s %15s\n", "M", "N", "K", "plain_ms", "order_ms", "flags_ms",
              "shipped_ms", "cublas_ms", "TF/s", "cublas/shipped");
  for (auto const& sh : kDesignSuite) {
    Case c{sh[0], sh[1], sh[2], 2, true, GemmRsConfig{}, false, true};
    World world(c);
    world.fill_inputs(3);
    cudaStream_t const stream = world.ranks[0].producer_stream;
    ProblemShape const s{c.m, c.n, c.k, 2, 0};
    GemmRsConfig const cfg{128, sms, 16, 512, 8};
    std::vector<std::function<void()>> launches{
        producer_launcher(world, s, cfg, false, false, stream), producer_launcher(world, s, cfg, true, false, stream),
        producer_launcher(world, s, cfg, false, true, stream), producer_launcher(world, s, cfg, true, true, stream)};
    CublasLt::Fp8Scales const scales{world.ranks[0].scales, world.ranks[0].scales + 1};
    if (lt) {
      auto run = lt->gemm(c.m, c.n, c.k, world.ranks[0].x, world.ranks[0].w, world.ranks[0].partial[1], stream, &scales);
      if (run) launches.push_back(run);
    }
    std::vector<float> const ms = interleaved_median_ms(launches, stream);
    float const cublas = ms.size() > 4 ? ms[4] : NAN;
    std::printf("%6d %6d %5d %10.4f %10.4f %10.4f %10.4f %10.4f %8.0f %15.3f\n", c.m, c.n, c.k, ms[0], ms[1], ms[2],
                ms[3], cublas, 2.0 * c.m * c.n * c.k / (ms[3] * 1e-3) / 1e12, cublas / ms[3]);
  }

  std::printf("# ag_gemm GEMM alone (chunks released), e4m3 -> bf16, W = 2 (rows: per-shard scales; contraction: "
              "one shared scale; contr-slice: per-shard scales, each K slice scaled in the mainloop)\n");
  std::printf("%-11s %6s %6s %6s %10s %10s %12s\n", "layout", "M", "N", "K", "ms", "cublas_ms", "cublas/ours");
  struct Shape {
    int tokens, embed, mlp;
  };
  for (int layout = 0; layout < 3; ++layout) {
    bool const gather_k = layout > 0, shared_scale = layout == 1;
    char const* const name = layout == 0 ? "rows" : layout == 1 ? "contraction" : "contr-slice";
    for (Shape sh : {Shape{8192, 4096, 14336}, Shape{16384, 4096, 14336}, Shape{8192, 8192, 28672}}) {
      int const world = 2, n = sh.mlp / world;
      AgCase c{gather_k ? sh.tokens : sh.tokens / world, gather_k ? sh.embed / world : sh.embed, n, world, true, gather_k,
               AgGemmConfig{128, sms - 1, 8, 8}, true, shared_scale};
      AgWorld wd(c);
      wd.fill_inputs(5);
      auto& r0 = wd.ranks[0];
      cudaStream_t const stream = r0.gemm;
      std::vector<std::function<void()>> launches{released_fp8_gemm(wd, stream)};
      int64_t const m = c.y_rows(), k = gather_k ? int64_t(world) * c.cols : c.cols;
      uint8_t *a_full = nullptr, *w_full = nullptr;
      uint16_t* ref_out = nullptr;
      if (lt) {
        // The same FLOPs as one [M, K] x [N, K]^T FP8 GEMM.
        CHECK_CUDA(cudaMalloc(&a_full, size_t(m) * k));
        CHECK_CUDA(cudaMalloc(&w_full, size_t(k) * n));
        CHECK_CUDA(cudaMalloc(&ref_out, size_t(m) * n * 2));
        fill_random_fp8<<<264, 256>>>(a_full, m * k, 78);
        fill_random_fp8<<<264, 256>>>(w_full, k * n, 79);
        CHECK_CUDA(cudaDeviceSynchronize());
        CublasLt::Fp8Scales const scales{r0.scales, r0.scales + 1};
        auto run = lt->gemm(int(m), n, int(k), a_full, w_full, ref_out, stream, &scales);
        if (run) launches.push_back(run);
      }
      std::vector<float> const ms = interleaved_median_ms(launches, stream, 10, 30, 5);
      float const cublas = ms.size() > 1 ? ms[1] : NAN;
      std::printf("%-11s %6lld %6d %6lld %10.4f %10.4f %12.3f\n", name, (long long)m, n,
                  (long long)k, ms[0], cublas, cublas / ms[0]);
      if (wd.read_error().code != 0) std::printf("  device error recorded!\n");
      cudaFree(a_full);
      cudaFree(w_full);
      cudaFree(ref_out);
    }
  }

  // An FP8 shard has half a bf16 one's bytes: once the copies are bandwidth bound its push (copy
  // engine + release kernels) should take about half the time.
  std::printf("# push, rank 0 -> rank 1 on this GPU: bf16 vs e4m3 shard of rows x 4096\n");
  for (int rows : {1024, 4096, 8192}) {
    float push_ms[2];
    for (bool fp8 : {false, true}) {
      AgCase c{rows, 4096, 256, 2, true, false, AgGemmConfig{128, sms - 1, 8, 8}, fp8, false};
      AgWorld wd(c);
      int64_t const chunk_bytes = wd.plan.shard_bytes / wd.plan.chunks;
      cudaStream_t const s = wd.ranks[0].transfer[1];
      auto push = [&]() {
        if (fp8) {
          CHECK_CUDA(cudaMemcpyAsync(wd.ranks[1].inbox + wd.plan.scales_offset, wd.ranks[0].scales, sizeof(float),
                                     cudaMemcpyDeviceToDevice, s));
        }
        for (int k = 0; k < wd.plan.chunks; ++k) {
          CHECK_CUDA(cudaMemcpyAsync(wd.ranks[1].inbox + k * chunk_bytes,
                                     reinterpret_cast<char*>(wd.ranks[0].x) + k * chunk_bytes, chunk_bytes,
                                     cudaMemcpyDeviceToDevice, s));
          CHECK_CUDA(comm::launch_release(wd.ranks[1].flags + k, wd.call_epoch(), s));
        }
      };
      push_ms[fp8] = median_ms(push, s, 5, 30);
      std::printf("shard %5d x 4096 %-4s (%6.1f MB, %d chunks): %.4f ms, %.0f GB/s\n", rows, fp8 ? "e4m3" : "bf16",
                  wd.plan.shard_bytes / 1e6, wd.plan.chunks, push_ms[fp8], wd.plan.shard_bytes / (push_ms[fp8] * 1e6));
    }
    std::printf("  e4m3/bf16 push time %.3f\n", push_ms[1] / push_ms[0]);
  }
  return 0;
}

// Where ag_gemm's FP8 GEMM loses to cuBLASLt: its GEMM alone (chunks released) in the bench's config
// and in the producer's block order, the builds of fp8_order_variants.cu, the rows layout at W = 1
// (no peer, no waits), beside gemm_rs's producer on the same [M, K] x [K, N] (plain, and with order
// and flags) and cuBLASLt, in one interleaved round per shape and layout. profile: the rows layout of
// 8192 x 14336 x 8192 only, each launch made twice and not timed (for ncu).
int fp8_order_main(bool profile) {
  CublasLt const* lt = prepare_fp8_bench();
  int const sms = sm_count();
  struct Shape {
    int tokens, embed, mlp;
  };
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("# fp8 order: ms of the GEMM alone, e4m3 -> bf16, W = 2 (w1: W = 1); cublas/ours per column\n");
  for (int layout = 0; layout < (profile ? 1 : 2); ++layout) {
    bool const gather_k = layout > 0;
    for (Shape sh : {Shape{8192, 4096, 14336}, Shape{16384, 4096, 14336}, Shape{8192, 8192, 28672}}) {
      // profile: the shape where the builds differ most
      if (profile && sh.embed != 8192) continue;
      int const world = 2, n = sh.mlp / world;
      std::vector<std::unique_ptr<AgWorld>> worlds;
      std::vector<std::string> names;
      std::vector<std::function<void()>> launches;
      // ag_gemm's GEMM at W = 2 (8 chunks: the bench's config; 1 chunk in raster groups of 8: the
      // producer's block order), and the builds of fp8_order_variants.cu: in the rows layout in the
      // producer's order and at W = 1 (one rank holding every row, one chunk), in the contraction
      // layout in the bench's config.
      struct Run {
        int ranks, chunks, raster;
        AgVariant const* variant;
        bool again = false;  // the shipped build once more, on buffers of its own
      };
      std::vector<AgVariant> const variants = fp8_order_variants();
      std::vector<Run> runs{{world, 8, 8, nullptr}, {world, 1, 8, nullptr}};
      if (!gather_k) {
        for (AgVariant const& v : variants) runs.push_back(Run{world, 1, 8, &v});
        // How far one build moves on other buffers, at another place in the round: the shipped c1 r8 again.
        runs.push_back(Run{world, 1, 8, nullptr, true});
        runs.push_back(Run{1, 1, 16, nullptr});
        for (AgVariant const& v : variants) runs.push_back(Run{1, 1, 16, &v});
      } else {
        for (AgVariant const& v : variants)
          if (v.contraction) runs.push_back(Run{world, 8, 8, &v});
      }
      for (Run const& r : runs) {
        AgCase c{gather_k ? sh.tokens : sh.tokens / r.ranks, gather_k ? sh.embed / r.ranks : sh.embed, n, r.ranks, true,
                 gather_k, AgGemmConfig{128, sms - 1, r.raster, r.chunks}, true, gather_k};
        worlds.push_back(std::make_unique<AgWorld>(c));
        AgWorld& wd = *worlds.back();
        wd.fill_inputs(5);
        wd.poison_outputs();  // a block no build wrote stays NaN (0xFFFF), which no build's y may hold
        launches.push_back(released_fp8_gemm(wd, stream, r.variant));
        std::string const build = r.variant != nullptr ? std::string(r.variant->name) + "_" : r.again ? "again_" : "";
        names.push_back(build +
                        (r.ranks == 1 ? "w1_c" : "c") + std::to_string(wd.plan.chunks) + "r" + std::to_string(r.raster));
      }
      int const m = sh.tokens, k = sh.embed;  // both layouts: y [tokens, n], K the whole embedding
      Case pc{m, n, k, 2, true, GemmRsConfig{}, false, true};
      World pw(pc);
      pw.fill_inputs(3);
      ProblemShape const ps{m, n, k, 2, 0};
      for (int raster : {8, 16}) {
        GemmRsConfig const cfg{128, sms, 16, 512, raster};
        launches.push_back(producer_launcher(pw, ps, cfg, false, false, stream));
        names.push_back("plain_r" + std::to_string(raster));
      }
      launches.push_back(producer_launcher(pw, ps, GemmRsConfig{128, sms, 16, 512, 8}, true, true, stream));
      names.push_back("rs_r8");
      if (lt) {
        CublasLt::Fp8Scales const scales{pw.ranks[0].scales, pw.ranks[0].scales + 1};
        auto run = lt->gemm(m, n, k, pw.ranks[0].x, pw.ranks[0].w, pw.ranks[0].partial[1], stream, &scales);
        if (run) {
          launches.push_back(run);
          names.push_back("cublas");
        }
      }
      if (profile) {
        for (size_t i = 0; i < launches.size(); ++i) {
          std::printf("profile launches %zu-%zu: %s\n", 2 * i, 2 * i + 1, names[i].c_str());
          launches[i]();
          launches[i]();
        }
        CHECK_CUDA(cudaStreamSynchronize(stream));
        continue;
      }
      std::vector<float> const ms = interleaved_median_ms(launches, stream, 10, 30, 5);
      float const cublas = names.back() == "cublas" ? ms.back() : NAN;
      std::printf("%s M %d N %d K %d:", gather_k ? "contraction" : "rows", m, n, k);
      for (size_t i = 0; i < ms.size(); ++i) std::printf(" %s %.4f (%.3f)", names[i].c_str(), ms[i], cublas / ms[i]);
      std::printf("\n");
      // Every build computes the same blocks in the same k order: its y must be bitwise that of the
      // shipped build with the same ranks (the first run of that world size).
      std::string differ;
      std::vector<uint16_t> expected;
      for (size_t i = 0; i < runs.size(); ++i) {
        AgWorld& wd = *worlds[i];
        std::vector<uint16_t> y = wd.download(wd.ranks[0].y, size_t(wd.c.y_rows()) * wd.c.n);
        if (i == 0 || runs[i].ranks != runs[i - 1].ranks) {  // the shipped build of this world size
          if (std::count(y.begin(), y.end(), uint16_t(0xFFFF)) != 0) differ += " " + names[i] + "(unwritten blocks)";
          expected = std::move(y);
        } else if (y != expected) {
          differ += " " + names[i];
        }
      }
      std::printf("  outputs: %s\n", differ.empty() ? "every build bitwise equal to the shipped one of its world size"
                                                     : ("DIFFER:" + differ).c_str());
      for (auto& wd : worlds)
        if (wd->read_error().code != 0) std::printf("  device error recorded!\n");
    }
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace entwine::harness
