// XLA FFI handlers `entwine_moe_dispatch_gemm` (bf16/fp16, static capacity) and `entwine_moe_transfer`
// (the same moves without the GEMM, any dtype). moe_dispatch_gemm: checks one rank's
// operands, plans its call, runs the expert GEMM over the receive pool as the segments arrive (XLA's
// stream) beside this rank's pushes of its x_send segments to every peer, one flag per (source,
// expert): one SM push kernel ahead of the GEMM, or copy engines on transfer streams forked from
// XLA's and joined back; and moe::kHooks. No kernel syntax; no allocation, free, synchronisation,
// IPC or peer-access call (see gemm_rs).
#include <cstdint>
#include <initializer_list>
#include <string>

#include <cuda_runtime.h>

#include "comm/comm.h"
#include "comm/handler_util.h"
#include "moe/moe.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace entwine {

namespace moe {

namespace {

// The heap region of the receive pool (single: a copy engine's destination is fixed in a graph; see
// RunMoeDispatch for why one copy suffices).
int inbox_region = -1;
const comm::RegionSpec kRegions[] = {{"moe.inbox", false, &inbox_region}};

}  // namespace

// Side stream d - 1 is transfer stream d (1 <= d < world): it pushes this rank's segments to rank
// (rank + d) % world, so every link carries a transfer from the start of a call. The workspace holds
// the SM push's arrival counters.
const comm::OpHooks kHooks{
    "moe",
    prepare_kernels,
    kMoeWaitSiteBase,
    [](const DeviceError& e, const std::string& waited) -> std::string {
      if (e.site == kMoeWaitInboxReady) {
        return "entwine moe_dispatch_gemm: " + waited + "for rank " + std::to_string(e.source) +
               " to start the call (before pushing tokens into rank " + std::to_string(e.source) + "'s pool)";
      }
      if (e.site == kMoeWaitCombineReady) {
        return "entwine moe_gemm_combine: " + waited + "for rank " + std::to_string(e.source) +
               " to start the call (before storing its tokens' rows into its inbox)";
      }
      std::string const op = e.site == kMoeWaitTransfer ? "moe_transfer" : "moe_dispatch_gemm";
      return "entwine " + op + ": " + waited + "for the rows of rank " + std::to_string(e.source) +
             " for local expert " + std::to_string(e.tile);
    },
    kMoePushArrivalsBytes,
    kRegions,
    1,
    [](int world) { return world - 1; },
};

}  // namespace moe

namespace {

constexpr const char* kOp = "entwine moe_dispatch_gemm";
constexpr const char* kCombineOp = "entwine moe_gemm_combine";
using handler::DeviceGuard;
using handler::dims_string;

// What a call of either target needs of the GPU (the SMs its waiting kernels and releases hold at
// once) and of the communicator (the pool and one flag per (source, expert)).
ffi::Error check_room(const char* op, MoePlan const& plan, comm::DeviceComm const& dc) {
  if (plan.sms_needed > dc.sm_count) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the call's kernels need " +
                                       std::to_string(plan.sms_needed) + " SMs at once (the GEMM's " +
                                       std::to_string(plan.grid) + " CTAs, the push's " +
                                       std::to_string(plan.push_grid) + " or one for the releases), this GPU has " +
                                       std::to_string(dc.sm_count));
  }
  size_t const has_bytes = dc.capacity.bytes[moe::inbox_region];
  if (size_t(plan.inbox_bytes) > has_bytes || plan.e_local > dc.capacity.flags_per_source) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(op) + ": call needs a pool of " + std::to_string(plan.inbox_bytes) + " bytes and " +
                          std::to_string(plan.e_local) + " flags per source, communicator has " +
                          std::to_string(has_bytes) + " bytes and " + std::to_string(dc.capacity.flags_per_source) +
                          " flags per source");
  }
  return ffi::Error::Success();
}

// The plan's rules, then check_room.
ffi::Error check_plan(MoePlan const& plan, MoeProblem const& problem, MoeConfig const& config,
                      comm::DeviceComm const& dc) {
  if (plan.error != nullptr) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": " + plan.error + " (E=" + std::to_string(problem.experts) +
                                       ", C=" + std::to_string(problem.capacity) + ", K=" + std::to_string(problem.k) +
                                       ", N=" + std::to_string(problem.n) + ", W=" + std::to_string(problem.world) +
                                       ", config " + ENTWINE_CONFIG_STRING(config, ENTWINE_MOE_CONFIG_FIELDS) + ")");
  }
  return check_room(kOp, plan, dc);
}

// The config the kernels run: the GEMM's grid leaves the SMs the pushes need (handler::waiting_gemm_sms).
MoeConfig run_config(MoeConfig cfg, comm::DeviceComm const& dc) {
  cfg.gemm_sms = handler::waiting_gemm_sms(cfg.gemm_sms, cfg.push_sms, dc);
  return cfg;
}

// A call's operands: 16-bit (x_send, w and y of one dtype) or FP8 (x_send e4m3/e5m2, w_t e4m3, y
// bf16/fp16, and the scales).
struct Operands {
  DType input, output;
  ffi::AnyBuffer x_send, w;
  const float* x_scales = nullptr;  // FP8: every source's x_scale [W]
  const float* w_scale = nullptr;   // FP8
  int64_t x_scale_count = 0;        // FP8: x_scales' length, W
  const ffi::AnyBuffer* received = nullptr;  // int32 [E_local, W]: the rows each source sent each expert
  const ffi::AnyBuffer* sent = nullptr;      // int32 [E]: the rows this rank sends each expert
};

