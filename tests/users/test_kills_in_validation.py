"""Kills the corpus' schedule does not reach, each compared with the static run: a member SIGKILLed inside a validation
run that falls in the middle of a gradient-accumulation window (``scripts/validate_mid_accumulation.py``), and in the
sanity check while the others sync torchmetrics (``scripts/metrics_loggers_profiler.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.users.corpus import (
    TOLERANCE,
    Job,
    Run,
    assert_checkpoints_alike,
    assert_logged_alike,
    assert_ok,
    assert_same_samples,
    assert_states_close,
    last_attempts,
    read_csv,
    run_job,
)
from tests.users.test_corpus import (
    check_glue_transformer,
    check_metrics_loggers_profiler,
    check_split_barriers_resume,
)

pytestmark = pytest.mark.integration

COMMAND = ("{scripts}/validate_mid_accumulation.py", "{out}")
# 120 samples, a global batch of 12: 10 batches an epoch, windows of 3 batches (the tenth alone), 4 optimizer steps
# an epoch; validation after every fifth batch. Epoch 2's validation after its batch 4 (the window of batches 3-5,
# which began at step 9) is the one cut short.
KILL = "9:validation"
STOP_AT_STEP = 14  # the script sets trainer.should_stop from this step


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static"), Job("static", COMMAND))
    assert_ok(run)
    return run


def test_a_member_killed_in_a_validation_inside_an_accumulation_window(tmp_path: Path, static: Run) -> None:
    """The window's micro-batches accumulated before the validation are redone from its first one by the survivor,
    with nothing of their first attempt left in the gradients: the final state, every validation, the checkpoints
    and the predictions are the static run's, and every sample trained once per epoch."""
    run = run_job(tmp_path, Job("killed", COMMAND, kill=KILL))
    assert_ok(run)
    assert [kill["phase"] for kill in run.kills()] == ["validation"]
    assert [a["action"] for a in run.adjustments()] == ["failure"]
    expected = last_attempts(static)
    seen = last_attempts(run)
    assert sorted(seen) == sorted(expected)
    for epoch, counts in seen.items():
        assert counts == expected[epoch], f"epoch {epoch}: {counts - expected[epoch]} / {expected[epoch] - counts}"
    assert_states_close(run.final_state(), static.final_state())
    validations = [json.loads(line) for line in (run.out / "validations.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (static.out / "validations.jsonl").read_text().splitlines()]
    assert [v["step"] for v in validations] == [v["step"] for v in reference]
    for mine, theirs in zip(validations, reference, strict=True):
        assert abs(mine["sum"] - theirs["sum"]) <= TOLERANCE, (mine, theirs)
    assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)
    assert json.loads((run.out / "predicted.json").read_text())["step"] == STOP_AT_STEP


SANITY_COMMAND = ("{scripts}/metrics_loggers_profiler.py", "{out}")


def test_a_member_killed_in_the_sanity_check_while_torchmetrics_syncs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 1 dies in the sanity check's ``on_validation_epoch_end`` (a callback's, which runs first), so rank 0 meets
    its death in the LightningModule's ``MetricCollection.compute()``, whose sync torchmetrics makes itself: the
    survivor runs the sanity check again and trains alone, as the static run trains (same samples, final state, every
    logged step of both CSV loggers and the same checkpoints)."""
    static = run_job(tmp_path_factory.mktemp("sanity-static"), Job("static", SANITY_COMMAND))
    assert_ok(static)
    run = run_job(tmp_path_factory.mktemp("sanity-killed"), Job("killed", SANITY_COMMAND, kill="sanity"))
    assert_ok(run)
    assert [kill["phase"] for kill in run.kills()] == ["sanity"]
    assert [a["action"] for a in run.adjustments()] == ["failure"]
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    for logger in ("csv_a", "csv_b"):
        _, rows = read_csv(run.out / logger / "version_0" / "metrics.csv")
        _, static_rows = read_csv(static.out / logger / "version_0" / "metrics.csv")
        for column in ("train_loss_step", "train_loss_epoch", "val_loss", "val_mse", "val_mae", "lr-Adam",
                       "grad_norm", "weight_norm"):
            assert_logged_alike(rows, static_rows, column, exact=True)
    assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)


def test_rank0_killed_in_a_validation_leaves_every_logger_in_its_version(tmp_path_factory: pytest.TempPathFactory
                                                                          ) -> None:
    """Rank 0 — the process that writes both ``CSVLogger``\\ s — dies in the validation after the batch that started
    at step 3 (found by ``random_kills.py``, seed 10): the new rank 0 continues both loggers in ``version_0``, as the
    static run wrote them. (It knew the first logger's version only, which Lightning resolves on every rank; its second
    logger opened ``version_1`` and ``metrics.csv`` of ``version_0`` stopped at the death.)"""
    static = run_job(tmp_path_factory.mktemp("rank0-static"), Job("static", SANITY_COMMAND))
    assert_ok(static)
    run = run_job(tmp_path_factory.mktemp("rank0-killed"), Job("killed", SANITY_COMMAND, kill="3:validation"),
                  {"USERS_KILL_RANK": "0"})
    assert_ok(run)
    assert [kill["phase"] for kill in run.kills()] == ["validation"]
    assert [a["action"] for a in run.adjustments()] == ["failure"]
    for logger in ("csv_a", "csv_b"):
        assert sorted(path.name for path in (run.out / logger).iterdir()) == ["version_0"], logger
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    check_metrics_loggers_profiler(run, static)


def test_rank0_killed_in_an_epochs_first_batch_keeps_the_epochs_learning_rate_row(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """``split_barriers_resume.py`` loses its rank 0 as the first batch of epoch 1 starts (found by ``random_kills.py
    --in-training``, seed 203): ``LearningRateMonitor`` logged that epoch's learning rate in ``on_train_epoch_start``,
    straight to the logger, which rank 0 had not saved yet. The row is in ``metrics.csv`` (it was lost: ``lr-SGD``
    logged at step 0 only) and the run is the static run's."""
    command = ("{scripts}/split_barriers_resume.py", "{out}")
    static = run_job(tmp_path_factory.mktemp("lr-static"), Job("static", command))
    assert_ok(static)
    run = run_job(tmp_path_factory.mktemp("lr-killed"), Job("killed", command, kill="8:start"),
                  {"USERS_KILL_RANK": "0"})
    assert_ok(run)
    assert [(kill["step"], kill["phase"]) for kill in run.kills()] == [(8, "start")]
    assert [a["action"] for a in run.adjustments()] == ["failure"]
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    check_split_barriers_resume(run, static)


def test_a_member_killed_in_a_validation_leaves_nothing_in_the_modules_list_of_outputs(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """``glue_transformer.py`` appends each validation batch's sums to ``self.outputs[dataloader_idx]`` and reduces
    them in ``on_validation_epoch_end``, Lightning's idiom: a member dies at the end of the validation after epoch 0
    (found by ``random_kills.py --in-training``, seed 5312), the survivor meets its death in that hook's reduce and
    runs the validation again, with its list as it was when the validation began. Each split saw each sample once (the
    survivor's list kept its first attempt: the matched split counted 27 of 18) and the run is the static run's."""
    command = ("{scripts}/glue_transformer.py", "{out}")
    static = run_job(tmp_path_factory.mktemp("glue-static"), Job("static", command))
    assert_ok(static)
    run = run_job(tmp_path_factory.mktemp("glue-killed"), Job("killed", command, kill="7:validation_end"))
    assert_ok(run)
    assert [(kill["step"], kill["phase"]) for kill in run.kills()] == [(7, "validation_end")]
    assert [a["action"] for a in run.adjustments()] == ["failure"]
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    check_glue_transformer(run, static)
