"""``strategy="elan_fsdp"``: a member SIGKILLed while the job runs ``trainer.validate``, ``trainer.test`` or
``trainer.predict`` after ``fit``, as the user sees it (``user_scripts/evaluations_after_fit.py --strategy elan_fsdp``,
float64, 3 processes; the victim held inside the call and SIGKILLed from outside). The dead member's shard comes from
its mirror (kept at the state after the last step: an evaluation changes none) in the recovery's reshard, and the
survivors run the pass again: what ``validate``/``test`` returned equals the static run's within 1e-9 and ``predict``
returned every sample once. Before, the job failed (the survivors' traceback from gloo). A job that only evaluates holds
the whole module on every member (Lightning shards for a fit only) and recovers as ``"elan"`` does (before, it stopped
with ``LostShard``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_kills_after_fit import SCRIPT, assert_ends_as_static, assert_saved_as_static, kill_when_held
from tests.users.corpus import Job, Run, assert_ok, run_job

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # sharded training beyond its CI-tier checks


def fsdp_job(name: str, *args: str) -> Job:
    return Job(name, (str(SCRIPT), "{out}", "--strategy", "elan_fsdp", *args), nproc=3)


@pytest.fixture(scope="module")
def static_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static-fsdp"), fsdp_job("fsdpstatic"))
    assert_ok(run)
    return run


def killed_fsdp_run(home: Path, call: str, rank: int, *args: str, batch: int = 1) -> Run:
    run = run_job(home, fsdp_job("fsdpkilled", *args, "--hold", f"{call}:{batch}:{rank}"), during=kill_when_held(home))
    assert (run.out / "hold-released").exists(), f"the victim never held:\n{run.excerpt()}"
    return run


@pytest.mark.parametrize(("call", "rank"), [("validate", 1), ("test", 0), ("predict", 2)])
def test_a_member_killed_in_an_evaluation_after_fit_is_restored_from_its_mirror(tmp_path: Path, static_fsdp: Run,
                                                                                call: str, rank: int) -> None:
    run = killed_fsdp_run(tmp_path, call, rank)

    assert "restores the shard of dead rank" in run.output, run.excerpt()
    assert_ends_as_static(run, static_fsdp)


@pytest.fixture(scope="module")
def static_fsdp_without_fit(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static-fsdp-nofit"), fsdp_job("fsdpstaticnofit", "--no-fit"))
    assert_ok(run)
    return run


@pytest.mark.parametrize(("call", "rank"), [("validate", 1), ("test", 0), ("predict", 2)])
def test_a_member_killed_in_an_evaluation_without_fit_is_recovered_from(tmp_path: Path, static_fsdp_without_fit: Run,
                                                                        call: str, rank: int) -> None:
    """A script that only evaluates (a model it loaded, say): Lightning shards a module for a fit only, so every
    member holds the whole module and the pass runs again among the survivors, as under ``"elan"``. Before, the job
    stopped with ``LostShard`` ("no shard is mirrored"), though no shard could be lost."""
    run = killed_fsdp_run(tmp_path, call, rank, "--no-fit")

    assert "LostShard" not in run.output, run.excerpt()
    assert_ends_as_static(run, static_fsdp_without_fit)


@pytest.fixture(scope="module")
def static_own_units_without_fit(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static-units-nofit"), fsdp_job("fsdpunitsnofit", "--no-fit", "--own-units"))
    assert_ok(run)
    return run


@pytest.mark.parametrize(("call", "rank"), [("validate", 1), ("test", 0), ("predict", 2)])
def test_a_member_killed_while_evaluating_its_own_units_without_fit_is_restored_from_its_mirror(
        tmp_path: Path, static_own_units_without_fit: Run, call: str, rank: int) -> None:
    """A job that only evaluates a model whose ``configure_model`` shards it with FSDP2 (Lightning's FSDP2 guide):
    each member's shard is mirrored as the pass starts, so the dead member's shard comes from its mirror and the pass
    runs again among the survivors. Before, no mirror existed in such a job: it stopped with ``LostShard``."""
    run = killed_fsdp_run(tmp_path, call, rank, "--no-fit", "--own-units")

    assert "restores the shard of dead rank" in run.output, run.excerpt()
    assert "LostShard" not in run.output, run.excerpt()
    assert_ends_as_static(run, static_own_units_without_fit)


@pytest.mark.parametrize("rank", [1, 0])
def test_a_member_killed_in_the_save_after_fit_is_restored_from_its_mirror(tmp_path: Path, static_fsdp: Run,
                                                                          rank: int) -> None:
    """``trainer.save_checkpoint`` after ``fit`` under ``elan_fsdp``: the full state was gathered, then the member of
    rank ``rank`` dies in ``on_save_checkpoint`` and the others wait in the save's barrier. They recover (its shard
    from its mirror), gather and save again among themselves. Before, the job failed in the barrier."""
    run = killed_fsdp_run(tmp_path, "save", rank, batch=0)
    assert "restores the shard of dead rank" in run.output, run.excerpt()
    assert "the survivors save the checkpoint again" in run.output, run.excerpt()
    assert_ends_as_static(run, static_fsdp)
    assert_saved_as_static(run, static_fsdp)
