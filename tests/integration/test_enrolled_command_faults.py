"""Faults of a job whose workers a scheduler started (`elan am` and one `elan worker` per worker), from the side of
the user who runs them: a frozen command, and the signals a scheduler or a terminal sends to an `elan worker`.

`elan run` kills a member the AM declared dead (it stopped answering: SIGSTOP, a hung process); an `elan worker` has
no `launcher_poll`, so before, its frozen command stayed stopped for ever: the job went on without it, but that
`elan worker` never exited and the scheduler's allocation (a Slurm step, a pod) was held until someone noticed. Now
the `elan worker` asks the AM about its command (`worker_poll`) and SIGKILLs it once declared dead; its exit is
reported as a death's. Ctrl-C (SIGINT) to an `elan worker` printed a KeyboardInterrupt traceback and left the AM
without its exit; a SIGTERM near the job's end left it a minute on a store and an AM that were gone. In every case
the other workers' run is the static run's: every sample once, the final state within 1e-9.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_elan.elastic.worker import DECLARED_DEAD_EXIT
from tests.integration.elastic_runs import free_port
from tests.users.corpus import (
    Job,
    Run,
    assert_members_agree,
    assert_ok,
    assert_same_samples,
    assert_states_close,
    end_every_process_of,
    job_env,
    read_run,
    run_job,
    shm_dir,
)

pytestmark = pytest.mark.integration

TIMEOUT_S = 10
COMMAND = ("{scripts}/short_timeout.py", "{out}", str(TIMEOUT_S))
FREEZE_AFTER_STEP = 4
WORKERS = 3
JOB_TIMEOUT_S = 360.0
BACK_FROM_THE_DEAD = (DECLARED_DEAD_EXIT, 128 + signal.SIGKILL)
"""How a worker declared dead ends when its host comes back: it learns it from the AM when it asks to recover, or its
`elan worker` learns it first (``worker_poll``) and kills it."""


class EnrolledJob:
    """An AM taking enrolments and ``WORKERS`` ``elan worker``s of the corpus script, all logging to
    ``home/output.log`` and observed as the corpus harness observes its jobs (``read_run``). The job starts with all
    of them (they enrol within the start grace) and may go on with one less (``--min-workers``)."""

    def __init__(self, home: Path, job: Job, env: dict[str, str] | None = None, am_args: tuple[str, ...] = ()) -> None:
        (home / "observe").mkdir(parents=True)
        self.home, self.job, self.shm = home, job, shm_dir(home)
        self.env = job_env(home, job, {**(env or {}), "ELAN_SHM_DIR": str(self.shm)})
        self.address = f"127.0.0.1:{free_port()}"
        self.log = (home / "output.log").open("a")
        self.am = self._start(["am", "--job", job.name, "--bind", f"tcp://{self.address}", "--state-dir",
                               str(home / "state"), "--min-workers", str(WORKERS - 1), "--max-workers",
                               str(WORKERS), "--start-grace", "30", "--coordinate-every", "1", *am_args])
        command = [sys.executable, *job.argv(home / "out")]
        self.workers = [self._start(["worker", "--am", self.address, "--job", job.name, "--", *command])
                        for _ in range(WORKERS)]

    def _start(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "lightning_elan.cli", *args], cwd=self.home, env=self.env,
                                stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def command_pid(self, worker: str) -> int | None:
        """The pid of ``worker``'s training command, once its ``elan worker`` logged it."""
        found = re.search(rf"{worker} \(rank \d+ of \d+\) started: pid (\d+)", self.output())
        return int(found.group(1)) if found else None

    def trained_steps(self) -> int:
        run = read_run(self.home, self.job, 0)
        return max((record["step"] for record in run.events("start")), default=-1)

    def wait(self) -> None:
        """Every process exited by itself, or the job is reported hung (its processes are killed)."""
        deadline = time.monotonic() + JOB_TIMEOUT_S
        for proc in [*self.workers, self.am]:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{proc.args[3:5]} still running {JOB_TIMEOUT_S:.0f} s after the start\n"
                            f"{self.output()[-6000:]}")

    def output(self) -> str:
        self.log.flush()
        return (self.home / "output.log").read_text()

    def run(self) -> Run:
        return read_run(self.home, self.job, self.am.returncode)

    def stop(self) -> None:
        for proc in [*self.workers, self.am]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        end_every_process_of(self.home)
        shutil.rmtree(self.shm, ignore_errors=True)
        self.log.close()


