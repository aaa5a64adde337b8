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
#include <vector>

#include <cuda_runtime.h>

#include "comm/protocol.h"

namespace entwine::comm {

struct DeviceComm;

// Where a handler's host time goes, in the order a call passes through (HostTimer::lap): its
// checks and plan, the fork of its side streams, the launches of its kernels and copies, the join
// back to XLA's stream, the call's last kernel.
enum HostPhase { kPhaseChecks, kPhaseFork, kPhaseLaunch, kPhaseJoin, kPhaseEnd, kHostPhases };

// --- Ops: what each op needs from every communicator entry, registered once per op before the
// first create() (module.cc, one line per op). ------------------------------------------------
constexpr int kMaxOps = 8;
// Payload regions of the heap, over all ops (HeapLayout).
constexpr int kMaxRegions = 8;
// A payload region of the heap that an op registers (OpHooks::regions).
struct RegionSpec {
  // Unique among every op's regions, e.g. "gemm_rs.partial": Python's capacity requests name it.
  const char* name;
  // Two copies, call e using copy e % 2 (CallEpoch::slot_stride apart): a region whose readers of
  // call e may still read while a peer writes call e+1 (docs/design.md, "The double-buffer argument").
  bool double_buffered;
  // Set by register_op(): the region's id, the index the handler passes to HeapLayout::region_offset.
  int* id;
};
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
  // The op's payload regions of the heap (the flags, ready and abort words are the communicator's).
  const RegionSpec* regions;
  int region_count;
  // How many side streams (DeviceComm::side) a call of the op on a group of `world` ranks uses; the
  // pool has the most any registered op asks.
  int (*side_streams)(int world);
};
// Throws if the op's name, wait sites or a region name collide with a registered op's, if the
// regions exceed kMaxRegions, or after the first create().
void register_op(const OpHooks* hooks);

// Room for the largest call seen so far, of any op: the most flags per source rank (gemm_rs:
// reduction tiles of one partition; ag_gemm: chunks of one shard), and the bytes of each registered
// region (one copy of a double-buffered one), by region id.
struct Capacity {
  int64_t flags_per_source = 0;
  size_t bytes[kMaxRegions] = {};
};
// A capacity from the regions' names (RegionSpec::name) and bytes; throws std::invalid_argument
// naming the registered regions on an unknown name.
Capacity capacity(int64_t flags_per_source, const std::vector<std::pair<std::string, size_t>>& region_bytes);

// Physical memory is mapped into the heap in multiples of this (the driver's granularity on Hopper;
// create() checks that the device's divides it).
constexpr size_t kChunkBytes = size_t(2) << 20;

// Heap layout: one reserved range of virtual addresses per rank, fixed for the communicator's life,
// identical on every rank (peers compute offsets into each other's heaps). Every growing region gets
// `region_bytes` of addresses, the heap cap, so no region ever moves:
//   [flags parity 0 | R][flags parity 1 | R][ready | 1 chunk][region 0, copy 0 | R][copy 1 | R]...
// with one copy of each registered region, two of a double-buffered one, in id order.
// Physical memory is mapped at the start of each region as far as the capacity needs (MappedBytes);
// growing maps more behind it, so a CUDA graph recorded earlier still addresses mapped memory.
// Call e uses flags[e % 2] and copy e % 2 of a double-buffered region (gemm_rs's partial output),
// the parity chosen on the device (CallEpoch). The flags are double-buffered like the partials
// because the kernels index flags by the call's tiles_per_partition: when the shape changes between
// calls, one flag word can belong to different source ranks in calls e and e+1, and a late write of
// call e could land after call e+1's; parity makes the two writers of a word be calls e and e+2,
// which are ordered (docs/design.md, "The double-buffer argument"; it holds across the ops, which
// share the epochs). A single region (ag_gemm's inbox) is for pushes by copy-engine copies, whose
// destination a graph fixes: a sender waits instead until the receiver has started the call
// (ready[sender]).
struct HeapLayout {
  size_t region_bytes = 0;  // addresses per growing region (per copy): the heap cap rounded up to chunks
  int regions = 0;          // registered payload regions
  int copies[kMaxRegions] = {};            // 2: double-buffered
  size_t payload_offset[kMaxRegions] = {};  // copy 0 of each region
  size_t flags_offset() const { return 0; }
  // One chunk: kMaxWorld ready words (one per sender), then the abort word.
  size_t ready_offset() const { return 2 * region_bytes; }
  size_t abort_offset() const { return ready_offset() + kMaxWorld * sizeof(uint64_t); }
  // The last 16 bytes of the ready chunk: the UUID of the GPU the heap lives on, written once at
  // creation, read by peers at connect (DeviceComm::gpu_sharers).
  size_t gpu_uuid_offset() const { return ready_offset() + kChunkBytes - 16; }
  size_t region_offset(int id) const { return payload_offset[id]; }
  size_t reserved() const;
  int64_t flags_stride_words() const { return int64_t(region_bytes / sizeof(uint64_t)); }
  // From copy 0 to copy 1 of a double-buffered region.
  int64_t parity_stride_bytes() const { return int64_t(region_bytes); }
};
// The layout of the registered regions under a heap cap.
HeapLayout heap_layout(size_t heap_max_bytes);

