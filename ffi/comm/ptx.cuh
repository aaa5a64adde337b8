// Memory-model primitives of the tile protocol: system-scope release/acquire on 64-bit epoch flags,
// the global nanosecond timer for deadlines, 16-byte loads that bypass L1 (peer data changes
// between calls; L1 is not coherent with NVLink writes), what the producer's release needs beyond
// cute's bulk-copy primitives (write completion, the global proxy fence), named barriers, and
// programmatic dependent launch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace entwine::ptx {

// Strong relaxed store of an epoch flag. After fence_acq_rel_sys() it is a release: every write
// ordered before the fence (including other threads' writes made visible to this thread by a CTA
// barrier) is visible system-wide before the flag is. One fence can release several flags; each
// st.release.sys would compile to a system fence of its own.
__device__ __forceinline__ void store_relaxed_sys(uint64_t* flag, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

// Relaxed (but not cached-stale) load of an epoch flag, for polling; follow a successful poll with
// fence_acq_rel_sys() to get acquire semantics.
__device__ __forceinline__ uint64_t load_relaxed_sys(const uint64_t* flag) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
}

// GPU-scope release/acquire of a 32-bit sequence (the producer's split-block handoff between CTAs).
__device__ __forceinline__ void store_release_gpu(uint32_t* flag, uint32_t value) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire_gpu(const uint32_t* flag) {
  uint32_t value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// 16-byte load cached in L2 only.
__device__ __forceinline__ uint4 load_cg_16(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The calling thread's bulk copies are complete: their global writes are performed (cute's
// tma_store_wait waits only for the reads of shared memory).
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Orders completed async-proxy global writes before this thread's later generic-proxy operations.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// A shared-memory word handed from one warp role to another across bar.arrive -> bar.sync (which
// orders it): written and read with atomics, so the handoff is race-free by the memory model's
// definition, and visible as such to compute-sanitizer racecheck, which does not order bar.arrive.
__device__ __forceinline__ void store_shared_word(uint32_t* word, uint32_t value) { atomicExch(word, value); }
__device__ __forceinline__ uint32_t load_shared_word(uint32_t* word) { return atomicOr(word, 0u); }

// Named barrier over `threads` threads (a multiple of 32), id 1..15 (0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Arrive at a named barrier without waiting (the producer side of a barrier handshake).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Programmatic dependent launch (both are no-ops in a kernel not launched as a primary or as a
// dependent): let the kernel launched after this one on its stream as a programmatic dependent
// start once every CTA of this grid got here or exited; and, in the dependent, wait until its
// primary has completed and its writes are visible.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void wait_primary() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// The host's half: the launch attribute that makes a launch the programmatic dependent of the
// stream's previous kernel.
inline cudaLaunchAttribute programmatic_dependent() {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return attr;
}

}  // namespace entwine::ptx