// A row-count operand of `name`: int32 of exactly `dims` (`words` names them in the message).
ffi::Error row_counts(const char* op, const char* name, const char* words, ffi::AnyBuffer const& counts,
                      std::initializer_list<int64_t> dims, const int32_t** out) {
  auto const d = counts.dimensions();
  bool ok = counts.element_type() == ffi::DataType::S32 && d.size() == dims.size();
  std::string want;
  size_t i = 0;
  for (int64_t v : dims) {
    ok = ok && d[i] == v;
    want += (i++ == 0 ? "" : ", ") + std::to_string(v);
  }
  if (!ok) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must be int32 " + words + " = [" + want +
                                       "], got dtype code " + std::to_string(int(counts.element_type())) + " " +
                                       dims_string(d));
  }
  *out = static_cast<const int32_t*>(counts.untyped_data());
  return ffi::Error::Success();
}

// The rows of each (expert, source) segment, int32 [E_local, W] (received_rows in entwine_jax/moe/op.py).
ffi::Error received_rows(const char* op, ffi::AnyBuffer const& received, int64_t e_local, int64_t world,
                         const int32_t** out) {
  return row_counts(op, "received", "[E/W, W]", received, {e_local, world}, out);
}

// The problem from x_send [E, C, K], w [E_local, K, N] (FP8: w_t [E_local, N, K]), y [E_local, W * C, N]
// and the pool output [E_local, W * C, K] (or empty).
ffi::Error problem_of(Operands const& ops, ffi::AnyBuffer const& y, ffi::AnyBuffer const& pool,
                      comm::DeviceComm const& dc, MoeProblem* problem) {
  int64_t const world = dc.world;
  bool const fp8 = is_fp8(ops.input);
  auto xd = ops.x_send.dimensions(), wd = ops.w.dimensions(), yd = y.dimensions(), pd = pool.dimensions();
  bool ok = xd.size() == 3 && wd.size() == 3 && yd.size() == 3 && xd[0] % world == 0;
  int64_t n = 0;
  if (ok) {
    int64_t const e_local = xd[0] / world, c = xd[1], k = xd[2];
    n = fp8 ? wd[1] : wd[2];
    ok = wd[0] == e_local && (fp8 ? wd[2] : wd[1]) == k && yd[0] == e_local && yd[1] == world * c && yd[2] == n;
    ok = ok && (pool.element_count() == 0 ||
                (pd.size() == 3 && pd[0] == e_local && pd[1] == world * c && pd[2] == k));
    ok = ok && (!fp8 || ops.x_scale_count == world);
  }
  if (!ok) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": expected x_send [E, C, K] (E a multiple of W), " +
                                       (fp8 ? "w_t [E/W, N, K]" : "w [E/W, K, N]") +
                                       ", y [E/W, W*C, N], pool [E/W, W*C, K] or empty" + (fp8 ? " and x_scales [W]" : "") +
                                       "; got x_send " +
                                       dims_string(xd) + ", w " + dims_string(wd) + ", y " + dims_string(yd) +
                                       ", pool " + dims_string(pd) +
                                       (fp8 ? ", x_scales [" + std::to_string(ops.x_scale_count) + "]" : "") +
                                       " with W = " + std::to_string(world));
  }
  problem->world = dc.world;
  problem->rank = dc.rank;
  problem->experts = int32_t(xd[0]);
  problem->capacity = int32_t(xd[1]);
  problem->k = int32_t(xd[2]);
  problem->n = int32_t(n);
  problem->input = ops.input;
  return ffi::Error::Success();
}

// A plan and its prepared GEMM, derived once per call site and buffers, then found in a memo keyed
// by every value it reads.
struct Derived {
  MoePlan plan;
  PreparedGemm gemm;
};

// The key words both GEMMs' memos share: the problem, capture, the call's strides and deadline, the
// config; the call's own words (handler::add_call) too.
template <size_t kWords>
void add_problem(handler::MemoKey<kWords>& key, MoeProblem const& problem, bool capturing, CallEpoch const& call,
                 uint64_t timeout_ns, MoeConfig const& config) {
  for (int64_t v : {int64_t(problem.input), int64_t(problem.experts), int64_t(problem.capacity), int64_t(problem.k),
                    int64_t(problem.n), int64_t(problem.world), int64_t(problem.rank), int64_t(capturing),
                    call.slot_stride, call.flags_stride, int64_t(timeout_ns)}) {
    key.add(uint64_t(v));
  }
#define ENTWINE_MEMO_FIELD(type, name, value) key.add(uint64_t(config.name));
  ENTWINE_MOE_CONFIG_FIELDS(ENTWINE_MEMO_FIELD)
#undef ENTWINE_MEMO_FIELD
  handler::add_call(key, call);
}

ffi::Error derive(MoeProblem const& problem, DType output, MoeGemmArgs const& args, bool capturing,
                  MoeConfig const& config, comm::DeviceComm const& dc, Derived const** derived) {
  static thread_local handler::CallMemo<48, Derived> memo;
  handler::MemoKey<48> key;
  add_problem(key, problem, capturing, args.call, args.timeout_ns, config);
  key.add(uint64_t(output));
  for (const void* p : {args.x_send, args.inbox, args.w, static_cast<const void*>(args.y),
                        static_cast<const void*>(args.flags), static_cast<const void*>(args.error),
                        static_cast<const void*>(args.error_mirror), static_cast<const void*>(args.call.epoch),
                        static_cast<const void*>(args.x_scales), static_cast<const void*>(args.w_scale),
                        static_cast<const void*>(args.received)}) {
    key.add(p);
  }
  *derived = memo.find(key);
  if (*derived != nullptr) return ffi::Error::Success();
  MoeConfig const run = run_config(config, dc);
  Derived fresh{moe_plan(problem, run), {}};
  if (ffi::Error e = check_plan(fresh.plan, problem, run, dc); e.failure()) return e;
  ENTWINE_RETURN_IF_CUDA(kOp, moe::prepare_gemm(problem.input, output, fresh.plan, args, &fresh.gemm));
  Derived* entry = memo.insert(key);
  *entry = fresh;
  *derived = entry;
  return ffi::Error::Success();
}