def trained_pid(job: EnrolledJob, worker: str, step: int = FREEZE_AFTER_STEP) -> int:
    """The pid of ``worker``'s command, once the job trained past ``step``."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        pid = job.command_pid(worker)
        if pid is not None and job.trained_steps() >= step:
            return pid
        assert job.am.poll() is None, job.output()[-6000:]
        time.sleep(0.05)
    pytest.fail(f"{worker} never trained past step {step}\n{job.output()[-6000:]}")


def freeze_when_trained(job: EnrolledJob, worker: str) -> int:
    """SIGSTOP ``worker``'s command once the job trained past ``FREEZE_AFTER_STEP``; its pid."""
    pid = trained_pid(job, worker)
    os.kill(pid, signal.SIGSTOP)
    return pid


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static"), Job("enrolled_static", COMMAND, nproc=WORKERS))
    assert_ok(run)
    return run


def parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def test_an_elan_worker_kills_its_frozen_command_once_the_am_declared_it_dead(static: Run, tmp_path: Path) -> None:
    job = EnrolledJob(tmp_path / "enrolled", Job("enrolled_frozen", COMMAND, nproc=WORKERS))
    try:
        frozen = freeze_when_trained(job, "w1")
        job.wait()
    finally:
        job.stop()
    run = job.run()

    assert job.am.returncode == 0, run.excerpt()
    assert sorted(proc.returncode for proc in job.workers) == [0, 0, 128 + signal.SIGKILL], run.excerpt()
    assert f"killing w1 (pid {frozen})" in run.output and "the AM declared it dead" in run.output, run.excerpt()
    adjustments = run.adjustments()
    assert [(a["action"], a["failure"]["dead"], len(a["members"])) for a in adjustments] == [
        ("failure", ["w1"], WORKERS - 1)], adjustments
    assert "Traceback" not in run.output, run.excerpt()
    assert_same_samples(run, static, victims=frozenset({"w1"}))  # frozen after its step stood: trained, unrecorded
    assert_members_agree(run)
    assert_states_close(run.final_state(), static.final_state())


def test_an_elan_worker_kills_its_command_stopped_after_the_training(static: Run, tmp_path: Path) -> None:
    """The process of rank 1 stops itself in ``on_fit_end`` (``$USERS_FREEZE``): no collective waits for it, so no
    timeout ends it and the AM never declares it dead. Its ``elan worker`` kills it once it has been stopped for 30 s
    after the job's training ended (``worker_poll``'s ``training_over``), and the job ends whole (before: that
    ``elan worker`` and the AM, waiting for its exit, ran for ever)."""
    job = EnrolledJob(tmp_path / "enrolled", Job("enrolled_stopped", COMMAND, nproc=WORKERS),
                      env={"USERS_FREEZE": "fit_end"})
    try:
        job.wait()
    finally:
        job.stop()
    run = job.run()

    assert [kill["phase"] for kill in run.kills()] == ["freeze:fit_end"]
    assert job.am.returncode == 0, run.excerpt()
    assert sorted(proc.returncode for proc in job.workers) == [0, 0, 128 + signal.SIGKILL], run.excerpt()
    assert "has been stopped (SIGSTOP) for" in run.output and not run.adjustments(), run.excerpt()
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())


@pytest.mark.parametrize(("signum", "terminal"), [(signal.SIGTERM, False), (signal.SIGINT, False),
                                                   (signal.SIGINT, True)], ids=["sigterm", "sigint", "ctrl_c"])
