"""A resize of a sharded job: the old members and the joiners move the shards live (issue 24, ``elan_fsdp``).

A front-end whose members each hold only a shard of the model (FSDP) cannot hand a joiner the whole state from one
source. It opts in by implementing :class:`LiveResharding`: at an adjustment every old member (stayers and leavers,
which hold shards) and every joiner calls its :meth:`~LiveResharding.reshard_live` at the same point of the adjustment,
with a :class:`ReshardGroup` that contains all of them — the old members first in their old rank order, then the
joiners in plan order — built from the new generation's store (a transfer group of its own, like the collective
transport's: a leaver is not in the new default group). The rest of a joiner's state (loops, data position, RNG,
callbacks, schedulers) still comes from its source through the engine's normal replication, before the reshard.

After a member's death the recovery plan's survivors and its joiners (``--replace-failed``) reshard the same way, the
dead members left out: the group is the survivors in old rank order, then the joiners, and ``owners`` says which of
them holds each old shard (a dead member's is held by its mirror holder, ``replication.mirror_plan``); a shard that
died with its mirror raises :class:`~lightning_elan.replication.mirror_plan.ShardsLost` on every participant alike.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from lightning_elan.protocol.contract import ACTION_FAILURE, AdjustmentPlan
from lightning_elan.replication.mirror_plan import shard_owners
from lightning_elan.replication.transports.collective import make_transfer_group

log = logging.getLogger(__name__)

__all__ = ["LiveResharding", "ReshardGroup", "reshard_live"]


@dataclass(frozen=True)
class ReshardGroup:
    """The group every participant of a live reshard is in: ``holders`` (the old members) and ``receivers`` (the new
    members) are its ranks, each in shard order (old rank order, new rank order)."""

    group: Any  # a c10d backend used through its own methods (send, recv, broadcast), not registered with torch
    holders: list[int]
    receivers: list[int]
    owners: list[int] | None = None  # after a death: for each old shard, the rank holding it (its own or a mirror)
    previous_index: int | None = None  # after a death: this member's old shard (None on a joiner)

    @property
    def rank(self) -> int:
        return self.group.rank()


@runtime_checkable
class LiveResharding(Protocol):
    """A front-end whose members hold shards: the engine calls this on old members and joiners at every resize."""

    def reshard_live(self, reshard: ReshardGroup) -> None:
        """Move this member's shards to their new holders and take its new ones (a receiver ends sharded over the new
        generation, a leaver holds nothing)."""


def reshard_live(frontend: object, plan: AdjustmentPlan, worker_id: str, store: dist.Store, backend: str,
                 timeout: timedelta) -> None:
    """If ``frontend`` reshards live, build the plan's reshard group and let it move the shards."""
    if not isinstance(frontend, LiveResharding):
        return
    started = time.perf_counter()
    recovering = plan.action == ACTION_FAILURE
    holding = [member for member in plan.previous_members if member in plan.stayers] if recovering else \
        list(plan.previous_members)
    owners = shard_owners(plan.previous_members, holding) if recovering else None  # ShardsLost: on every member alike
    order = [*holding, *[joiner for joiner in plan.joiners if joiner not in holding]]
    group = make_transfer_group(store, f"elan/gen{plan.generation}/reshard", order.index(worker_id), len(order),
                                backend, timeout)
    reshard = ReshardGroup(group, list(range(len(holding))), [order.index(member) for member in plan.members],
                           owners=None if owners is None else [order.index(owner) for owner in owners],
                           previous_index=plan.previous_members.index(worker_id) if recovering and
                           worker_id in holding else None)
    frontend.reshard_live(reshard)
    log.info("worker %s resharded live for generation %d (%d holders -> %d receivers) in %.1f ms", worker_id,
             plan.generation, len(reshard.holders), len(reshard.receivers), (time.perf_counter() - started) * 1e3)
