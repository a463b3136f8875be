"""``cv_example_resume.py`` (Accelerate's ``complete_cv_example.py`` as a user ports it: ``OneCycleLR`` stepped every
batch, ``save_state("step_<n>")`` every 5 steps, accuracy with ``gather_for_metrics``, ``accelerator.print``, a tracker
row per epoch, ``accelerator.save_model``) static at 2 workers and elastic: 2 → 3 at step 2, rank 0 removed at step
4, a migration at step 6, the process that is rank 1 at step 8 SIGKILLed with ``--replace-failed`` (probe round 9:
every run held). The elastic run must be the static run: samples once per epoch, each step applied once, the same
``step_<n>`` folders, every epoch's accuracy, the final model within 1e-9.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.users.accelerate.corpus_runs import (
    Job,
    Run,
    assert_each_sample_once,
    assert_ok,
    assert_steps_applied_once,
    run_job,
)

pytestmark = pytest.mark.integration

SCRIPT, IMAGES, EPOCHS, STEPS = "cv_example_resume.py", 144, 3, 36  # 12 global batches of 12 per epoch


def rows(run: Run) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    evaluations = [line for line in lines if "accuracy" in line]
    assert len(evaluations) == len({line["epoch"] for line in evaluations}) == EPOCHS, evaluations
    return {line["epoch"]: line for line in evaluations}


def test_the_cv_example_under_resizes_and_a_kill_is_the_static_run(tmp_path: Path) -> None:
    static = run_job(tmp_path / "static", Job("cvstatic", SCRIPT))
    assert_ok(static)
    run = run_job(tmp_path / "elastic", Job("cvelastic", SCRIPT, schedule="2:add=1,4:remove=rank:0,6:migrate=1",
                                            kill_step=8))
    assert_ok(run)
    assert "Traceback" not in run.output, run.excerpt()
    assert [adjustment["action"] for adjustment in run.adjustments()][:4] == ["add", "remove", "migrate", "failure"]
    assert_each_sample_once(run.trained(), IMAGES, EPOCHS)
    assert_steps_applied_once(run.trained(), range(STEPS))
    assert sorted(path.name for path in run.out.glob("step_*")) == sorted(path.name for path in
                                                                          static.out.glob("step_*"))
    for epoch, line in rows(run).items():
        expected = rows(static)[epoch]
        assert (line["step"], line["accuracy"], line["eval_samples"]) == (
            expected["step"], expected["accuracy"], expected["eval_samples"]), (line, expected)
    final, reference = (load_file(job.out / "final" / "model.safetensors") for job in (run, static))
    assert max((final[key] - reference[key]).abs().max().item() for key in reference) <= 1e-9
