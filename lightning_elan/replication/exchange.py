"""Carry out an adjustment plan's replication: every source sends, every joiner receives, over the plan's transports.

The application master's plan names, per joiner, its source, the link level, the transport and the wave
(:mod:`lightning_elan.replication.planner`). A source serves all its joiners at once through
:class:`~lightning_elan.replication.transports.base.StateTransport` objects looked up by name
(:data:`~lightning_elan.replication.transports.TRANSPORTS`): one publication per same-host transport (``cuda_ipc``: one
GPU arena; ``shm``: one shared-memory segment), which returns immediately, then one broadcast to its ``collective``
joiners on a transfer group of their own; the CPU-side state travels in each transport's header, concurrently with the
tensors. Different sources run at the same time. A joiner of wave ``w > 0`` (copies that would share a cross-socket
link) starts reading only after every transfer of wave ``w - 1`` was received.

When a same-host transport cannot be set up on the source (no shared-memory space, CUDA IPC refused), the source
publishes a fallback and both sides move that transport's joiners to a collective group of their own. A plan without
``transfers`` (some worker's topology unknown) is all collective, from the plan's ``sources``.

Keys: each transport deletes its channel's keys in ``shutdown`` (:meth:`OutgoingReplication.finish`); the wave
counters, written by joiners of every source, stay under ``context.prefix`` until the engine deletes the adjustment's
prefix (:func:`lightning_elan.replication.keys.delete_prefix`).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_elan.replication.planner import TRANSPORT_COLLECTIVE, Transfer, wave_sizes
from lightning_elan.replication.reception import ReceiveInto
from lightning_elan.replication.send_segment import SendSegment
from lightning_elan.replication.topology import L4_NETWORK
from lightning_elan.replication.transports import (
    TRANSPORTS,
    Channel,
    Received,
    StateTransport,
    TransportUnavailable,
    transport_for,
)
from lightning_elan.replication.transports.base import wait_count

log = logging.getLogger(__name__)

__all__ = [
    "OutgoingReplication",
    "ReplicationContext",
    "ReplicationPlan",
    "mark_wave_received",
    "plan_transfers_of",
    "receive_replica",
    "send_replica",
    "wait_for_wave",
]


class ReplicationPlan(Protocol):
    """What this module reads of an adjustment plan (``AdjustmentPlan`` has these attributes)."""

    joiners: list[str]
    sources: dict[str, str]
    transfers: Sequence[Transfer] | None


@dataclass(frozen=True)
class ReplicationContext:
    """Where one adjustment's transfers meet: the long-lived store, a prefix unique to the adjustment, the backend."""

    store: dist.Store
    prefix: str
    backend: str
    timeout: datetime.timedelta
    device: torch.device
    cancelled: Callable[[], bool] | None = None  # True once the adjustment's generation failed
    send_segment: SendSegment | None = None  # a source's shared-memory segment made ahead of the adjustment

    def channel(self, source: str, route: str) -> Channel:
        """The channel of ``source``'s publication over ``route`` (a transport name, or its fallback's)."""
        return Channel(self.store, f"{self.prefix}/{source}/{route}", self.timeout, self.device, self.backend,
                       self.cancelled)


def plan_transfers_of(plan: ReplicationPlan) -> list[Transfer]:
    """Each joiner's transfer in plan order; a plan without ``transfers`` is all collective, from ``plan.sources``."""
    if plan.transfers is None:
        return [
            Transfer(source=plan.sources[joiner], joiner=joiner, level=L4_NETWORK, transport=TRANSPORT_COLLECTIVE)
            for joiner in plan.joiners
        ]
    return list(plan.transfers)


def _routes_of(transfers: list[Transfer], source: str) -> dict[str, list[str]]:
    """``{transport: [joiner, ...]}`` that ``source`` serves, joiners in plan order."""
    routes: dict[str, list[str]] = {}
    for transfer in transfers:
        if transfer.source == source:
            routes.setdefault(transfer.transport, []).append(transfer.joiner)
    return routes


def _fallback_route(transport: str) -> str:
    return f"{transport}-fallback"


def _same_host_first(transport: str) -> bool:
    """Sort key: publications that return at once go before the blocking broadcasts."""
    return not TRANSPORTS[transport].same_host


# --------------------------------------------------------------------------------------------
# source
# --------------------------------------------------------------------------------------------


