// ag_gemm's part of the nanobind module (see bind.h): its FFI targets (AG_GEMM_TARGET and, for FP8
// operands, AG_GEMM_FP8_TARGET), the plans that Python asks instead of restating the kernels' shape
// rules, and its communicator hooks.
#include <nanobind/nanobind.h>

#include "ag_gemm/ag_gemm.h"
#include "bind.h"
#include "comm/comm.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

// Defined by XLA_FFI_DEFINE_HANDLER_SYMBOL in ag_gemm/handler.cc.
extern "C" XLA_FFI_Error* AgGemm(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AgGemmFp8(XLA_FFI_CallFrame* call_frame);

namespace entwine::ag_gemm {

void bind(nb::module_& m, FfiTargets& targets) {
  // The XLA FFI target names, spelled only here: Python reads them from the module.
  constexpr const char* kTarget = "entwine_ag_gemm";
  constexpr const char* kFp8Target = "entwine_ag_gemm_fp8";
  m.attr("AG_GEMM_TARGET") = kTarget;
  m.attr("AG_GEMM_FP8_TARGET") = kFp8Target;
  m.attr("AG_GEMM_MAX_WEIGHTS") = kMaxWeights;
  targets.push_back({kTarget, reinterpret_cast<void*>(AgGemm), false});
  targets.push_back({kFp8Target, reinterpret_cast<void*>(AgGemmFp8), true});
  comm::register_op(&kHooks);

  // The plan of one call of an unpadded shard [rows, cols] and N = n as a dict.
  auto plan_dict = [](AgProblem const& problem, AgGemmConfig const& config) {
    AgPlan const p = ag_plan(problem, config);
    nb::dict d;
    d["error"] = rule_or_none(p.error);
    d["rows_pad"] = p.rows_pad;
    d["cols_pad"] = p.cols_pad;
    d["n_pad"] = p.n_pad;
    d["chunks"] = p.chunks;
    d["chunk_tiles"] = p.chunk_tiles;
    d["num_blocks"] = p.num_blocks;
    d["grid"] = p.grid;
    d["k_tiles"] = p.k_tiles;
    d["inbox_bytes"] = p.inbox_bytes;
    d["shard_bytes"] = p.shard_bytes;
    d["flags"] = p.flags;
    d["push_grid"] = p.push_grid;
    d["sms_needed"] = p.sms_needed;
    d["block_scaled"] = p.scaling == Scaling::kBlock;
    d["scale_k_blocks"] = p.scale_k_blocks;
    return d;
  };
  // What both return (a string literal, so that the docstrings below are literals too).
#define ENTWINE_AG_PLAN_RETURNS                                                                                 \
  "{error: None or the violated rule, rows_pad, cols_pad, n_pad, chunks, chunk_tiles, num_blocks, grid, k_tiles, " \
  "inbox_bytes, shard_bytes, flags, push_grid, sms_needed, block_scaled, scale_k_blocks}."
  m.def("ag_plan",
        [plan_dict](int rows, int cols, int n, int world, bool gather_k, int block_n, int gemm_sms, int raster_rows,
                    int max_chunks, int push_sms) {
          return plan_dict(AgProblem{rows, cols, n, world, 0, gather_k},
                           AgGemmConfig{block_n, gemm_sms, raster_rows, max_chunks, push_sms});
        },
        nb::arg("rows"), nb::arg("cols"), nb::arg("n"), nb::arg("world"), nb::arg("gather_k"), nb::arg("block_n"),
        nb::arg("gemm_sms"), nb::arg("raster_rows"), nb::arg("max_chunks"), nb::arg("push_sms"),
        "ag_gemm's plan of one call (ffi/ag_gemm/ag_gemm.h) of an unpadded bf16 or fp16 shard [rows, cols] and "
        "N = n: " ENTWINE_AG_PLAN_RETURNS);
  m.def("ag_gemm_fp8_plan",
        [plan_dict](int rows, int cols, int n, int world, bool gather_k, int block_n, int gemm_sms, int raster_rows,
                    int max_chunks, int push_sms, bool shared_scale, std::string const& x_dtype, bool block_scaled) {
          return plan_dict(AgProblem{rows, cols, n, world, 0, gather_k, fp8_input_dtype(x_dtype), shared_scale,
                                     block_scaled ? Scaling::kBlock : Scaling::kTensor},
                           AgGemmConfig{block_n, gemm_sms, raster_rows, max_chunks, push_sms});
        },
        nb::arg("rows"), nb::arg("cols"), nb::arg("n"), nb::arg("world"), nb::arg("gather_k"), nb::arg("block_n"),
        nb::arg("gemm_sms"), nb::arg("raster_rows"), nb::arg("max_chunks"), nb::arg("push_sms"),
        nb::arg("shared_scale") = false, nb::arg("x_dtype") = "float8_e4m3fn", nb::arg("block_scaled") = false,
        "ag_gemm's plan of one FP8 call (entwine_ag_gemm_fp8) of an unpadded shard [rows, cols] in x_dtype "
        "(float8_e4m3fn or float8_e5m2), "
        "w_t [n, W * cols or cols] (cols padded to 16, block_n 128 only; inbox_bytes includes the scale slots; "
        "shared_scale: one x scale for every shard, which per-tensor gather_k needs; block_scaled: x_scale "
        "[cols/128, rows_pad] per shard, always pushed, w_scale [n_pad/128, K/128], cols % 128 == 0): "
        ENTWINE_AG_PLAN_RETURNS);
#undef ENTWINE_AG_PLAN_RETURNS
}

}  // namespace entwine::ag_gemm
