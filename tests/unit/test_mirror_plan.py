"""The shard mirror's ring and who holds each old shard after deaths (``replication.mirror_plan``, issue 24)."""

from __future__ import annotations

import pytest

from lightning_elan.replication.mirror_plan import (
    OwnedMove,
    ShardsLost,
    mirror_holder,
    mirror_ward,
    owned_row_moves,
    shard_holders,
    shard_owners,
)
from lightning_elan.replication.shard_layout import shard_count


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


def test_shard_count_is_the_group_size_only_with_two_or_more_replica_groups() -> None:
    assert [shard_count(world, 2) for world in (1, 2, 3, 4, 5, 6)] == [1, 2, 3, 2, 5, 2]
    assert shard_count(6, 3) == 3 and shard_count(6, None) == 6 and shard_count(4, 1) == 1
    with pytest.raises(ValueError):
        shard_count(4, 0)


def test_hsdp_shard_holders_are_the_living_replicas() -> None:
    members = ["w0", "w1", "w2", "w3"]  # shard 0: w0, w2; shard 1: w1, w3
    assert shard_holders(members, members, 2) == [["w0", "w2"], ["w1", "w3"]]
    assert shard_holders(members, ["w0", "w2", "w3"], 2) == [["w0", "w2"], ["w3"]]
    assert shard_holders(["w0", "w1", "w2"], ["w0", "w2"], 3) == [["w0"], ["w2"], ["w2"]]  # FSDP: the mirror holder
    lost = r"died with their replicas: shard 1 \(worker w1\) and its replica \(worker w3\)"
    with pytest.raises(ShardsLost, match=lost):
        shard_holders(members, ["w0", "w2"], 2)


def test_a_leaving_replica_group_moves_nothing() -> None:
    """HSDP over 4 (2 shards of a 10-row tensor) to FSDP over the first 2: each keeps its shard, a local copy."""
    moves = owned_row_moves(10, [[0, 2], [1, 3]], [0, 1], shards=2)
    assert all(move.source == move.target for move in moves)
    assert moves == [OwnedMove(0, 0, 0, 0, 5), OwnedMove(1, 1, 1, 5, 10)]


def test_a_joining_shard_group_is_healed_shard_for_shard_from_a_replica() -> None:
    """FSDP over 2 to HSDP over 4 (shards of 2): the joiners 2 and 3 take shard 0 from rank 0 and shard 1 from
    rank 1, whole; HSDP 4 to 6: the third replica group's sources are spread over the replicas."""
    moves = owned_row_moves(10, [[0], [1]], [0, 1, 2, 3], shards=2)
    assert [move for move in moves if move.source != move.target] == [OwnedMove(0, 0, 2, 0, 5),
                                                                          OwnedMove(1, 1, 3, 5, 10)]
    grown = owned_row_moves(10, [[0, 2], [1, 3]], [0, 1, 2, 3, 4, 5], shards=2)
    assert [(move.source, move.target) for move in grown if move.source != move.target] == [(0, 4), (1, 5)]
    for target in range(6):
        rows = sorted((move.start, move.end) for move in grown if move.target == target)
        start = 0 if target % 2 == 0 else 5
        assert [row for low, high in rows for row in range(low, high)] == list(range(start, start + 5))


def test_replicated_receivers_of_a_shard_spread_over_its_holders() -> None:
    """FSDP over 3 to HSDP over 4: every receiver gets each row of its new shard once, from a holder of it."""
    moves = owned_row_moves(12, [[0], [1], [2]], [0, 1, 2, 3], shards=2)
    for target in range(4):
        rows = sorted((move.start, move.end) for move in moves if move.target == target)
        start = 0 if target % 2 == 0 else 6
        assert [row for low, high in rows for row in range(low, high)] == list(range(start, start + 6))
    assert all(move.source == move.old_index for move in moves)


def test_a_replicated_shard_is_taken_from_a_holder_on_the_receivers_host() -> None:
    """HSDP over 4 to 6. Hosts a, b, a, b, b, b: shard 0's holders (ranks 0, 2) are both on a, so joiner 4 (on b) takes
    it by turn (rank 0); joiner 5 takes shard 1 from rank 1, on its host. Hosts a, b, c, d, c, d: each joiner takes its
    shard from the holder on its own host (ranks 2 and 3), though the turn would have picked ranks 0 and 1."""
    hosts = ["a", "b", "a", "b", "b", "b"]
    moves = owned_row_moves(10, [[0, 2], [1, 3]], [0, 1, 2, 3, 4, 5], shards=2, hosts=hosts)
    remote = {move.target: move.source for move in moves if move.source != move.target}
    assert remote == {4: 0, 5: 1}
    local = owned_row_moves(10, [[0, 2], [1, 3]], [0, 1, 2, 3, 4, 5], shards=2, hosts=["a", "b", "c", "d", "c", "d"])
    assert {move.target: move.source for move in local if move.source != move.target} == {4: 2, 5: 3}
