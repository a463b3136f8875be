"""A member SIGKILLed during a validation run inside ``fit``, or while it accumulates gradients, as the user sees it:
an ordinary script (``user_scripts/validate_and_die.py``: float64, ``CSVLogger``, a torchmetrics accuracy, a
step-interval plateau scheduler, checkpoints named by ``val_loss``, validation twice per epoch) kills itself once
under ``elan run --nproc 2``; the survivor ends as the static 2-process run: every row of ``metrics.csv`` (step,
epoch, each value within 1e-9), the checkpoints' names, the final parameters and the scheduler's state, and every
sample trained once per epoch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.users.corpus import (
    TOLERANCE,
    Job,
    Run,
    assert_ok,
    assert_same_samples,
    assert_states_close,
    read_csv,
    run_job,
)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "validate_and_die.py"
STEPS_PER_EPOCH = 8  # 96 samples, 6 per process and batch, 2 processes (the survivor takes the whole global batch)


def job(name: str, *args: str) -> Job:
    return Job(name, (str(SCRIPT), "{out}", *args))


@pytest.fixture(scope="module")
def static_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Run]:
    """The static 2-process run of the script, by ``accumulate_grad_batches`` (run when first needed)."""
    runs: dict[int, Run] = {}

    def static(accumulate: int) -> Run:
        if accumulate not in runs:
            run = run_job(tmp_path_factory.mktemp(f"static{accumulate}"),
                          job(f"static{accumulate}", "--accumulate", str(accumulate)))
            assert_ok(run)
            runs[accumulate] = run
        return runs[accumulate]

    return static  # type: ignore[return-value]


def assert_ends_as_static(run: Run, static: Run) -> None:
    assert_ok(run)
    assert (run.out / "died").exists(), "the member never killed itself"
    failures = [a for a in run.adjustments() if a["action"] == "failure"]
    assert len(failures) == 1 and len(failures[0]["members"]) == 1, run.adjustments()
    assert_same_rows(run.out / "logs" / "metrics.csv", static.out / "logs" / "metrics.csv")
    assert _names(run.out / "checkpoints") == _names(static.out / "checkpoints")
    assert_states_close(torch.load(run.out / "final.pt"), torch.load(static.out / "final.pt"))
    assert_same_values(json.loads((run.out / "final.json").read_text()),
                       json.loads((static.out / "final.json").read_text()))
    assert_same_samples(run, static)


def assert_same_rows(path: Path, static_path: Path) -> None:
    """Every row of the static run's ``metrics.csv``, in order: its step, epoch and logged values (within 1e-9)."""
    _, rows = read_csv(path)
    _, static_rows = read_csv(static_path)
    actual = [{key: value for key, value in row.items() if value != ""} for row in rows]
    expected = [{key: value for key, value in row.items() if value != ""} for row in static_rows]
    assert [sorted(row.items()) for row in _keys_and_steps(actual)] == [
        sorted(row.items()) for row in _keys_and_steps(expected)], "rows differ in their steps or keys"
    for index, (row, reference) in enumerate(zip(actual, expected, strict=True)):
        for key, value in reference.items():
            assert math.isclose(float(row[key]), float(value), rel_tol=0.0, abs_tol=TOLERANCE), (
                f"row {index} (step {row['step']}): {key} {row[key]} != {value}")


def _keys_and_steps(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{"step": row["step"], "epoch": row.get("epoch", ""), "keys": ",".join(sorted(row))} for row in rows]


def assert_same_values(actual: object, expected: object) -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (actual, expected)
        for key in expected:
            assert_same_values(actual[key], expected[key])
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), (actual, expected)
        for mine, theirs in zip(actual, expected, strict=True):
            assert_same_values(mine, theirs)
    elif isinstance(expected, float):
        assert math.isclose(actual, expected, rel_tol=0.0, abs_tol=TOLERANCE), (actual, expected)  # type: ignore[arg-type]
    else:
        assert actual == expected


def _names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob("*.ckpt"))


@pytest.mark.parametrize("step", [STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2, STEPS_PER_EPOCH],
                         ids=["mid-epoch", "epoch-end"])
def test_a_death_during_validation_runs_that_validation_again(tmp_path: Path, static_runs, step: int) -> None:
    """Rank 1 dies at the second batch of the validation at ``step`` (``val_check_interval=0.5`` in epoch 1, or
    the one at epoch 0's end): the survivor validates again from its first batch, over the whole validation set,
    logs it once (nothing of the abandoned run in its ``val_loss``/``val_acc``), names its checkpoint by it, steps the
    plateau scheduler once and counts the batch once in the logged steps."""
    run = run_job(tmp_path, job("valdeath", "--die-validating", f"{step}:1"))

    assert_ends_as_static(run, static_runs(1))


def test_rank0_dying_while_accumulating_keeps_the_rows_it_logged(tmp_path: Path, static_runs) -> None:
    """``accumulate_grad_batches=2``: rank 0 dies at the first micro-batch of a window (epoch 1, batch 2), after it
    logged the previous step's ``train_loss``; that row is in ``metrics.csv``, and the survivor (the new rank 0)
    logs the rest once."""
    run = run_job(tmp_path, job("accdeath", "--accumulate", "2", "--die-training", "1:2:0"))

    assert_ends_as_static(run, static_runs(2))
