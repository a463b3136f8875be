"""A member SIGKILLed while the job runs ``trainer.validate``, ``trainer.test`` or ``trainer.predict`` after ``fit``
(or without a ``fit``), as the user sees it: an ordinary script (``user_scripts/evaluations_after_fit.py``, float64)
under ``elan run --nproc 3``; the test holds the victim inside the evaluation call (the others go on into the call's
collectives) and SIGKILLs it from outside with a real signal. The survivors recover and run the interrupted pass again
among themselves: the job exits 0, what ``validate``/``test`` returned equals the static run's within 1e-9, ``predict``
returned every sample's prediction once (with the static run's values), and the script's calls after it ran."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.users.corpus import TOLERANCE, Job, Run, assert_ok, run_job

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "evaluations_after_fit.py"
PREDICT_SAMPLES = 36
HOLD_LIMIT_S = 240.0  # a victim never held is a broken test: it fails instead of hanging


def job(name: str, *args: str) -> Job:
    return Job(name, (str(SCRIPT), "{out}", *args), nproc=3)


def kill_when_held(home: Path) -> Callable[[subprocess.Popen], None]:
    """While the job runs: once the victim marks itself held in the evaluation call, release the hold for the pass
    run again and SIGKILL the victim."""
    out = home / "out"

    def kill(launcher: subprocess.Popen) -> None:
        deadline = time.monotonic() + HOLD_LIMIT_S
        marker = out / "held.json"
        while not marker.exists():
            if launcher.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.05)
        (out / "hold-released").touch()
        os.kill(json.loads(marker.read_text())["pid"], signal.SIGKILL)

    return kill


@pytest.fixture(scope="module")
def static_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool], Run]:
    """The static 3-process run of the script, with and without ``fit`` (run when first needed)."""
    runs: dict[bool, Run] = {}

    def static(fit: bool) -> Run:
        if fit not in runs:
            args = () if fit else ("--no-fit",)
            run = run_job(tmp_path_factory.mktemp(f"static-fit{fit}"), job(f"static{int(fit)}", *args))
            assert_ok(run)
            runs[fit] = run
        return runs[fit]

    return static


def killed_run(home: Path, call: str, batch: int, rank: int, *args: str) -> Run:
    run = run_job(home, job("killed", *args, "--hold", f"{call}:{batch}:{rank}"), during=kill_when_held(home))
    assert (run.out / "hold-released").exists(), f"the victim never held:\n{run.excerpt()}"
    return run


def predictions(run: Run) -> dict[int, float]:
    found: dict[int, float] = {}
    for path in sorted((run.out / "predictions").glob("rank-*.pt")):
        saved = torch.load(path)
        for index, value in zip(saved["index"].tolist(), saved["prediction"].flatten().tolist(), strict=True):
            assert index not in found, f"sample {index} predicted twice"
            found[index] = value
    return found


def assert_ends_as_static(run: Run, static: Run) -> None:
    assert_ok(run)
    assert "Traceback" not in run.output, run.excerpt()
    failures = [a for a in run.adjustments() if a["action"] == "failure"]
    assert len(failures) == 1, run.adjustments()
    results = json.loads((run.out / "results.json").read_text())
    reference = json.loads((static.out / "results.json").read_text())
    assert results["world_size"] == 2 and reference["world_size"] == 3
    for call in ("validate", "test"):
        assert len(results[call]) == len(reference[call]) == 1
        assert results[call][0].keys() == reference[call][0].keys()
        for key, value in reference[call][0].items():
            assert abs(results[call][0][key] - value) <= TOLERANCE, (call, key, results[call][0][key], value)
    found, expected = predictions(run), predictions(static)
    assert sorted(found) == sorted(expected) == list(range(PREDICT_SAMPLES))
    for index, value in expected.items():
        assert abs(found[index] - value) <= TOLERANCE, (index, found[index], value)


@pytest.mark.parametrize(("call", "rank"), [("validate", 1), ("validate", 0), ("test", 2), ("test", 0),
                                            ("predict", 1), ("predict", 0)])
def test_a_member_killed_in_an_evaluation_after_fit(tmp_path: Path, static_runs: Callable[[bool], Run], call: str,
                                                    rank: int) -> None:
    """The member of rank ``rank`` dies at its second batch of ``call`` after ``fit``."""
    assert_ends_as_static(killed_run(tmp_path, call, 1, rank), static_runs(True))


def test_a_member_killed_between_two_evaluations(tmp_path: Path, static_runs: Callable[[bool], Run]) -> None:
    """Rank 1 dies after ``validate`` returned: the others meet its death in ``test``'s setup (Lightning's barrier
    before the setup hooks), recover there, and test among themselves."""
    run = killed_run(tmp_path, "after-validate", 0, 1)
    assert_ends_as_static(run, static_runs(True))
    assert json.loads((run.out / "results.json").read_text())["validate"] == json.loads(
        (static_runs(True).out / "results.json").read_text())["validate"]  # validated with the three


@pytest.mark.parametrize(("call", "rank"), [("validate", 1), ("test", 0)])
def test_a_member_killed_in_an_evaluation_without_fit(tmp_path: Path, static_runs: Callable[[bool], Run], call: str,
                                                      rank: int) -> None:
    """A script that only evaluates (a model it loaded, say): the same, without a training loop."""
    assert_ends_as_static(killed_run(tmp_path, call, 1, rank, "--no-fit"), static_runs(False))


def assert_saved_as_static(run: Run, static: Run) -> None:
    saved, expected = (torch.load(one.out / "final.ckpt", weights_only=False) for one in (run, static))
    assert saved["global_step"] == expected["global_step"]
    assert saved["state_dict"].keys() == expected["state_dict"].keys()
    for key, value in expected["state_dict"].items():
        assert (saved["state_dict"][key] - value).abs().max().item() <= TOLERANCE, key


@pytest.mark.parametrize("rank", [1, 0])
def test_a_member_killed_in_the_save_after_fit(tmp_path: Path, static_runs: Callable[[bool], Run], rank: int) -> None:
    """``trainer.fit(...)`` then ``trainer.save_checkpoint(...)``: the member of rank ``rank`` dies inside the save
    (rank 0, the writer, before it wrote), the others wait in its barrier. They recover and save again among
    themselves, then validate, test and predict. Before, they failed in the barrier and the job with them."""
    run = killed_run(tmp_path, "save", 0, rank)
    assert "the survivors save the checkpoint again" in run.output, run.excerpt()
    assert_ends_as_static(run, static_runs(True))
    assert_saved_as_static(run, static_runs(True))
