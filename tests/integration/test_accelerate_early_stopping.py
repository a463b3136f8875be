"""Accelerate's early stopping (``set_trigger``/``check_trigger``, ``examples/by_feature/early_stopping.py``) with a
worker that joined the running job (user loop ``accelerate_early_stopping_loop.py``, the real `elan run --nproc 2
--schedule 3:add=1`): every process leaves the loop after the same epoch, as in the static run, and the job ends 0.

Before, the joiner died with ``LoopEnded`` ('the job's other workers ended their training loop after 24 optimizer
steps while this worker, which joined the running job, trains on ...') and the job failed (exit 1): the main process
announced the end of its loop while the joiner, past the same ``check_trigger()`` but slower to leave (it writes its
own summary first), was still in the loop at that step, which counted as training past it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.integration.accelerate_runs import loop_records, loop_run
from tests.integration.elastic_runs import RunResult

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_early_stopping_loop.py")
SAMPLES = 64


def elan_run(tmp: Path, name: str, schedule: str | None = None) -> RunResult:
    return loop_run(tmp, name, LOOP, schedule=schedule)


records = loop_records


def test_a_joiner_stops_early_with_the_members(tmp_path: Path) -> None:
    static = elan_run(tmp_path, "static")
    assert static.returncode == 0, static.excerpt()
    reference = records(static)["w0"]
    stopped = reference["stopped_after"]
    assert stopped is not None and int(stopped) < 7, reference["losses"]  # it stops early, before the last epoch
    run = elan_run(tmp_path, "joined", "3:add=1")
    assert run.returncode == 0, run.excerpt()
    assert "Traceback" not in run.output and "LoopEnded" not in run.output, run.excerpt()
    got = records(run)
    assert set(got) == {"w0", "w1", "w2"}, run.excerpt()
    per_epoch: dict[str, Counter] = {}
    for worker, record in got.items():
        assert record["stopped_after"] == stopped, worker
        assert record["optimizer_steps"] == reference["optimizer_steps"], worker
        for actual, expected in zip(record["parameters"], reference["parameters"], strict=True):
            assert actual == pytest.approx(expected, rel=0, abs=1e-9), worker
        for epoch, indices in record["trained"].items():
            per_epoch.setdefault(epoch, Counter()).update(indices)
    assert per_epoch == {str(epoch): Counter(range(SAMPLES)) for epoch in range(stopped + 1)}
