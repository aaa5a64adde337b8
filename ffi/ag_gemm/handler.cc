// XLA FFI handlers `entwine_ag_gemm` (bf16/fp16) and `entwine_ag_gemm_fp8` (FP8 shards with their
// scales, per tensor or per block): each checks its operands' types, then one body validates and plans one rank's call, runs
// the GEMM (consuming the gathered operand as it arrives) on XLA's stream beside the pushes of the
// shard (and an FP8 shard's scale) to every peer, one flag per chunk: one SM copy kernel on XLA's
// stream ahead of the GEMM, or copy engines on transfer streams forked from it and joined back; and ag_gemm::kHooks. No kernel syntax; no allocation, free, synchronisation, IPC or
// peer-access call (see gemm_rs).
#include <cstdint>
#include <optional>
#include <string>

#include <cuda_runtime.h>

#include "ag_gemm/ag_gemm.h"
#include "comm/comm.h"
#include "comm/handler_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace entwine {

namespace ag_gemm {

namespace {

// The heap region of the gathered shards (RegionSpec::id): single (the inbox argument, RunAgGemm).
int inbox_region = -1;
const comm::RegionSpec kRegions[] = {{"ag_gemm.inbox", false, &inbox_region}};

}  // namespace

// The GEMM and the transfer kernels are loaded with the communicator; the workspace holds the SM
// push's arrival counters (one transfer stream runs the push kernel: one set per entry). Side
// stream d - 1 is transfer stream d (1 <= d < world), which pushes this rank's shard to rank
// (rank + d) % world, so every link carries a transfer from the start of a call.
const comm::OpHooks kHooks{
    "ag_gemm",
    prepare_kernels,
    kAgGemmWaitSiteBase,
    [](const DeviceError& e, const std::string& waited) -> std::string {
      if (e.site == kWaitInboxReady) {
        return "entwine ag_gemm: " + waited + "for rank " + std::to_string(e.source) +
               " to start the call (before pushing its shard into rank " + std::to_string(e.source) + "'s inbox)";
      }
      return "entwine ag_gemm: " + waited + "for chunk " + std::to_string(e.tile) + " of the shard of rank " +
             std::to_string(e.source);
    },
    kPushArrivalsBytes,
    kRegions,
    1,
    [](int world) { return world - 1; },
};

}  // namespace ag_gemm

namespace {

constexpr const char* kOp = "entwine ag_gemm";
using handler::DeviceGuard;
using handler::dims_string;

// One call's operands once its target's type checks passed: the shard x [rows, cols] and w
// [W * cols or cols, N] (FP8: w_t [N, W * cols or cols]).
struct Operands {
  DType input, output;
  ffi::AnyBuffer x, w;
  const float* x_scale = nullptr;  // FP8 only
  const float* w_scale = nullptr;
  bool shared_scale = true;        // FP8: no scale travels (AgProblem)
  Scaling scaling = Scaling::kTensor;
  ffi::AnyBuffer* gathered_scales = nullptr;  // FP8: f32 [W] (block-scaled: [W, ceil(cols/128), rows]) or empty
  // A group of weights (AgGemmArgs): the further weights (the remaining arguments, typed as w) and
  // their outputs (the remaining results, typed as y), `more` of each.
  int more = 0;
  std::optional<ffi::AnyBuffer> w_more[kMaxWeights - 1], y_more[kMaxWeights - 1];
};

// An FP8 call's scales (handler::fp8_scales) for the shard x [rows, cols] and w_t [N, K]: per
// tensor, or per block with x_scale [ceil(cols/128), rows].
ffi::Error fp8_scales(ffi::AnyBuffer const& x_scale, ffi::AnyBuffer const& w_scale, Operands* ops) {
  auto const xd = ops->x.dimensions(), wd = ops->w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": expected x [rows, cols] and w_t [N, K], got x " +
                                       dims_string(xd) + ", w_t " + dims_string(wd));
  }
  bool block = false;
  ffi::Error e = handler::fp8_scales(kOp, x_scale, w_scale, xd[0], xd[1], wd[0], wd[1], kScaleBlock,
                                     "[ceil(cols/128), rows]", &block, &ops->x_scale, &ops->w_scale);
  ops->scaling = block ? Scaling::kBlock : Scaling::kTensor;
  return e;
}

