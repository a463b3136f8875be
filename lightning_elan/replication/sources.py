"""Which old member sends the training state to each joiner (pure).

With every worker's topology known, the choice goes through the topology-aware planner
(:func:`lightning_elan.replication.planner.plan_transfers`); without it, distinct sources round-robin.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lightning_elan.replication.planner import plan_transfers, primary_sources
from lightning_elan.replication.topology import WorkerTopology

log = logging.getLogger(__name__)

__all__ = ["plan_replication"]


def plan_replication(
    stayers: list[str],
    leavers: list[str],
    joiners: list[str],
    topologies: Mapping[str, WorkerTopology | Mapping[str, Any] | None] | None = None,
) -> tuple[dict[str, str], list[dict[str, Any]] | None]:
    """``(sources, transfers)``: ``{joiner: source}`` and, when topologies are known, the planner's transfers as dicts.

    Without ``topologies`` (or when one of the workers involved has none): distinct stayers round-robin in order,
    leavers if there is no stayer, and ``transfers`` is None. With them: each joiner's nearest source, balanced
    (:func:`~lightning_elan.replication.planner.plan_transfers`). Raises ``ValueError`` when joiners need a source but
    there are neither stayers nor leavers, or when a joiner is listed twice.
    """
    if len(set(joiners)) != len(joiners):
        raise ValueError(f"joiners must be distinct, got {joiners}")
    if not joiners:
        return {}, None
    candidates = list(dict.fromkeys(stayers)) or list(dict.fromkeys(leavers))
    if not candidates:
        raise ValueError(f"no source for joiners {joiners}: there are no stayers and no leavers")
    known = _known_topologies(candidates + joiners, topologies)
    if known is None:
        return {joiner: candidates[index % len(candidates)] for index, joiner in enumerate(joiners)}, None
    transfers = plan_transfers({s: known[s] for s in candidates}, {j: known[j] for j in joiners})
    return primary_sources(transfers), [transfer.to_dict() for transfer in transfers]


def _known_topologies(
    workers: list[str], topologies: Mapping[str, WorkerTopology | Mapping[str, Any] | None] | None
) -> dict[str, WorkerTopology] | None:
    """Every worker's topology, or None when one is missing or unreadable (then the round-robin rule applies)."""
    if not topologies:
        return None
    known: dict[str, WorkerTopology] = {}
    for worker in workers:
        value = topologies.get(worker)
        if value is None:
            return None
        try:
            known[worker] = WorkerTopology.coerce(value)
        except (TypeError, ValueError) as error:
            log.warning("ignoring the topology of %s (%s): sources chosen round-robin", worker, error)
            return None
    return known
