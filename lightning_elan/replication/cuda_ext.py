"""The optional CUDA extension (``csrc/``) and its pure-torch fallback, behind one API.

What the extension does (and what the fallback does instead):

* :func:`pack` / :func:`pack_into`: one kernel launch copies every CUDA tensor into its slice of the per-dtype
  buffers (fallback: :func:`lightning_elan.replication.packing.pack`, ``torch.cat`` / ``copy_``);
* :func:`unpack_into`: one launch copies the buffer slices into existing tensors (fallback: ``copy_`` per tensor);
  per call, the checks and byte offsets run in C++ (tens of microseconds of host time for ~600 tensors);
* :func:`prepare_copy` / :func:`prepare_pack` / :func:`prepare_unpack`: a :class:`CopyPlan` for fixed tensors
  (parameters, optimizer state), checked and with its kernel table uploaded once; ``plan.run()`` is one launch per
  device and no other work (fallback: the same ``copy_`` calls, their slices computed once);
* :func:`ipc_export` / :func:`ipc_open`: ``cudaIpcGetMemHandle`` of a raw ``cudaMalloc``, ``cudaIpcOpenMemHandle``
  and async memcpys (fallback: ``torch.multiprocessing`` CUDA reductions and ``copy_``);
* :func:`pci_bus_id` / :func:`can_access_peer`: ``cudaDeviceGetPCIBusId`` / ``cudaDeviceCanAccessPeer`` (fallback:
  ``torch.cuda.get_device_properties`` / ``torch.cuda.can_device_access_peer``).

Both paths produce the same bytes and the same :class:`~lightning_elan.replication.packing.PackedLayout` (the
contract the unit and GPU tests check). :func:`load` finds the module: a build in ``$LIGHTNING_ELAN_CUDA_EXT_DIR``,
``csrc/build`` or ``~/.cache/lightning_elan/cuda_ext`` that matches the sources and this torch, or ``import
lightning_elan_cuda``; with ``LIGHTNING_ELAN_BUILD_CUDA_EXT=1`` (or ``load(build=True)``) it compiles one first
(``csrc/build.py``, about a minute). Without a GPU, a CUDA toolkit or a build it logs why, once, and the fallback
runs. ``LIGHTNING_ELAN_NO_CUDA_EXT=1`` disables the extension.

Build ahead of time: ``python csrc/build.py`` (or ``python -m lightning_elan.replication.cuda_ext --build``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from lightning_elan.replication import packing
from lightning_elan.replication.packing import PackedLayout, TensorSpec, dtype_from_str, make_layout

log = logging.getLogger(__name__)

__all__ = [
    "ARENA_ALIGN",
    "ArenaLayout",
    "CopyPlan",
    "IpcHandle",
    "IpcMapping",
    "alloc_shareable",
    "arena_layout",
    "arena_views",
    "available",
    "can_access_peer",
    "ipc_export",
    "ipc_open",
    "load",
    "multi_tensor_copy",
    "pack",
    "pack_into",
    "pci_bus_id",
    "prepare_copy",
    "prepare_pack",
    "prepare_unpack",
    "status",
    "unpack_into",
]

MODULE_NAME = "lightning_elan_cuda"
ENV_BUILD = "LIGHTNING_ELAN_BUILD_CUDA_EXT"
ENV_DISABLE = "LIGHTNING_ELAN_NO_CUDA_EXT"
ENV_DIR = "LIGHTNING_ELAN_CUDA_EXT_DIR"
CSRC = Path(__file__).resolve().parents[2] / "csrc"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_elan" / "cuda_ext"
ARENA_ALIGN = 256  # bytes: every dtype buffer of an arena starts on this boundary

_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "module": None, "reason": None}
_shareable: dict[int, int] = {}  # data_ptr -> device index of live alloc_shareable() allocations


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------


def load(build: bool | None = None) -> ModuleType | None:
    """The extension module, or None (the reason is in :func:`status`). Tried once per process."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            module, reason = _find(_env_flag(ENV_BUILD) if build is None else build)
            _state["module"], _state["reason"] = module, reason
            if module is None:
                log.info("CUDA extension not used (%s); replication uses the pure-torch path", reason)
            else:
                log.info("CUDA extension loaded from %s", getattr(module, "__file__", MODULE_NAME))
        return _state["module"]


