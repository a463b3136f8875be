"""A worker killed while the job starts (still importing, or while the others form the first generation): the
survivors form a generation without it and the job ends exact. Found by the failure storms: the others waited in
gloo's rendezvous for the dead member until they were declared dead themselves, and the job failed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import processes
from tests.faults.checks import check_storm
from tests.faults.storm import WORKERS, _kind, _stop, job_command, run_static
from tests.integration.elastic_runs import RunResult, elan_env

pytestmark = pytest.mark.integration

SAMPLES, EPOCHS = 100, 2
START_ARGS = ["--samples", str(SAMPLES), "--batch-size", "6", "--epochs", str(EPOCHS), "--global-batch", "18",
              "--progress"]
SLOWER = ["--step-sleep", "0.1"]
"""The killed job's 12 steps take 1.2 s more (no effect on the numbers): preloaded workers formed and trained the
whole job in 0.5 s on a quiet box, and the kill 0.3 s after their start landed after the training had ended."""


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run_static(tmp_path_factory.mktemp("start-static"), START_ARGS)


def killed_at_start(tmp: Path, delay_s: float, sig: signal.Signals, extra: tuple[str, ...] = ()) -> RunResult:
    """Run the job and send ``sig`` to its second worker ``delay_s`` after the launcher started it."""
    env = elan_env(tmp)
    with open(tmp / "job.log", "w") as log:
        launcher = subprocess.Popen(job_command(tmp, "job", WORKERS, extra, [*START_ARGS, *SLOWER]), env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
        try:
            workers = _await_workers(launcher.pid, WORKERS)
            time.sleep(delay_s)
            assert launcher.poll() is None, "the job ended before the kill"
            os.kill(sorted(workers)[1], sig)
            launcher.wait(600)
        finally:
            _stop(launcher)
    return RunResult(tmp / "job", tmp / "job-state", launcher.returncode, (tmp / "job.log").read_text())


def _await_workers(launcher: int, count: int) -> list[int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        workers = [pid for pid in processes.launched_by(launcher) if _kind(processes.argv(pid)) == "worker"]
        if len(workers) >= count:
            return workers
        time.sleep(0.01)
    raise AssertionError("the workers were never started")


# a fresh worker imports torch and Lightning for its first ~8 s here, then forms the first generation; a worker forked
# from the preloaded interpreter (launcher/preload.py) starts forming at once
@pytest.mark.parametrize(("delay_s", "start"), [(0.5, ("--no-preload",)), (3.0, ("--no-preload",)), (0.3, ())],
                         ids=["importing", "forming", "forming-preloaded"])
def test_a_member_killed_while_the_job_starts(tmp_path, static, delay_s, start):
    run = killed_at_start(tmp_path, delay_s, signal.SIGKILL, ("--replace-failed", *start))
    result = check_storm(run, static, SAMPLES, EPOCHS)
    assert result.recoveries == 1, f"one recovery from the death at start: {result}"
