"""SIGTERM to a worker in its first seconds (while it imports torch and Lightning, before elan's handler exists) is a
leave, not a crash: the launcher starts every worker with SIGTERM blocked and the worker's SIGTERM watch takes the
held signal once installed (``launcher/lifeline.py``, ``elastic/termination.py``). Real `elan run` jobs, real signals
at fixed moments after the launcher spawned the worker; every job must end 0 with the static run's exact result."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.accelerate_runs import EPOCHS as ACCELERATE_EPOCHS
from tests.integration.accelerate_runs import JOB_ARGS
from tests.integration.accelerate_runs import PROBE as ACCELERATE_PROBE
from tests.integration.accelerate_runs import SAMPLES as ACCELERATE_SAMPLES
from tests.integration.elastic_runs import (
    PROBE_ARGS,
    TOLERANCE,
    RunResult,
    assert_counted_once,
    assert_every_trained_batch_ends_where_it_trained,
    assert_exact,
    assert_ranks_agree,
    assert_states_close,
    consumed_per_epoch,
    elan_command,
    elan_env,
)
from tests.integration.test_sigterm_leave import OutputReader

pytestmark = pytest.mark.integration

HELD = "received SIGTERM while it started: it asks to leave the job"
NEVER_STARTS_ENGINE = "import time; print('command up', flush=True); time.sleep(120)"


class SignalledJob:
    """An `elan run` job whose output is read as it runs; :meth:`sigterm` signals a worker at a moment of its life."""

    def __init__(self, tmp: Path, name: str, command: list[str]) -> None:
        self.tmp, self.name = tmp, name
        self.process = subprocess.Popen(command, env=elan_env(tmp), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.output = OutputReader(self.process)

    def spawned(self, worker: str) -> tuple[int, float]:
        """The worker's pid and when the launcher's line saying it was spawned was read."""
        line = self.output.wait_for(f"spawned {worker} (")
        match = re.search(r"pid (\d+)\)", line)
        assert match is not None, line
        return int(match.group(1)), time.monotonic()

    def sigterm(self, worker: str, after_s: float) -> int:
        """SIGTERM ``worker`` ``after_s`` seconds after it was spawned; returns its pid."""
        pid, seen = self.spawned(worker)
        time.sleep(max(0.0, seen + after_s - time.monotonic()))
        signal_process(pid, signal.SIGTERM)
        return pid

    def finish(self, timeout: float = 600) -> RunResult:
        """Wait for the job's end (killing it past ``timeout``); its output is kept in ``tmp/name.log``."""
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        text = self.output.text()
        (self.tmp / f"{self.name}.log").write_text(text)
        return RunResult(self.tmp / self.name, self.tmp / f"{self.name}-state", self.process.returncode, text)


