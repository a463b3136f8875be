"""``elan_fsdp``'s shard mirror in the training step, and the recovery of a dead member's shard from it (issue 24).

:class:`StepMirroring` is what :class:`~lightning_elan.strategy.fsdp.ElanFSDPStrategy` does around each optimizer step
(``replication.shard_mirror``: seed the mirror at the end of a reshard or as the launch generation's loop starts,
exchange the reduced gradients before the commit vote, advance the mirror once the step committed) and at a recovery
(``replication.fsdp_recover``: every survivor gives its own shard and, if its ward died, the ward's from the mirror; the
rows go to the new layout). A member's death that no mirror covers — the job has a single member, an optimizer that
cannot be replayed on a shard, manual optimization (:func:`unmirrored_because`), the mirror of the
generation was not seeded yet (seeded at the end of a resize's or recovery's reshard, before its commit vote, and as
the launch generation's training loop starts) — stops the job with :class:`LostShard`, naming why. A death while the
shards move to a new layout abandons that reshard: each member keeps its old rows and its mirror until every
participant has its new shard and the new mirrors are seeded (the reshard's commit vote), so the recovery starts from
the old layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_elan.elastic.live_reshard import ReshardGroup, UnrecoverableShards
from lightning_elan.replication.fsdp_recover import recover_fsdp
from lightning_elan.replication.fsdp_reshard import ShardModules, describe_optimizers, held_shards, reshard_fsdp
from lightning_elan.replication.reshard import DEFAULT_CHUNK_BYTES
from lightning_elan.replication.shard_mirror import Rows, ShardMirror, mirrorable

log = logging.getLogger(__name__)

__all__ = ["LostShard", "StepMirroring", "unmirrored_because"]


class LostShard(UnrecoverableShards):
    """A member of an elan_fsdp job died and its shard of the model and optimizer cannot be rebuilt."""


def unmirrored_because(optimizers: Sequence[torch.optim.Optimizer], automatic: bool) -> str | None:
    """Why the steps of this fit cannot be mirrored exactly (None: they can). Clipped gradients can: the mirrors
    receive each step's gradients as the optimizer applies them, after any clipping."""
    if not automatic:
        return "manual optimization: a redone batch undoes the steps it applied, which the mirrors cannot"
    return mirrorable(optimizers)


