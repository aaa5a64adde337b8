// gemm_rs's part of the nanobind module (see bind.h): its FFI targets (GEMM_RS_TARGET and, for FP8
// operands, GEMM_RS_FP8_TARGET), the plans that Python asks instead of restating the kernels' shape
// rules, and its communicator hooks.
#include <nanobind/nanobind.h>

#include "bind.h"
#include "comm/comm.h"
#include "gemm_rs/gemm_rs.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

// Defined by XLA_FFI_DEFINE_HANDLER_SYMBOL in gemm_rs/handler.cc.
extern "C" XLA_FFI_Error* GemmRs(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* GemmRsFp8(XLA_FFI_CallFrame* call_frame);

namespace entwine::gemm_rs {

void bind(nb::module_& m, FfiTargets& targets) {
  // The XLA FFI target names, spelled only here: Python reads them from the module.
  constexpr const char* kTarget = "entwine_gemm_rs";
  constexpr const char* kFp8Target = "entwine_gemm_rs_fp8";
  m.attr("GEMM_RS_TARGET") = kTarget;
  m.attr("GEMM_RS_FP8_TARGET") = kFp8Target;
  targets.push_back({kTarget, reinterpret_cast<void*>(GemmRs), false});
  targets.push_back({kFp8Target, reinterpret_cast<void*>(GemmRsFp8), true});
  comm::register_op(&kHooks);

  // The plan of one call for x [m, k], w [k, n] (FP8: w_t [n, k]) of operand type `input`, unpadded.
  auto plan = [](DType input, int64_t m, int64_t n, int64_t k, int world, bool scatter_cols, int block_n,
                 int producer_sms, int consumer_grid, int consumer_block, int raster_rows, bool split_tail,
                 bool block_scaled) {
    GemmRsProblem problem{m, n, k, world, 0, scatter_cols, input, block_scaled ? Scaling::kBlock : Scaling::kTensor};
    GemmRsConfig config{block_n, producer_sms, consumer_grid, consumer_block, raster_rows, split_tail};
    GemmRsPlan const p = gemm_rs_plan(problem, config);
    nb::dict d;
    d["error"] = rule_or_none(p.error);
    d["config_error"] = p.config_error;
    d["m"] = p.shape.m;
    d["n"] = p.shape.n;
    d["k"] = p.shape.k;
    d["part_rows"] = p.shape.part_rows();
    d["part_cols"] = p.shape.part_cols();
    d["tiles_per_partition"] = p.tiles_per_partition;
    d["m_blocks"] = p.order.m_blocks;
    d["n_blocks"] = p.order.n_blocks;
    d["raster_rows"] = p.order.raster_rows;
    d["num_blocks"] = p.schedule.num_blocks;
    d["grid"] = p.schedule.grid;
    d["k_tiles"] = p.schedule.k_tiles;
    d["split_first_block"] = p.schedule.split_first_block;
    d["split"] = p.split;
    d["slot_bytes"] = p.slot_bytes;
    d["block_scaled"] = p.scaling == Scaling::kBlock;
    return d;
  };
  // What both return (a string literal, so that the docstrings below are literals too).
#define ENTWINE_GEMM_RS_PLAN_RETURNS                                                                       \
  "{error: None or the violated rule, config_error, m, n, k (the padded problem), part_rows, part_cols, " \
  "tiles_per_partition, m_blocks, n_blocks, raster_rows, num_blocks, grid, k_tiles, split_first_block, "  \
  "split, slot_bytes, block_scaled}."
  m.def("gemm_rs_plan",
        [plan](int64_t m, int64_t n, int64_t k, int world, bool scatter_cols, int block_n, int producer_sms,
               int consumer_grid, int consumer_block, int raster_rows, bool split_tail) {
          return plan(DType::kBF16, m, n, k, world, scatter_cols, block_n, producer_sms, consumer_grid,
                      consumer_block, raster_rows, split_tail, false);
        },
        nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("world"),
        nb::arg("scatter_cols"), nb::arg("block_n"), nb::arg("producer_sms"), nb::arg("consumer_grid"),
        nb::arg("consumer_block"), nb::arg("raster_rows"), nb::arg("split_tail"),
        "gemm_rs's plan of one call (ffi/gemm_rs/gemm_rs.h) for x [m, k], w [k, n] in bf16 or fp16, "
        "unpadded: " ENTWINE_GEMM_RS_PLAN_RETURNS);
  m.def("gemm_rs_fp8_plan",
        [plan](int64_t m, int64_t n, int64_t k, int world, bool scatter_cols, int block_n, int producer_sms,
               int consumer_grid, int consumer_block, int raster_rows, bool split_tail, std::string const& x_dtype,
               bool block_scaled) {
          return plan(fp8_input_dtype(x_dtype), m, n, k, world, scatter_cols, block_n, producer_sms, consumer_grid,
                      consumer_block, raster_rows, split_tail, block_scaled);
        },
        nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("world"),
        nb::arg("scatter_cols"), nb::arg("block_n"), nb::arg("producer_sms"), nb::arg("consumer_grid"),
        nb::arg("consumer_block"), nb::arg("raster_rows"), nb::arg("split_tail"), nb::arg("x_dtype") = "float8_e4m3fn",
        nb::arg("block_scaled") = false,
        "gemm_rs's plan of one FP8 call (entwine_gemm_rs_fp8) for x [m, k] in x_dtype (float8_e4m3fn or "
        "float8_e5m2), w_t [n, k] in float8_e4m3fn, unpadded (K padded to 16, block_n 128 only; "
        "block_scaled: scales x_scale [k/128, m] and w_scale [n/128, k/128] of the padded m and n, "
        "K % 128 == 0 required): " ENTWINE_GEMM_RS_PLAN_RETURNS);
#undef ENTWINE_GEMM_RS_PLAN_RETURNS
}

}  // namespace entwine::gemm_rs
