// XLA FFI handlers `entwine_gemm_rs` (bf16/fp16) and `entwine_gemm_rs_fp8` (FP8 operands with their
// scales, per tensor or per block): each checks its operands' types, then one body validates and plans the call and launches
// the consumer (reduction) and the producer (GEMM) beside it, both on XLA's stream;
// and gemm_rs::kHooks. No kernel syntax; no allocation, free, synchronisation, IPC or peer-access call (any of them can
// deadlock against a consumer spinning on another device of this process).
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "comm/comm.h"
#include "comm/handler_util.h"
#include "gemm_rs/gemm_rs.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace entwine {

namespace gemm_rs {

namespace {

// The heap region of the partial output (RegionSpec::id): double-buffered (the double-buffer
// argument, RunGemmRs).
int partial_region = -1;
const comm::RegionSpec kRegions[] = {{"gemm_rs.partial", true, &partial_region}};

}  // namespace

// The kernels are loaded with the communicator; the producer's split tail needs one workspace per
// stream that runs producers: XLA's stream of the entry's device, whose calls run one at a time.
// One side stream: the consumer's, forked only under ENTWINE_PROFILE.
const comm::OpHooks kHooks{
    "gemm_rs",
    prepare_kernels,
    kGemmRsWaitSiteBase,
    [](const DeviceError& e, const std::string& waited) {
      return "entwine gemm_rs: " + waited + "for tile " + std::to_string(e.tile) + " from rank " +
             std::to_string(e.source);
    },
    kSplitWorkspaceBytes,
    kRegions,
    1,
    [](int) { return 1; },
};

}  // namespace gemm_rs

namespace {

constexpr const char* kOp = "entwine gemm_rs";
using handler::DeviceGuard;
using handler::dims_string;

// One call's operands once its target's type checks passed: x [m, k] and w [k, n] (FP8: w_t [n, k]).
struct Operands {
  DType input, output;  // output: y's and the partials' type
  const void* x;
  const void* w;
  const float* x_scale = nullptr;  // FP8 only (ProducerArgs)
  const float* w_scale = nullptr;
  Scaling scaling = Scaling::kTensor;
  int64_t m, n, k;
};

// The 2-D shapes of x, w (or w_t) and y, and their common K; fills m, n, k.
ffi::Error check_dims(ffi::AnyBuffer const& x, ffi::AnyBuffer const& w, ffi::AnyBuffer const& y, bool w_transposed,
                      Operands* ops) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || wd[w_transposed ? 1 : 0] != xd[1]) {
    return ffi::Error::InvalidArgument(std::string("entwine gemm_rs: expected x [M, K], ") +
                                       (w_transposed ? "w_t [N, K]" : "w [K, N]") + ", y 2-D, got x " +
                                       dims_string(xd) + ", w " + dims_string(wd) + ", y " + dims_string(yd));
  }
  ops->m = xd[0];
  ops->n = wd[w_transposed ? 0 : 1];
  ops->k = xd[1];
  return ffi::Error::Success();
}

// An FP8 call's scales (handler::fp8_scales) for the call's x [M, K] and w_t [N, K] (check_dims
// first): per tensor, or per block with x_scale [ceil(K/128), M].
ffi::Error fp8_scales(ffi::AnyBuffer const& x_scale, ffi::AnyBuffer const& w_scale, Operands* ops) {
  bool block = false;
  ffi::Error e = handler::fp8_scales(kOp, x_scale, w_scale, ops->m, ops->k, ops->n, ops->k, kScaleBlock,
                                     "[ceil(K/128), M]", &block, &ops->x_scale, &ops->w_scale);
  ops->scaling = block ? Scaling::kBlock : Scaling::kTensor;
  return e;
}

