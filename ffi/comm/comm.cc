// Process-wide registry of the communicators (see comm.h) and of the ops that use them: allocation,
// peer pointers and IPC handles, growth and teardown. Everything here runs from Python at trace
// time or at exit, never from the execute path except find(), workspace() and error_message().
#include "comm/comm.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

namespace entwine::comm {
namespace {

// Filled by register_op() before the first create() and read-only afterwards (created_any), so
// the execute path reads it without the lock.
const OpHooks* registered_ops[kMaxOps] = {};
int op_count = 0;
bool created_any = false;

struct Comm {
  int world = 1;
  Capacity capacity;
  std::map<int, std::unique_ptr<DeviceComm>> by_device;  // local ordinal -> rank entry
};

// The map is only changed by create() and shutdown(); entries are never moved (unique_ptr), so a
// pointer from find() stays valid until shutdown().
std::mutex registry_mutex;
std::map<int64_t, Comm>& registry() {
  static auto* comms = new std::map<int64_t, Comm>();  // leaked: outlives static destructors
  return *comms;
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
    throw std::runtime_error(std::string("entwine comm: ") + what + ": " + cudaGetErrorString(err));
  }
}

Comm& get(int64_t comm_id) {
  auto it = registry().find(comm_id);
  if (it == registry().end()) {
    throw std::runtime_error("entwine comm: no communicator " + std::to_string(comm_id));
  }
  return it->second;
}

DeviceComm& entry(Comm& comm, int64_t comm_id, int device) {
  auto it = comm.by_device.find(device);
  if (it == comm.by_device.end()) {
    throw std::runtime_error("entwine comm: communicator " + std::to_string(comm_id) +
                             " has no rank on local device " + std::to_string(device));
  }
  return *it->second;
}

void allocate_heap(DeviceComm& dc, const Capacity& capacity) {
  check(cudaSetDevice(dc.device), "cudaSetDevice");
  dc.capacity = capacity;
  dc.layout = heap_layout(dc.world, capacity);
  check(cudaMalloc(&dc.heap, dc.layout.total()), "cudaMalloc(heap)");
  // Zeroed once: flags start below every epoch (the first call uses 1), and never get reset again.
  check(cudaMemset(dc.heap, 0, dc.layout.total()), "cudaMemset(heap)");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(after heap zeroing)");
}

// The peer table is cleared; imported mappings stay open (retired) until shutdown, since a graph
// recorded earlier may still push to them or read them.
void retire_imports(DeviceComm& dc) {
  for (int s = 0; s < kMaxWorld; ++s) {
    if (dc.peer_imported[s]) dc.retired_imports.push_back(dc.peer_heap[s]);
    dc.peer_imported[s] = false;
    dc.peer_heap[s] = nullptr;
  }
  dc.connected = false;
}

void close_imports(DeviceComm& dc) {
  retire_imports(dc);
  for (void* p : dc.retired_imports) cudaIpcCloseMemHandle(p);
  dc.retired_imports.clear();
}

}  // namespace

void register_op(const OpHooks* hooks) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (created_any) throw std::runtime_error(std::string("entwine comm: op ") + hooks->name + " registered after the first communicator");
  if (op_count == kMaxOps) throw std::runtime_error("entwine comm: more than kMaxOps ops");
  for (int i = 0; i < op_count; ++i) {
    if (registered_ops[i] == hooks) return;
    if (std::strcmp(registered_ops[i]->name, hooks->name) == 0 ||
        registered_ops[i]->wait_site_base == hooks->wait_site_base) {
      throw std::runtime_error(std::string("entwine comm: ops ") + registered_ops[i]->name + " and " + hooks->name +
                               " share a name or a wait_site_base");
    }
  }
  registered_ops[op_count++] = hooks;
}

void* DeviceComm::workspace(const OpHooks* op) const noexcept {
  for (int i = 0; i < op_count; ++i) {
    if (registered_ops[i] == op) return workspaces[i];
  }
  return nullptr;
}

HeapLayout heap_layout(int world, const Capacity& capacity) {
  HeapLayout layout;
  layout.flags_bytes = HeapLayout::align(size_t(world) * size_t(capacity.max_tiles) * sizeof(uint64_t));
  layout.slot_bytes = HeapLayout::align(capacity.slot_bytes);
  layout.inbox_bytes = HeapLayout::align(capacity.inbox_bytes);
  return layout;
}

