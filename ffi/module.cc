// nanobind module entwine_jax._entwine: each op's FFI target and plan (bound by the op, one line
// each), and the communicator API that entwine_jax.comm.acquire_comm drives at trace time (create,
// IPC handles, connect, grow, errors, shutdown). Failures raise RuntimeError with CUDA's message.
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

#include "bind.h"
#include "comm/comm.h"

namespace nb = nanobind;

// The ops, one row each: ffi/<op>/bind.cc defines entwine::<op>::bind (see bind.h).
#define ENTWINE_OPS(X) \
  X(gemm_rs)           \
  X(ag_gemm)

#define ENTWINE_DECLARE_BIND(op) \
  namespace entwine::op {        \
  void bind(nb::module_& m, FfiTargets& targets); \
  }
ENTWINE_OPS(ENTWINE_DECLARE_BIND)
#undef ENTWINE_DECLARE_BIND

namespace {

namespace comm = entwine::comm;

// Calls that may wait on the GPU release the GIL: an XLA thread may need it meanwhile.
using NoGil = nb::call_guard<nb::gil_scoped_release>;

// Every op's FFI targets, filled once at import by the ops' bind().
entwine::FfiTargets& ffi_targets() {
  static auto* targets = new entwine::FfiTargets();  // leaked: outlives static destructors
  return *targets;
}

}  // namespace

NB_MODULE(_entwine, m) {
  m.doc() = "entwine_jax CUDA extension: XLA FFI targets, the plans of the ops, and their communicators";

  m.attr("MAX_WORLD") = entwine::kMaxWorld;  // the largest mesh axis the kernels serve
#define ENTWINE_BIND(op) entwine::op::bind(m, ffi_targets());
  ENTWINE_OPS(ENTWINE_BIND)
#undef ENTWINE_BIND
  m.def("registrations", [] {
    nb::dict targets;
    for (auto const& t : ffi_targets()) targets[t.name.c_str()] = nb::capsule(t.handler);
    return targets;
  }, "{target name: FFI handler capsule}, for jax.ffi.register_ffi_target(platform='CUDA').");
  m.def("fp8_targets", [] {
    std::vector<std::string> names;
    for (auto const& t : ffi_targets()) {
      if (t.fp8) names.push_back(t.name);
    }
    return names;
  }, "Names of the registered FFI targets whose operands are FP8 (float8_e4m3fn with f32 scales).");

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