// A group's further weights and outputs: as many of each, at most kMaxWeights in all (the kernel's
// parameters hold each weight's descriptors), each of its first's type.
ffi::Error group_operands(ffi::RemainingArgs const& w_more, ffi::RemainingRets const& y_more,
                          ffi::AnyBuffer const& y, Operands* ops) {
  if (w_more.size() != y_more.size() || w_more.size() > size_t(kMaxWeights - 1)) {
    return ffi::Error::InvalidArgument("entwine ag_gemm: a group takes one output per weight and at most " +
                                       std::to_string(kMaxWeights) + " weights, got " +
                                       std::to_string(1 + w_more.size()) + " weights and " +
                                       std::to_string(1 + y_more.size()) + " outputs");
  }
  ops->more = int(w_more.size());
  for (int g = 0; g < ops->more; ++g) {
    ffi::ErrorOr<ffi::AnyBuffer> w = w_more.get<ffi::AnyBuffer>(g);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = y_more.get<ffi::AnyBuffer>(g);
    if (w.has_error()) return w.error();
    if (out.has_error()) return out.error();
    if (w->element_type() != ops->w.element_type() || (*out)->element_type() != y.element_type()) {
      return ffi::Error::InvalidArgument("entwine ag_gemm: weight " + std::to_string(g + 1) +
                                         " of the group or its output differs in dtype from the first's");
    }
    ops->w_more[g] = *w;
    ops->y_more[g] = **out;
  }
  return ffi::Error::Success();
}

// The plan's rules, and what the call needs of the GPU and of the communicator: checked when a call
// site's plan is made (a memoised plan passed them).
ffi::Error check_plan(AgPlan const& plan, AgProblem const& problem, AgGemmConfig const& config,
                      comm::DeviceComm const& dc) {
  // Built only for a message: the handler's host time is on every call's path.
  auto const call = [&] {
    return " (rows=" + std::to_string(problem.rows) + ", cols=" + std::to_string(problem.cols) + ", N=" +
           std::to_string(problem.n) + ", W=" + std::to_string(problem.world) + ", config " +
           ENTWINE_CONFIG_STRING(config, ENTWINE_AG_GEMM_CONFIG_FIELDS) + ")";
  };
  if (plan.error != nullptr) return ffi::Error::InvalidArgument(std::string(kOp) + ": " + plan.error + call());
  // Python padded the operands with the same plan: planning the padded shape must change nothing.
  if (plan.rows_pad != problem.rows || plan.cols_pad != problem.cols || plan.n_pad != problem.n) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": operands not padded as the plan pads them" + call());
  }
  if (plan.sms_needed > dc.sm_count) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": the GEMM's " + std::to_string(plan.grid) +
                                       " CTAs and the push's " + std::to_string(plan.push_grid) +
                                       " (or one SM for the chunk releases) need " + std::to_string(plan.sms_needed) +
                                       " SMs, this GPU has " + std::to_string(dc.sm_count) + call());
  }
  size_t const has_bytes = dc.capacity.bytes[ag_gemm::inbox_region];
  if (size_t(plan.inbox_bytes) > has_bytes || plan.chunks > dc.capacity.flags_per_source) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "entwine ag_gemm: call needs an inbox of " + std::to_string(plan.inbox_bytes) + " bytes and " +
                          std::to_string(plan.chunks) + " chunks per source, communicator has " +
                          std::to_string(has_bytes) + " bytes and " +
                          std::to_string(dc.capacity.flags_per_source) + " flags per source");
  }
  return ffi::Error::Success();
}

// The config the kernels run: the GEMM's grid leaves the SMs the pushes need (handler::waiting_gemm_sms).
AgGemmConfig run_config(AgGemmConfig cfg, comm::DeviceComm const& dc) {
  cfg.gemm_sms = handler::waiting_gemm_sms(cfg.gemm_sms, cfg.push_sms, dc);
  return cfg;
}

