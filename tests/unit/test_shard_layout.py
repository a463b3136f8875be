"""Which rows of a dim-0-sharded tensor move at a resize (``replication/shard_layout.py``): FSDP2's layout, each row
moved once, from a member that holds it to the member whose new shard it is in."""

from __future__ import annotations

import pytest

from lightning_elan.replication.shard_layout import RowMove, row_moves, shard_rows


def test_the_layout_is_fsdp2s_chunks_with_the_last_ones_short_or_empty() -> None:
    assert [shard_rows(13, 3, i) for i in range(3)] == [(0, 5), (5, 10), (10, 13)]
    assert [shard_rows(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]  # torch.chunk: 3 chunks
    assert [shard_rows(2, 3, i) for i in range(3)] == [(0, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize(("length", "holders", "receivers"), [
    (13, [0, 1], [0, 1, 2]), (13, [0, 1, 2], [0, 1]), (13, [0, 1], [0, 2]), (5, [0, 1, 2, 3], [3, 1]),
    (1, [0, 1], [1, 0, 2]), (0, [0], [0, 1]), (64, [2, 0, 1], [1, 2, 0, 3, 4]),
])
def test_every_row_moves_once_from_a_holder_to_its_new_owner(length: int, holders: list[int],
                                                              receivers: list[int]) -> None:
    moves = row_moves(length, holders, receivers)
    moved = sorted(row for move in moves for row in range(move.start, move.end))
    assert moved == list(range(length))
    for move in moves:
        held = shard_rows(length, len(holders), holders.index(move.source))
        owned = shard_rows(length, len(receivers), receivers.index(move.target))
        assert held[0] <= move.start < move.end <= held[1], move
        assert owned[0] <= move.start < move.end <= owned[1], move


def test_rows_a_member_keeps_are_a_local_move_and_a_leaver_only_sends() -> None:
    moves = row_moves(13, [0, 1, 2], [0, 1])  # 3 -> 2: rank 2 leaves
    assert RowMove(0, 0, 0, 5) in moves and RowMove(1, 1, 7, 10) in moves
    assert all(move.target != 2 for move in moves)
    assert {move.source for move in moves if move.target == 1} == {1, 2}


def test_a_joiner_only_receives_and_nothing_else_moves_twice() -> None:
    moves = row_moves(12, [0, 1], [0, 1, 2])  # 6+6 -> 4+4+4
    assert moves == [RowMove(0, 0, 0, 4), RowMove(0, 1, 4, 6), RowMove(1, 1, 6, 8), RowMove(1, 2, 8, 12)]


def test_impossible_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="needs holders and receivers"):
        row_moves(4, [], [0])
    with pytest.raises(ValueError, match="no shard 3 of 3"):
        shard_rows(4, 3, 3)
