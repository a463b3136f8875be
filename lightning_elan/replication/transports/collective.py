"""The collective transport: a broadcast on a transfer group of its own (gloo or NCCL), across hosts or as a fallback.

A transfer uses its own process-group object built directly from the store (never the default process group: the
source may be a leaving worker that is not in the new default group); the source is rank 0, reader ``i`` is rank
``i + 1``. The CPU-side state and the :class:`~lightning_elan.replication.packing.PackedLayout` travel pickled in the
channel's header, published before anything is copied, so readers allocate while the source packs. The packed
buffers travel in chunks of whole tensors (``CHUNK_BYTES``, :func:`~lightning_elan.replication.packing.chunk_layout`),
one broadcast each from rank 0: the source packs chunk ``i + 1`` while the backend's thread sends chunk ``i`` (the copy
and the send overlap instead of adding up), and every reader issues the same broadcasts into its receive buffers.
``send`` returns once the broadcasts completed on the source; each reader acknowledges once it holds its copy, which
:meth:`CollectiveTransport.disallow` waits for before :meth:`~CollectiveTransport.shutdown` deletes the header, the
acknowledgements and the group's rendezvous keys.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_elan import torch_compat
from lightning_elan.replication.packing import (
    Chunk,
    PackedLayout,
    allocate_like,
    chunk_layout,
    empty_buffers,
    fill_chunk,
    make_layout,
    state_nbytes,
    unpack,
)
from lightning_elan.replication.reception import ReceiveInto
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
CHUNK_BYTES = 16 << 20
"""Size of one broadcast: large enough that a collective's fixed cost is noise, small enough that packing the next
chunk overlaps sending this one for all but the last ~16 MB."""

# ProcessGroupGloo / ProcessGroupNCCL are c10d *backends* (torch >= 2.2): they are used through
# their own methods (broadcast, barrier, rank, size), never through torch.distributed.* functions,
# since they are not registered with c10d's world.
TransferGroup: TypeAlias = dist.ProcessGroup | torch_compat.C10dBackend


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
        layout = make_layout(tensors)
        header = {"format": self.header_format, "cpu_state": cpu_state, "layout": layout, "readers": readers,
                  "chunk_bytes": CHUNK_BYTES}
        header_len = self._publish_header(header)
        self._readers = readers
        buffers = allocate_like(layout, tensors)
        self._group = self._make_group(SOURCE_RANK, 1 + readers)
        with _timed(prefix, "pack and broadcast"):
            _broadcast_chunks(self._group, buffers, chunk_layout(layout, CHUNK_BYTES),
                              lambda chunk: fill_chunk(buffers, layout, chunk, tensors))
        nbytes = state_nbytes(buffers) + header_len
        log.debug("transfer %s: sent %d bytes (%d tensors) to %d readers", prefix, nbytes, len(tensors), readers)
        return nbytes

    @override
    def receive(self, reader: int, device_for: DeviceFor, into: ReceiveInto | None = None) -> Received:
        header, header_len = self._fetch_header()
        layout: PackedLayout = header["layout"]
        buffers = empty_buffers(layout, device_for)
        group = self._make_group(SOURCE_RANK + 1 + reader, 1 + header["readers"])
        with _timed(self.channel.prefix, "broadcast"):
            _broadcast_chunks(group, buffers, chunk_layout(layout, header["chunk_bytes"]))
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
        group = torch_compat.nccl_backend(group_store, rank, size, timeout)
    else:
        raise ValueError(f"unsupported transfer backend {backend!r} (gloo or nccl)")
    log.debug("transfer group %s rank %d/%d (%s) ready in %.1f ms", prefix, rank, size, backend, _ms(t0))
    return group


def _broadcast_chunks(group: TransferGroup, buffers: dict[str, torch.Tensor], chunks: list[Chunk],
                      fill: Callable[[Chunk], None] | None = None) -> None:
    """Broadcast every chunk from rank 0, in order, as raw bytes (a uint8 view: any dtype, any backend); the source
    fills each chunk (``fill``) just before issuing it, while the earlier ones are on the wire. All issued, then all
    waited."""
    opts = dist.BroadcastOptions()
    opts.rootRank = SOURCE_RANK
    works = []
    for chunk in chunks:
        if fill is not None:
            fill(chunk)
        works.append(group.broadcast([buffers[chunk.key][chunk.start:chunk.end].view(torch.uint8)], opts))
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