// The bytes mapped at the start of each region for a capacity, whole chunks.
struct MappedBytes {
  size_t flags = 0;  // each parity
  size_t ready = 0;
  size_t region[kMaxRegions] = {};  // each copy
  int copies[kMaxRegions] = {};
  size_t total() const;
};
MappedBytes mapped_bytes(int world, const Capacity& capacity);

// One physical allocation mapped into a heap: [offset, offset + bytes) of the reserved range.
struct Chunk {
  size_t offset = 0, bytes = 0;
  unsigned long long handle = 0;  // vmm::Handle; kept for own chunks (exported again at each growth)
};

// A chunk of another process's heap as sent over the socket: where it goes and its descriptor.
struct SharedChunk {
  size_t offset = 0, bytes = 0;
  int fd = -1;
};

// The most side streams of one entry (OpHooks::side_streams).
constexpr int kMaxSideStreams = kMaxWorld;

// One rank of one comm, living on one local GPU of this process.
struct DeviceComm {
  int device = 0;  // local CUDA ordinal (XLA's DeviceOrdinal)
  int rank = 0, world = 1;
  // What calls may use: checked by the handlers, raised by connect() once every peer has mapped it.
  Capacity capacity;
  Capacity mapped;                      // what the own heap has mapped (>= capacity during a growth)
  HeapLayout layout;
  void* heap = nullptr;                 // the own reservation (layout.reserved() bytes)
  std::vector<Chunk> chunks;            // own physical memory, in mapping order
  std::vector<int> accessors;           // local devices granted access to the own heap (self first)
  void* peer_heap[kMaxWorld] = {};      // heap base of every rank of the group, as seen from here
  // Ranks of other processes: a reservation of ours for their heap and their chunks mapped into it.
  void* peer_reserved[kMaxWorld] = {};
  std::vector<Chunk> peer_chunks[kMaxWorld];
  std::atomic<bool> connected{false};   // peer table filled (read by calls)
  // A handler is enqueueing a call on this entry (handler::ExclusiveDispatch): calls of one
  // communicator take epochs in the order they are enqueued, which two threads would make differ
  // between ranks.
  std::atomic<bool> dispatching{false};
  cudaStream_t setup = nullptr;         // zeroes new chunks without waiting for XLA's or our calls
  // The side streams a call forks XLA's stream into (OpHooks::side_streams: the most any op asks),
  // each joined back through its event. Highest priority, non-blocking: what runs on them (a
  // consumer, copy-engine pushes and their release kernels) goes first on freed SMs.
  int side_count = 0;
  cudaStream_t side[kMaxSideStreams] = {};
  cudaEvent_t side_done[kMaxSideStreams] = {};
  // The fork of XLA's stream and the end of the GEMM window; with side_done[0] what last_call_ms times.
  cudaEvent_t start = nullptr, producer_done = nullptr;
  int sm_count = 0;
  // Ranks of the group on this physical GPU, this one included: above 1 only where processes share
  // a GPU (MPS, or time slicing). Their waiting kernels together must leave it an SM (the handlers
  // clamp their grids: docs/design.md, "Forward progress").
  int gpu_sharers = 1;
  // The call's epoch: a device word, 1 before the first call, advanced at the end of every call
  // (launch_end_call, or the last CTA of a call that folds its end: comm/call_end.cuh). Never
  // reset, so flags of any earlier call are below it, in every chunk however old. epoch[1] and
  // epoch[2] count the arrivals at a folded end (all kernels; gemm_rs's consumer CTAs), 0 between calls.
  uint64_t* epoch = nullptr;
  // Host cost of the handlers on this entry: executions, their summed wall time, and that time by
  // phase (handler_util.h, HostTimer).
  std::atomic<uint64_t> handler_calls{0}, handler_ns{0};
  std::atomic<uint64_t> phase_ns[kHostPhases] = {};
  DeviceError* error_host = nullptr;    // host-mapped pinned: read without synchronising
  DeviceError* error_device = nullptr;  // the same record, as the consumer kernel writes it
  DeviceError* error_local = nullptr;   // device memory: polled and claimed by the consumers
  void* workspaces[kMaxOps] = {};       // each registered op's workspace (OpHooks::workspace_bytes)

