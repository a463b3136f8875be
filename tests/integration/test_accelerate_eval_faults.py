"""A member SIGKILLed while an Accelerate loop evaluates, as the user sees it: an ordinary script shaped like
``run_glue_no_trainer.py`` (``user_scripts/evaluate_and_die.py``: float64, an evaluation loop over a prepared
DataLoader that calls ``gather_for_metrics`` per batch after every epoch's training, the main process writing what it
gathered) kills itself once at an evaluation batch under ``elan run --nproc 2``. Every epoch's evaluation must still
cover every evaluation sample exactly once — the same ids, predictions, references and per-sample losses (within
1e-9) as the static 2-process run — also in the epoch of the death and when the dead one was the main process, and
the final parameters must equal the static run's within 1e-9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.elastic_runs import elan_env
from tests.users.corpus import (
    TOLERANCE,
    assert_states_close,
    end_every_process_of,
    shm_dir,
    wait_for_job,
)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "evaluate_and_die.py"
EVAL_SAMPLES, EPOCHS = 30, 3


class EvalRun:
    """One `elan run` of the script: its exit code, output, the main process's evaluation records, the AM's records."""

    def __init__(self, home: Path, returncode: int, output: str) -> None:
        self.home, self.returncode, self.output = home, returncode, output

    @property
    def out(self) -> Path:
        return self.home / "out"

    def evaluations(self) -> list[dict]:
        path = self.out / "eval.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def adjustments(self) -> list[dict]:
        path = self.home / "state" / "adjustments.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def excerpt(self) -> str:
        start = self.output.find("Traceback")
        return f"{self.output[start : start + 4000] if start >= 0 else ''}\n...\n{self.output[-3000:]}"


def run_script(home: Path, name: str, *args: str, launcher: tuple[str, ...] = ()) -> EvalRun:
    """The script as job ``name`` at 2 workers (its outputs in ``home/out``); everything it started ends with it."""
    home.mkdir(parents=True, exist_ok=True)
    shm = shm_dir(home)
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", name, "--coordinate-every",
               "1", "--state-dir", str(home / "state"), *launcher, "--", sys.executable, str(SCRIPT),
               str(home / "out"), *args]
    log = home / "output.log"
    with log.open("a") as output:
        proc = subprocess.Popen(command, cwd=home, env={**elan_env(home), "ELAN_SHM_DIR": str(shm)}, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            verdict = wait_for_job(proc, home)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            end_every_process_of(home)
            subprocess.run(["rm", "-rf", str(shm)], check=False)
        if verdict:
            output.write(f"\n[harness] {verdict}: killed\n")
    return EvalRun(home, proc.returncode, log.read_text())


@pytest.fixture(scope="module")
def static_run(tmp_path_factory: pytest.TempPathFactory) -> EvalRun:
    """The static 2-process run: every epoch evaluates the 30 samples once, at 2 processes."""
    run = run_script(tmp_path_factory.mktemp("static"), "static")
    assert run.returncode == 0, run.excerpt()
    evaluations = run.evaluations()
    assert [record["epoch"] for record in evaluations] == list(range(EPOCHS))
    assert all(sorted(record["ids"]) == list(range(EVAL_SAMPLES)) for record in evaluations)
    return run


def by_sample(record: dict) -> dict[int, tuple[int, int, float]]:
    """``{id: (prediction, reference, loss)}`` of one epoch's evaluation; an id gathered twice fails."""
    ids = record["ids"]
    duplicated = sorted({sample for sample in ids if ids.count(sample) > 1})
    assert not duplicated, f"epoch {record['epoch']}: samples gathered more than once: {duplicated}"
    values = zip(record["predictions"], record["references"], record["losses"], strict=True)
    return dict(zip(ids, values, strict=True))


def assert_evaluates_as_static(run: EvalRun, static: EvalRun) -> None:
    """Exit 0, the member died once, every epoch's evaluation is the static run's (each sample once, same accuracy,
    same per-sample values), the final parameters equal within 1e-9, no warning of a missing evaluation sample."""
    assert run.returncode == 0, run.excerpt()
    assert (run.out / "died").exists(), "the member never killed itself"
    failures = [adjustment for adjustment in run.adjustments() if adjustment["action"] == "failure"]
    assert len(failures) == 1 and len(failures[0]["members"]) == 1, run.adjustments()
    evaluations, expected = run.evaluations(), static.evaluations()
    assert [record["epoch"] for record in evaluations] == list(range(EPOCHS)), evaluations
    for record, reference in zip(evaluations, expected, strict=True):
        actual, wanted = by_sample(record), by_sample(reference)
        missing, extra = sorted(wanted.keys() - actual.keys()), sorted(actual.keys() - wanted.keys())
        assert not (missing or extra), f"epoch {record['epoch']}: missing {missing}, not evaluation samples {extra}"
        for sample, (prediction, target, loss) in wanted.items():
            assert actual[sample][:2] == (prediction, target), (record["epoch"], sample)
            assert abs(actual[sample][2] - loss) <= TOLERANCE, (record["epoch"], sample, actual[sample][2], loss)
        assert record["accuracy"] == reference["accuracy"], record["epoch"]
    assert_states_close(torch.load(run.out / "final.pt"), torch.load(static.out / "final.pt"))
    assert "not evaluated" not in run.output, run.excerpt()


def test_member_dies_mid_evaluation(tmp_path: Path, static_run: EvalRun) -> None:
    """Process 1 dies at evaluation batch 2 of epoch 1: the survivor gathers its own part of that batch, then
    evaluates the dead one's part of it and of the batches after it."""
    run = run_script(tmp_path, "member", "--die-evaluating", "1:2:1")
    assert_evaluates_as_static(run, static_run)
    assert [record["processes"] for record in run.evaluations()] == [2, 1, 1]


def test_main_process_dies_in_the_last_evaluation_batch(tmp_path: Path, static_run: EvalRun) -> None:
    """The main process dies at evaluation batch 3 of epoch 1 (the last, padded batch): the survivor becomes the main
    process within that evaluation and writes its record, whole (what was gathered before the death included)."""
    run = run_script(tmp_path, "main", "--die-evaluating", "1:3:0")
    assert_evaluates_as_static(run, static_run)
    assert [record["processes"] for record in run.evaluations()] == [2, 1, 1]


def test_replacement_joins_after_a_death_mid_evaluation(tmp_path: Path, static_run: EvalRun) -> None:
    """``--replace-failed``: process 1 dies at evaluation batch 0 of epoch 0; the survivor finishes the evaluation
    alone, and the replacement joins at the next epoch's first step (the next epochs evaluate at 2 processes)."""
    run = run_script(tmp_path, "replaced", "--die-evaluating", "0:0:1", "--hold-for-joiners",
                     launcher=("--replace-failed",))
    assert_evaluates_as_static(run, static_run)
    assert [(adjustment["action"], len(adjustment["members"])) for adjustment in run.adjustments()] == [
        ("failure", 1), ("add", 2)], run.adjustments()
    assert [record["processes"] for record in run.evaluations()] == [1, 2, 2]
