"""Ordinary Hugging Face Accelerate scripts (``transformers`` models built from a config, ``get_scheduler``, dict
batches, ``gather_for_metrics``, ``save_state``/``load_state``, gradient accumulation, clipping, a tracker) under the
real ``elan run``: each once static (2 workers) and once elastic (a grow, rank 0 leaving, a migration, then a worker
SIGKILLed with ``os.kill`` mid-step under ``--replace-failed``), the elastic run compared with the static one. What is
checked and why: README.md in this folder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.users.accelerate.corpus_runs import (
    Job,
    Run,
    assert_adjustments,
    assert_checkpoint_alike,
    assert_checkpoint_whole,
    assert_each_sample_once,
    assert_members_agree,
    assert_ok,
    assert_states_close,
    assert_states_finite,
    assert_steps_applied_once,
    final_model,
    logged_steps,
    run_job,
)

pytestmark = [pytest.mark.integration, pytest.mark.every_case]  # the corpus: each script in the CI tier

SCHEDULE = "2:add=1,4:remove=rank:0,6:migrate=1"
"""Every elastic run from step 0: 2 workers grow to 3, rank 0 leaves (2), one worker migrates (2); then
``KILL_STEP``, and the replacement joins (2)."""
KILL_STEP = 9
GROW_TO_3_AND_BACK = [("add", 3), ("remove", 2), ("migrate", 2), ("failure", 1), ("add", 2)]


@dataclass(frozen=True)
class Script:
    """A script of this folder and what its default job trains: ``samples`` per epoch for ``epochs`` epochs in
    ``steps`` optimizer steps, ``eval_samples`` evaluated after every epoch; ``exact``: the maths makes every world
    size compute the same (float64, no randomness per process)."""

    file: str
    samples: int
    epochs: int
    steps: int
    eval_samples: int
    exact: bool
    elastic_args: tuple[str, ...] = ()
    elastic_nproc: int = 2
    schedule: str = SCHEDULE
    kill_step: int = KILL_STEP
    adjustments: tuple[tuple[str, int], ...] = tuple(GROW_TO_3_AND_BACK)
    resumed_at: int = 0
    """The elastic run starts from the static run's ``save_state`` after this many steps (0: from scratch)."""

    @property
    def checkpoints(self) -> str:
        return "step_*" if self.file.startswith("causal") else "epoch_*"


BERT = Script("classify_bert.py", samples=160, epochs=3, steps=24, eval_samples=50, exact=True)
GPT2 = Script("causal_lm_gpt2.py", samples=96, epochs=2, steps=24, eval_samples=30, exact=True,
              # resumed at 3 workers from a state the static run saved at 2, then the same story later
              elastic_args=("--resume_from_checkpoint", "{static}/step_10"), elastic_nproc=3, resumed_at=10,
              schedule="12:add=1,14:remove=rank:0,16:migrate=1", kill_step=18,
              adjustments=(("add", 4), ("remove", 3), ("migrate", 3), ("failure", 2), ("add", 3)))
MLM = Script("masked_lm_bert.py", samples=128, epochs=3, steps=24, eval_samples=40, exact=False)
SCRIPTS = [pytest.param(BERT, id="bert"), pytest.param(GPT2, id="gpt2"), pytest.param(MLM, id="mlm")]

class Corpus:
    """The runs of the module, each run once, when a test first needs it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[tuple[str, str], Run] = {}

    def static(self, script: Script) -> Run:
        return self._run(script, "static", lambda: Job(f"{_stem(script)}-static", script.file))

    def elastic(self, script: Script) -> Run:
        static = self.static(script)
        args = tuple(arg.format(static=static.out) for arg in script.elastic_args)
        return self._run(script, "elastic", lambda: Job(f"{_stem(script)}-elastic", script.file, args,
                                                        script.elastic_nproc, script.schedule, script.kill_step))

    def _run(self, script: Script, kind: str, job: Callable[[], Job]) -> Run:
        key = (script.file, kind)
        if key not in self.runs:
            self.runs[key] = run_job(self.root / f"{_stem(script)}-{kind}", job())
        return self.runs[key]


def _stem(script: Script) -> str:
    return script.file.removesuffix(".py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return Corpus(tmp_path_factory.mktemp("accelerate-corpus"))


def trained_lines(corpus: Corpus, script: Script) -> list[dict[str, Any]]:
    """The applied steps of the elastic run, with the static run's before the step it resumed from."""
    earlier = [line for line in corpus.static(script).trained() if line["step"] < script.resumed_at]
    return earlier + corpus.elastic(script).trained()


def worlds_by_step(lines: list[dict[str, Any]]) -> dict[int, int]:
    return {line["step"]: line["world"] for line in lines}


# ---------------------------------------------------------------------- static runs


@pytest.mark.parametrize("script", SCRIPTS)
def test_static_run_trains_each_sample_once_with_members_identical(corpus: Corpus, script: Script) -> None:
    run = corpus.static(script)
    assert_ok(run)
    assert not run.adjustments(), "a static run has no adjustment"
    assert_each_sample_once(run.trained(), script.samples, script.epochs)
    assert_steps_applied_once(run.trained(), range(script.steps))
    assert assert_members_agree(run) == list(range(script.steps))
    assert sorted(logged_steps(run.metrics(), "train_loss")) == list(range(script.steps))
    for folder in sorted(run.out.glob(script.checkpoints)):
        assert_checkpoint_whole(folder, world=2)


# ---------------------------------------------------------------------- elastic runs


