"""``lbfgs_regression.py``: an Accelerate loop whose optimizer evaluates its closure several times in a step
(``torch.optim.LBFGS``: each evaluation a forward, ``accelerator.backward`` and its gradient all-reduce, the parameters
updated between them), static at 2 workers and with the process that is rank 1 SIGKILLed in a chosen evaluation of
step 5 or step 0: the survivor must redo the whole step from the parameters and L-BFGS state it began with, and end
where the static run ends: the redo starts from the static run's state bit for bit, every sample once per epoch,
each step applied once, every step's loss and the final model within a relative 1e-7 (L-BFGS's history amplifies the
last bits a different partition of the batch gives its gradients: a run without a death that loses rank 1 gracefully
at step 5 and grows back at 7 ends 2.2e-8 to 3.6e-8 from the static run).
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

SCRIPT, SAMPLES, EPOCHS, STEPS = "lbfgs_regression.py", 96, 3, 24  # 8 global batches of 12 per epoch
RELATIVE = 1e-7


def check_run(run: Run) -> None:
    assert_ok(run)
    assert "Traceback" not in run.output, run.excerpt()
    assert_each_sample_once(run.trained(), SAMPLES, EPOCHS)
    assert_steps_applied_once(run.trained(), range(STEPS))
    evaluations = logged_steps(run.metrics(), "evaluations")
    assert sorted(evaluations) == list(range(STEPS))
    assert max(line["evaluations"] for line in evaluations.values()) > 1, "L-BFGS evaluated its closure again"


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static"), Job("lbfgsstatic", SCRIPT))
    check_run(run)
    return run


@pytest.mark.parametrize(("step", "evaluation"), [(5, 1), (5, 3), (0, 1)])
def test_a_death_in_an_evaluation_of_the_closure_redoes_the_whole_step(static: Run, tmp_path: Path, step: int,
                                                                      evaluation: int) -> None:
    """Killed in the step's first evaluation (nothing updated yet) or its third (the parameters updated twice); in
    the job's first step, the survivor's DDP has not laid its buckets out again yet (its next forward does, and
    failed DDP's check while the evaluations went on after the death: random kills, seed 4210)."""
    run = run_job(tmp_path / "elastic", Job(f"lbfgskill{step}x{evaluation}", SCRIPT, kill_step=step,
                                            env=(("USERS_KILL_EVALUATION", str(evaluation)),)))
    check_run(run)
    assert [a["action"] for a in run.adjustments()][:1] == ["failure"]
    assert assert_members_agree(run) == list(range(STEPS))
    assert digests_at(run, step, world=1) == digests_at(static, step, world=2), "the redo's start"
    for step, line in logged_steps(run.metrics(), "train_loss").items():
        expected = logged_steps(static.metrics(), "train_loss")[step]["train_loss"]
        assert abs(line["train_loss"] - expected) <= RELATIVE * max(1.0, abs(expected)), (step, line, expected)
    final, reference = (load_file(job.out / "final" / "model.safetensors") for job in (run, static))
    for key, value in reference.items():
        scale = max(1.0, value.abs().max().item())
        difference = (final[key] - value).abs().max().item()
        assert difference <= RELATIVE * scale, f"{key}: {difference:.3e}"


def digests_at(run: Run, step: int, world: int) -> set[str]:
    """The members' digests at the first backward of ``step`` at ``world`` processes (its first closure evaluation)."""
    return {line["digest"] for line in run.observed()
            if (line["step"], line["world"], line["backward"]) == (step, world, 0)}
