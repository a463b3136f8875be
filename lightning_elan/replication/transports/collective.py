"""The collective transport: a broadcast on a transfer group of its own (gloo or NCCL), across hosts or as a fallback.

A transfer uses its own process-group object built directly from the store (never the default process group: the
source may be a leaving worker that is not in the new default group); the source is rank 0, reader ``i`` is rank
``i + 1``. The CPU-side state and the :class:`~lightning_elan.replication.packing.PackedLayout` travel pickled in the
channel's header; the packed buffers are broadcast from rank 0, one broadcast per buffer, all issued before any is
waited on. ``send`` returns once the broadcasts completed on the source; each reader acknowledges once it holds its
copy, which :meth:`CollectiveTransport.disallow` waits for before :meth:`~CollectiveTransport.shutdown` deletes the
header, the acknowledgements and the group's rendezvous keys.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_elan.replication.packing import PackedLayout, empty_buffers, pack, state_nbytes, unpack
from lightning_elan.replication.transports.base import (
    DEFAULT_TIMEOUT,
    Channel,
    DeviceFor,
    Received,
    StateTransport,
)

log = logging.getLogger(__name__)

__all__ = ["SOURCE_RANK", "CollectiveTransport", "TransferGroup", "make_transfer_group"]

SOURCE_RANK = 0

# ProcessGroupGloo / ProcessGroupNCCL are c10d *backends* (torch >= 2.2): they are used through
# their own methods (broadcast, barrier, rank, size), never through torch.distributed.* functions,
# since they are not registered with c10d's world.
TransferGroup: TypeAlias = dist.ProcessGroup | torch._C._distributed_c10d.Backend


class CollectiveTransport(StateTransport):
    """Broadcast from the source (rank 0) to its readers on a transfer group built for this channel."""

    name = "collective"
    header_format = "elan-collective/1"

    def __init__(self, channel: Channel) -> None:
        super().__init__(channel)
        self._readers = 0
        self._group: TransferGroup | None = None

    @override
    def send(self, cpu_state: Any, tensors: list[torch.Tensor], readers: int) -> int:
        prefix = self.channel.prefix
        with _timed(prefix, "pack"):
            buffers, layout = pack(tensors)
        header = {"format": self.header_format, "cpu_state": cpu_state, "layout": layout, "readers": readers}
        header_len = self._publish_header(header)
        self._readers = readers
        self._group = self._make_group(SOURCE_RANK, 1 + readers)
        with _timed(prefix, "broadcast"):
            _broadcast_all(self._group, buffers)
        nbytes = state_nbytes(buffers) + header_len
        log.debug("transfer %s: sent %d bytes (%d tensors) to %d readers", prefix, nbytes, len(tensors), readers)
        return nbytes

    @override
    def receive(self, reader: int, device_for: DeviceFor) -> Received:
        header, header_len = self._fetch_header()
        layout: PackedLayout = header["layout"]
        buffers = empty_buffers(layout, device_for)
        group = self._make_group(SOURCE_RANK + 1 + reader, 1 + header["readers"])
        with _timed(self.channel.prefix, "broadcast"):
            _broadcast_all(group, buffers)
        self._ack()
        tensors = unpack(buffers, layout)
        return Received(header["cpu_state"], tensors, state_nbytes(buffers) + header_len)


    @override
    def shutdown(self) -> None:
        self._group = None
        super().shutdown()

    def _make_group(self, rank: int, size: int) -> TransferGroup:
        c = self.channel
        return make_transfer_group(c.store, c.prefix, rank, size, c.backend, c.timeout)


def make_transfer_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    backend: str = "gloo",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> TransferGroup:
    """Build the transfer group for ``prefix`` without touching the default process group.

    Every member (the source as rank 0, readers 1..size-1) calls this with the same ``prefix`` and ``size``; it returns
    once all have connected. The group's rendezvous keys live under ``{prefix}/pg/``.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a transfer group of size {size}")
    t0 = time.perf_counter()
    group_store = dist.PrefixStore(f"{prefix}/pg", store)  # apart from the header and ack keys
    if backend == "gloo":
        if not dist.is_gloo_available():
            raise RuntimeError("torch.distributed was built without Gloo")
        group = dist.ProcessGroupGloo(group_store, rank, size, timeout)
    elif backend == "nccl":
        group = _make_nccl(group_store, rank, size, timeout)
    else:
        raise ValueError(f"unsupported transfer backend {backend!r} (gloo or nccl)")
    log.debug("transfer group %s rank %d/%d (%s) ready in %.1f ms", prefix, rank, size, backend, _ms(t0))
    return group


def _make_nccl(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> TransferGroup:
    if not dist.is_nccl_available():
        raise RuntimeError("torch.distributed was built without NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _broadcast_all(group: TransferGroup, buffers: dict[str, torch.Tensor]) -> None:
    """Broadcast every non-empty buffer from rank 0, sorted by key; all issued, then all waited.

    Buffers go as raw bytes (a uint8 view), so any dtype works with any backend.
    """
    opts = dist.BroadcastOptions()
    opts.rootRank = SOURCE_RANK
    works = [
        group.broadcast([buffers[key].view(torch.uint8)], opts) for key in sorted(buffers) if buffers[key].numel()
    ]
    for work in works:
        work.wait()
    _sync_devices(buffers)


def _sync_devices(buffers: dict[str, torch.Tensor]) -> None:
    # Work.wait() on an accelerator only orders the current stream; block until the data has
    # actually moved, so a leaving source may exit and a reader may time the real copy.
    for device in {b.device for b in buffers.values() if b.device.type != "cpu"}:
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize(device)


@contextmanager
def _timed(prefix: str, phase: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    log.debug("transfer %s: %s %.2f ms", prefix, phase, _ms(t0))


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
