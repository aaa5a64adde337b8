// nanobind module entwine_jax._entwine: the FFI registrations and their target names, the plans of
// both ops (every shape rule of the kernels, asked by Python instead of restated), and the small
// communicator API that entwine_jax.fused.acquire_comm drives at trace time (create, exchange IPC
// handles, connect, grow, errors, shutdown). Every failure raises RuntimeError carrying the CUDA
// error string.
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "ag_gemm/ag_gemm.h"
#include "common/comm.h"
#include "gemm_rs/gemm_rs.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

// Defined by XLA_FFI_DEFINE_HANDLER_SYMBOL in gemm_rs/handler.cc and ag_gemm/handler.cc.
extern "C" XLA_FFI_Error* GemmRs(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* AgGemm(XLA_FFI_CallFrame* call_frame);

namespace {

namespace comm = entwine::comm;

// Calls that may wait on the GPU release the GIL: an XLA thread may need it meanwhile.
using NoGil = nb::call_guard<nb::gil_scoped_release>;

// The XLA FFI target names, spelled only here: Python reads them from the module.
constexpr const char* kGemmRsTarget = "entwine_gemm_rs";
constexpr const char* kAgGemmTarget = "entwine_ag_gemm";

nb::object rule_or_none(const char* rule) { return rule ? nb::cast(std::string(rule)) : nb::none(); }

}  // namespace

NB_MODULE(_entwine, m) {
  m.doc() = "entwine_jax CUDA extension: XLA FFI targets, the plans of both ops, and their communicators";

  m.attr("GEMM_RS_TARGET") = kGemmRsTarget;
  m.attr("AG_GEMM_TARGET") = kAgGemmTarget;
  m.attr("MAX_WORLD") = entwine::kMaxWorld;  // the largest mesh axis the kernels serve
  m.def("registrations", [] {
    nb::dict targets;
    targets[kGemmRsTarget] = nb::capsule(reinterpret_cast<void*>(GemmRs));
    targets[kAgGemmTarget] = nb::capsule(reinterpret_cast<void*>(AgGemm));
    return targets;
  }, "{target name: FFI handler capsule}, for jax.ffi.register_ffi_target(platform='CUDA').");

  m.def("gemm_rs_plan",
        [](int64_t m, int64_t n, int64_t k, int world, bool scatter_cols, int block_n, int producer_sms,
           int consumer_grid, int consumer_block, int raster_rows, bool split_tail) {
          entwine::GemmRsProblem problem{m, n, k, world, 0, scatter_cols};
          entwine::GemmRsConfig config{block_n, producer_sms, consumer_grid, consumer_block, raster_rows,
                                       split_tail ? 1 : 0};
          entwine::GemmRsPlan const p = entwine::gemm_rs_plan(problem, config);
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
          return d;
        },
        nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("world"), nb::arg("scatter_cols"), nb::arg("block_n"),
        nb::arg("producer_sms"), nb::arg("consumer_grid"), nb::arg("consumer_block"), nb::arg("raster_rows"),
        nb::arg("split_tail"),
        "gemm_rs's plan of one call (ffi/gemm_rs/gemm_rs.h) for x [m, k], w [k, n], unpadded: {error: None or "
        "the violated rule, config_error, m, n, k (the padded problem), part_rows, part_cols, tiles_per_partition, "
        "m_blocks, n_blocks, raster_rows, num_blocks, grid, k_tiles, split_first_block, split, slot_bytes}.");

  m.def("can_access_peer", [](int device, int peer) {
    int ok = 0;
    cudaError_t err = cudaDeviceCanAccessPeer(&ok, device, peer);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("cudaDeviceCanAccessPeer: ") + cudaGetErrorString(err));
    }
    return ok != 0;
  }, nb::arg("device"), nb::arg("peer"), "Whether local device `device` can map `peer`'s memory.");

  m.def("comm_create",
        [](int64_t comm_id, int world, const std::vector<std::pair<int, int>>& local_ranks,
           size_t slot_bytes, int64_t max_tiles, size_t inbox_bytes) {
          comm::create(comm_id, world, local_ranks, {slot_bytes, inbox_bytes, max_tiles});
        },
        nb::arg("comm_id"), nb::arg("world"), nb::arg("local_ranks"), nb::arg("slot_bytes"),
        nb::arg("max_tiles"), nb::arg("inbox_bytes"), NoGil(),
        "Create the local ranks [(device ordinal, rank)] of a communicator with zeroed heaps.");

  m.def("ag_plan",
        [](int rows, int cols, int n, int world, bool gather_k, int block_n, int gemm_sms, int raster_rows,
           int max_chunks) {
          entwine::AgProblem problem{rows, cols, n, world, 0, gather_k};
          entwine::AgGemmConfig config{block_n, gemm_sms, raster_rows, max_chunks};
          entwine::AgPlan p = entwine::ag_plan(problem, config);
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
          return d;
        },
        nb::arg("rows"), nb::arg("cols"), nb::arg("n"), nb::arg("world"), nb::arg("gather_k"), nb::arg("block_n"),
        nb::arg("gemm_sms"), nb::arg("raster_rows"), nb::arg("max_chunks"),
        "ag_gemm's plan of one call (ffi/ag_gemm/ag_gemm.h) of an unpadded shard [rows, cols] and N = n: "
        "{error: None or the violated rule, rows_pad, cols_pad, n_pad, chunks, chunk_tiles, num_blocks, grid, "
        "k_tiles, inbox_bytes, flags}.");

  m.def("heap_bytes",
        [](int world, size_t slot_bytes, int64_t max_tiles, size_t inbox_bytes) {
          return comm::heap_layout(world, {slot_bytes, inbox_bytes, max_tiles}).total();
        },
        nb::arg("world"), nb::arg("slot_bytes"), nb::arg("max_tiles"), nb::arg("inbox_bytes") = 0,
        "Bytes of one rank's heap with room for a partial slot of slot_bytes, max_tiles flags per source "
        "and an inbox of inbox_bytes.");

  m.def("heap_ipc_handle", [](int64_t comm_id, int device) {
    std::string handle = comm::ipc_handle(comm_id, device);
    return nb::bytes(handle.data(), handle.size());
  }, nb::arg("comm_id"), nb::arg("device"), "CUDA IPC handle (64 bytes) of this device's heap.");

  m.def("comm_connect", [](int64_t comm_id, int device, const std::vector<nb::object>& peers) {
    // Per rank of the device's group: an int (local ordinal) or bytes (IPC handle).
    std::vector<comm::Peer> parsed;
    for (const nb::object& peer : peers) {
      if (nb::isinstance<nb::bytes>(peer)) {
        nb::bytes b = nb::borrow<nb::bytes>(peer);
        parsed.emplace_back(std::string(b.c_str(), b.size()));
      } else {
        parsed.emplace_back(nb::cast<int>(peer));
      }
    }
    nb::gil_scoped_release release;
    comm::connect(comm_id, device, parsed);
  }, nb::arg("comm_id"), nb::arg("device"), nb::arg("peers"),
     "Fill the device's peer table: one int (local device ordinal) or bytes (IPC handle) per rank.");

  m.def("comm_synchronize", &comm::synchronize, nb::arg("comm_id"), NoGil(),
        "cudaDeviceSynchronize on every local device of the communicator.");
  m.def("comm_disconnect", &comm::disconnect, nb::arg("comm_id"), NoGil(),
        "Close imported IPC handles; calls are rejected until comm_connect.");
  m.def("comm_grow",
        [](int64_t comm_id, size_t slot_bytes, int64_t max_tiles, size_t inbox_bytes) {
          comm::grow(comm_id, {slot_bytes, inbox_bytes, max_tiles});
        },
        nb::arg("comm_id"), nb::arg("slot_bytes"), nb::arg("max_tiles"), nb::arg("inbox_bytes"), NoGil(),
        "New local heaps (disconnected on every rank first; the old ones are retired until shutdown); "
        "keeps the epochs.");

  m.def("error_message",
        [](int64_t comm_id) { return comm::error_message(comm_id); },
        nb::arg("comm_id"), "The device error recorded by a local rank of the comm, or None.");

  m.def("last_call_ms", [](int64_t comm_id) {
    std::vector<std::tuple<int, float, float>> out;
    for (const comm::CallTiming& t : comm::last_call_ms(comm_id)) out.emplace_back(t.device, t.producer_ms, t.consumer_ms);
    return out;
  }, nb::arg("comm_id"), NoGil(),
     "[(device, producer_ms, consumer_ms)] of the comm's last completed call (needs ENTWINE_PROFILE=1).");

  m.def("device_epochs", &comm::device_epochs, nb::arg("comm_id"), NoGil(),
        "[(device, epoch word)] of the comm's local devices (synchronous copies; tests and diagnostics).");

  m.def("handler_cost", [](int64_t comm_id) {
    std::vector<std::tuple<int, uint64_t, double>> out;
    for (const comm::HandlerCost& c : comm::handler_cost(comm_id)) out.emplace_back(c.device, c.calls, c.mean_us);
    return out;
  }, nb::arg("comm_id"),
     "[(device, handler executions, mean host microseconds per execution)] of the comm's handlers.");

  m.def("shutdown", &comm::shutdown, NoGil(),
        "Free every communicator (IPC handles closed before heaps are freed).");
}
