// Python bindings of the lightning_elan CUDA extension (module lightning_elan_cuda).
//
// Streams and devices come from Python as integers (torch.cuda.current_stream(d).cuda_stream, d.index), so this file
// needs only <torch/extension.h>, not the ATen CUDA headers: it compiles and links against a CPU build of torch too.
#include <torch/extension.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "elan_cuda.h"

namespace {

constexpr std::int64_t kDefaultChunkBytes = 1 << 16;

void check_pair(const at::Tensor& src, const at::Tensor& dst, const at::Device& device) {
  TORCH_CHECK(src.is_cuda() && dst.is_cuda(), "multi_tensor_copy: CUDA tensors only");
  TORCH_CHECK(src.device() == device && dst.device() == device, "multi_tensor_copy: all tensors on ", device);
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "multi_tensor_copy: contiguous tensors only");
  TORCH_CHECK(src.nbytes() == dst.nbytes(), "multi_tensor_copy: byte counts differ (", src.nbytes(), " vs ",
              dst.nbytes(), ")");
}

// dst[i] <- src[i] for every i (raw bytes), in one kernel launch on `stream` of the tensors' device.
void multi_tensor_copy(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts, std::int64_t stream,
                       std::int64_t chunk_bytes) {
  TORCH_CHECK(srcs.size() == dsts.size(), "multi_tensor_copy: ", srcs.size(), " sources for ", dsts.size(),
              " destinations");
  TORCH_CHECK(chunk_bytes > 0, "multi_tensor_copy: chunk_bytes must be positive");
  if (srcs.empty()) return;
  const int n = static_cast<int>(srcs.size());
  const at::Device device = srcs[0].device();
  auto meta = at::empty({4 * n + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::int64_t* m = meta.data_ptr<std::int64_t>();
  for (int i = 0; i < n; ++i) {
    check_pair(srcs[i], dsts[i], device);
    m[i] = reinterpret_cast<std::int64_t>(srcs[i].data_ptr());
    m[n + i] = reinterpret_cast<std::int64_t>(dsts[i].data_ptr());
    m[2 * n + i] = static_cast<std::int64_t>(srcs[i].nbytes());
  }
  const std::int64_t total = elan::chunk_prefix(m + 2 * n, n, chunk_bytes, m + 3 * n);
  if (total == 0) return;
  // the H2D copy runs on torch's current stream of `device`, which is the `stream` the caller passes
  at::Tensor device_meta = meta.to(device, /*non_blocking=*/true);
  const int error = elan::launch_multi_tensor_copy(device_meta.data_ptr<std::int64_t>(), n, total, chunk_bytes,
                                                   device.index(), static_cast<std::uintptr_t>(stream));
  TORCH_CHECK(error == 0, "multi_tensor_copy launch failed: ", elan::error_string(error));
}

// A uint8 CUDA tensor over its own cudaMalloc allocation (so cudaIpcGetMemHandle of its data_ptr is valid).
at::Tensor alloc_shareable(std::int64_t nbytes, std::int64_t device) {
  TORCH_CHECK(nbytes >= 0, "alloc_shareable: negative size");
  const int dev = static_cast<int>(device);
  const std::uintptr_t ptr = elan::device_malloc(static_cast<std::size_t>(nbytes), dev);
  auto deleter = [dev](void* p) {
    try {
      elan::device_free(reinterpret_cast<std::uintptr_t>(p), dev);
    } catch (const std::exception&) {  // never throw from a deleter (process teardown)
    }
  };
  return torch::from_blob(reinterpret_cast<void*>(ptr), {nbytes}, deleter,
                          at::TensorOptions().dtype(at::kByte).device(at::kCUDA, dev));
}

py::bytes ipc_get_handle(std::uintptr_t base, int device) { return py::bytes(elan::ipc_get_handle(base, device)); }

std::uintptr_t ipc_open(const py::bytes& handle, int device) { return elan::ipc_open(std::string(handle), device); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning_elan CUDA extension: multi-tensor copy, CUDA IPC, topology queries";
  m.def("multi_tensor_copy", &multi_tensor_copy, py::arg("srcs"), py::arg("dsts"), py::arg("stream"),
        py::arg("chunk_bytes") = kDefaultChunkBytes);
  m.def("alloc_shareable", &alloc_shareable, py::arg("nbytes"), py::arg("device"));
  m.def("ipc_get_handle", &ipc_get_handle, py::arg("base"), py::arg("device"));
  m.def("ipc_open", &ipc_open, py::arg("handle"), py::arg("device"));
  m.def("ipc_close", &elan::ipc_close, py::arg("ptr"), py::arg("device"));
  m.def("memcpy_async", &elan::memcpy_async, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("device"),
        py::arg("stream"));
  m.def("stream_synchronize", &elan::stream_synchronize, py::arg("stream"), py::arg("device"));
  m.def("device_count", &elan::device_count);
  m.def("pci_bus_id", &elan::pci_bus_id, py::arg("device"));
  m.def("can_access_peer", &elan::can_access_peer, py::arg("device"), py::arg("peer"));
}