class StepMirroring:
    """One member's shard mirror across the steps and generations of a fit."""

    def __init__(self, worker_id: str) -> None:
        self._worker_id = worker_id
        self._mirror = ShardMirror()
        self._exchanged = False  # this step's gradients are in the mirrors: advance once it committed
        self._old: _OldShards | None = None  # the old layout's rows while a reshard has not committed
        self.replicated = False  # HSDP with replica groups: a dead member's shard is held by its replicas, no mirror
        self.step_seconds: list[float] = []  # the mirror's own time per step (seed, exchange, advance)

    @property
    def seeded(self) -> bool:
        """Whether this member's mirror of its ward's shard is seeded in the current generation."""
        return self._mirror.seeded

    @property
    def covers_a_death(self) -> bool:
        """Whether a member's death now loses no shard: the mirrors are seeded, or every shard has replicas."""
        return self.replicated or self._mirror.seeded

    def before_vote(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], index: int,
                    group: Any, unmirrored: str | None) -> None:
        """After the step's backward: seed the mirror if this generation has none, send the gradients to it
        (nothing when ``unmirrored`` says why the steps cannot be mirrored)."""
        self._exchanged = False
        if group.size() < 2 or unmirrored is not None or self.replicated:
            return
        started = time.perf_counter()
        self.seed(model, optimizers, group, unmirrored)
        self._mirror.exchange_gradients(model, group)
        self._mirror.capture_hyperparameters(optimizers)
        self._index, self._exchanged = index, True
        self.step_seconds.append(time.perf_counter() - started)

    def seed(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], group: Any,
             unmirrored: str | None) -> None:
        """At a step boundary (the end of a reshard, or a generation's first step): the full copy of the shards into
        the mirrors, if this generation has none yet."""
        if not self._mirror.seeded:
            self._mirror = self._seeded_mirror(model, optimizers, group, unmirrored) or self._mirror

    def _seeded_mirror(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], group: Any,
                       unmirrored: str | None) -> ShardMirror | None:
        """A new mirror of this member's ward in ``group``'s layout, seeded (a collective: the full copy of every
        member's shard into its holder); None when the steps cannot be mirrored."""
        if group is None or group.size() < 2 or unmirrored is not None or self.replicated:
            return None
        mirror = ShardMirror()
        received = mirror.seed(model, optimizers, group)
        log.info("worker %s mirrors the shard of rank %d (%.1f MB)", self._worker_id, mirror.ward, received / 1e6)
        return mirror

    def hyperparameters_changed(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The step's hyperparameters were set after its gradients went to the mirror (a front-end that scales the
        learning rate by the LR ramp after the commit vote): the mirror replays the step with these."""
        if self._exchanged:
            self._mirror.capture_hyperparameters(optimizers)

    def after_step(self) -> None:
        """The step committed and applied here: apply it to the mirror too."""
        if self._exchanged:
            started = time.perf_counter()
            self._mirror.advance(self._index)
            self._exchanged = False
            self.step_seconds[-1] += time.perf_counter() - started

    def settle(self) -> None:
        """Wait for the mirror's replay of the last step (before the process ends)."""
        self._mirror.settle()

    def check_recoverable(self, world_size: int, unmirrored: str | None) -> None:
        """Before a recovery: :class:`LostShard` when no mirror (nor replica) can cover a dead member."""
        if self.replicated:
            return  # a shard that died with all its replicas: ShardsLost, when the recovery's holders are known
        why = "the job had a single member" if world_size < 2 else unmirrored
        if why is not None:
            raise LostShard(f"worker {self._worker_id}: a member of this sharded (FSDP2) job died and its shard "
                            f"of the model and optimizer state cannot be rebuilt ({why}); restart the job from its "
                            "last checkpoint")

    def describe(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[dict[str, Any]]:
        """The optimizers as a holder describes them for a reshard (a joiner's skeleton): those of the old layout
        while an abandoned reshard left the shards there (the optimizers' states are then in the kept rows)."""
        return self._old.skeleton if self._old is not None else describe_optimizers(model, optimizers)

    def move(self, reshard: ReshardGroup, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
             shard_modules: ShardModules, mesh: Any, skeleton: list[dict[str, Any]], chunk_bytes: int,
             generation_group: Any, unmirrored: str | None) -> None:
        """A front-end's live reshard (``LiveResharding.reshard_live``, both front-ends): a planned resize's rows to
        the new layout, or after a death the recovery from the mirrors; then the receivers seed the new generation's
        mirrors, before the commit vote, so a death at any moment after the vote is covered (before, they were seeded
        after it: a death between the two lost a shard, ``LostShard``). ``mesh``: the new generation's (None on a
        leaver); ``skeleton``: the optimizers as a holder describes them.

        Until every participant has its new shard and the new mirrors are seeded (``reshard.agree``) this member's old
        rows and its old mirror stay: a death before that abandons the reshard, and the recovery starts again from
        them (the old layout). For that while a receiver holds both mirrors (its memory grows by one more shard)."""
        receiving = reshard.rank in reshard.receivers
        mesh = mesh if receiving else None
        holding = reshard.rank in reshard.holders
        if self._old is None and holding and (reshard.owners is None or reshard.previous_index is not None):
            self._old = _OldShards(held_shards(model, optimizers), skeleton)
        if self._old is not None:
            skeleton = self._old.skeleton
        if reshard.owners is not None:
            self.recover(reshard, model, optimizers, shard_modules, mesh, skeleton, chunk_bytes)
        else:
            reshard_fsdp(model, optimizers, shard_modules, reshard.holders, reshard.receivers, mesh,
                         group=reshard.group, skeleton=skeleton, chunk_bytes=chunk_bytes,
                         held=self._old.rows if self._old is not None else None)
        mirror = self._seeded_mirror(model, optimizers, generation_group, unmirrored) if receiving else None
        reshard.agree()  # every participant has its new shard, mirrored: the old ones and the mirror of them go
        self._old = None
        self._mirror.forget()
        self._mirror = mirror or self._mirror

    def recover(self, reshard: ReshardGroup, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                shard_modules: ShardModules, mesh: Any, skeleton: list[dict[str, Any]],
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        """After a death: the old shards (each survivor's own, a dead ward's from its mirror) to the new layout."""
        assert reshard.owners is not None
        me = reshard.rank
        ward = self._mirror.ward
        needs_mirror = ward is not None and reshard.owners[ward] == [me] and ward != reshard.previous_index
        missing = reshard.previous_index is not None and not self._mirror.seeded and _holds_a_dead_shard(reshard)
        if _any_member(reshard.group, missing):
            raise LostShard(f"worker {self._worker_id}: a member of this sharded (FSDP2) job died before its "
                            "shard was mirrored in this generation (the mirrors are seeded at the end of a resize, or "
                            "as the launch generation's training loop starts); restart the job from its last "
                            "checkpoint")
        mirrored = {ward: self._mirror.rows()} if needs_mirror else {}
        if mirrored:
            log.warning("worker %s restores the shard of dead rank %d from its mirror", self._worker_id, ward)
        own = self._old.rows if self._old is not None and reshard.previous_index is not None else None
        recover_fsdp(model, optimizers, shard_modules, reshard.owners, reshard.receivers, mesh, reshard.group,
                     skeleton, reshard.previous_index, mirrored, own_rows=own, chunk_bytes=chunk_bytes,
                     shards=reshard.new_shards, hosts=reshard.hosts)


class _OldShards:
    """A holder's rows and optimizer skeleton of the layout a live reshard started from, kept until it commits."""

    def __init__(self, rows: Rows, skeleton: list[dict[str, Any]]) -> None:
        self.rows, self.skeleton = rows, skeleton


def _holds_a_dead_shard(reshard: ReshardGroup) -> bool:
    """Whether this survivor is the owner of a shard that is not its own (it must have a mirror)."""
    assert reshard.owners is not None
    return any(reshard.rank in holders and index != reshard.previous_index
               for index, holders in enumerate(reshard.owners))


def _any_member(group: Any, flag: bool) -> bool:
    """Whether ``flag`` is set on any member of ``group`` (a c10d backend: one small all-reduce)."""
    value = torch.tensor([1.0 if flag else 0.0])
    group.allreduce([value]).wait()
    return bool(value.item() > 0)
