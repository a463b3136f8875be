"""PreLoopCollectives: a member's death in a collective before the training loop is recovered from, and the survivors
run the same collectives again from the earliest one any of them had not completed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lightning_elan.elastic.pre_loop import PreLoopCollectives


class _Death(RuntimeError):
    """What a collective raises when a member died in it (gloo's "Connection reset by peer")."""


class _Member:
    """One member's view: its collectives log their names; ``earliest`` answers with the survivors' earliest."""

    def __init__(self, earliest_positions: list[int | None] | None = None) -> None:
        self.ran: list[str] = []
        self.recoveries = 0
        self.published: list[int | None] = []
        self._earliest_positions = list(earliest_positions or [])
        self.collectives = PreLoopCollectives(self._recover, self._earliest)

    def _recover(self, error: BaseException) -> None:
        if not isinstance(error, _Death):
            raise error
        self.recoveries += 1

    def _earliest(self, position: int | None) -> int | None:
        self.published.append(position)
        if position is None:
            return None
        return self._earliest_positions.pop(0) if self._earliest_positions else position

    def collective(self, name: str, fails: int = 0, result: Any = None) -> Callable[[], Any]:
        left = [fails]

        def run() -> Any:
            self.ran.append(name)
            if left[0]:
                left[0] -= 1
                raise _Death(name)
            return result

        return run


def test_a_collective_a_member_died_in_runs_again_after_the_recovery() -> None:
    member = _Member()

    assert member.collectives.run(member.collective("barrier", fails=1, result="done")) == "done"
    assert member.ran == ["barrier", "barrier"]
    assert member.recoveries == 1
    assert member.published == [0]


def test_a_member_ahead_runs_again_what_a_survivor_behind_had_not_completed() -> None:
    member = _Member(earliest_positions=[1])
    member.collectives.run(member.collective("pre_setup"))
    member.collectives.run(member.collective("broadcast_dirpath"))

    assert member.collectives.run(member.collective("post_setup", fails=1, result=7)) == 7
    assert member.ran == ["pre_setup", "broadcast_dirpath", "post_setup", "broadcast_dirpath", "post_setup"]
    assert member.published == [2]


def test_a_second_death_during_the_replay_replays_from_the_newest_earliest() -> None:
    member = _Member(earliest_positions=[1, 0])
    member.collectives.run(member.collective("a"))
    member.collectives.run(member.collective("b", fails=0))
    replayed_b_fails = member.collective("b", fails=1)
    member.collectives._calls[1] = replayed_b_fails  # the replay of "b" meets the second death

    member.collectives.run(member.collective("c", fails=1))
    assert member.ran == ["a", "b", "c", "b", "a", "b", "c"]
    assert member.recoveries == 2
    assert member.published == [2, 1]


def test_a_survivor_in_the_training_loop_replays_before_its_batch_is_redone() -> None:
    member = _Member(earliest_positions=[1])
    member.collectives.run(member.collective("pre_setup"))
    member.collectives.run(member.collective("resume_end"))
    member.collectives.loop_started()

    member.collectives.catch_up()
    assert member.ran == ["pre_setup", "resume_end", "resume_end"]
    assert member.published == [2]


def test_after_the_first_committed_step_nothing_is_kept_or_agreed() -> None:
    member = _Member()
    member.collectives.run(member.collective("pre_setup"))
    member.collectives.loop_started()
    member.collectives.batch_started()
    member.collectives.step_committed()

    member.collectives.catch_up()
    assert member.published == []
    with pytest.raises(_Death):
        member.collectives.run(member.collective("validation_reduce", fails=1))


def test_the_loops_start_hooks_are_kept_until_the_first_batch_starts() -> None:
    """``on_train_start`` and the first epoch's ``on_train_epoch_start`` come after the loop started: a death in their
    collectives is recovered inside them, and a survivor ahead replays them once its first batch met the death."""
    member = _Member(earliest_positions=[1, 1])
    member.collectives.run(member.collective("post_setup"))
    member.collectives.loop_started()
    member.collectives.run(member.collective("epoch_seed", fails=1))
    assert member.ran == ["post_setup", "epoch_seed", "epoch_seed"]
    assert member.recoveries == 1

    member.collectives.batch_started()
    member.collectives.catch_up()
    assert member.ran == ["post_setup", "epoch_seed", "epoch_seed", "epoch_seed"]
    assert member.published == [1, 2]


def test_in_a_batch_a_collective_is_not_retried_here() -> None:
    member = _Member()
    member.collectives.loop_started()
    member.collectives.batch_started()

    with pytest.raises(_Death):
        member.collectives.run(member.collective("sync_dist", fails=1))
    assert member.recoveries == 0


def test_a_joiner_tells_the_survivors_it_has_nothing_to_replay() -> None:
    member = _Member()
    member.collectives.joined()
    member.collectives.loop_started()

    member.collectives.catch_up()
    assert member.published == [None]
    assert member.ran == []


def test_an_error_that_is_not_a_death_reaches_the_user() -> None:
    member = _Member()

    def broken() -> None:
        raise ValueError("the user's broadcast object cannot be pickled")

    with pytest.raises(ValueError, match="pickled"):
        member.collectives.run(broken)
    assert member.published == []


# ---------------------------------------------------------------------- between two training batches


def test_once_a_batch_stands_its_end_hooks_collectives_are_recovered_inside_themselves() -> None:
    """The ``Timer``'s broadcast in ``on_train_batch_end``: a member's death in it is recovered from there, and the
    broadcast runs again in the new generation (the hook is not run again)."""
    member = _Member()
    member.collectives.loop_started()
    member.collectives.step_committed()
    member.collectives.batch_stood()

    assert member.collectives.run(member.collective("timer_broadcast", fails=1, result=False)) is False
    assert member.ran == ["timer_broadcast", "timer_broadcast"]
    assert (member.recoveries, member.published) == (1, [0])


def test_a_survivor_already_at_the_boundary_replays_the_end_hooks_collectives_with_one_behind() -> None:
    """A broadcast's receiver completed the ``Timer``'s broadcast and the ``ModelCheckpoint``'s save barrier, and met
    the death at the batch boundary; the source met it in the broadcast (position 0): the receiver runs both again."""
    member = _Member(earliest_positions=[0])
    member.collectives.loop_started()
    member.collectives.batch_stood()
    member.collectives.run(member.collective("timer_broadcast"))
    member.collectives.run(member.collective("checkpoint_barrier"))

    member.collectives.catch_up()
    assert member.ran == ["timer_broadcast", "checkpoint_barrier", "timer_broadcast", "checkpoint_barrier"]
    assert member.published == [2]


def test_a_survivor_in_the_next_batch_keeps_the_last_batch_end_collectives_until_its_step_commits() -> None:
    member = _Member(earliest_positions=[0])
    member.collectives.loop_started()
    member.collectives.batch_stood()
    member.collectives.run(member.collective("timer_broadcast"))
    member.collectives.batch_started()

    with pytest.raises(_Death):  # the batch's own collective (a sync_dist reduction): the batch is redone
        member.collectives.run(member.collective("training_step_reduce", fails=1))
    member.collectives.catch_up()
    assert member.ran == ["timer_broadcast", "training_step_reduce", "timer_broadcast"]
    assert member.published == [1]

    member.collectives.step_committed()
    member.collectives.catch_up()
    assert member.published == [1]


def test_a_joiner_of_the_last_boundary_has_no_end_hooks_collectives_until_a_batch_stands() -> None:
    member = _Member()
    member.collectives.loop_started()
    member.collectives.joined()

    member.collectives.catch_up()
    assert member.published == [None]
    member.collectives.batch_stood()
    member.collectives.run(member.collective("timer_broadcast"))
    member.collectives.catch_up()
    assert member.published == [None, 1]


def test_after_the_training_loop_nothing_is_kept() -> None:
    member = _Member()
    member.collectives.loop_started()
    member.collectives.batch_stood()
    member.collectives.run(member.collective("epoch_end_reduce"))
    member.collectives.loop_ended()

    member.collectives.catch_up()
    assert member.published == []
    with pytest.raises(_Death):
        member.collectives.run(member.collective("on_train_end_barrier", fails=1))
    assert member.collectives.before_loop is False
