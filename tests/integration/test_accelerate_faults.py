"""A member of an Accelerate job killed with SIGKILL mid-step: the survivors discard the step (nothing applied, the
user's loop sees ``optimizer_step_was_skipped``), re-form without it and redo the step's global batches — the result
equals a static plain-Accelerate run within 1e-9, and every sample counts once per epoch."""

from __future__ import annotations

import os

import pytest

from tests.integration.accelerate_runs import (
    EPOCHS,
    JOB_ARGS,
    SAMPLES,
    accelerate_run,
    committed_batches,
    total_steps,
)
from tests.integration.elastic_runs import (
    TOLERANCE,
    assert_counted_once,
    assert_ranks_agree,
    assert_states_close,
    consumed_per_epoch,
)
from tests.integration.worker_faults import FAULT_KILL_DIR

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("accumulation", "schedule", "kill"), [
    (1, "2:add=1", "w0:5:backward"),  # rank 0 dies inside the gradient all-reduce
    (2, "1:add=1", "w1:3:accumulating"),  # dies in a micro-batch without all-reduce: the whole step is redone
])
def test_sigkill_mid_step_is_redone_by_the_survivors(plain_runs, tmp_path, accumulation, schedule, kill):
    args = [*JOB_ARGS[accumulation], "--wait-for-joiners", "--kill-at", kill]
    run = accelerate_run(tmp_path, f"kill{accumulation}", 2, args, schedule=schedule)
    assert run.returncode == 0, run.excerpt()
    assert_counted_once(committed_batches(run), SAMPLES, EPOCHS)
    assert assert_ranks_agree(run.records()) == total_steps(accumulation)  # the redone step's attempts agree too
    assert_states_close(run.final_state(), plain_runs[accumulation].final_state(), TOLERANCE)
    _grow, failure = run.adjustments()
    dead = kill.split(":")[0]
    assert failure["action"] == "failure" and failure["failure"]["dead"] == [dead]
    assert failure["failure"]["step_redone"] == int(kill.split(":")[1]) + 1
    assert len(failure["members"]) == 2 and dead not in failure["members"]
    assert {record["worker"] for record in run.records()} == set(failure["members"]), "the dead left no record"


def test_sigterm_makes_a_worker_leave_at_the_next_batch_boundary(plain_runs, tmp_path):
    """SIGTERM (a preemption notice) to a member mid-step: it finishes the step, leaves at the next batch boundary
    and exits 0 although coordination is due only every 5 steps; nothing is redone."""
    args = ["--wait-for-joiners", "--sigterm-at", "w2:6"]  # after the join at step 5
    run = accelerate_run(tmp_path, "sigterm", 2, args, schedule="1:add=1", coordinate_every=5)
    assert run.returncode == 0, run.excerpt()
    records = run.records()
    assert_counted_once(consumed_per_epoch(records), SAMPLES, EPOCHS)
    assert_ranks_agree(records)
    assert_states_close(run.final_state(), plain_runs[1].final_state(), TOLERANCE)
    grow, leave = run.adjustments()
    assert grow["step"] == 5 and grow["joiners"] == ["w2"]
    # the leave request reaches the AM asynchronously (a step or two later on a loaded machine): the leave comes at the
    # first batch boundary after that, before the next coordination due (step 10)
    assert leave["leavers"] == ["w2"] and 7 <= leave["step"] < 10 and "failure" not in leave
    (leaver,) = [record for record in records if record["worker"] == "w2"]
    assert leaver["left"] and leaver["optimizer_steps"] == leave["step"]


def test_a_member_killed_after_its_loop_ended_fails_nothing(plain_runs, tmp_path):
    """w1 is SIGKILLed once its ``epochs()`` loop ran out (the job's last step was trained by every member), while w0
    waits for everyone before it saves (the probe's ``wait_for_everyone``, Accelerate's usual pattern): w0 meets the
    death in that barrier and recovers at once, with no step to redo and no joiner (the code after the loop is
    recovered from since session 37), then saves the final state; the job ends 0."""
    run = _exact_after_a_library_kill(plain_runs, tmp_path, "after", "w1:loop_over")
    assert "after the death of w1 (outside the training loop: no step redone)" in run.output, run.excerpt()


def test_a_member_killed_in_prepare_before_the_loop_is_recovered(plain_runs, tmp_path):
    """w1 is SIGKILLed as it calls ``accelerator.prepare`` (before its training loop; w0 is in ``prepare``'s DDP
    broadcast of rank 0's weights or its first step): w0 trains the whole job alone, exactly."""
    _exact_after_a_library_kill(plain_runs, tmp_path, "prepare_kill", "w1:preparing")


def _exact_after_a_library_kill(plain_runs, tmp_path, job, kill):
    """A 2-worker job whose ``kill`` (``WORKER:PHASE``, tests/integration/fault_kill) SIGKILLs that worker: exit 0,
    that kill, every sample once per epoch, the plain run's final state."""
    env = {"ELAN_TEST_KILL": kill,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULT_KILL_DIR), os.environ.get("PYTHONPATH")])),
           "ELAN_PRELOAD_SITECUSTOMIZE": "worker"}
    run = accelerate_run(tmp_path, job, 2, list(JOB_ARGS[1]), env=env)
    assert run.returncode == 0, run.excerpt()
    kills = (tmp_path / "elan-home" / "fault-kills.log").read_text().split()
    assert kills[:2] == kill.split(":"), kills
    assert_counted_once(committed_batches(run), SAMPLES, EPOCHS)
    assert_states_close(run.final_state(), plain_runs[1].final_state(), TOLERANCE)
    return run