// The combine's plan and prepared GEMM, memoised as derive's.
ffi::Error derive_combine(MoeProblem const& problem, DType output, MoeCombineArgs const& args, bool capturing,
                          MoeConfig const& config, comm::DeviceComm const& dc, Derived const** derived) {
  // Every rank's inbox and flags are in the key: room for 8 ranks' (16 words) beyond derive's.
  static thread_local handler::CallMemo<72, Derived> memo;
  handler::MemoKey<72> key;
  add_problem(key, problem, capturing, args.call, args.timeout_ns, config);
  key.add(uint64_t(output));
  for (const void* p : {args.h, args.w, static_cast<const void*>(args.ready), static_cast<const void*>(args.arrivals),
                        static_cast<const void*>(args.error), static_cast<const void*>(args.error_mirror),
                        static_cast<const void*>(args.call.epoch), static_cast<const void*>(args.x_scale),
                        static_cast<const void*>(args.w_scale), static_cast<const void*>(args.received)}) {
    key.add(p);
  }
  for (int q = 0; q < dc.world; ++q) {
    key.add(static_cast<const void*>(args.inbox[q]));
    key.add(static_cast<const void*>(args.flags[q]));
  }
  *derived = memo.find(key);
  if (*derived != nullptr) return ffi::Error::Success();
  MoeConfig const run = run_config(config, dc);
  Derived fresh{moe_combine_plan(problem, run), {}};
  if (fresh.plan.error != nullptr) {
    return ffi::Error::InvalidArgument(std::string(kCombineOp) + ": " + fresh.plan.error + " (E=" +
                                       std::to_string(problem.experts) + ", C=" + std::to_string(problem.capacity) +
                                       ", F=" + std::to_string(problem.k) + ", H=" + std::to_string(problem.n) +
                                       ", config " + ENTWINE_CONFIG_STRING(run, ENTWINE_MOE_CONFIG_FIELDS) + ")");
  }
  if (ffi::Error e = check_room(kCombineOp, fresh.plan, dc); e.failure()) return e;
  ENTWINE_RETURN_IF_CUDA(kCombineOp,
                         moe::combine::prepare_gemm(problem.input, output, fresh.plan, args, &fresh.gemm));
  Derived* entry = memo.insert(key);
  *entry = fresh;
  *derived = entry;
  return ffi::Error::Success();
}

// The SM push on `stream`: waits for every receiver, pushes every segment, releases each.
ffi::Error enqueue_sm_push(comm::DeviceComm& dc, MoePlan const& plan, const void* x_send, const int32_t* sent,
                           CallEpoch const& epoch, cudaStream_t stream) {
  size_t const inbox_offset = dc.layout.region_offset(moe::inbox_region);
  MoePushArgs push{};
  push.x_send = x_send;
  for (int q = 0; q < dc.world; ++q) {
    if (q == dc.rank) continue;
    char* const peer_heap = static_cast<char*>(dc.peer_heap[q]);
    push.inbox[q] = peer_heap + inbox_offset;
    push.flags[q] = reinterpret_cast<uint64_t*>(peer_heap + dc.layout.flags_offset());
  }
  push.ready = reinterpret_cast<uint64_t*>(static_cast<char*>(dc.heap) + dc.layout.ready_offset());
  push.arrivals = static_cast<uint32_t*>(dc.workspace(&moe::kHooks));
  push.slice_bytes = plan.slice_bytes;
  push.row_bytes = plan.slice_bytes / plan.shape.capacity;
  push.sent = sent;
  push.e_local = plan.e_local;
  push.rank = dc.rank;
  push.world = dc.world;
  push.error = dc.error_local;
  push.error_mirror = dc.error_device;
  push.call = epoch;
  push.timeout_ns = comm::timeout_ms() * 1000000ull;
  ENTWINE_RETURN_IF_CUDA(kOp, moe::launch_push(plan, push, stream));
  return ffi::Error::Success();
}

// Copy engines: side stream d - 1 sends this rank's segments to rank (rank + d) % W (receiver wait,
// then per expert one copy and one release), forked from dc.start, recording its side_done.
ffi::Error enqueue_copy_engine_pushes(comm::DeviceComm& dc, MoePlan const& plan, const void* x_send,
                                      CallEpoch const& epoch) {
  size_t const inbox_offset = dc.layout.region_offset(moe::inbox_region);
  uint64_t* const own_ready = reinterpret_cast<uint64_t*>(static_cast<char*>(dc.heap) + dc.layout.ready_offset());
  for (int d = 1; d < dc.world; ++d) {
    int const peer = (dc.rank + d) % dc.world;
    cudaStream_t const stream = dc.side[d - 1];
    ENTWINE_RETURN_IF_CUDA(kOp, cudaStreamWaitEvent(stream, dc.start, 0));
    char* const peer_heap = static_cast<char*>(dc.peer_heap[peer]);
    MoeTransferArgs t{};
    t.x_send = x_send;
    t.inbox = peer_heap + inbox_offset;
    t.flags = reinterpret_cast<uint64_t*>(peer_heap + dc.layout.flags_offset());
    t.ready = own_ready + peer;
    t.rank = dc.rank;
    t.dest = peer;
    t.error = dc.error_local;
    t.error_mirror = dc.error_device;
    t.call = epoch;
    t.timeout_ns = comm::timeout_ms() * 1000000ull;
    ENTWINE_RETURN_IF_CUDA(kOp, moe::launch_push_copy(plan, t, stream));
    ENTWINE_RETURN_IF_CUDA(kOp, cudaEventRecord(dc.side_done[d - 1], stream));
  }
  return ffi::Error::Success();
}

// The receiver's wait for every peer's segments of this call (moe_transfer's, the combine's).
MoeWaitArgs wait_args(comm::DeviceComm const& dc, MoePlan const& plan, CallEpoch const& epoch) {
  MoeWaitArgs wait{};
  wait.flags = reinterpret_cast<const uint64_t*>(static_cast<char*>(dc.heap) + dc.layout.flags_offset());
  wait.e_local = plan.e_local;
  wait.rank = dc.rank;
  wait.world = dc.world;
  wait.error = dc.error_local;
  wait.error_mirror = dc.error_device;
  wait.call = epoch;
  wait.timeout_ns = comm::timeout_ms() * 1000000ull;
  return wait;
}