@dataclass
class OutgoingReplication:
    """What a source sent; its transports keep serving until :meth:`finish` (same-host readers may still copy)."""

    bytes_sent: int = 0
    joiners: dict[str, list[str]] = field(default_factory=dict)
    _transports: list[StateTransport] = field(default_factory=list)

    def finish(self, timeout: datetime.timedelta) -> None:
        """Wait until every joiner has its copy, then free the arenas, unlink the segments and delete the keys."""
        try:
            for transport in self._transports:
                transport.disallow(timeout)
        finally:
            self.close()

    def close(self) -> None:
        """Stop serving now, whoever is still reading (after :meth:`finish`, or when sending failed)."""
        transports, self._transports = self._transports, []
        for transport in transports:
            transport.shutdown()

    @property
    def pending(self) -> bool:
        return bool(self._transports)


def send_replica(
    context: ReplicationContext,
    plan: ReplicationPlan,
    source: str,
    cpu_state: Any,
    tensors: list[torch.Tensor],
) -> OutgoingReplication:
    """Send ``(cpu_state, tensors)`` to every joiner the plan gives ``source``; returns with same-host shares open."""
    routes = _routes_of(plan_transfers_of(plan), source)
    outgoing = OutgoingReplication(joiners=routes)
    try:
        fallbacks = []
        for name in sorted(routes, key=_same_host_first):
            if not _serve(context, outgoing, source, name, name, routes[name], cpu_state, tensors):
                fallbacks.append(name)
        for name in fallbacks:
            route = _fallback_route(name)
            _serve(context, outgoing, source, TRANSPORT_COLLECTIVE, route, routes[name], cpu_state, tensors)
    except BaseException:
        outgoing.close()
        raise
    return outgoing


def _serve(
    context: ReplicationContext,
    outgoing: OutgoingReplication,
    source: str,
    name: str,
    route: str,
    joiners: list[str],
    cpu_state: Any,
    tensors: list[torch.Tensor],
) -> bool:
    """Send over transport ``name`` on ``source``'s channel ``route``; False if it published a fallback instead."""
    transport = transport_for(name, context.channel(source, route), context.send_segment)
    outgoing._transports.append(transport)
    try:
        outgoing.bytes_sent += transport.send(cpu_state, tensors, len(joiners))
    except TransportUnavailable as error:
        log.warning("%s to %s unavailable (%s): sending over the collective", name, joiners, error)
        transport.publish_fallback(str(error))
        return False
    return True


# --------------------------------------------------------------------------------------------
# joiner
# --------------------------------------------------------------------------------------------


def receive_replica(
    context: ReplicationContext,
    plan: ReplicationPlan,
    joiner: str,
    device_for: Callable[[str], torch.device],
    into: ReceiveInto | None = None,
) -> tuple[Received, str]:
    """Receive this joiner's state: what came in and the transport used; ``into``: the joiner's own memory, for a
    transport that can receive into it."""
    transfers = plan_transfers_of(plan)
    mine = next((t for t in transfers if t.joiner == joiner), None)
    if mine is None:
        raise ValueError(f"the plan has no transfer to joiner {joiner}")
    reader = _routes_of(transfers, mine.source)[mine.transport].index(joiner)
    transport = transport_for(mine.transport, context.channel(mine.source, mine.transport))
    route = mine.transport
    if transport.same_host:
        wait_for_wave(context.store, context.prefix, mine.wave, wave_sizes(transfers).get(mine.wave - 1, 0),
                      context.timeout)  # fmt: skip
    try:
        received = transport.receive(reader, device_for, into)
    except TransportUnavailable as error:
        log.warning("%s from %s unavailable (%s): receiving over the collective", route, mine.source, error)
        route = _fallback_route(mine.transport)
        received = _receive_fallback(context, mine.source, route, reader, device_for)
    mark_wave_received(context.store, context.prefix, mine.wave)
    return received, route


def _receive_fallback(
    context: ReplicationContext, source: str, route: str, reader: int, device_for: Callable[[str], torch.device]
) -> Received:
    return transport_for(TRANSPORT_COLLECTIVE, context.channel(source, route)).receive(reader, device_for)


# --------------------------------------------------------------------------------------------
# waves: copies that share a cross-socket link run in turn, across sources
# --------------------------------------------------------------------------------------------


def _wave_key(prefix: str, wave: int) -> str:
    return f"{prefix}/wave{wave}/received"


def mark_wave_received(store: dist.Store, prefix: str, wave: int) -> None:
    """A joiner finished receiving its transfer of ``wave`` (``prefix``: one per adjustment)."""
    store.add(_wave_key(prefix, wave), 1)


def wait_for_wave(
    store: dist.Store, prefix: str, wave: int, transfers_in_previous_wave: int, timeout: datetime.timedelta
) -> None:
    """A joiner about to read a transfer of ``wave`` > 0 waits until every transfer of ``wave - 1`` was received."""
    if wave <= 0 or transfers_in_previous_wave <= 0:
        return
    wait_count(store, _wave_key(prefix, wave - 1), transfers_in_previous_wave, timeout, f"wave {wave - 1}")
