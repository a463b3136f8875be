"""A member killed in the code at an epoch's end of an Accelerate loop (user loop ``accelerate_epoch_end_loop.py``:
``reduce`` of the epoch's loss, an evaluation pass, a tracker row, ``save_state``), under the real
`elan run --nproc 3`: rank 2 SIGKILLs itself in epoch 1 just before its ``accelerator.reduce``. The survivors recover
in that ``reduce`` and it runs again among them, so the evaluation after it gathers every sample and ``save_state``'s
barrier holds: exit 0, no traceback, every epoch's ``val_mse`` and the final model equal to a static 3-worker run's,
every sample once per epoch, a whole checkpoint per epoch.

On the old code the survivors treated the death as one inside a training step: ``reduce`` returned each process's own
value, the evaluation pass gathered the main process's samples only (epoch 1's ``val_mse`` off, with a warning), and
``save_state``'s barrier returned at once, so a survivor could find the main process's checkpoint directory made
already and died with Accelerate's ``ValueError: Checkpoint directory .../checkpoint_1 (1) already exists`` (found by
probe round 8).

A joiner admitted at an epoch's end (after its last step, 8 at 3 workers) runs the epoch's end code with the members,
its ``scheduler.step()`` before any ``optimizer.step()`` of its own: torch warned "Detected call of
`lr_scheduler.step()` before `optimizer.step()` ... PyTorch skipping the first value of the learning rate schedule"
(untrue: the members stepped). It now takes the optimizers as stepped with their state, silently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tests.integration.accelerate_runs import loop_run
from tests.integration.elastic_runs import (
    TOLERANCE,
    RunResult,
    assert_counted_once,
    assert_states_close,
    elan_env,
)

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_epoch_end_loop.py")
SAMPLES, EPOCHS = 192, 4


def trained_samples(run: RunResult) -> dict[int, Counter]:
    """The samples of each epoch's standing steps: a step trained twice (cut by the death, then redone by the
    survivors) counts in its last attempt only, the one made by the fewest processes."""
    attempts: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for path in run.out.glob("samples-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            attempts[record["epoch"], record["step"]].append(record)
    per_epoch: dict[int, Counter] = defaultdict(Counter)
    for (epoch, _), records in attempts.items():
        world = min(record["world"] for record in records)
        for record in records:
            if record["world"] == world:
                per_epoch[epoch].update(record["samples"])
    return dict(per_epoch)


def tracker_rows(run: RunResult) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run.out / "logs" / "run.jsonl").read_text().splitlines()]
    return {row["epoch"]: row for row in rows if "epoch" in row}


@pytest.fixture(scope="module")
def static(tmp_path_factory) -> RunResult:
    """The loop on 3 workers, nothing changing."""
    run = loop_run(tmp_path_factory.mktemp("static"), "static", LOOP, nproc=3)
    assert run.returncode == 0, run.excerpt()
    return run


def test_a_member_killed_in_an_epochs_reduce_is_recovered_there(tmp_path, static):
    run = loop_run(tmp_path, "killed", LOOP, ("--die-at", "reduce:2:1"), nproc=3)
    assert run.returncode == 0, run.excerpt()
    assert (run.out / "died-reduce").exists()
    assert "Traceback" not in run.output, run.excerpt()
    assert_counted_once(trained_samples(run), SAMPLES, EPOCHS)
    assert_states_close(run.final_state(), static.final_state(), TOLERANCE)
    expected, actual = tracker_rows(static), tracker_rows(run)
    assert sorted(actual) == list(range(EPOCHS))
    for epoch in range(EPOCHS):
        assert abs(actual[epoch]["val_mse"] - expected[epoch]["val_mse"]) <= TOLERANCE, (epoch, actual, expected)
    checkpoints = sorted(path.name for path in (run.out / "checkpoints").iterdir())
    assert checkpoints == [f"checkpoint_{epoch}" for epoch in range(EPOCHS)]
    for checkpoint in checkpoints:
        assert (run.out / "checkpoints" / checkpoint / "elan_state.json").exists(), checkpoint


def test_a_joiner_admitted_at_an_epochs_end_steps_its_scheduler_silently(tmp_path, static):
    """Torch's warnings shown as a user sees them (the tests' environment ignores warnings otherwise)."""
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "3", "--job", "joined",
               "--coordinate-every", "1", "--state-dir", str(tmp_path / "joined-state"), "--schedule", "8:add=1", "--",
               sys.executable, str(LOOP), str(tmp_path / "joined"), "--hold"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=420,
                          env={**elan_env(tmp_path), "PYTHONWARNINGS": "default"})
    run = RunResult(tmp_path / "joined", tmp_path / "joined-state", proc.returncode, proc.stdout + proc.stderr)
    assert run.returncode == 0, run.excerpt()
    assert [(record["action"], record["step"]) for record in run.adjustments()] == [("add", 8)]
    assert "before `optimizer.step()`" not in run.output, run.excerpt()
    assert_counted_once(trained_samples(run), SAMPLES, EPOCHS)
    assert_states_close(run.final_state(), static.final_state(), TOLERANCE)
