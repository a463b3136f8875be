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
    member.collectives.step_committed()

    member.collectives.catch_up()
    assert member.published == []
    with pytest.raises(_Death):
        member.collectives.run(member.collective("validation_reduce", fails=1))


def test_in_the_loop_a_collective_is_not_retried_here() -> None:
    member = _Member()
    member.collectives.loop_started()

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
