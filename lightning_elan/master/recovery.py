"""Recovering from a dead member (pure: no sockets, no torch): who must check in, and the plan without the dead.

When a member dies, every generation it belonged to (the current one and, with a plan in flight, the plan's) is
*failed*: its survivors abort their process group, discard the step they had not committed and check in with
``recover``, saying whether they hold the training state and at which step. Once every survivor has checked in (or
was declared dead after ``deadline``), the AM forms one plan: the state holders stay in rank order, survivors without
state (joiners of the interrupted plan that had not received theirs) and ready replacements join from them, and the
generation after the newest failed one forms. Semantics: docs/architecture.md, *Worker failures*.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_elan.protocol.contract import ACTION_FAILURE, AdjustmentPlan, Transfer, worker_number
from lightning_elan.replication.sources import plan_replication

logger = logging.getLogger(__name__)

__all__ = ["CheckIn", "Recovery", "recovery_plan"]


@dataclass
class CheckIn:
    """One survivor's ``recover``: whether it holds the state, its last committed step, when it checked in, and
    whether it voted on the step after ``step`` without learning the decision (``uncertain``)."""

    has_state: bool
    step: int | None
    at: float
    uncertain: bool = False
    before_loop: bool = False  # a state holder not in its training loop yet

    def step_after(self, newest: int) -> int | None:
        """The step this survivor holds once the recovery plan says the newest committed one is ``newest``: an
        uncertain survivor applies its open step if another survivor committed it, and discards it otherwise."""
        if self.uncertain and self.step is not None and self.step + 1 == newest:
            return newest
        return self.step


@dataclass
class Recovery:
    """A failure being recovered: the failed generations, the dead, the survivors expected to check in."""

    failure_id: str
    failed_generations: list[int]
    previous_members: list[str]  # the members of the newest failed generation, in its rank order
    survivors: list[str]
    detected_at: float
    deadline: float
    dead: list[str] = field(default_factory=list)
    checked_in: dict[str, CheckIn] = field(default_factory=dict)
    interrupted_request: str | None = None
    waiting_logged: bool = False  # the "waiting for joiners below --min-workers" line was logged
    leavers: list[str] = field(default_factory=list)
    """The living leavers of an interrupted live reshard (elan_fsdp): they hold shards of the layout the survivors
    recover from, so they take part in the recovery's reshard as its leavers (not members, not waited for)."""
    layouts: dict[str, list[str]] = field(default_factory=dict)
    """The members of each failed generation, by generation number (``AdjustmentPlan.layouts``)."""

    @property
    def next_generation(self) -> int:
        return max(self.failed_generations) + 1

    def mark_dead(self, worker_id: str) -> None:
        if worker_id not in self.dead:
            self.dead.append(worker_id)
        if worker_id in self.survivors:
            self.survivors.remove(worker_id)
        if worker_id in self.leavers:
            self.leavers.remove(worker_id)
        self.checked_in.pop(worker_id, None)

    def missing(self) -> list[str]:
        """Survivors that have not checked in yet."""
        return [worker for worker in self.survivors if worker not in self.checked_in]

    def state_holders(self) -> list[str]:
        """Checked-in survivors with the state at the newest committed step, in the failed generation's rank order.

        Every member commits a step together (the commit vote), so holders agree on the step — an uncertain one
        takes the newest committed step as its own (it applies the step it voted on); one behind would be a bug in
        that vote: it is logged and served the state like a survivor without it.
        """
        newest = self.committed_step()
        holders = {worker: c.step_after(newest) for worker, c in self.checked_in.items()
                   if c.has_state and c.step is not None}
        if not holders:
            return []
        behind = sorted(worker for worker, step in holders.items() if step != newest)
        if behind:
            logger.error("survivors %s are behind step %d (%s): they take the state from one that is not", behind,
                         newest, holders)
        ordered = [worker for worker in self.previous_members if holders.get(worker) == newest]
        return ordered + sorted(w for w in holders if holders[w] == newest and w not in ordered)

    def committed_step(self) -> int:
        steps = [c.step for c in self.checked_in.values() if c.has_state and c.step is not None]
        return max(steps) if steps else 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recovery:
        checked = {worker: CheckIn(**entry) for worker, entry in data.get("checked_in", {}).items()}
        return cls(**{**data, "checked_in": checked})


def recovery_plan(
    recovery: Recovery,
    current_generation: int,
    replacements: list[str],
    hosts: dict[str, str | None],
    topologies: dict[str, dict[str, Any] | None],
) -> AdjustmentPlan:
    """The plan after a failure: holders stay, survivors without state and ``replacements`` join from them."""
    holders = recovery.state_holders()
    if not holders:
        raise ValueError(f"no survivor holds the training state (dead: {', '.join(recovery.dead)})")
    stateless = sorted((w for w in recovery.checked_in if w not in holders), key=worker_number)
    joiners = stateless + [worker for worker in replacements if worker not in stateless]
    sources, transfers = plan_replication(holders, [], joiners, {w: topologies.get(w) for w in holders + joiners})
    routes = None if transfers is None else [Transfer.from_dict(transfer) for transfer in transfers]
    return AdjustmentPlan(
        request_id=recovery.failure_id,
        action=ACTION_FAILURE,
        generation=recovery.next_generation,
        previous_generation=current_generation,
        step=recovery.committed_step(),
        members=holders + joiners,
        previous_members=list(recovery.previous_members),
        joiners=joiners,
        leavers=list(recovery.leavers),
        sources=sources,
        hosts={worker: hosts.get(worker) for worker in holders + joiners},
        transfers=routes,
        layouts={generation: list(members) for generation, members in recovery.layouts.items()} or None,
    )
