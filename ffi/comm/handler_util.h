// What every FFI handler does alike before it launches: a CUDA-error-to-ffi::Error macro, the
// decoding of an op's config attribute, a printable buffer shape, the communicator entry a call
// may use, the kernels' element types (FP8 operands and their scales), the body that turns
// exceptions into errors, the capture test and the call's epoch arguments, the grid of a GEMM that
// waits on pushes, a host timer, a guard that restores XLA's current device, and the memo of what a
// call site derives. Host-only.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

#include <cuda_runtime.h>

#include "comm/comm.h"
#include "comm/protocol.h"
#include "xla/ffi/api/ffi.h"

// Returns an ffi::Error naming the op (`what`, e.g. "entwine gemm_rs"), the call and CUDA's error.
#define ENTWINE_RETURN_IF_CUDA(what, expr)                                                            \
  do {                                                                                                \
    cudaError_t err_ = (expr);                                                                        \
    if (err_ != cudaSuccess) {                                                                        \
      return ::xla::ffi::Error::Internal(std::string(what) + ": " + #expr + ": " + cudaGetErrorString(err_)); \
    }                                                                                                 \
  } while (0)

// Registers the decoding of the config struct T from a dictionary attribute whose entries are the
// rows of FIELDS (comm/config.h): a missing, extra or mistyped entry fails the call with XLA's
// message naming it. At global scope, once per op (its handler.cc).
#define ENTWINE_CONFIG_DECODING_MEMBER(type, name, value) , ::xla::ffi::StructMember<type>(#name)
#define ENTWINE_CONFIG_DECODING_EXPANDED(...) XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(__VA_ARGS__)
#define ENTWINE_REGISTER_CONFIG_DECODING(T, FIELDS) \
  ENTWINE_CONFIG_DECODING_EXPANDED(T FIELDS(ENTWINE_CONFIG_DECODING_MEMBER))

namespace entwine::handler {

namespace ffi = ::xla::ffi;

inline std::string dims_string(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// The entry of (comm_id, device) in *out, if a call may use it: it exists (Python's acquire_comm
// made it at trace time), no wait of an earlier call passed its deadline (the error is sticky), and
// its peer table is filled.
inline ffi::Error usable_comm(const char* op, int64_t comm_id, int32_t device, comm::DeviceComm** out) {
  comm::DeviceComm* dc = comm::find(comm_id, device);
  if (dc == nullptr) {
    return ffi::Error::InvalidArgument(std::string(op) + ": no communicator " + std::to_string(comm_id) +
                                       " on device " + std::to_string(device) +
                                       " (entwine_jax.comm.acquire_comm makes it, at trace time)");
  }
  if (auto message = comm::error_message(*dc)) return ffi::Error::Internal(*message);
  if (!dc->connected) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(op) + ": communicator " + std::to_string(comm_id) +
                          " is not connected (yet, or any more) on device " + std::to_string(device));
  }
  *out = dc;
  return ffi::Error::Success();
}

// Holds a communicator entry for one handler's execution. Two handlers enqueueing calls on one
// entry at once (two host threads running programs with fused calls of one mesh axis, or XLA
// running commands concurrently) would give the calls epochs in an order no other rank shares: the
// second is refused with an error instead of mixing silently.
class ExclusiveDispatch {
 public:
  explicit ExclusiveDispatch(comm::DeviceComm& dc) : dc_(dc), owned_(!dc.dispatching.exchange(true)) {}
  ~ExclusiveDispatch() {
    if (owned_) dc_.dispatching.store(false);
  }
  ExclusiveDispatch(const ExclusiveDispatch&) = delete;
  ExclusiveDispatch& operator=(const ExclusiveDispatch&) = delete;
  ffi::Error check(const char* op) const {
    if (owned_) return ffi::Error::Success();
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(op) + ": another fused call of this communicator is being enqueued at the same "
                                        "time (two threads, or concurrent XLA commands); calls of one mesh axis "
                                        "must be issued one at a time, in the same order on every rank");
  }

 private:
  comm::DeviceComm& dc_;
  bool owned_;
};