def available() -> bool:
    return load() is not None


def status() -> str:
    """One line: where the extension was loaded from, or why it is not used."""
    module = load()
    if module is not None:
        return f"loaded from {getattr(module, '__file__', MODULE_NAME)}"
    return str(_state["reason"])


def _reset_for_tests() -> None:
    with _lock:
        _state.update(tried=False, module=None, reason=None)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _find(build: bool) -> tuple[ModuleType | None, str | None]:
    if _env_flag(ENV_DISABLE):
        return None, f"disabled by {ENV_DISABLE}"
    if torch.version.cuda is None:
        return None, "this torch is a CPU-only build"
    if not torch.cuda.is_available():
        return None, "no CUDA device visible (torch.cuda.is_available() is False)"
    for directory in _search_dirs():
        module = _import_built(directory)
        if module is not None:
            return module, None
    try:
        return importlib.import_module(MODULE_NAME), None
    except ImportError:
        pass
    if not build:
        return None, f"not built: run `python {CSRC / 'build.py'}` or set {ENV_BUILD}=1"
    return _build_and_import()


def _search_dirs() -> list[Path]:
    dirs = [Path(os.environ[ENV_DIR])] if os.environ.get(ENV_DIR) else []
    return [*dirs, CSRC / "build", CACHE_DIR]


@functools.cache
def _build_module() -> ModuleType | None:
    """``csrc/build.py`` loaded as a module (it is not part of the installed package)."""
    path = CSRC / "build.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("lightning_elan_csrc_build", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def _import_built(directory: Path) -> ModuleType | None:
    """The module built in ``directory`` if it matches the sources, this torch and this GPU's architecture."""
    builder = _build_module()
    if builder is None or not builder.is_current(directory):
        return None
    stamp = builder.read_stamp(directory) or {}
    if not _arch_runs_here(stamp.get("archs") or []):
        log.info("the build in %s is for SM %s, not this GPU; ignored", directory, stamp.get("archs"))
        return None
    return _import_file(directory / builder.module_filename())


def _arch_runs_here(archs: list[str]) -> bool:
    """SASS for this GPU's capability, or PTX (built for the highest arch) that it can JIT-compile."""
    major, minor = torch.cuda.get_device_capability()
    capability = major * 10 + minor
    numbers = [int(arch) for arch in archs if str(arch).isdigit()]
    return capability in numbers or (bool(numbers) and max(numbers) <= capability)


def _import_file(path: Path) -> ModuleType | None:
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError) as error:
        log.warning("could not import the CUDA extension at %s: %s", path, error)
        return None
    sys.modules[MODULE_NAME] = module
    return module


def _build_and_import() -> tuple[ModuleType | None, str | None]:
    builder = _build_module()
    if builder is None:
        return None, f"csrc/ sources not found next to the package ({CSRC}): install from a source checkout"
    out = Path(os.environ.get(ENV_DIR) or CACHE_DIR)
    log.info("building the CUDA extension into %s (about a minute, once)", out)
    try:
        path = builder.build(out)
    except builder.BuildError as error:
        return None, f"build failed: {str(error).splitlines()[0]}"
    module = _import_file(path)
    return (module, None) if module is not None else (None, f"built {path} but could not import it")


# --------------------------------------------------------------------------------------------
# pack / unpack (contract: identical to packing.pack / packing.unpack)
# --------------------------------------------------------------------------------------------


def _current_stream(device_index: int) -> int:
    """Torch's current stream of a CUDA device as a raw ``cudaStream_t`` (where the extension launches, so that the
    copies are ordered with the caller's torch work exactly as ``copy_`` would be)."""
    return torch.cuda.current_stream(device_index).cuda_stream