// The call's problem from its operands' shapes, checked against each other (y and gathered: the
// results; gathered and an FP8 call's gathered_scales may be empty).
ffi::Error problem_of(Operands const& ops, ffi::AnyBuffer const& y, ffi::AnyBuffer const& gathered, bool gather_k,
                      AgGemmConfig const& config, comm::DeviceComm const& dc, AgProblem* problem) {
  bool const fp8 = is_fp8(ops.input);
  int64_t const world = dc.world;
  auto xd = ops.x.dimensions(), wd = ops.w.dimensions(), yd = y.dimensions(), gd = gathered.dimensions();
  // FP8's w_t is w transposed: its K is the second dimension.
  int const w_k = fp8 ? 1 : 0, w_n = fp8 ? 0 : 1;
  bool dims_ok = xd.size() == 2 && wd.size() == 2 && yd.size() == 2;
  if (dims_ok) {
    int64_t const rows = xd[0], cols = xd[1];
    dims_ok = wd[w_k] == (gather_k ? world * cols : cols) && yd[0] == (gather_k ? rows : world * rows) &&
              yd[1] == wd[w_n];
    // The gathered output: [world, rows, cols] (source-major), or empty when not asked for.
    bool const no_gathered = gathered.element_count() == 0;
    dims_ok = dims_ok && (no_gathered || (gd.size() == 3 && gd[0] == world && gd[1] == rows && gd[2] == cols));
    // FP8: each shard's scale, [world] (source-major; block-scaled [world, ceil(cols/128), rows]), or empty.
    auto const sd = fp8 ? ops.gathered_scales->dimensions() : gd;
    bool const scales_ok = ops.scaling == Scaling::kBlock
                               ? sd.size() == 3 && sd[0] == world && sd[1] == (cols + kScaleBlock - 1) / kScaleBlock &&
                                     sd[2] == rows
                               : sd.size() == 1 && sd[0] == world;
    dims_ok = dims_ok && (!fp8 || ops.gathered_scales->element_count() == 0 || scales_ok);
    // A group: every weight as w (its own N), every output as y with its weight's N.
    for (int g = 0; dims_ok && g < ops.more; ++g) {
      auto md = ops.w_more[g]->dimensions(), od = ops.y_more[g]->dimensions();
      dims_ok = md.size() == 2 && od.size() == 2 && md[w_k] == wd[w_k] && od[0] == yd[0] && od[1] == md[w_n];
    }
  }
  if (!dims_ok) {
    std::string const w_shape = fp8 ? (gather_k ? "w_t [N, W * cols]" : "w_t [N, cols]")
                                    : (gather_k ? "w [W * cols, N]" : "w [cols, N]");
    return ffi::Error::InvalidArgument(
        std::string("entwine ag_gemm: expected x [rows, cols], ") + w_shape +
        (gather_k ? ", y [rows, N]" : ", y [W * rows, N]") + ", gathered [W, rows, cols] or empty" +
        (!fp8                               ? ""
         : ops.scaling == Scaling::kBlock ? ", gathered_scales [W, ceil(cols/128), rows] or empty"
                                          : ", gathered_scales [W] or empty") +
        "; got x " + dims_string(xd) + ", w " + dims_string(wd) +
        ", y " + dims_string(yd) + ", gathered " + dims_string(gd) +
        (fp8 ? ", gathered_scales " + dims_string(ops.gathered_scales->dimensions()) : std::string()) +
        (ops.more > 0 ? ", and each further weight and output of the group shaped as w and y with its own N"
                      : "") +
        " with W = " + std::to_string(world));
  }
  // Each weight of a group owns whole blocks: a block is loaded from and stored to one weight.
  int64_t n = wd[w_n];
  for (int g = 0; g <= ops.more; ++g) {
    int64_t const width = g == 0 ? wd[w_n] : ops.w_more[g - 1]->dimensions()[w_n];
    if (ops.more > 0 && width % config.block_n != 0) {
      return ffi::Error::InvalidArgument("entwine ag_gemm: weight " + std::to_string(g) + " of the group has N = " +
                                         std::to_string(width) + ", not a multiple of config.block_n = " +
                                         std::to_string(config.block_n));
    }
    if (g > 0) n += width;
  }
  problem->world = dc.world;
  problem->rank = dc.rank;
  problem->gather_k = gather_k;
  problem->input = ops.input;
  problem->shared_scale = ops.shared_scale;
  problem->scaling = ops.scaling;
  problem->rows = int32_t(xd[0]);
  problem->cols = int32_t(xd[1]);
  problem->n = int32_t(n);
  return ffi::Error::Success();
}

// The plan and the GEMM's parameters (TMA descriptors) of a call site and its buffers.
struct Derived {
  AgPlan plan;
  PreparedGemm gemm;
};

