"""Workers started by a scheduler: `elan am --min-workers 2 --max-workers 3` and `elan worker` processes.

What a cluster does, with real processes on this machine: two `elan worker`s enrol and the job starts with them; a
third started later joins the running job; a fourth is refused (the job has its maximum); the scheduler's SIGTERM to
the worker holding rank 0 makes it leave gracefully; the job ends by itself, the AM exits, and the run equals the
static run within 1e-9 with every sample used once per epoch. The training script is the ordinary probe.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.elastic_runs import (
    EPOCHS,
    PROBE,
    PROBE_ARGS,
    STEPS_PER_EPOCH,
    TOLERANCE,
    RunResult,
    assert_exact,
    assert_ranks_agree,
    assert_states_close,
    elan_env,
    free_port,
)
from tests.integration.worker_faults import FAULT_KILL_DIR, assert_completed_once

pytestmark = pytest.mark.integration

JOB = "enrolled"
SLOW = ["--step-sleep", "0.6"]  # ~16 s of training: room for a joiner's start-up and a leave


class Cluster:
    """An AM that takes enrolments and the `elan worker`s started against it (stopped by PID at the end)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.env, self.port = tmp, elan_env(tmp), free_port()
        self.am_address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []

    def start_am(self, max_workers: int = 3, min_workers: int = 2) -> subprocess.Popen:
        self.am = self._start([
            "am", "--job", JOB, "--bind", f"tcp://{self.am_address}", "--state-dir", str(self.state_dir),
            "--min-workers", str(min_workers), "--max-workers", str(max_workers), "--start-grace", "0.5",
            "--coordinate-every", "1",
        ], "am")
        return self.am

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"

    def worker(self, name: str, probe_args: list[str] = SLOW) -> subprocess.Popen:
        return self.command(name, [sys.executable, str(PROBE), "--out", str(self.tmp / "out"), *PROBE_ARGS,
                                   *probe_args])

    def command(self, name: str, command: list[str]) -> subprocess.Popen:
        """An ``elan worker`` of the job running ``command``."""
        return self._start(["worker", "--am", self.am_address, "--job", JOB, "--", *command], name)

    def kill_in_library(self, kill: str) -> None:
        """The workers' commands SIGKILL themselves at ``kill`` (``tests/integration/fault_kill``)."""
        self.env = {**self.env, "ELAN_TEST_KILL": kill,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULT_KILL_DIR), self.env.get("PYTHONPATH")]))}

    def _start(self, args: list[str], name: str) -> subprocess.Popen:
        log = (self.tmp / f"{name}.log").open("w")
        proc = subprocess.Popen([sys.executable, "-m", "lightning_elan.cli", *args], env=self.env, stdout=log,
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def status(self) -> dict:
        proc = subprocess.run([sys.executable, "-m", "lightning_elan.cli", "status", "--job", JOB, "--am",
                               self.am_address, "--json"], env=self.env, capture_output=True, text=True, timeout=60)
        return json.loads(proc.stdout) if proc.returncode == 0 else {}

    def wait_status(self, predicate, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            if status and predicate(status):
                return status
            time.sleep(0.3)
        raise AssertionError(f"status never matched: {self.status()}\n{self.logs()}")

    def adjustments(self) -> list[dict]:
        path = self.state_dir / "adjustments.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def parent_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no parent for {pid}")


def test_workers_enrol_join_get_refused_and_leave_like_a_static_run(static_run, tmp_path):
    cluster = Cluster(tmp_path)
    cluster.start_am()
    try:
        first = [cluster.worker("w-a"), cluster.worker("w-b")]
        started = cluster.wait_status(lambda s: s["generation"] == 0 and len(s["members"]) == 2
                                      and all(m.get("pid") for m in s["members"]))
        joiner = cluster.worker("w-c")
        deadline = time.monotonic() + 120
        while not cluster.adjustments() and time.monotonic() < deadline:
            time.sleep(0.2)
        (grown,) = cluster.adjustments()
        assert grown["action"] == "add" and len(grown["members"]) == 3, grown

        surplus = cluster.worker("w-d")
        assert surplus.wait(60) == 3, cluster.logs()
        assert "has its 3 workers (--max-workers)" in (tmp_path / "w-d.log").read_text()

        rank0 = cluster.status()["members"][0]
        assert rank0["worker_id"] == started["members"][0]["worker_id"]
        wrapper = parent_of(rank0["pid"])  # the training process registered: its parent is its `elan worker`
        assert wrapper in {proc.pid for proc in first}
        next(proc for proc in first if proc.pid == wrapper).send_signal(signal.SIGTERM)  # the scheduler's stop

        codes = [proc.wait(180) for proc in [*first, joiner]]
        assert codes == [0, 0, 0], cluster.logs()
        assert cluster.am.wait(60) == 0, cluster.logs()
    finally:
        cluster.stop()

    run = RunResult(tmp_path / "out", cluster.state_dir, 0, cluster.logs())
    records = assert_exact(run, static_run)
    adjustments = run.adjustments()
    assert [len(a["members"]) for a in adjustments] == [3, 2], adjustments
    assert adjustments[1]["leavers"] == [rank0["worker_id"]]
    assert sorted(r["worker"] for r in records if r["left"]) == [rank0["worker_id"]]


def test_a_worker_started_before_its_am_listens_is_enrolled_once(static_run, tmp_path):
    """A scheduler starts workers and the AM together (the ssh and Slurm recipes do): a worker that asks for seconds
    before the AM listens has many attempts queued, and all of them reach the AM at once. It is one worker: the job
    (--min-workers 2 --max-workers 2) waits for the second `elan worker` and trains with both, exactly."""
    cluster = Cluster(tmp_path)
    try:
        early = cluster.worker("w-early")
        time.sleep(4.0)  # ≥ 4 enrol attempts queued for an address nobody listens on yet
        cluster.start_am(max_workers=2)
        cluster.wait_status(lambda s: bool(s.get("enrolment") and (s["enrolment"]["waiting"]
                                                                   or s["enrolment"]["started"])))
        time.sleep(1.0)  # every queued attempt has arrived
        enrolment = cluster.status()["enrolment"]
        assert not enrolment["started"] and len(enrolment["waiting"]) == 1, enrolment
        late = cluster.worker("w-late")
        assert [early.wait(180), late.wait(180)] == [0, 0], cluster.logs()
        assert cluster.am.wait(60) == 0, cluster.logs()
    finally:
        cluster.stop()
    run = RunResult(tmp_path / "out", cluster.state_dir, 0, cluster.logs())
    assert_completed_once(run.out)  # what each step completed (w1's own records died with it)
    assert assert_ranks_agree(run.records()) == EPOCHS * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static_run.final_state(), TOLERANCE)
    assert run.adjustments() == []