@pytest.mark.parametrize("script", SCRIPTS)
def test_elastic_run_adjusts_as_scheduled_and_replaces_the_killed_worker(corpus: Corpus, script: Script) -> None:
    run = corpus.elastic(script)
    assert_ok(run)
    adjustments = assert_adjustments(run, list(script.adjustments))
    grow, remove, _migrate, failure, replacement = adjustments
    assert remove["leavers"] == [grow["members"][0]], "remove rank:0 removes the generation's rank 0"
    assert run.victim() is not None and run.victim()["step"] == script.kill_step
    assert failure["failure"]["step_redone"] == script.kill_step + 1
    earlier = {worker for adjustment in adjustments[:-1] for worker in adjustment["members"]}
    assert len(replacement["joiners"]) == 1 and replacement["joiners"][0] not in earlier, "a new worker replaced it"


@pytest.mark.parametrize("script", SCRIPTS)
def test_elastic_run_trains_each_sample_once_with_members_identical(corpus: Corpus, script: Script) -> None:
    """Counted from the steps the scripts saw applied (a step discarded when the victim died is not among them)."""
    run = corpus.elastic(script)
    assert_ok(run)
    lines = trained_lines(corpus, script)
    assert_each_sample_once(lines, script.samples, script.epochs)
    assert_steps_applied_once(lines, range(script.steps))
    steps = assert_members_agree(run)
    assert steps == list(range(steps[0], steps[0] + script.steps - script.resumed_at)), "every step observed"


@pytest.mark.parametrize("script", SCRIPTS)
def test_elastic_run_ends_with_the_static_runs_model_and_optimizer(corpus: Corpus, script: Script) -> None:
    """``exact``: the final model (``save_pretrained``) and every checkpoint both runs saved (model, optimizer state,
    LR schedule) equal the static run's within 1e-9; otherwise the same entries and shapes, finite."""
    run, static = corpus.elastic(script), corpus.static(script)
    assert_ok(run)
    if script.exact:
        assert_states_close(final_model(run), final_model(static), where="final")
    else:
        assert_states_finite(final_model(run), final_model(static), where="final")
    saved = sorted(run.out.glob(script.checkpoints))
    assert [folder.name for folder in saved] == [folder.name for folder in sorted(static.out.glob(script.checkpoints))
                                                  if _steps_of(folder, script) > script.resumed_at]
    for folder in saved:
        assert_checkpoint_alike(folder, static.out / folder.name, script.exact)


def _steps_of(folder: Path, script: Script) -> int:
    """The steps applied before a checkpoint was saved (``step_<n>``, or ``epoch_<n>``: after n + 1 epochs)."""
    kind, _, number = folder.name.partition("_")
    return int(number) if kind == "step" else (int(number) + 1) * script.steps // script.epochs


@pytest.mark.parametrize("script", SCRIPTS)
def test_elastic_runs_tracker_log_is_whole(corpus: Corpus, script: Script) -> None:
    """Every step logged once, by the main process of the moment (the tracker started again on the new main process
    when rank 0 left: two configurations, from the two main processes); one evaluation per epoch over every held-out
    sample, with the static run's results where the maths is exact."""
    run, static = corpus.elastic(script), corpus.static(script)
    assert_ok(run)
    metrics = run.metrics()
    steps = logged_steps(metrics, "train_loss")
    assert sorted(steps) == list(range(script.resumed_at, script.steps))
    configured = [line["pid"] for line in metrics if "config" in line]
    assert len(configured) == 2 and {line["pid"] for line in steps.values()} == set(configured)
    evaluations, expected = logged_steps(metrics, "eval_loss"), logged_steps(static.metrics(), "eval_loss")
    assert sorted(evaluations) == [step for step in sorted(expected) if step > script.resumed_at]
    for step, line in evaluations.items():
        assert line["eval_samples"] == script.eval_samples, line
        if script.exact:
            assert abs(line["eval_loss"] - expected[step]["eval_loss"]) <= 1e-9, (line, expected[step])


@pytest.mark.parametrize("script", SCRIPTS)
def test_elastic_runs_checkpoints_are_whole(corpus: Corpus, script: Script) -> None:
    """Each ``save_state`` folder holds what Accelerate saves for the world that saved it, and nothing else (a worker
    that left the job runs the script's ``save_state`` too: it writes nothing)."""
    run = corpus.elastic(script)
    assert_ok(run)
    worlds = worlds_by_step(trained_lines(corpus, script))
    for folder in sorted(run.out.glob(script.checkpoints)):
        assert_checkpoint_whole(folder, world=worlds[_steps_of(folder, script) - 1])


def test_a_job_resumed_from_a_state_saved_after_step_n_counts_on_from_n(corpus: Corpus) -> None:
    """The resumed GPT-2 job's first step is step 10 (as the job itself, the AM and `elan status` count them)."""
    run = corpus.elastic(GPT2)
    assert_ok(run)
    assert min(line["step"] for line in run.observed()) == GPT2.resumed_at


# ---------------------------------------------------------------------- what is refused


def test_a_streamed_training_dataset_is_refused_at_start_with_one_clear_error(tmp_path: Path) -> None:
    """An ``IterableDataset`` training loader (``--streaming``) is not elastic yet: every worker stops in
    ``prepare()`` with the reason, and the job ends at once with a failure (no hang, nothing trained)."""
    run = run_job(tmp_path, Job("gpt2-streaming", GPT2.file, ("--streaming",)))
    assert run.returncode != 0
    assert "NotImplementedError: ElasticAccelerator's training DataLoader needs a map-style dataset" in run.output
    assert not run.trained() and not run.observed()