// A 16-bit operand's or output's element type (bf16 or fp16), in *out.
inline ffi::Error element_type(const char* op, const char* name, ffi::AnyBuffer const& a, DType* out) {
  if (a.element_type() == ffi::DataType::BF16) {
    *out = DType::kBF16;
  } else if (a.element_type() == ffi::DataType::F16) {
    *out = DType::kFP16;
  } else {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must be bf16 or f16, got dtype code " +
                                       std::to_string(int(a.element_type())));
  }
  return ffi::Error::Success();
}

// An FP8 call's x (A): float8_e4m3fn, or float8_e5m2 (a gradient, the hybrid recipe's backward);
// its type picks the kernel, in *out (protocol.h: kE4M3, kE5M2).
inline ffi::Error fp8_input(const char* op, const char* name, ffi::AnyBuffer const& a, DType* out) {
  if (a.element_type() == ffi::DataType::F8E4M3FN) {
    *out = DType::kE4M3;
  } else if (a.element_type() == ffi::DataType::F8E5M2) {
    *out = DType::kE5M2;
  } else {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + name +
                                       " must be float8_e4m3fn or float8_e5m2, got dtype code " +
                                       std::to_string(int(a.element_type())));
  }
  return ffi::Error::Success();
}

// An FP8 call's w_t (B): float8_e4m3fn, the one weight type the kernels are built for.
inline ffi::Error fp8_weight(const char* op, const char* name, ffi::AnyBuffer const& a) {
  if (a.element_type() == ffi::DataType::F8E4M3FN) return ffi::Error::Success();
  std::string const got = a.element_type() == ffi::DataType::F8E5M2
                              ? "float8_e5m2 (the kernels take e5m2 for x only: e5m2 x e4m3 or e4m3 x e4m3)"
                              : "dtype code " + std::to_string(int(a.element_type()));
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must be float8_e4m3fn, got " + got);
}

// A dequantisation scale: one f32 on the device (a traced value: read by the kernels, never here).
inline ffi::Error scale_operand(const char* op, const char* name, ffi::AnyBuffer const& a, const float** out) {
  if (a.element_type() != ffi::DataType::F32 || a.element_count() != 1 || a.dimensions().size() > 1) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must be one float32 ([] or [1]), got dtype code " +
                                       std::to_string(int(a.element_type())) + " " + dims_string(a.dimensions()));
  }
  *out = static_cast<const float*>(a.untyped_data());
  return ffi::Error::Success();
}

// Whether an FP8 call's scale is one per tensor ([] or [1]); a block-scaled call's are 2-D arrays.
inline bool is_tensor_scale(ffi::AnyBuffer const& a) { return a.dimensions().size() <= 1 && a.element_count() == 1; }

// A block-scaled FP8 call's scale array: float32 [rows, cols] exactly (`layout` names the dims).
inline ffi::Error block_scale_operand(const char* op, const char* name, ffi::AnyBuffer const& a, int64_t rows,
                                      int64_t cols, const char* layout, const float** out) {
  auto const d = a.dimensions();
  if (a.element_type() != ffi::DataType::F32 || d.size() != 2 || d[0] != rows || d[1] != cols) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must be float32 " + layout + " = [" +
                                       std::to_string(rows) + ", " + std::to_string(cols) +
                                       "] (block scaling; per tensor, both scales are one float32), got dtype code " +
                                       std::to_string(int(a.element_type())) + " " + dims_string(d));
  }
  *out = static_cast<const float*>(a.untyped_data());
  return ffi::Error::Success();
}