// The receive pool as an output [E_local, W * C, K], on XLA's stream after the GEMM (which acquired
// every segment): the peers' segments from the inbox, this rank's own from x_send (MoePoolArgs).
ffi::Error copy_pool(comm::DeviceComm const& dc, MoePlan const& plan, const void* x_send, const int32_t* received,
                     ffi::AnyBuffer& pool, cudaStream_t xla_stream) {
  if (pool.element_count() == 0) return ffi::Error::Success();
  MoePoolArgs a{};
  a.own_rows = static_cast<char const*>(x_send) + int64_t(dc.rank) * plan.e_local * plan.slice_bytes;
  a.inbox = static_cast<char const*>(dc.heap) + dc.layout.region_offset(moe::inbox_region);
  a.pool = static_cast<char*>(pool.untyped_data());
  a.received = received;
  a.slice_bytes = plan.slice_bytes;
  a.row_bytes = plan.slice_bytes / plan.shape.capacity;
  a.e_local = plan.e_local;
  a.rank = dc.rank;
  a.world = dc.world;
  ENTWINE_RETURN_IF_CUDA(kOp, moe::launch_copy_pool(a, xla_stream));
  return ffi::Error::Success();
}

// The inbox is single for ag_gemm's reason (ffi/ag_gemm/handler.cc, RunAgGemm): a source's transfer
// to rank r opens with a wait for r's announcement of the call, which r makes only after its
// previous call, every read of the pool included, completed on r's XLA stream.
ffi::Error RunMoeDispatch(cudaStream_t xla_stream, int32_t device, Operands const& ops, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> pool, int64_t comm_id, int64_t signature, MoeConfig config) {
  comm::DeviceComm* dc = nullptr;
  if (ffi::Error e = handler::usable_comm(kOp, comm_id, device, &dc); e.failure()) return e;
  handler::ExclusiveDispatch const exclusive(*dc);
  if (ffi::Error e = exclusive.check(kOp); e.failure()) return e;
  handler::HostTimer timer{dc};
  MoeProblem problem;
  if (ffi::Error e = problem_of(ops, *y, *pool, *dc, &problem); e.failure()) return e;
  bool capturing = false;
  if (ffi::Error e = handler::is_capturing(kOp, xla_stream, &capturing); e.failure()) return e;

  DeviceGuard guard;
  ENTWINE_RETURN_IF_CUDA(kOp, guard.set(device));
  char* const own = static_cast<char*>(dc->heap);
  CallEpoch const epoch_args = handler::call_epoch(*dc, capturing, signature);
  MoeGemmArgs args{};
  args.x_send = ops.x_send.untyped_data();
  args.inbox = own + dc->layout.region_offset(moe::inbox_region);
  args.w = ops.w.untyped_data();
  args.x_scales = ops.x_scales;
  args.w_scale = ops.w_scale;
  if (ffi::Error e = received_rows(kOp, *ops.received, problem.experts / dc->world, dc->world, &args.received);
      e.failure()) {
    return e;
  }
  // The rows this rank sends each expert (sent_rows in entwine_jax/moe/reference.py).
  const int32_t* sent = nullptr;
  if (ffi::Error e = row_counts(kOp, "sent", "[E]", *ops.sent, {problem.experts}, &sent); e.failure()) return e;
  args.y = y->untyped_data();
  args.flags = reinterpret_cast<const uint64_t*>(own + dc->layout.flags_offset());
  args.error = dc->error_local;
  args.error_mirror = dc->error_device;
  args.call = epoch_args;
  args.timeout_ns = comm::timeout_ms() * 1000000ull;
  Derived const* derived = nullptr;
  if (ffi::Error e = derive(problem, ops.output, args, capturing, config, *dc, &derived); e.failure()) return e;
  MoePlan const& plan = derived->plan;

  timer.lap(comm::kPhaseChecks);
  ffi::Error const pushed = handler::run_pushes_and_gemm(
      kOp, *dc, plan.push_grid > 0 && dc->world > 1, derived->gemm, xla_stream, timer,
      [&](cudaStream_t stream) { return enqueue_sm_push(*dc, plan, args.x_send, sent, epoch_args, stream); },
      [&] { return enqueue_copy_engine_pushes(*dc, plan, args.x_send, epoch_args); },
      [&] { return copy_pool(*dc, plan, args.x_send, args.received, *pool, xla_stream); });
  if (pushed.failure()) return pushed;
  // The next call's epoch, once this whole call is done (outputs poisoned if it failed anywhere).
  comm::CallEnd end = handler::call_end(*dc, epoch_args);
  end.add_output(y->untyped_data(), int64_t(y->size_bytes()));
  end.add_output(pool->untyped_data(), int64_t(pool->size_bytes()));
  ENTWINE_RETURN_IF_CUDA(kOp, comm::launch_end_call(end, xla_stream));
  timer.lap(comm::kPhaseEnd);
  return ffi::Error::Success();
}

ffi::Error MoeDispatchGemmImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer x_send, ffi::AnyBuffer w,
                               ffi::AnyBuffer received, ffi::AnyBuffer sent, ffi::Result<ffi::AnyBuffer> y,
                               ffi::Result<ffi::AnyBuffer> pool, int64_t comm_id, int64_t signature,
                               MoeConfig config) {
  return handler::guarded(kOp, [&]() -> ffi::Error {
    Operands ops{DType::kBF16, DType::kBF16, x_send, w};
    ops.received = &received;
    ops.sent = &sent;
    if (ffi::Error e = handler::element_type(kOp, "x_send", x_send, &ops.input); e.failure()) return e;
    if (w.element_type() != x_send.element_type() || y->element_type() != x_send.element_type() ||
        pool->element_type() != x_send.element_type()) {
      return ffi::Error::InvalidArgument(std::string(kOp) + ": x_send, w, y and pool must share one dtype");
    }
    ops.output = ops.input;
    return RunMoeDispatch(xla_stream, device, ops, y, pool, comm_id, signature, config);
  });
}

