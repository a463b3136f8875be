"""A SIGTERM leave whose plan a member's death cuts short (found by ``random_kills --script contrastive_gather --seed
403 --signal MIXED --in-training``): w2 is SIGTERMed, the AM agrees its leave, and w1 dies at that coordination point
before it reads the agreement (rank 0 meets its death in the plan's broadcast). The job recovers without w1; the
leaver must still leave at once and exit 0 (it waited out its 30 s grace period and SIGKILLed itself), and the job
ends as the static run does. Real processes, real signals (the SIGTERM sent by the test, w1's SIGKILL by itself:
``fault_kill/``'s ``planned``)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.integration.elastic_runs import RunResult, wait_for_status
from tests.integration.test_sigterm_leave import pids_by_worker, wait_for_progress
from tests.integration.worker_faults import check_fault_run, fault_command

pytestmark = pytest.mark.integration


def test_a_leave_cut_by_a_death_at_its_coordination_still_leaves_at_once(static_run: RunResult,
                                                                           tmp_path: Path) -> None:
    name = "cut"
    command, env = fault_command(tmp_path, name, 3, ["--step-sleep", "0.3", "--progress"], library_kill="w1:planned")
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        status = wait_for_status(env, name, lambda s: s["members"] and all(m["pid"] for m in s["members"]))
        leaver = pids_by_worker(status)["w2"]
        wait_for_progress(tmp_path / name, "w2", 3)
        os.kill(leaver, signal.SIGTERM)
        output = job.communicate(timeout=300)[0]
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    (tmp_path / f"{name}.log").write_text(output)
    run = RunResult(tmp_path / name, tmp_path / f"{name}-state", job.returncode, output)
    assert (tmp_path / "elan-home" / "fault-kills.log").exists(), f"w1 never killed itself:\n{run.excerpt()}"
    assert "takes the crash path" not in output, run.excerpt()
    assert f"w2 (pid {leaver}) exited with code 0 (expected)" in output, run.excerpt()
    check_fault_run(run, static_run, dead=["w1"])
    assert run.adjustments()[-1]["members"] == ["w0"], run.adjustments()
