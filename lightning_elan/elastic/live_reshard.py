"""A resize of a sharded job: the old members and the joiners move the shards live (issue 24, ``elan_fsdp``).

A front-end whose members each hold only a shard of the model (FSDP) cannot hand a joiner the whole state from one
source. It opts in by implementing :class:`LiveResharding`: at an adjustment every old member (stayers and leavers,
which hold shards) and every joiner calls its :meth:`~LiveResharding.reshard_live` at the same point of the adjustment,
with a :class:`ReshardGroup` that contains all of them — the old members first in their old rank order, then the
joiners in plan order — built from the new generation's store (a transfer group of its own, like the collective
transport's: a leaver is not in the new default group). The rest of a joiner's state (loops, data position, RNG,
callbacks, schedulers) still comes from its source through the engine's normal replication, before the reshard.

The group is a side group of the elastic process group (``ElasticProcessGroup.side_group``) failed with the new
generation: a member's death releases every participant waiting in a transfer at once (the rows travel in
all-to-alls, ``replication.reshard.carry``). A reshard commits only when every participant has its new shard: each
then votes (:class:`ReshardCommit`, one decision key as a step's commit vote); until the decision the old shards and
the mirrors stay, so a reshard a death interrupts is abandoned as a whole (:class:`ReshardAbandoned`) and the recovery
starts from the old layout — the one the abandoned reshard started from — as if the resize had not begun.

After a member's death the recovery plan's survivors and its joiners (``--replace-failed``) reshard the same way, the
dead members left out: the group is the survivors in old rank order, then the joiners, and ``owners`` says which of
them holds each old shard (a dead member's is held by its mirror holder, ``replication.mirror_plan``); a shard that
died with its mirror raises :class:`~lightning_elan.replication.mirror_plan.ShardsLost` on every participant alike.
The living leavers of an abandoned scale-in are the recovery plan's leavers: they hold their shards (and their mirrors)
of the old layout, so they are holders of the recovery's reshard, then leave.

A front-end whose layout is not one shard per member (HSDP: shard groups, replicated) says how many shards a world of
a given size has (``shard_count``); whenever either layout is replicated, ``owners`` lists every holder of each old
shard (its replicas; after a death, the living ones), so each receiver takes its rows from itself when it holds them
and else from one replica — a joining shard group is healed shard for shard from a replica, a leaving one moves
nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from lightning_elan.elastic.failures import CommitVote, PeerFailure
from lightning_elan.elastic.process_group import SideGroup
from lightning_elan.protocol.contract import ACTION_FAILURE, AdjustmentPlan
from lightning_elan.replication.mirror_plan import shard_holders
from lightning_elan.replication.transports.collective import make_transfer_group

log = logging.getLogger(__name__)

__all__ = ["LiveResharding", "ReshardAbandoned", "ReshardCommit", "ReshardGroup", "UnrecoverableShards",
           "reshard_live"]

SideGroupMaker = Callable[[Callable[[dist.Store], Any]], Any]
"""``ElasticProcessGroup.side_group`` for the plan's generation: the group built by the callable (given a store client),
failed with that generation."""


class UnrecoverableShards(RuntimeError):
    """A front-end found during a reshard that the job's shards cannot be rebuilt: raised as it is (not a death to
    wait for, not an abandoned reshard to start again)."""


class ReshardAbandoned(PeerFailure):
    """A member died before every participant of a live reshard had its new shard: the reshard is abandoned, the
    shards are still in the old ``layout`` (the members whose shards they are, in shard order)."""

    def __init__(self, generation: int, layout: list[str]) -> None:
        super().__init__(generation, "the live reshard was abandoned; the shards stay in their old layout")
        self.layout = layout


class ReshardCommit:
    """The decision that a live reshard stands: every participant votes once it has its new shard (a step's
    :class:`CommitVote`, with keys of its own); False on every participant alike once a death aborted it."""

    def __init__(self, store: dist.Store, generation: int, rank: int, size: int, failed: Callable[[], bool]) -> None:
        self._vote = CommitVote(store, generation, rank, size, failed, name="reshard_commit")
        self._generation = generation
        self.decided = False
        self.committed = False

    def __call__(self) -> None:
        """Vote; raise :class:`PeerFailure` if the reshard was aborted (then nothing of it stands)."""
        if self.decided:
            return
        self.committed = self._vote.commit()
        self.decided = True
        if not self.committed:
            raise PeerFailure(self._generation, "the live reshard was aborted")


@dataclass(frozen=True)
class ReshardGroup:
    """The group every participant of a live reshard is in: ``holders`` (the old members) and ``receivers`` (the new
    members) are its ranks, each in shard order (old rank order, new rank order)."""

    group: Any  # a c10d backend or a side group, used through its own methods (alltoall_base, allreduce)
    holders: list[int]
    receivers: list[int]
    owners: list[list[int]] | None = None
    """After a death, or with a replicated layout: for each old shard, the ranks holding it (its own, a mirror's or its
    replicas')."""
    previous_index: int | None = None  # with ``owners``: this member's old shard (None on a joiner)
    new_shards: int | None = None
    """The new layout's shards: receiver ``p`` takes shard ``p % new_shards`` (None: one per receiver)."""
    hosts: list[str | None] | None = None  # each rank's host (a replicated shard is taken from one on the receiver's)
    agree: Callable[[], None] = field(default=lambda: None)
    """Once this participant has its new shard, before it lets the old one go: the reshard's commit vote (raises
    :class:`PeerFailure` when a death aborted it)."""

    @property
    def rank(self) -> int:
        return self.group.rank()


@runtime_checkable
class LiveResharding(Protocol):
    """A front-end whose members hold shards: the engine calls this on old members and joiners at every resize."""

    def reshard_live(self, reshard: ReshardGroup) -> None:
        """Move this member's shards to their new holders and take its new ones (a receiver ends sharded over the new
        generation, a leaver holds nothing); call ``reshard.agree()`` once its new shards are in, before it drops
        the old ones, and keep the old ones if anything raises before it returned."""


def reshard_live(frontend: object, plan: AdjustmentPlan, worker_id: str, store: dist.Store, backend: str,
                 timeout: timedelta, side_group: SideGroupMaker | None = None,
                 failed: Callable[[], bool] = lambda: False,
                 confirm: Callable[[BaseException], None] | None = None, layout: list[str] | None = None) -> None:
    """If ``frontend`` reshards live, build the plan's reshard group and let it move the shards.

    ``side_group``: the elastic group's (abortable transfers; None: a plain transfer group); ``failed``: whether the
    plan's generation is known to have failed (the commit vote's); ``confirm``: re-raises an error that is not a
    member's death; ``layout``: the members whose shards the participants hold, in shard order, when an abandoned
    reshard left them in a layout older than the plan's previous generation. Raises :class:`ReshardAbandoned` when a
    death interrupts it before it committed."""
    if not isinstance(frontend, LiveResharding):
        return
    started = time.perf_counter()
    recovering = plan.action == ACTION_FAILURE
    previous = list(layout) if layout is not None else list(plan.previous_members)
    holding = [member for member in previous if member in plan.stayers or member in plan.leavers] if recovering \
        else previous  # a recovery's leavers: those of the reshard it abandoned, which still hold their shards
    shards_of = getattr(frontend, "shard_count", len_of_world)
    old_shards, new_shards = shards_of(len(previous)), shards_of(len(plan.members))
    replicated = old_shards != len(previous) or new_shards != len(plan.members)
    # ShardsLost: on every member alike
    owners = shard_holders(previous, holding, old_shards) if recovering or replicated else None
    order = [*holding, *[joiner for joiner in plan.joiners if joiner not in holding]]
    if recovering and old_shards < len(previous):
        _log_replicas_of_the_dead(worker_id, previous, holding, old_shards)
    rank, prefix = order.index(worker_id), f"elan/gen{plan.generation}/reshard"
    commit = ReshardCommit(store, plan.generation, rank, len(order), failed)
    group: Any = None
    try:
        group = _transfer_group(store, prefix, rank, len(order), backend, timeout, side_group)
        reshard = ReshardGroup(group, list(range(len(holding))), [order.index(member) for member in plan.members],
                               owners=None if owners is None else [[order.index(one) for one in shard]
                                                                   for shard in owners],
                               previous_index=previous.index(worker_id) % old_shards
                               if owners is not None and worker_id in holding else None,
                               new_shards=new_shards, hosts=[plan.hosts.get(member) for member in order],
                               agree=commit)
        frontend.reshard_live(reshard)
        commit()
    except Exception as error:
        if commit.committed or isinstance(error, UnrecoverableShards):
            raise
        if confirm is not None:
            confirm(error)  # not a member's death: the error is this process's own
        log.warning("worker %s abandons the live reshard of generation %d: %s", worker_id, plan.generation, error)
        raise ReshardAbandoned(plan.generation, previous) from error
    if isinstance(group, SideGroup):
        group.close()
    log.info("worker %s resharded live for generation %d (%d holders -> %d receivers) in %.1f ms", worker_id,
             plan.generation, len(reshard.holders), len(reshard.receivers), (time.perf_counter() - started) * 1e3)


def _log_replicas_of_the_dead(worker_id: str, previous: list[str], holding: list[str], shards: int) -> None:
    """One line per dead member whose shard this member holds as its replica (HSDP: no mirror needed)."""
    for index, member in enumerate(previous):
        replica = index % shards == previous.index(worker_id) % shards if worker_id in previous else False
        if member not in holding and replica:
            log.warning("worker %s holds the shard of dead worker %s as its replica (HSDP shard %d of %d)", worker_id,
                        member, index % shards, shards)


def len_of_world(world: int) -> int:
    """One shard per member (FSDP): a front-end's ``shard_count`` when it has none."""
    return world


def _transfer_group(store: dist.Store, prefix: str, rank: int, size: int, backend: str, timeout: timedelta,
                    side_group: SideGroupMaker | None) -> Any:
    """The reshard's transfer group: a side group failed with the plan's generation when the engine offers one."""
    if side_group is None:
        return make_transfer_group(store, prefix, rank, size, backend, timeout)
    return side_group(lambda client: make_transfer_group(client, prefix, rank, size, backend, timeout))
