"""Accelerate's ``find_executable_batch_size`` (``examples/by_feature/memory.py``) under the real `elan run --nproc 2`
(user loop ``accelerate_executable_batch_loop.py``): the training function fails its first forward with an
out-of-memory error until the per-process batch is 4, and the decorator prepares the model, optimizer and a new
training loader again at each smaller size. The loop that finally runs is the training loop: it trains every sample once
per epoch and ends where the same loop started at 4 does (within 1e-9), also when a worker joins. Its tracker's rows
are written by the main process only. A retry after steps were applied (not supported) is named in a warning.

Before, the new loader of a retry was taken for an evaluation loader (the first prepared loader is the training
loader): the job trained on it outside elan's control, with ``accelerator.optimizer_steps`` 0 at the end and final
parameters 0.29 from the static run's, exit 0 and no warning.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.accelerate_runs import loop_records, loop_run
from tests.integration.elastic_runs import RunResult

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_executable_batch_loop.py")
SAMPLES, EPOCHS, WORLD, FITS = 96, 3, 2, 4
STEPS = EPOCHS * SAMPLES // (FITS * WORLD)
NOT_ELASTIC = "backward() of a batch that is not from the training DataLoader (the first one prepared)"


def elan_run(tmp: Path, name: str, start: int, schedule: str | None = None) -> RunResult:
    return loop_run(tmp, name, LOOP, (str(start),), nproc=WORLD, schedule=schedule)


records = loop_records


def assert_like_the_static_run(run: RunResult, reference: dict) -> dict[str, dict]:
    assert run.returncode == 0, run.excerpt()
    assert "Traceback" not in run.output, run.excerpt()
    assert NOT_ELASTIC not in run.output, run.excerpt()
    got = records(run)
    per_epoch: dict[str, Counter] = {}
    for record in got.values():
        for epoch, indices in record["trained"].items():
            per_epoch.setdefault(epoch, Counter()).update(indices)
    assert per_epoch == {str(epoch): Counter(range(SAMPLES)) for epoch in range(EPOCHS)}
    for worker, record in got.items():
        assert record["optimizer_steps"] == STEPS, worker
        for actual, expected in zip(record["parameters"], reference["parameters"], strict=True):
            assert actual == pytest.approx(expected, rel=0, abs=1e-9), worker
    return got


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The loop started at the batch size that fits: no retry."""
    static = elan_run(tmp_path_factory.mktemp("static"), "fits", FITS)
    assert static.returncode == 0, static.excerpt()
    record = records(static)["w0"]
    assert record["tried"] == [FITS] and record["optimizer_steps"] == STEPS
    return record


def tracker_rows(run: RunResult) -> list[dict]:
    return [json.loads(line) for line in (run.out / "tracker.jsonl").read_text().splitlines()]


def test_a_retry_at_a_smaller_batch_size_trains_as_the_static_run(tmp_path: Path, reference: dict) -> None:
    got = assert_like_the_static_run(elan_run(tmp_path, "retried", 8), reference)
    assert {tuple(record["tried"]) for record in got.values()} == {(8, 7, 6, 5, 4)}
    grown = assert_like_the_static_run(elan_run(tmp_path, "grown", 8, "5:add=1"), reference)
    assert set(grown) == {"w0", "w1", "w2"}


def test_a_joiner_warming_up_writes_no_tracker_row(tmp_path: Path, reference: dict) -> None:
    """A joiner before it is admitted is no process of the job, yet Accelerate's ``on_main_process`` ran there (its
    state is not distributed): its ``init_trackers`` wrote the config row a second time (a second run of a real
    tracker). Only the main process w0 writes now."""
    run = elan_run(tmp_path, "joined", FITS, "5:add=1")
    assert_like_the_static_run(run, reference)
    rows = tracker_rows(run)
    assert [row["worker"] for row in rows if "config" in row] == ["w0"], rows[:3]
    assert {row["worker"] for row in rows} == {"w0"}
    assert sorted(row["step"] for row in rows if "loss" in row) == list(range(STEPS))


def test_a_retry_after_steps_were_applied_is_named(tmp_path: Path) -> None:
    """Not supported: rank 0 leaves after step 5, so the survivor's share of the global batch (8) no longer fits and
    the decorator retries after steps were applied; the new loader is an evaluation loader there, whose batches elan
    does not count or re-shard. Before, nothing said so (exit 0, optimizer_steps frozen at the leave, an epoch's
    samples trained twice); the survivor now warns once."""
    run = elan_run(tmp_path, "shrunk", FITS, "5:remove=rank:0")
    assert run.returncode == 0, run.excerpt()
    assert run.output.count(NOT_ELASTIC) == 1, run.excerpt()
    assert records(run)["w1"]["tried"] == [FITS, 3]
