"""The transports of a packed training state, one module each, behind :class:`~.base.StateTransport`.

``TRANSPORTS`` maps the planner's transport names (:data:`lightning_elan.replication.planner.TRANSPORTS`) to their
classes; :func:`transport_for` builds one for a channel.
"""

from __future__ import annotations

from lightning_elan.replication.planner import TRANSPORT_COLLECTIVE, TRANSPORT_CUDA_IPC, TRANSPORT_SHM
from lightning_elan.replication.send_segment import SendSegment
from lightning_elan.replication.transports.base import (
    Channel,
    DeviceFor,
    Received,
    StateTransport,
    TransportUnavailable,
)
from lightning_elan.replication.transports.collective import CollectiveTransport
from lightning_elan.replication.transports.cuda_ipc import CudaIpcTransport
from lightning_elan.replication.transports.shm import ShmTransport

__all__ = [
    "TRANSPORTS",
    "Channel",
    "CollectiveTransport",
    "CudaIpcTransport",
    "DeviceFor",
    "Received",
    "ShmTransport",
    "StateTransport",
    "TransportUnavailable",
    "transport_for",
]

TRANSPORTS: dict[str, type[StateTransport]] = {
    TRANSPORT_COLLECTIVE: CollectiveTransport,
    TRANSPORT_CUDA_IPC: CudaIpcTransport,
    TRANSPORT_SHM: ShmTransport,
}


def transport_for(name: str, channel: Channel, send_segment: SendSegment | None = None) -> StateTransport:
    """A new transport of kind ``name`` on ``channel``; ``ValueError`` for a name no transport has. ``send_segment``: a
    source's shared-memory segment made ahead, which the shared-memory transport writes into."""
    try:
        cls = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {sorted(TRANSPORTS)}") from None
    if cls is ShmTransport:
        return ShmTransport(channel, segment=send_segment)
    return cls(channel)
