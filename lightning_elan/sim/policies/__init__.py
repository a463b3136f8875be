"""Scheduling policies by name: ``make_policy("e-fifo")``."""

from __future__ import annotations

from collections.abc import Callable

from lightning_elan.sim.errors import SimulationError
from lightning_elan.sim.policies.base import Policy
from lightning_elan.sim.policies.dp import SaxenaDp, SaxenaDpFixedBatch
from lightning_elan.sim.policies.elastic import ElasticBackfill, ElasticFifo
from lightning_elan.sim.policies.static import Backfill, Fifo
from lightning_elan.sim.policies.tiresias import ElasticTiresias, Tiresias

POLICIES: dict[str, Callable[[], Policy]] = {
    "fifo": Fifo,
    "backfill": Backfill,
    "e-fifo": ElasticFifo,
    "e-bf": ElasticBackfill,
    "tiresias": Tiresias,
    "elastic-tiresias": ElasticTiresias,
    "dp": SaxenaDp,
    "dp-fixed": SaxenaDpFixedBatch,
}


def make_policy(name: str, dp_interval_s: float = 0.0) -> Policy:
    """The policy called ``name`` (``dp_interval_s``: how often the dp allocators run; 0 at every event)."""
    if name not in POLICIES:
        raise SimulationError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")
    if name in ("dp", "dp-fixed"):
        return POLICIES[name](dp_interval_s)  # type: ignore[call-arg]
    return POLICIES[name]()


def parse_policies(text: str) -> list[str]:
    """``--policy fifo,e-fifo``: the names, each checked."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise SimulationError("--policy needs at least one policy name")
    for name in names:
        if name not in POLICIES:
            raise SimulationError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")
    return names


__all__ = [
    "POLICIES",
    "Backfill",
    "ElasticBackfill",
    "ElasticFifo",
    "ElasticTiresias",
    "Fifo",
    "Policy",
    "SaxenaDp",
    "SaxenaDpFixedBatch",
    "Tiresias",
    "make_policy",
    "parse_policies",
]
