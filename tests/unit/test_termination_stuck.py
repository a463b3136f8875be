"""A worker whose main thread is stuck in C++ (issue 26, item 3): its SIGTERM watch still starts, asks the AM and takes
the crash path when the grace period ends, because the delivery reaches the watch's thread through Python's wakeup fd,
not through the Python handler that cannot run. Real SIGTERMs to this process; the crash path is recorded, not taken."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

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
    """Stands in for ``os.kill``: records when the crash path was taken instead of taking it."""

    def __init__(self) -> None:
        self.at: list[float] = []

    def __call__(self, pid: int, signum: int) -> None:
        assert (pid, signum) == (os.getpid(), signal.SIGKILL)
        self.at.append(time.monotonic())


@pytest.fixture
def watch(am: ApplicationMaster) -> Iterator[tuple[TerminationWatch, Kills]]:
    previous = signal.getsignal(signal.SIGTERM)
    environment = WorkerEnvironment.launched(job=JOB, worker_id="w1", role="member", am_address=am.address,
                                             store_address="127.0.0.1:1", rank=1, world_size=2, term_grace_s=1.0)
    kills = Kills()
    watch = TerminationWatch(environment, kill=kills)
    assert watch.install()
    yield watch, kills
    watch.disarm()
    signal.signal(signal.SIGTERM, previous)


def block_in_cpp(seconds: float) -> None:
    """Wait in C++ (the GIL released, no return to the interpreter): as a rendezvous or a hung collective does."""
    with pytest.raises(RuntimeError):
        dist.HashStore().wait(["never set"], timedelta(seconds=seconds))


def test_a_sigterm_to_a_worker_stuck_in_cpp_takes_the_crash_path_after_the_grace_period(watch) -> None:
    watch, kills = watch
    sent: list[float] = []

    def terminate() -> None:
        time.sleep(0.2)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=terminate)
    sender.start()
    block_in_cpp(4.0)
    unblocked = time.monotonic()
    sender.join()

    assert watch.leave_queued and "1 s after SIGTERM" in (watch.fell_back or "")
    (killed,) = kills.at
    assert killed < unblocked and 0.9 <= killed - sent[0] <= 2.5
    assert watch.signals == 1  # the handler ran once the main thread was back: the same notice, not a second one


def test_a_forked_childs_sigterm_is_not_the_workers(watch) -> None:
    watch, kills = watch
    pid = os.fork()
    if pid == 0:  # the child (a DataLoader worker): the watch's handler passes its SIGTERM on to the default
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    time.sleep(0.7)
    assert watch.outcome is None and not watch.leave_queued and kills.at == []
