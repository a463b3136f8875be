"""AM crash, reduced form run by CI: 2 jobs × 5 SIGKILLs of the AM process at seeded random moments (start-up, right
after a scale request, while a joiner waits, during an adjustment, at random); each job must end with the exact static
result. ``python -m tests.integration.am_kill_trials --trials 50`` runs the full harness (see ``am_kills.py``)."""

from __future__ import annotations

import pytest

from tests.integration.am_kills import run_killed_job

pytestmark = pytest.mark.integration

KILLS_PER_JOB = 5


@pytest.mark.parametrize("seed", [101, 202])
def test_am_sigkilled_five_times_the_job_ends_with_the_static_result(static_run, tmp_path, seed):
    job = run_killed_job(tmp_path, f"amkill{seed}", seed, KILLS_PER_JOB)
    assert len(job.delivered) >= 3, f"only {job.delivered} of {job.planned} kills were delivered"
    job.check(static_run)
