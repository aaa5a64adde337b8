// Communicators, shared by the fused ops: per mesh-axis comm id and local GPU, the symmetric heap,
// peer table, side streams, events, epoch word and device error record. Names no op: each op
// registers what it needs (OpHooks). Set up from Python at trace time; FFI handlers only look
// entries up. Layout and protocol: docs/design.md, "The communicator and symmetric heap".
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <cuda_runtime.h>

#include "comm/protocol.h"

namespace entwine::comm {

struct DeviceComm;

// --- Ops: what each op needs from every communicator entry, registered once per op before the
// first create() (module.cc, one line per op). ------------------------------------------------
constexpr int kMaxOps = 8;
struct OpHooks {
  const char* name;  // e.g. "gemm_rs": names the op in messages
  // Loads every kernel module of the op on the current device and sets its attributes. Run at
  // create(), never lazily: a module loaded at first launch can wait behind a kernel that spins on
  // a flag which that launch's own work would release (a deadlock).
  cudaError_t (*prepare_kernels)();
  // The op's waits record sites [wait_site_base, wait_site_base + kWaitSitesPerOp) in DeviceError.
  int32_t wait_site_base;
  // The message of a deadline record of one of the op's sites; `waited` reads "rank r waited t ms ".
  std::string (*describe_deadline)(const DeviceError& record, const std::string& waited);
  // Bytes of device memory the op keeps per entry, zeroed once at create() (0: none); the handler
  // finds it with DeviceComm::workspace(hooks).
  size_t workspace_bytes;
};
// Throws if the op's name or wait sites collide with a registered op's, or after the first create().
void register_op(const OpHooks* hooks);

// Room for the largest call seen so far, of any op: the double-buffered slot in bytes (gemm_rs: the
// M x N partial output), the single inbox in bytes (ag_gemm: the W gathered shards), and the most
// flags per source rank (gemm_rs: reduction tiles of one partition; ag_gemm: chunks of one shard).
struct Capacity {
  size_t slot_bytes = 0;
  size_t inbox_bytes = 0;
  int64_t max_tiles = 0;
};

// Heap layout, identical on every rank (peers compute offsets into each other's heaps):
//   [flags parity 0: world * max_tiles u64][flags parity 1][ready: kMaxWorld u64]
//   [partial slot 0][partial slot 1][inbox]
// Call e uses flags[e % 2] and partial[e % 2], the parity chosen on the device (CallEpoch). The
// flags are double-buffered like the partials because the kernels index flags by the call's
// tiles_per_partition: when the shape changes between calls, one flag word can belong to different
// source ranks in calls e and e+1, and a late write of call e could land after call e+1's; parity
// makes the two writers of a word be calls e and e+2, which are ordered (docs/design.md, "The
// double-buffer argument"; it holds across the two ops, which share the epochs). The inbox (what
// peers push to ag_gemm) is single: its pushes are copy-engine copies, whose destination a graph
// fixes, so a sender waits instead until the receiver has started the call (ready[sender]).
struct HeapLayout {
  size_t flags_bytes = 0;  // one parity
  size_t slot_bytes = 0;
  size_t inbox_bytes = 0;
  static constexpr size_t kReadyBytes = 256;  // kMaxWorld u64, one per sender, padded
  size_t flags_offset() const { return 0; }
  size_t ready_offset() const { return align(2 * flags_bytes); }
  size_t slot_offset() const { return ready_offset() + kReadyBytes; }
  size_t inbox_offset() const { return slot_offset() + 2 * slot_bytes; }
  size_t total() const { return inbox_offset() + inbox_bytes; }
  static size_t align(size_t bytes) { return (bytes + 255) / 256 * 256; }
};
HeapLayout heap_layout(int world, const Capacity& capacity);

// One rank of one comm, living on one local GPU of this process.
struct DeviceComm {
  int device = 0;  // local CUDA ordinal (XLA's DeviceOrdinal)
  int rank = 0, world = 1;
  Capacity capacity;
  HeapLayout layout;
  void* heap = nullptr;                 // owned, zeroed at allocation
  // Heaps and peer mappings replaced by a growth stay until shutdown: a CUDA graph recorded before
  // the growth (an XLA command buffer) still addresses them when it is replayed.
  std::vector<void*> retired_heaps, retired_imports;
  void* peer_heap[kMaxWorld] = {};      // heap base of every rank of the group, as seen from here
  bool peer_imported[kMaxWorld] = {};   // opened with cudaIpcOpenMemHandle (closed before frees)
  std::atomic<bool> connected{false};   // peer table filled for the current heap (read by calls)
  cudaStream_t consumer = nullptr;      // highest priority, non-blocking (the GEMMs run on XLA's stream)
  cudaEvent_t start = nullptr, producer_done = nullptr, consumer_done = nullptr;
  // ag_gemm: stream d (1 <= d < world) pushes this rank's shard to rank (rank + d) % world, so
  // every link carries a transfer from the start of a call; each joins back through its event.
  cudaStream_t transfer[kMaxWorld] = {};  // highest priority: the release kernels go first
  int sm_count = 0;
  cudaEvent_t transfer_done[kMaxWorld] = {};
  // The call's epoch: a device word, 1 before the first call, advanced by a one-thread kernel on
  // XLA's stream after each call (launch_advance_epoch). Never reset, so flags of any earlier call
  // are below it, in this heap and in the retired ones.
  uint64_t* epoch = nullptr;
  // Host cost of the handlers on this entry: executions and their summed wall time (handler_util.h).
  std::atomic<uint64_t> handler_calls{0}, handler_ns{0};
  DeviceError* error_host = nullptr;    // host-mapped pinned: read without synchronising
  DeviceError* error_device = nullptr;  // the same record, as the consumer kernel writes it
  DeviceError* error_local = nullptr;   // device memory: polled and claimed by the consumers
  void* workspaces[kMaxOps] = {};       // each registered op's workspace (OpHooks::workspace_bytes)