// FP8 per tensor: x_send in float8_e4m3fn or float8_e5m2 (a gradient), w_t [E_local, N, K] in
// float8_e4m3fn, x_scales f32 [W] (every source's scale, gathered before the call) and w_scale f32;
// y bf16 or fp16; the pool in x_send's dtype (or empty).
ffi::Error MoeDispatchGemmFp8Impl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer x_send, ffi::AnyBuffer w_t,
                                  ffi::AnyBuffer x_scales, ffi::AnyBuffer w_scale, ffi::AnyBuffer received,
                                  ffi::AnyBuffer sent, ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::AnyBuffer> pool, int64_t comm_id, int64_t signature,
                                  MoeConfig config) {
  return handler::guarded(kOp, [&]() -> ffi::Error {
    Operands ops{DType::kE4M3, DType::kBF16, x_send, w_t};
    ops.received = &received;
    ops.sent = &sent;
    if (ffi::Error e = handler::fp8_input(kOp, "x_send", x_send, &ops.input); e.failure()) return e;
    if (ffi::Error e = handler::fp8_weight(kOp, "w_t", w_t); e.failure()) return e;
    if (ffi::Error e = handler::element_type(kOp, "y", *y, &ops.output); e.failure()) return e;
    if (pool->element_type() != x_send.element_type()) {
      return ffi::Error::InvalidArgument(std::string(kOp) + ": the pool must have x_send's dtype");
    }
    if (ffi::Error e = handler::scale_operand(kOp, "w_scale", w_scale, &ops.w_scale); e.failure()) return e;
    auto const sd = x_scales.dimensions();
    if (x_scales.element_type() != ffi::DataType::F32 || sd.size() != 1) {
      return ffi::Error::InvalidArgument(std::string(kOp) + ": x_scales must be float32 [W], got dtype code " +
                                         std::to_string(int(x_scales.element_type())) + " " + dims_string(sd));
    }
    ops.x_scales = static_cast<const float*>(x_scales.untyped_data());
    ops.x_scale_count = sd[0];
    return RunMoeDispatch(xla_stream, device, ops, y, pool, comm_id, signature, config);
  });
}

// moe_gemm_combine's operands once its target's type checks passed: h [E_local, W * C, F] and w2
// [E_local, F, H] of one 16-bit dtype, or FP8 per tensor (h e4m3 or e5m2, w2_t [E_local, H, F] e4m3,
// each with its scale; the rows in the 16-bit output type).
struct CombineOperands {
  DType input, output;
  ffi::AnyBuffer h, w;
  const float* x_scale = nullptr;  // FP8 only
  const float* w_scale = nullptr;
  const ffi::AnyBuffer* received = nullptr;  // int32 [E_local, W]: the rows each source reads back
};

// moe_gemm_combine's GEMM and return -> o_recv [E, C, H] at every source: the GEMM (XLA's stream)
// stores each finished block into its source's inbox and releases each segment
// (moe/combine_schedule.cuh); then this rank waits for every peer's segments of its own rows and
// copies its inbox out. The inbox is the dispatch's, under the same announcement rule (the GEMM
// announces the call as it starts; its stores into a source wait for that source's announcement).
ffi::Error RunMoeCombine(cudaStream_t xla_stream, int32_t device, CombineOperands const& ops,
                         ffi::Result<ffi::AnyBuffer> o_recv, int64_t comm_id, int64_t signature, MoeConfig config) {
  comm::DeviceComm* dc = nullptr;
  if (ffi::Error e = handler::usable_comm(kCombineOp, comm_id, device, &dc); e.failure()) return e;
  handler::ExclusiveDispatch const exclusive(*dc);
  if (ffi::Error e = exclusive.check(kCombineOp); e.failure()) return e;
  handler::HostTimer timer{dc};
  int64_t const world = dc->world;
  bool const fp8 = is_fp8(ops.input);
  auto hd = ops.h.dimensions(), wd = ops.w.dimensions(), od = o_recv->dimensions();
  bool ok = hd.size() == 3 && wd.size() == 3 && od.size() == 3 && hd[1] % world == 0;
  // w2 [E_local, F, H], or FP8 w2_t [E_local, H, F].
  int64_t const f = ok ? (fp8 ? wd[2] : wd[1]) : 0, n = ok ? (fp8 ? wd[1] : wd[2]) : 0;
  ok = ok && wd[0] == hd[0] && f == hd[2] && od[0] == world * hd[0] && od[1] == hd[1] / world && od[2] == n;
  if (!ok) {
    return ffi::Error::InvalidArgument(std::string(kCombineOp) + ": expected h [E/W, W*C, F], " +
                                       (fp8 ? "w2_t [E/W, H, F]" : "w2 [E/W, F, H]") + " and o_recv [E, C, H]; got h " +
                                       dims_string(hd) + ", w2 " + dims_string(wd) + ", o_recv " + dims_string(od) +
                                       " with W = " + std::to_string(world));
  }
  MoeProblem const problem{dc->world, dc->rank, int32_t(od[0]), int32_t(od[1]), int32_t(hd[2]), int32_t(n),
                           ops.input};
  bool capturing = false;
  if (ffi::Error e = handler::is_capturing(kCombineOp, xla_stream, &capturing); e.failure()) return e;
  DeviceGuard guard;
  ENTWINE_RETURN_IF_CUDA(kCombineOp, guard.set(device));
  CallEpoch const epoch_args = handler::call_epoch(*dc, capturing, signature);
  size_t const inbox_offset = dc->layout.region_offset(moe::inbox_region);
  MoeCombineArgs args{};
  args.h = ops.h.untyped_data();
  args.w = ops.w.untyped_data();
  args.x_scale = ops.x_scale;
  args.w_scale = ops.w_scale;
  if (ffi::Error e = received_rows(kCombineOp, *ops.received, hd[0], world, &args.received); e.failure()) return e;
  for (int q = 0; q < dc->world; ++q) {
    char* const heap = static_cast<char*>(q == dc->rank ? dc->heap : dc->peer_heap[q]);
    args.inbox[q] = heap + inbox_offset;
    args.flags[q] = reinterpret_cast<uint64_t*>(heap + dc->layout.flags_offset());
  }
  char* const own = static_cast<char*>(dc->heap);
  args.ready = reinterpret_cast<const uint64_t*>(own + dc->layout.ready_offset());
  args.arrivals = static_cast<uint32_t*>(dc->workspace(&moe::kHooks));
  args.error = dc->error_local;
  args.error_mirror = dc->error_device;
  args.call = epoch_args;
  args.timeout_ns = comm::timeout_ms() * 1000000ull;
  Derived const* derived = nullptr;
  if (ffi::Error e = derive_combine(problem, ops.output, args, capturing, config, *dc, &derived); e.failure()) {
    return e;
  }
  MoePlan const& plan = derived->plan;
  timer.lap(comm::kPhaseChecks);
  timer.lap(comm::kPhaseFork);
  ENTWINE_RETURN_IF_CUDA(kCombineOp, derived->gemm.enqueue(xla_stream));
  // This rank's rows from every peer (its own segments are the GEMM's, complete in stream order).
  ENTWINE_RETURN_IF_CUDA(kCombineOp, moe::launch_wait_segments(wait_args(*dc, plan, epoch_args), xla_stream));
  ENTWINE_RETURN_IF_CUDA(kCombineOp, cudaMemcpyAsync(o_recv->untyped_data(), own + inbox_offset, plan.inbox_bytes,
                                                     cudaMemcpyDeviceToDevice, xla_stream));
  timer.lap(comm::kPhaseLaunch);
  timer.lap(comm::kPhaseJoin);
  comm::CallEnd end = handler::call_end(*dc, epoch_args);
  end.add_output(o_recv->untyped_data(), int64_t(o_recv->size_bytes()));
  ENTWINE_RETURN_IF_CUDA(kCombineOp, comm::launch_end_call(end, xla_stream));
  timer.lap(comm::kPhaseEnd);
  return ffi::Error::Success();
}

