"""The arithmetic of ``bench.fsdp_reshard``: the bytes a live reshard must move (its copy floor's numerator) and the
stop-and-restart schedule read from an ``elan run --schedule``."""

from __future__ import annotations

from bench.fsdp_reshard import moved_bytes, parameter_rows, restart_schedule
from bench.sizes import MODEL_SIZES


def test_the_rows_are_the_models_parameters() -> None:
    rows = parameter_rows("25m")
    assert sum(count * row_bytes for count, row_bytes in rows) == MODEL_SIZES["25m"].parameters() * 4


def test_a_growth_from_2_to_3_moves_half_the_state_and_a_migration_the_leavers_shard() -> None:
    state = MODEL_SIZES["1m"].parameters() * 12
    grown = moved_bytes("1m", ["w0", "w1"], ["w0", "w1", "w2"], ["w2"])
    migrated = moved_bytes("1m", ["w0", "w1"], ["w0", "w2"], ["w2"])
    # thirds from halves: rank 1's new third is half rank 0's old rows, rank 2's all rank 1's: 1/6 + 1/3 of the rows
    assert abs(grown - state / 2) <= 0.01 * state
    assert abs(migrated - state / 2) <= 0.01 * state  # the leaver's half goes to the joiner, nothing else moves
    assert moved_bytes("1m", ["w0", "w1"], ["w0", "w1"], []) == 0


def test_the_restart_schedule_follows_the_world_size() -> None:
    assert restart_schedule("10:add=1,30:remove=1,50:migrate=1") == [("add", 10, 3), ("remove", 30, 2),
                                                                      ("migrate", 50, 2)]
    assert restart_schedule("5:add=2, 9:remove=3", world=2) == [("add", 5, 4), ("remove", 9, 1)]
