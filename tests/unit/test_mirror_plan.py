"""The shard mirror's ring and who holds each old shard after deaths (``replication.mirror_plan``, issue 24)."""

from __future__ import annotations

import pytest

from lightning_elan.replication.mirror_plan import (
    OwnedMove,
    ShardsLost,
    mirror_holder,
    mirror_ward,
    owned_row_moves,
    shard_owners,
)


def test_each_shard_is_mirrored_by_the_next_rank_of_the_ring() -> None:
    assert [mirror_holder(rank, 3) for rank in range(3)] == [1, 2, 0]
    assert [mirror_ward(rank, 3) for rank in range(3)] == [2, 0, 1]
    assert mirror_holder(0, 1) == mirror_ward(0, 1) == 0


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (-1, 3), (0, 0)])
def test_a_rank_outside_the_world_is_refused(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="no rank"):
        mirror_holder(rank, world)


def test_a_dead_members_shard_is_held_by_its_mirror_holder() -> None:
    assert shard_owners(["w0", "w1", "w2"], ["w0", "w2"]) == ["w0", "w2", "w2"]
    assert shard_owners(["w0", "w1", "w2"], ["w1", "w2"]) == ["w1", "w1", "w2"]
    assert shard_owners(["w0", "w1"], ["w0"]) == ["w0", "w0"]
    assert shard_owners(["w0", "w1", "w2", "w3"], ["w1", "w3"]) == ["w1", "w1", "w3", "w3"]


def test_a_shard_that_died_with_its_mirror_is_named() -> None:
    with pytest.raises(ShardsLost, match=r"shard 1 \(worker w1\) and its mirror \(worker w2\)") as lost:
        shard_owners(["w0", "w1", "w2"], ["w0"])
    assert lost.value.lost == [(1, "w1", "w2")]


def test_a_lone_member_has_no_mirror() -> None:
    with pytest.raises(ShardsLost):
        shard_owners(["w0"], [])


def test_owned_moves_cover_every_row_once_from_its_owner() -> None:
    moves = owned_row_moves(10, [0, 1, 1], [0, 1])  # shard 2's owner died: its mirror on rank 1 holds it
    assert moves == [OwnedMove(0, 0, 0, 0, 4), OwnedMove(1, 1, 0, 4, 5), OwnedMove(1, 1, 1, 5, 8),
                     OwnedMove(2, 1, 1, 8, 10)]
    rows = sorted((move.start, move.end) for move in moves)
    assert [row for start, end in rows for row in range(start, end)] == list(range(10))
