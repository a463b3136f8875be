"""A member killed in ``ModelCheckpoint``'s save at the end of a validation run (probe round 9): the survivors meet
the death in ``Trainer.save_checkpoint``'s barrier and run the validation again in the new generation. Before, that
redo found the callbacks as the interrupted run left them: ``EarlyStopping`` counted the validation twice (its
``wait_count`` one too high: the job stopped after epoch 1 of 6, with exit 0) and ``ModelCheckpoint`` ranked the
redone run against the interrupted one (three files kept for ``save_top_k=2``). The interrupted run now gives back
the state of the callbacks with validation hooks and ``trainer.should_stop`` (``compat._validation_start``).

``scripts/interval_eval_datamodule.py`` at 3 workers, validating the whole set (``--limit-val-batches 1.0``, so each
validation's loss is the static run's), rank 0 SIGKILLed before it writes its second checkpoint
(``die_in_checkpoint_save.py``); compared with a static 3-worker run of the script.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.users.corpus import (
    Job,
    assert_checkpoints_alike,
    assert_logged_alike,
    assert_ok,
    assert_same_samples,
    assert_states_close,
    logged,
    read_csv,
    run_job,
)

pytestmark = pytest.mark.integration

ARGS = ("{out}", "--limit-val-batches", "1.0")
HARNESS = str(Path(__file__).with_name("die_in_checkpoint_save.py"))


def test_a_member_killed_in_a_validations_checkpoint_save_changes_no_decision(tmp_path: Path) -> None:
    static = run_job(tmp_path / "static", Job("ckstatic", ("{scripts}/interval_eval_datamodule.py", *ARGS), nproc=3))
    assert_ok(static)
    run = run_job(tmp_path / "killed", Job("ckkilled", (HARNESS, *ARGS), nproc=3))
    assert_ok(run)
    assert "Traceback" not in run.output, run.excerpt()
    assert (run.out / "died-in-save").exists(), "rank 0 did not die in its checkpoint save"
    assert [adjustment["failure"]["dead"] for adjustment in run.adjustments()] == [["w0"]]
    assert "a member died during validation" in run.output
    results, expected = (json.loads((job.out / "results.json").read_text()) for job in (run, static))
    assert results["stopped_epoch"] == expected["stopped_epoch"] == 6, (results, expected)
    assert results["best"] == expected["best"]
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
    assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)
    _, rows = read_csv(run.out / "logs" / "version_0" / "metrics.csv")
    _, static_rows = read_csv(static.out / "logs" / "version_0" / "metrics.csv")
    for column in ("val_loss", "train_loss_step"):
        assert_logged_alike(rows, static_rows, column, exact=True)
    assert_logged_alike(rows, static_rows, "best_val_seen", exact=False)  # a float logged: Lightning's float32 mean
    seen, static_seen = logged(rows, "best_val_seen"), logged(static_rows, "best_val_seen")
    assert all(abs(value - static_seen[step]) <= 1e-6 for step, value in seen.items()), (seen, static_seen)
