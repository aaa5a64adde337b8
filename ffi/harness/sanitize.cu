// Small cases of both ops for compute-sanitizer (scripts/sanitize.sh): `sanitize [sequential]`
// and `ag sanitize`.
#include "harness/ag_world.h"
#include "harness/gemm_rs_world.h"

namespace entwine::harness {

// sequential: producers before consumers (racecheck slows the producer past any deadline).
int sanitize_main(bool sequential) {
  CHECK_CUDA(gemm_rs::prepare_kernels());
  run_case(Case{2 * 128, 256, 72, 2, true, GemmRsConfig{128, 0, 2, 128}}, 2, sequential, true);
  run_case(Case{128, 2 * 256, 72, 2, true, GemmRsConfig{256, 0, 2, 128}, true}, 2, sequential, true);
  // Split tail (B 16, G 5, R 1, T 20); 4 consumer steps per CTA reuse the waiter's handoff words.
  run_case(Case{2 * 256, 512, 1280, 2, true, GemmRsConfig{128, 5, 2, 128, 8, 1}}, 2, sequential, true);
  std::printf("harness sanitize: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

// Small cases of both layouts and both pushes for compute-sanitizer (pushes, releases and GEMMs as
// in `ag test`; the GEMM's waits see the pushes land while it runs).
int ag_sanitize_main() {
  CHECK_CUDA(ag_gemm::prepare_kernels());
  CHECK_CUDA(comm::prepare_epoch_kernel());
  run_ag_case(AgCase{256, 136, 256, 2, true, false, ag_config_for(2, 128, 8, 2)}, 2);
  run_ag_case(AgCase{256, 136, 512, 2, true, true, ag_config_for(2, 256, 8, 2)}, 2);
  run_ag_case(AgCase{256, 136, 256, 2, true, false, ag_config_for(2, 128, 8, 2, 3)}, 2);  // the SM push
  std::printf("harness ag sanitize: %d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace entwine::harness