// The plan's rules and what the call needs of the communicator: checked when a call site's plan is
// made (a memoised plan passed them). Python padded the operands with the same function: on the
// padded shape it must plan the problem unchanged (docs/design.md, "gemm_rs"). The plan alone
// checks that the scattered dimension divides.
ffi::Error check_plan(GemmRsPlan const& plan, GemmRsProblem const& problem, GemmRsConfig const& cfg,
                      comm::DeviceComm const& dc) {
  // Built only for a message: the handler's host time is on every call's path.
  auto const call = [&] {
    return " (M=" + std::to_string(problem.m) + ", N=" + std::to_string(problem.n) + ", K=" +
           std::to_string(problem.k) + ", W=" + std::to_string(problem.world) + ", config " +
           ENTWINE_CONFIG_STRING(cfg, ENTWINE_GEMM_RS_CONFIG_FIELDS) + ")";
  };
  if (plan.error != nullptr) return ffi::Error::InvalidArgument(std::string("entwine gemm_rs: ") + plan.error + call());
  ProblemShape const& shape = plan.shape;
  if (shape.m != problem.m || shape.n != problem.n || shape.k != problem.k) {
    return ffi::Error::InvalidArgument("entwine gemm_rs: operands not padded to the plan's [M, N, K] = [" +
                                       std::to_string(shape.m) + ", " + std::to_string(shape.n) + ", " +
                                       std::to_string(shape.k) + "]" + call());
  }
  // Python grows the heap at trace time, before any call of a new shape runs; this only catches
  // a call compiled against another process's (or a shut down) communicator.
  size_t const has_bytes = dc.capacity.bytes[gemm_rs::partial_region];
  if (size_t(plan.slot_bytes) > has_bytes || plan.tiles_per_partition > dc.capacity.flags_per_source) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "entwine gemm_rs: call needs " + std::to_string(plan.slot_bytes) + " bytes and " +
                          std::to_string(plan.tiles_per_partition) + " tiles per slot, communicator has " +
                          std::to_string(has_bytes) + " bytes and " +
                          std::to_string(dc.capacity.flags_per_source) + " tiles");
  }
  return ffi::Error::Success();
}

// The config the kernels run (docs/design.md, "Forward progress"). producer_sms = 0 takes the SMs
// that the consumer and the reserve (comm::sm_reserve) leave. Where processes share this GPU, the
// consumers of all but one of them, all spinning at once, must leave an SM for the last one's
// GEMM, which none of them can start: the consumer grid is clamped to that share. The GEMM itself
// never waits, so any producer_sms is safe.
GemmRsConfig run_config(GemmRsConfig cfg, comm::DeviceComm const& dc) {
  int64_t const free = int64_t(dc.sm_count) - comm::sm_reserve();
  if (dc.gpu_sharers > 1) {
    int64_t const share = (free - 1) / (dc.gpu_sharers - 1);
    if (cfg.consumer_grid > share) cfg.consumer_grid = share > 1 ? share : 1;
  }
  if (cfg.producer_sms == 0) {
    int64_t const left = free - cfg.consumer_grid;
    cfg.producer_sms = left > 1 ? left : 1;
  }
  return cfg;
}