// 16-bit: h, w2 and o_recv of one dtype.
ffi::Error MoeGemmCombineImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer h, ffi::AnyBuffer w2,
                              ffi::AnyBuffer received, ffi::Result<ffi::AnyBuffer> o_recv, int64_t comm_id,
                              int64_t signature, MoeConfig config) {
  return handler::guarded(kCombineOp, [&]() -> ffi::Error {
    CombineOperands ops{DType::kBF16, DType::kBF16, h, w2};
    ops.received = &received;
    if (ffi::Error e = handler::element_type(kCombineOp, "h", h, &ops.input); e.failure()) return e;
    if (w2.element_type() != h.element_type() || o_recv->element_type() != h.element_type()) {
      return ffi::Error::InvalidArgument(std::string(kCombineOp) + ": h, w2 and o_recv must share one dtype");
    }
    ops.output = ops.input;
    return RunMoeCombine(xla_stream, device, ops, o_recv, comm_id, signature, config);
  });
}

// FP8 per tensor: h in float8_e4m3fn or float8_e5m2 (a gradient), w2_t [E_local, H, F] in
// float8_e4m3fn, x_scale and w_scale f32 (this rank's); o_recv bf16 or fp16.
ffi::Error MoeGemmCombineFp8Impl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer h, ffi::AnyBuffer w2_t,
                                 ffi::AnyBuffer x_scale, ffi::AnyBuffer w_scale, ffi::AnyBuffer received,
                                 ffi::Result<ffi::AnyBuffer> o_recv,
                                 int64_t comm_id, int64_t signature, MoeConfig config) {
  return handler::guarded(kCombineOp, [&]() -> ffi::Error {
    CombineOperands ops{DType::kE4M3, DType::kBF16, h, w2_t};
    ops.received = &received;
    if (ffi::Error e = handler::fp8_input(kCombineOp, "h", h, &ops.input); e.failure()) return e;
    if (ffi::Error e = handler::fp8_weight(kCombineOp, "w2_t", w2_t); e.failure()) return e;
    if (ffi::Error e = handler::element_type(kCombineOp, "o_recv", *o_recv, &ops.output); e.failure()) return e;
    if (ffi::Error e = handler::scale_operand(kCombineOp, "x_scale", x_scale, &ops.x_scale); e.failure()) return e;
    if (ffi::Error e = handler::scale_operand(kCombineOp, "w_scale", w_scale, &ops.w_scale); e.failure()) return e;
    return RunMoeCombine(xla_stream, device, ops, o_recv, comm_id, signature, config);
  });
}