// Derived once per call site and buffers, then found in a memo: the key holds every value they are
// derived from (the problem, the config, the GEMM's arguments, the FP8 scales' addresses among them:
// kernel parameters).
ffi::Error derive(Operands const& ops, AgProblem const& problem, AgGemmArgs const& args, bool capturing,
                  AgGemmConfig const& config, comm::DeviceComm const& dc, Derived const** derived) {
  static thread_local handler::CallMemo<64, Derived> memo;
  handler::MemoKey<64> key;
  for (int64_t v : {int64_t(ops.input), int64_t(ops.output), int64_t(problem.shared_scale), int64_t(problem.scaling),
                    int64_t(problem.rows),
                    int64_t(problem.cols), int64_t(problem.n), int64_t(problem.world), int64_t(problem.rank),
                    int64_t(problem.gather_k), int64_t(capturing), args.call.slot_stride, args.call.flags_stride,
                    int64_t(args.timeout_ns)}) {
    key.add(uint64_t(v));
  }
#define ENTWINE_MEMO_FIELD(type, name, value) key.add(uint64_t(config.name));
  ENTWINE_AG_GEMM_CONFIG_FIELDS(ENTWINE_MEMO_FIELD)
#undef ENTWINE_MEMO_FIELD
  for (const void* p : {args.x, args.gathered, args.w, static_cast<const void*>(args.y),
                        static_cast<const void*>(args.flags), static_cast<const void*>(args.error),
                        static_cast<const void*>(args.error_mirror), static_cast<const void*>(args.call.epoch),
                        static_cast<const void*>(args.x_scale), static_cast<const void*>(args.w_scale)}) {
    key.add(p);
  }
  key.add(uint64_t(args.weights));
  for (int g = 0; g < args.weights && args.weights > 1; ++g) {
    key.add(uint64_t(args.weight_n[g]));
    if (g > 0) {
      key.add(args.w_more[g - 1]);
      key.add(static_cast<const void*>(args.y_more[g - 1]));
    }
  }
  handler::add_call(key, args.call);
  *derived = memo.find(key);
  if (*derived != nullptr) return ffi::Error::Success();
  AgGemmConfig const run = run_config(config, dc);
  Derived fresh{ag_plan(problem, run), {}};
  if (ffi::Error e = check_plan(fresh.plan, problem, run, dc); e.failure()) return e;
  ENTWINE_RETURN_IF_CUDA(kOp, ag_gemm::prepare_gemm(ops.input, ops.output, fresh.plan, args, &fresh.gemm));
  Derived* entry = memo.insert(key);
  *entry = fresh;
  *derived = entry;
  return ffi::Error::Success();
}

// The SM push: one kernel waits for every receiver, pushes every chunk to every peer and releases
// each (launch_push); on `stream`, XLA's ahead of the GEMM or a side stream.
ffi::Error enqueue_sm_push(comm::DeviceComm& dc, AgPlan const& plan, Operands const& ops, CallEpoch const& epoch,
                           cudaStream_t stream) {
  int const rank = dc.rank, world = dc.world;
  size_t const inbox_offset = dc.layout.region_offset(ag_gemm::inbox_region);
  PushArgs push{};
  push.shard = static_cast<char const*>(ops.x.untyped_data());
  for (int q = 0; q < world; ++q) {
    if (q == rank) continue;
    char* const peer_heap = static_cast<char*>(dc.peer_heap[q]);
    push.inbox[q] = peer_heap + inbox_offset;
    push.flags[q] = reinterpret_cast<uint64_t*>(peer_heap + dc.layout.flags_offset());
  }
  push.ready = reinterpret_cast<uint64_t*>(static_cast<char*>(dc.heap) + dc.layout.ready_offset());
  push.arrivals = static_cast<uint32_t*>(dc.workspace(&ag_gemm::kHooks));
  // A per-shard FP8 scale travels in its slot, ahead of the first chunk's release (PushArgs);
  // block scales always travel (AgProblem).
  push.scale = is_fp8(ops.input) && (!ops.shared_scale || plan.scale_k_blocks > 0) ? ops.x_scale : nullptr;
  push.scales_offset = plan.scales_offset;
  push.scale_k_blocks = plan.scale_k_blocks;
  push.rows = plan.rows_pad;
  push.shard_bytes = plan.shard_bytes;
  push.chunks = plan.chunks;
  push.rank = rank;
  push.world = int32_t(world);
  push.error = dc.error_local;
  push.error_mirror = dc.error_device;
  push.call = epoch;
  push.timeout_ns = comm::timeout_ms() * 1000000ull;
  ENTWINE_RETURN_IF_CUDA(kOp, launch_push(plan, push, stream));
  return ffi::Error::Success();
}

