"""AM crash, reduced form run by CI: 2 jobs, each with 5 SIGKILLs of the AM process at seeded random moments
(start-up, right after a scale request, while a joiner waits, during an adjustment, at random) and 2 self-SIGKILLs of
the AM right before / right after a state write; each job must end with the exact static result.
``python -m tests.integration.am_kill_trials --trials 50`` runs the full harness (see ``am_kills.py``)."""

from __future__ import annotations

import pytest

from tests.integration.am_kills import run_killed_job

pytestmark = pytest.mark.integration

KILLS_PER_JOB = 5
SAVE_KILLS_PER_JOB = 2


@pytest.mark.solo  # beside another job under `pytest -n` seed 101 once counted 8 adjustments for 7 requests
@pytest.mark.parametrize("seed", [101, 202])
def test_am_sigkilled_seven_times_the_job_ends_with_the_static_result(static_run, tmp_path, seed):
    job = run_killed_job(tmp_path, f"amkill{seed}", seed, KILLS_PER_JOB, SAVE_KILLS_PER_JOB)
    assert len(job.delivered) >= 5, f"only {job.delivered} of {job.planned} + {SAVE_KILLS_PER_JOB} kills delivered"
    job.check(static_run)
