// ag_gemm's part of the nanobind module (see bind.h): its FFI target, AG_GEMM_TARGET, the plan that
// Python asks instead of restating the kernels' shape rules, and its communicator hooks.
#include <nanobind/nanobind.h>

#include "ag_gemm/ag_gemm.h"
#include "bind.h"
#include "comm/comm.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

// Defined by XLA_FFI_DEFINE_HANDLER_SYMBOL in ag_gemm/handler.cc.
extern "C" XLA_FFI_Error* AgGemm(XLA_FFI_CallFrame* call_frame);

namespace entwine::ag_gemm {

void bind(nb::module_& m, FfiTargets& targets) {
  // The XLA FFI target name, spelled only here: Python reads it from the module.
  constexpr const char* kTarget = "entwine_ag_gemm";
  m.attr("AG_GEMM_TARGET") = kTarget;
  targets.emplace_back(kTarget, reinterpret_cast<void*>(AgGemm));
  comm::register_op(&kHooks);

  m.def("ag_plan",
        [](int rows, int cols, int n, int world, bool gather_k, int block_n, int gemm_sms, int raster_rows,
           int max_chunks, int push_sms) {
          AgProblem problem{rows, cols, n, world, 0, gather_k};
          AgGemmConfig config{block_n, gemm_sms, raster_rows, max_chunks, push_sms};
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
          d["flags"] = p.flags;
          d["push_grid"] = p.push_grid;
          d["sms_needed"] = p.sms_needed;
          return d;
        },
        nb::arg("rows"), nb::arg("cols"), nb::arg("n"), nb::arg("world"), nb::arg("gather_k"), nb::arg("block_n"),
        nb::arg("gemm_sms"), nb::arg("raster_rows"), nb::arg("max_chunks"), nb::arg("push_sms"),
        "ag_gemm's plan of one call (ffi/ag_gemm/ag_gemm.h) of an unpadded shard [rows, cols] and N = n: "
        "{error: None or the violated rule, rows_pad, cols_pad, n_pad, chunks, chunk_tiles, num_blocks, grid, "
        "k_tiles, inbox_bytes, flags, push_grid, sms_needed}.");
}

}  // namespace entwine::ag_gemm