def test_a_member_killed_after_the_last_step_fails_nothing(static_run, tmp_path):
    """Three ``elan worker``s; w1's command is SIGKILLed once its training ended (every member trained the last
    step), before the others exited (etcd storm seed 9012: the AM opened a recovery nobody checked in to and failed the
    job, "no survivor checked in after f1"). The training is complete: the AM ends the job 0 and the survivors' run
    equals the static run."""
    cluster = Cluster(tmp_path)
    cluster.kill_in_library("w1:trained")
    cluster.start_am(max_workers=3, min_workers=3)
    try:
        workers = [cluster.worker(f"w-{name}", probe_args=["--global-batch", "12"]) for name in "abc"]
        codes = [proc.wait(180) for proc in workers]
        assert sorted(code == 0 for code in codes) == [False, True, True], (codes, cluster.logs())
        assert cluster.am.wait(60) == 0, cluster.logs()
    finally:
        cluster.stop()

    assert (tmp_path / "elan-home" / "fault-kills.log").read_text().startswith("w1 trained")
    assert "fails" not in (tmp_path / "am.log").read_text(), cluster.logs()
    run = RunResult(tmp_path / "out", cluster.state_dir, 0, cluster.logs())
    assert_completed_once(run.out)  # what each step completed (w1's own records died with it)
    assert assert_ranks_agree(run.records()) == EPOCHS * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static_run.final_state(), TOLERANCE)
