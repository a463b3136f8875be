"""Members killed in the script's code after its ``epochs()`` loop, as the user's script sees it
(``classify_bert.py --test_after_training``: after the loop, a held-out test split evaluated with ``gather_for_metrics``
and logged, then ``wait_for_everyone()`` and the main process's ``save_pretrained``).

Before, a death there was not recovered from: the survivors' collectives returned their own values, so the test
metrics covered the survivor's 26 of the 50 samples (exit 0, a warning in the log), and with rank 0 dead in the final
barrier no process was the main one: the final model was never saved. Now the survivors form a new generation at once
(no joiner: there is no training left), the test pass goes on with the dead member's samples, and a barrier runs again
among them: the test metrics are the static run's over all 50 samples, and the main process of the moment saves the
final model, which is the static run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.users.accelerate.corpus_runs import (
    Job,
    Run,
    assert_each_sample_once,
    assert_ok,
    assert_states_close,
    final_model,
    logged_steps,
    run_job,
)
from tests.users.accelerate.test_accelerate_corpus import BERT

pytestmark = pytest.mark.integration

ARGS = ("--test_after_training",)


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static"), Job("afterstatic", BERT.file, args=ARGS))
    assert_ok(run)
    return run


def assert_after_the_loop_as_static(run: Run, static: Run, died: str) -> None:
    assert_ok(run)
    assert (run.home / "observe" / died).exists(), "the victim died where it was meant to"
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1)], run.adjustments()
    assert "outside the training loop: no step redone" in run.output, run.excerpt()
    [tested] = logged_steps(run.metrics(), "test_loss").values()
    [expected] = logged_steps(static.metrics(), "test_loss").values()
    assert tested["test_samples"] == BERT.eval_samples, tested
    assert abs(tested["test_loss"] - expected["test_loss"]) <= 1e-9, (tested, expected)
    assert tested["test_accuracy"] == expected["test_accuracy"], (tested, expected)
    assert_each_sample_once(run.trained(), BERT.samples, BERT.epochs)
    assert_states_close(final_model(run), final_model(static), where="final")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_member_killed_as_the_test_pass_after_the_loop_starts(static: Run, tmp_path: Path, rank: int) -> None:
    """Rank ``rank`` SIGKILLs itself as it takes the first batch of the test pass (its evaluation pass after the 3
    in the loop): the survivor evaluates its samples too."""
    run = run_job(tmp_path, Job("aftertest", BERT.file, args=ARGS,
                                env=(("USERS_DIE_EVALUATING", f"{BERT.epochs}:{rank}"),)))
    assert_after_the_loop_as_static(run, static, "died-evaluating.json")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_member_killed_in_the_final_barrier_leaves_the_model_saved(static: Run, tmp_path: Path, rank: int) -> None:
    """Rank ``rank`` SIGKILLs itself as it enters the barrier before the main process saves: the survivor meets the
    death there, and, rank 0 dead, becomes the main process and saves."""
    run = run_job(tmp_path, Job("afterbarrier", BERT.file, args=ARGS, env=(("USERS_DIE_AFTER_LOOP", str(rank)),)))
    assert_after_the_loop_as_static(run, static, "died-after-loop.json")


@pytest.fixture(scope="module")
def sharded_static(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("gpt2static"), Job("fsdpstatic", "causal_lm_gpt2.py", args=("--fsdp",)))
    assert_ok(run)
    return run


@pytest.mark.parametrize("where", ["USERS_DIE_AFTER_LOOP", "USERS_DIE_GATHERING_STATE"],
                         ids=["in-the-barrier", "in-get_state_dict"])
def test_a_sharded_member_killed_before_the_final_save_leaves_the_whole_model_saved(sharded_static: Run,
                                                                                   tmp_path: Path,
                                                                                   where: str) -> None:
    """``causal_lm_gpt2.py --fsdp`` (FSDP2: each process holds a shard): rank 0 SIGKILLs itself in the barrier before
    every process gathers the full state (``get_state_dict``: the survivor meets the death in the barrier), or as it
    enters that gather (the survivor meets it inside the gather; before, that raised out of ``get_state_dict``). The
    survivor recovers the dead member's shard from its mirror and saves the static run's model. (At one process the
    gathered tensors of the tied head share the embedding's storage, so ``save_pretrained`` leaves ``lm_head.weight``
    out, as it does for a DDP model; the static run's gathered copies do not share it.)"""
    static = sharded_static
    run = run_job(tmp_path, Job("fsdpafter", "causal_lm_gpt2.py", args=("--fsdp",), env=((where, "0"),)))
    assert_ok(run)
    assert (run.home / "observe" / "died-after-loop.json").exists()
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 1)], run.adjustments()
    saved, expected = final_model(run), final_model(static)
    expected.pop("lm_head.weight")
    saved.pop("lm_head.weight", None)
    assert_states_close(saved, expected, where="final")
