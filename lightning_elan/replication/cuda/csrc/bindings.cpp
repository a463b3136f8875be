// Python bindings of the lightning_elan CUDA extension (module lightning_elan_cuda).
//
// Streams and devices come from Python as integers (torch.cuda.current_stream(d).cuda_stream, d.index), so this file
// needs only <torch/extension.h>, not the ATen CUDA headers: it compiles and links against a CPU build of torch too.
//
// Copies come in two forms, both one kernel launch per CUDA device:
// * per call (copy_pairs, pack_into, unpack_into): eligibility checks and byte offsets in C++, the kernel's table
//   uploaded through a pinned buffer; the indices the kernel cannot take are returned for a copy_ in Python;
// * prepared (prepare_pairs, prepare_pack, prepare_unpack -> CopyPlan): the same checks once, the table uploaded
//   once into its own device allocation; CopyPlan.run is a launch per device and nothing else.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "elan_cuda.h"

// Error messages are built without iostreams. On the H100 image (torch 2.11) this module carried its own copy of
// libstdc++'s stream code, and formatting a number through an ostream (c10::str, TORCH_CHECK with an integer argument)
// crashed with SIGSEGV in codecvt: the stream used the process's locale facets with the module's stream code.
// std::to_string and string concatenation do not touch locales. ValueError is pybind11's own type (no translator).
#define ELAN_CHECK_VALUE(cond, ...)                                   \
  do {                                                                \
    if (!(cond)) throw py::value_error(elan_message(__VA_ARGS__));    \
  } while (false)
#define ELAN_CHECK(cond, ...)                                         \
  do {                                                                \
    if (!(cond)) throw std::runtime_error(elan_message(__VA_ARGS__)); \
  } while (false)

namespace {

std::string message_part(const std::string& s) { return s; }
std::string message_part(const char* s) { return s; }
std::string message_part(at::ScalarType dtype) { return c10::toString(dtype); }
std::string message_part(at::IntArrayRef shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
std::string message_part(T value) {
  return std::to_string(value);
}

}  // namespace

template <typename... Args>
std::string elan_message(const Args&... args) {
  std::string out;
  (out.append(message_part(args)), ...);
  return out;
}

namespace {

constexpr std::int64_t kDefaultChunkBytes = 1 << 16;

using StreamFor = std::function<std::int64_t(int)>;  // device index -> cudaStream_t as an integer

// ---- which tensors the kernel may copy ------------------------------------------------------------------------------

// The kernel copies raw bytes, so it takes only tensors whose memory holds exactly their logical elements in order:
// CUDA, strided, contiguous, and not a lazily conjugated/negated view (torch leaves those bits unresolved in memory;
// copy_ resolves them). The layout test comes first: is_contiguous() throws on sparse tensors.
bool raw_bytes_ok(const at::Tensor& t) {
  return t.defined() && t.is_cuda() && t.layout() == at::kStrided && t.is_contiguous() && !t.is_conj() &&
         !t.is_neg();
}

// A destination must also accept an in-place write outside autograd's view: inference tensors cannot have their
// version counter bumped outside InferenceMode (copy_ raises the proper error for them on the fallback).
bool writable_ok(const at::Tensor& t) { return raw_bytes_ok(t) && !t.is_inference(); }

// In-place writes through a raw pointer bypass autograd's version counter; bump it as copy_ would, so that a graph
// that saved the destination still detects the modification.
void bump_version(const at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

std::int64_t address(const at::Tensor& t, std::int64_t byte_offset = 0) {
  return static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(t.data_ptr())) + byte_offset;
}

// ---- byte ranges grouped by device, and the kernel's table ----------------------------------------------------------

struct DeviceTasks {
  int device = 0;
  std::vector<std::int64_t> src, dst, nbytes;
};

class Tasks {
 public:
  void add(int device, std::int64_t src, std::int64_t dst, std::int64_t nbytes) {
    DeviceTasks& g = group(device);
    g.src.push_back(src);
    g.dst.push_back(dst);
    g.nbytes.push_back(nbytes);
    total_bytes_ += nbytes;
  }
  const std::vector<DeviceTasks>& groups() const { return groups_; }
  std::int64_t total_bytes() const { return total_bytes_; }
  std::int64_t count() const {
    std::int64_t n = 0;
    for (const DeviceTasks& g : groups_) n += static_cast<std::int64_t>(g.src.size());
    return n;
  }

