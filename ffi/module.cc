// nanobind module entwine_jax._entwine: each op's FFI target and plan (bound by the op, one line
// each), and the communicator API that entwine_jax.comm.acquire_comm drives at trace time (create,
// grow, share chunks, connect, errors, shutdown). Failures raise RuntimeError with CUDA's message.
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
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
  X(ag_gemm)           \
  X(moe)

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

// A capacity as Python asks it: flags per source rank and {region name: bytes} (an unknown name
// raises ValueError).
using RegionBytes = std::map<std::string, size_t>;
comm::Capacity capacity(int64_t flags_per_source, RegionBytes const& regions) {
  return comm::capacity(flags_per_source, {regions.begin(), regions.end()});
}

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
  }, "Names of the registered FFI targets whose operands are FP8 (x float8_e4m3fn or float8_e5m2, w_t "
     "float8_e4m3fn, f32 scales).");

  m.def("can_access_peer", [](int device, int peer) {
    int ok = 0;
    cudaError_t err = cudaDeviceCanAccessPeer(&ok, device, peer);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("cudaDeviceCanAccessPeer: ") + cudaGetErrorString(err));
    }
    return ok != 0;
  }, nb::arg("device"), nb::arg("peer"), "Whether local device `device` can map `peer`'s memory.");

  m.def("device_memory", [](int device) {
    // On this thread's current device, restored after: an XLA thread never runs this.
    int previous = 0;
    size_t free_bytes = 0, total_bytes = 0;
    cudaGetDevice(&previous);
    cudaError_t err = cudaSetDevice(device);
    if (err == cudaSuccess) err = cudaMemGetInfo(&free_bytes, &total_bytes);
    cudaSetDevice(previous);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("cudaMemGetInfo: ") + cudaGetErrorString(err));
    }
    return std::make_pair(free_bytes, total_bytes);
  }, nb::arg("device"), "(free, total) bytes of local device `device`, as CUDA sees them (all processes).");

  m.def("comm_create",
        [](int64_t comm_id, int world, const std::vector<std::pair<int, int>>& local_ranks, int64_t flags_per_source,
           RegionBytes const& regions, size_t heap_max_bytes) {
          comm::Capacity const c = capacity(flags_per_source, regions);
          nb::gil_scoped_release release;
          comm::create(comm_id, world, local_ranks, c, heap_max_bytes);
        },
        nb::arg("comm_id"), nb::arg("world"), nb::arg("local_ranks"), nb::arg("flags_per_source"),
        nb::arg("regions"), nb::arg("heap_max_bytes"),
        "Create the local ranks [(device ordinal, rank)] of a communicator: heaps reserved for heap_max_bytes, "
        "zeroed memory mapped for the capacity (flags per source rank, {region name: bytes}).");
  m.def("comm_destroy", &comm::destroy, nb::arg("comm_id"), NoGil(),
        "Remove a communicator no call has used (its creation failed to connect).");

  m.def("heap_bytes",
        [](int world, int64_t flags_per_source, RegionBytes const& regions) {
          return comm::mapped_bytes(world, capacity(flags_per_source, regions)).total();
        },
        nb::arg("world"), nb::arg("flags_per_source"), nb::arg("regions"),
        "Bytes of device memory one rank's heap maps for flags_per_source flags per source rank and "
        "{region name: bytes} (two copies of a double-buffered region).");

  m.def("comm_grow",
        [](int64_t comm_id, int64_t flags_per_source, RegionBytes const& regions) {
          comm::Capacity const c = capacity(flags_per_source, regions);
          nb::gil_scoped_release release;
          comm::grow(comm_id, c);
        },
        nb::arg("comm_id"), nb::arg("flags_per_source"), nb::arg("regions"),
        "Map zeroed memory behind every local heap's regions up to the capacity (calls use it after comm_connect).");
  m.def("comm_shrink",
        [](int64_t comm_id, int64_t flags_per_source, RegionBytes const& regions) {
          comm::Capacity const c = capacity(flags_per_source, regions);
          nb::gil_scoped_release release;
          comm::shrink(comm_id, c);
        },
        nb::arg("comm_id"), nb::arg("flags_per_source"), nb::arg("regions"),
        "Undo a comm_grow (and the imports) down to the capacity: a growth whose exchange failed.");

  m.def("comm_export", [](int64_t comm_id, int device) {
    std::vector<std::tuple<size_t, size_t, int>> out;
    for (const comm::SharedChunk& c : comm::export_chunks(comm_id, device)) out.emplace_back(c.offset, c.bytes, c.fd);
    return out;
  }, nb::arg("comm_id"), nb::arg("device"), NoGil(),
     "[(offset, bytes, fd)] of every chunk of the device's heap, each with a new file descriptor (close it once sent).");
  m.def("comm_import",
        [](int64_t comm_id, int device, int rank, const std::vector<std::tuple<size_t, size_t, int>>& chunks) {
          std::vector<comm::SharedChunk> parsed;
          for (auto [offset, bytes, fd] : chunks) parsed.push_back({offset, bytes, fd});
          nb::gil_scoped_release release;
          comm::import_chunks(comm_id, device, rank, parsed);
        },
        nb::arg("comm_id"), nb::arg("device"), nb::arg("rank"), nb::arg("chunks"),
        "Map rank's chunks [(offset, bytes, fd)] (another process) into the device's view of its heap; "
        "mapped ones are skipped; the descriptors stay open.");
  m.def("comm_connect", &comm::connect, nb::arg("comm_id"), nb::arg("device"), nb::arg("peers"), NoGil(),
        "Fill the device's peer table (per rank: its local device ordinal, or -1 for another process's rank, "
        "imported first) and let calls use the grown capacity.");
  m.def("comm_synchronize", &comm::synchronize, nb::arg("comm_id"), NoGil(),
        "cudaDeviceSynchronize on every local device of the communicator.");
  m.def("heap_usage", [](int64_t comm_id) {
    std::vector<std::tuple<int, size_t, size_t, size_t>> out;
    for (const comm::HeapUsage& u : comm::heap_usage(comm_id)) {
      out.emplace_back(u.device, u.own_bytes, u.imported_bytes, u.reserved_bytes);
    }
    return out;
  }, nb::arg("comm_id"),
     "[(device, own mapped bytes, peers' bytes mapped here, reserved bytes)] of the comm's local heaps.");

  m.def("name_call", &comm::name_call, nb::arg("signature"), nb::arg("description"),
        "Names a call signature for the messages of a failed call (Python, at trace time).");

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
    std::vector<std::tuple<int, uint64_t, double, std::vector<double>>> out;
    for (const comm::HandlerCost& c : comm::handler_cost(comm_id)) {
      out.emplace_back(c.device, c.calls, c.mean_us, std::vector<double>(c.phase_us, c.phase_us + comm::kHostPhases));
    }
    return out;
  }, nb::arg("comm_id"),
     "[(device, handler executions, mean host microseconds per execution, [mean microseconds per phase: checks, "
     "fork, launch, join, end])] of the comm's handlers.");

  m.def("call_sequence_us", [](int device, int reps) {
    double us = 0;
    cudaError_t const err = comm::call_sequence_us(device, reps, &us);
    if (err != cudaSuccess) throw std::runtime_error(std::string("call_sequence_us: ") + cudaGetErrorString(err));
    return us;
  }, nb::arg("device"), nb::arg("reps") = 200, NoGil(),
        "Median host microseconds of gemm_rs's handler's CUDA calls alone (fork, two launches, join, end "
        "kernel) from the calling thread: their floor in this process.");

  nb::class_<comm::SmHold>(m, "SmHold",
                           "Tests only: CTAs holding one SM each on a stream of their own, spinning until "
                           "release() or bound_ms (another stream's kernel waiting for another GPU)")
      .def(nb::init<int, int, uint64_t>(), nb::arg("device"), nb::arg("ctas"), nb::arg("bound_ms"))
      .def_prop_ro("started", &comm::SmHold::started)
      .def("release", &comm::SmHold::release, NoGil());
  m.def("shutdown", &comm::shutdown, NoGil(),
        "Free every communicator (unmapping every heap).");
}
