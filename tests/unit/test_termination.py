"""A worker's SIGTERM watch (``elastic/termination.py``) against a real in-process AM: the leave it sends, its
fallbacks to the crash path (recorded, not carried out) and its disarming. Real SIGTERMs to this process."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_elan.elastic.termination import TerminationWatch
from lightning_elan.master.server import ApplicationMaster
from lightning_elan.master.store import FileStore
from lightning_elan.protocol import AMClient
from lightning_elan.protocol.contract import WorkerEnvironment

JOB = "job"


@pytest.fixture
def am(tmp_path: Path) -> Iterator[ApplicationMaster]:
    master = ApplicationMaster(JOB, FileStore(tmp_path / "state.json"), state_dir=tmp_path, register=False).start()
    with AMClient(master.address, JOB) as client:
        client.request("start_job", {"nproc": 2, "coordinate_every": 50})
    yield master
    master.stop()


class Kills:
    """Stands in for ``os.kill``: records the crash path instead of taking it."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, pid: int, signum: int) -> None:
        self.calls.append((pid, signum))


@pytest.fixture
def watch_of(am: ApplicationMaster) -> Iterator:
    watches: list[TerminationWatch] = []
    previous = signal.getsignal(signal.SIGTERM)

    def make(
        worker_id: str = "w1", grace_s: float = 30.0, address: str | None = None, repeat_window_s: float = 0.2
    ) -> tuple[TerminationWatch, Kills]:
        environment = WorkerEnvironment.launched(
            job=JOB, worker_id=worker_id, role="member", am_address=address or am.address,
            store_address="127.0.0.1:1", rank=1, world_size=2, term_grace_s=grace_s,
        )
        kills = Kills()
        watch = TerminationWatch(environment, kill=kills, repeat_window_s=repeat_window_s)
        assert watch.install()
        watches.append(watch)
        return watch, kills

    yield make
    for watch in watches:
        watch.disarm()
    signal.signal(signal.SIGTERM, previous)


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_first_sigterm_queues_the_leave_at_the_am_and_the_second_takes_the_crash_path(watch_of, am) -> None:
    watch, kills = watch_of("w1")
    assert not watch.leave_queued

    os.kill(os.getpid(), signal.SIGTERM)
    wait_until(lambda: watch.leave_queued)

    with AMClient(am.address, JOB) as client:
        (pending,) = client.status()["pending"]
    assert (pending["action"], pending["workers"]) == ("leave", ["w1"])
    assert kills.calls == [] and watch.fell_back is None
    time.sleep(watch.repeat_window_s)
    os.kill(os.getpid(), signal.SIGTERM)
    assert kills.calls == [(os.getpid(), signal.SIGKILL)] and watch.fell_back == "a second SIGTERM"


def test_sigterms_in_quick_succession_are_one_notice(watch_of, am) -> None:
    """Slurm signals every process of a step: the worker gets SIGTERM directly and forwarded by ``elan worker``."""
    watch, kills = watch_of("w1", repeat_window_s=5.0)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    wait_until(lambda: watch.leave_queued)
    os.kill(os.getpid(), signal.SIGTERM)

    assert watch.signals == 3 and kills.calls == [] and watch.fell_back is None
    with AMClient(am.address, JOB) as client:
        (pending,) = client.status()["pending"]
    assert (pending["action"], pending["workers"]) == ("leave", ["w1"])


def test_not_left_within_the_grace_period_takes_the_crash_path(watch_of) -> None:
    watch, kills = watch_of("w1", grace_s=0.3)
    os.kill(os.getpid(), signal.SIGTERM)

    wait_until(lambda: kills.calls)
    assert watch.leave_queued and "0.3 s after SIGTERM" in (watch.fell_back or "")


def test_a_worker_that_left_in_time_is_disarmed_and_sigterm_gets_its_previous_handler_back(watch_of) -> None:
    seen: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    watch, kills = watch_of("w1", grace_s=0.3)
    os.kill(os.getpid(), signal.SIGTERM)
    wait_until(lambda: watch.leave_queued)

    watch.disarm()  # the engine closes once the worker has left
    time.sleep(0.5)
    assert kills.calls == []
    os.kill(os.getpid(), signal.SIGTERM)
    assert seen == [signal.SIGTERM] and kills.calls == []
    watch.handle(signal.SIGTERM, None)  # Lightning's teardown may put the watch's handler back: it delegates
    assert seen == [signal.SIGTERM, signal.SIGTERM]


def test_a_refused_leave_trains_on_until_the_grace_period_ends(watch_of) -> None:
    other, _ = watch_of("w0", grace_s=30.0)
    other.handle(signal.SIGTERM, None)
    wait_until(lambda: other.leave_queued)
    watch, kills = watch_of("w1", grace_s=0.5)

    watch.handle(signal.SIGTERM, None)

    wait_until(lambda: watch.refusal is not None)
    assert "last member" in (watch.refusal or "") and kills.calls == []
    wait_until(lambda: kills.calls)


def test_a_finished_job_takes_the_crash_path_at_once(watch_of, am) -> None:
    with AMClient(am.address, JOB) as client:
        client.request("shutdown", {"reason": "elan run is stopping"})
    watch, kills = watch_of("w1", grace_s=30.0)

    watch.handle(signal.SIGTERM, None)

    wait_until(lambda: kills.calls)
    assert watch.outcome == "finished" and "finished or shutting down" in (watch.fell_back or "")


def test_an_am_that_does_not_answer_is_asked_until_the_grace_period_ends(watch_of) -> None:
    watch, kills = watch_of("w1", grace_s=1.5, address="tcp://127.0.0.1:1")

    watch.handle(signal.SIGTERM, None)

    wait_until(lambda: kills.calls)
    assert watch.outcome is None and watch.refusal is None


def test_off_the_main_thread_nothing_is_installed(am) -> None:
    import threading

    environment = WorkerEnvironment.launched(job=JOB, worker_id="w1", role="member", am_address=am.address,
                                             store_address="127.0.0.1:1", rank=1, world_size=2)
    installed: list[bool] = []
    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=lambda: installed.append(TerminationWatch(environment).install()))
    thread.start()
    thread.join()
    assert installed == [False] and signal.getsignal(signal.SIGTERM) is before
