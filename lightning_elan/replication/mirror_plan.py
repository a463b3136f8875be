"""Who mirrors whose shard in an ``elan_fsdp`` generation, and who holds each old shard after members die (issue 24).

FSDP (one shard per member): each member's shard (its rows of every parameter and optimizer state) is mirrored in the
host memory of the next rank of the ring (:func:`mirror_holder`). After a death the survivors hold every old shard —
each its own, and the shard of a dead ward from its mirror — unless a shard and its mirror both died
(:class:`ShardsLost`). HSDP (shard groups of ``k``, two or more replica groups): member ``p`` holds shard ``p % k``,
as every other member of its replica set does; no mirror: a dead member's shard is held by its living replicas, and
is lost only with all of them. Pure logic: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_elan.replication.shard_layout import shard_rows

__all__ = ["OwnedMove", "ShardsLost", "mirror_holder", "mirror_ward", "owned_row_moves", "shard_holders",
           "shard_owners"]


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

    def __init__(self, lost: list[tuple[int, str, str]], copies: str = "mirrors") -> None:
        described = "; ".join(f"shard {index} (worker {owner}) and its {copies[:-1]} (worker {holder})"
                              for index, owner, holder in lost)
        super().__init__(f"{len(lost)} shard(s) of the model and optimizer state died with their {copies}: {described}")
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


def shard_holders(previous_members: Sequence[str], survivors: Sequence[str], shards: int) -> list[list[str]]:
    """For each old shard of a layout of ``shards`` shards over ``previous_members`` (in old rank order), the
    survivors that hold its rows: with one shard per member, :func:`shard_owners` (its member or its mirror holder);
    under HSDP, its living replicas. :class:`ShardsLost` when a shard died with its mirror or all its replicas."""
    world = len(previous_members)
    if shards == world:
        return [[owner] for owner in shard_owners(previous_members, survivors)]
    if shards < 1 or world % shards:
        raise ValueError(f"{world} members do not hold {shards} shards in replica groups")
    alive = set(survivors)
    holders = [[member for member in previous_members[index::shards] if member in alive] for index in range(shards)]
    lost = [(index, previous_members[index], ", ".join(previous_members[index + shards::shards]))
            for index, living in enumerate(holders) if not living]
    if lost:
        raise ShardsLost(lost, copies="replicas")
    return holders


def owned_row_moves(length: int, owners: Sequence[int | Sequence[int]], receivers: Sequence[int],
                    shards: int | None = None, hosts: Sequence[str | None] | None = None) -> list[OwnedMove]:
    """Every move that takes the rows of the old layout (shard ``i`` held by ``owners[i]``: a rank, or every rank
    holding a copy of it; a rank may hold two) to the layout of ``shards`` shards (default: one per receiver) over
    the ``receivers``, receiver ``p`` taking shard ``p % shards``. Each receiver gets each row of its new shard in
    exactly one move: from itself when it holds it, else from one of its holders — one on its own host when there is
    one (``hosts``: each rank's host; nearest source) — the receivers of one new shard spread over them (concurrent
    sources)."""
    copies = [[owner] if isinstance(owner, int) else list(owner) for owner in owners]
    shards = len(receivers) if shards is None else shards
    moves = []
    for position, target in enumerate(receivers):
        start, end = shard_rows(length, shards, position % shards)
        for index, holders in enumerate(copies):
            held_start, held_end = shard_rows(length, len(copies), index)
            low, high = max(start, held_start), min(end, held_end)
            if low < high:
                source = target if target in holders else _nearest(holders, target, position // shards, hosts)
                moves.append(OwnedMove(index, source, target, low, high))
    return moves


def _nearest(holders: list[int], target: int, turn: int, hosts: Sequence[str | None] | None) -> int:
    """One of ``holders`` for ``target``: those on its host if any, the ``turn``-th of them round the list."""
    local = [holder for holder in holders if hosts is not None and hosts[holder] is not None and
             hosts[holder] == hosts[target]]
    candidates = local or holders
    return candidates[turn % len(candidates)]


def _check(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"no rank {rank} in a world of {world}")