def test_a_signal_to_an_elan_worker_makes_its_command_leave_and_the_exit_is_reported(static: Run, tmp_path: Path,
                                                                                      signum: signal.Signals,
                                                                                      terminal: bool) -> None:
    """The scheduler's SIGTERM, or Ctrl-C to one `elan worker` (SIGINT to it alone, or, as a terminal sends it, to its
    whole process group: its command too), after step 1: its command leaves at a batch boundary and exits 0, and so
    does the `elan worker`, having reported the exit to the AM (which serves on for a leaver still exiting when the job
    finished). Before: SIGINT raised a KeyboardInterrupt traceback out of `elan worker`; a leaver still exiting as the
    job finished found the store and the AM gone; the terminal's SIGINT to the command interrupted its `fit`
    (Lightning's "Detected KeyboardInterrupt", exit 1): recovered as a death, its step redone."""
    name = f"enrolled_{signum.name.lower()}" + ("_terminal" if terminal else "")
    job = EnrolledJob(tmp_path / "enrolled", Job(name, COMMAND, nproc=WORKERS))
    try:
        pid = trained_pid(job, "w1", step=1)  # early: the leave lands well before the job's last (24th) step
        supervisor = next(proc for proc in job.workers if proc.pid == parent_of(pid))
        if terminal:
            os.killpg(supervisor.pid, signum)  # each `elan worker` leads its own session, as in its own terminal
        else:
            supervisor.send_signal(signum)
        job.wait()
    finally:
        job.stop()
    run = job.run()

    assert job.am.returncode == 0 and [proc.returncode for proc in job.workers] == [0, 0, 0], run.excerpt()
    assert [(a["action"], a["members"]) for a in run.adjustments()] == [("leave", ["w0", "w2"])], run.excerpt()
    assert f"received {signum.name}: the worker (pid {pid}) leaves the job" in run.output, run.excerpt()
    assert "Traceback" not in run.output and "could not" not in run.output, run.excerpt()
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())


@pytest.mark.parametrize("resumed", ["after_the_recovery", "after_the_others_finished"])
def test_a_host_paused_without_a_word_is_lost_and_the_others_recover_before_their_collective_times_out(
        static: Run, tmp_path: Path, resumed: str) -> None:
    """A whole host stops (a paused VM, a machine cut off the network: SIGSTOP to its `elan worker` and its command,
    its process group) after step 4 of a job whose collective timeout is 600 s: nothing exits, no connection resets.
    The AM, no longer polled by that `elan worker`, takes the worker for lost after `--heartbeat-timeout` (15 s),
    announces the failure, and the others recover without it at once, redo the interrupted step and finish. When the
    host comes back (SIGCONT) its command learns it was declared dead and ends (one line, exit 1), or its `elan
    worker` learns it first and kills it (137). Before, the others waited in their collective for the 600 s timeout
    (the job outlived the test's 360 s). Resumed once the others have finished: the AM of the finished job serves on
    a while for the lost worker's `elan worker` (at most 30 s), which learns it and kills its command; before, the AM
    was gone, and the command waited on the store that went with it (its collective timeout: 600 s)."""
    command = ("{scripts}/short_timeout.py", "{out}", "600")
    job = EnrolledJob(tmp_path / "enrolled", Job("enrolled_lost_host", command, nproc=WORKERS),
                      am_args=("--heartbeat-timeout", "15"))
    try:
        pid = trained_pid(job, "w1")
        host = parent_of(pid)
        os.killpg(host, signal.SIGSTOP)
        lost = time.monotonic()
        recovered_before = _wait_for_output(job, "generation 1 trains with 2 workers", JOB_TIMEOUT_S)
        if resumed == "after_the_others_finished":
            for proc in job.workers:
                if proc.pid != host:
                    proc.wait(timeout=JOB_TIMEOUT_S)
        os.killpg(host, signal.SIGCONT)
        job.wait()
    finally:
        job.stop()
    run = job.run()

    assert recovered_before - lost < 60, run.excerpt()  # the 15 s heartbeat timeout, not the 600 s collective's
    logging.getLogger(__name__).warning("a paused host: the others trained on %.1f s after the pause",
                                        recovered_before - lost)
    codes = {proc.pid: proc.returncode for proc in job.workers}
    assert job.am.returncode == 0 and codes.pop(host) in BACK_FROM_THE_DEAD, run.excerpt()
    assert list(codes.values()) == [0, 0] and "Traceback" not in run.output, run.excerpt()
    assert "no word from the `elan worker` of w1 for 1" in run.output, run.excerpt()
    assert [(a["action"], a["members"]) for a in run.adjustments()] == [("failure", ["w0", "w2"])], run.excerpt()
    assert_members_agree(run)
    assert_same_samples(run, static, victims=frozenset({"w1"}))
    assert_states_close(run.final_state(), static.final_state())


def _wait_for_output(job: EnrolledJob, text: str, timeout_s: float) -> float:
    """When ``text`` appeared in the job's output (monotonic), waiting at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while text not in job.output():
        if time.monotonic() > deadline:
            pytest.fail(f"{text!r} not in the output after {timeout_s:.0f} s\n{job.output()[-6000:]}")
        time.sleep(0.1)
    return time.monotonic()