  // The workspace of a registered op (nullptr: it asked for none).
  void* workspace(const OpHooks* op) const noexcept;

  DeviceComm() = default;
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;
  ~DeviceComm();  // unmaps and frees everything; errors are ignored at this point
};

// --- Setup (Python, trace time). Each throws std::runtime_error with the CUDA error string. -------
// Growth is a transaction: grow() maps own memory (undone by shrink()), the peers' chunks are
// imported, and connect() publishes the capacity to the handlers only once every peer's heap has
// it mapped here. Calls compiled earlier keep running meanwhile: nothing they address moves.

// Creates the comm's entries for the local ranks: (local device ordinal, rank) pairs. Loads every
// registered op's kernels, creates streams, events, the error record and the ops' workspaces,
// reserves a heap of heap_layout(heap_max_bytes) and maps zeroed memory for `capacity` on each
// device. Creating an existing comm id is an error; a failure leaves no comm behind.
void create(int64_t comm_id, int world, const std::vector<std::pair<int, int>>& local_ranks,
            const Capacity& capacity, size_t heap_max_bytes);
// Removes a comm that no call has used (a creation whose connection failed).
void destroy(int64_t comm_id);

// Maps zeroed memory behind each region of every local heap up to `capacity` (larger in some
// dimension, within the heap cap); calls keep the old capacity until connect(). All or nothing.
void grow(int64_t comm_id, const Capacity& capacity);
// Undoes grow(), imports and connect() down to `capacity` (the capacity comm.py committed last,
// >= what calls may use): a growth that failed here or on another process.
void shrink(int64_t comm_id, const Capacity& capacity);

// Every own chunk of `device`'s heap with a new file descriptor each, for ranks in other processes
// (the caller sends and closes them).
std::vector<SharedChunk> export_chunks(int64_t comm_id, int device);
// Maps the chunks of `rank`'s heap (another process) into this device's reservation for it; chunks
// mapped already are skipped. Does not close the descriptors.
void import_chunks(int64_t comm_id, int device, int rank, const std::vector<SharedChunk>& chunks);

// One entry per rank of `device`'s group: the local ordinal of a rank driven by this process (its
// heap is granted to this device and used directly), or -1 for a rank of another process (its
// chunks imported first). Checks that every peer's heap is mapped here as far as the own heap, then
// lets calls use that capacity.
void connect(int64_t comm_id, int device, const std::vector<int>& peers);

// Waits for all work on every local device of the comm (cudaDeviceSynchronize).
void synchronize(int64_t comm_id);

// Per local device: (device, bytes of physical memory the own heap maps, bytes of peers' memory
// mapped into this process, reserved addresses of the own heap).
struct HeapUsage {
  int device;
  size_t own_bytes, imported_bytes, reserved_bytes;
};
std::vector<HeapUsage> heap_usage(int64_t comm_id);

// Destroys every comm (synchronising each device first). Called once at exit from Python.
void shutdown();