def _module_for(buffers: dict[str, torch.Tensor], use_ext: bool | None) -> ModuleType | None:
    """The extension when it may run and some buffer is on a GPU (CPU-only buffers never reach the kernel)."""
    if use_ext is False or not any(b.is_cuda for b in buffers.values()):
        return None
    return load()


def multi_tensor_copy(srcs: list[torch.Tensor], dsts: list[torch.Tensor], *, use_ext: bool | None = None) -> bool:
    """``dsts[i].copy_(srcs[i])`` for all ``i`` (same shapes/bytes); True when the kernel took any pair.

    The kernel takes, in one launch per device, the pairs where both tensors are contiguous CUDA tensors of one device,
    dtype and shape (checked in C++); the other pairs (and everything, without the extension) use ``copy_``.
    """
    module = load() if use_ext is not False else None
    if module is None:
        for src, dst in zip(srcs, dsts, strict=True):
            dst.detach().copy_(src.detach())
        return False
    fallback = module.copy_pairs(srcs, dsts, _current_stream)
    for i in fallback:
        dsts[i].detach().copy_(srcs[i].detach())
    return len(fallback) < len(srcs)


def pack(tensors: list[torch.Tensor], *, use_ext: bool | None = None) -> tuple[dict[str, torch.Tensor], PackedLayout]:
    """Same result as :func:`packing.pack`; CUDA tensors go through one kernel launch when the extension is loaded."""
    if not (use_ext is not False and load() is not None and any(t.is_cuda for t in tensors)):
        return packing.pack(tensors)
    layout = make_layout(tensors)
    buffers: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}
    for spec, t in zip(layout.specs, tensors, strict=True):
        first.setdefault(spec.key, t)
    for key in sorted(first):
        buffers[key] = torch.empty(layout.buffer_numels[key], dtype=first[key].dtype, device=first[key].device)
    module = _module_for(buffers, use_ext)
    if module is None:
        _pack_by_copy(tensors, layout, buffers)
        return buffers, layout
    _pack_with(module, tensors, layout, buffers, _build_index(module, layout))  # a fresh layout: not worth caching
    return buffers, layout


def pack_into(
    tensors: list[torch.Tensor], layout: PackedLayout, buffers: dict[str, torch.Tensor], *, use_ext: bool | None = None
) -> None:
    """Copy ``tensors`` into the slices ``layout`` gives them in preallocated ``buffers`` (any devices).

    With the extension, the checks and offsets are computed in C++ (the layout's byte offsets once per layout) and the
    eligible tensors go in one launch per device; the rest (non-contiguous, CPU, other device) use ``copy_``.
    """
    module = _module_for(buffers, use_ext)
    if module is None:
        _pack_by_copy(tensors, layout, buffers)
        return
    _pack_with(module, tensors, layout, buffers, _layout_index(module, layout))


def unpack_into(
    buffers: dict[str, torch.Tensor],
    layout: PackedLayout,
    targets: list[torch.Tensor],
    *,
    use_ext: bool | None = None,
) -> None:
    """Copy each tensor of the packed state into the existing tensor at the same position of ``targets``.

    The in-place alternative to :func:`packing.unpack` (which returns views): e.g. straight into a model's parameters.
    Raises ValueError, before copying anything, when a target's shape or dtype differs from its spec.
    """
    if len(targets) != len(layout.specs):
        raise ValueError(f"{len(targets)} targets for {len(layout.specs)} packed tensors")
    module = _module_for(buffers, use_ext)
    if module is None:
        _check_targets(layout, targets)
        for spec, target in zip(layout.specs, targets, strict=True):
            target.detach().copy_(_slice(buffers[spec.key], spec))
        return
    index = _layout_index(module, layout)
    fallback = module.unpack_into([buffers[key] for key in index.keys], index.native, targets, _current_stream)
    for i in fallback:
        spec = layout.specs[i]
        targets[i].detach().copy_(_slice(buffers[spec.key], spec))