// An FP8 call's two scales, told apart by their shapes: two scalars ([] or [1]) scale per tensor
// (*block false); otherwise per block (*block true), x_scale [ceil(x_k / b), x_rows] (M-major) and
// w_scale [ceil(w_n / b), ceil(w_k / b)] for w_t [w_n, w_k], b = `block_elems`; `x_layout` names
// x_scale's dims in its error. Sets the scales' addresses.
inline ffi::Error fp8_scales(const char* op, ffi::AnyBuffer const& x_scale, ffi::AnyBuffer const& w_scale,
                             int64_t x_rows, int64_t x_k, int64_t w_n, int64_t w_k, int64_t block_elems,
                             const char* x_layout, bool* block, const float** xs, const float** ws) {
  *block = !(is_tensor_scale(x_scale) && is_tensor_scale(w_scale));
  if (!*block) {
    if (ffi::Error e = scale_operand(op, "x_scale", x_scale, xs); e.failure()) return e;
    return scale_operand(op, "w_scale", w_scale, ws);
  }
  auto const blocks = [block_elems](int64_t v) { return (v + block_elems - 1) / block_elems; };
  if (ffi::Error e = block_scale_operand(op, "x_scale", x_scale, blocks(x_k), x_rows, x_layout, xs); e.failure()) {
    return e;
  }
  return block_scale_operand(op, "w_scale", w_scale, blocks(w_n), blocks(w_k), "[ceil(N/128), ceil(K/128)]", ws);
}

// The grid of a GEMM whose CTAs wait, holding their SMs, for data that peers' pushes release
// (docs/design.md, "Forward progress"): an SM push of push_sms CTAs that waits for its receivers to
// start the call, or (push_sms 0) the copy engines' one-warp release kernels, which need an SM of
// their own. So the GEMM leaves SMs: the push's CTAs (or one for the release kernels), the reserve
// (comm::sm_reserve), and, where processes share this GPU, enough that all of them waiting at once
// (GEMM and push) still leave one SM for the release kernels and the pushes still to start.
inline int64_t waiting_gemm_sms(int64_t gemm_sms, int64_t push_sms, const comm::DeviceComm& dc) {
  int64_t const push = push_sms > 0 ? push_sms : 1;
  int64_t const free = int64_t(dc.sm_count) - comm::sm_reserve();
  int64_t limit = free - push;
  if (dc.gpu_sharers > 1) {
    int64_t const share = (free - 1) / dc.gpu_sharers - push;
    if (share < limit) limit = share;
  }
  if (gemm_sms > limit) return limit > 1 ? limit : 1;
  return gemm_sms;
}

// Runs a handler's body: nothing but an ffi::Error may leave a handler (std::string and the
// registry lock can throw).
template <class Body>
ffi::Error guarded(const char* op, Body const& body) {
  // The runtime's last-error word is per thread and outlives a call: a stale one (another
  // library's, or a failed call's) would make this call's first launch check fail after kernels
  // were enqueued, so it is cleared before the call and after a failed one.
  cudaGetLastError();
  ffi::Error result = [&]() -> ffi::Error {
    try {
      return body();
    } catch (const std::exception& e) {
      return ffi::Error::Internal(std::string(op) + ": " + e.what());
    } catch (...) {
      return ffi::Error::Internal(std::string(op) + ": unknown C++ exception");
    }
  }();
  if (result.failure()) cudaGetLastError();
  return result;
}

// Whether XLA's stream is being captured into a CUDA graph (an XLA command buffer, or a user's own
// stream capture). Such a call is replayed without its handler, so nothing on the host can report
// a deadline between replays: its waits trap instead (CallEpoch::trap).
inline ffi::Error is_capturing(const char* op, cudaStream_t stream, bool* out) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  ENTWINE_RETURN_IF_CUDA(op, cudaStreamIsCapturing(stream, &capture));
  *out = capture != cudaStreamCaptureStatusNone;
  return ffi::Error::Success();
}

