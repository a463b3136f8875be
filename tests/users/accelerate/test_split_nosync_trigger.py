"""``split_nosync_trigger.py`` (probe round 10: ``split_batches=True``, accumulation by hand with ``no_sync``,
``autocast``, a warm-up ``LambdaLR`` stepped per optimizer step, ``accelerator.reduce``, early stopping with
``set_trigger``/``check_trigger``) static at 2 workers and elastic: 2 → 3 at step 2, rank 0 removed at step 4, a
migration at step 6, the process that is rank 1 at step 9 SIGKILLed at the window's first micro-batch with
``--replace-failed``. The elastic run must be the static run: samples once per epoch, each step applied once, every
step's reduced loss and LR, every epoch's held-out loss, the epoch the trigger stopped at, the final model within
1e-9.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.users.accelerate.corpus_runs import (
    Job,
    Run,
    assert_each_sample_once,
    assert_members_agree,
    assert_ok,
    assert_steps_applied_once,
    logged_steps,
    run_job,
)

pytestmark = pytest.mark.integration

SCRIPT, SAMPLES, STEPS_PER_EPOCH = "split_nosync_trigger.py", 96, 4  # 2 micro-batches of 12 per step
STOPPED_AT = 6  # the held-out loss first falls under 0.145 after epoch 6


def stopped_at(run: Run) -> int:
    [line] = [line for line in run.metrics() if "stopped_at_epoch" in line]
    return line["stopped_at_epoch"]


def check_static(run: Run) -> None:
    assert_ok(run)
    assert stopped_at(run) == STOPPED_AT
    steps = (STOPPED_AT + 1) * STEPS_PER_EPOCH
    assert_each_sample_once(run.trained(), SAMPLES, STOPPED_AT + 1)
    assert_steps_applied_once(run.trained(), range(steps))
    assert sorted(logged_steps(run.metrics(), "train_loss")) == list(range(steps))


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static"), Job("splitstatic", SCRIPT))
    check_static(run)
    return run


def test_split_batches_no_sync_and_a_trigger_under_resizes_and_a_kill_are_the_static_run(static: Run,
                                                                                        tmp_path: Path) -> None:
    run = run_job(tmp_path / "elastic", Job("splitelastic", SCRIPT, schedule="2:add=1,4:remove=rank:0,6:migrate=1",
                                            kill_step=9))
    assert_ok(run)
    assert "Traceback" not in run.output, run.excerpt()
    assert [a["action"] for a in run.adjustments()][:4] == ["add", "remove", "migrate", "failure"]
    check_static(run)
    assert_same_run(run, static)


def test_a_kill_in_the_first_windows_all_reduce_is_the_static_run(static: Run, tmp_path: Path) -> None:
    """Rank 1 SIGKILLed at step 0, and rank 0 enters the backward of the window's first micro-batch only once it knows
    (the script's ``no_sync`` wraps the backward only: DDP syncs by the state at the forward, so that backward
    all-reduces, on a failed generation). The recovery waits for the window's end, and the window's second forward
    came first: it failed DDP's check that the previous reduction finished ("INTERNAL ASSERT FAILED ...
    unmarked_param_indices") until the cut iteration was discarded at once (found by ``random_kills.py``, seed 48)."""
    run = run_job(tmp_path / "elastic", Job("splitkill0", SCRIPT, kill_step=0, env=(("USERS_AWAIT_DEATH", "0"),)))
    assert_ok(run)
    assert "Traceback" not in run.output, run.excerpt()
    assert [a["action"] for a in run.adjustments()][:1] == ["failure"]
    check_static(run)
    assert_same_run(run, static)


def assert_same_run(run: Run, static: Run) -> None:
    assert assert_members_agree(run) == assert_members_agree(static)
    for key in ("train_loss", "lr", "eval_loss"):
        logged, expected = logged_steps(run.metrics(), key), logged_steps(static.metrics(), key)
        assert sorted(logged) == sorted(expected), key
        for step, line in logged.items():
            assert abs(line[key] - expected[step][key]) <= 1e-9, (key, line, expected[step])
    final, reference = (load_file(job.out / "final" / "model.safetensors") for job in (run, static))
    assert max((final[key] - reference[key]).abs().max().item() for key in reference) <= 1e-9