 private:
  DeviceTasks& group(int device) {  // a process has one or two devices: a linear scan is the fastest lookup
    for (DeviceTasks& g : groups_) {
      if (g.device == device) return g;
    }
    groups_.push_back(DeviceTasks{device, {}, {}, {}});
    return groups_.back();
  }
  std::vector<DeviceTasks> groups_;
  std::int64_t total_bytes_ = 0;
};

// The table layout documented in elan_cuda.h: sources, destinations, byte counts, chunk prefix.
std::vector<std::int64_t> kernel_table(const DeviceTasks& g, std::int64_t chunk_bytes, std::int64_t* total_chunks) {
  const std::size_t n = g.src.size();
  std::vector<std::int64_t> table(4 * n + 1);
  std::copy(g.src.begin(), g.src.end(), table.begin());
  std::copy(g.dst.begin(), g.dst.end(), table.begin() + static_cast<std::ptrdiff_t>(n));
  std::copy(g.nbytes.begin(), g.nbytes.end(), table.begin() + static_cast<std::ptrdiff_t>(2 * n));
  *total_chunks = elan::chunk_prefix(table.data() + 2 * n, static_cast<int>(n), chunk_bytes, table.data() + 3 * n);
  return table;
}

void check_launch(int error) { ELAN_CHECK(error == 0, "multi_tensor_copy launch failed: ", elan::error_string(error)); }

void check_chunk(std::int64_t chunk_bytes) {
  ELAN_CHECK(chunk_bytes >= 16 && chunk_bytes % 16 == 0, "chunk_bytes must be a positive multiple of 16, got ",
              chunk_bytes);
}

// One launch per device now, each on stream_for(device). The table goes through a pinned host tensor and a
// non_blocking H2D copy: torch issues that copy on its current stream of the device (which stream_for returns) and
// records an event on the pinned block so the host allocator does not hand it out before the copy ran. The device
// table comes from the caching allocator for that same stream, so releasing it on return is stream-ordered: a later
// allocation reusing it is queued behind this launch.
void launch_now(const Tasks& tasks, const StreamFor& stream_for, std::int64_t chunk_bytes) {
  for (const DeviceTasks& g : tasks.groups()) {
    std::int64_t total_chunks = 0;
    const std::vector<std::int64_t> table = kernel_table(g, chunk_bytes, &total_chunks);
    if (total_chunks == 0) continue;
    const std::int64_t stream = stream_for(g.device);
    at::Tensor pinned =
        at::empty({static_cast<std::int64_t>(table.size())}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(pinned.data_ptr(), table.data(), table.size() * sizeof(std::int64_t));
    const at::Tensor device_table =
        pinned.to(at::TensorOptions().dtype(at::kLong).device(at::kCUDA, g.device), /*non_blocking=*/true);
    check_launch(elan::launch_multi_tensor_copy(device_table.data_ptr<std::int64_t>(), static_cast<int>(g.src.size()),
                                                total_chunks, chunk_bytes, g.device,
                                                static_cast<std::uintptr_t>(stream)));
  }
}

// ---- what to copy: pairs, or tensors <-> slices of packed buffers ---------------------------------------------------

struct Resolved {
  Tasks tasks;
  std::vector<std::int64_t> fallback;  // indices the caller copies with copy_
  std::vector<at::Tensor> written;     // destinations of the kernel's tasks (version bumps)
  std::vector<at::Tensor> read;        // sources of the kernel's tasks (kept alive by a plan)
};

bool pair_ok(const at::Tensor& src, const at::Tensor& dst) {
  return raw_bytes_ok(src) && writable_ok(dst) && src.device() == dst.device() &&
         src.scalar_type() == dst.scalar_type() && src.sizes().equals(dst.sizes());
}

Resolved resolve_pairs(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts) {
  ELAN_CHECK_VALUE(srcs.size() == dsts.size(), "multi_tensor_copy: ", srcs.size(), " sources for ", dsts.size(),
                    " destinations");
  Resolved r;
  for (std::size_t i = 0; i < srcs.size(); ++i) {
    if (!pair_ok(srcs[i], dsts[i])) {
      r.fallback.push_back(static_cast<std::int64_t>(i));
      continue;
    }
    const std::int64_t nbytes = static_cast<std::int64_t>(srcs[i].nbytes());
    if (nbytes == 0) continue;  // nothing to copy (and data_ptr may be null)
    r.tasks.add(dsts[i].get_device(), address(srcs[i]), address(dsts[i]), nbytes);
    r.read.push_back(srcs[i]);
    r.written.push_back(dsts[i]);
  }
  return r;
}

// Where each tensor of a PackedLayout lives, in bytes; built once per layout (cuda_ext caches it).
struct LayoutIndex {
  std::vector<std::int64_t> key;          // index into the buffer list (buffers sorted by key)
  std::vector<std::int64_t> byte_offset;  // spec.offset * itemsize
  std::vector<std::int64_t> nbytes;       // spec.numel * itemsize
  std::vector<at::ScalarType> dtype;
  std::vector<std::vector<std::int64_t>> shape;
  std::int64_t nkeys = 0;

  std::size_t size() const { return key.size(); }
};

std::shared_ptr<LayoutIndex> make_index(std::vector<std::int64_t> key, std::vector<std::int64_t> byte_offset,
                                        std::vector<std::int64_t> nbytes, std::vector<at::ScalarType> dtype,
                                        std::vector<std::vector<std::int64_t>> shape, std::int64_t nkeys) {
  const std::size_t n = key.size();
  ELAN_CHECK_VALUE(byte_offset.size() == n && nbytes.size() == n && dtype.size() == n && shape.size() == n,
                    "LayoutIndex: per-tensor lists of different lengths");
  for (std::size_t i = 0; i < n; ++i) {
    ELAN_CHECK_VALUE(key[i] >= 0 && key[i] < nkeys, "LayoutIndex: key index ", key[i], " out of range");
    ELAN_CHECK_VALUE(byte_offset[i] >= 0 && nbytes[i] >= 0, "LayoutIndex: negative offset or size");
  }
  auto index = std::make_shared<LayoutIndex>();
  index->key = std::move(key);
  index->byte_offset = std::move(byte_offset);
  index->nbytes = std::move(nbytes);
  index->dtype = std::move(dtype);
  index->shape = std::move(shape);
  index->nkeys = nkeys;
  return index;
}

enum class Direction { kPack, kUnpack };  // tensors -> buffers, buffers -> tensors

// unpack_into's contract: every target has its spec's shape and dtype (checked before anything is copied).
void check_target(const at::Tensor& t, const LayoutIndex& index, std::size_t i) {
  ELAN_CHECK_VALUE(t.defined() && t.sizes().equals(index.shape[i]) && t.scalar_type() == index.dtype[i], "target ",
                    i, " ", (t.defined() ? t.sizes() : at::IntArrayRef{}), "/",
                    (t.defined() ? t.scalar_type() : at::ScalarType::Undefined), " does not match ",
                    at::IntArrayRef(index.shape[i]), "/", index.dtype[i]);
}

bool packed_ok(const at::Tensor& t, const at::Tensor& buf, bool buf_ok, const LayoutIndex& index, std::size_t i,
               Direction direction) {
  const bool t_ok = direction == Direction::kPack ? raw_bytes_ok(t) : writable_ok(t);
  return buf_ok && t_ok && t.device() == buf.device() && t.scalar_type() == buf.scalar_type() &&
         static_cast<std::int64_t>(t.nbytes()) == index.nbytes[i] &&
         index.byte_offset[i] + index.nbytes[i] <= static_cast<std::int64_t>(buf.nbytes());
}

Resolved resolve_packed(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& buffers,
                        const LayoutIndex& index, Direction direction) {
  ELAN_CHECK_VALUE(tensors.size() == index.size(), tensors.size(), " tensors for ", index.size(), " packed tensors");
  ELAN_CHECK_VALUE(static_cast<std::int64_t>(buffers.size()) == index.nkeys, buffers.size(), " buffers for ",
                    index.nkeys, " keys");
  if (direction == Direction::kUnpack) {
    for (std::size_t i = 0; i < tensors.size(); ++i) check_target(tensors[i], index, i);
  }
  std::vector<bool> buf_ok(buffers.size());
  for (std::size_t k = 0; k < buffers.size(); ++k) {
    buf_ok[k] = direction == Direction::kPack ? writable_ok(buffers[k]) : raw_bytes_ok(buffers[k]);
  }
  Resolved r;
  std::vector<bool> buf_used(buffers.size(), false);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const auto k = static_cast<std::size_t>(index.key[i]);
    const at::Tensor& buf = buffers[k];
    if (index.nbytes[i] == 0 && t.defined() && t.numel() == 0) continue;  // nothing to copy
    if (!t.defined() || !packed_ok(t, buf, buf_ok[k], index, i, direction)) {
      r.fallback.push_back(static_cast<std::int64_t>(i));
      continue;
    }
    const std::int64_t slice = address(buf, index.byte_offset[i]);
    const bool pack = direction == Direction::kPack;
    r.tasks.add(t.get_device(), pack ? address(t) : slice, pack ? slice : address(t), index.nbytes[i]);
    (pack ? r.read : r.written).push_back(t);
    buf_used[k] = true;
  }
  for (std::size_t k = 0; k < buffers.size(); ++k) {
    if (buf_used[k]) (direction == Direction::kPack ? r.written : r.read).push_back(buffers[k]);
  }
  return r;
}

StreamFor python_streams(const py::object& current_stream) {
  return [&current_stream](int device) { return current_stream(device).cast<std::int64_t>(); };
}

std::vector<std::int64_t> run_resolved(Resolved r, const py::object& current_stream, std::int64_t chunk_bytes) {
  check_chunk(chunk_bytes);
  launch_now(r.tasks, python_streams(current_stream), chunk_bytes);
  for (const at::Tensor& t : r.written) bump_version(t);
  return std::move(r.fallback);
}

// dst[i] <- src[i] (raw bytes) for the pairs the kernel takes; returns the indices of the others.
std::vector<std::int64_t> copy_pairs(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                                     const py::object& current_stream, std::int64_t chunk_bytes) {
  return run_resolved(resolve_pairs(srcs, dsts), current_stream, chunk_bytes);
}

std::vector<std::int64_t> pack_into(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& buffers,
                                    const LayoutIndex& index, const py::object& current_stream,
                                    std::int64_t chunk_bytes) {
  return run_resolved(resolve_packed(tensors, buffers, index, Direction::kPack), current_stream, chunk_bytes);
}

std::vector<std::int64_t> unpack_into(const std::vector<at::Tensor>& buffers, const LayoutIndex& index,
                                      const std::vector<at::Tensor>& targets, const py::object& current_stream,
                                      std::int64_t chunk_bytes) {
  return run_resolved(resolve_packed(targets, buffers, index, Direction::kUnpack), current_stream, chunk_bytes);
}

// Strict form kept from the first version of the extension: every pair must be eligible, all on one device.
void multi_tensor_copy(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts, std::int64_t stream,
                       std::int64_t chunk_bytes) {
  Resolved r = resolve_pairs(srcs, dsts);
  ELAN_CHECK(r.fallback.empty(), "multi_tensor_copy: pair ", r.fallback.empty() ? 0 : r.fallback.front(),
              " is not two contiguous CUDA tensors of one device, dtype and shape");
  ELAN_CHECK(r.tasks.groups().size() <= 1, "multi_tensor_copy: all tensors must be on one device");
  check_chunk(chunk_bytes);
  launch_now(r.tasks, [stream](int) { return stream; }, chunk_bytes);
  for (const at::Tensor& t : r.written) bump_version(t);
}

// ---- prepared plans -------------------------------------------------------------------------------------------------

// A kernel table in its own device allocation (not the caching allocator: a plan may be run on any stream, and
// release_table waits for the device before freeing, so no stream bookkeeping is needed).
class DeviceTable {
 public:
  DeviceTable(const std::vector<std::int64_t>& table, int device)
      : device_(device), ptr_(elan::upload_table(table.data(), table.size(), device)) {}
  ~DeviceTable() {
    if (ptr_ != 0) elan::release_table(ptr_, device_);
  }
  DeviceTable(DeviceTable&& other) noexcept : device_(other.device_), ptr_(std::exchange(other.ptr_, 0)) {}
  DeviceTable(const DeviceTable&) = delete;
  DeviceTable& operator=(const DeviceTable&) = delete;
  DeviceTable& operator=(DeviceTable&&) = delete;
  const std::int64_t* data() const { return reinterpret_cast<const std::int64_t*>(ptr_); }

