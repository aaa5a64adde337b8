// One-GPU harness for the producer and consumer kernels: W virtual ranks on one GPU (every rank's
// partials and flags in this GPU's memory, each rank's producer and consumer on its own streams),
// checked against a float64 host reference, plus the kernel benchmarks.
//   entwine_harness test              protocol + kernels, W in {1,2,4,8}, several epochs, deadline
//   entwine_harness ag test           ag_gemm: both layouts, W in {1,2,4,8}, both pushes, several
//                                     epochs, deadline, graphs
//   entwine_harness moe test          moe_dispatch_gemm, static capacity: W in {1,2,3,4}, E in {W, 2W},
//                                     C in {128, 256, 384}, both pushes, several epochs, deadline,
//                                     graphs; likewise moe_gemm_combine's GEMM
//   entwine_harness moe bench         each fused MoE call vs the same kernels one after the other,
//                                     the GEMMs alone, the transfers alone and cuBLASLt
//   entwine_harness moe wgrad test    the MoE weight gradients over ragged rows, W in {1,2,3,4}
//   entwine_harness moe wgrad bench   the same with all, 1/4, 1/8 of the rows vs cuBLASLt
//   entwine_harness ag bench          ag_gemm's GEMM alone (chunks released) vs cuBLASLt
//   entwine_harness ag push           one push alone, copy engines vs SM push, shards of 0.25-67 MB
//   entwine_harness sanitize [sequential]   small gemm_rs cases (for compute-sanitizer)
//   entwine_harness ag sanitize       small ag_gemm cases, both pushes (for compute-sanitizer)
//   entwine_harness bench [out.jsonl] [fused|producer|consumer]   fused one-rank grid sweep,
//                                     producer alone (order/flag costs), consumer bandwidth sweep
//   entwine_harness producer M N K block_n producer_sms raster_rows [plain]   (three launches, for ncu)
//   entwine_harness energy M N K [seconds] [names]   steady-state time, board power and energy per
//                                     GEMM of the producer and of every cuBLASLt algorithm
//   entwine_harness energy suite [seconds] [shapes]   the same on the design suite (its first
//                                     `shapes` shapes): order and flag costs and the ratio to
//                                     cuBLASLt's fastest algorithm, one line per shape
//   entwine_harness fp8 test          FP8 operands (e4m3, or x in e5m2 with w_t in e4m3; f32 scales)
//                                     of both ops against float64 of the dequantised inputs:
//                                     W in {1,2,4,8}, bf16/fp16 outputs,
//                                     per-shard and shared scales, both pushes, split tail, graphs,
//                                     a failed call's three outputs poisoned
//   entwine_harness api               the host cost of each CUDA call a handler makes
//   entwine_harness fp8 bench         the FP8 producer and ag_gemm's FP8 GEMM vs cuBLASLt's FP8 GEMM
//                                     on the design suite; an FP8 shard's push time vs a bf16 one
//   entwine_harness fp8 accuracy      the FP8 accumulation's error (positive operands, K to 32768)
//                                     against float64, ours and cuBLASLt's
//   entwine_harness fp8 order [profile]   ag_gemm's FP8 GEMM beside builds of its TMA warp
//                                     (fp8_order_variants.cu), the producer's GEMM and cuBLASLt,
//                                     every build's y checked bitwise (profile: one case, for ncu)
//   entwine_harness fp8block test     block-scaled FP8 (x per row and 128-wide K block, w_t per
//                                     128x128 block; x in e4m3 or e5m2): gemm_rs's GEMM and fused
//                                     call, ag_gemm's fused call in both layouts and both pushes,
//                                     against float64, W in {1,2,4,8}, split tail, graphs
//   entwine_harness fp8block bench    the block-scaled FP8 producer and ag_gemm GEMM vs their
//                                     per-tensor selves and cuBLASLt's block-scaled FP8 GEMM
// Each command's code is in the file of its concern; harness.h holds what they share.
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>

#include "harness/harness.h"

using namespace entwine::harness;

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string const mode = argc > 1 ? argv[1] : "test";
  if (mode == "test") return test_main();
  if (mode == "api") return api_main();
  if (mode == "sanitize") return sanitize_main(argc > 2 && std::string(argv[2]) == "sequential");
  if (mode == "ag" && argc > 2 && std::string(argv[2]) == "test") return ag_test_main();
  if (mode == "ag" && argc > 2 && std::string(argv[2]) == "bench") return ag_bench_main();
  if (mode == "ag" && argc > 2 && std::string(argv[2]) == "push") return ag_push_main();
  if (mode == "ag" && argc > 2 && std::string(argv[2]) == "sanitize") return ag_sanitize_main();
  if (mode == "moe" && argc > 2 && std::string(argv[2]) == "test") return moe_test_main();
  if (mode == "moe" && argc > 2 && std::string(argv[2]) == "bench") return moe_bench_main();
  if (mode == "moe" && argc > 3 && std::string(argv[2]) == "wgrad" && std::string(argv[3]) == "test") {
    return moe_wgrad_test_main();
  }
  if (mode == "moe" && argc > 3 && std::string(argv[2]) == "wgrad" && std::string(argv[3]) == "bench") {
    return moe_wgrad_bench_main();
  }
  if (mode == "fp8" && argc > 2 && std::string(argv[2]) == "test") return fp8_test_main();
  if (mode == "fp8" && argc > 2 && std::string(argv[2]) == "bench") return fp8_bench_main();
  if (mode == "fp8" && argc > 2 && std::string(argv[2]) == "accuracy") return fp8_accuracy_main();
  if (mode == "fp8" && argc > 2 && std::string(argv[2]) == "order") {
    return fp8_order_main(argc > 3 && std::string(argv[3]) == "profile");
  }
  if (mode == "fp8block" && argc > 2 && std::string(argv[2]) == "test") return fp8block_test_main();
  if (mode == "fp8block" && argc > 2 && std::string(argv[2]) == "bench") return fp8block_bench_main();
  if (mode == "bench") return bench_main(argc > 2 && argv[2][0] ? argv[2] : nullptr, argc > 3 ? argv[3] : nullptr);
  if (mode == "producer" && (argc == 8 || argc == 9)) return producer_main(argc, argv);
  if (mode == "energy" && argc >= 3 && std::string(argv[2]) == "suite") {
    int const count = argc > 4 ? std::atoi(argv[4]) : 0;
    auto const end = count > 0 && count < int(std::size(kDesignSuite)) ? std::begin(kDesignSuite) + count
                                                                        : std::end(kDesignSuite);
    return energy_main(true, {std::begin(kDesignSuite), end}, argc > 3 ? std::atof(argv[3]) : 1.0, false);
  }
  if (mode == "energy" && argc >= 5) {
    return energy_main(false, {{std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4])}},
                       argc > 5 ? std::atof(argv[5]) : 1.0, argc > 6 && std::string(argv[6]) == "names");
  }
  std::fprintf(stderr,
               "usage: entwine_harness test | sanitize [sequential] | bench [out.jsonl] [fused|producer|consumer]\n"
               "       entwine_harness ag test | ag sanitize | ag bench | ag push | moe test | moe bench | moe wgrad test | moe wgrad bench | fp8 test | fp8 bench | fp8 accuracy | fp8 order [profile] | api\n"
               "       entwine_harness fp8block test | fp8block bench\n"
               "       entwine_harness producer M N K block_n producer_sms raster_rows [plain]\n"
               "       entwine_harness energy M N K [seconds] [names] | energy suite [seconds] [shapes]\n");
  return 2;
}