  // The workspace of a registered op (nullptr: it asked for none).
  void* workspace(const OpHooks* op) const noexcept;

  DeviceComm() = default;
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;
  ~DeviceComm();  // frees everything (IPC imports first); errors are ignored at this point
};

// --- Setup (Python, trace time). Each throws std::runtime_error with the CUDA error string. -------

// Creates the comm's entries for the local ranks: (local device ordinal, rank) pairs. Loads every
// registered op's kernels, creates streams, events, the error record and the ops' workspaces, and
// allocates a zeroed heap of `capacity` on each device. Creating an existing comm id is an error.
void create(int64_t comm_id, int world, const std::vector<std::pair<int, int>>& local_ranks,
            const Capacity& capacity);

// This device's heap base as a CUDA IPC handle (64 bytes), for ranks in other processes.
std::string ipc_handle(int64_t comm_id, int device);

// One entry per rank of `device`'s group: the local ordinal of a rank driven by this process (raw
// peer pointer; peer access enabled here) or the IPC handle bytes of a rank in another process.
using Peer = std::variant<int, std::string>;
void connect(int64_t comm_id, int device, const std::vector<Peer>& peers);

// Waits for all work on every local device of the comm (cudaDeviceSynchronize).
void synchronize(int64_t comm_id);
// Clears the peer tables (the imported mappings are retired, not closed); calls are rejected until
// connect().
void disconnect(int64_t comm_id);
// Gives every local device a new zeroed heap of the new capacity; the old one is retired, not
// freed. Requires disconnect() on every rank of every process first. The epochs are kept: flags
// of the new heap start at 0, below the next epoch.
void grow(int64_t comm_id, const Capacity& capacity);

// Destroys every comm (synchronising each device first). Called once at exit from Python.
void shutdown();

// The call's epoch kernel (epoch.cu): one thread adds 1 to *epoch once `stream`'s earlier work,
// the whole call, is done. prepare_epoch_kernel loads its module (setup).
cudaError_t launch_advance_epoch(uint64_t* epoch, cudaStream_t stream);
cudaError_t prepare_epoch_kernel();

// The epoch word of each local device, after synchronising it (tests and diagnostics only).
std::vector<std::pair<int, uint64_t>> device_epochs(int64_t comm_id);

// --- Execute path (FFI handler): lookups only, no CUDA calls, no exceptions. ----------------------

// The entry of (comm_id, device), or nullptr. Entries live until shutdown().
DeviceComm* find(int64_t comm_id, int device) noexcept;

// Deadline of every flag wait: ENTWINE_TIMEOUT_MS (default 60000: it also has to cover the skew
// between ranks reaching a call, e.g. compile-time differences on a first call), read once per
// process (docs/design.md, "Bounded waits").
uint64_t timeout_ms() noexcept;

// ENTWINE_PROFILE=1 (read once, before the first communicator): the per-call events record time.
bool profiling() noexcept;
// Of the last completed call on each local device: milliseconds from the fork of XLA's stream to
// the end of the producer (the GEMM window) and to the end of the consumer.
struct CallTiming {
  int device;
  float producer_ms, consumer_ms;
};
std::vector<CallTiming> last_call_ms(int64_t comm_id);

// Per local device: how many times the handlers executed on it and their mean host time (the
// handler's own wall time: validation, plan, TMA descriptors, launches).
struct HandlerCost {
  int device;
  uint64_t calls;
  double mean_us;
};
std::vector<HandlerCost> handler_cost(int64_t comm_id);

// The device error recorded on this entry, formatted for the user, or nullopt.
std::optional<std::string> error_message(const DeviceComm& dc);
// The first device error of any local device of the comm (Python's check_errors()).
std::optional<std::string> error_message(int64_t comm_id);

}  // namespace entwine::comm
