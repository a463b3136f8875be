"""A second death while the survivors of a first one form their recovery generation, as the user's logs see it
(``datamodule_callbacks.py``: ``self.log("train_loss", on_epoch=True, sync_dist=True)`` and a torchmetrics
``MeanSquaredError`` logged per epoch). 2 workers grow to 3 at step 3; rank 1 is SIGKILLed as the batch of step 5
starts; one survivor SIGKILLs itself once it has the recovery's plan, before it enters its generation; the last one
goes on alone.

Each member records its epoch aggregates in the generation's store, and the heir of a recovery (its first stayer) adds
the dead members' records to its own. Before, the heir of the second recovery read only the records of the generation
that failed as it formed, in which the second victim had written none: that victim's part of the epoch (and, when it
was the first recovery's heir, the part it had taken from the first victim) was lost, and the epoch's logged loss was
not the static run's (random kills on ``contrastive_gather``, seed 7000: 2.3177 against 2.3891)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.users.corpus import (
    TOLERANCE,
    Job,
    assert_logged_alike,
    assert_ok,
    assert_same_samples,
    assert_states_close,
    read_csv,
    run_job,
)
from tests.users.test_corpus import CORPUS, check_metrics_loggers_profiler

pytestmark = pytest.mark.integration

COMMAND = CORPUS["datamodule_callbacks"].command
METRICS = Path("logs") / "regression" / "version_0" / "metrics.csv"


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory):
    run = run_job(tmp_path_factory.mktemp("static"), Job("dm_static", COMMAND))
    assert_ok(run)
    return run


@pytest.mark.parametrize("victim", ["w0", "w2"], ids=["the-first-heir", "another-survivor"])
def test_a_survivor_killed_entering_the_recovery_keeps_every_epochs_logged_values(static, tmp_path: Path,
                                                                                   victim: str) -> None:
    """``w0`` is the first recovery's heir (it took w1's part, then died before it recorded the sum); ``w2`` is the
    other survivor. Every epoch's ``train_loss_epoch`` and ``train_mse`` are the static run's, as are the samples and
    the final state."""
    run = run_job(tmp_path, Job("dm_twice", COMMAND, schedule="3:add=1", kill="5:start"),
                  env={"USERS_DIE_RECOVERING": victim})
    assert_ok(run)
    assert (run.observed / "recovering.log").exists(), "the second victim died where it was meant to"
    assert "failed during the recovery" in run.output, run.excerpt()
    assert len(run.adjustments()[-1]["members"]) == 1, run.adjustments()
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state(), TOLERANCE)
    _, rows = read_csv(run.out / METRICS)
    _, static_rows = read_csv(static.out / METRICS)
    for column in ("train_loss_epoch", "train_mse"):
        assert_logged_alike(rows, static_rows, column, exact=True)


@pytest.fixture(scope="module")
def profiler_static(tmp_path_factory: pytest.TempPathFactory):
    command = CORPUS["metrics_loggers_profiler"].command
    run = run_job(tmp_path_factory.mktemp("profiler_static"), Job("mlp_static", command))
    assert_ok(run)
    return run


def test_a_joiner_killed_before_its_adjustment_completed_keeps_its_part_of_the_epoch(profiler_static,
                                                                                      tmp_path: Path) -> None:
    """``metrics_loggers_profiler.py``: w2 joins at step 3, trains that batch, and is SIGKILLed in the validation
    after it (``$USERS_KILL_RANK=2``, phase ``validation``), before the AM completed its adjustment: the AM's
    recovery plan then names generation 0 as the previous one, while w2 recorded its part of the epoch in generation
    1. Before, the heir read generation 0 only: epoch 0's ``train_loss_epoch`` lacked w2's samples (0.2913, static
    0.2883; random kills, seed 7301). Every logged column and checkpoint is the static run's."""
    command = CORPUS["metrics_loggers_profiler"].command
    run = run_job(tmp_path, Job("mlp_joiner_killed", command, schedule="3:add=1", kill="3:validation"),
                  env={"USERS_KILL_RANK": "2"})
    assert_ok(run)
    assert [(a["action"], a["failure"]["dead"]) for a in run.adjustments()] == [("failure", ["w2"])], \
        run.adjustments()
    assert_same_samples(run, profiler_static)
    assert_states_close(run.final_state(), profiler_static.final_state(), TOLERANCE)
    check_metrics_loggers_profiler(run, profiler_static)