 private:
  int device_;
  std::uintptr_t ptr_;
};

struct PlannedLaunch {
  int device;
  int ntasks;
  std::int64_t chunks;
  DeviceTable table;
};

class CopyPlan {
 public:
  CopyPlan(Resolved r, std::int64_t chunk_bytes)
      : chunk_bytes_(chunk_bytes),
        fallback_(std::move(r.fallback)),
        written_(std::move(r.written)),
        read_(std::move(r.read)),
        nbytes_(r.tasks.total_bytes()),
        ntasks_(r.tasks.count()) {
    check_chunk(chunk_bytes);
    for (const DeviceTasks& g : r.tasks.groups()) {
      std::int64_t chunks = 0;
      const std::vector<std::int64_t> table = kernel_table(g, chunk_bytes, &chunks);
      if (chunks == 0) continue;
      launches_.push_back(PlannedLaunch{g.device, static_cast<int>(g.src.size()), chunks, DeviceTable(table, g.device)});
    }
    for (const std::vector<at::Tensor>* group : {&written_, &read_}) {
      for (const at::Tensor& t : *group) addresses_.push_back(t.data_ptr());
    }
  }

  CopyPlan(const CopyPlan&) = delete;  // owns device tables
  CopyPlan& operator=(const CopyPlan&) = delete;

