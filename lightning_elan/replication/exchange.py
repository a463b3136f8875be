"""Carry out an adjustment plan's replication: every source sends, every joiner receives, over the plan's transports.

The application master's plan names, per joiner, its source, the link level, the transport and the wave
(:mod:`lightning_elan.replication.planner`). A source serves all its joiners at once: it publishes its snapshot once
per same-host transport (``cuda_ipc``: one GPU arena; ``shm``: one shared-memory segment), which returns immediately,
then broadcasts to its ``collective`` joiners on a transfer group of its own; the CPU-side state travels in each
transport's header, concurrently with the tensors. Different sources run at the same time. A joiner of wave ``w > 0``
(copies that would share a cross-socket link) starts reading only after every transfer of wave ``w - 1`` was received.

When a same-host transport cannot be set up on the source (no shared-memory space, CUDA IPC refused), the source
publishes a fallback and both sides switch that transport's joiners to a collective group of their own. A plan without
``transfers`` (some worker's topology unknown) is all collective, from the plan's ``sources``.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_elan.replication.planner import (
    TRANSPORT_COLLECTIVE,
    TRANSPORT_CUDA_IPC,
    TRANSPORT_SHM,
    Transfer,
    wave_sizes,
)
from lightning_elan.replication.shm import (
    IpcShare,
    ShmShare,
    ShmUnavailable,
    mark_wave_received,
    publish_fallback,
    receive_state_ipc,
    receive_state_shm,
    share_state_ipc,
    share_state_shm,
    wait_for_wave,
)
from lightning_elan.replication.topology import L4_NETWORK
from lightning_elan.replication.transport import make_transfer_group, receive_state, send_state

log = logging.getLogger(__name__)

__all__ = ["OutgoingReplication", "ReplicationContext", "plan_transfers_of", "receive_replica", "send_replica"]

_SAME_HOST = (TRANSPORT_CUDA_IPC, TRANSPORT_SHM)


@dataclass(frozen=True)
class ReplicationContext:
    """Where one adjustment's transfers meet: the long-lived store, a prefix unique to the adjustment, the backend."""

    store: dist.Store
    prefix: str
    backend: str
    timeout: datetime.timedelta
    device: torch.device

    def route_prefix(self, source: str, route: str) -> str:
        return f"{self.prefix}/{source}/{route}"


def plan_transfers_of(plan: Mapping[str, Any]) -> list[Transfer]:
    """Each joiner's (first-slice) transfer in plan order; a plan without ``transfers`` is all collective."""
    transfers = plan.get("transfers")
    if transfers is None:
        return [
            Transfer(source=plan["sources"][joiner], joiner=joiner, level=L4_NETWORK, transport=TRANSPORT_COLLECTIVE)
            for joiner in plan["joiners"]
        ]
    primary = [Transfer.from_dict(t) for t in transfers if t.get("slice_index", 0) == 0]
    if any(t.get("slice_count", 1) > 1 for t in transfers):
        log.warning("the plan splits transfers into slices; each joiner copies the whole state from its first source")
    return primary


def _routes_of(transfers: list[Transfer], source: str) -> dict[str, list[str]]:
    """``{transport: [joiner, ...]}`` that ``source`` serves, joiners in plan order."""
    routes: dict[str, list[str]] = {}
    for transfer in transfers:
        if transfer.source == source:
            routes.setdefault(transfer.transport, []).append(transfer.joiner)
    return routes


def _fallback_route(transport: str) -> str:
    return f"{transport}-fallback"


@dataclass
class OutgoingReplication:
    """What a source sent; same-host shares stay open until :meth:`finish` (their readers may still be copying)."""

    bytes_sent: int = 0
    joiners: dict[str, list[str]] = field(default_factory=dict)
    _shares: list[IpcShare | ShmShare] = field(default_factory=list)

    def finish(self, timeout: datetime.timedelta) -> None:
        """Wait until every same-host joiner has its copy, then free the arenas and unlink the segments."""
        try:
            for share in self._shares:
                share.wait(timeout)
        finally:
            for share in self._shares:
                share.close()
            self._shares = []

    @property
    def pending(self) -> bool:
        return bool(self._shares)