// Copy-engine pushes: side stream d - 1 sends the shard to rank (rank + d) % W, chunk by chunk
// (copy engine), each chunk released by its flag in the receiver's memory (launch_release, after the
// copy). Rank r thus receives from r-1 first on every link at once; the GEMM visits peers in that
// order. Each stream opens with the wait for the receiver's announcement (its GEMM has started the
// call), forks from dc.start and records its side_done.
ffi::Error enqueue_copy_engine_pushes(comm::DeviceComm& dc, AgPlan const& plan, Operands const& ops,
                                      CallEpoch const& epoch) {
  int const rank = dc.rank, world = dc.world;
  size_t const inbox_offset = dc.layout.region_offset(ag_gemm::inbox_region);
  char const* const shard = static_cast<char const*>(ops.x.untyped_data());
  int64_t const chunk_bytes = plan.shard_bytes / plan.chunks;
  uint64_t* const own_ready = reinterpret_cast<uint64_t*>(static_cast<char*>(dc.heap) + dc.layout.ready_offset());
  uint64_t const timeout_ns = comm::timeout_ms() * 1000000ull;
  for (int d = 1; d < world; ++d) {
    int const peer = (rank + d) % world;
    cudaStream_t const stream = dc.side[d - 1];
    ENTWINE_RETURN_IF_CUDA(kOp, cudaStreamWaitEvent(stream, dc.start, 0));
    char* const peer_heap = static_cast<char*>(dc.peer_heap[peer]);
    comm::ReceiverWait receiver{};
    receiver.ready = own_ready + peer;
    receiver.rank = rank;
    receiver.dest = peer;
    receiver.site = kWaitInboxReady;
    receiver.error = dc.error_local;
    receiver.error_mirror = dc.error_device;
    receiver.call = epoch;
    receiver.timeout_ns = timeout_ns;
    ENTWINE_RETURN_IF_CUDA(kOp, comm::launch_wait_receiver(receiver, stream));
    char* const peer_inbox = peer_heap + inbox_offset;
    uint64_t* const peer_flags = reinterpret_cast<uint64_t*>(peer_heap + dc.layout.flags_offset());
    if (is_fp8(ops.input) && plan.scale_k_blocks > 0) {
      // Block-scaled: the shard's [k_blocks, rows] scales first, into columns rank*rows .. of the
      // peer's [k_blocks, W * rows] (AgPlan); every chunk's release then publishes them too.
      size_t const row_bytes = size_t(plan.rows_pad) * sizeof(float);
      ENTWINE_RETURN_IF_CUDA(kOp, cudaMemcpy2DAsync(peer_inbox + plan.scales_offset + rank * row_bytes, world * row_bytes,
                                                    ops.x_scale, row_bytes, row_bytes, size_t(plan.scale_k_blocks),
                                                    cudaMemcpyDeviceToDevice, stream));
    } else if (is_fp8(ops.input) && !ops.shared_scale) {
      // The shard's scale first: every chunk's release then publishes it too.
      ENTWINE_RETURN_IF_CUDA(kOp, cudaMemcpyAsync(peer_inbox + plan.scales_offset + rank * kScaleSlotBytes, ops.x_scale,
                                                  sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }
    for (int c = 0; c < plan.chunks; ++c) {
      ENTWINE_RETURN_IF_CUDA(kOp, cudaMemcpyAsync(peer_inbox + rank * plan.shard_bytes + c * chunk_bytes,
                                                  shard + c * chunk_bytes, chunk_bytes, cudaMemcpyDeviceToDevice, stream));
      ENTWINE_RETURN_IF_CUDA(kOp, comm::launch_release(peer_flags + rank * plan.chunks + c, epoch, stream));
    }
    ENTWINE_RETURN_IF_CUDA(kOp, cudaEventRecord(dc.side_done[d - 1], stream));
  }
  return ffi::Error::Success();
}

// The gathered outputs, on XLA's stream after the GEMM, which acquired every chunk: the inbox holds
// every peer's shard (and per-shard FP8 scale) of this call. Empty outputs are skipped.
ffi::Error copy_gathered(comm::DeviceComm const& dc, AgPlan const& plan, Operands const& ops,
                         ffi::AnyBuffer& gathered, cudaStream_t xla_stream) {
  int const rank = dc.rank, world = dc.world;
  char const* const shard = static_cast<char const*>(ops.x.untyped_data());
  char const* const own_inbox = static_cast<char const*>(dc.heap) + dc.layout.region_offset(ag_gemm::inbox_region);
  if (gathered.element_count() != 0) {
    char* const out = static_cast<char*>(gathered.untyped_data());
    for (int s = 0; s < world; ++s) {
      char const* const from = s == rank ? shard : own_inbox + s * plan.shard_bytes;
      ENTWINE_RETURN_IF_CUDA(kOp, cudaMemcpyAsync(out + s * plan.shard_bytes, from, plan.shard_bytes,
                                                  cudaMemcpyDeviceToDevice, xla_stream));
    }
  }
  if (is_fp8(ops.input) && ops.gathered_scales->element_count() != 0 && plan.scale_k_blocks > 0) {
    // Block-scaled: each source's [k_blocks, rows], in the same order: this rank's from x_scale, the
    // peers' from their columns of the inbox's [k_blocks, W * rows].
    auto* const scales = static_cast<char*>(ops.gathered_scales->untyped_data());
    size_t const row_bytes = size_t(plan.rows_pad) * sizeof(float), source_bytes = row_bytes * plan.scale_k_blocks;
    for (int s = 0; s < world; ++s) {
      if (s == rank) {
        ENTWINE_RETURN_IF_CUDA(kOp, cudaMemcpyAsync(scales + s * source_bytes, ops.x_scale, source_bytes,
                                                    cudaMemcpyDeviceToDevice, xla_stream));
      } else {
        ENTWINE_RETURN_IF_CUDA(kOp, cudaMemcpy2DAsync(scales + s * source_bytes, row_bytes,
                                                      own_inbox + plan.scales_offset + s * row_bytes, world * row_bytes,
                                                      row_bytes, size_t(plan.scale_k_blocks), cudaMemcpyDeviceToDevice,
                                                      xla_stream));
      }
    }
  } else if (is_fp8(ops.input) && ops.gathered_scales->element_count() != 0) {
    // Each source's scale, in the same order: the peers' from the inbox's slots, this rank's own (and
    // with a shared scale every one) from x_scale.
    auto* const scales = static_cast<float*>(ops.gathered_scales->untyped_data());
    for (int s = 0; s < world; ++s) {
      void const* const from = s == rank || ops.shared_scale ? static_cast<void const*>(ops.x_scale)
                                                             : own_inbox + plan.scales_offset + s * kScaleSlotBytes;
      ENTWINE_RETURN_IF_CUDA(kOp, cudaMemcpyAsync(scales + s, from, sizeof(float), cudaMemcpyDeviceToDevice,
                                                  xla_stream));
    }
  }
  return ffi::Error::Success();
}

// The inbox argument (docs/design.md, "The double-buffer argument"). In call e, rank q pushes its
// shard into rank r's inbox and r's GEMM (and r's copy of the gathered operand) reads it. The
// inbox is single: a copy engine's destination is fixed when a CUDA graph records it, so it cannot
// follow a parity chosen on the device. Instead q's transfer stream to r opens with a wait and
// copies nothing before r has announced call e (ready_q[r] >= e); r announces as soon as its call
// starts (its push kernel or transfer streams' first kernel, and its GEMM), after r's call e-1,
// every read of the inbox included, completed on r's XLA stream. The flags stay double-buffered
// (their chain is gemm_rs's: every call of either op takes a flag from every peer), so calls of
// both ops may alternate.
ffi::Error RunAgGemm(cudaStream_t xla_stream, int32_t device, Operands const& ops, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::AnyBuffer> gathered, int64_t comm_id, bool gather_k, int64_t signature,
                     AgGemmConfig const& config) {
  comm::DeviceComm* dc = nullptr;
  if (ffi::Error e = handler::usable_comm(kOp, comm_id, device, &dc); e.failure()) return e;
  handler::ExclusiveDispatch const exclusive(*dc);
  if (ffi::Error e = exclusive.check(kOp); e.failure()) return e;
  handler::HostTimer timer{dc};
  AgProblem problem;
  if (ffi::Error e = problem_of(ops, *y, *gathered, gather_k, config, *dc, &problem); e.failure()) return e;
  bool capturing = false;
  if (ffi::Error e = handler::is_capturing(kOp, xla_stream, &capturing); e.failure()) return e;

  // Every argument below is the same for every call of this shape: the epoch and the flags' parity
  // are read on the device, so a CUDA graph may replay the launches and copies (docs/design.md,
  // "Graph safety").
  DeviceGuard guard;
  ENTWINE_RETURN_IF_CUDA(kOp, guard.set(device));
  char* const own = static_cast<char*>(dc->heap);
  CallEpoch const epoch_args = handler::call_epoch(*dc, capturing, signature);
  AgGemmArgs args{};
  args.x = ops.x.untyped_data();
  args.gathered = own + dc->layout.region_offset(ag_gemm::inbox_region);
  args.w = ops.w.untyped_data();
  args.y = y->untyped_data();
  args.x_scale = ops.x_scale;
  args.w_scale = ops.w_scale;
  args.weights = 1 + ops.more;
  if (ops.more > 0) {
    int const w_n = is_fp8(ops.input) ? 0 : 1;
    args.weight_n[0] = int32_t(ops.w.dimensions()[w_n]);
    for (int g = 1; g <= ops.more; ++g) {
      args.weight_n[g] = int32_t(ops.w_more[g - 1]->dimensions()[w_n]);
      args.w_more[g - 1] = ops.w_more[g - 1]->untyped_data();
      args.y_more[g - 1] = ops.y_more[g - 1]->untyped_data();
    }
  }
  args.flags = reinterpret_cast<const uint64_t*>(own + dc->layout.flags_offset());
  args.error = dc->error_local;
  args.error_mirror = dc->error_device;
  args.call = epoch_args;
  args.timeout_ns = comm::timeout_ms() * 1000000ull;
  Derived const* derived = nullptr;
  if (ffi::Error e = derive(ops, problem, args, capturing, config, *dc, &derived); e.failure()) return e;
  AgPlan const& plan = derived->plan;

  timer.lap(comm::kPhaseChecks);
  ffi::Error const pushed = handler::run_pushes_and_gemm(
      kOp, *dc, plan.push_grid > 0 && dc->world > 1, derived->gemm, xla_stream, timer,
      [&](cudaStream_t stream) { return enqueue_sm_push(*dc, plan, ops, epoch_args, stream); },
      [&] { return enqueue_copy_engine_pushes(*dc, plan, ops, epoch_args); },
      [&] { return copy_gathered(*dc, plan, ops, *gathered, xla_stream); });
  if (pushed.failure()) return pushed;
  // The next call's epoch, once this whole call is done (outputs poisoned if the call failed anywhere).
  comm::CallEnd end = handler::call_end(*dc, epoch_args);
  end.add_output(y->untyped_data(), int64_t(y->size_bytes()));
  for (int g = 0; g < ops.more; ++g) end.add_output(ops.y_more[g]->untyped_data(), int64_t(ops.y_more[g]->size_bytes()));
  end.add_output(gathered->untyped_data(), int64_t(gathered->size_bytes()));
  if (is_fp8(ops.input)) {
    end.add_output(ops.gathered_scales->untyped_data(), int64_t(ops.gathered_scales->size_bytes()));
  }
  ENTWINE_RETURN_IF_CUDA(kOp, comm::launch_end_call(end, xla_stream));
  timer.lap(comm::kPhaseEnd);
  return ffi::Error::Success();
}

// bf16 or fp16: x, w, y and the gathered output of one type.
ffi::Error AgGemmImpl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::RemainingArgs w_more, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> gathered,
                      ffi::RemainingRets y_more, int64_t comm_id, bool gather_k, int64_t signature,
                      AgGemmConfig config) {
  return handler::guarded(kOp, [&] {
    Operands ops{DType::kBF16, DType::kBF16, x, w};
    if (ffi::Error e = handler::element_type(kOp, "x", x, &ops.input); e.failure()) return e;
    if (w.element_type() != x.element_type() || y->element_type() != x.element_type() ||
        gathered->element_type() != x.element_type()) {
      return ffi::Error::InvalidArgument("entwine ag_gemm: x, w, y and the gathered output must share one dtype");
    }
    ops.output = ops.input;
    if (ffi::Error e = group_operands(w_more, y_more, *y, &ops); e.failure()) return e;
    return RunAgGemm(xla_stream, device, ops, y, gathered, comm_id, gather_k, signature, config);
  });
}

// FP8: the shard x [rows, cols] in float8_e4m3fn or float8_e5m2 and w_t [N, W * cols or cols] in
// float8_e4m3fn; y bf16 or fp16 (x's type, y's and the scales' shapes pick the kernel). Per tensor,
// one f32 scale each: each source's rows (rows layout) are scaled by that source's x_scale, which
// travels with its shard, unless shared_scale says they are all equal. Per block (fp8_scales): each
// shard's x_scale [ceil(cols/128), rows] travels with it and scales its rows (rows layout) or its K
// slice (contraction layout) per K block; w_scale [ceil(N/128), ceil(K/128)].
// Returns the gathered shards (x's type, [W, rows, cols], or empty) and their scales (f32 [W], or
// block-scaled [W, ceil(cols/128), rows], or empty).
ffi::Error AgGemmFp8Impl(cudaStream_t xla_stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w_t,
                         ffi::AnyBuffer x_scale, ffi::AnyBuffer w_scale, ffi::RemainingArgs w_t_more,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> gathered,
                         ffi::Result<ffi::AnyBuffer> gathered_scales, ffi::RemainingRets y_more, int64_t comm_id,
                         bool gather_k, int64_t signature, AgGemmConfig config, bool shared_scale) {
  return handler::guarded(kOp, [&] {
    Operands ops{DType::kE4M3, DType::kBF16, x, w_t};
    if (ffi::Error e = handler::fp8_input(kOp, "x", x, &ops.input); e.failure()) return e;
    if (ffi::Error e = handler::fp8_weight(kOp, "w_t", w_t); e.failure()) return e;
    if (gathered->element_type() != x.element_type()) {
      return ffi::Error::InvalidArgument("entwine ag_gemm: the gathered output must have x's dtype, got codes " +
                                         std::to_string(int(gathered->element_type())) + " and " +
                                         std::to_string(int(x.element_type())));
    }
    if (ffi::Error e = fp8_scales(x_scale, w_scale, &ops); e.failure()) return e;
    if (ffi::Error e = handler::element_type(kOp, "y", *y, &ops.output); e.failure()) return e;
    if (gathered_scales->element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument("entwine ag_gemm: gathered_scales must be float32, got dtype code " +
                                         std::to_string(int(gathered_scales->element_type())));
    }
    ops.shared_scale = shared_scale;
    ops.gathered_scales = &*gathered_scales;
    if (ffi::Error e = group_operands(w_t_more, y_more, *y, &ops); e.failure()) return e;
    if (ops.scaling == Scaling::kBlock && ops.more > 0) {
      // The block-scaled kernels read one weight: the op joins a block-scaled group (its scales concatenate).
      return ffi::Error::InvalidArgument("entwine ag_gemm: a block-scaled call takes one weight, got a group of " +
                                         std::to_string(1 + ops.more));
    }
    return RunAgGemm(xla_stream, device, ops, y, gathered, comm_id, gather_k, signature, config);
  });
}

}  // namespace
}  // namespace entwine

