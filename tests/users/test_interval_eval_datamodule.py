"""``scripts/interval_eval_datamodule.py`` (a ``LightningDataModule`` with ``prepare_data``/``setup``/``teardown``,
validation four times an epoch every second epoch, torchmetrics attributes, ``log_dict(sync_dist=True)``,
``callback_metrics`` read in ``on_train_epoch_end``, EarlyStopping + LearningRateMonitor + ModelCheckpoint top 2, then
``trainer.test(ckpt_path="best")`` and ``trainer.predict(ckpt_path="best")`` with a batch ``BasePredictionWriter``)
static and under the corpus's elastic schedule (2 → 3 → 2 → 2 → 1 workers).

Found by probe round 9: every worker that left the job during ``fit`` (rank 0 removed at step 6, the migrated one at
step 9) died in ``trainer.test(datamodule=...)`` with a traceback and exit 1: Lightning wraps the datamodule's
``prepare_data`` in ``_InfiniteBarrier``, whose ``torch.distributed.new_group`` a leaver (in no generation) refused
("this worker is not a member of the job right now"). A leaver now prepares no data (it evaluates nothing).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.users.corpus import (
    KILL_STEP,
    SCHEDULE,
    TOLERANCE,
    Job,
    Run,
    assert_checkpoints_alike,
    assert_elastic,
    assert_logged_alike,
    assert_static,
    logged,
    read_csv,
    run_job,
)

pytestmark = pytest.mark.integration

COMMAND = ("{scripts}/interval_eval_datamodule.py", "{out}")
EPOCHS, SAMPLES, STEPS = 6, 96, 48  # 8 global batches of 12 per epoch
METRIC_TOLERANCE = 1e-6  # a torchmetrics value (float32 states) against the static run's


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_job(tmp_path_factory.mktemp("static"), Job("ivstatic", COMMAND))


@pytest.fixture(scope="module")
def elastic(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_job(tmp_path_factory.mktemp("elastic"), Job("ivelastic", COMMAND, schedule=SCHEDULE,
                                                           kill=f"{KILL_STEP}:start"))


def assert_close_logged(rows: list[dict[str, str]], static_rows: list[dict[str, str]], column: str,
                        tolerance: float) -> None:
    actual, expected = logged(rows, column), logged(static_rows, column)
    assert all(abs(value - expected[step]) <= tolerance for step, value in actual.items()), (column, actual, expected)


def predictions(run: Run) -> dict[int, float]:
    predicted: dict[int, float] = {}
    for path in (run.out / "predictions").glob("batch-*.pt"):
        batch = torch.load(path)
        for index, value in zip(batch["index"].tolist(), batch["prediction"].flatten().tolist(), strict=True):
            assert index not in predicted, f"sample {index} predicted twice"
            predicted[index] = value
    return predicted


def test_static_run(static: Run) -> None:
    assert_static(static, dict.fromkeys(range(EPOCHS), SAMPLES), list(range(STEPS)))
    assert "Traceback" not in static.output, static.excerpt()


def test_elastic_run_leavers_exit_0_and_the_results_are_the_static_runs(static: Run, elastic: Run) -> None:
    assert "Traceback" not in elastic.output, elastic.excerpt()
    assert "exited with code 1" not in elastic.output, elastic.excerpt()
    assert_elastic(elastic, static, exact=True)
    assert_checkpoints_alike(elastic.out / "checkpoints", static.out / "checkpoints", exact=True)
    _, rows = read_csv(elastic.out / "logs" / "version_0" / "metrics.csv")
    _, static_rows = read_csv(static.out / "logs" / "version_0" / "metrics.csv")
    for column in ("train_loss_step", "train_loss_epoch", "val_loss", "lr-Adam"):
        assert_logged_alike(rows, static_rows, column, exact=True)
    for column in ("val_mae", "train_mse", "best_val_seen"):  # float32: torchmetrics states, a logged Python float
        assert_logged_alike(rows, static_rows, column, exact=False)
        assert_close_logged(rows, static_rows, column, METRIC_TOLERANCE)
    results, expected = (json.loads((run.out / "results.json").read_text()) for run in (elastic, static))
    assert results["best"] == expected["best"] and results["world_size"] == 1
    assert abs(results["test"][0]["test_loss"] - expected["test"][0]["test_loss"]) <= TOLERANCE
    assert abs(results["test"][0]["test_r2"] - expected["test"][0]["test_r2"]) <= METRIC_TOLERANCE
    predicted, reference = predictions(elastic), predictions(static)
    assert sorted(predicted) == sorted(reference) == list(range(36))
    assert max(abs(predicted[index] - reference[index]) for index in reference) <= TOLERANCE