// Where the kernels of a call on `dc` find its epoch, parity strides, ready and abort words, and
// what the call is (protocol.h, CallEpoch).
inline CallEpoch call_epoch(const comm::DeviceComm& dc, bool trap, int64_t signature) {
  CallEpoch call{dc.epoch, dc.layout.parity_stride_bytes(), dc.layout.flags_stride_words(), trap,
                 uint32_t(uint64_t(signature) & kSignatureMask)};
  char* const own = static_cast<char*>(dc.heap);
  call.ready = reinterpret_cast<const uint64_t*>(own + dc.layout.ready_offset());
  call.aborted = reinterpret_cast<const uint64_t*>(own + dc.layout.abort_offset());
  for (int q = 0; q < dc.world; ++q) {
    char* const heap = static_cast<char*>(dc.peer_heap[q]);
    call.abort[q] = reinterpret_cast<uint64_t*>(heap + dc.layout.abort_offset());
    if (q != dc.rank) call.announce[q] = reinterpret_cast<uint64_t*>(heap + dc.layout.ready_offset()) + dc.rank;
  }
  return call;
}

// The call's end's arguments (its end kernel's, or the kernels' that fold it: comm/call_end.cuh): the
// epoch and the failure records; the handler adds the outputs to poison (CallEnd::add_output).
inline comm::CallEnd call_end(const comm::DeviceComm& dc, const CallEpoch& call) {
  comm::CallEnd end;
  end.epoch = dc.epoch;
  end.error = dc.error_local;
  end.mirror = dc.error_device;
  end.aborted = call.aborted;
  end.rank = dc.rank;
  return end;
}

// Adds the handler's wall time, from its construction to the return, to the entry's host cost, and
// each stretch between laps to its phase (comm::HostPhase): where a handler's time goes.
struct HostTimer {
  using Clock = std::chrono::steady_clock;
  comm::DeviceComm* dc;
  Clock::time_point start = Clock::now(), last = start;
  void lap(comm::HostPhase phase) {
    Clock::time_point const now = Clock::now();
    dc->phase_ns[phase] += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count());
    last = now;
  }
  ~HostTimer() {
    auto const ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start);
    dc->handler_ns += uint64_t(ns.count());
    ++dc->handler_calls;
  }
};

// The pushes and the GEMM that consumes them as they land (an op whose GEMM waits), from the end of
// the call's checks to the join of its side streams. An SM push (sm_push) and the GEMM are chained on
// XLA's stream, the GEMM as the push's programmatic dependent: its CTAs start once the push's are
// resident, and its grid completes only after the push's (gemm_kernel.cuh); no fork or join.
// ENTWINE_PROFILE=1 forks the push instead, so that events time the GEMM window alone
// (comm::last_call_ms). Otherwise the GEMM goes first on XLA's stream (its local operand needs nothing
// from a peer, so it starts while the host still enqueues the pushes), then the pushes on side
// streams: push_on(stream) enqueues the SM push (side stream 0), copy_engine_pushes() the copy
// engines' (one side stream per peer). after_gemm(): XLA's stream's work between the GEMM and the join.
template <class Gemm, class PushOn, class CopyEnginePushes, class AfterGemm>
ffi::Error run_pushes_and_gemm(const char* op, comm::DeviceComm& dc, bool sm_push, Gemm const& gemm,
                               cudaStream_t xla_stream, HostTimer& timer, PushOn const& push_on,
                               CopyEnginePushes const& copy_engine_pushes, AfterGemm const& after_gemm) {
  bool const chained = sm_push && !comm::profiling();
  if (!chained) ENTWINE_RETURN_IF_CUDA(op, cudaEventRecord(dc.start, xla_stream));
  timer.lap(comm::kPhaseFork);
  // The side streams to join: side stream 0 alone for a forked SM push, one per peer for the copy engines.
  int const side_streams = chained ? 0 : sm_push ? 1 : dc.world - 1;
  if (chained) {
    if (ffi::Error e = push_on(xla_stream); e.failure()) return e;
    ENTWINE_RETURN_IF_CUDA(op, gemm.enqueue(xla_stream, /*dependent=*/true));
  } else {
    ENTWINE_RETURN_IF_CUDA(op, gemm.enqueue(xla_stream));
    if (sm_push) {
      ENTWINE_RETURN_IF_CUDA(op, cudaStreamWaitEvent(dc.side[0], dc.start, 0));
      if (ffi::Error e = push_on(dc.side[0]); e.failure()) return e;
      ENTWINE_RETURN_IF_CUDA(op, cudaEventRecord(dc.side_done[0], dc.side[0]));
    } else if (ffi::Error e = copy_engine_pushes(); e.failure()) {
      return e;
    }
  }
  if (ffi::Error e = after_gemm(); e.failure()) return e;
  // The GEMM window, for ENTWINE_PROFILE=1 (comm::last_call_ms).
  if (comm::profiling()) ENTWINE_RETURN_IF_CUDA(op, cudaEventRecord(dc.producer_done, xla_stream));
  timer.lap(comm::kPhaseLaunch);
  for (int d = 1; d <= side_streams; ++d) {
    ENTWINE_RETURN_IF_CUDA(op, cudaStreamWaitEvent(xla_stream, dc.side_done[d - 1], 0));
  }
  timer.lap(comm::kPhaseJoin);
  return ffi::Error::Success();
}

