"""A joiner's ``accelerator.num_processes`` before ``prepare()`` is the job's launch world (user loop
``accelerate_sized_schedule_loop.py``, transformers' ``run_glue_no_trainer.py`` way of sizing the LR schedule with it),
under the real `elan run --nproc 3`: the joiner of an ``add`` builds the members' schedule, so every step it trains has
the members' LR and the job ends where the static run does (within 1e-9). Before the launcher told joiners the launch
world, a joiner saw 2 processes there: its warm-up and decay were shorter than the members' (LR 0.00867 where theirs
was 0.00933) and the parameters ended 5e-4 from the static run's, with exit 0 and no warning.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.integration.accelerate_runs import loop_records, loop_run
from tests.integration.elastic_runs import RunResult

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_sized_schedule_loop.py")
SAMPLES, EPOCHS, LAUNCH_WORLD = 96, 3, 3
STEPS = EPOCHS * SAMPLES // (4 * LAUNCH_WORLD)  # global batch 4 x 3 at every world size (strong scaling)


def elan_run(tmp: Path, name: str, schedule: str | None) -> RunResult:
    return loop_run(tmp, name, LOOP, nproc=LAUNCH_WORLD, schedule=schedule)


records = loop_records


def test_a_joiner_sizes_its_schedule_with_the_launch_world(tmp_path: Path) -> None:
    static = elan_run(tmp_path, "static", None)
    assert static.returncode == 0, static.excerpt()
    reference = records(static)["w0"]["lrs"]
    assert len(reference) == STEPS
    run = elan_run(tmp_path, "elastic", "3:add=1")
    assert run.returncode == 0, run.excerpt()
    got = records(run)
    assert set(got) == {"w0", "w1", "w2", "w3"}, run.excerpt()
    assert {record["processes_before_prepare"] for record in got.values()} == {LAUNCH_WORLD}
    per_epoch: dict[str, Counter] = {}
    for record in got.values():
        for epoch, indices in record["trained"].items():
            per_epoch.setdefault(epoch, Counter()).update(indices)
    assert per_epoch == {str(epoch): Counter(range(SAMPLES)) for epoch in range(EPOCHS)}
    joiner = got["w3"]["lrs"]
    assert 0 < len(joiner) < STEPS
    for worker, record in got.items():  # each step's LR is the static run's LR of that step
        assert record["lrs"] == pytest.approx(reference[-len(record["lrs"]):], abs=1e-15), worker
    expected, actual = torch.load(static.out / "final.pt"), torch.load(run.out / "final.pt")
    for key, value in expected.items():
        assert torch.allclose(actual[key], value, rtol=0, atol=1e-9), (key, float((actual[key] - value).abs().max()))