// Double-buffer argument (docs/design.md, "The double-buffer argument"). Call e of rank A writes
// A's partial slot V[e % 2] (e and its parity are read on the device: CallEpoch); the consumers of
// every rank B read A's V[e % 2] during their call e.
// A's producer of call e+2 writes V[e % 2] again, and cannot start before every B finished reading it:
//   A's producer(e+2) runs on A's XLA stream after call e+1 completed there, A's consumer(e+1)
//   included (the consumer of a call completes after its GEMM, and next on the stream);
//   A's consumer(e+1) finished, so it saw a flag of call e+1 from every B (every tile of A's
//   partition has a contribution from every rank, and the consumer only exits early on a failed
//   wait (deadline, mismatch or a peer's abort), which poisons the communicator: later calls are
//   rejected below);
//   B published in call e+1, so B's producer(e+1) had started, which was after B's call e
//   completed, B's consumer(e) included: B's reads of V[e % 2] on every rank had completed.
// Call e+1 (the other slot) may overlap a slow peer's call e freely. The same chain orders the two
// writers of one flag word of parity e % 2 (calls e and e+2), which is why the flags are
// double-buffered too (comm.h). Requires every rank to make the same sequence of calls on the
// communicator (same epochs), which SPMD programs do.
ffi::Error RunGemmRs(cudaStream_t xla_stream, int32_t device, Operands const& ops, ffi::Result<ffi::AnyBuffer> y,
                     int64_t comm_id, int64_t scatter_dimension, int64_t signature, GemmRsConfig const& cfg) {
  // --- Validation: everything below is cheap host work on the call's metadata. --------------------
  comm::DeviceComm* dc = nullptr;
  if (ffi::Error e = handler::usable_comm(kOp, comm_id, device, &dc); e.failure()) return e;
  handler::ExclusiveDispatch const exclusive(*dc);
  if (ffi::Error e = exclusive.check(kOp); e.failure()) return e;
  handler::HostTimer timer{dc};
  auto yd = y->dimensions();
  if (scatter_dimension != 0 && scatter_dimension != 1) {
    return ffi::Error::InvalidArgument("entwine gemm_rs: scatter_dimension must be 0 (rows) or 1 (columns), got " +
                                       std::to_string(scatter_dimension));
  }

  GemmRsProblem problem;
  problem.m = ops.m;
  problem.n = ops.n;
  problem.k = ops.k;
  problem.world = dc->world;
  problem.rank = dc->rank;
  problem.scatter_cols = scatter_dimension == 1;
  problem.input = ops.input;
  problem.scaling = ops.scaling;

  bool capturing = false;
  if (ffi::Error e = handler::is_capturing(kOp, xla_stream, &capturing); e.failure()) return e;

  // --- Execute: the GEMM on XLA's stream, the consumer forked beside it and joined back. -----------
  // Every argument below is the same for every call of this shape: the epoch and the parity are
  // read on the device, so a CUDA graph may replay the launches (docs/design.md, "Graph safety").
  DeviceGuard guard;
  ENTWINE_RETURN_IF_CUDA(kOp, guard.set(device));
  char* own = static_cast<char*>(dc->heap);
  size_t const partial_offset = dc->layout.region_offset(gemm_rs::partial_region);
  CallEpoch const epoch_args = handler::call_epoch(*dc, capturing, signature);

  ConsumerArgs consumer_args{};
  for (int s = 0; s < dc->world; ++s) {
    consumer_args.partial[s] = static_cast<char*>(dc->peer_heap[s]) + partial_offset;
  }
  consumer_args.flags = reinterpret_cast<const uint64_t*>(own + dc->layout.flags_offset());
  consumer_args.out = y->untyped_data();
  consumer_args.error = dc->error_local;
  consumer_args.error_mirror = dc->error_device;
  consumer_args.call = epoch_args;
  consumer_args.timeout_ns = comm::timeout_ms() * 1000000ull;

  ProducerArgs producer_args{};
  producer_args.x = ops.x;
  producer_args.w = ops.w;
  producer_args.x_scale = ops.x_scale;
  producer_args.w_scale = ops.w_scale;
  producer_args.partial = own + partial_offset;
  for (int q = 0; q < dc->world; ++q) {
    // Push: each tile's flag goes into the memory of the rank that owns its partition.
    producer_args.flags[q] =
        reinterpret_cast<uint64_t*>(static_cast<char*>(dc->peer_heap[q]) + dc->layout.flags_offset());
  }
  producer_args.call = epoch_args;
  producer_args.split_workspace = dc->workspace(&gemm_rs::kHooks);  // used only by this entry's XLA stream

  // The plan and the GEMM's parameters (TMA descriptors), derived once per call site and buffers:
  // the key holds every value they are derived from (the problem, the config, the GEMM's arguments,
  // the FP8 scales' addresses among them: kernel parameters).
  struct Derived {
    GemmRsPlan plan;
    PreparedGemm gemm;
  };
  static thread_local handler::CallMemo<64, Derived> memo;
  handler::MemoKey<64> key;
  for (int64_t v : {int64_t(ops.input), int64_t(ops.output), int64_t(ops.scaling), problem.m, problem.n, problem.k, int64_t(problem.world), int64_t(problem.rank),
                    int64_t(problem.scatter_cols), int64_t(capturing), epoch_args.slot_stride,
                    epoch_args.flags_stride, int64_t(producer_args.interleave), int64_t(producer_args.publish)}) {
    key.add(uint64_t(v));
  }
#define ENTWINE_MEMO_FIELD(type, name, value) key.add(uint64_t(cfg.name));
  ENTWINE_GEMM_RS_CONFIG_FIELDS(ENTWINE_MEMO_FIELD)
#undef ENTWINE_MEMO_FIELD
  for (const void* p : {producer_args.x, producer_args.w, static_cast<const void*>(producer_args.partial),
                        static_cast<const void*>(epoch_args.epoch),
                        static_cast<const void*>(producer_args.split_workspace),
                        static_cast<const void*>(producer_args.x_scale),
                        static_cast<const void*>(producer_args.w_scale)}) {
    key.add(p);
  }
  for (uint64_t* f : producer_args.flags) key.add(f);
  handler::add_call(key, epoch_args);
  // The call's end folded into its kernels (no end kernel's launch): the consumer's CTAs and the
  // producer's store warps arrive at it, and the last advances the epoch; the consumer's last CTA
  // poisons y after a failure (ConsumerArgs). `end` holds no output: the producer's copy is in its
  // prepared parameters, derived from the epoch's words (in the key); the consumer adds y.
  auto const folded_end = [&](GemmRsPlan const& plan) {
    comm::CallEnd end = handler::call_end(*dc, epoch_args);
    end.done = dc->epoch + 1;
    end.expected = uint64_t(plan.config.consumer_grid) + uint64_t(plan.schedule.grid);
    return end;
  };
  Derived const* derived = memo.find(key);
  if (derived == nullptr) {
    GemmRsConfig const run = run_config(cfg, *dc);
    Derived fresh{gemm_rs_plan(problem, run), {}};
    if (ffi::Error e = check_plan(fresh.plan, problem, run, *dc); e.failure()) return e;
    producer_args.end = folded_end(fresh.plan);
    ENTWINE_RETURN_IF_CUDA(kOp, gemm_rs::prepare_gemm(ops.input, ops.output, fresh.plan, producer_args, &fresh.gemm));
    Derived* entry = memo.insert(key);
    *entry = fresh;
    derived = entry;
  }
  // The output y is not in the key: the consumer's arguments are built on every call; its shape is.
  if (yd[0] != derived->plan.shape.part_rows() || yd[1] != derived->plan.shape.part_cols()) {
    return ffi::Error::InvalidArgument("entwine gemm_rs: y must be this rank's partition [" +
                                       std::to_string(derived->plan.shape.part_rows()) + ", " +
                                       std::to_string(derived->plan.shape.part_cols()) + "], got " + dims_string(yd));
  }

  consumer_args.end = folded_end(derived->plan);
  consumer_args.end.add_output(y->untyped_data(), int64_t(y->size_bytes()));
  consumer_args.consumers_done = dc->epoch + 2;
  timer.lap(comm::kPhaseChecks);
  // The GEMM, then the consumer as its programmatic dependent, both on XLA's stream: the consumer's
  // CTAs start once every GEMM CTA is resident (so every tile it waits for is being computed on an
  // SM it does not hold), and its grid completes only after the GEMM's, so XLA's next work sees y.
  // Two launches, no fork or join: the handler's host time is on every call's path.
  // ENTWINE_PROFILE=1 forks the consumer onto its own (high-priority) stream instead and joins it
  // back, so that events time the GEMM window apart from the consumer's tail (comm::last_call_ms).
  bool const forked = comm::profiling();
  cudaStream_t consumer_stream = xla_stream;
  if (forked) {
    ENTWINE_RETURN_IF_CUDA(kOp, cudaEventRecord(dc->start, xla_stream));
    ENTWINE_RETURN_IF_CUDA(kOp, cudaStreamWaitEvent(dc->side[0], dc->start, 0));
    consumer_stream = dc->side[0];
  }
  timer.lap(comm::kPhaseFork);
  if (forked) ENTWINE_RETURN_IF_CUDA(kOp, launch_consumer(ops.output, derived->plan, consumer_args, consumer_stream, false));
  ENTWINE_RETURN_IF_CUDA(kOp, derived->gemm.enqueue(xla_stream));
  if (!forked) ENTWINE_RETURN_IF_CUDA(kOp, launch_consumer(ops.output, derived->plan, consumer_args, xla_stream, true));
  timer.lap(comm::kPhaseLaunch);
  if (forked) {
    ENTWINE_RETURN_IF_CUDA(kOp, cudaEventRecord(dc->producer_done, xla_stream));
    ENTWINE_RETURN_IF_CUDA(kOp, cudaEventRecord(dc->side_done[0], dc->side[0]));
    ENTWINE_RETURN_IF_CUDA(kOp, cudaStreamWaitEvent(xla_stream, dc->side_done[0], 0));
  }
  timer.lap(comm::kPhaseJoin);
  timer.lap(comm::kPhaseEnd);  // folded into the kernels: no launch
  return ffi::Error::Success();
}