DeviceComm::~DeviceComm() {
  // Order: nothing of ours may still run, IPC mappings are closed before any heap is freed (CUDA
  // leaves freeing exported memory that is still open elsewhere undefined), then the rest.
  cudaSetDevice(device);
  cudaDeviceSynchronize();
  close_imports(*this);
  if (heap) cudaFree(heap);
  for (void* p : retired_heaps) cudaFree(p);
  if (epoch) cudaFree(epoch);
  for (cudaEvent_t e : {start, producer_done, consumer_done}) {
    if (e) cudaEventDestroy(e);
  }
  for (int d = 0; d < kMaxWorld; ++d) {
    if (transfer_done[d]) cudaEventDestroy(transfer_done[d]);
    if (transfer[d]) cudaStreamDestroy(transfer[d]);
  }
  if (consumer) cudaStreamDestroy(consumer);
  if (error_host) cudaFreeHost(error_host);
  if (error_local) cudaFree(error_local);
  for (void* p : workspaces) {
    if (p) cudaFree(p);
  }
  cudaGetLastError();
}

void create(int64_t comm_id, int world, const std::vector<std::pair<int, int>>& local_ranks,
            const Capacity& capacity) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (registry().count(comm_id)) {
    throw std::runtime_error("entwine comm: communicator " + std::to_string(comm_id) + " exists");
  }
  if (world < 1 || world > kMaxWorld) {
    throw std::runtime_error("entwine comm: world " + std::to_string(world) + " outside [1, 8]");
  }
  created_any = true;
  Comm comm;
  comm.world = world;
  comm.capacity = capacity;
  for (auto [device, rank] : local_ranks) {
    if (rank < 0 || rank >= world || comm.by_device.count(device)) {
      throw std::runtime_error("entwine comm: bad local rank " + std::to_string(rank) + " on device " +
                               std::to_string(device) + " for world " + std::to_string(world));
    }
    auto dc = std::make_unique<DeviceComm>();
    dc->device = device;
    dc->rank = rank;
    dc->world = world;
    check(cudaSetDevice(device), "cudaSetDevice");
    // Lazy module loading while a consumer spins can deadlock: load every kernel now.
    for (int i = 0; i < op_count; ++i) {
      check(registered_ops[i]->prepare_kernels(), (std::string(registered_ops[i]->name) + " prepare_kernels").c_str());
    }
    check(prepare_epoch_kernel(), "prepare_epoch_kernel");
    int least, greatest;
    check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    // The consumer goes first on freed SMs so its small grid stays resident next to the GEMM.
    check(cudaStreamCreateWithPriority(&dc->consumer, cudaStreamNonBlocking, greatest),
          "cudaStreamCreateWithPriority(consumer)");
    for (cudaEvent_t* e : {&dc->start, &dc->producer_done, &dc->consumer_done}) {
      check(cudaEventCreateWithFlags(e, profiling() ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreate");
    }
    check(cudaDeviceGetAttribute(&dc->sm_count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    for (int d = 1; d < world; ++d) {
      check(cudaStreamCreateWithPriority(&dc->transfer[d], cudaStreamNonBlocking, greatest),
            "cudaStreamCreate(transfer)");
      check(cudaEventCreateWithFlags(&dc->transfer_done[d], cudaEventDisableTiming), "cudaEventCreate(transfer)");
    }

    // Portable: one pinned record must be mappable from whichever context the device uses.
    check(cudaHostAlloc(reinterpret_cast<void**>(&dc->error_host), sizeof(DeviceError),
                        cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc(error record)");
    std::memset(dc->error_host, 0, sizeof(DeviceError));
    check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dc->error_device), dc->error_host, 0),
          "cudaHostGetDevicePointer(error record)");
    // The record the consumers poll lives in device memory: polling a host-mapped word crosses PCIe.
    check(cudaMalloc(reinterpret_cast<void**>(&dc->error_local), sizeof(DeviceError)), "cudaMalloc(error record)");
    check(cudaMemset(dc->error_local, 0, sizeof(DeviceError)), "cudaMemset(error record)");
    uint64_t const first_epoch = 1;
    check(cudaMalloc(reinterpret_cast<void**>(&dc->epoch), sizeof(uint64_t)), "cudaMalloc(epoch)");
    check(cudaMemcpy(dc->epoch, &first_epoch, sizeof(uint64_t), cudaMemcpyHostToDevice), "cudaMemcpy(epoch)");
    for (int i = 0; i < op_count; ++i) {
      size_t const bytes = registered_ops[i]->workspace_bytes;
      if (bytes == 0) continue;
      check(cudaMalloc(&dc->workspaces[i], bytes), "cudaMalloc(op workspace)");
      check(cudaMemset(dc->workspaces[i], 0, bytes), "cudaMemset(op workspace)");
    }
    allocate_heap(*dc, capacity);
    comm.by_device[device] = std::move(dc);
  }
  registry()[comm_id] = std::move(comm);
}

std::string ipc_handle(int64_t comm_id, int device) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  DeviceComm& dc = entry(get(comm_id), comm_id, device);
  check(cudaSetDevice(device), "cudaSetDevice");
  cudaIpcMemHandle_t handle;
  // The base of a cudaMalloc allocation: peers add the same offsets as on their own heap.
  check(cudaIpcGetMemHandle(&handle, dc.heap), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void connect(int64_t comm_id, int device, const std::vector<Peer>& peers) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  Comm& comm = get(comm_id);
  DeviceComm& dc = entry(comm, comm_id, device);
  if (int(peers.size()) != dc.world) {
    throw std::runtime_error("entwine comm: connect got " + std::to_string(peers.size()) +
                             " peers for world " + std::to_string(dc.world));
  }
  retire_imports(dc);
  check(cudaSetDevice(device), "cudaSetDevice");
  for (int s = 0; s < dc.world; ++s) {
    if (const int* local = std::get_if<int>(&peers[s])) {
      auto it = comm.by_device.find(*local);
      if (it == comm.by_device.end()) {
        throw std::runtime_error("entwine comm: rank " + std::to_string(s) + " on local device " +
                                 std::to_string(*local) + " is not part of the communicator");
      }
      if (*local != device) {
        cudaError_t err = cudaDeviceEnablePeerAccess(*local, 0);
        // XLA usually enabled it already; that is success, but the error must be cleared.
        if (err == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
          err = cudaSuccess;
        }
        check(err, "cudaDeviceEnablePeerAccess");
      }
      dc.peer_heap[s] = it->second->heap;
    } else {
      const std::string& bytes = std::get<std::string>(peers[s]);
      cudaIpcMemHandle_t handle;
      if (bytes.size() != sizeof(handle)) {
        throw std::runtime_error("entwine comm: IPC handle of rank " + std::to_string(s) + " has " +
                                 std::to_string(bytes.size()) + " bytes");
      }
      std::memcpy(&handle, bytes.data(), sizeof(handle));
      check(cudaIpcOpenMemHandle(&dc.peer_heap[s], handle, cudaIpcMemLazyEnablePeerAccess),
            "cudaIpcOpenMemHandle");
      dc.peer_imported[s] = true;
    }
  }
  if (dc.peer_heap[dc.rank] != dc.heap) {
    throw std::runtime_error("entwine comm: rank " + std::to_string(dc.rank) +
                             " is not its own device in the peer list");
  }
  dc.connected = true;
}

void synchronize(int64_t comm_id) {
  std::vector<int> devices;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (auto& [device, dc] : get(comm_id).by_device) devices.push_back(device);
  }
  // Outside the lock: a handler of another device may need it to launch the kernels we wait for.
  for (int device : devices) {
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
}

void disconnect(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (auto& [device, dc] : get(comm_id).by_device) retire_imports(*dc);
}

std::vector<std::pair<int, uint64_t>> device_epochs(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  std::vector<std::pair<int, uint64_t>> epochs;
  for (auto& [device, dc] : get(comm_id).by_device) {
    uint64_t value = 0;
    check(cudaSetDevice(device), "cudaSetDevice");
    // After every call enqueued so far (XLA's streams do not synchronise with the legacy stream).
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    check(cudaMemcpy(&value, dc->epoch, sizeof(value), cudaMemcpyDeviceToHost), "cudaMemcpy(epoch)");
    epochs.emplace_back(device, value);
  }
  return epochs;
}

void grow(int64_t comm_id, const Capacity& capacity) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  Comm& comm = get(comm_id);
  for (auto& [device, dc] : comm.by_device) {
    if (dc->connected) throw std::runtime_error("entwine comm: grow() before disconnect()");
  }
  for (auto& [device, dc] : comm.by_device) {
    // Retired, not freed: a graph recorded before the growth addresses it.
    check(cudaSetDevice(device), "cudaSetDevice");
    dc->retired_heaps.push_back(dc->heap);
    dc->heap = nullptr;
    allocate_heap(*dc, capacity);
  }
  comm.capacity = capacity;
}

void shutdown() {
  std::vector<int> devices;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (auto& [id, comm] : registry()) {
      for (auto& [device, dc] : comm.by_device) devices.push_back(device);
    }
  }
  // Outside the lock, as in synchronize(); a spinning consumer ends at its deadline at the latest.
  for (int device : devices) {
    cudaSetDevice(device);
    cudaDeviceSynchronize();
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  // Close every IPC import of every comm before freeing any heap (DeviceComm's destructor does
  // both for one entry, but another entry of this process may import a heap freed earlier).
  for (auto& [id, comm] : registry()) {
    for (auto& [device, dc] : comm.by_device) {
      cudaSetDevice(device);
      close_imports(*dc);
    }
  }
  registry().clear();
  cudaGetLastError();
}

uint64_t timeout_ms() noexcept {
  // Read once: the deadline is part of every launch and must not change between ranks mid-run.
  static const uint64_t ms = [] {
    const char* env = std::getenv("ENTWINE_TIMEOUT_MS");
    char* end = nullptr;
    unsigned long long value = env ? std::strtoull(env, &end, 10) : 0;
    return (env && end != env && value > 0) ? uint64_t(value) : uint64_t(60000);
  }();
  return ms;
}

bool profiling() noexcept {
  static const bool enabled = [] {
    const char* env = std::getenv("ENTWINE_PROFILE");
    return env != nullptr && env[0] == '1';
  }();
  return enabled;
}

std::vector<CallTiming> last_call_ms(int64_t comm_id) {
  if (!profiling()) {
    throw std::runtime_error("entwine comm: call timings need ENTWINE_PROFILE=1 set before the first fused call");
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  std::vector<CallTiming> timings;
  for (auto& [device, dc] : get(comm_id).by_device) {
    CallTiming t{device, 0.f, 0.f};
    check(cudaEventElapsedTime(&t.producer_ms, dc->start, dc->producer_done), "cudaEventElapsedTime(producer)");
    check(cudaEventElapsedTime(&t.consumer_ms, dc->start, dc->consumer_done), "cudaEventElapsedTime(consumer)");
    timings.push_back(t);
  }
  return timings;
}

std::vector<HandlerCost> handler_cost(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  std::vector<HandlerCost> costs;
  for (auto& [device, dc] : get(comm_id).by_device) {
    uint64_t const calls = dc->handler_calls.load();
    costs.push_back({device, calls, calls ? dc->handler_ns.load() / 1e3 / double(calls) : 0.0});
  }
  return costs;
}

DeviceComm* find(int64_t comm_id, int device) noexcept {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(comm_id);
  if (it == registry().end()) return nullptr;
  auto jt = it->second.by_device.find(device);
  return jt == it->second.by_device.end() ? nullptr : jt->second.get();
}

std::optional<std::string> error_message(const DeviceComm& dc) {
  // Host-mapped and written by the kernel: volatile reads, code last-written by convention.
  const volatile DeviceError* e = dc.error_host;
  if (e == nullptr || e->code == 0) return std::nullopt;
  if (e->code != kErrorDeadline) {
    return "entwine: rank " + std::to_string(dc.rank) + " recorded device error code " + std::to_string(e->code);
  }
  DeviceError record{};
  record.code = e->code;
  record.rank = e->rank;
  record.source = e->source;
  record.tile = e->tile;
  record.expected = e->expected;
  record.observed = e->observed;
  record.site = e->site;
  std::string const waited = "rank " + std::to_string(record.rank) + " waited " + std::to_string(timeout_ms()) + " ms ";
  std::string what = "entwine: " + waited + "at unknown wait site " + std::to_string(record.site);
  for (int i = 0; i < op_count; ++i) {
    int32_t const base = registered_ops[i]->wait_site_base;
    if (record.site >= base && record.site < base + kWaitSitesPerOp) {
      what = registered_ops[i]->describe_deadline(record, waited);
    }
  }
  return what + " (expected epoch " + std::to_string(record.expected) + ", saw " + std::to_string(record.observed) +
         "); the communicator is unusable until the process restarts";
}

std::optional<std::string> error_message(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (auto& [device, dc] : get(comm_id).by_device) {
    if (auto msg = error_message(*dc)) return msg;
  }
  return std::nullopt;
}

}  // namespace entwine::comm
