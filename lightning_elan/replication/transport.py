"""Collective transport of a packed training state: one source, one or more destinations.

A transfer uses its own process-group object built directly from a store (never the default
process group: the source may be a leaving worker that is not in the new default group). Rank 0
of the transfer group is the source. The CPU-side state and the :class:`PackedLayout` travel
pickled through the store under ``prefix + "/header"``; the packed buffers are broadcast from
rank 0, one broadcast per buffer, all issued before any is waited on.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

from lightning_elan.replication.packing import (
    PackedLayout,
    empty_buffers,
    pack,
    state_nbytes,
    unpack,
)

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TIMEOUT",
    "HEADER_FORMAT",
    "SOURCE_RANK",
    "TransferGroup",
    "clear_header",
    "header_key",
    "make_transfer_group",
    "receive_state",
    "send_state",
]

SOURCE_RANK = 0
HEADER_FORMAT = 1
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)

# ProcessGroupGloo / ProcessGroupNCCL are c10d *backends* (torch >= 2.2): they are used through
# their own methods (broadcast, barrier, rank, size), never through torch.distributed.* functions,
# since they are not registered with c10d's world.
TransferGroup: TypeAlias = dist.ProcessGroup | torch._C._distributed_c10d.Backend


def header_key(prefix: str) -> str:
    return f"{prefix}/header"


def _group_store(store: dist.Store, prefix: str) -> dist.Store:
    # A sub-prefix keeps the backend's rendezvous keys apart from our header key.
    return dist.PrefixStore(f"{prefix}/pg", store)


def make_transfer_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    backend: str = "gloo",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> TransferGroup:
    """Build the transfer group for ``prefix`` without touching the default process group.

    Every member of the transfer (the source as rank 0, destinations 1..size-1) calls this with
    the same ``prefix`` and ``size``; it returns once all have connected. ``prefix`` must be unique
    per transfer within ``store``.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a transfer group of size {size}")
    t0 = time.perf_counter()
    group_store = _group_store(store, prefix)
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


def send_state(
    group: TransferGroup,
    store: dist.Store,
    prefix: str,
    cpu_state: Any,
    tensors: list[torch.Tensor],
) -> int:
    """Send ``cpu_state`` and ``tensors`` from rank 0 of ``group`` to all its other ranks.

    Returns the bytes sent: packed tensor bytes plus the pickled header's length (the same number
    :func:`receive_state` returns).
    """
    if group.rank() != SOURCE_RANK:
        raise RuntimeError(f"send_state must run on rank {SOURCE_RANK} of the transfer group, not {group.rank()}")
    with _timed(prefix, "pack"):
        buffers, layout = pack(tensors)
    with _timed(prefix, "header"):
        header = pickle.dumps(
            {"format": HEADER_FORMAT, "cpu_state": cpu_state, "layout": layout},
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        store.set(header_key(prefix), header)
    with _timed(prefix, "broadcast"):
        _broadcast_all(group, buffers)
    nbytes = state_nbytes(buffers) + len(header)
    log.debug("transfer %s: sent %d bytes (%d tensors, %d buffers)", prefix, nbytes, len(tensors), len(buffers))
    return nbytes


def receive_state(
    group: TransferGroup,
    store: dist.Store,
    prefix: str,
    device_for: Callable[[str], torch.device],
) -> tuple[Any, list[torch.Tensor], int]:
    """Receive what :func:`send_state` sends; returns ``(cpu_state, tensors, bytes_received)``.

    Blocks on the store until the header is there. ``device_for`` maps the source's device type to
    a local device for the receive buffers. The returned tensors are views into those buffers.
    """
    if group.rank() == SOURCE_RANK:
        raise RuntimeError("receive_state cannot run on the source (rank 0) of the transfer group")
    with _timed(prefix, "header"):
        header_bytes = store.get(header_key(prefix))
        header = pickle.loads(header_bytes)
    _check_header(header)
    layout: PackedLayout = header["layout"]
    buffers = empty_buffers(layout, device_for)
    with _timed(prefix, "broadcast"):
        _broadcast_all(group, buffers)
    with _timed(prefix, "unpack"):
        tensors = unpack(buffers, layout)
    nbytes = state_nbytes(buffers) + len(header_bytes)
    log.debug("transfer %s: received %d bytes (%d tensors)", prefix, nbytes, len(tensors))
    return header["cpu_state"], tensors, nbytes


def clear_header(store: dist.Store, prefix: str) -> bool:
    """Delete a finished transfer's header from the store (call once every destination has it)."""
    return bool(store.delete_key(header_key(prefix)))


def _check_header(header: Any) -> None:
    if not isinstance(header, dict) or header.get("format") != HEADER_FORMAT:
        raise RuntimeError(f"unexpected transfer header format: {type(header).__name__}")


def _broadcast_all(group: TransferGroup, buffers: dict[str, torch.Tensor]) -> None:
    """Broadcast every non-empty buffer from rank 0, sorted by key; all issued, then all waited.

    Buffers go as raw bytes (a uint8 view), so any dtype works with any backend.
    """
    opts = dist.BroadcastOptions()
    opts.rootRank = SOURCE_RANK
    works = []
    for key in sorted(buffers):
        buf = buffers[key]
        if buf.numel() == 0:
            continue
        works.append(group.broadcast([buf.view(torch.uint8)], opts))
    for work in works:
        work.wait()
    _sync_devices(buffers)


def _sync_devices(buffers: dict[str, torch.Tensor]) -> None:
    # Work.wait() on an accelerator only orders the current stream; block until the data has
    # actually moved, so a leaving source may exit and a destination may time the real copy.
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
