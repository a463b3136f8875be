"""The job of ``elan run`` (``master/transitions/launching.py``): ``start_job`` and the launcher's poll."""

from __future__ import annotations

import pytest

from lightning_elan.master.state import SPAWNED, JobState, StateError
from lightning_elan.master.transitions import launching, requests
from lightning_elan.protocol.contract import LauncherPollReply, SpawnOrder, StartJobReply


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"nproc": 0}, "nproc must be ≥ 1, got 0"),
        ({"nproc": 2, "hosts": ["a"]}, "hosts must list one host per worker: got 1 for nproc 2"),
        ({"nproc": 1, "hosts": {"w7": "a"}}, "hosts names unknown workers ['w7']"),
        ({"nproc": 1, "coordinate_every": 0}, "coordinate_every must be ≥ 1, got 0"),
    ],
)
def test_start_job_refuses_bad_arguments(arguments: dict, message: str) -> None:
    with pytest.raises(StateError) as refused:
        launching.start_job(JobState(job="job"), **arguments)

    assert str(refused.value) == message


def test_start_job_forms_generation_zero_with_its_hosts_once() -> None:
    state = JobState(job="job")

    first = launching.start_job(state, 2, hosts={"w1": "b"}, report_timeout_s=30.0, min_workers=2)

    assert first == StartJobReply(0, ["w0", "w1"]) == launching.start_job(state, 5)
    assert (state.host_of("w0"), state.host_of("w1")) == (None, "b")
    assert (state.report_timeout_s, state.min_workers, state.next_worker) == (30.0, 2, 2)


def test_the_poll_starts_each_requested_worker_once_and_stops_the_late_ones() -> None:
    state = JobState(job="job")
    launching.start_job(state, 1, report_timeout_s=10.0)
    requests.scale(state, "add", count=1)

    first = launching.launcher_poll(state, now=100.0)
    assert first == LauncherPollReply([SpawnOrder("w1", "r1")], [], False)
    assert state.pending_workers["w1"].status == SPAWNED
    assert launching.launcher_poll(state, now=105.0).spawn == []
    assert launching.launcher_poll(state, now=111.0).stop == ["w1"]