// moe_transfer: send [E, C, ...] (rank d's rows of expert e at d * E_local + e) -> recv [E_local,
// W * C, ...] (every source's rows of this rank's expert e, source-major), any dtype: the pushes as in
// moe_dispatch_gemm, then on XLA's stream the wait for every peer's segments and the copies of recv.
// The inbox is moe_dispatch_gemm's, under the same announcement rule.
ffi::Error MoeTransferImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer send,
                           ffi::Result<ffi::AnyBuffer> recv, int64_t comm_id, int64_t signature, int64_t push_sms) {
  constexpr const char* kTransferOp = "entwine moe_transfer";
  return handler::guarded(kTransferOp, [&]() -> ffi::Error {
    comm::DeviceComm* dc = nullptr;
    if (ffi::Error e = handler::usable_comm(kTransferOp, comm_id, device, &dc); e.failure()) return e;
    handler::ExclusiveDispatch const exclusive(*dc);
    if (ffi::Error e = exclusive.check(kTransferOp); e.failure()) return e;
    handler::HostTimer timer{dc};
    auto sd = send.dimensions(), rd = recv->dimensions();
    int64_t const world = dc->world;
    bool ok = sd.size() >= 2 && rd.size() == sd.size() && sd[0] % world == 0 && rd[0] == sd[0] / world &&
              rd[1] == world * sd[1] && recv->element_type() == send.element_type() && send.element_count() > 0;
    for (size_t i = 2; ok && i < sd.size(); ++i) ok = rd[i] == sd[i];
    if (!ok) {
      return ffi::Error::InvalidArgument(std::string(kTransferOp) +
                                         ": expected send [E, C, ...] (E a multiple of W) and recv [E/W, W*C, ...] of "
                                         "one dtype, got send " + dims_string(sd) + ", recv " + dims_string(rd) +
                                         " with W = " + std::to_string(world));
    }
    int64_t const row_bytes = int64_t(send.size_bytes()) / (sd[0] * sd[1]);
    MoePlan const plan = moe_transfer_plan(dc->world, dc->rank, int32_t(sd[0]), int32_t(sd[1]), row_bytes, push_sms);
    if (plan.error != nullptr) return ffi::Error::InvalidArgument(std::string(kTransferOp) + ": " + plan.error);
    if (ffi::Error e = check_room(kTransferOp, plan, *dc); e.failure()) return e;
    bool capturing = false;
    if (ffi::Error e = handler::is_capturing(kTransferOp, xla_stream, &capturing); e.failure()) return e;
    DeviceGuard guard;
    ENTWINE_RETURN_IF_CUDA(kTransferOp, guard.set(device));
    CallEpoch const epoch_args = handler::call_epoch(*dc, capturing, signature);
    timer.lap(comm::kPhaseChecks);
    bool const sm_push = plan.push_grid > 0 && dc->world > 1;
    if (!sm_push) ENTWINE_RETURN_IF_CUDA(kTransferOp, cudaEventRecord(dc->start, xla_stream));
    timer.lap(comm::kPhaseFork);
    if (sm_push) {
      // Every row moves: the rows sent are not known here.
      ffi::Error const e = enqueue_sm_push(*dc, plan, send.untyped_data(), nullptr, epoch_args, xla_stream);
      if (e.failure()) return e;
    } else if (ffi::Error e = enqueue_copy_engine_pushes(*dc, plan, send.untyped_data(), epoch_args); e.failure()) {
      return e;
    }
    ENTWINE_RETURN_IF_CUDA(kTransferOp, moe::launch_wait_segments(wait_args(*dc, plan, epoch_args), xla_stream));
    if (ffi::Error e = copy_pool(*dc, plan, send.untyped_data(), nullptr, *recv, xla_stream); e.failure()) return e;
    timer.lap(comm::kPhaseLaunch);
    for (int d = 1; !sm_push && d < dc->world; ++d) {
      ENTWINE_RETURN_IF_CUDA(kTransferOp, cudaStreamWaitEvent(xla_stream, dc->side_done[d - 1], 0));
    }
    timer.lap(comm::kPhaseJoin);
    comm::CallEnd end = handler::call_end(*dc, epoch_args);
    end.add_output(recv->untyped_data(), int64_t(recv->size_bytes()));
    ENTWINE_RETURN_IF_CUDA(kTransferOp, comm::launch_end_call(end, xla_stream));
    timer.lap(comm::kPhaseEnd);
    return ffi::Error::Success();
  });
}

