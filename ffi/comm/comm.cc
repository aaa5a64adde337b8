// Process-wide registry of the communicators (see comm.h) and of the ops that use them: the heaps
// (reserved address ranges with physical memory mapped in, vmm.h), peer tables, growth and teardown. Everything here runs from Python at trace
// time or at exit, never from the execute path except find(), workspace() and error_message().
#include "comm/comm.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "comm/vmm.h"

namespace entwine::comm {
namespace {

// Filled by register_op() before the first create() and read-only afterwards (created_any), so
// the execute path reads it without the lock.
const OpHooks* registered_ops[kMaxOps] = {};
int op_count = 0;
// Every registered op's regions, by id (RegionSpec::id).
const RegionSpec* registered_regions[kMaxRegions] = {};
int region_count = 0;
// The most side streams any registered op asks for a group of `world` ranks.
int side_streams_for(int world) {
  int most = 0;
  for (int i = 0; i < op_count; ++i) most = std::max(most, registered_ops[i]->side_streams(world));
  return most;
}
bool created_any = false;

struct Comm {
  int world = 1;
  Capacity capacity;
  std::map<int, std::unique_ptr<DeviceComm>> by_device;  // local ordinal -> rank entry
};

// The map is only changed by create(), destroy() and shutdown(); entries are never moved
// (unique_ptr), so a pointer from find() stays valid until then.
std::mutex registry_mutex;
// Serialises the setup calls (create, grow, shrink, export, import, connect, destroy, shutdown).
// They make driver calls that can take a while and do not hold registry_mutex meanwhile: every
// handler takes it in find(), and a handler kept waiting can keep a peer's kernel spinning.
std::mutex setup_mutex;
std::map<int64_t, Comm>& registry() {
  static auto* comms = new std::map<int64_t, Comm>();  // leaked: outlives static destructors
  return *comms;
}

// What each call signature this process traced is (name_call), for error messages. Its own lock:
// messages are formatted while registry_mutex is held.
std::mutex call_names_mutex;
std::map<uint32_t, std::string>& call_names() {
  static auto* names = new std::map<uint32_t, std::string>();  // leaked, as the registry
  return *names;
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
    throw std::runtime_error(std::string("entwine comm: ") + what + ": " + cudaGetErrorString(err));
  }
}

// The comm of comm_id; the caller holds registry_mutex.
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

// The comm of comm_id for a setup call, which holds setup_mutex: no other call can remove it then.
Comm& setup_get(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  return get(comm_id);
}

size_t whole_chunks(size_t bytes) { return (bytes + kChunkBytes - 1) / kChunkBytes * kChunkBytes; }

// The spans of a heap in layout order (each flag parity, the ready chunk, each copy of each
// region): where each starts, how much of it `mapped` covers and how much it may ever cover.
struct Span {
  size_t offset, bytes, limit;
};
std::vector<Span> spans(const HeapLayout& layout, const MappedBytes& mapped) {
  size_t const r = layout.region_bytes;
  std::vector<Span> out = {{layout.flags_offset(), mapped.flags, r},
                           {layout.flags_offset() + r, mapped.flags, r},
                           {layout.ready_offset(), mapped.ready, kChunkBytes}};
  for (int id = 0; id < layout.regions; ++id) {
    for (int copy = 0; copy < layout.copies[id]; ++copy) {
      out.push_back({layout.region_offset(id) + copy * r, mapped.region[id], r});
    }
  }
  return out;
}

// Whether a chunk lies in the part of its region that `mapped` covers.
bool covered(const HeapLayout& layout, const MappedBytes& mapped, const Chunk& chunk) {
  for (const Span& span : spans(layout, mapped)) {
    if (chunk.offset >= span.offset && chunk.offset + chunk.bytes <= span.offset + span.bytes) return true;
  }
  return false;
}

bool at_least(const Capacity& a, const Capacity& b) {
  for (int id = 0; id < kMaxRegions; ++id) {
    if (a.bytes[id] < b.bytes[id]) return false;
  }
  return a.flags_per_source >= b.flags_per_source;
}

std::string describe(const Capacity& c) {
  std::string text = std::to_string(c.flags_per_source) + " flags per source";
  for (int id = 0; id < region_count; ++id) {
    text += ", " + std::string(registered_regions[id]->name) + " " + std::to_string(c.bytes[id]) + " B";
  }
  return text;
}

// Unmaps (and frees, for own chunks) every chunk of `chunks` that `keep` does not cover.
void unmap_beyond(void* base, std::vector<Chunk>& chunks, const HeapLayout& layout, const MappedBytes& keep) {
  auto outside = [&](const Chunk& c) { return !covered(layout, keep, c); };
  for (const Chunk& c : chunks) {
    if (!outside(c)) continue;
    vmm::unmap(static_cast<char*>(base) + c.offset, c.bytes);
    if (c.handle) vmm::release(c.handle);
  }
  chunks.erase(std::remove_if(chunks.begin(), chunks.end(), outside), chunks.end());
}

// Maps zeroed physical memory behind each region of the own heap, up to `capacity`; all or nothing.
// The zeroing runs on the entry's setup stream, so it waits for no call (flags must start below every
// epoch; a region's new memory is unused until connect() publishes the capacity).
void map_own(DeviceComm& dc, const Capacity& capacity) {
  check(cudaSetDevice(dc.device), "cudaSetDevice");
  // A new heap has nothing mapped, not even the ready words that every capacity includes.
  MappedBytes const have = dc.chunks.empty() ? MappedBytes{} : mapped_bytes(dc.world, dc.mapped);
  std::vector<Span> const before = spans(dc.layout, have);
  std::vector<Span> const after = spans(dc.layout, mapped_bytes(dc.world, capacity));
  try {
    for (size_t i = 0; i < after.size(); ++i) {
      if (after[i].bytes > after[i].limit) {
        throw std::runtime_error("entwine comm: " + describe(capacity) + " exceeds the heap reserved at creation (" +
                                 std::to_string(dc.layout.region_bytes) + " bytes per region)");
      }
      if (after[i].bytes <= before[i].bytes) continue;
      Chunk chunk{before[i].offset + before[i].bytes, after[i].bytes - before[i].bytes, 0};
      chunk.handle = vmm::create(dc.device, chunk.bytes);
      void* at = static_cast<char*>(dc.heap) + chunk.offset;
      try {
        vmm::map(at, chunk.bytes, chunk.handle, dc.accessors);
      } catch (...) {
        vmm::release(chunk.handle);
        throw;
      }
      dc.chunks.push_back(chunk);
      check(cudaMemsetAsync(at, 0, chunk.bytes, dc.setup), "cudaMemsetAsync(new heap memory)");
    }
    check(cudaStreamSynchronize(dc.setup), "cudaStreamSynchronize(heap zeroing)");
  } catch (...) {
    cudaStreamSynchronize(dc.setup);
    cudaGetLastError();
    unmap_beyond(dc.heap, dc.chunks, dc.layout, have);
    throw;
  }
  dc.mapped = capacity;
}

// Undoes map_own and the imports down to `capacity`, which calls may not have used yet.
void shrink_entry(DeviceComm& dc, const Capacity& capacity) {
  MappedBytes const keep = mapped_bytes(dc.world, capacity);
  unmap_beyond(dc.heap, dc.chunks, dc.layout, keep);
  for (int s = 0; s < kMaxWorld; ++s) {
    if (dc.peer_reserved[s]) unmap_beyond(dc.peer_reserved[s], dc.peer_chunks[s], dc.layout, keep);
  }
  dc.mapped = capacity;
}

// Whether the chunks mapped at `chunks` cover every span as far as `mapped` says.
bool covers(const std::vector<Chunk>& chunks, const HeapLayout& layout, const MappedBytes& mapped) {
  for (const Span& span : spans(layout, mapped)) {
    size_t have = 0;
    for (const Chunk& c : chunks) {
      if (c.offset >= span.offset && c.offset < span.offset + span.limit) have += c.bytes;
    }
    if (have < span.bytes) return false;
  }
  return true;
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
  if (region_count + hooks->region_count > kMaxRegions) {
    throw std::runtime_error(std::string("entwine comm: op ") + hooks->name + "'s regions exceed kMaxRegions");
  }
  for (int r = 0; r < hooks->region_count; ++r) {
    for (int id = 0; id < region_count; ++id) {
      if (std::strcmp(registered_regions[id]->name, hooks->regions[r].name) == 0) {
        throw std::runtime_error(std::string("entwine comm: two ops register a region ") + hooks->regions[r].name);
      }
    }
  }
  for (int r = 0; r < hooks->region_count; ++r) {
    *hooks->regions[r].id = region_count;
    registered_regions[region_count++] = &hooks->regions[r];
  }
  registered_ops[op_count++] = hooks;
}

Capacity capacity(int64_t flags_per_source, const std::vector<std::pair<std::string, size_t>>& region_bytes) {
  Capacity c;
  c.flags_per_source = flags_per_source;
  for (auto const& [name, bytes] : region_bytes) {
    int id = 0;
    while (id < region_count && name != registered_regions[id]->name) ++id;
    if (id == region_count) {
      std::string known;
      for (int k = 0; k < region_count; ++k) known += (k ? ", " : "") + std::string(registered_regions[k]->name);
      throw std::invalid_argument("entwine comm: no region named " + name + " (registered: " + known + ")");
    }
    c.bytes[id] = bytes;
  }
  return c;
}

void* DeviceComm::workspace(const OpHooks* op) const noexcept {
  for (int i = 0; i < op_count; ++i) {
    if (registered_ops[i] == op) return workspaces[i];
  }
  return nullptr;
}

HeapLayout heap_layout(size_t heap_max_bytes) {
  HeapLayout layout;
  layout.region_bytes = std::max(whole_chunks(heap_max_bytes), kChunkBytes);
  layout.regions = region_count;
  size_t offset = layout.ready_offset() + kChunkBytes;
  for (int id = 0; id < region_count; ++id) {
    layout.copies[id] = registered_regions[id]->double_buffered ? 2 : 1;
    layout.payload_offset[id] = offset;
    offset += layout.copies[id] * layout.region_bytes;
  }
  return layout;
}

size_t HeapLayout::reserved() const {
  return regions == 0 ? ready_offset() + kChunkBytes : region_offset(regions - 1) + copies[regions - 1] * region_bytes;
}

MappedBytes mapped_bytes(int world, const Capacity& capacity) {
  MappedBytes m;
  m.flags = whole_chunks(size_t(world) * size_t(capacity.flags_per_source) * sizeof(uint64_t));
  m.ready = kChunkBytes;
  for (int id = 0; id < region_count; ++id) {
    m.region[id] = whole_chunks(capacity.bytes[id]);
    m.copies[id] = registered_regions[id]->double_buffered ? 2 : 1;
  }
  return m;
}

size_t MappedBytes::total() const {
  size_t sum = 2 * flags + ready;
  for (int id = 0; id < kMaxRegions; ++id) sum += copies[id] * region[id];
  return sum;
}

DeviceComm::~DeviceComm() {
  // Nothing of ours may still run (shutdown() synchronised the device before; a comm destroyed
  // after a failed creation ran nothing but the zeroing); then every mapping goes before its
  // reservation. Physical memory lives until the last process unmaps it, so the order between
  // processes does not matter.
  cudaSetDevice(device);
  if (setup) cudaStreamSynchronize(setup);
  for (int s = 0; s < kMaxWorld; ++s) {
    if (!peer_reserved[s]) continue;
    unmap_beyond(peer_reserved[s], peer_chunks[s], layout, MappedBytes{});
    vmm::free_reservation(peer_reserved[s], layout.reserved());
  }
  if (heap) {
    unmap_beyond(heap, chunks, layout, MappedBytes{});
    vmm::free_reservation(heap, layout.reserved());
  }
  if (epoch) cudaFree(epoch);
  for (cudaEvent_t e : {start, producer_done}) {
    if (e) cudaEventDestroy(e);
  }
  for (int i = 0; i < kMaxSideStreams; ++i) {
    if (side_done[i]) cudaEventDestroy(side_done[i]);
    if (side[i]) cudaStreamDestroy(side[i]);
  }
  if (setup) cudaStreamDestroy(setup);
  if (error_host) cudaFreeHost(error_host);
  if (error_local) cudaFree(error_local);
  for (void* p : workspaces) {
    if (p) cudaFree(p);
  }
  cudaGetLastError();
}

void create(int64_t comm_id, int world, const std::vector<std::pair<int, int>>& local_ranks,
            const Capacity& capacity, size_t heap_max_bytes) {
  std::lock_guard<std::mutex> setup_lock(setup_mutex);
  if (world < 1 || world > kMaxWorld) {
    throw std::runtime_error("entwine comm: world " + std::to_string(world) + " outside [1, 8]");
  }
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (registry().count(comm_id)) {
      throw std::runtime_error("entwine comm: communicator " + std::to_string(comm_id) + " exists");
    }
    created_any = true;
  }
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
    unsigned const event_flags = profiling() ? cudaEventDefault : cudaEventDisableTiming;
    for (cudaEvent_t* e : {&dc->start, &dc->producer_done}) {
      check(cudaEventCreateWithFlags(e, event_flags), "cudaEventCreate");
    }
    check(cudaDeviceGetAttribute(&dc->sm_count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    dc->side_count = side_streams_for(world);
    if (dc->side_count > kMaxSideStreams) {
      throw std::runtime_error("entwine comm: the ops ask " + std::to_string(dc->side_count) +
                               " side streams, more than kMaxSideStreams");
    }
    for (int i = 0; i < dc->side_count; ++i) {
      check(cudaStreamCreateWithPriority(&dc->side[i], cudaStreamNonBlocking, greatest), "cudaStreamCreate(side)");
      check(cudaEventCreateWithFlags(&dc->side_done[i], event_flags), "cudaEventCreate(side)");
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
    uint64_t const first_epoch[3] = {1, 0, 0};  // the epoch, the folded end's two arrival counters
    check(cudaMalloc(reinterpret_cast<void**>(&dc->epoch), sizeof(first_epoch)), "cudaMalloc(epoch)");
    check(cudaMemcpy(dc->epoch, first_epoch, sizeof(first_epoch), cudaMemcpyHostToDevice), "cudaMemcpy(epoch)");
    for (int i = 0; i < op_count; ++i) {
      size_t const bytes = registered_ops[i]->workspace_bytes;
      if (bytes == 0) continue;
      check(cudaMalloc(&dc->workspaces[i], bytes), "cudaMalloc(op workspace)");
      check(cudaMemset(dc->workspaces[i], 0, bytes), "cudaMemset(op workspace)");
    }
    size_t const granule = vmm::granularity(device);
    if (kChunkBytes % granule != 0) {
      throw std::runtime_error("entwine comm: device " + std::to_string(device) + " maps memory in units of " +
                               std::to_string(granule) + " bytes, which do not divide kChunkBytes");
    }
    check(cudaStreamCreateWithFlags(&dc->setup, cudaStreamNonBlocking), "cudaStreamCreate(setup)");
    dc->layout = heap_layout(heap_max_bytes);
    dc->heap = vmm::reserve(dc->layout.reserved(), kChunkBytes);
    dc->accessors = {device};
    map_own(*dc, capacity);
    // The GPU's identity in the heap, for peers to tell whether they share this GPU (connect).
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    check(cudaMemcpyAsync(static_cast<char*>(dc->heap) + dc->layout.gpu_uuid_offset(), prop.uuid.bytes, 16,
                          cudaMemcpyHostToDevice, dc->setup),
          "cudaMemcpyAsync(gpu uuid)");
    check(cudaStreamSynchronize(dc->setup), "cudaStreamSynchronize(gpu uuid)");
    comm.by_device[device] = std::move(dc);
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[comm_id] = std::move(comm);
}

void destroy(int64_t comm_id) {
  std::lock_guard<std::mutex> setup_lock(setup_mutex);
  Comm removed;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    removed = std::move(get(comm_id));
    registry().erase(comm_id);
  }
  // The entries are freed here, outside registry_mutex.
}

std::vector<SharedChunk> export_chunks(int64_t comm_id, int device) {
  std::lock_guard<std::mutex> setup_lock(setup_mutex);
  DeviceComm& dc = entry(setup_get(comm_id), comm_id, device);
  std::vector<SharedChunk> shared;
  try {
    for (const Chunk& c : dc.chunks) shared.push_back({c.offset, c.bytes, vmm::export_fd(c.handle)});
  } catch (...) {
    for (const SharedChunk& c : shared) close(c.fd);
    throw;
  }
  return shared;
}

void import_chunks(int64_t comm_id, int device, int rank, const std::vector<SharedChunk>& chunks) {
  std::lock_guard<std::mutex> setup_lock(setup_mutex);
  DeviceComm& dc = entry(setup_get(comm_id), comm_id, device);
  if (rank < 0 || rank >= dc.world || rank == dc.rank) {
    throw std::runtime_error("entwine comm: cannot import the heap of rank " + std::to_string(rank) + " on rank " +
                             std::to_string(dc.rank) + " of " + std::to_string(dc.world));
  }
  check(cudaSetDevice(device), "cudaSetDevice");
  if (!dc.peer_reserved[rank]) dc.peer_reserved[rank] = vmm::reserve(dc.layout.reserved(), kChunkBytes);
  std::vector<Chunk>& mapped = dc.peer_chunks[rank];
  size_t const before = mapped.size();
  try {
    for (const SharedChunk& c : chunks) {
      auto same = [&](const Chunk& m) { return m.offset == c.offset; };
      auto known = std::find_if(mapped.begin(), mapped.end(), same);
      if (known != mapped.end()) {
        if (known->bytes != c.bytes) throw std::runtime_error("entwine comm: rank " + std::to_string(rank) +
                                                              " sent a chunk of another size at a mapped offset");
        continue;
      }
      if (c.offset % kChunkBytes || c.bytes % kChunkBytes || c.offset + c.bytes > dc.layout.reserved()) {
        throw std::runtime_error("entwine comm: rank " + std::to_string(rank) + " sent a chunk outside the heap layout");
      }
      vmm::Handle const handle = vmm::import_fd(c.fd);
      try {
        vmm::map(static_cast<char*>(dc.peer_reserved[rank]) + c.offset, c.bytes, handle, {device});
      } catch (...) {
        vmm::release(handle);
        throw;
      }
      // The mapping keeps the memory alive; unmapping it is the last reference of this process.
      vmm::release(handle);
      mapped.push_back({c.offset, c.bytes, 0});
    }
  } catch (...) {
    for (size_t i = before; i < mapped.size(); ++i) {
      vmm::unmap(static_cast<char*>(dc.peer_reserved[rank]) + mapped[i].offset, mapped[i].bytes);
    }
    mapped.resize(before);
    throw;
  }
}

void connect(int64_t comm_id, int device, const std::vector<int>& peers) {
  std::lock_guard<std::mutex> setup_lock(setup_mutex);
  Comm& comm = setup_get(comm_id);
  DeviceComm& dc = entry(comm, comm_id, device);
  if (int(peers.size()) != dc.world) {
    throw std::runtime_error("entwine comm: connect got " + std::to_string(peers.size()) +
                             " peers for world " + std::to_string(dc.world));
  }
  check(cudaSetDevice(device), "cudaSetDevice");
  MappedBytes const need = mapped_bytes(dc.world, dc.mapped);
  void* table[kMaxWorld] = {};
  for (int s = 0; s < dc.world; ++s) {
    if (peers[s] < 0) {
      if (!dc.peer_reserved[s] || !covers(dc.peer_chunks[s], dc.layout, need)) {
        throw std::runtime_error("entwine comm: the heap of rank " + std::to_string(s) +
                                 " (another process) is not mapped here as far as " + describe(dc.mapped));
      }
      table[s] = dc.peer_reserved[s];
      continue;
    }
    auto it = comm.by_device.find(peers[s]);
    if (it == comm.by_device.end()) {
      throw std::runtime_error("entwine comm: rank " + std::to_string(s) + " on local device " +
                               std::to_string(peers[s]) + " is not part of the communicator");
    }
    DeviceComm& peer = *it->second;
    if (!at_least(peer.mapped, dc.mapped)) {
      throw std::runtime_error("entwine comm: local rank " + std::to_string(s) + " has not grown to " + describe(dc.mapped));
    }
    if (peers[s] != device) {
      // The copy engines of ag_gemm's pushes want peer access too; XLA usually enabled it already,
      // which is success, but the error must be cleared.
      cudaError_t err = cudaDeviceEnablePeerAccess(peers[s], 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
        err = cudaSuccess;
      }
      check(err, "cudaDeviceEnablePeerAccess");
      // The peer's heap is used through its own addresses: this device is granted its chunks, now
      // and (as an accessor) at every later growth.
      if (std::find(peer.accessors.begin(), peer.accessors.end(), device) == peer.accessors.end()) {
        for (const Chunk& c : peer.chunks) vmm::grant(static_cast<char*>(peer.heap) + c.offset, c.bytes, {device});
        peer.accessors.push_back(device);
      }
    }
    table[s] = peer.heap;
  }
  if (table[dc.rank] != dc.heap) {
    throw std::runtime_error("entwine comm: rank " + std::to_string(dc.rank) +
                             " is not its own device in the peer list");
  }
  std::copy(table, table + kMaxWorld, dc.peer_heap);
  // Which peers' heaps live on this very GPU (processes sharing it): read their identities on the
  // setup stream, which waits for no call.
  unsigned char uuids[kMaxWorld][16] = {};
  for (int s = 0; s < dc.world; ++s) {
    check(cudaMemcpyAsync(uuids[s], static_cast<char*>(table[s]) + dc.layout.gpu_uuid_offset(), 16,
                          cudaMemcpyDeviceToHost, dc.setup),
          "cudaMemcpyAsync(peer gpu uuid)");
  }
  check(cudaStreamSynchronize(dc.setup), "cudaStreamSynchronize(peer gpu uuids)");
  int sharers = 0;
  for (int s = 0; s < dc.world; ++s) sharers += std::memcmp(uuids[s], uuids[dc.rank], 16) == 0 ? 1 : 0;
  dc.gpu_sharers = sharers;
  dc.capacity = dc.mapped;
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
  std::lock_guard<std::mutex> setup_lock(setup_mutex);
  Comm& comm = setup_get(comm_id);
  std::vector<DeviceComm*> grown;
  try {
    for (auto& [device, dc] : comm.by_device) {
      if (!at_least(capacity, dc->mapped)) {
        throw std::runtime_error("entwine comm: grow() to " + describe(capacity) + " would shrink " + describe(dc->mapped));
      }
      map_own(*dc, capacity);
      grown.push_back(dc.get());
    }
  } catch (...) {
    for (DeviceComm* dc : grown) shrink_entry(*dc, comm.capacity);
    throw;
  }
  comm.capacity = capacity;
}

void shrink(int64_t comm_id, const Capacity& capacity) {
  std::lock_guard<std::mutex> setup_lock(setup_mutex);
  Comm& comm = setup_get(comm_id);
  for (auto& [device, dc] : comm.by_device) {
    check(cudaSetDevice(device), "cudaSetDevice");
    shrink_entry(*dc, capacity);
    // A growth that another process failed may have connected here already; no call was built
    // against its capacity (comm.py had not committed it), so the handlers' limit goes back too.
    if (!at_least(capacity, dc->capacity)) dc->capacity = capacity;
  }
  comm.capacity = capacity;
}

std::vector<HeapUsage> heap_usage(int64_t comm_id) {
  std::lock_guard<std::mutex> setup_lock(setup_mutex);
  std::vector<HeapUsage> usage;
  for (auto& [device, dc] : setup_get(comm_id).by_device) {
    HeapUsage u{device, 0, 0, dc->layout.reserved()};
    for (const Chunk& c : dc->chunks) u.own_bytes += c.bytes;
    for (int s = 0; s < kMaxWorld; ++s) {
      for (const Chunk& c : dc->peer_chunks[s]) u.imported_bytes += c.bytes;
    }
    usage.push_back(u);
  }
  return usage;
}

void shutdown() {
  std::lock_guard<std::mutex> setup_lock(setup_mutex);
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
  std::map<int64_t, Comm> removed;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    removed.swap(registry());
  }
  removed.clear();  // frees the entries outside registry_mutex
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

int sm_reserve() noexcept {
  static const int sms = [] {
    const char* env = std::getenv("ENTWINE_SM_RESERVE");
    char* end = nullptr;
    long value = env ? std::strtol(env, &end, 10) : 0;
    return (env && end != env && value > 0 && value < 1024) ? int(value) : 0;
  }();
  return sms;
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
    if (dc->side_count > 0) {
      check(cudaEventElapsedTime(&t.consumer_ms, dc->start, dc->side_done[0]), "cudaEventElapsedTime(side stream 0)");
    }
    timings.push_back(t);
  }
  return timings;
}

std::vector<HandlerCost> handler_cost(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  std::vector<HandlerCost> costs;
  for (auto& [device, dc] : get(comm_id).by_device) {
    uint64_t const calls = dc->handler_calls.load();
    HandlerCost cost{device, calls, calls ? dc->handler_ns.load() / 1e3 / double(calls) : 0.0, {}};
    for (int p = 0; p < kHostPhases; ++p) cost.phase_us[p] = calls ? dc->phase_ns[p].load() / 1e3 / double(calls) : 0.0;
    costs.push_back(cost);
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

void name_call(uint32_t signature, const std::string& description) {
  std::lock_guard<std::mutex> lock(call_names_mutex);
  call_names()[signature & kSignatureMask] = description;
}

namespace {

// "call 17 (gemm_rs x [512, 1024] ...)": a stamp as the user knows it; a signature this process
// never traced is printed as a number.
std::string describe_stamp(uint64_t value) {
  std::string name = "signature " + std::to_string(stamp_signature(value));
  {
    std::lock_guard<std::mutex> lock(call_names_mutex);
    auto it = call_names().find(stamp_signature(value));
    if (it != call_names().end()) name = it->second;
  }
  return "call " + std::to_string(stamp_epoch(value)) + " (" + name + ")";
}

}  // namespace

std::optional<std::string> error_message(const DeviceComm& dc) {
  // Host-mapped and written by the kernel: volatile reads, code last-written by convention.
  const volatile DeviceError* e = dc.error_host;
  if (e == nullptr || e->code == 0 || e->code == kErrorClaimed) return std::nullopt;
  DeviceError record{};
  record.code = e->code;
  record.rank = e->rank;
  record.source = e->source;
  record.tile = e->tile;
  record.expected = e->expected;
  record.observed = e->observed;
  record.site = e->site;
  std::string const unusable = "; the communicator is unusable until the process restarts, and every output of a "
                               "fused call on it since the failure is NaN";
  if (record.code == kErrorAborted) {
    return "entwine: rank " + std::to_string(record.source) + " gave up on the communicator (its own error says why)" +
           unusable;
  }
  if (record.code == kErrorMismatch) {
    return "entwine: rank " + std::to_string(record.rank) + " ran " + describe_stamp(record.expected) + " while rank " +
           std::to_string(record.source) + " ran " + describe_stamp(record.observed) +
           ": the ranks disagree on the sequence of fused calls (a call skipped on one rank, a different plan, "
           "or calls dispatched in different orders)" + unusable;
  }
  if (record.code != kErrorDeadline) {
    return "entwine: rank " + std::to_string(dc.rank) + " recorded device error code " + std::to_string(record.code);
  }
  std::string const waited = "rank " + std::to_string(record.rank) + " waited " + std::to_string(timeout_ms()) + " ms ";
  std::string what = "entwine: " + waited + "at unknown wait site " + std::to_string(record.site);
  for (int i = 0; i < op_count; ++i) {
    int32_t const base = registered_ops[i]->wait_site_base;
    if (record.site >= base && record.site < base + kWaitSitesPerOp) {
      what = registered_ops[i]->describe_deadline(record, waited);
    }
  }
  return what + " in " + describe_stamp(record.expected) + " (its flag held " +
         (record.observed == 0 ? std::string("nothing yet") : describe_stamp(record.observed)) + ")" + unusable;
}

std::optional<std::string> error_message(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (auto& [device, dc] : get(comm_id).by_device) {
    if (auto msg = error_message(*dc)) return msg;
  }
  return std::nullopt;
}

}  // namespace entwine::comm