// Restores the caller's current device: XLA's thread may rely on it after we return. Usually XLA's
// thread is on the call's device already, and nothing is set either way.
struct DeviceGuard {
  int previous = -1;
  bool changed = false;
  cudaError_t set(int device) {
    cudaGetDevice(&previous);
    changed = previous != device;
    return changed ? cudaSetDevice(device) : cudaSuccess;
  }
  ~DeviceGuard() {
    if (changed && previous >= 0) cudaSetDevice(previous);
  }
};

// The words of a CallMemo key: every value a handler's derivation reads, each widened to 64 bits.
template <size_t kWords>
struct MemoKey {
  uint64_t words[kWords] = {};
  size_t used = 0;
  bool overflow = false;  // more values than kWords: the key matches nothing
  void add(uint64_t v) {
    if (used < kWords) {
      words[used++] = v;
    } else {
      overflow = true;
    }
  }
  void add(const void* p) { add(uint64_t(reinterpret_cast<uintptr_t>(p))); }
  bool operator==(MemoKey const& o) const {
    return !overflow && !o.overflow && used == o.used && std::memcmp(words, o.words, sizeof words) == 0;
  }
};

// Adds what the kernels read of the call's CallEpoch beyond its epoch word and strides (which the
// handlers add themselves): the signature and the ready, abort and announce words.
template <size_t kWords>
inline void add_call(MemoKey<kWords>& key, CallEpoch const& call) {
  key.add(uint64_t(call.signature));
  key.add(call.ready);
  key.add(call.aborted);
  for (uint64_t* a : call.abort) key.add(a);
  for (uint64_t* a : call.announce) key.add(a);
}

// What a handler derives from a call and may reuse (its plan, its prepared GEMM launch), memoised by
// the key of every value the derivation reads: a call of the same site, shape, config and buffers
// skips the planning and the TMA descriptors. The derivation is a pure function of the key, so an
// entry is never stale (a freed buffer whose address comes back gets the same derivation). One memo
// per host thread (XLA calls a device's handlers on its threads; the thread's first call has the
// runtime allocate its copy), a few entries replaced in turn; no lock.
template <size_t kWords, class Value, int kEntries = 8>
class CallMemo {
 public:
  using Key = MemoKey<kWords>;
  Value const* find(Key const& key) const {
    for (int i = 0; i < filled_; ++i) {
      if (keys_[i] == key) return &values_[i];
    }
    return nullptr;
  }
  // The entry for `key`, to be filled by the caller.
  Value* insert(Key const& key) {
    int const i = next_;
    next_ = (next_ + 1) % kEntries;
    if (filled_ < kEntries) ++filled_;
    keys_[i] = key;
    return &values_[i];
  }

 private:
  Key keys_[kEntries];
  Value values_[kEntries];
  int next_ = 0, filled_ = 0;
};

}  // namespace entwine::handler
