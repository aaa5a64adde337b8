// The driver functions of vmm.h, resolved once through cudaGetDriverEntryPointByVersion (the runtime
// already loads libcuda at its first call; linking libcuda would make `import entwine_jax` fail on
// machines without a driver).
#include "comm/vmm.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

namespace entwine::comm::vmm {
namespace {

// The ABI version the function types below follow (the v10020 forms, unchanged since).
constexpr unsigned kDriverAbi = 12000;

struct Driver {
  CUresult (*get_error_string)(CUresult, const char**);
  CUresult (*get_granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
};

template <typename F>
void resolve(const char* symbol, F* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &fn, kDriverAbi, cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    throw std::runtime_error(std::string("entwine comm: the CUDA driver has no ") + symbol + " (" +
                             cudaGetErrorString(err) + ")");
  }
  *out = reinterpret_cast<F>(fn);
}

const Driver& driver() {
  static std::once_flag once;
  static Driver d{};
  std::call_once(once, [] {
    resolve("cuGetErrorString", &d.get_error_string);
    resolve("cuMemGetAllocationGranularity", &d.get_granularity);
    resolve("cuMemAddressReserve", &d.address_reserve);
    resolve("cuMemAddressFree", &d.address_free);
    resolve("cuMemCreate", &d.create);
    resolve("cuMemRelease", &d.release);
    resolve("cuMemMap", &d.map);
    resolve("cuMemUnmap", &d.unmap);
    resolve("cuMemSetAccess", &d.set_access);
    resolve("cuMemExportToShareableHandle", &d.export_handle);
    resolve("cuMemImportFromShareableHandle", &d.import_handle);
  });
  return d;
}

void check(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (driver().get_error_string(result, &text) != CUDA_SUCCESS || text == nullptr) text = "unknown error";
  throw std::runtime_error(std::string("entwine comm: ") + what + ": " + text);
}

CUdeviceptr address(void* p) { return reinterpret_cast<CUdeviceptr>(p); }

CUmemAllocationProp device_memory(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

}  // namespace

size_t granularity(int device) {
  CUmemAllocationProp prop = device_memory(device);
  size_t bytes = 0;
  check(driver().get_granularity(&bytes, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity");
  return bytes;
}

void* reserve(size_t bytes, size_t alignment) {
  CUdeviceptr base = 0;
  check(driver().address_reserve(&base, bytes, alignment, 0, 0), "cuMemAddressReserve");
  return reinterpret_cast<void*>(base);
}

void free_reservation(void* base, size_t bytes) noexcept {
  if (base) driver().address_free(address(base), bytes);
}

Handle create(int device, size_t bytes) {
  CUmemAllocationProp prop = device_memory(device);
  CUmemGenericAllocationHandle handle = 0;
  check(driver().create(&handle, bytes, &prop, 0), "cuMemCreate");
  return handle;
}

void release(Handle handle) noexcept { driver().release(handle); }

void grant(void* at, size_t bytes, const std::vector<int>& devices) {
  std::vector<CUmemAccessDesc> access(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[i].location.id = devices[i];
    access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  check(driver().set_access(address(at), bytes, access.data(), access.size()), "cuMemSetAccess");
}

void map(void* at, size_t bytes, Handle handle, const std::vector<int>& devices) {
  check(driver().map(address(at), bytes, 0, handle, 0), "cuMemMap");
  try {
    grant(at, bytes, devices);
  } catch (...) {
    driver().unmap(address(at), bytes);
    throw;
  }
}

void unmap(void* at, size_t bytes) noexcept { driver().unmap(address(at), bytes); }

int export_fd(Handle handle) {
  int fd = -1;
  check(driver().export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle");
  return fd;
}

Handle import_fd(int fd) {
  CUmemGenericAllocationHandle handle = 0;
  // The descriptor is passed by value, cast to a pointer (the driver's convention for POSIX fds).
  check(driver().import_handle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        "cuMemImportFromShareableHandle");
  return handle;
}

}  // namespace entwine::comm::vmm
