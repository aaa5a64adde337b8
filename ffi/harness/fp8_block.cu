// Block-scaled FP8 (DeepSeek-V3 / TransformerEngine recipe: x scaled per row and 128-wide K block,
// w_t per 128x128 block): `fp8block test` (gemm_rs's GEMM and the fused call against float64 of the
// dequantised inputs, the plan's rules) and `fp8block bench` (the producer GEMM against the
// per-tensor FP8 one and cuBLASLt's block-scaled FP8 GEMM).
#include <cmath>

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
  std::printf("harness fp8block test: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

// gemm_rs's producer, e4m3 -> bf16, W = 2 (publishing, interleaved: as in a call), block-scaled
// against the same producer per tensor and cuBLASLt's block-scaled FP8 GEMM, in interleaved
// rounds on the design suite; the geometric means of the ratios at the end.
int fp8block_bench_main() {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  CublasLt const* lt = CublasLt::load();
  if (!lt) std::printf("(libcublasLt.so.13 not found: no cuBLAS column)\n");
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
    // cuBLASLt's scales: ones, in buffers padded beyond its layouts' sizes (the timing does not
    // depend on the values).
    float* lt_scales = nullptr;
    if (lt) {
      size_t const k_blocks = (c.k + 127) / 128 + 4, x_count = k_blocks * (size_t(c.m) + 128),
                   w_count = k_blocks * (size_t(c.n) / 128 + 4);
      std::vector<float> const ones(x_count + w_count, 1.0f);
      CHECK_CUDA(cudaMalloc(&lt_scales, ones.size() * sizeof(float)));
      CHECK_CUDA(cudaMemcpy(lt_scales, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
      CublasLt::Fp8Scales const scales{lt_scales, lt_scales + x_count, true};
      auto run = lt->gemm(c.m, c.n, c.k, world.ranks[0].x, world.ranks[0].w, world.ranks[0].partial[1], stream, &scales);
      if (run) launches.push_back(run);
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
    cudaFree(lt_scales);
  }
  std::printf("geomean tensor/block %.3f over %d shapes", std::exp(log_tensor / std::max(shapes, 1)), shapes);
  if (cublas_shapes > 0) {
    std::printf(", cublas/block %.3f over %d shapes", std::exp(log_cublas / cublas_shapes), cublas_shapes);
  }
  std::printf("\n(ag_gemm's block-scaled GEMM: not built yet)\n");
  return 0;
}

}  // namespace entwine::harness
