"""A member SIGKILLed at a chosen point: the job goes on without it, redoes the interrupted step and ends exactly as
the static run (see ``worker_faults.py`` for the harness and what each check means)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import processes
from tests.integration.elastic_runs import TOLERANCE, RunResult, assert_ranks_agree, assert_states_close
from tests.integration.worker_faults import (
    assert_completed_once,
    check_fault_run,
    failure_records,
    fault_command,
    fault_run,
    unblock_seconds,
)

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)


@pytest.mark.parametrize(
    ("victim", "phase"),
    [("w1", "backward"), ("w2", "optimizer"), ("w0", "backward")],
    ids=["member-in-the-gradient-allreduce", "member-in-the-optimizer-step", "rank-0-in-the-gradient-allreduce"],
)
def test_a_killed_member_is_dropped_and_its_step_redone(tmp_path: Path, static_run: RunResult, victim: str,
                                                        phase: str) -> None:
    run = fault_run(tmp_path, "fault", 3, ["--kill-at", f"{victim}:5:{phase}"])

    failures = check_fault_run(run, static_run, dead=[victim])

    assert [len(record["members"]) for record in run.adjustments()] == [2]
    redone = failures[0]["failure"]["step_redone"]
    assert redone == (6 if phase == "backward" else 7), failures  # killed after the commit: step 6 stands
    log.info("%s killed in %s: survivors unblocked after %s s", victim, phase, unblock_seconds(failures))


def test_with_replace_failed_the_world_size_comes_back(tmp_path: Path, static_run: RunResult) -> None:
    run = fault_run(tmp_path, "replace", 3, ["--kill-at", "w1:4:backward", "--wait-for-joiners"],
                    launcher_args=("--replace-failed",))

    check_fault_run(run, static_run, dead=["w1"])

    adjustments = run.adjustments()
    assert [(a["action"], len(a["members"])) for a in adjustments] == [("failure", 2), ("add", 3)], adjustments
    assert adjustments[1]["joiners"] == ["w3"]


def test_a_source_killed_while_it_serves_a_joiner(tmp_path: Path, static_run: RunResult) -> None:
    run = fault_run(tmp_path, "source", 2, ["--wait-for-joiners"], schedule="3:add=1", library_kill="*:send")

    source = _killed(tmp_path)
    failures = check_fault_run(run, static_run, dead=[source])

    record = failures[0]
    assert record["joiners"] == ["w2"] and record["sources"]["w2"] != source, record  # served by the other stayer
    assert record["received"]["w2"]["source"] == record["sources"]["w2"]


def test_a_joiner_killed_while_it_receives(tmp_path: Path, static_run: RunResult) -> None:
    run = fault_run(tmp_path, "joiner", 2, ["--wait-for-joiners"], schedule="3:add=1", library_kill="w2:receive")

    failures = check_fault_run(run, static_run, dead=["w2"])

    assert _killed(tmp_path) == "w2"
    assert failures[0]["members"] == ["w0", "w1"] and failures[0]["joiners"] == []


def test_a_survivor_killed_while_the_recovery_generation_forms(tmp_path: Path, static_run: RunResult) -> None:
    """w1 dies in its backward; w2, a survivor, dies as it enters the recovery's generation: w0 meets that death
    while the generation forms and recovers from it in turn, alone, exactly."""
    run = fault_run(tmp_path, "second", 3, ["--kill-at", "w1:5:backward"], library_kill="w2:recovering")

    failures = check_fault_run(run, static_run, dead=["w1", "w2"])

    assert _killed(tmp_path) == "w2"
    assert "worker w0: generation 1 failed during the recovery" in run.output, run.excerpt()
    assert run.adjustments()[-1]["members"] == ["w0"], failures


def test_a_survivor_killed_after_it_arrived_in_the_recovery_generation(tmp_path: Path, static_run: RunResult) -> None:
    """w1 dies in its backward; w2, a survivor, dies once every member has arrived in the recovery's generation, before
    its backend connects: w0, inside gloo's rendezvous (which waits for a missing peer for the whole timeout), meets
    that death and recovers from it in turn, alone, exactly (found by the fault matrix, ``lightning:data:w1+w2``)."""
    run = fault_run(tmp_path, "connecting", 3, ["--kill-at", "w1:5:backward"], library_kill="w2:connecting")

    failures = check_fault_run(run, static_run, dead=["w1", "w2"])

    assert _killed(tmp_path) == "w2"
    assert "worker w0: generation 1 failed during the recovery" in run.output, run.excerpt()
    assert run.adjustments()[-1]["members"] == ["w0"], failures


@pytest.mark.parametrize("phase", ["trained", "train_end"], ids=["after-it-told-the-launcher", "in-on-train-end"])
def test_a_member_killed_after_the_training_ended_fails_nothing(tmp_path: Path, static_run: RunResult,
                                                                 phase: str) -> None:
    """w1 is SIGKILLed once its training loop ended (the job's last step was trained by every member), before its
    script's code after ``fit``: the training is complete, so once the others have exited the job ends 0, saying
    what did not run (storm seed 356: the job failed, "every worker has exited but generation 5 is unfinished")."""
    run = fault_run(tmp_path, "after", 3, [], library_kill=f"w1:{phase}", launcher_args=("--replace-failed",))

    assert run.returncode == 0, run.excerpt()
    assert _killed(tmp_path) == "w1"
    assert_completed_once(run.out)
    assert_ranks_agree(run.records())
    assert_states_close(run.final_state(), static_run.final_state(), TOLERANCE)
    assert sorted(record["worker"] for record in run.records() if not record["left"]) == ["w0", "w2"]
    assert "what its script does after training did not run" in run.output, run.excerpt()
    assert failure_records(run) == []  # the recovery started for it never formed a generation


def test_a_member_killed_in_a_barrier_before_the_first_batch_is_recovered(tmp_path: Path,
                                                                           static_run: RunResult) -> None:
    """w1 is SIGKILLed entering Lightning's first barrier before the training loop (storm seed 953: w0 and w2 crashed in
    ``_CheckpointConnector.resume_end``'s barrier with gloo's "Connection reset by peer", the job failed): the
    survivors recover and train the whole job."""
    run = fault_run(tmp_path, "preloop", 3, [], library_kill="w1:barrier", launcher_args=("--replace-failed",))

    assert _killed(tmp_path) == "w1"
    check_fault_run(run, static_run, ["w1"])


@pytest.mark.parametrize("kill", ["w0:barrier:pre_setup", "w1:barrier:_CheckpointConnector.resume_end",
                                  "w2:broadcast", "w0:broadcast", "w1:ddp_broadcast", "w0:ddp_broadcast"])
def test_a_member_killed_in_a_collective_before_the_training_loop_is_recovered(tmp_path: Path, static_run: RunResult,
                                                                                kill: str) -> None:
    """Rank 0 at the setup barrier, a member after the model is wrapped in DDP (``resume_end``), DDP's broadcast of
    rank 0's weights as the model is wrapped (a receiver, or the source), the broadcast of ``ModelCheckpoint``'s
    directory (its source may be past it when the others learn of the death): the survivors run the interrupted
    collective again without the dead one and train the whole job exactly."""
    victim = kill.split(":")[0]
    run = fault_run(tmp_path, "preloop", 3, [], library_kill=kill, launcher_args=("--replace-failed",))

    assert _killed(tmp_path) == victim
    check_fault_run(run, static_run, [victim])


def test_below_min_workers_before_the_loop_the_replacement_joins_in_the_loop(tmp_path: Path,
                                                                             static_run: RunResult) -> None:
    """w1 of 2 is SIGKILLed in Lightning's first barrier under ``--min-workers 2``: w0 alone is below the minimum, but
    it is before its training loop (its model not set up, its collectives before the loop not made by a joiner), so
    it goes on alone and the replacement joins at a batch boundary; the job is exact (before: the replacement was
    admitted into the recovery with an empty state, and w0's barrier waited for it forever)."""
    run = fault_run(tmp_path, "preloop_min", 2, ["--wait-for-joiners"], library_kill="w1:barrier",
                    launcher_args=("--replace-failed", "--min-workers", "2", "--join-timeout", "240"))

    assert _killed(tmp_path) == "w1"
    check_fault_run(run, static_run, ["w1"])
    assert [(record["action"], len(record["members"])) for record in run.adjustments()] == [("failure", 1),
                                                                                            ("add", 2)]


def _killed(tmp: Path) -> str:
    lines = (tmp / "elan-home" / "fault-kills.log").read_text().splitlines()
    assert len(lines) == 1, lines
    return lines[0].split()[0]


def test_below_min_workers_without_a_joiner_the_job_stops_and_says_why(tmp_path: Path) -> None:
    run = fault_run(tmp_path, "minimum", 2, ["--kill-at", "w1:5:backward"],
                    launcher_args=("--min-workers", "2", "--join-timeout", "3"))

    assert run.returncode == 1, run.excerpt()
    assert "1 worker left after f1, fewer than --min-workers 2, and no joiner came within 3 s" in run.output
    assert "waiting up to 3 s for joiners" in run.output  # the log line while it waited


AM_PAUSE_S = 20.0
"""Longer than the 10 s a survivor used to wait for the AM's notice of a death before it failed."""


def test_a_death_the_am_hears_of_late_is_still_recovered(tmp_path: Path, static_run: RunResult) -> None:
    """The AM is paused (SIGSTOP, as an oversubscribed or swapping host pauses it) while w1 SIGKILLs itself in its
    backward: w0's all-reduce fails at once, but the notice that w1 died comes only when the AM runs again, 20 s later.
    w0 waits for it and the job ends as the static run (it gave up after 10 s and failed the job)."""
    command, env = fault_command(tmp_path, "late", 2, ["--kill-at", "w1:12:backward", "--progress",
                                                       "--step-sleep", "0.1"], coordinate_every=100)
    with open(tmp_path / "late.log", "w") as output:
        job = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    am = None
    try:
        progress = tmp_path / "late"
        _wait_for(lambda: _progress(progress, "w0").get("step", 0) >= 2, "w0 completed step 2")
        am = next(pid for pid in processes.children(job.pid) if (processes.argv(pid) or [])[3:4] == [b"am"])
        os.kill(am, signal.SIGSTOP)
        victim = _progress(progress, "w1")["pid"]
        _wait_for(lambda: not processes.running(victim), "w1 killed itself")
        time.sleep(AM_PAUSE_S)
        os.kill(am, signal.SIGCONT)
        job.wait(300)
    finally:
        if am is not None:
            _signal(am, signal.SIGCONT)
        job.kill()
        job.wait()
    run = RunResult(tmp_path / "late", tmp_path / "late-state", job.returncode, (tmp_path / "late.log").read_text())
    check_fault_run(run, static_run, dead=["w1"])


def _wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.01)


def _progress(out: Path, worker: str) -> dict:
    try:
        return json.loads((out / f"progress-{worker}.json").read_text())
    except (OSError, ValueError):
        return {}


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