  // One launch per device on streams[i] (aligned with devices()). With check, first verifies that no tensor of the
  // plan got new storage (`p.data = ...`, `set_`): the table holds raw addresses, and a moved tensor would be
  // silently missed. The plan holds references, so the old storage is alive either way.
  void run(const std::vector<std::int64_t>& streams, bool check) const {
    ELAN_CHECK_VALUE(streams.size() == launches_.size(), "CopyPlan.run: ", streams.size(), " streams for ",
                      launches_.size(), " devices");
    if (check) ELAN_CHECK(!stale(), "CopyPlan: a tensor of the plan has new storage; prepare a new plan");
    for (std::size_t i = 0; i < launches_.size(); ++i) {
      const PlannedLaunch& l = launches_[i];
      check_launch(elan::launch_multi_tensor_copy(l.table.data(), l.ntasks, l.chunks, chunk_bytes_, l.device,
                                                  static_cast<std::uintptr_t>(streams[i])));
    }
    for (const at::Tensor& t : written_) bump_version(t);
  }

  bool stale() const {
    std::size_t i = 0;
    for (const std::vector<at::Tensor>* group : {&written_, &read_}) {
      for (const at::Tensor& t : *group) {
        if (t.data_ptr() != addresses_[i++]) return true;
      }
    }
    return false;
  }