// The call's last kernel (epoch.cu): once `stream`'s earlier work, the whole call, is done, it
// poisons the outputs if this rank failed or a peer aborted, then adds 1 to *epoch.
// prepare_epoch_kernel loads its module (setup). Null pointers: nothing to check or poison.
struct CallEnd {
  uint64_t* epoch = nullptr;
  DeviceError* error = nullptr;   // this rank's record (device memory)
  DeviceError* mirror = nullptr;  // its host-mapped copy
  const uint64_t* aborted = nullptr;  // this rank's abort word (CallEpoch::aborted)
  int rank = 0;
  // The call's outputs, poisoned on failure: the first `outputs` of out and bytes (add_output).
  static constexpr int kMaxOutputs = 8;
  int outputs = 0;
  void* out[kMaxOutputs] = {};
  int64_t bytes[kMaxOutputs] = {};
  // Folded into the call's kernels (comm/call_end.cuh): the arrival counter (DeviceComm::epoch[1])
  // and how many arrivals end the call, the last one advancing the epoch; nullptr: the end kernel.
  uint64_t* done = nullptr;
  uint64_t expected = 0;
  // Appends an output (host side, building the arguments); false when kMaxOutputs are taken.
  bool add_output(void* data, int64_t size_bytes) {
    if (outputs == kMaxOutputs) return false;
    out[outputs] = data;
    bytes[outputs] = size_bytes;
    ++outputs;
    return true;
  }
};
cudaError_t launch_end_call(const CallEnd& end, cudaStream_t stream);
cudaError_t prepare_epoch_kernel();

// Median host microseconds, in *median_us, of gemm_rs's handler's CUDA calls alone (two launches on
// one stream, the second as the first's programmatic dependent; both the end kernel, on a scratch
// epoch), over `reps` runs on `device`, from the calling thread:
// the floor of those calls in this process, to set against handler_cost's launch phases.
cudaError_t call_sequence_us(int device, int reps, double* median_us);

// The epoch word of each local device, after synchronising it (tests and diagnostics only).
std::vector<std::pair<int, uint64_t>> device_epochs(int64_t comm_id);

// --- Execute path (FFI handler): lookups only, no CUDA calls, no exceptions. ----------------------

// The entry of (comm_id, device), or nullptr. Entries live until shutdown() (or the destroy() of a
// comm that no call used).
DeviceComm* find(int64_t comm_id, int device) noexcept;

// Deadline of every flag wait: ENTWINE_TIMEOUT_MS (default 60000: it also has to cover the skew
// between ranks reaching a call, e.g. compile-time differences on a first call), read once per
// process (docs/design.md, "Bounded waits").
uint64_t timeout_ms() noexcept;

// ENTWINE_SM_RESERVE (default 0, read once): SMs that a fused call's waiting kernels leave to the
// kernels of other streams and processes, e.g. NCCL collectives of another mesh axis that XLA runs
// beside our calls (docs/design.md, "Forward progress").
int sm_reserve() noexcept;

// Tests only (hold.cu): `ctas` CTAs of one SM each spinning on a stream of their own, standing for
// another stream's kernel that waits for something outside this GPU, until release() or bound_ms.
class SmHold {
 public:
  SmHold(int device, int ctas, uint64_t bound_ms);
  ~SmHold();
  SmHold(const SmHold&) = delete;
  SmHold& operator=(const SmHold&) = delete;
  int started() const;  // CTAs that have started so far
  void release();       // lets them end and waits for them
 private:
  int device_, ctas_;
  uint32_t* words_ = nullptr;  // host-mapped: [0] release, [1] started CTAs
  cudaStream_t stream_ = nullptr;
};

// ENTWINE_PROFILE=1 (read once, before the first communicator): the per-call events record time.
bool profiling() noexcept;
// Of the last completed call on each local device: milliseconds from the fork of XLA's stream to
// the end of the producer (the GEMM window) and to the join of side stream 0.
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
  double phase_us[kHostPhases];  // the mean by HostPhase
};
std::vector<HandlerCost> handler_cost(int64_t comm_id);

// Names a call signature (CallEpoch::signature) for the error messages of this process: Python
// names each call it traces (op, shapes, layout, config).
void name_call(uint32_t signature, const std::string& description);

// The device error recorded on this entry, formatted for the user, or nullopt.
std::optional<std::string> error_message(const DeviceComm& dc);
// The first device error of any local device of the comm (Python's check_errors()).
std::optional<std::string> error_message(int64_t comm_id);

}  // namespace entwine::comm
