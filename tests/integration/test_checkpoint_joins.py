"""A worker joins a job that saves checkpoints every few optimizer steps while it accumulates gradients, as the user
sees it: an ordinary script (``user_scripts/checkpoint_every_steps.py``: float64, ``CSVLogger``,
``ModelCheckpoint(every_n_train_steps=3, save_top_k=-1)``, ``accumulate_grad_batches=2``) grows from 2 to 3 workers
at step 3, right after the members saved there. The joiner must not save step 3's checkpoint again on its own (its
save's barrier would wait forever while the members all-reduce the next micro-batch): the job ends, with the static
2-process run's checkpoint files and final parameters (within 1e-9)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.users import corpus
from tests.users.corpus import Job, Run, assert_ok, assert_states_close, run_job

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "checkpoint_every_steps.py"
HANG_S = 120.0
"""A run still going after this long is hung (each run takes about 30 s on 2 busy cores): killed, and it fails."""


def job(name: str, schedule: str | None = None, *extra: str) -> Job:
    return Job(name, (str(SCRIPT), "{out}", "--accumulate", "2", "--every", "3", "--epochs", "2", *extra),
               schedule=schedule)


def scheduled_job(name: str, schedule: str | None = None) -> Job:
    """``GradientAccumulationScheduler({1: 2})``: 8 optimizer steps in epoch 0, 4 (of 2 batches each) in epoch 1."""
    return job(name, schedule, "--accumulate-from-epoch", "1")


def run_bounded(home: Path, job: Job, monkeypatch: pytest.MonkeyPatch) -> Run:
    with monkeypatch.context() as patch:
        patch.setattr(corpus, "RUN_TIMEOUT_S", HANG_S)
        return run_job(home, job)


@pytest.fixture(scope="module")
def static_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    with pytest.MonkeyPatch.context() as patch:
        run = run_bounded(tmp_path_factory.mktemp("static"), job("ckptstatic"), patch)
    assert_ok(run)
    return run


@pytest.fixture(scope="module")
def static_scheduled_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    with pytest.MonkeyPatch.context() as patch:
        run = run_bounded(tmp_path_factory.mktemp("static-scheduled"), scheduled_job("ckptschedstatic"), patch)
    assert_ok(run)
    return run


def _names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob("*.ckpt"))


def test_a_joiner_after_a_step_checkpoint_saves_with_the_members(tmp_path: Path, static_run: Run,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The members save ``step=3`` and a worker joins at that step's boundary, then trains the next window's first
    micro-batch: it knows step 3 was saved, so it saves nothing until step 6, where all three save together."""
    run = run_bounded(tmp_path, job("ckptjoin", schedule="3:add=1"), monkeypatch)

    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3)], run.adjustments()
    assert _names(static_run.out / "checkpoints") == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
    assert _names(run.out / "checkpoints") == _names(static_run.out / "checkpoints")
    assert_states_close(torch.load(run.out / "final.pt"), torch.load(static_run.out / "final.pt"))
    assert json.loads((run.out / "final.json").read_text()) == json.loads((static_run.out / "final.json").read_text())


def test_a_joiner_in_an_epoch_the_accumulation_scheduler_changed_saves_with_the_members(
        tmp_path: Path, static_scheduled_run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with the accumulation set by ``GradientAccumulationScheduler`` in ``on_train_epoch_start`` (which a
    joiner's mid-epoch start skips): the worker joins at step 9, the first window of epoch 1, right after the members
    saved it; it accumulates 2 batches as they do and saves with them at step 12. (On the code before 6b60610 this
    run hung: killed by the harness after 120 s.)"""
    run = run_bounded(tmp_path, scheduled_job("ckptschedjoin", schedule="9:add=1"), monkeypatch)

    assert_ok(run)
    assert [(a["action"], a["step"], len(a["members"])) for a in run.adjustments()] == [("add", 9, 3)], \
        run.adjustments()
    expected = ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "epoch=1-step=12.ckpt", "epoch=1-step=9.ckpt"]
    assert _names(static_scheduled_run.out / "checkpoints") == expected
    assert _names(run.out / "checkpoints") == expected
    assert_states_close(torch.load(run.out / "final.pt"), torch.load(static_scheduled_run.out / "final.pt"))
    assert json.loads((run.out / "final.json").read_text()) == \
        json.loads((static_scheduled_run.out / "final.json").read_text())
