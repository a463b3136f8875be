"""SIGTERM held while a worker starts (``launcher/lifeline.py``, ``elastic/termination.py``): the launcher starts it
with SIGTERM blocked, the watch unblocks it once its handler is installed, and a SIGTERM that came meanwhile is a leave.
Real processes, real signals, a real in-process AM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_elan.launcher.enrolled import EnrolledWorker, WorkerConfig
from lightning_elan.launcher.lifeline import die_with_parent, sigterm_held
from lightning_elan.master.server import ApplicationMaster
from lightning_elan.master.store import FileStore
from lightning_elan.protocol import AMClient
from lightning_elan.protocol.contract import LEAVE_QUEUED, WorkerEnvironment

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the hold is set in Linux's preexec_fn")

JOB = "held"

# a worker that is told when its SIGTERM was sent (a line on stdin), then installs the watch as the engine does
WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from torch.utils.data import DataLoader, Dataset

    from lightning_elan.elastic.termination import TerminationWatch
    from lightning_elan.protocol.contract import WorkerEnvironment

    def blocked():
        return signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, ())

    def report(**facts):
        print(json.dumps(facts), flush=True)

    # Sample 0, then the loader's worker stalls in __getitem__ (and says so in the marker file): killed there it
    # holds none of the loader's locks. Killed as it checks the loader's done event, it would hold that event's lock
    # and the loader's shutdown in `del loader` would wait for it forever (torch's DataLoader, not the watch).
    class Stalling(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            if index > 0:
                open(sys.argv[1], "w").close()
                time.sleep(600)
            return index

    report(blocked=blocked())
    sys.stdin.readline()  # the test has sent SIGTERM
    loader = iter(DataLoader(Stalling(), num_workers=1, batch_size=1))  # a DataLoader worker forked before the watch
    next(loader)  # it runs: torch's SIGTERM handler is installed (SIGTERM from its parent: exit 0)
    loader_worker = loader._workers[0]
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    os.kill(loader_worker.pid, signal.SIGTERM)
    loader_worker.join(10)
    pending = signal.SIGTERM in signal.sigpending()
    watch = TerminationWatch(WorkerEnvironment.from_env(), kill=lambda pid, signum: report(crash_path=signum))
    watch.install()
    report(pending_before_install=pending, held_at_start=watch.held_at_start, signals_at_install=watch.signals,
           outcome_at_install=watch.outcome,
           blocked_after_install=blocked(), loader_worker_exit=loader_worker.exitcode)
    watch.disarm()
    del loader
    """
)


@pytest.fixture
def am(tmp_path: Path) -> Iterator[ApplicationMaster]:
    master = ApplicationMaster(JOB, FileStore(tmp_path / "state.json"), state_dir=tmp_path, register=False).start()
    with AMClient(master.address, JOB) as client:
        client.request("start_job", {"nproc": 2, "coordinate_every": 50})
    yield master
    master.stop()


def worker_env(am: ApplicationMaster) -> dict[str, str]:
    environment = WorkerEnvironment.launched(job=JOB, worker_id="w1", role="member", am_address=am.address,
                                             store_address="127.0.0.1:1", rank=1, world_size=2, term_grace_s=60)
    return {**os.environ, **environment.to_env(), "PYTHONWARNINGS": "ignore"}


def wait_held(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not sigterm_held(pid):
        assert time.monotonic() < deadline, f"process {pid} never held its SIGTERM"
        time.sleep(0.01)


def test_a_sigterm_during_start_up_waits_for_the_handler_and_is_a_leave(am: ApplicationMaster, tmp_path: Path) -> None:
    """The SIGTERM sent before the watch is installed neither kills the worker nor is lost: installing the watch
    delivers it to the handler and returns once the AM has queued the leave; a DataLoader worker forked meanwhile still
    dies of SIGTERM."""
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "stalled")], env=worker_env(am),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              preexec_fn=die_with_parent(signal.SIGKILL, hold_sigterm=True))
    try:
        assert worker.stdin is not None and worker.stdout is not None
        assert json.loads(worker.stdout.readline()) == {"blocked": True}
        worker.send_signal(signal.SIGTERM)
        wait_held(worker.pid)
        worker.stdin.write("sent\n")
        worker.stdin.flush()
        facts = json.loads(worker.stdout.readline())
        assert worker.wait(timeout=60) == 0
    finally:
        worker.kill()
        worker.wait()
    assert facts == {"pending_before_install": True, "held_at_start": True, "signals_at_install": 1,
                     "outcome_at_install": LEAVE_QUEUED, "blocked_after_install": False, "loader_worker_exit": 0}


def test_a_child_started_without_the_hold_dies_of_sigterm_and_holds_nothing() -> None:
    child = subprocess.Popen(["sleep", "60"], preexec_fn=die_with_parent(signal.SIGKILL))
    try:
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
    assert not sigterm_held(child.pid), "a reaped process holds nothing"


def test_a_command_that_never_installs_the_watch_holds_sigterm() -> None:
    child = subprocess.Popen(["sleep", "60"], preexec_fn=die_with_parent(signal.SIGKILL, hold_sigterm=True))
    try:
        assert not sigterm_held(child.pid)
        child.send_signal(signal.SIGTERM)
        wait_held(child.pid)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_elan_worker_kills_a_command_that_holds_sigterm_past_the_grace_period() -> None:
    """``elan worker``'s backstop: the command never starts the engine, so its SIGTERM is SIGKILL --term-grace later."""
    enrolled = EnrolledWorker(WorkerConfig("tcp://127.0.0.1:9", "job", ["sleep", "60"], term_grace_s=1.0, poll_s=0.1))
    child = subprocess.Popen(["sleep", "60"], preexec_fn=die_with_parent(signal.SIGTERM, hold_sigterm=True))
    try:
        child.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert enrolled._wait(child, "w0") == -signal.SIGKILL
        assert 1.0 <= time.monotonic() - started < 10.0
    finally:
        child.kill()
        child.wait()
        enrolled._client.close()
