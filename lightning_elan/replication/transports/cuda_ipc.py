"""The CUDA IPC transport (levels L0/L1: same GPU, or GPUs with peer access): device to device, no host copy.

The source packs the snapshot into one shareable GPU arena (one kernel launch with the CUDA extension), exports one
IPC handle and publishes the header; ``send`` returns at once. Each reader opens the handle on its own GPU, copies
device to device (P2P across GPUs) into its receive buffers, waits for the copies, unmaps and acknowledges;
:meth:`CudaIpcTransport.disallow` waits for every acknowledgement and frees the arena. A source whose device is not a
GPU, or whose allocation or export fails (out of memory, containers without ``--ipc=host``), raises
:class:`~lightning_elan.replication.transports.base.TransportUnavailable`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from typing_extensions import override

from lightning_elan.replication.cuda import ipc, kernels
from lightning_elan.replication.cuda.ipc import IpcHandle, IpcMapping
from lightning_elan.replication.packing import (
    ArenaLayout,
    PackedLayout,
    arena_layout,
    arena_views,
    empty_buffers,
    make_layout,
    state_nbytes,
    unpack,
)
from lightning_elan.replication.reception import ReceiveInto
from lightning_elan.replication.transports.base import (
    Channel,
    DeviceFor,
    Received,
    StateTransport,
    TransportUnavailable,
)

log = logging.getLogger(__name__)

__all__ = ["CudaIpcTransport"]


class CudaIpcTransport(StateTransport):
    """One exported GPU arena per source, copied from by every reader on this host."""

    name = "cuda_ipc"
    header_format = "elan-ipc/1"
    same_host = True

    def __init__(self, channel: Channel) -> None:
        super().__init__(channel)
        self._arena: torch.Tensor | None = None
        self._readers = 0

    @override
    def send(self, cpu_state: Any, tensors: list[torch.Tensor], readers: int) -> int:
        t0 = time.perf_counter()
        device = self.channel.device
        if device.type != "cuda":
            raise TransportUnavailable(f"this source's device is {device}, not a GPU")
        device = torch.device("cuda", ipc.device_index(device))
        layout = make_layout(tensors)
        places = arena_layout(layout)
        handle = self._export(tensors, layout, places, device) if places.nbytes else None
        self._readers = readers
        header = {"format": self.header_format, "cpu_state": cpu_state, "layout": layout, "arena": places,
                  "handle": handle}  # fmt: skip
        header_len = self._publish_header(header)
        kind = handle.kind if handle else "empty"
        log.debug("ipc %s: %d bytes packed on %s (%s) in %.1f ms", self.channel.prefix, places.nbytes, device, kind,
                  _ms(t0))  # fmt: skip
        return sum(places.sizes.values()) + header_len

    def _export(
        self, tensors: list[torch.Tensor], layout: PackedLayout, places: ArenaLayout, device: torch.device
    ) -> IpcHandle:
        """Pack into a new shareable arena on ``device`` and export it (the arena lives until :meth:`disallow`)."""
        try:
            arena = ipc.alloc_shareable(places.nbytes, device)
            kernels.pack_into(tensors, layout, arena_views(arena, places))
            torch.cuda.synchronize(device)  # the bytes are in place before anyone can open the handle
            handle = ipc.ipc_export(arena)
        except (RuntimeError, OSError) as error:
            what = f"CUDA IPC export of {places.nbytes} bytes on {device}"
            raise TransportUnavailable(f"{what} failed: {error}") from error
        self._arena = arena
        return handle

    @override
    def receive(self, reader: int, device_for: DeviceFor, into: ReceiveInto | None = None) -> Received:
        t0 = time.perf_counter()
        header, header_len = self._fetch_header()
        layout: PackedLayout = header["layout"]
        places: ArenaLayout = header["arena"]
        handle: IpcHandle | None = header["handle"]
        buffers = empty_buffers(layout, device_for)
        try:
            if handle is not None:
                _copy_all(ipc.ipc_open(handle, self.channel.device), places, buffers)
        finally:
            self._ack()  # copied (or failed): the source may free the arena
        log.debug("ipc %s: received %d bytes in %.1f ms", self.channel.prefix, places.nbytes, _ms(t0))
        return Received(header["cpu_state"], unpack(buffers, layout), state_nbytes(buffers) + header_len)

    @override
    def _stop_serving(self) -> None:
        """Every reader has copied: free the arena."""
        self._arena = None

    @override
    def shutdown(self) -> None:
        self._arena = None
        super().shutdown()


def _copy_all(mapping: IpcMapping, places: ArenaLayout, buffers: dict[str, torch.Tensor]) -> None:
    """Copy every buffer out of the opened arena, then wait for the copies and unmap."""
    try:
        for key, offset in places.offsets.items():
            mapping.copy_to(buffers[key].view(torch.uint8), offset)
    finally:
        mapping.close()


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