def signal_process(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize("after_s", [0.2, 1.0, 3.0, 5.0])
def test_a_member_of_generation_0_sigtermed_while_it_starts_leaves(static_run, tmp_path, after_s):
    """3 members at global batch 12 (the static 2-worker run's), no coordination due: SIGTERM to w1 ``after_s`` after
    its spawn, before or after its handler exists. It leaves at a batch boundary (its first one when it was still
    starting), exits 0, and w0 and w2 end exactly as the static run."""
    name = "early"
    # 27 steps of at least 0.3 s: the job is still training at 5 s whatever the box's speed (no effect on the numbers)
    # a worker forked from the preloaded interpreter imports nothing: only a fresh one is surely still starting at 0.2 s
    fresh = ("--no-preload",) if after_s < 1.0 else ()
    command = elan_command(tmp_path, name, 3, [*PROBE_ARGS, "--global-batch", "12", "--step-sleep", "0.3"],
                           coordinate_every=50, launcher_args=("--term-grace", "120", *fresh))
    job = SignalledJob(tmp_path, name, command)
    pid = job.sigterm("w1", after_s)
    run = job.finish()

    assert run.returncode == 0, run.excerpt()
    assert f"w1 (pid {pid}) exited with code 0 (expected)" in run.output, run.excerpt()
    if after_s < 1.0:  # torch alone takes longer than this to import: the signal was held
        assert f"worker w1 {HELD}" in run.output
    records = assert_exact(run, static_run)
    assert_every_trained_batch_ends_where_it_trained(records)
    (adjustment,) = run.adjustments()
    assert (adjustment["action"], adjustment["leavers"], adjustment["members"]) == ("leave", ["w1"], ["w0", "w2"])
    (leaver,) = [record for record in records if record["worker"] == "w1"]
    assert leaver["left"] and leaver["global_step"] == adjustment["step"]


def test_a_joiner_sigtermed_while_it_starts_is_cancelled(static_run, tmp_path):
    """`add 1` at the start: its joiner is SIGTERMed 0.2 s after its spawn, long before it could report ready. Its
    request is cancelled, it exits 0, and the two members end exactly as the static run with no adjustment."""
    name = "joiner"
    # a joiner forked from the preloaded interpreter is ready in ~0.1 s: only a fresh one is surely still starting
    command = elan_command(tmp_path, name, 2, PROBE_ARGS, schedule="1:add=1",
                           launcher_args=("--term-grace", "120", "--no-preload"))
    job = SignalledJob(tmp_path, name, command)
    pid = job.sigterm("w2", 0.2)
    run = job.finish()

    assert run.returncode == 0, run.excerpt()
    assert f"w2 (pid {pid}) exited with code 0 (expected)" in run.output, run.excerpt()
    assert f"worker w2 {HELD}" in run.output, run.excerpt()
    assert "worker w2: leave cancelled" in run.output
    assert run.adjustments() == []
    assert_exact(run, static_run)


def test_a_preloaded_joiner_sigtermed_at_once_joins_or_is_cancelled_and_loses_nothing(static_run, tmp_path):
    """The same SIGTERM 0.2 s after a preloaded joiner's spawn: it may already have joined. Either its request is
    cancelled, or it joins and leaves again at a batch boundary; it exits 0 and the members end as the static run."""
    name = "joiner"
    command = elan_command(tmp_path, name, 2, PROBE_ARGS, schedule="1:add=1", launcher_args=("--term-grace", "120"))
    job = SignalledJob(tmp_path, name, command)
    pid = job.sigterm("w2", 0.2)
    run = job.finish()

    assert run.returncode == 0, run.excerpt()
    assert f"w2 (pid {pid}) exited with code 0 (expected)" in run.output, run.excerpt()
    assert_exact(run, static_run)
    adjustments = [(adjustment["action"], adjustment["members"]) for adjustment in run.adjustments()]
    assert adjustments in ([], [("add", ["w0", "w1", "w2"]), ("leave", ["w0", "w1"])]), adjustments


def test_an_accelerate_member_sigtermed_while_it_starts_leaves(plain_runs, tmp_path):
    """The Accelerate front-end installs the same watch: a member SIGTERMed 0.2 s after its spawn leaves at a batch
    boundary and exits 0; the job (a joiner added at the start) ends as the plain 2-process run."""
    name = "accel"
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", name, "--coordinate-every",
               "1", "--state-dir", str(tmp_path / f"{name}-state"), "--schedule", "1:add=1", "--term-grace", "120",
               "--no-preload",  # a preloaded worker may have built its accelerator 0.2 s after its spawn
               "--", sys.executable, str(ACCELERATE_PROBE), "--out", str(tmp_path / name), *JOB_ARGS[1]]
    job = SignalledJob(tmp_path, name, command)
    pid = job.sigterm("w1", 0.2)
    run = job.finish()

    assert run.returncode == 0, run.excerpt()
    assert f"w1 (pid {pid}) exited with code 0 (expected)" in run.output, run.excerpt()
    assert f"worker w1 {HELD}" in run.output
    records = run.records()
    assert_counted_once(consumed_per_epoch(records), ACCELERATE_SAMPLES, ACCELERATE_EPOCHS)
    assert_ranks_agree(records)
    assert_states_close(run.final_state(), plain_runs[1].final_state(), TOLERANCE)
    leaves = [adjustment for adjustment in run.adjustments() if adjustment["action"] == "leave"]
    assert [adjustment["leavers"] for adjustment in leaves] == [["w1"]]
    assert all("failure" not in adjustment for adjustment in run.adjustments())


def plain_command_job(tmp_path: Path, name: str) -> SignalledJob:
    """A 1-worker job whose command never imports lightning_elan: SIGTERM stays blocked in it."""
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "1", "--job", name, "--state-dir",
               str(tmp_path / f"{name}-state"), "--term-grace", "2", "--", sys.executable, "-c", NEVER_STARTS_ENGINE]
    job = SignalledJob(tmp_path, name, command)
    job.output.wait_for("command up")
    return job


def test_a_command_that_never_starts_the_engine_is_killed_term_grace_after_sigterm(tmp_path):
    """Nothing takes the held SIGTERM: the launcher SIGKILLs the worker ``--term-grace`` seconds after it (the crash
    path the watch would have taken); the job's only worker crashed, so the job fails."""
    job = plain_command_job(tmp_path, "plain")
    pid, _ = job.spawned("w0")
    signal_process(pid, signal.SIGTERM)
    started = time.monotonic()
    run = job.finish(timeout=120)
    assert 2.0 <= time.monotonic() - started < 60
    assert "w0 has held a SIGTERM for 2 s without installing its handler" in run.output, run.output
    assert f"w0 (pid {pid}) was killed by SIGKILL" in run.output
    assert run.returncode != 0


def test_the_launchers_own_stop_kills_a_worker_holding_sigterm_at_once(tmp_path):
    """``elan run`` stopped by SIGTERM: a worker that holds the SIGTERM it was sent is SIGKILLed at once, not after
    the 10 s kill grace."""
    job = plain_command_job(tmp_path, "stop")
    pid, _ = job.spawned("w0")
    job.process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    run = job.finish(timeout=120)
    assert time.monotonic() - started < 8
    assert run.returncode == 128 + signal.SIGTERM, run.output
    assert "w0 has not installed its SIGTERM handler yet: killing it" in run.output
    assert f"w0 (pid {pid}) was killed by SIGKILL" in run.output