// `config` arrives as one dictionary attribute, decoded by name into AgGemmConfig.
ENTWINE_REGISTER_CONFIG_DECODING(entwine::AgGemmConfig, ENTWINE_AG_GEMM_CONFIG_FIELDS);

// Command-buffer compatible: no host value that changes per call reaches a kernel or a copy, so XLA
// may record the call into a CUDA graph and replay it (docs/design.md, "Graph safety").
XLA_FFI_DEFINE_HANDLER_SYMBOL(AgGemm, entwine::AgGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // xla_stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Arg<ffi::AnyBuffer>()                     // x: the local shard
                                  .Arg<ffi::AnyBuffer>()                     // w
                                  .RemainingArgs()                           // a group's further weights
                                  .Ret<ffi::AnyBuffer>()                     // y
                                  .Ret<ffi::AnyBuffer>()                     // gathered (or empty)
                                  .RemainingRets()                           // a group's further outputs
                                  .Attr<int64_t>("comm_id")                  // comm_id
                                  .Attr<bool>("gather_k")                    // gather_k
                                  .Attr<int64_t>("signature")                // what the call is (stamps)
                                  .Attr<entwine::AgGemmConfig>("config"),    // config
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgGemmFp8, entwine::AgGemmFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // xla_stream
                                  .Ctx<ffi::DeviceOrdinal>()                 // device
                                  .Arg<ffi::AnyBuffer>()                     // x: the local shard, float8_e4m3fn or e5m2
                                  .Arg<ffi::AnyBuffer>()                     // w_t: float8_e4m3fn [N, K]
                                  .Arg<ffi::AnyBuffer>()                     // x_scale: f32 [] or [cols/128, rows]
                                  .Arg<ffi::AnyBuffer>()                     // w_scale: f32 [] or [N/128, K/128]
                                  .RemainingArgs()                           // a group's further w_t
                                  .Ret<ffi::AnyBuffer>()                     // y: bf16 or f16
                                  .Ret<ffi::AnyBuffer>()                     // gathered (or empty)
                                  .Ret<ffi::AnyBuffer>()                     // gathered_scales [W] or [W, cols/128, rows] (or empty)
                                  .RemainingRets()                           // a group's further outputs
                                  .Attr<int64_t>("comm_id")                  // comm_id
                                  .Attr<bool>("gather_k")                    // gather_k
                                  .Attr<int64_t>("signature")                // what the call is (stamps)
                                  .Attr<entwine::AgGemmConfig>("config")     // config
                                  .Attr<bool>("shared_scale"),               // shared_scale
                              {ffi::Traits::kCmdBufferCompatible});
