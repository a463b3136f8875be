// lightning_elan CUDA extension: multi-tensor copy, CUDA IPC and topology queries.
//
// Only this header and the CUDA runtime are shared between the translation units: the kernel file and the runtime
// file do not include torch headers (fast nvcc compile, buildable without a CUDA build of torch); bindings.cpp is the
// only file that includes <torch/extension.h>.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace elan {

// ---- multi-tensor copy (multi_tensor_copy.cu) ----------------------------------------------------------------------
//
// Copies ntasks byte ranges in ONE kernel launch. `device_meta` is a device array of int64:
//   [0, n)        source addresses
//   [n, 2n)       destination addresses
//   [2n, 3n)      byte counts
//   [3n, 4n + 1)  chunk prefix: task t owns chunks [prefix[t], prefix[t + 1]) of `chunk_bytes` bytes each
// Any alignment is accepted; the widest word (16/8/4/2/1 bytes) that both ends share is used.
// Returns the launch error, cudaSuccess when there is nothing to copy.
int launch_multi_tensor_copy(const std::int64_t* device_meta, int ntasks, std::int64_t total_chunks,
                             std::int64_t chunk_bytes, int device, std::uintptr_t stream);

// Host-side helper: fills `prefix` (ntasks + 1 entries) from the byte counts; returns the total number of chunks.
std::int64_t chunk_prefix(const std::int64_t* nbytes, int ntasks, std::int64_t chunk_bytes, std::int64_t* prefix);

// ---- runtime: devices, raw memory, IPC (runtime.cpp); all throw std::runtime_error on a CUDA error ------------------
int device_count();                                   // 0 when there is no driver or no device (never throws)
std::string pci_bus_id(int device);                   // "0000:3b:00.0" (lower case, sysfs form)
bool can_access_peer(int device, int peer);           // cudaDeviceCanAccessPeer
std::uintptr_t device_malloc(std::size_t nbytes, int device);  // cudaMalloc: an allocation base, IPC-exportable
void device_free(std::uintptr_t ptr, int device);
std::string ipc_get_handle(std::uintptr_t base, int device);     // 64-byte cudaIpcMemHandle_t
std::uintptr_t ipc_open(const std::string& handle, int device);  // cudaIpcOpenMemHandle (lazy peer access)
void ipc_close(std::uintptr_t ptr, int device);
void memcpy_async(std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, int device, std::uintptr_t stream);
// A device copy of `count` int64 from host memory (cudaMalloc + a synchronous cudaMemcpy): the table of a prepared
// copy plan, built once. Freed by release_table.
std::uintptr_t upload_table(const std::int64_t* host, std::size_t count, int device);
// Waits for the device (a launch still reading the table may be queued on any stream), then frees; never throws
// (called from destructors, possibly at interpreter teardown when the CUDA runtime is already unloading).
void release_table(std::uintptr_t table, int device) noexcept;
void stream_synchronize(std::uintptr_t stream, int device);
const char* error_string(int error);

}  // namespace elan
