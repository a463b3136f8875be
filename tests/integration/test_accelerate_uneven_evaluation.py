"""An evaluation loader with ``even_batches=False`` after a resize to a world that does not divide its batches (user
loop ``accelerate_uneven_evaluation_loop.py``, the real `elan run --nproc 2 --schedule 3:to=3`): Accelerate deals its
8 batches 3, 3, 2 over 3 processes, so a loop with a collective per batch (``gather_for_metrics`` in the loop over the
batches) waits for ever there: probe round 6 saw such a job, fine at 2 workers, hang after ``to=3`` until gloo's
300 s timeout failed every worker ('Timed out waiting 300000ms for recv operation'), with nothing saying why. Each
process now warns when its shards become uneven (not at 2 workers), and this loop, which gathers once per pass,
evaluates every sample once per epoch with the static run's losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.accelerate_runs import loop_records, loop_run
from tests.integration.elastic_runs import RunResult

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_uneven_evaluation_loop.py")
WARNING = "evaluation DataLoader with even_batches=False at 3 processes: its 8 batches are [3, 3, 2] per process"


def elan_run(tmp: Path, name: str, schedule: str | None = None) -> RunResult:
    return loop_run(tmp, name, LOOP, schedule=schedule)


records = loop_records


def test_uneven_evaluation_shards_after_a_resize_are_named(tmp_path: Path) -> None:
    static = elan_run(tmp_path, "static")
    assert static.returncode == 0, static.excerpt()
    assert "even_batches=False at" not in static.output
    reference = records(static)["w0"]["evaluations"]
    run = elan_run(tmp_path, "resized", "3:to=3")
    assert run.returncode == 0, run.excerpt()
    assert run.output.count(WARNING) == 3, run.excerpt()
    got = records(run)
    assert set(got) == {"w0", "w1", "w2"}
    for worker in ("w0", "w1"):
        evaluations = got[worker]["evaluations"]
        assert [evaluation["samples"] for evaluation in evaluations] == [list(range(32))] * 3, worker
        for actual, expected in zip(evaluations, reference, strict=True):
            assert actual["loss"] == pytest.approx(expected["loss"], rel=0, abs=1e-9), worker
