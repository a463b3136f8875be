"""A member's death known in the middle of an ``accumulate()`` window, as the user's loop sees it
(``classify_bert.py``: ``gradient_accumulation_steps=2``, the sample ids of a step's micro-batches kept until the step
is applied or skipped, as the corpus' ``SampleLog`` does). Rank 1 is SIGKILLed at the first micro-batch of step 5,
and rank 0 enters that micro-batch's backward only once it knows. Before, the survivor recovered at the boundary after
that micro-batch and its loop was given the window's first micro-batch again with no skipped step in between: its
log held those samples twice (the training itself was exact). Now the rest of the window is discarded, the batch that
calls the step sees ``optimizer_step_was_skipped``, and the window is redone from its first micro-batch: each sample
once per epoch, each step applied once, the static run's final model within 1e-9."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.users.accelerate.corpus_runs import (
    Job,
    Run,
    assert_each_sample_once,
    assert_ok,
    assert_states_close,
    assert_steps_applied_once,
    final_model,
    run_job,
)
from tests.users.accelerate.test_accelerate_corpus import BERT

pytestmark = pytest.mark.integration

KILL_STEP = 5


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static"), Job("bertstatic", BERT.file))
    assert_ok(run)
    return run


@pytest.mark.parametrize("where", ["first", "taken"])
def test_a_death_known_mid_window_redoes_the_window_the_loop_saw_skipped(static: Run, tmp_path: Path,
                                                                         where: str) -> None:
    """``first``: the death is known before the backward of the window's first micro-batch; ``taken``: before its
    forward, whose buffer broadcast (BERT's ``position_ids``: the elastic DDP broadcasts rank 0's buffers where DDP
    would) then meets it. Before, that broadcast raised out of the user's ``model(**batch)`` and the job failed."""
    run = run_job(tmp_path / "killed", Job("bertmidwindow", BERT.file, kill_step=KILL_STEP,
                                           env=(("USERS_KILL_MICRO", where), ("USERS_AWAIT_DEATH", str(KILL_STEP)))))
    assert_ok(run)
    assert [a["action"] for a in run.adjustments()][:1] == ["failure"], run.adjustments()
    assert_each_sample_once(run.trained(), BERT.samples, BERT.epochs)
    assert_steps_applied_once(run.trained(), range(BERT.steps))
    assert_states_close(final_model(run), final_model(static), where="final")
