"""A member killed as an evaluation pass starts, as the user's loop sees it (``classify_bert.py``: after every epoch
``model.eval()`` and a loop of ``model(**batch)`` under ``torch.no_grad()`` and ``gather_for_metrics``). The pass's
first forward follows a synchronised training step, so the elastic DDP broadcasts rank 0's buffers before it (BERT's
``position_ids``): the survivors meet the death there, inside the user's ``model(**batch)``. Before, that broadcast's
failure was raised out of the user's forward and the job failed. Now the survivors recover at once and go on with the
pass (the dead member's samples re-cut among them): the job ends, every evaluation over all 50 held-out samples with
the static run's results, the training exact."""

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
    logged_steps,
    run_job,
)
from tests.users.accelerate.test_accelerate_corpus import BERT

pytestmark = pytest.mark.integration


_STATIC: dict[int, Run] = {}


def static_run(tmp_path_factory: pytest.TempPathFactory, nproc: int) -> Run:
    """The static run at ``nproc`` workers (its global batch is ``nproc`` times the script's per-device batch)."""
    if nproc not in _STATIC:
        _STATIC[nproc] = run_job(tmp_path_factory.mktemp(f"static{nproc}"), Job("evalstatic", BERT.file, nproc=nproc))
        assert_ok(_STATIC[nproc])
    return _STATIC[nproc]


@pytest.mark.parametrize(("nproc", "rank"), [(2, 0), (2, 1), (3, 0)])
def test_a_member_killed_as_the_evaluation_starts_leaves_every_evaluation_whole(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, nproc: int, rank: int) -> None:
    """Rank ``rank`` of ``nproc`` workers SIGKILLs itself as it takes the first batch of the first evaluation pass
    (after epoch 0); the others go on without it. Rank 0 dead: the survivors meet the death in the broadcast they
    receive (at 3 workers, two survivors recover there and agree on where the pass is)."""
    static = static_run(tmp_path_factory, nproc)
    run = run_job(tmp_path / "killed", Job("evalkilled", BERT.file, nproc=nproc,
                                           env=(("USERS_DIE_EVALUATING", f"0:{rank}"),)))
    assert_ok(run)
    assert (run.home / "observe" / "died-evaluating.json").exists(), "the victim died where it was meant to"
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", nproc - 1)], \
        run.adjustments()
    evaluations, expected = logged_steps(run.metrics(), "eval_loss"), logged_steps(static.metrics(), "eval_loss")
    assert sorted(evaluations) == sorted(expected)
    for step, line in evaluations.items():
        assert line["eval_samples"] == BERT.eval_samples, line
        assert abs(line["eval_loss"] - expected[step]["eval_loss"]) <= 1e-9, (line, expected[step])
        assert line["eval_tokens"] == expected[step]["eval_tokens"], (line, expected[step])
    assert_each_sample_once(run.trained(), BERT.samples, BERT.epochs)
    steps = sorted({line["step"] for line in static.trained()})
    assert_steps_applied_once(run.trained(), range(len(steps)))
    assert_states_close(final_model(run), final_model(static), where="final")


def test_a_member_killed_before_it_pads_across_processes_leaves_every_evaluation_whole(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Rank 1 SIGKILLs itself as it enters ``pad_across_processes`` in the first evaluation pass (after its forward;
    the script pads each batch's token ids to the longest across the processes before ``gather_for_metrics``, as
    transformers' generation examples do): the survivor meets the death in that call's all-gather of the sizes.
    Before, that raised out of the user's ``pad_across_processes``."""
    static = static_run(tmp_path_factory, 2)
    run = run_job(tmp_path / "killed", Job("padkilled", BERT.file, env=(("USERS_DIE_PADDING", "1"),)))
    assert_ok(run)
    assert (run.home / "observe" / "died-in-pad_across_processes.json").exists()
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1)], run.adjustments()
    evaluations, expected = logged_steps(run.metrics(), "eval_loss"), logged_steps(static.metrics(), "eval_loss")
    assert sorted(evaluations) == sorted(expected)
    for step, line in evaluations.items():
        assert (line["eval_samples"], line["eval_tokens"]) == (BERT.eval_samples, expected[step]["eval_tokens"])
        assert abs(line["eval_loss"] - expected[step]["eval_loss"]) <= 1e-9, (line, expected[step])
    assert_states_close(final_model(run), final_model(static), where="final")

