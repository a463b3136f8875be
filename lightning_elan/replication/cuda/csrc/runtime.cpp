// CUDA runtime calls of the extension: device queries, raw (IPC-exportable) allocations, IPC handles, raw copies.
// Plain C++ against cuda_runtime.h; no torch header.
#include <cuda_runtime.h>

#include <cctype>
#include <cstring>
#include <stdexcept>
#include <string>

#include "elan_cuda.h"

namespace elan {
namespace {

void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state so later calls are not poisoned
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(error));
  }
}

// Sets `device` current for the scope, restoring the previous one.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    changed_ = previous_ != device;
  }
  ~DeviceScope() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::string pci_bus_id(int device) {
  char buffer[64] = {0};
  check(cudaDeviceGetPCIBusId(buffer, sizeof(buffer), device), "cudaDeviceGetPCIBusId");
  std::string id(buffer);
  for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // CUDA prints an 8-digit domain ("00000000:3b:00.0"); sysfs and the Python side use 4 digits
  const std::size_t colon = id.find(':');
  if (colon == 8 && id.compare(0, 4, "0000") == 0) id.erase(0, 4);
  return id;
}

bool can_access_peer(int device, int peer) {
  int can = 0;
  check(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer");
  return can != 0;
}

std::uintptr_t device_malloc(std::size_t nbytes, int device) {
  DeviceScope scope(device);
  void* ptr = nullptr;
  check(cudaMalloc(&ptr, nbytes == 0 ? 1 : nbytes), "cudaMalloc");
  return reinterpret_cast<std::uintptr_t>(ptr);
}

void device_free(std::uintptr_t ptr, int device) {
  DeviceScope scope(device);
  check(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree");
}

std::string ipc_get_handle(std::uintptr_t base, int device) {
  DeviceScope scope(device);
  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

std::uintptr_t ipc_open(const std::string& handle, int device) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    throw std::runtime_error("ipc_open: a CUDA IPC handle has " + std::to_string(sizeof(cudaIpcMemHandle_t)) +
                             " bytes, got " + std::to_string(handle.size()));
  }
  DeviceScope scope(device);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* ptr = nullptr;
  check(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return reinterpret_cast<std::uintptr_t>(ptr);
}

void ipc_close(std::uintptr_t ptr, int device) {
  DeviceScope scope(device);
  check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle");
}

void memcpy_async(std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, int device, std::uintptr_t stream) {
  if (nbytes == 0) return;
  DeviceScope scope(device);
  check(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes, cudaMemcpyDefault,
                        reinterpret_cast<cudaStream_t>(stream)),
        "cudaMemcpyAsync");
}

std::uintptr_t upload_table(const std::int64_t* host, std::size_t count, int device) {
  const std::size_t nbytes = count * sizeof(std::int64_t);
  const std::uintptr_t table = device_malloc(nbytes, device);
  try {
    DeviceScope scope(device);
    // pageable source: cudaMemcpy returns once the bytes are on the device (no stream ordering needed afterwards)
    check(cudaMemcpy(reinterpret_cast<void*>(table), host, nbytes, cudaMemcpyHostToDevice), "cudaMemcpy (plan table)");
  } catch (...) {
    release_table(table, device);
    throw;
  }
  return table;
}

void release_table(std::uintptr_t table, int device) noexcept {
  try {
    DeviceScope scope(device);
    // the table may still be read by a launch queued on any stream of the device: wait for all of them first
    cudaDeviceSynchronize();
    cudaFree(reinterpret_cast<void*>(table));
  } catch (const std::exception&) {  // no device / runtime unloading: nothing left to free
  }
  cudaGetLastError();  // do not leave a sticky error for the caller's next CUDA call
}

void stream_synchronize(std::uintptr_t stream, int device) {
  DeviceScope scope(device);
  check(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

const char* error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace elan
