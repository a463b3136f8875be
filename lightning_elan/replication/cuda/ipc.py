"""CUDA IPC and device queries of the optional CUDA extension, with their torch fallback: owns sharing GPU memory.

* :func:`alloc_shareable` / :func:`ipc_export` / :func:`ipc_open`: ``cudaIpcGetMemHandle`` of a raw ``cudaMalloc``,
  ``cudaIpcOpenMemHandle`` and async memcpys (fallback: ``torch.multiprocessing`` CUDA reductions and ``copy_``);
* :func:`pci_bus_id` / :func:`can_access_peer`: ``cudaDeviceGetPCIBusId`` / ``cudaDeviceCanAccessPeer`` (fallback:
  ``torch.cuda.get_device_properties`` / ``torch.cuda.can_device_access_peer``).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from lightning_elan.replication.cuda import loader

log = logging.getLogger(__name__)

__all__ = [
    "IpcHandle",
    "IpcMapping",
    "alloc_shareable",
    "can_access_peer",
    "device_index",
    "ipc_export",
    "ipc_open",
    "pci_bus_id",
]

_shareable: dict[int, int] = {}  # data_ptr -> device index of live alloc_shareable() allocations


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
    device = torch.device("cuda", device_index(device))
    module = loader.load()
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
    module = loader.load()
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
        self.device = torch.device("cuda", device_index(device))
        self._ptr: int | None = None
        self._source: torch.Tensor | None = None
        if handle.kind == "ext":
            module = loader.load()
            if module is None:
                reason = loader.status()
                raise RuntimeError(f"the source exported through the CUDA extension, not loaded here: {reason}")
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
    index = device_index(device)
    module = loader.load()
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
    a, b = device_index(device), device_index(peer)
    module = loader.load()
    try:
        if module is not None:
            return bool(module.can_access_peer(a, b))
        return bool(torch.cuda.can_device_access_peer(a, b))
    except (RuntimeError, AssertionError) as error:
        log.debug("peer query cuda:%s -> cuda:%s failed: %s", a, b, error)
        return False


def device_index(device: torch.device | str | int) -> int:
    """The CUDA device index ``device`` names (the current device for a bare ``"cuda"``)."""
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"not a CUDA device: {device}")
    return device.index if device.index is not None else torch.cuda.current_device()
