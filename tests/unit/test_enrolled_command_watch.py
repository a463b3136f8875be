"""``elan worker`` watches its running command through the AM (``worker_poll``), with a real AM in this process and
real child processes: a command the AM declared dead (it did not check in after a failure: frozen) is SIGKILLed, one
stopped (SIGSTOP) after the job's training ended is SIGKILLed after the grace, any other runs to its end."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_elan.launcher.enrolled import EnrolledWorker, WorkerConfig
from lightning_elan.master.server import ApplicationMaster
from lightning_elan.master.store import FileStore
from lightning_elan.protocol import AMClient

JOB = "watched"


@pytest.fixture
def am(tmp_path: Path) -> Iterator[ApplicationMaster]:
    master = ApplicationMaster(JOB, FileStore(tmp_path / "state.json"), state_dir=tmp_path, register=False).start()
    with AMClient(master.address, JOB, timeout_s=2.0, retries=1) as client:
        client.request("start_job", {"nproc": 3, "coordinate_every": 50})
        for worker in ("w0", "w1", "w2"):
            client.request("register", {"worker_id": worker, "host": "h", "pid": 1})
    yield master
    master.stop()


def ask(am: ApplicationMaster, msg_type: str, body: dict) -> dict:
    with AMClient(am.address, JOB, timeout_s=2.0, retries=1) as client:
        return client.request(msg_type, body)


def declare_w1_dead(am: ApplicationMaster) -> None:
    """w0's collective timed out; w0 and w2 check in, w1 does not within the 0.2 s waited: declared dead."""
    ask(am, "stalled", {"worker_id": "w0", "generation": 0, "waited_s": 0.2})
    for worker in ("w0", "w2"):
        ask(am, "recover", {"worker_id": worker, "generation": 0, "has_state": True, "step": 3, "timeout_s": 0})
    time.sleep(0.3)
    assert ask(am, "launcher_poll", {})["kill"] == ["w1"]


def watcher(address: str, **options: float) -> EnrolledWorker:
    return EnrolledWorker(WorkerConfig(address, JOB, ["true"], poll_s=0.05, am_poll_s=0.1, **options))


def wait_with(enrolled: EnrolledWorker, command: list[str], worker: str, stop: bool = False) -> tuple[int, float]:
    """The command's exit code under ``enrolled``'s watch, and how long it ran."""
    child = subprocess.Popen(command)
    started = time.monotonic()
    try:
        if stop:
            child.send_signal(signal.SIGSTOP)
        return enrolled._wait(child, worker), time.monotonic() - started
    finally:
        child.kill()
        child.wait()
        enrolled._client.close()


def test_a_command_the_am_declared_dead_is_killed_and_the_others_run_on(am: ApplicationMaster) -> None:
    declare_w1_dead(am)

    assert wait_with(watcher(am.address), ["sleep", "60"], "w1")[0] == -signal.SIGKILL
    assert wait_with(watcher(am.address), ["sleep", "1"], "w2")[0] == 0


def test_a_command_stopped_after_the_training_is_killed_after_the_grace(am: ApplicationMaster) -> None:
    ask(am, "worker_exit", {"worker_id": "w0", "returncode": 0, "training_ended": True})

    code, ran_s = wait_with(watcher(am.address, stopped_grace_s=0.5), ["sleep", "60"], "w1", stop=True)
    assert code == -signal.SIGKILL and 0.5 <= ran_s < 30.0
    assert wait_with(watcher(am.address, stopped_grace_s=0.5), ["sleep", "1"], "w2")[0] == 0


def test_a_command_stopped_during_the_training_is_left_to_the_am(am: ApplicationMaster) -> None:
    """Stopped while the others train, it is the AM's to declare dead (a stall): the grace does not apply."""
    child = subprocess.Popen(["sleep", "60"])
    enrolled = watcher(am.address, stopped_grace_s=0.1)
    try:
        child.send_signal(signal.SIGSTOP)
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.1)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert not enrolled._unresponsive(child, "w1")
            time.sleep(0.05)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
        enrolled._client.close()


def test_without_an_am_answering_the_command_runs_to_its_end() -> None:
    assert wait_with(watcher("tcp://127.0.0.1:9"), ["sleep", "1"], "w1")[0] == 0
