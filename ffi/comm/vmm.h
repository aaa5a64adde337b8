// The CUDA driver's virtual memory management, as the communicator uses it: reserve address ranges,
// create physical memory, map it, grant devices access, share it with other processes as POSIX file
// descriptors. The driver is reached through the runtime's entry-point lookup on first use, so the
// module links no libcuda and imports on machines without a GPU. Setup only; every call throws
// std::runtime_error naming the driver function and its error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace entwine::comm::vmm {

using Handle = unsigned long long;  // CUmemGenericAllocationHandle

// The driver's smallest mapping unit on `device` (2 MiB on Hopper).
size_t granularity(int device);

// A range of virtual addresses aligned to `alignment`, mapped nowhere yet; both multiples of the
// granularity.
void* reserve(size_t bytes, size_t alignment);
void free_reservation(void* base, size_t bytes) noexcept;

// Physical memory of `bytes` on `device`, exportable as a POSIX file descriptor.
Handle create(int device, size_t bytes);
void release(Handle handle) noexcept;

// Maps all of `handle` at `address` (inside a reservation) and lets `devices` read and write it.
void map(void* address, size_t bytes, Handle handle, const std::vector<int>& devices);
// Lets `devices` read and write the mapped range [address, address + bytes).
void grant(void* address, size_t bytes, const std::vector<int>& devices);
void unmap(void* address, size_t bytes) noexcept;

// A new file descriptor of `handle` for another process (the caller closes it once sent), and the
// handle of a descriptor received from one (the caller still closes the descriptor).
int export_fd(Handle handle);
Handle import_fd(int fd);

}  // namespace entwine::comm::vmm
