"""The job's rendezvous store in the store host (``launcher/job_store.py``): with a preloaded interpreter, ``elan run``
never imports torch itself; the TCPStore the workers rendezvous on is served by a process the preload process forks
(``elan-store``), which lives exactly as long as the launcher. Real jobs of the probe (a join, a member SIGKILLed and
recovered through the failure key the launcher sets on that store), a SIGKILLed launcher, a SIGKILLed store host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.elastic_runs import PROBE_ARGS, RunResult, elan_command, elan_env
from tests.integration.hold_point import RELEASED
from tests.integration.worker_faults import check_fault_run
from tests.processes import argv, mentioning, running, wait_gone

pytestmark = pytest.mark.integration
STORE_TITLE = b"elan-store"


def start_job(tmp: Path, name: str, hold: str, *launcher_args: str) -> subprocess.Popen[str]:
    probe_args = [*PROBE_ARGS, "--global-batch", "12", "--hold-at", hold]  # the static run's batch at any size
    command = elan_command(tmp, name, 2, probe_args, launcher_args=launcher_args)
    return subprocess.Popen(command, env=elan_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_held(out: Path, workers: set[str], job: subprocess.Popen[str], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while {path.stem.removeprefix("held-") for path in out.glob("held-*.json")} < workers:
        assert job.poll() is None, job.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{workers} never held"
        time.sleep(0.1)


def store_hosts(tmp: Path) -> set[int]:
    """The running store hosts of this test's jobs (their environment names the test's ``ELAN_HOME``)."""
    return {pid for pid in mentioning(str(tmp / "elan-home")) if (argv(pid) or [b""])[0] == STORE_TITLE}


def kill_victim(out: Path, worker: str) -> None:
    (out / RELEASED).write_text(str(time.time()))
    os.kill(json.loads((out / f"held-{worker}.json").read_text())["pid"], signal.SIGKILL)


def test_the_store_host_serves_the_job_a_death_included_and_ends_with_it(static_run: RunResult, tmp_path: Path) -> None:
    job = start_job(tmp_path, "served", "w1:4:forward", "--replace-failed")
    try:
        wait_held(tmp_path / "served", {"w0", "w1"}, job)
        hosts = store_hosts(tmp_path)
        assert len(hosts) == 1, hosts
        maps = Path(f"/proc/{job.pid}/maps").read_text()
        assert "libtorch" not in maps, "the launcher imported torch"
        kill_victim(tmp_path / "served", "w1")
        output = job.communicate(timeout=300)[0]
    finally:
        job.kill()
    check_fault_run(RunResult(tmp_path / "served", tmp_path / "served-state", job.returncode, output), static_run,
                    dead=["w1"])
    assert "w1 died" in output and "recover without it" in output, output[-3000:]
    assert not wait_gone(hosts, 10.0), "the store host outlived its launcher"


def test_a_sigkilled_launcher_takes_its_store_host_along(tmp_path: Path) -> None:
    job = start_job(tmp_path, "orphaned", "w1:3:forward")
    try:
        wait_held(tmp_path / "orphaned", {"w0", "w1"}, job)
        hosts = store_hosts(tmp_path)
        assert len(hosts) == 1, hosts
        job.kill()
        job.communicate(timeout=60)
        assert not wait_gone(hosts, 10.0), "the store host outlived its SIGKILLed launcher"
        assert not wait_gone(mentioning(str(tmp_path / "elan-home")), 15.0), "processes of the job left behind"
    finally:
        job.kill()


def test_a_dead_store_host_ends_the_job_with_a_clear_error(tmp_path: Path) -> None:
    job = start_job(tmp_path, "storeless", "w1:3:forward")
    try:
        wait_held(tmp_path / "storeless", {"w0", "w1"}, job)
        (host,) = store_hosts(tmp_path)
        os.kill(host, signal.SIGKILL)
        assert not wait_gone({host}, 10.0)
        kill_victim(tmp_path / "storeless", "w1")  # the launcher reads the dead member's marks on the store
        output = job.communicate(timeout=120)[0]
    finally:
        job.kill()
    assert job.returncode == 1, output[-3000:]
    assert "rendezvous store host is gone" in output and "stopping job storeless" in output, output[-3000:]
    assert not running(job.pid)
    assert not wait_gone(mentioning(str(tmp_path / "elan-home")), 15.0), "processes of the job left behind"