  std::vector<int> devices() const {
    std::vector<int> out;
    for (const PlannedLaunch& l : launches_) out.push_back(l.device);
    return out;
  }
  const std::vector<std::int64_t>& fallback() const { return fallback_; }
  std::int64_t nbytes() const { return nbytes_; }
  std::int64_t ntasks() const { return ntasks_; }
  std::int64_t nchunks() const {
    std::int64_t n = 0;
    for (const PlannedLaunch& l : launches_) n += l.chunks;
    return n;
  }
  std::int64_t chunk_bytes() const { return chunk_bytes_; }

 private:
  std::int64_t chunk_bytes_;
  std::vector<std::int64_t> fallback_;
  std::vector<at::Tensor> written_;
  std::vector<at::Tensor> read_;
  std::int64_t nbytes_;
  std::int64_t ntasks_;
  std::vector<const void*> addresses_;  // data_ptr of written_ then read_, when prepared
  std::vector<PlannedLaunch> launches_;
};

std::unique_ptr<CopyPlan> prepare_pairs(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                                        std::int64_t chunk_bytes) {
  return std::make_unique<CopyPlan>(resolve_pairs(srcs, dsts), chunk_bytes);
}

std::unique_ptr<CopyPlan> prepare_pack(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& buffers,
                                       const LayoutIndex& index, std::int64_t chunk_bytes) {
  return std::make_unique<CopyPlan>(resolve_packed(tensors, buffers, index, Direction::kPack), chunk_bytes);
}

std::unique_ptr<CopyPlan> prepare_unpack(const std::vector<at::Tensor>& buffers, const LayoutIndex& index,
                                         const std::vector<at::Tensor>& targets, std::int64_t chunk_bytes) {
  return std::make_unique<CopyPlan>(resolve_packed(targets, buffers, index, Direction::kUnpack), chunk_bytes);
}

// ---- raw allocations and IPC ----------------------------------------------------------------------------------------

// A uint8 CUDA tensor over its own cudaMalloc allocation (so cudaIpcGetMemHandle of its data_ptr is valid).
at::Tensor alloc_shareable(std::int64_t nbytes, std::int64_t device) {
  ELAN_CHECK(nbytes >= 0, "alloc_shareable: negative size");
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
  m.attr("DEFAULT_CHUNK_BYTES") = kDefaultChunkBytes;

  py::class_<LayoutIndex, std::shared_ptr<LayoutIndex>>(m, "LayoutIndex")
      .def(py::init(&make_index), py::arg("key"), py::arg("byte_offset"), py::arg("nbytes"), py::arg("dtype"),
           py::arg("shape"), py::arg("nkeys"))
      .def("__len__", &LayoutIndex::size);

  py::class_<CopyPlan>(m, "CopyPlan")
      .def("run", &CopyPlan::run, py::arg("streams"), py::arg("check") = true)
      .def("stale", &CopyPlan::stale)
      .def_property_readonly("devices", &CopyPlan::devices)
      .def_property_readonly("fallback", &CopyPlan::fallback)
      .def_property_readonly("nbytes", &CopyPlan::nbytes)
      .def_property_readonly("ntasks", &CopyPlan::ntasks)
      .def_property_readonly("nchunks", &CopyPlan::nchunks)
      .def_property_readonly("chunk_bytes", &CopyPlan::chunk_bytes);

  m.def("copy_pairs", &copy_pairs, py::arg("srcs"), py::arg("dsts"), py::arg("current_stream"),
        py::arg("chunk_bytes") = kDefaultChunkBytes);
  m.def("pack_into", &pack_into, py::arg("tensors"), py::arg("buffers"), py::arg("index"), py::arg("current_stream"),
        py::arg("chunk_bytes") = kDefaultChunkBytes);
  m.def("unpack_into", &unpack_into, py::arg("buffers"), py::arg("index"), py::arg("targets"),
        py::arg("current_stream"), py::arg("chunk_bytes") = kDefaultChunkBytes);
  m.def("prepare_pairs", &prepare_pairs, py::arg("srcs"), py::arg("dsts"), py::arg("chunk_bytes") = kDefaultChunkBytes);
  m.def("prepare_pack", &prepare_pack, py::arg("tensors"), py::arg("buffers"), py::arg("index"),
        py::arg("chunk_bytes") = kDefaultChunkBytes);
  m.def("prepare_unpack", &prepare_unpack, py::arg("buffers"), py::arg("index"), py::arg("targets"),
        py::arg("chunk_bytes") = kDefaultChunkBytes);
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
