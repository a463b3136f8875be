"""Where the rows of a tensor sharded on its first dimension lie before and after a resize, and which rows move.

FSDP2 (``fully_shard``) shards each parameter, and the optimizer's state alike, on dim 0 over its mesh's ranks in
order: the shard of the mesh's ``index``-th rank is rows ``[index·c, (index+1)·c) ∩ [0, n)`` with ``c = ⌈n / world⌉``
(``_chunk_with_empty``: the last shards short or empty; FSDP pads each to ``c`` rows). At a resize every member
computes the same moves from the old holders' order and the new one: each receiver gets only the rows of its new shard,
from the members that hold them; rows a member already holds are a move to itself (a local copy). No member ever holds
more than its old and its new shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RowMove", "row_moves", "shard_count", "shard_rows"]


@dataclass(frozen=True)
class RowMove:
    """Rows ``[start, end)`` of a tensor, from the member ``source`` (which holds them) to ``target`` (whose new shard
    they belong to); members are named by their rank in the group the move runs on."""

    source: int
    target: int
    start: int
    end: int


def shard_count(world: int, group_size: int | None) -> int:
    """How many shards a generation of ``world`` members cuts each tensor into: ``group_size`` under HSDP when it
    divides the world into two or more replica groups (member ``p`` then holds shard ``p % group_size``, as a 2-D
    mesh's shard dimension does), else one per member (FSDP over all of them, a size that is not a multiple too)."""
    if world < 1 or (group_size is not None and group_size < 1):
        raise ValueError(f"no layout of {world} members in shard groups of {group_size}")
    if group_size is None or world % group_size or world == group_size:
        return world
    return group_size


def shard_rows(length: int, world: int, index: int) -> tuple[int, int]:
    """The rows ``[start, end)`` the ``index``-th of ``world`` shard holders holds of a tensor of ``length`` rows."""
    if world < 1 or not 0 <= index < world or length < 0:
        raise ValueError(f"no shard {index} of {world} for {length} rows")
    chunk = -(-length // world)
    return min(index * chunk, length), min((index + 1) * chunk, length)


def row_moves(length: int, holders: Sequence[int], receivers: Sequence[int]) -> list[RowMove]:
    """Every move that takes the rows of the ``holders``' layout (in shard order) to the ``receivers``' layout, by
    receiver then row; each row of the tensor is in exactly one move."""
    if not holders or not receivers:
        raise ValueError("a reshard needs holders and receivers")
    moves = []
    for target_index, target in enumerate(receivers):
        start, end = shard_rows(length, len(receivers), target_index)
        for source_index, source in enumerate(holders):
            held_start, held_end = shard_rows(length, len(holders), source_index)
            low, high = max(start, held_start), min(end, held_end)
            if low < high:
                moves.append(RowMove(source, target, low, high))
    return moves
