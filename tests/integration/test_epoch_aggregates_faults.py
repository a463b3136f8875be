"""A member SIGKILLed after its step stood, as the user sees its epoch values: an ordinary script
(``user_scripts/aggregate_and_die.py``: float64, ``self.log("train_loss", on_step=False, on_epoch=True,
sync_dist=True)`` and a torchmetrics ``MeanSquaredError`` logged per epoch, ``CSVLogger``) kills itself once under
``elan run``. Its part of the epoch lives in its process until the epoch's end; the survivors' epoch values must
still be the static run's (within 1e-9), and the final parameters too. Before, a member dying in ``on_train_batch_end``
(its step stood, its next batch boundary not reached) left its part of that step out (with a warning), and one dying
in the first step of a new generation left its whole part of the epoch out, silently."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.users.corpus import (
    TOLERANCE,
    Job,
    Run,
    assert_ok,
    assert_states_close,
    logged,
    read_csv,
    run_job,
    static_runs_by_world,
)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "aggregate_and_die.py"
JOIN = "3:add=1"
"""The joiner's generation trains from the batch that starts at global step 3 (the fourth step) on; 6 steps per
epoch with 2 processes, 4 with 3."""


def job(name: str, nproc: int, *args: str, schedule: str | None = None) -> Job:
    return Job(name, (str(SCRIPT), "{out}", *args), nproc=nproc, schedule=schedule)


@pytest.fixture(scope="module")
def static_runs(tmp_path_factory: pytest.TempPathFactory):
    """The static run of the script with ``nproc`` processes (run when first needed)."""
    return static_runs_by_world(tmp_path_factory, job)


def epoch_values(run: Run) -> dict[str, dict[int, float]]:
    _, rows = read_csv(run.out / "logs" / "metrics.csv")
    return {column: logged(rows, column) for column in ("train_loss", "train_mse")}


def assert_epochs_as_static(run: Run, static: Run) -> None:
    assert_ok(run)
    assert (run.out / "died").exists(), "the member never killed itself"
    assert [a["action"] for a in run.adjustments()][-1:] == ["failure"], run.adjustments()
    actual, expected = epoch_values(run), epoch_values(static)
    for column, values in expected.items():
        assert sorted(actual[column]) == sorted(values), f"{column} logged at {sorted(actual[column])}"
        for step, value in values.items():
            assert math.isclose(actual[column][step], value, rel_tol=0.0, abs_tol=TOLERANCE), (
                f"{column} at step {step}: {actual[column][step]} != the static run's {value}")
    assert_states_close(torch.load(run.out / "final.pt"), torch.load(static.out / "final.pt"))


@pytest.mark.parametrize(("nproc", "die", "schedule"), [
    (2, "1:3:end", None),
    (2, "0:3:end", None),
    (3, "1:2:end", None),
    (2, "1:6:end", None),
    (2, "1:3:end", JOIN),
    (2, "0:3:end", JOIN),
    (2, "2:3:end", JOIN),
    (3, "1:3:end", JOIN),
    (2, "1:3:start", JOIN),
], ids=["rank1-mid-2", "rank0-mid-2", "rank1-mid-3", "rank1-epoch-start-2", "rank1-joined-2", "rank0-joined-2",
        "joiner-joined-2", "rank1-joined-3", "rank1-joined-before-the-step-2"])
def test_a_death_keeps_the_dead_members_part_of_the_epoch(tmp_path: Path, static_runs, nproc: int, die: str,
                                                          schedule: str | None) -> None:
    """The process of rank ``die``'s first number SIGKILLs itself in the batch that starts at the given step: in
    ``on_train_batch_end`` (the step stood: the dead member's part of it is handed to the heir) mid-epoch, in an
    epoch's first batch, and in the first step of the generation a scheduled join formed; or, there, in
    ``on_train_batch_start`` (the step is redone; its part of the steps before it is handed over)."""
    run = run_job(tmp_path, job("aggdeath", nproc, "--die", die, schedule=schedule))

    assert_epochs_as_static(run, static_runs(nproc))
