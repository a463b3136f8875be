"""Who mirrors whose shard in an ``elan_fsdp`` generation, and who holds each old shard after members die (issue 24).

Each member's shard (its rows of every parameter and optimizer state) is mirrored in the host memory of the next rank
of the ring (:func:`mirror_holder`). After a death the survivors hold every old shard — each its own, and the shard of
a dead ward from its mirror — unless a shard and its mirror both died (:class:`ShardsLost`). Pure logic: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_elan.replication.shard_layout import row_moves

__all__ = ["OwnedMove", "ShardsLost", "mirror_holder", "mirror_ward", "owned_row_moves", "shard_owners"]


@dataclass(frozen=True)
class OwnedMove:
    """Rows ``[start, end)`` of old shard ``old_index``, from ``source`` (which holds that shard, its own or a mirror)
    to ``target`` (whose new shard they belong to); members named by their rank in the group the move runs on."""

    old_index: int
    source: int
    target: int
    start: int
    end: int


class ShardsLost(RuntimeError):
    """Some shards died together with their mirrors: the job's model and optimizer state cannot be rebuilt."""

    def __init__(self, lost: list[tuple[int, str, str]]) -> None:
        described = "; ".join(f"shard {index} (worker {owner}) and its mirror (worker {holder})"
                              for index, owner, holder in lost)
        super().__init__(f"{len(lost)} shard(s) of the model and optimizer state died with their mirrors: {described}")
        self.lost = lost


def mirror_holder(rank: int, world: int) -> int:
    """The rank whose host memory mirrors ``rank``'s shard (the next one in the ring; itself when alone)."""
    _check(rank, world)
    return (rank + 1) % world


def mirror_ward(rank: int, world: int) -> int:
    """The rank whose shard ``rank`` mirrors (the previous one in the ring)."""
    _check(rank, world)
    return (rank - 1) % world


def shard_owners(previous_members: Sequence[str], survivors: Sequence[str]) -> list[str]:
    """For each old shard (``previous_members`` in old rank order), the survivor that holds its rows: its own member
    or, for a dead one, its mirror holder; :class:`ShardsLost` when a shard and its mirror both died."""
    alive = set(survivors)
    world = len(previous_members)
    owners, lost = [], []
    for index, member in enumerate(previous_members):
        holder = previous_members[mirror_holder(index, world)]
        if member in alive:
            owners.append(member)
        elif holder in alive and world > 1:
            owners.append(holder)
        else:
            lost.append((index, member, holder))
    if lost:
        raise ShardsLost(lost)
    return owners


def owned_row_moves(length: int, owners: Sequence[int], receivers: Sequence[int]) -> list[OwnedMove]:
    """Every move that takes the rows of the old layout (shard ``i`` held by ``owners[i]``; an owner may hold two) to
    the ``receivers``' layout; each row of the tensor is in exactly one move."""
    moves = row_moves(length, range(len(owners)), receivers)
    return [OwnedMove(move.source, owners[move.source], move.target, move.start, move.end) for move in moves]


def _check(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"no rank {rank} in a world of {world}")
