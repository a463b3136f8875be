"""Topology-aware replication plan: who sends the training state to which joiner, over which link, when (pure).

Rules (Elan §IV, ETL fig. 2, DESIGN.md §5):

1. **Nearest.** Each joiner copies from a source at the lowest link level it has to any source
   (:func:`~lightning_elan.replication.topology.link_level`: L0 same GPU < L1 P2P < L2 host bridge < L3 cross-socket <
   L4 network). Sources are the stayers, or the leavers when nobody stays.
2. **Concurrent, balanced.** Among a joiner's nearest sources, joiners are spread so that no source serves more than
   it must: the assignment is a balanced semi-matching on the "nearest" edges (no source with load ``k`` has a joiner
   that could move to a nearest source with load ``<= k - 2``, even through a chain of moves), which minimises the
   largest load and gives distinct sources whenever there are enough. Ties go to the source whose cross-socket link is
   less used, then to the source listed first.
3. **Serialised where links are shared.** Copies that cross the same socket-to-socket link (L3) of one machine run in
   turn: each gets its own ``wave`` (0, 1, ...). Everything else runs in wave 0, concurrently.
Each :class:`Transfer` also names the transport for its level (:func:`choose_transport`): ``cuda_ipc`` for GPU pairs
at L0/L1, ``shm`` for the rest of one machine (host shared memory; GPU tensors are staged through it), ``collective``
(NCCL/gloo send on a transfer group) across machines.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lightning_elan.protocol.contract import (
    TRANSPORT_COLLECTIVE,
    TRANSPORT_CUDA_IPC,
    TRANSPORT_SHM,
    TRANSPORTS,
    Transfer,
)
from lightning_elan.replication.topology import (
        L1_P2P,
    L3_CROSS_SOCKET,
    L4_NETWORK,
    WorkerTopology,
    link_level,
)

log = logging.getLogger(__name__)

__all__ = [
    "TRANSPORTS",
    "Transfer",
    "choose_transport",
    "contention_key",
    "plan_transfers",
    "primary_sources",
    "wave_sizes",
]

LevelFn = Callable[[WorkerTopology, WorkerTopology], int]


def plan_transfers(
    stayers: Mapping[str, WorkerTopology | Mapping[str, Any]],
    joiners: Mapping[str, WorkerTopology | Mapping[str, Any]],
    leavers: Mapping[str, WorkerTopology | Mapping[str, Any]] | None = None,
    *,
    level_of: LevelFn = link_level,
) -> list[Transfer]:
    """The transfers that bring every joiner the state; see the module docstring for the rules.

    Mappings are ``worker id -> topology`` (a :class:`WorkerTopology` or its dict); their order is the tie-break order.
    Returns one transfer per joiner, sorted by wave, then joiner order. Raises ``ValueError`` when joiners need a source
    and there is none, or a joiner is also a source.
    """
    joiner_topo = {worker: WorkerTopology.coerce(t) for worker, t in joiners.items()}
    if not joiner_topo:
        return []
    source_topo = {worker: WorkerTopology.coerce(t) for worker, t in (stayers or leavers or {}).items()}
    if not source_topo:
        raise ValueError(f"no source for joiners {list(joiner_topo)}: there are no stayers and no leavers")
    overlap = sorted(set(source_topo) & set(joiner_topo))
    if overlap:
        raise ValueError(f"workers {overlap} are listed both as joiners and as sources")
    levels = {j: {s: level_of(jt, st) for s, st in source_topo.items()} for j, jt in joiner_topo.items()}
    nearest = {j: _nearest(by_source) for j, by_source in levels.items()}
    assignment = _assign(list(joiner_topo), list(source_topo), nearest, _link_keys(joiner_topo, source_topo, levels))
    transfers = _build(joiner_topo, source_topo, levels, assignment)
    log.debug("replication plan: %s", [t.to_dict() for t in transfers])
    return transfers


def _nearest(by_source: Mapping[str, int]) -> list[str]:
    best = min(by_source.values())
    return [source for source, level in by_source.items() if level == best]


# --------------------------------------------------------------------------------------------
# balanced assignment on the nearest edges
# --------------------------------------------------------------------------------------------


def _link_keys(
    joiners: Mapping[str, WorkerTopology],
    sources: Mapping[str, WorkerTopology],
    levels: Mapping[str, Mapping[str, int]],
) -> dict[tuple[str, str], tuple | None]:
    return {(j, s): contention_key(sources[s], jt, levels[j][s]) for j, jt in joiners.items() for s in sources}


def _assign(
    joiners: list[str], sources: list[str], nearest: Mapping[str, list[str]], links: Mapping[tuple[str, str], Any]
) -> dict[str, str]:
    """Greedy (most constrained joiner first, least loaded source), then rebalanced along alternating paths."""
    order = {s: i for i, s in enumerate(sources)}
    position = {j: i for i, j in enumerate(joiners)}
    load = dict.fromkeys(sources, 0)
    link_load: dict[Any, int] = {}
    assignment: dict[str, str] = {}
    for joiner in sorted(joiners, key=lambda j: (len(nearest[j]), position[j])):
        source = min(nearest[joiner], key=lambda s: (load[s], link_load.get(links[joiner, s], 0), order[s]))
        assignment[joiner] = source
        load[source] += 1
        key = links[joiner, source]
        if key is not None:
            link_load[key] = link_load.get(key, 0) + 1
    _rebalance(assignment, nearest, load, order)
    return assignment


def _rebalance(
    assignment: dict[str, str], nearest: Mapping[str, list[str]], load: dict[str, int], order: Mapping[str, int]
) -> None:
    """Shift joiners along cost-reducing paths until none is left (Harvey et al.'s optimal semi-matching)."""
    while True:
        for start in sorted(load, key=lambda s: (-load[s], order[s])):
            path = _cost_reducing_path(start, assignment, nearest, load, order)
            if path:
                _apply(path, assignment, load)
                break
        else:
            return


def _cost_reducing_path(
    start: str,
    assignment: Mapping[str, str],
    nearest: Mapping[str, list[str]],
    load: Mapping[str, int],
    order: Mapping[str, int],
) -> list[tuple[str, str, str]]:
    """BFS from ``start`` over (source -> its joiner -> that joiner's other nearest source) to a source with load
    ``<= load[start] - 2``; returns the moves ``(joiner, from, to)`` from ``start`` outwards, or ``[]``."""
    served: dict[str, list[str]] = {}
    for joiner, source in assignment.items():
        served.setdefault(source, []).append(joiner)
    parent: dict[str, tuple[str, str]] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        source = queue.popleft()
        for joiner in served.get(source, []):
            for other in sorted(nearest[joiner], key=order.__getitem__):
                if other in seen:
                    continue
                seen.add(other)
                parent[other] = (source, joiner)
                if load[other] <= load[start] - 2:
                    return _unwind(other, start, parent)
                queue.append(other)
    return []


def _unwind(end: str, start: str, parent: Mapping[str, tuple[str, str]]) -> list[tuple[str, str, str]]:
    moves = []
    node = end
    while node != start:
        previous, joiner = parent[node]
        moves.append((joiner, previous, node))
        node = previous
    return moves[::-1]


def _apply(path: list[tuple[str, str, str]], assignment: dict[str, str], load: dict[str, int]) -> None:
    for joiner, _, target in path:
        assignment[joiner] = target
    load[path[0][1]] -= 1
    load[path[-1][2]] += 1


# --------------------------------------------------------------------------------------------
# waves, transports
# --------------------------------------------------------------------------------------------


def _build(
    joiners: Mapping[str, WorkerTopology],
    sources: Mapping[str, WorkerTopology],
    levels: Mapping[str, Mapping[str, int]],
    assignment: Mapping[str, str],
) -> list[Transfer]:
    transfers: list[Transfer] = []
    next_wave: dict[Any, int] = {}
    for joiner, topo in joiners.items():
        source = assignment[joiner]
        level = levels[joiner][source]
        key = contention_key(sources[source], topo, level)
        wave = 0
        if key is not None:
            wave = next_wave.get(key, 0)
            next_wave[key] = wave + 1
        transport = choose_transport(level, sources[source], topo)
        transfers.append(Transfer(source=source, joiner=joiner, level=level, wave=wave, transport=transport))
    position = {joiner: i for i, joiner in enumerate(joiners)}
    return sorted(transfers, key=lambda t: (t.wave, position[t.joiner]))


def contention_key(a: WorkerTopology, b: WorkerTopology, level: int) -> tuple | None:
    """The shared physical link a copy at ``level`` occupies, when copies on it must run in turn (L3 only).

    ``("L3", host, boot id, lower socket, higher socket)``; NUMA nodes stand in when sockets are unknown.
    """
    if level != L3_CROSS_SOCKET:
        return None
    if a.socket is not None and b.socket is not None:
        ends = sorted((a.socket, b.socket))
    else:
        ends = sorted((_or_minus_one(a.numa_node), _or_minus_one(b.numa_node)))
    return ("L3", a.host, a.boot_id or b.boot_id, *ends)


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value


def choose_transport(level: int, source: WorkerTopology, joiner: WorkerTopology) -> str:
    """``cuda_ipc`` for two GPUs at L0/L1, ``shm`` within one machine otherwise, ``collective`` across machines."""
    if level >= L4_NETWORK:
        return TRANSPORT_COLLECTIVE
    if level <= L1_P2P and source.is_gpu and joiner.is_gpu:
        return TRANSPORT_CUDA_IPC
    return TRANSPORT_SHM


# --------------------------------------------------------------------------------------------
# reading a plan
# --------------------------------------------------------------------------------------------


def primary_sources(transfers: Iterable[Transfer | Mapping[str, Any]]) -> dict[str, str]:
    """``{joiner: source}``, in plan order."""
    return {t.joiner: t.source for t in map(Transfer.coerce, transfers)}


def wave_sizes(transfers: Iterable[Transfer | Mapping[str, Any]]) -> dict[int, int]:
    """``{wave: number of transfers in it}`` (a joiner of wave ``w`` > 0 waits for the ``w - 1`` count)."""
    sizes: dict[int, int] = {}
    for t in map(Transfer.coerce, transfers):
        sizes[t.wave] = sizes.get(t.wave, 0) + 1
    return sizes
