"""How ``elan run`` reads its workers' exits (issue 27): only an exit the AM waited for is '(expected)'; it tells the
AM what the rendezvous store says of each exit, and obeys the AM's verdict on the job (the rule itself is the AM's:
``test_am_finishing.py``)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_elan.launcher.run import ExitVerdict, JobLauncher, LaunchConfig, WorkerProcess, describe_exit
from lightning_elan.protocol.contract import (
    FINISHED_BY_LAUNCHER,
    AdjustmentPlan,
    MemberStatus,
    StatusReply,
    WorkerExitReply,
    WorkerExitRequest,
    script_failed_key,
    training_ended_key,
)


@pytest.mark.parametrize(
    ("reply", "returncode", "described"),
    [
        ({"expected": True}, 0, "exited with code 0 (expected)"),
        ({"expected": False, "recovering": True, "failed_generations": [0]}, 1,
         "exited with code 1 (the job recovers without it)"),
        ({"expected": True}, -15, "was killed by SIGTERM (after the job's training completed)"),
        ({"expected": False}, 0, "exited with code 0"),
        ({"expected": False, "recovering": False}, 1, "exited with code 1"),
    ],
)
def test_only_an_exit_the_am_waited_for_is_expected(reply: dict, returncode: int, described: str) -> None:
    verdict = ExitVerdict.from_reply(WorkerExitReply.from_body(reply), returncode)
    assert describe_exit(returncode, verdict.expected, verdict.note) == described
    assert verdict.tolerated == (reply.get("expected") or reply.get("recovering") or False)


def launcher_with(returncodes: dict[str, int | None]) -> JobLauncher:
    launcher = JobLauncher(LaunchConfig(job="j", nproc=len(returncodes), command=["true"], state_dir=Path("unused")))
    for worker_id, returncode in returncodes.items():
        launcher._workers[worker_id] = WorkerProcess(worker_id, "member", SimpleNamespace(pid=1), returncode=returncode)
    return launcher


def launcher_with_store(returncodes: dict[str, int | None], training_ended: list[str]) -> JobLauncher:
    """A launcher whose job store holds the marks of the members whose training loop ended."""
    import torch.distributed as dist

    launcher = launcher_with(returncodes)
    launcher._store = dist.HashStore()
    for worker_id in training_ended:
        launcher._store.set(training_ended_key(worker_id), b"1")
    return launcher


def test_each_exit_is_reported_with_what_the_store_says_of_the_worker() -> None:
    """The AM decides whether the job is done from these marks (storm seed 356: a member killed after the last step,
    before its own mark, while another's training loop had ended)."""
    launcher = launcher_with_store({"w0": 0, "w1": -9, "w2": -6}, training_ended=["w0", "w2"])
    launcher._store.set(script_failed_key("w2"), b"1")

    reports = [launcher._exit_report(launcher._workers[worker]) for worker in ("w0", "w1", "w2")]

    assert reports == [WorkerExitRequest("w0", 0, training_ended=True, script_failed=False),
                       WorkerExitRequest("w1", -9, training_ended=False, script_failed=False),
                       WorkerExitRequest("w2", -6, training_ended=True, script_failed=True)]


def test_without_a_store_an_exit_is_reported_unmarked() -> None:
    launcher = launcher_with({"w0": -9})
    assert launcher._exit_report(launcher._workers["w0"]) == WorkerExitRequest("w0", -9, False, False)


@pytest.mark.parametrize("training_ended", [True, False])
def test_a_death_after_the_training_ended_is_still_reported_as_a_death(training_ended: bool) -> None:
    """The other members may be in collectives after ``fit``: only the generation's failure releases them."""
    launcher = launcher_with_store({"w1": -9}, ["w1"] if training_ended else [])
    assert launcher._counted_exit(launcher._workers["w1"], -9) == -9


def test_once_the_am_finished_the_job_the_launcher_stops_the_joiners_of_a_stranded_plan(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The AM ended the job because its members finished training with a plan in flight: its joiner (a live child
    here) is stopped by the launcher, as an expected exit, and the member killed after the training is named."""
    launcher = launcher_with({"w0": 0, "w1": -9})
    joiner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        launcher._workers["w2"] = WorkerProcess("w2", "joiner", joiner)
        plan = AdjustmentPlan("r1", "add", 1, 0, 10, ["w0", "w1", "w2"], ["w0", "w1"], ["w2"], [], {"w2": "w0"}, {})
        members = [MemberStatus("w0", 0), MemberStatus("w1", 1)]
        status = StatusReply("j", 0, members, finished=True, in_flight=plan, finish_reason=FINISHED_BY_LAUNCHER)

        with caplog.at_level(logging.INFO, logger="lightning_elan.launcher.run"):
            launcher._end_after_training(status)

        assert launcher._workers["w2"].stranded and joiner.poll() == -15
        assert "job j: w1 was killed by SIGKILL after the training was complete (another member finished it): what " \
               "its script does after training did not run" in caplog.messages
        assert "job j: the members finished before adjustment r1 was carried out; stopping its joiner w2" \
               in caplog.messages
    finally:
        joiner.kill()
        joiner.wait()
