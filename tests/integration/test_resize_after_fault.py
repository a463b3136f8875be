"""A scheduled ``to N`` after a member was SIGKILLed: the resize is resolved against the members when it is decided,
so the job ends at N workers (the user-side probe: ``elan run --nproc 3 --schedule 28:to=2`` with a worker killed
before step 28 ended at 1 worker — the AM applied the ``remove 1`` the request had been queued as)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.elastic_runs import RunResult
from tests.integration.worker_faults import check_fault_run, fault_run

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("nproc", "schedule", "sizes", "said"),
    [
        (3, "15:to=2", [("failure", 2)], "the job already has 2 workers: nothing to do"),
        (2, "15:to=3", [("failure", 1), ("to", 3)], "is resolved against the 1 member of generation 1: add 2 workers"),
    ],
    ids=["to-the-size-a-death-left-changes-nothing", "to-a-bigger-size-starts-the-joiner-it-lacks"],
)
def test_a_scheduled_resize_after_a_death_ends_at_its_size(tmp_path: Path, static_run: RunResult, nproc: int,
                                                           schedule: str, sizes: list[tuple[str, int]],
                                                           said: str) -> None:
    run = fault_run(tmp_path, "resize", nproc, ["--kill-at", "w1:5:backward", "--wait-for-joiners"],
                    schedule=schedule)

    check_fault_run(run, static_run, dead=["w1"])
    assert [(record["action"], len(record["members"])) for record in run.adjustments()] == sizes, run.excerpt()
    assert said in run.output, run.excerpt()