// bf16 or fp16: x, w and y of one type.
ffi::Error GemmRsImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Result<ffi::AnyBuffer> y, int64_t comm_id, int64_t scatter_dimension, int64_t signature,
                      GemmRsConfig config) {
  return handler::guarded(kOp, [&] {
    Operands ops{};
    if (ffi::Error e = handler::element_type(kOp, "x", x, &ops.input); e.failure()) return e;
    if (w.element_type() != x.element_type() || y->element_type() != x.element_type()) {
      return ffi::Error::InvalidArgument("entwine gemm_rs: x, w and y must share one dtype, got codes " +
                                         std::to_string(int(x.element_type())) + ", " +
                                         std::to_string(int(w.element_type())) + ", " +
                                         std::to_string(int(y->element_type())));
    }
    if (ffi::Error e = check_dims(x, w, *y, false, &ops); e.failure()) return e;
    ops.output = ops.input;
    ops.x = x.untyped_data();
    ops.w = w.untyped_data();
    return RunGemmRs(xla_stream, device, ops, y, comm_id, scatter_dimension, signature, config);
  });
}

// FP8: x [M, K] in float8_e4m3fn or float8_e5m2 and w_t [N, K] in float8_e4m3fn; y bf16 or fp16
// (x's type, y's and the scales' shapes pick the kernel, y's the partials' type). Per tensor, one
// f32 scale each: y = x_scale * w_scale * (x @ w_t^T). Per block (fp8_scales): y = sum over K blocks
// kb of (x[:, kb] @ w_t[:, kb]^T) * x_scale[kb, m] * w_scale[nb, kb]. Reduce-scattered.
ffi::Error GemmRsFp8Impl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w_t,
                         ffi::AnyBuffer x_scale, ffi::AnyBuffer w_scale, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm_id, int64_t scatter_dimension, int64_t signature, GemmRsConfig config) {
  return handler::guarded(kOp, [&] {
    Operands ops{};
    if (ffi::Error e = handler::fp8_input(kOp, "x", x, &ops.input); e.failure()) return e;
    if (ffi::Error e = handler::fp8_weight(kOp, "w_t", w_t); e.failure()) return e;
    if (ffi::Error e = handler::element_type(kOp, "y", *y, &ops.output); e.failure()) return e;
    if (ffi::Error e = check_dims(x, w_t, *y, true, &ops); e.failure()) return e;
    if (ffi::Error e = fp8_scales(x_scale, w_scale, &ops); e.failure()) return e;
    ops.x = x.untyped_data();
    ops.w = w_t.untyped_data();
    return RunGemmRs(xla_stream, device, ops, y, comm_id, scatter_dimension, signature, config);
  });
}

}  // namespace
}  // namespace entwine

