"""A member killed in ``ModelCheckpoint``'s save (probe round 9): the survivors meet the death in
``Trainer.save_checkpoint``'s barrier and run the hook again in the new generation (a validation run again from its
first batch, an ``on_train_batch_end`` hook again). Before, the redo found Lightning's deciding callbacks as the
interrupted run left them: at a validation's end ``EarlyStopping`` counted the validation twice (its ``wait_count`` one
too high: the job stopped after epoch 1 of 6, with exit 0); at a training batch's end ``ModelCheckpoint`` had dropped
the k-th best file from its top k before the barrier (it removes the file after the save), so the redo dropped
another and left that one on disk (three files for ``save_top_k=2``). The interrupted run now gives back the state of
those callbacks (``compat._validation_start``, ``compat._deciding_state``), and ``ModelCheckpoint`` its record of its
saves (``compat.callback_state``).

The victim is rank 0, SIGKILLed before it writes a checkpoint (``die_in_checkpoint_save.py``); each run is compared
with a static run of the script at 3 workers. The observer records a batch's samples in ``on_train_batch_end`` after
``ModelCheckpoint``'s hook, so the victim's share of its last batch is never recorded: the samples are checked through
the final state (equal to the static run's within 1e-9), not counted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.users.corpus import (
    Job,
    Run,
    assert_checkpoints_alike,
    assert_logged_alike,
    assert_ok,
    assert_states_close,
    logged,
    read_csv,
    run_job,
)

pytestmark = pytest.mark.integration

HARNESS = str(Path(__file__).with_name("die_in_checkpoint_save.py"))


def test_a_member_killed_in_a_validations_checkpoint_save_changes_no_decision(tmp_path: Path) -> None:
    """``interval_eval_datamodule.py`` validating the whole set (so each validation's loss is the static run's),
    rank 0 killed before it writes its second checkpoint (after ``EarlyStopping`` counted that validation)."""
    args = ("interval_eval_datamodule.py", "{out}", "--limit-val-batches", "1.0")
    static = run_job(tmp_path / "static", Job("ckstatic", (f"{{scripts}}/{args[0]}", *args[1:]), nproc=3))
    assert_ok(static)
    run = run_job(tmp_path / "killed", Job("ckkilled", (HARNESS, "2", *args), nproc=3))
    assert_killed_in_save(run)
    assert "a member died during validation" in run.output
    results, expected = (json.loads((job.out / "results.json").read_text()) for job in (run, static))
    assert results["stopped_epoch"] == expected["stopped_epoch"] == 6, (results, expected)
    assert results["best"] == expected["best"]
    assert_states_close(run.final_state(), static.final_state())
    assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)
    _, rows = read_csv(run.out / "logs" / "version_0" / "metrics.csv")
    _, static_rows = read_csv(static.out / "logs" / "version_0" / "metrics.csv")
    for column in ("val_loss", "train_loss_step"):
        assert_logged_alike(rows, static_rows, column, exact=True)
    assert_logged_alike(rows, static_rows, "best_val_seen", exact=False)  # a float logged: Lightning's float32 mean
    seen, static_seen = logged(rows, "best_val_seen"), logged(static_rows, "best_val_seen")
    assert all(abs(value - static_seen[step]) <= 1e-6 for step, value in seen.items()), (seen, static_seen)


def test_a_member_killed_in_a_batch_ends_checkpoint_save_leaves_the_top_k(tmp_path: Path) -> None:
    """``datamodule_callbacks.py`` (``ModelCheckpoint(every_n_train_steps=4, save_top_k=2, monitor=...,
    save_last=True)``), rank 0 killed before it writes its third checkpoint (the top k full: one file is dropped)."""
    args = ("datamodule_callbacks.py", "{out}", "--prepare-per-node")
    static = run_job(tmp_path / "static", Job("dmstatic", (f"{{scripts}}/{args[0]}", *args[1:]), nproc=3))
    assert_ok(static)
    run = run_job(tmp_path / "killed", Job("dmkilled", (HARNESS, "3", *args), nproc=3))
    assert_killed_in_save(run)
    assert "a member died during ModelCheckpoint.on_train_batch_end" in run.output
    assert_states_close(run.final_state(), static.final_state())
    assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)


def test_a_member_killed_in_the_last_checkpoints_save_after_a_top_k_save_keeps_that_checkpoint(tmp_path: Path) -> None:
    """``datamodule_callbacks.py`` at 2 workers, rank 0 killed in the save of ``last.ckpt`` that follows its second
    top-k save, in the same ``on_train_batch_end`` (found by ``random_kills.py``, seed 5400): the hook run again
    writes the step's top-k checkpoint again (``ModelCheckpoint`` had recorded that it saved at this step, and the
    hook run again on that record skipped both saves: ``epoch=0-step=8.ckpt``, the best, was missing)."""
    args = ("datamodule_callbacks.py", "{out}")
    static = run_job(tmp_path / "static", Job("dmstatic", (f"{{scripts}}/{args[0]}", *args[1:])))
    assert_ok(static)
    run = run_job(tmp_path / "killed", Job("dmkilled", (HARNESS, "2:last", *args)))
    assert_killed_in_save(run)
    assert (run.out / "died-in-save").read_text().endswith("last.ckpt")
    assert "a member died during ModelCheckpoint.on_train_batch_end" in run.output
    assert_states_close(run.final_state(), static.final_state())
    assert_checkpoints_alike(run.out / "checkpoints", static.out / "checkpoints", exact=True)


def assert_killed_in_save(run: Run) -> None:
    assert_ok(run)
    assert "Traceback" not in run.output, run.excerpt()
    assert (run.out / "died-in-save").exists(), "rank 0 did not die in its checkpoint save"
    assert [adjustment["failure"]["dead"] for adjustment in run.adjustments()] == [["w0"]]