def send_replica(
    context: ReplicationContext,
    plan: Mapping[str, Any],
    source: str,
    cpu_state: Any,
    tensors: list[torch.Tensor],
) -> OutgoingReplication:
    """Send ``(cpu_state, tensors)`` to every joiner the plan gives ``source``; returns with same-host shares open."""
    routes = _routes_of(plan_transfers_of(plan), source)
    outgoing = OutgoingReplication(joiners=routes)
    collective_routes: list[tuple[str, list[str]]] = []
    for transport in _SAME_HOST:
        joiners = routes.get(transport)
        if not joiners:
            continue
        try:
            share = _share(context, source, transport, cpu_state, tensors, len(joiners))
        except ShmUnavailable as error:
            log.warning("%s to %s unavailable (%s): sending over the collective", transport, joiners, error)
            publish_fallback(context.store, context.route_prefix(source, transport), transport, str(error))
            collective_routes.append((_fallback_route(transport), joiners))
            continue
        outgoing._shares.append(share)
        outgoing.bytes_sent += share.nbytes
    if routes.get(TRANSPORT_COLLECTIVE):
        collective_routes.insert(0, (TRANSPORT_COLLECTIVE, routes[TRANSPORT_COLLECTIVE]))
    for route, joiners in collective_routes:
        outgoing.bytes_sent += _broadcast(context, source, route, len(joiners), cpu_state, tensors)
    return outgoing


def _share(
    context: ReplicationContext, source: str, transport: str, cpu_state: Any, tensors: list[torch.Tensor], count: int
) -> IpcShare | ShmShare:
    prefix = context.route_prefix(source, transport)
    if transport == TRANSPORT_CUDA_IPC:
        if context.device.type != "cuda":
            raise ShmUnavailable(f"this source's device is {context.device}, not a GPU")
        return share_state_ipc(context.store, prefix, cpu_state, tensors, context.device, count)
    return share_state_shm(context.store, prefix, cpu_state, tensors, count)


def _broadcast(
    context: ReplicationContext, source: str, route: str, count: int, cpu_state: Any, tensors: list[torch.Tensor]
) -> int:
    prefix = context.route_prefix(source, route)
    group = make_transfer_group(context.store, prefix, 0, 1 + count, context.backend, context.timeout)
    return send_state(group, context.store, prefix, cpu_state, tensors)


def receive_replica(
    context: ReplicationContext,
    plan: Mapping[str, Any],
    joiner: str,
    device_for: Callable[[str], torch.device],
) -> tuple[Any, list[torch.Tensor], int, str]:
    """Receive this joiner's state: ``(cpu_state, tensors, bytes_received, transport used)``."""
    transfers = plan_transfers_of(plan)
    mine = next((t for t in transfers if t.joiner == joiner), None)
    if mine is None:
        raise ValueError(f"the plan has no transfer to joiner {joiner}")
    route = mine.transport
    if route in _SAME_HOST:
        try:
            result = _receive_same_host(context, transfers, mine, device_for)
        except ShmUnavailable as error:
            log.warning("%s from %s unavailable (%s): receiving over the collective", route, mine.source, error)
            route = _fallback_route(route)
        else:
            mark_wave_received(context.store, context.prefix, mine.wave)
            return (*result, mine.transport)
    result = _receive_broadcast(context, transfers, mine, route, device_for)
    mark_wave_received(context.store, context.prefix, mine.wave)
    return (*result, route)


def _receive_same_host(
    context: ReplicationContext,
    transfers: list[Transfer],
    mine: Transfer,
    device_for: Callable[[str], torch.device],
) -> tuple[Any, list[torch.Tensor], int]:
    if mine.wave > 0:
        previous = wave_sizes(transfers).get(mine.wave - 1, 0)
        wait_for_wave(context.store, context.prefix, mine.wave, previous, context.timeout)
    prefix = context.route_prefix(mine.source, mine.transport)
    if mine.transport == TRANSPORT_CUDA_IPC:
        return receive_state_ipc(context.store, prefix, context.device, device_for, timeout=context.timeout)
    # copied out, not zero-copy views: a joiner keeps what it receives (optimizer state loads without a copy), and
    # views would pin the whole segment in /dev/shm, and copy its pages on write, for as long as the process trains
    return receive_state_shm(context.store, prefix, device_for, zero_copy=False, timeout=context.timeout)


def _receive_broadcast(
    context: ReplicationContext,
    transfers: list[Transfer],
    mine: Transfer,
    route: str,
    device_for: Callable[[str], torch.device],
) -> tuple[Any, list[torch.Tensor], int]:
    siblings = _routes_of(transfers, mine.source)[mine.transport]
    prefix = context.route_prefix(mine.source, route)
    rank = 1 + siblings.index(mine.joiner)
    group = make_transfer_group(context.store, prefix, rank, 1 + len(siblings), context.backend, context.timeout)
    return receive_state(group, context.store, prefix, device_for)
