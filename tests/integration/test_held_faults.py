"""A member SIGKILLed from outside while the others are in a chosen phase of a step (issue 27 item 1): the survivors
discard the step if it was not committed, reset their elastic DDP and redo it (or keep it, once committed), and the job
ends exactly as the static run — exit 0, every sample once per epoch, bit-identical survivors, final parameters within
1e-9. Lightning (3 workers, ``--replace-failed``) and Accelerate (gradient accumulation 1 and 2), every phase of
``hold_point.PHASES`` (Lightning also ``METRIC``: the failure raised inside ``training_step``); the harness is
``hold_point.py`` (in the workers) and ``held_faults.py`` (the kill)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.integration.accelerate_runs import EPOCHS, JOB_ARGS, SAMPLES, committed_batches, total_steps
from tests.integration.elastic_runs import (
    TOLERANCE,
    RunResult,
    assert_counted_once,
    assert_ranks_agree,
    assert_states_close,
)
from tests.integration.held_faults import HeldKill, held_accelerate_run, held_lightning_run
from tests.integration.hold_point import METRIC, PHASES
from tests.integration.worker_faults import check_fault_run

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

COMMITTED = ("optimizer", "batch_end")
"""Phases after every member committed the step: it stands, the next one is the first redone."""
HOLD_STEP = 5


def expected_redone(phase: str, step: int) -> int:
    """The step a recovery redoes (counted from 1): the held one, or the next once it was committed."""
    return step + (2 if phase in COMMITTED else 1)


@pytest.mark.parametrize("phase", [METRIC, *PHASES])
def test_lightning_member_killed_while_the_others_are_in(tmp_path: Path, static_run: RunResult, phase: str) -> None:
    run, kill = held_lightning_run(tmp_path, "held", 3, f"w1:{HOLD_STEP}:{phase}", members=3,
                                   launcher_args=("--replace-failed",), probe_args=("--wait-for-joiners",))

    assert kill.killed_at is not None, f"the members never all held (arrived: {kill.arrived})\n{run.excerpt()}"
    failures = check_fault_run(run, static_run, dead=["w1"])

    assert failures[0]["failure"]["step_redone"] == expected_redone(phase, HOLD_STEP), failures
    adjustments = run.adjustments()
    assert [(a["action"], len(a["members"])) for a in adjustments] == [("failure", 2), ("add", 3)], adjustments
    log.info("w1 killed while the others were in %s: %s", phase, _summary(kill, failures))


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("phase", PHASES)
def test_accelerate_member_killed_while_the_others_are_in(plain_runs: dict[int, RunResult], tmp_path: Path,
                                                          phase: str, accumulation: int) -> None:
    step = 3  # after the join at step 1 (accumulation 2: its second micro-batch)
    args = [*JOB_ARGS[accumulation], "--wait-for-joiners"]
    run, kill = held_accelerate_run(tmp_path, f"held{accumulation}", 2, f"w1:{step}:{phase}", members=3, args=args,
                                    schedule="1:add=1")

    assert kill.killed_at is not None, f"the members never all held (arrived: {kill.arrived})\n{run.excerpt()}"
    assert run.returncode == 0, run.excerpt()
    assert_counted_once(committed_batches(run), SAMPLES, EPOCHS)
    assert assert_ranks_agree(run.records()) == total_steps(accumulation)
    assert_states_close(run.final_state(), plain_runs[accumulation].final_state(), TOLERANCE)
    grow, failure = run.adjustments()
    assert grow["action"] == "add" and failure["action"] == "failure" and failure["failure"]["dead"] == ["w1"]
    assert failure["failure"]["step_redone"] == expected_redone(phase, step), failure
    assert sorted(failure["members"]) == ["w0", "w2"]
    assert {record["worker"] for record in run.records()} == {"w0", "w2"}, "the dead left no record"


def _summary(kill: HeldKill, failures: list[dict]) -> str:
    failure = failures[0]["failure"]
    return (f"killed pid {kill.pid}; detected +{failure['detected_at'] - kill.killed_at:.2f} s, "
            f"recovered +{failure['recovered_at'] - kill.killed_at:.2f} s")