// moe_weight_grad: dw [E_local, M, N] = a^T dy per local expert over the rows received, a_t [E_local,
// M, W * C] (the pool or h transposed), dy [E_local, W * C, N] and received int32 [E_local, W], one
// 16-bit dtype (moe/wgrad_schedule.cuh). A local GEMM on XLA's stream: no epoch, no flag, no wait;
// the communicator (the op's, on this device) only proves that setup prepared its kernels here.
ffi::Error MoeWeightGradImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer a_t, ffi::AnyBuffer dy,
                             ffi::AnyBuffer received, ffi::Result<ffi::AnyBuffer> dw, int64_t comm_id,
                             MoeConfig config) {
  constexpr const char* kWgradOp = "entwine moe_weight_grad";
  return handler::guarded(kWgradOp, [&]() -> ffi::Error {
    if (comm::find(comm_id, device) == nullptr) {
      return ffi::Error::InvalidArgument(std::string(kWgradOp) + ": no communicator " + std::to_string(comm_id) +
                                         " on device " + std::to_string(device) +
                                         " (entwine_jax.comm.acquire_comm makes it, at trace time)");
    }
    DType input = DType::kBF16;
    if (ffi::Error e = handler::element_type(kWgradOp, "a_t", a_t, &input); e.failure()) return e;
    if (dy.element_type() != a_t.element_type() || dw->element_type() != a_t.element_type()) {
      return ffi::Error::InvalidArgument(std::string(kWgradOp) + ": a_t, dy and dw must share one dtype");
    }
    auto ad = a_t.dimensions(), yd = dy.dimensions(), wd = dw->dimensions(), rd = received.dimensions();
    bool ok = ad.size() == 3 && yd.size() == 3 && wd.size() == 3 && rd.size() == 2 && rd[1] > 0;
    ok = ok && yd[0] == ad[0] && yd[1] == ad[2] && wd[0] == ad[0] && wd[1] == ad[1] && wd[2] == yd[2] &&
         rd[0] == ad[0] && ad[2] % rd[1] == 0;
    if (!ok) {
      return ffi::Error::InvalidArgument(std::string(kWgradOp) +
                                         ": expected a_t [E_local, M, W*C], dy [E_local, W*C, N], received [E_local, "
                                         "W] and dw [E_local, M, N]; got a_t " + dims_string(ad) + ", dy " +
                                         dims_string(yd) + ", received " + dims_string(rd) + ", dw " +
                                         dims_string(wd));
    }
    const int32_t* counts = nullptr;
    if (ffi::Error e = row_counts(kWgradOp, "received", "[E_local, W]", received, {rd[0], rd[1]}, &counts);
        e.failure()) {
      return e;
    }
    MoeWgradProblem const problem{int32_t(rd[1]), int32_t(ad[0]), int32_t(ad[2] / rd[1]), int32_t(ad[1]),
                                  int32_t(yd[2]), input};
    MoeWgradPlan const plan = moe_wgrad_plan(problem, config);
    if (plan.error != nullptr) {
      return ffi::Error::InvalidArgument(std::string(kWgradOp) + ": " + plan.error + " (M=" +
                                         std::to_string(problem.m) + ", N=" + std::to_string(problem.n) + ", C=" +
                                         std::to_string(problem.capacity) + ", config " +
                                         ENTWINE_CONFIG_STRING(config, ENTWINE_MOE_CONFIG_FIELDS) + ")");
    }
    DeviceGuard guard;
    ENTWINE_RETURN_IF_CUDA(kWgradOp, guard.set(device));
    MoeWgradArgs const args{a_t.untyped_data(), dy.untyped_data(), dw->untyped_data(), counts};
    ENTWINE_RETURN_IF_CUDA(kWgradOp, moe::wgrad::launch_gemm(input, input, plan, args, xla_stream));
    ENTWINE_RETURN_IF_CUDA(kWgradOp, cudaGetLastError());
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace entwine

// `config` arrives as one dictionary attribute, decoded by name into MoeConfig.
ENTWINE_REGISTER_CONFIG_DECODING(entwine::MoeConfig, ENTWINE_MOE_CONFIG_FIELDS);

// Command-buffer compatible for ag_gemm's reason: no host value that changes per call reaches a
// kernel or a copy.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeDispatchGemm, entwine::MoeDispatchGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // xla_stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Arg<ffi::AnyBuffer>()                     // x_send [E, C, K]
                                  .Arg<ffi::AnyBuffer>()                     // w [E_local, K, N]
                                  .Arg<ffi::AnyBuffer>()                     // received: int32 [E_local, W]
                                  .Arg<ffi::AnyBuffer>()                     // sent: int32 [E]
                                  .Ret<ffi::AnyBuffer>()                     // y [E_local, W * C, N]
                                  .Ret<ffi::AnyBuffer>()                     // pool [E_local, W * C, K] (or empty)
                                  .Attr<int64_t>("comm_id")                  // comm_id
                                  .Attr<int64_t>("signature")                // what the call is (stamps)
                                  .Attr<entwine::MoeConfig>("config"),       // config
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeDispatchGemmFp8, entwine::MoeDispatchGemmFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // xla_stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Arg<ffi::AnyBuffer>()                     // x_send [E, C, K]: e4m3 or e5m2
                                  .Arg<ffi::AnyBuffer>()                     // w_t [E_local, N, K]: e4m3
                                  .Arg<ffi::AnyBuffer>()                     // x_scales: f32 [W]
                                  .Arg<ffi::AnyBuffer>()                     // w_scale: f32 [] or [1]
                                  .Arg<ffi::AnyBuffer>()                     // received: int32 [E_local, W]
                                  .Arg<ffi::AnyBuffer>()                     // sent: int32 [E]
                                  .Ret<ffi::AnyBuffer>()                     // y [E_local, W * C, N]: bf16 or f16
                                  .Ret<ffi::AnyBuffer>()                     // pool [E_local, W * C, K] (or empty)
                                  .Attr<int64_t>("comm_id")                  // comm_id
                                  .Attr<int64_t>("signature")                // what the call is (stamps)
                                  .Attr<entwine::MoeConfig>("config"),       // config
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGemmCombine, entwine::MoeGemmCombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // xla_stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Arg<ffi::AnyBuffer>()                     // h [E_local, W * C, F]
                                  .Arg<ffi::AnyBuffer>()                     // w2 [E_local, F, H]
                                  .Arg<ffi::AnyBuffer>()                     // received: int32 [E_local, W]
                                  .Ret<ffi::AnyBuffer>()                     // o_recv [E, C, H]
                                  .Attr<int64_t>("comm_id")                  // comm_id
                                  .Attr<int64_t>("signature")                // what the call is (stamps)
                                  .Attr<entwine::MoeConfig>("config"),       // config
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeGemmCombineFp8, entwine::MoeGemmCombineFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // xla_stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Arg<ffi::AnyBuffer>()                     // h [E_local, W * C, F]: e4m3 or e5m2
                                  .Arg<ffi::AnyBuffer>()                     // w2_t [E_local, H, F]: e4m3
                                  .Arg<ffi::AnyBuffer>()                     // x_scale: f32 [] or [1] (h's)
                                  .Arg<ffi::AnyBuffer>()                     // w_scale: f32 [] or [1]
                                  .Arg<ffi::AnyBuffer>()                     // received: int32 [E_local, W]
                                  .Ret<ffi::AnyBuffer>()                     // o_recv [E, C, H]: bf16 or f16
                                  .Attr<int64_t>("comm_id")                  // comm_id
                                  .Attr<int64_t>("signature")                // what the call is (stamps)
                                  .Attr<entwine::MoeConfig>("config"),       // config
                              {ffi::Traits::kCmdBufferCompatible});

// Command-buffer compatible: the counts are read on the device, nothing per call on the host.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeWeightGrad, entwine::MoeWeightGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // xla_stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Arg<ffi::AnyBuffer>()                     // a_t [E_local, M, W * C]
                                  .Arg<ffi::AnyBuffer>()                     // dy [E_local, W * C, N]
                                  .Arg<ffi::AnyBuffer>()                     // received: int32 [E_local, W]
                                  .Ret<ffi::AnyBuffer>()                     // dw [E_local, M, N]
                                  .Attr<int64_t>("comm_id")                  // comm_id
                                  .Attr<entwine::MoeConfig>("config"),       // config
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeTransfer, entwine::MoeTransferImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // xla_stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Arg<ffi::AnyBuffer>()                     // send [E, C, ...]
                                  .Ret<ffi::AnyBuffer>()                     // recv [E_local, W * C, ...]
                                  .Attr<int64_t>("comm_id")                  // comm_id
                                  .Attr<int64_t>("signature")                // what the call is (stamps)
                                  .Attr<int64_t>("push_sms"),                // 0: copy engines; else the SM push's CTAs
                              {ffi::Traits::kCmdBufferCompatible});