// `config` arrives as one dictionary attribute, decoded by name into GemmRsConfig.
ENTWINE_REGISTER_CONFIG_DECODING(entwine::GemmRsConfig, ENTWINE_GEMM_RS_CONFIG_FIELDS);

// Command-buffer compatible: no host value that changes per call reaches a kernel, so XLA may
// record the call into a CUDA graph and replay it (docs/design.md, "Graph safety").
XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmRs, entwine::GemmRsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // xla_stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Arg<ffi::AnyBuffer>()                     // x
                                  .Arg<ffi::AnyBuffer>()                     // w
                                  .Ret<ffi::AnyBuffer>()                     // y
                                  .Attr<int64_t>("comm_id")                  // comm_id
                                  .Attr<int64_t>("scatter_dimension")        // scatter_dimension
                                  .Attr<int64_t>("signature")                // what the call is (stamps)
                                  .Attr<entwine::GemmRsConfig>("config"),    // config
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmRsFp8, entwine::GemmRsFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // xla_stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Arg<ffi::AnyBuffer>()                     // x: float8_e4m3fn or e5m2 [M, K]
                                  .Arg<ffi::AnyBuffer>()                     // w_t: float8_e4m3fn [N, K]
                                  .Arg<ffi::AnyBuffer>()                     // x_scale: f32 [] or [K/128, M]
                                  .Arg<ffi::AnyBuffer>()                     // w_scale: f32 [] or [N/128, K/128]
                                  .Ret<ffi::AnyBuffer>()                     // y: bf16 or f16
                                  .Attr<int64_t>("comm_id")                  // comm_id
                                  .Attr<int64_t>("scatter_dimension")        // scatter_dimension
                                  .Attr<int64_t>("signature")                // what the call is (stamps)
                                  .Attr<entwine::GemmRsConfig>("config"),    // config
                              {ffi::Traits::kCmdBufferCompatible});