def _pack_by_copy(tensors: list[torch.Tensor], layout: PackedLayout, buffers: dict[str, torch.Tensor]) -> None:
    for spec, t in zip(layout.specs, tensors, strict=True):
        _slice(buffers[spec.key], spec).copy_(t.detach())


def _pack_with(
    module: ModuleType,
    tensors: list[torch.Tensor],
    layout: PackedLayout,
    buffers: dict[str, torch.Tensor],
    index: _Index,
) -> None:
    fallback = module.pack_into(tensors, [buffers[key] for key in index.keys], index.native, _current_stream)
    for i in fallback:
        spec = layout.specs[i]
        _slice(buffers[spec.key], spec).copy_(tensors[i].detach())


def _check_targets(layout: PackedLayout, targets: list[torch.Tensor]) -> None:
    for spec, target in zip(layout.specs, targets, strict=True):
        if tuple(target.shape) != spec.shape or str(target.dtype) != spec.dtype:
            raise ValueError(f"target {tuple(target.shape)}/{target.dtype} does not match {spec.shape}/{spec.dtype}")


def _slice(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    return buffer[spec.offset : spec.offset + spec.numel].view(spec.shape)


# --------------------------------------------------------------------------------------------
# the layout in bytes, for C++ (built once per PackedLayout)
# --------------------------------------------------------------------------------------------


@dataclass
class _Index:
    """A layout's per-tensor buffer position, byte offset, size, dtype and shape as a C++ ``LayoutIndex``."""

    specs: list[TensorSpec]  # the layout's list, to notice a layout whose specs were replaced
    count: int
    keys: list[str]  # buffer keys, sorted: the C++ side takes the buffers as a list in this order
    native: Any


_indexes: dict[int, _Index] = {}  # id(layout) -> index, dropped when the layout is collected


def _layout_index(module: ModuleType, layout: PackedLayout) -> _Index:
    """The cached index of ``layout`` (a layout is not modified once used: it describes buffers that exist)."""
    cached = _indexes.get(id(layout))
    if cached is not None and cached.specs is layout.specs and cached.count == len(layout.specs):
        return cached
    index = _build_index(module, layout)
    if id(layout) not in _indexes:
        weakref.finalize(layout, _indexes.pop, id(layout), None)
    _indexes[id(layout)] = index
    return index


def _build_index(module: ModuleType, layout: PackedLayout) -> _Index:
    specs = layout.specs
    keys = sorted({spec.key for spec in specs})
    position = {key: i for i, key in enumerate(keys)}
    dtypes = {name: dtype_from_str(name) for name in {spec.dtype for spec in specs}}
    itemsize = {name: dtype.itemsize for name, dtype in dtypes.items()}
    native = module.LayoutIndex(
        key=[position[spec.key] for spec in specs],
        byte_offset=[spec.offset * itemsize[spec.dtype] for spec in specs],
        nbytes=[spec.numel * itemsize[spec.dtype] for spec in specs],
        dtype=[dtypes[spec.dtype] for spec in specs],
        shape=[spec.shape for spec in specs],
        nkeys=len(keys),
    )
    return _Index(specs, len(specs), keys, native)


# --------------------------------------------------------------------------------------------
# prepared copies: checks, offsets and the kernel's table done once for fixed tensors
# --------------------------------------------------------------------------------------------


class CopyPlan:
    """A copy between fixed tensors prepared once; :meth:`run` repeats it (one kernel launch per device).

    Built by :func:`prepare_copy`, :func:`prepare_pack` or :func:`prepare_unpack`. The extension's part holds the
    device addresses of the tensors (and references keeping them alive); the pairs the kernel cannot take (and all
    pairs, without the extension) are kept as ``(src, dst)`` tensors and copied with ``copy_`` after the launch.
    Parameters and optimizer state keep their storage between adjustments, which is what makes a plan reusable;
    ``run(check=True)`` (the default, a few microseconds in C++) raises if one of the kernel's tensors got new storage.
    """

    def __init__(self, native: Any | None, fallback: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._native = native
        self._devices: list[int] = list(native.devices) if native is not None else []
        self._fallback = fallback

    @property
    def devices(self) -> list[int]:
        """CUDA device indices the plan launches on (empty without the extension)."""
        return list(self._devices)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel copies per run."""
        return int(self._native.nbytes) if self._native is not None else 0

    @property
    def ntasks(self) -> int:
        """Tensors the kernel copies per run (0-byte ones are skipped)."""
        return int(self._native.ntasks) if self._native is not None else 0

    @property
    def fallback_count(self) -> int:
        """Pairs copied with ``copy_`` per run."""
        return len(self._fallback)

    def run(self, stream: torch.cuda.Stream | None = None, *, check: bool = True) -> None:
        """Copy again: on ``stream`` (for its device) or torch's current stream of each device."""
        if self._native is not None:
            self._native.run(self._streams(stream), check)
        if self._fallback:
            with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                for src, dst in self._fallback:  # no_grad: in-place into leaves (parameters) like the kernel
                    dst.copy_(src)

    def _streams(self, stream: torch.cuda.Stream | None) -> list[int]:
        if stream is None:
            return [torch.cuda.current_stream(d).cuda_stream for d in self._devices]
        index = stream.device.index
        return [stream.cuda_stream if d == index else torch.cuda.current_stream(d).cuda_stream for d in self._devices]


def prepare_copy(
    srcs: list[torch.Tensor], dsts: list[torch.Tensor], *, use_ext: bool | None = None, chunk_bytes: int | None = None
) -> CopyPlan:
    """A plan for ``dsts[i].copy_(srcs[i])`` (see :func:`multi_tensor_copy`)."""
    module = load() if use_ext is not False else None
    if module is None:
        return CopyPlan(None, list(zip(srcs, dsts, strict=True)))
    native = module.prepare_pairs(srcs, dsts, chunk_bytes or module.DEFAULT_CHUNK_BYTES)
    return CopyPlan(native, [(srcs[i], dsts[i]) for i in native.fallback])


def prepare_pack(
    tensors: list[torch.Tensor],
    layout: PackedLayout,
    buffers: dict[str, torch.Tensor],
    *,
    use_ext: bool | None = None,
    chunk_bytes: int | None = None,
) -> CopyPlan:
    """A plan for :func:`pack_into` of these tensors into these buffers."""
    module = _module_for(buffers, use_ext)
    if module is None:
        pairs = [(t, _slice(buffers[spec.key], spec)) for spec, t in zip(layout.specs, tensors, strict=True)]
        return CopyPlan(None, pairs)
    index = _layout_index(module, layout)
    native = module.prepare_pack(
        tensors, [buffers[key] for key in index.keys], index.native, chunk_bytes or module.DEFAULT_CHUNK_BYTES
    )
    specs = layout.specs
    return CopyPlan(native, [(tensors[i], _slice(buffers[specs[i].key], specs[i])) for i in native.fallback])


def prepare_unpack(
    buffers: dict[str, torch.Tensor],
    layout: PackedLayout,
    targets: list[torch.Tensor],
    *,
    use_ext: bool | None = None,
    chunk_bytes: int | None = None,
) -> CopyPlan:
    """A plan for :func:`unpack_into` of these buffers into these targets (checked now: ValueError)."""
    if len(targets) != len(layout.specs):
        raise ValueError(f"{len(targets)} targets for {len(layout.specs)} packed tensors")
    module = _module_for(buffers, use_ext)
    if module is None:
        _check_targets(layout, targets)
        return CopyPlan(None, [(_slice(buffers[s.key], s), t) for s, t in zip(layout.specs, targets, strict=True)])
    index = _layout_index(module, layout)
    native = module.prepare_unpack(
        [buffers[key] for key in index.keys], index.native, targets, chunk_bytes or module.DEFAULT_CHUNK_BYTES
    )
    specs = layout.specs
    return CopyPlan(native, [(_slice(buffers[specs[i].key], specs[i]), targets[i]) for i in native.fallback])


# --------------------------------------------------------------------------------------------
# arenas: all buffers of a packed state in one byte allocation (one IPC handle, one shm segment)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArenaLayout:
    """Byte offset and size of each buffer key inside one arena of ``nbytes`` bytes."""

    offsets: dict[str, int]
    sizes: dict[str, int]
    nbytes: int


def arena_layout(layout: PackedLayout, keys: list[str] | None = None, align: int = ARENA_ALIGN) -> ArenaLayout:
    """Place the buffers of ``layout`` (or only ``keys``) one after another, sorted by key, each ``align``-aligned."""
    offsets: dict[str, int] = {}
    sizes: dict[str, int] = {}
    cursor = 0
    for key in sorted(layout.buffer_numels if keys is None else keys):
        _, dtype = _key_parts(key)
        cursor = -(-cursor // align) * align
        offsets[key] = cursor
        sizes[key] = layout.buffer_numels[key] * _element_size(dtype)
        cursor += sizes[key]
    return ArenaLayout(offsets, sizes, cursor)


def arena_views(arena: torch.Tensor, layout: PackedLayout, places: ArenaLayout) -> dict[str, torch.Tensor]:
    """Typed 1-D views of ``arena`` (uint8), one per buffer key of ``places``."""
    views = {}
    for key, offset in places.offsets.items():
        _, dtype = _key_parts(key)
        views[key] = arena[offset : offset + places.sizes[key]].view(dtype)
    return views


def _key_parts(key: str) -> tuple[str, torch.dtype]:
    device_type, _, dtype_name = key.rpartition(":")
    return device_type, dtype_from_str(dtype_name)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------------------------
# CUDA IPC
# --------------------------------------------------------------------------------------------


@dataclass
class IpcHandle:
    """A picklable reference to a CUDA allocation another process on this host can copy from."""

    kind: str  # "ext" (raw cudaIpcMemHandle_t) or "torch" (torch.multiprocessing reduction)
    payload: Any
    nbytes: int
    device_index: int  # the exporting process's device index
    bus_id: str | None = None  # the exporting GPU's PCI bus id (to find it under another numbering)


def alloc_shareable(nbytes: int, device: torch.device | str | int) -> torch.Tensor:
    """A uint8 CUDA tensor of ``nbytes`` that :func:`ipc_export` can share (its own ``cudaMalloc`` with the extension,
    a caching-allocator tensor without it)."""
    device = torch.device("cuda", _index(device))
    module = load()
    if module is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    tensor = module.alloc_shareable(nbytes, device.index)
    ptr = tensor.data_ptr()
    _shareable[ptr] = device.index
    weakref.finalize(tensor, _shareable.pop, ptr, None)
    return tensor


def ipc_export(buffer: torch.Tensor) -> IpcHandle:
    """Share ``buffer`` (from :func:`alloc_shareable`, or any CUDA tensor on the fallback) with other processes.

    The caller keeps ``buffer`` alive, and its contents ready (synchronised), until every reader has copied.
    """
    if not buffer.is_cuda:
        raise ValueError("ipc_export needs a CUDA tensor")
    nbytes = buffer.numel() * buffer.element_size()
    bus = pci_bus_id(buffer.device)
    module = load()
    if module is not None and _shareable.get(buffer.data_ptr()) == buffer.device.index:
        payload = bytes(module.ipc_get_handle(buffer.data_ptr(), buffer.device.index))
        return IpcHandle("ext", payload, nbytes, buffer.device.index, bus)
    from torch.multiprocessing.reductions import reduce_tensor

    return IpcHandle("torch", reduce_tensor(buffer.view(torch.uint8)), nbytes, buffer.device.index, bus)


class IpcMapping:
    """The exporter's buffer opened in this process (``with ipc_open(handle, device) as m: m.copy_to(dst, offset)``).

    Copies are issued on the current stream of ``device``; :meth:`close` waits for them, then unmaps.
    """

    def __init__(self, handle: IpcHandle, device: torch.device | str | int) -> None:
        self.handle = handle
        self.device = torch.device("cuda", _index(device))
        self._ptr: int | None = None
        self._source: torch.Tensor | None = None
        if handle.kind == "ext":
            module = load()
            if module is None:
                raise RuntimeError(f"the source exported through the CUDA extension, not loaded here: {status()}")
            self._module = module
            self._ptr = int(module.ipc_open(handle.payload, self.device.index))
        else:
            rebuild, args = handle.payload
            self._source = rebuild(*args)  # opened on the exporter's device index (same numbering on one host)

    def copy_to(self, dst: torch.Tensor, offset: int = 0) -> None:
        """``dst`` (contiguous; CUDA or CPU) <- bytes ``[offset, offset + dst.nbytes)`` of the shared buffer."""
        nbytes = dst.numel() * dst.element_size()
        if not dst.is_contiguous() or not 0 <= offset <= offset + nbytes <= self.handle.nbytes:
            raise ValueError(f"cannot copy {nbytes} bytes at offset {offset} of a {self.handle.nbytes}-byte buffer")
        if nbytes == 0:
            return
        if self._ptr is not None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
            self._module.memcpy_async(dst.data_ptr(), self._ptr + offset, nbytes, self.device.index, stream)
        else:
            assert self._source is not None
            dst.view(-1).view(torch.uint8).copy_(self._source[offset : offset + nbytes], non_blocking=True)

    def close(self) -> None:
        """Wait for the copies, then unmap (idempotent)."""
        if self._ptr is None and self._source is None:
            return
        torch.cuda.synchronize(self.device)
        if self._ptr is not None:
            self._module.ipc_close(self._ptr, self.device.index)
        self._ptr, self._source = None, None

    def __enter__(self) -> IpcMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ipc_open(handle: IpcHandle, device: torch.device | str | int) -> IpcMapping:
    """Open a buffer another process exported with :func:`ipc_export`, in this process, on ``device``."""
    return IpcMapping(handle, device)


# --------------------------------------------------------------------------------------------
# topology queries
# --------------------------------------------------------------------------------------------


def pci_bus_id(device: torch.device | str | int) -> str | None:
    """The PCI bus id (``"0000:3b:00.0"``) of a CUDA device of this process, or None if unknown."""
    index = _index(device)
    module = load()
    try:
        if module is not None:
            return str(module.pci_bus_id(index))
        props = torch.cuda.get_device_properties(index)
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except (RuntimeError, AssertionError, AttributeError) as error:
        log.debug("no PCI bus id for cuda:%s: %s", index, error)
        return None


def can_access_peer(device: torch.device | str | int, peer: torch.device | str | int) -> bool:
    """Whether CUDA device ``device`` can read ``peer``'s memory directly (P2P)."""
    a, b = _index(device), _index(peer)
    module = load()
    try:
        if module is not None:
            return bool(module.can_access_peer(a, b))
        return bool(torch.cuda.can_device_access_peer(a, b))
    except (RuntimeError, AssertionError) as error:
        log.debug("peer query cuda:%s -> cuda:%s failed: %s", a, b, error)
        return False


def _index(device: torch.device | str | int) -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"not a CUDA device: {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_elan.replication.cuda_ext [--build]``: build if asked, then print the status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    if "--build" in args:
        builder = _build_module()
        if builder is None:
            print(f"no csrc/ at {CSRC}")
            return 1
        try:
            print(f"built {builder.build(os.environ.get(ENV_DIR) or CACHE_DIR, quiet=False)}")
        except builder.BuildError as error:
            print(f"build failed: {error}")
            return 1
    print(f"CUDA extension: {status()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
