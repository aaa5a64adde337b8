// moe's part of the nanobind module (see bind.h): the FFI targets of moe_dispatch_gemm,
// moe_gemm_combine, their FP8 twins, moe_transfer and the experts' weight gradients
// (MOE_DISPATCH_GEMM_TARGET, MOE_DISPATCH_GEMM_FP8_TARGET, MOE_GEMM_COMBINE_TARGET,
// MOE_GEMM_COMBINE_FP8_TARGET, MOE_TRANSFER_TARGET, MOE_WEIGHT_GRAD_TARGET),
// their plans, which Python asks instead of restating the kernels' shape rules, and its communicator
// hooks.
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "bind.h"
#include "comm/comm.h"
#include "moe/moe.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

// Defined by XLA_FFI_DEFINE_HANDLER_SYMBOL in moe/handler.cc.
extern "C" XLA_FFI_Error* MoeDispatchGemm(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* MoeDispatchGemmFp8(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* MoeGemmCombine(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* MoeGemmCombineFp8(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* MoeTransfer(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* MoeWeightGrad(XLA_FFI_CallFrame* call_frame);

namespace entwine::moe {

namespace {

// The kernels' type of x_send from its numpy dtype name.
DType input_dtype(std::string const& name) {
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kFP16;
  return fp8_input_dtype(name);
}

// A plan as Python reads it: {error: None or the violated rule, e_local, num_blocks, grid,
// inbox_bytes, flags_per_source, push_grid, sms_needed} (moe_transfer's: no GEMM, num_blocks and
// grid 0).
nb::dict plan_dict(MoePlan const& p) {
  nb::dict d;
  d["error"] = rule_or_none(p.error);
  d["e_local"] = p.e_local;
  d["num_blocks"] = p.num_blocks;
  d["grid"] = p.grid;
  d["inbox_bytes"] = p.inbox_bytes;
  d["flags_per_source"] = p.e_local;
  d["push_grid"] = p.push_grid;
  d["sms_needed"] = p.sms_needed;
  return d;
}

}  // namespace

void bind(nb::module_& m, FfiTargets& targets) {
  constexpr const char* kTarget = "entwine_moe_dispatch_gemm";
  m.attr("MOE_DISPATCH_GEMM_TARGET") = kTarget;
  constexpr const char* kFp8Target = "entwine_moe_dispatch_gemm_fp8";
  m.attr("MOE_DISPATCH_GEMM_FP8_TARGET") = kFp8Target;
  constexpr const char* kCombineTarget = "entwine_moe_gemm_combine";
  m.attr("MOE_GEMM_COMBINE_TARGET") = kCombineTarget;
  constexpr const char* kCombineFp8Target = "entwine_moe_gemm_combine_fp8";
  m.attr("MOE_GEMM_COMBINE_FP8_TARGET") = kCombineFp8Target;
  constexpr const char* kTransferTarget = "entwine_moe_transfer";
  m.attr("MOE_TRANSFER_TARGET") = kTransferTarget;
  targets.push_back({kTarget, reinterpret_cast<void*>(MoeDispatchGemm), false});
  targets.push_back({kFp8Target, reinterpret_cast<void*>(MoeDispatchGemmFp8), true});
  targets.push_back({kCombineTarget, reinterpret_cast<void*>(MoeGemmCombine), false});
  targets.push_back({kCombineFp8Target, reinterpret_cast<void*>(MoeGemmCombineFp8), true});
  targets.push_back({kTransferTarget, reinterpret_cast<void*>(MoeTransfer), false});
  constexpr const char* kWeightGradTarget = "entwine_moe_weight_grad";
  m.attr("MOE_WEIGHT_GRAD_TARGET") = kWeightGradTarget;
  targets.push_back({kWeightGradTarget, reinterpret_cast<void*>(MoeWeightGrad), false});
  comm::register_op(&kHooks);
  m.def("moe_plan",
        [](int world, int experts, int capacity, int k, int n, std::string const& x_dtype, int block_n, int gemm_sms,
           int raster_rows, int push_sms) {
          MoePlan const p = moe_plan(MoeProblem{world, 0, experts, capacity, k, n, input_dtype(x_dtype)},
                                     MoeConfig{block_n, gemm_sms, raster_rows, push_sms});
          return plan_dict(p);
        },
        nb::arg("world"), nb::arg("experts"), nb::arg("capacity"), nb::arg("k"), nb::arg("n"), nb::arg("x_dtype"),
        nb::arg("block_n"), nb::arg("gemm_sms"), nb::arg("raster_rows"), nb::arg("push_sms"),
        "moe_dispatch_gemm's plan of one call (ffi/moe/moe.h) of x_send [experts, capacity, k] (x_dtype: bfloat16, "
        "float16, float8_e4m3fn or float8_e5m2) and w [experts/world, k, n]: {error: None or the violated rule, "
        "e_local, num_blocks, grid, inbox_bytes, flags_per_source, push_grid, sms_needed}.");
  m.def("moe_combine_plan",
        [](int world, int experts, int capacity, int k, int n, std::string const& x_dtype, int block_n, int gemm_sms,
           int raster_rows) {
          MoePlan const p = moe_combine_plan(MoeProblem{world, 0, experts, capacity, k, n, input_dtype(x_dtype)},
                                             MoeConfig{block_n, gemm_sms, raster_rows, 0});
          return plan_dict(p);
        },
        nb::arg("world"), nb::arg("experts"), nb::arg("capacity"), nb::arg("k"), nb::arg("n"), nb::arg("x_dtype"),
        nb::arg("block_n"), nb::arg("gemm_sms"), nb::arg("raster_rows"),
        "moe_gemm_combine's plan (ffi/moe/moe.h) of h [experts/world, world * capacity, k] (bfloat16, float16, "
        "float8_e4m3fn or float8_e5m2) and w2 [experts/world, k, n] (FP8: w2_t [experts/world, n, k]), as moe_plan's.");
  m.def("moe_wgrad_plan",
        [](int world, int e_local, int capacity, int m, int n, std::string const& dtype, int block_n, int gemm_sms,
           int raster_rows) {
          MoeWgradPlan const p = moe_wgrad_plan(MoeWgradProblem{world, e_local, capacity, m, n, input_dtype(dtype)},
                                                MoeConfig{block_n, gemm_sms, raster_rows, 0});
          nb::dict d;
          d["error"] = rule_or_none(p.error);
          d["num_blocks"] = p.schedule.num_blocks;
          d["grid"] = p.schedule.grid;
          return d;
        },
        nb::arg("world"), nb::arg("e_local"), nb::arg("capacity"), nb::arg("m"), nb::arg("n"), nb::arg("dtype"),
        nb::arg("block_n"), nb::arg("gemm_sms"), nb::arg("raster_rows"),
        "The experts' weight-gradient GEMM's plan (ffi/moe/moe.h, MoeWgradPlan) of a_t [e_local, m, world * "
        "capacity] and dy [e_local, world * capacity, n] (bfloat16 or float16): {error: None or the violated rule, "
        "num_blocks, grid}.");
  m.def("moe_transfer_plan",
        [](int world, int experts, int capacity, int64_t row_bytes, int push_sms) {
          MoePlan const p = moe_transfer_plan(world, 0, experts, capacity, row_bytes, push_sms);
          return plan_dict(p);
        },
        nb::arg("world"), nb::arg("experts"), nb::arg("capacity"), nb::arg("row_bytes"), nb::arg("push_sms"),
        "moe_transfer's plan (ffi/moe/moe.h) of send [experts, capacity, ...] with row_bytes bytes per row, as "
        "moe_plan's (no GEMM).");
}

}  // namespace entwine::moe
