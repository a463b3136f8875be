"""Rank 0 SIGKILLed around a step it logs, as the user sees it: an ordinary script (``user_scripts/log_and_die.py``:
float64, the step's loss logged every step with ``sync_dist``, ``LearningRateMonitor``, ``CSVLogger``) kills itself
once under ``elan run``. Only rank 0 writes ``metrics.csv``, and the rows of a step are held until the step stands;
whatever the phase of the death, every step's rows are in ``metrics.csv`` exactly once with the static run's values
(within 1e-9), and the final parameters are the static run's. Before, rank 0 dying after its step stood (in
``on_train_batch_end``) lost that step's rows, silently."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_validation_faults import assert_same_rows
from tests.users.corpus import (
    Job,
    Run,
    assert_ok,
    assert_same_samples,
    assert_states_close,
    logged,
    read_csv,
    run_job,
    static_runs_by_world,
)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "log_and_die.py"
KILL_STEP = 3  # mid-epoch 0 (6 steps per epoch with 2 processes, 4 with 3)


def job(name: str, nproc: int, *args: str) -> Job:
    return Job(name, (str(SCRIPT), "{out}", *args), nproc=nproc)


@pytest.fixture(scope="module")
def static_runs(tmp_path_factory: pytest.TempPathFactory):
    """The static run of the script with ``nproc`` processes (run when first needed)."""
    return static_runs_by_world(tmp_path_factory, job)


def assert_ends_as_static(run: Run, static: Run) -> None:
    assert_ok(run)
    assert (run.out / "died").exists(), "the member never killed itself"
    failures = [a for a in run.adjustments() if a["action"] == "failure"]
    assert len(failures) == 1 and len(failures[0]["members"]) == run.job.nproc - 1, run.adjustments()
    metrics = run.out / "logs" / "metrics.csv"
    _, rows = read_csv(metrics)
    _, static_rows = read_csv(static.out / "logs" / "metrics.csv")
    for column in ("train_loss", "lr-SGD"):  # a step logged twice raises
        assert sorted(logged(rows, column)) == sorted(logged(static_rows, column)), f"{column}: steps differ"
    assert_same_rows(metrics, static.out / "logs" / "metrics.csv")
    assert_states_close(torch.load(run.out / "final.pt"), torch.load(static.out / "final.pt"))
    if not run.job.command[-1].endswith(":optimizer"):  # killed there, it trained its batch before the observer's
        assert_same_samples(run, static)                # record of it (its parameters above tell it trained once)


@pytest.mark.parametrize(("nproc", "die"), [
    (2, f"0:{KILL_STEP}:end"),
    (3, f"0:{KILL_STEP}:end"),
    (2, f"0:{KILL_STEP}:optimizer"),
    (2, f"0:{KILL_STEP}:start"),
    (2, f"1:{KILL_STEP}:end"),
], ids=["rank0-end-2", "rank0-end-3", "rank0-optimizer-2", "rank0-start-2", "rank1-end-2"])
def test_a_death_around_a_logged_step_keeps_each_row_once(tmp_path: Path, static_runs, nproc: int, die: str) -> None:
    """The process of rank ``die``'s first number SIGKILLs itself at step ``KILL_STEP``, in ``on_train_batch_end``
    (the step stood: the new rank 0 writes the rows the dead rank 0 had not), right after the optimizer step (likewise)
    or in ``on_train_batch_start`` (the step is redone: its rows are logged once, by the new rank 0)."""
    run = run_job(tmp_path, job("rowdeath", nproc, "--die", die))

    assert_ends_as_static(run, static_runs(nproc))
