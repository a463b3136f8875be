"""``strategy="elan_fsdp"``: a member SIGKILLed while the job runs ``trainer.validate``, ``trainer.test`` or
``trainer.predict`` after ``fit``, as the user sees it (``user_scripts/evaluations_after_fit.py --strategy elan_fsdp``,
float64, 3 processes; the victim held inside the call and SIGKILLed from outside). The dead member's shard comes from
its mirror (kept at the state after the last step: an evaluation changes none) in the recovery's reshard, and the
survivors run the pass again: what ``validate``/``test`` returned equals the static run's within 1e-9 and ``predict``
returned every sample once. Before, the job failed (the survivors' traceback from gloo). A job that only evaluates has
no mirror: it stops with a message saying so, never hanging."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_kills_after_fit import SCRIPT, assert_ends_as_static, kill_when_held
from tests.users.corpus import Job, Run, assert_ok, run_job

pytestmark = pytest.mark.integration


def fsdp_job(name: str, *args: str) -> Job:
    return Job(name, (str(SCRIPT), "{out}", "--strategy", "elan_fsdp", *args), nproc=3)


@pytest.fixture(scope="module")
def static_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static-fsdp"), fsdp_job("fsdpstatic"))
    assert_ok(run)
    return run


def killed_fsdp_run(home: Path, call: str, rank: int, *args: str) -> Run:
    run = run_job(home, fsdp_job("fsdpkilled", *args, "--hold", f"{call}:1:{rank}"), during=kill_when_held(home))
    assert (run.out / "hold-released").exists(), f"the victim never held:\n{run.excerpt()}"
    return run


@pytest.mark.parametrize(("call", "rank"), [("validate", 1), ("test", 0), ("predict", 2)])
def test_a_member_killed_in_an_evaluation_after_fit_is_restored_from_its_mirror(tmp_path: Path, static_fsdp: Run,
                                                                                call: str, rank: int) -> None:
    run = killed_fsdp_run(tmp_path, call, rank)

    assert "restores the shard of dead rank" in run.output, run.excerpt()
    assert_ends_as_static(run, static_fsdp)


def test_a_member_killed_in_an_evaluation_without_fit_stops_the_job_clearly(tmp_path: Path) -> None:
    run = killed_fsdp_run(tmp_path, "validate", 1, "--no-fit")

    assert run.returncode != 0
    assert "still running after" not in run.output, run.excerpt()
    assert "died in trainer.validate when no shard is mirrored" in run.output.replace("\n", " "), run.excerpt()
