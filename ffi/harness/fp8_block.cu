// Block-scaled FP8 (DeepSeek-V3 / TransformerEngine recipe: x scaled per row and 128-wide K block,
// w_t per 128x128 block): `fp8block test` (gemm_rs's GEMM and fused call, ag_gemm's fused call in
// both layouts, against float64 of the dequantised inputs; the plans' rules) and `fp8block bench`
// (gemm_rs's producer GEMM and ag_gemm's GEMM against their per-tensor FP8 selves and cuBLASLt's
// block-scaled FP8 GEMM).
#include <cmath>

#include "harness/ag_world.h"
#include "harness/gemm_rs_world.h"

namespace entwine::harness {

namespace {

// A block-scaled case of gemm_rs (Case with fp8 and block_scaled set).
Case block_case(int m, int n, int k, int world, bool bf16, GemmRsConfig const& config, bool scatter_cols = false,
                bool x_e5m2 = false) {
  Case c{m, n, k, world, bf16, config, scatter_cols, true, x_e5m2};
  c.block_scaled = true;
  return c;
}

// A block-scaled case of ag_gemm (every shard's scales travel with it).
AgCase ag_block_case(int rows, int cols, int n, int world, bool bf16, bool gather_k, AgGemmConfig const& config,
                     bool x_e5m2 = false) {
  AgCase c{rows, cols, n, world, bf16, gather_k, config, true, false, x_e5m2};
  c.block_scaled = true;
  return c;
}

}  // namespace

// Every case checks the whole output and each row's 128-column segments (World::check) and each
// rank's partial, the GEMM's own output (check_partials), over several epochs and a bitwise repeat.
// The scales are powers of two spread over three orders of magnitude per block (BlockScales).
int fp8block_test_main() {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  GemmRsConfig const base{128, 0, 8, 512};
  // The GEMM alone (W = 1: the partial is the product), then W in {2, 4, 8}; 3 K blocks.
  for (int world : {1, 2, 4, 8}) {
    for (bool bf16 : {true, false}) run_case(block_case(world * 256, 512, 384, world, bf16, base), 3, false, true);
  }
  // Persistent grid with several blocks per CTA, scatter over columns, a split tail (B 128, G 7,
  // R 2, T 32: a block's K blocks in two CTAs' pieces), a long K (128 K blocks).
  run_case(block_case(2 * 512, 1024, 1024, 2, true, GemmRsConfig{128, 100, 8, 256}), 3, false, true);
  run_case(block_case(512, 4 * 384, 256, 4, false, GemmRsConfig{128, 0, 8, 256, 3}, true), 2, false, true);
  run_case(block_case(2 * 1024, 1024, 4096, 2, true, GemmRsConfig{128, 7, 8, 512, 8, 1}), 2, false, true);
  run_case(block_case(2 * 256, 512, 16384, 2, true, base), 1, false, true);
  run_graph<World>(block_case(2 * 512, 1024, 256, 2, true, GemmRsConfig{128, 0, 16, 512}), 4);
  // x in e5m2 (the backward's gradient), w_t in e4m3: the same kernel with A e5m2.
  for (int world : {1, 2, 4}) {
    for (bool bf16 : {true, false}) {
      run_case(block_case(world * 256, 512, 384, world, bf16, base, false, true), 2, false, true);
    }
  }
  run_case(block_case(512, 4 * 384, 256, 4, false, GemmRsConfig{128, 0, 8, 256, 3}, true, true), 2, false, true);
  run_case(block_case(2 * 1024, 1024, 4096, 2, true, GemmRsConfig{128, 7, 8, 512, 8, 1}, false, true), 2, false, true);

  // The plan's rules: K whole scale blocks, FP8 only; M and N pad as per tensor.
  GemmRsProblem problem{200, 300, 256, 1, 0, false, DType::kE4M3, Scaling::kBlock};
  GemmRsPlan const padded = gemm_rs_plan(problem, base);
  expect(padded.error == nullptr && padded.scaling == Scaling::kBlock && padded.shape.m == 256 &&
             padded.shape.n == 384 && padded.shape.k == 256 && padded.schedule.k_tiles == 2,
         "fp8block plan: M 200 and N 300 pad to 256 and 384, K 256 is 2 k-tiles, the plan keeps the scaling");
  problem.k = 200;
  GemmRsPlan const k_tail = gemm_rs_plan(problem, base);
  expect(k_tail.error != nullptr && !k_tail.config_error, std::string("fp8block plan: K 200 is refused (") +
                                                               (k_tail.error ? k_tail.error : "no error") + ")");
  problem.k = 256;
  problem.input = DType::kBF16;
  expect(gemm_rs_plan(problem, base).error != nullptr, "fp8block plan: bf16 operands are refused");
  problem.input = DType::kE5M2;
  expect(gemm_rs_plan(problem, base).error == nullptr, "fp8block plan: x in e5m2 is planned");

  // ag_gemm: rows and contraction layouts (each source's K slice scaled by its own scales), W in
  // {1,2,4,8}, odd chunk counts, the copy engines and the SM push (scales copied by its CTAs), a
  // graph, x in e5m2.
  CHECK_CUDA(ag_gemm::prepare_kernels());
  for (int world : {1, 2, 4, 8}) {
    for (bool gather_k : {false, true}) {
      for (bool bf16 : {true, false}) {
        run_ag_case(ag_block_case(256, 384, 512, world, bf16, gather_k, ag_config_for(world, 128)), 3);
      }
    }
  }
  run_ag_case(ag_block_case(768, 256, 384, 2, true, false, ag_config_for(2, 128, 2, 3)), 2);
  run_ag_case(ag_block_case(768, 256, 384, 4, false, true, ag_config_for(4, 128, 4, 6)), 2);
  run_ag_case(ag_block_case(1024, 1024, 2048, 8, true, false, ag_config_for(8, 128, 8, 8)), 2);
  for (int world : {2, 4, 8}) {
    for (bool gather_k : {false, true}) {
      run_ag_case(ag_block_case(256, 384, 512, world, true, gather_k, ag_config_for(world, 128, 8, 8, 4)), 3);
    }
  }
  run_ag_case(ag_block_case(768, 256, 384, 4, true, true, ag_config_for(4, 128, 4, 6, 8)), 2);
  run_graph<AgWorld>(ag_block_case(768, 256, 384, 2, true, false, ag_config_for(2, 128, 2, 3)), 4);
  run_graph<AgWorld>(ag_block_case(768, 256, 384, 2, true, true, ag_config_for(2, 128, 2, 3, 4)), 4);
  for (bool gather_k : {false, true}) {
    for (bool bf16 : {true, false}) {
      run_ag_case(ag_block_case(256, 384, 512, 4, bf16, gather_k, ag_config_for(4, 128), true), 2);
    }
  }
  // ag_gemm's plan: cols whole scale blocks, the inbox's scale region, shared_scale changes nothing.
  AgProblem ag{128, 256, 256, 2, 0, true, DType::kE4M3, false, Scaling::kBlock};
  AgPlan const ag_ok = ag_plan(ag, AgGemmConfig{128});
  expect(ag_ok.error == nullptr && ag_ok.scaling == Scaling::kBlock && ag_ok.scale_k_blocks == 2 &&
             ag_ok.inbox_bytes == 2 * ag_ok.shard_bytes + 2 * 2 * 128 * int64_t(sizeof(float)),
         "fp8block ag plan: gather_k with block scales, cols 256 is 2 K blocks, the inbox ends with [2, W * 128] scales");
  ag.cols = 200;
  expect(ag_plan(ag, AgGemmConfig{128}).error != nullptr, "fp8block ag plan: cols 200 is refused");
  ag.cols = 256;
  ag.shared_scale = true;
  AgPlan const ag_shared = ag_plan(ag, AgGemmConfig{128});
  expect(ag_shared.error == nullptr && ag_shared.inbox_bytes == ag_ok.inbox_bytes,
         "fp8block ag plan: shared_scale is planned as not shared (block scales always travel)");
  std::printf("harness fp8block test: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

namespace {

// cuBLASLt's block scales for an [m, k] x [n, k]^T GEMM: ones (the timing does not depend on the
// values), in a buffer padded beyond its layouts' sizes; returns the launcher or an empty one.
struct LtBlockScales {
  float* ones = nullptr;
  std::function<void()> gemm(CublasLt const* lt, int m, int n, int k, void const* x, void const* w, void* y,
                             cudaStream_t stream) {
    if (!lt) return {};
    size_t const k_blocks = size_t(k + 127) / 128 + 4, x_count = k_blocks * (size_t(m) + 128),
                 w_count = k_blocks * (size_t(n) / 128 + 4);
    std::vector<float> const host(x_count + w_count, 1.0f);
    CHECK_CUDA(cudaMalloc(&ones, host.size() * sizeof(float)));
    CHECK_CUDA(cudaMemcpy(ones, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
    CublasLt::Fp8Scales const scales{ones, ones + x_count, true};
    return lt->gemm(m, n, k, x, w, y, stream, &scales);
  }
  ~LtBlockScales() { cudaFree(ones); }
};

}  // namespace

// gemm_rs's producer, e4m3 -> bf16, W = 2 (publishing, interleaved: as in a call), and ag_gemm's
// GEMM alone (chunks released), block-scaled against the same GEMM per tensor and cuBLASLt's
// block-scaled FP8 GEMM of the same FLOPs, in interleaved rounds on the shapes of `fp8 bench`; the
// geometric means of the ratios at the end.
int fp8block_bench_main() {
  CublasLt const* lt = prepare_fp8_bench();
  int const sms = sm_count();
  std::printf("# gemm_rs producer, e4m3 -> bf16, W = 2, median ms of interleaved rounds; goal cublas/block >= 0.95\n");
  std::printf("%6s %6s %5s %10s %10s %10s %8s %13s %13s\n", "M", "N", "K", "block_ms", "tensor_ms", "cublas_ms",
              "TF/s", "cublas/block", "tensor/block");
  double log_cublas = 0, log_tensor = 0;
  int cublas_shapes = 0, shapes = 0;
  for (auto const& sh : kDesignSuite) {
    Case const c = block_case(sh[0], sh[1], sh[2], 2, true, GemmRsConfig{});
    World world(c);
    world.fill_inputs(3);
    cudaStream_t const stream = world.ranks[0].producer_stream;
    ProblemShape const s{c.m, c.n, c.k, 2, 0};
    GemmRsConfig const cfg{128, sms, 16, 512, 8};
    ProducerArgs const block_args = world.producer_args(0);
    ProducerArgs tensor_args = block_args;
    tensor_args.x_scale = world.ranks[0].scales;
    tensor_args.w_scale = world.ranks[0].scales + 1;
    GemmRsPlan const block_plan = Case::plan_of(s, cfg, DType::kE4M3, Scaling::kBlock);
    GemmRsPlan const tensor_plan = Case::plan_of(s, cfg, DType::kE4M3, Scaling::kTensor);
    std::vector<std::function<void()>> launches{
        [=] { CHECK_CUDA(gemm_rs::launch_gemm(DType::kE4M3, DType::kBF16, block_plan, block_args, stream)); },
        [=] { CHECK_CUDA(gemm_rs::launch_gemm(DType::kE4M3, DType::kBF16, tensor_plan, tensor_args, stream)); }};
    LtBlockScales lt_scales;
    if (auto run = lt_scales.gemm(lt, c.m, c.n, c.k, world.ranks[0].x, world.ranks[0].w, world.ranks[0].partial[1], stream)) {
      launches.push_back(run);
    }
    std::vector<float> const ms = interleaved_median_ms(launches, stream);
    float const cublas = ms.size() > 2 ? ms[2] : NAN;
    std::printf("%6d %6d %5d %10.4f %10.4f %10.4f %8.0f %13.3f %13.3f\n", c.m, c.n, c.k, ms[0], ms[1], cublas,
                2.0 * c.m * c.n * c.k / (ms[0] * 1e-3) / 1e12, cublas / ms[0], ms[1] / ms[0]);
    log_tensor += std::log(ms[1] / ms[0]);
    ++shapes;
    if (ms.size() > 2) {
      log_cublas += std::log(cublas / ms[0]);
      ++cublas_shapes;
    }
    if (world.read_error().code != 0) std::printf("  device error recorded!\n");
  }
  auto geomeans = [&](char const* what) {
    std::printf("%s: geomean tensor/block %.3f over %d shapes", what, std::exp(log_tensor / std::max(shapes, 1)), shapes);
    if (cublas_shapes > 0) {
      std::printf(", cublas/block %.3f over %d shapes", std::exp(log_cublas / cublas_shapes), cublas_shapes);
    }
    std::printf("\n");
    log_tensor = log_cublas = 0;
    shapes = cublas_shapes = 0;
  };
  geomeans("gemm_rs producer");

  std::printf("# ag_gemm GEMM alone (chunks released), e4m3 -> bf16, W = 2\n");
  std::printf("%-11s %6s %6s %6s %10s %10s %10s %13s %13s\n", "layout", "M", "N", "K", "block_ms", "tensor_ms",
              "cublas_ms", "cublas/block", "tensor/block");
  struct Shape {
    int tokens, embed, mlp;
  };
  for (bool gather_k : {false, true}) {
    for (Shape sh : {Shape{8192, 4096, 14336}, Shape{16384, 4096, 14336}, Shape{8192, 8192, 28672}}) {
      int const world = 2, n = sh.mlp / world;
      AgCase const c = ag_block_case(gather_k ? sh.tokens : sh.tokens / world, gather_k ? sh.embed / world : sh.embed,
                                     n, world, true, gather_k, AgGemmConfig{128, sms - 1, 8, 8});
      AgWorld wd(c);
      wd.fill_inputs(5);
      CHECK_CUDA(cudaMemset(wd.ranks[0].flags, 0xFF, 2 * wd.plan.flags * sizeof(uint64_t)));
      // The peers' shards in the inbox: e4m3 bytes; their scales (both kinds' regions): ones.
      fill_random_fp8<<<264, 256>>>(reinterpret_cast<uint8_t*>(wd.ranks[0].inbox), wd.plan.scales_offset, 77);
      std::vector<float> const ones(size_t(wd.plan.inbox_bytes - wd.plan.scales_offset) / sizeof(float), 1.0f);
      CHECK_CUDA(cudaMemcpy(wd.ranks[0].inbox + wd.plan.scales_offset, ones.data(), ones.size() * sizeof(float),
                            cudaMemcpyHostToDevice));
      auto& r0 = wd.ranks[0];
      cudaStream_t const stream = r0.gemm;
      AgGemmArgs block_args{r0.x, r0.inbox, r0.w, r0.y, r0.flags, wd.error, nullptr, wd.call_epoch(), wd.timeout_ns};
      AgGemmArgs tensor_args = block_args;
      block_args.x_scale = r0.x_block_scales;
      block_args.w_scale = r0.w_block_scales;
      tensor_args.x_scale = r0.scales;
      tensor_args.w_scale = r0.scales + 1;
      AgPlan const block_plan = wd.plan;
      AgProblem tensor_problem = c.problem(0);
      tensor_problem.scaling = Scaling::kTensor;
      tensor_problem.shared_scale = gather_k;  // per-tensor gather_k needs one shared scale
      AgPlan const tensor_plan = ag_plan(tensor_problem, c.config);
      std::vector<std::function<void()>> launches{
          [=] { CHECK_CUDA(ag_gemm::launch_gemm(DType::kE4M3, DType::kBF16, block_plan, block_args, stream)); },
          [=] { CHECK_CUDA(ag_gemm::launch_gemm(DType::kE4M3, DType::kBF16, tensor_plan, tensor_args, stream)); }};
      int64_t const m = c.y_rows(), k = gather_k ? int64_t(world) * c.cols : c.cols;
      uint8_t *a_full = nullptr, *w_full = nullptr;
      uint16_t* ref_out = nullptr;
      LtBlockScales lt_scales;
      if (lt) {
        // The same FLOPs as one [M, K] x [N, K]^T FP8 GEMM.
        CHECK_CUDA(cudaMalloc(&a_full, size_t(m) * k));
        CHECK_CUDA(cudaMalloc(&w_full, size_t(k) * n));
        CHECK_CUDA(cudaMalloc(&ref_out, size_t(m) * n * 2));
        fill_random_fp8<<<264, 256>>>(a_full, m * k, 78);
        fill_random_fp8<<<264, 256>>>(w_full, k * n, 79);
        CHECK_CUDA(cudaDeviceSynchronize());
        if (auto run = lt_scales.gemm(lt, int(m), n, int(k), a_full, w_full, ref_out, stream)) launches.push_back(run);
      }
      std::vector<float> const ms = interleaved_median_ms(launches, stream, 10, 30, 5);
      float const cublas = ms.size() > 2 ? ms[2] : NAN;
      std::printf("%-11s %6lld %6d %6lld %10.4f %10.4f %10.4f %13.3f %13.3f\n", gather_k ? "contraction" : "rows",
                  (long long)m, n, (long long)k, ms[0], ms[1], cublas, cublas / ms[0], ms[1] / ms[0]);
      log_tensor += std::log(ms[1] / ms[0]);
      ++shapes;
      if (ms.size() > 2) {
        log_cublas += std::log(cublas / ms[0]);
        ++cublas_shapes;
      }
      if (wd.read_error().code != 0) std::printf("  device error recorded!\n");
      cudaFree(a_full);
      cudaFree(w_full);
      cudaFree(ref_out);
    }
  }
  geomeans("ag_gemm GEMM");
  return 0;
}

}  // namespace entwine::harness
