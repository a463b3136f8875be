"""From the user's side: a bug in an ordinary Lightning script's ``training_step`` (an ``IndexError`` from step 3,
``user_scripts/bug_in_training_step.py``) under `elan run --nproc 2`. A bug on every rank fails the job with the
user's own error and traceback, without first waiting for the AM to say that a member died (the engine's wait for a
death, up to 60 s, is for errors a collective raised; before, every such bug printed "a collective failed ... waiting
up to 60 s" after 10 s and surfaced after 60). A bug on one rank only is that worker's death (its traceback, a
warning naming it): the other, whose all-reduce met its exit, recovers alone and redoes the step, as after a kill.
The same holds for a ``RuntimeError`` of a torch op the user called (``--bug dtype``: ``mat1 and mat2 must have the
same dtype``): it was raised outside any collective, so it is the process's own (``elastic/error_origin.py``); before,
every ``RuntimeError`` waited up to 60 s for a death that never came."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.elastic_runs import elan_env

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "user_scripts" / "bug_in_training_step.py"
WAITED = "the AM has not said that a member died"
DTYPE_BUG = "RuntimeError: mat1 and mat2 must have the same dtype"


def run_buggy(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", "bug", "--state-dir",
               str(tmp / "state"), "--", sys.executable, str(SCRIPT), str(tmp / "out"), *args]
    return subprocess.run(command, env=elan_env(tmp), capture_output=True, text=True, timeout=300)


def test_a_bug_on_every_rank_fails_the_job_with_the_users_error_at_once(tmp_path: Path) -> None:
    job = run_buggy(tmp_path, "3")
    output = job.stdout + job.stderr
    assert job.returncode != 0, output[-3000:]
    assert output.count("IndexError: list index out of range") >= 2, output[-3000:]  # each worker's own traceback
    assert WAITED not in output, output[-3000:]


def test_a_bug_on_one_rank_ends_that_worker_and_the_survivor_trains_on(tmp_path: Path) -> None:
    job = run_buggy(tmp_path, "3", "1")
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-3000:]
    assert output.count("IndexError: list index out of range") == 1, output[-3000:]  # rank 1's, with its traceback
    assert "w1 died (exited with code 1): its script raised an error" in output, output[-3000:]
    assert "step 4 redone" in output, output[-3000:]


def test_a_torch_error_on_every_rank_fails_the_job_with_the_users_error_at_once(tmp_path: Path) -> None:
    job = run_buggy(tmp_path, "3", "--bug", "dtype")
    output = job.stdout + job.stderr
    assert job.returncode != 0, output[-3000:]
    assert output.count(DTYPE_BUG) >= 2, output[-3000:]  # each worker's own traceback
    assert "bug_in_training_step.py" in output and "in training_step" in output, output[-3000:]
    assert WAITED not in output, output[-3000:]


def test_a_torch_error_on_one_rank_ends_that_worker_and_the_survivor_trains_on(tmp_path: Path) -> None:
    job = run_buggy(tmp_path, "3", "1", "--bug", "dtype")
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-3000:]
    assert output.count(DTYPE_BUG) == 1, output[-3000:]
    assert "w1 died (exited with code 1): its script raised an error" in output, output[-3000:]
    assert "step 4 redone" in output, output[-3000:]
