"""Deaths in the live reshard of an ``elan_fsdp`` scale-in (issue 24): the leaver's rows must reach the stayers, so a
death of the leaver itself, or of a stayer while the leaver lives, must abandon the reshard and recover from the old
layout (a dead member's shard from its mirror) without a hang, and the result must be the static run's.

Real ``elan run`` jobs of ``user_scripts/fsdp_mlp.py``, a process SIGKILLing itself at a chosen point of the reshard
(``--kill-at reshard``: its third transfer); checked as ``test_elan_fsdp_faults``' reshard kills are: exit 0, every
survivor released at once, each sample once per epoch, the final state within 1e-9 of the static 2-worker run's. A
hung run is killed after ``RUN_TIMEOUT_S`` and fails.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.integration.elastic_runs import elan_env
from tests.integration.fsdp_runs import elan_command, run_to_end
from tests.integration.test_elan_fsdp import RUN_TIMEOUT_S, SCRIPT, FsdpRun, run_fsdp_job
from tests.integration.test_elan_fsdp_faults import (
    assert_recovered_exactly,
    assert_released_and_recovered,
    static_fsdp,
)
from tests.integration.worker_faults import FAULT_KILL_DIR
from tests.users.corpus import shm_dir

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # sharded training beyond its CI-tier checks

__all__ = ["static_fsdp"]  # the module-scoped static run, shared with test_elan_fsdp_faults' definition


def test_the_leaver_killed_in_a_scale_in_reshard_releases_every_stayer(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """2 workers grown to 4 after step 2, rank 3 removed after step 4 (4 -> 3); the leaver SIGKILLs itself at its third
    transfer of that reshard (some of its rows moved, not all): the stayers 0, 1 and 2 are released, the reshard is
    abandoned, and they recover from the 4-member layout (the leaver's shard from rank 0's mirror)."""
    run = run_fsdp_job(tmp_path, "fsdpkillleaver", "--kill-step", "4", "--kill-at", "reshard", "--kill-rank", "3",
                       schedule="2:add=2,4:remove=rank:3")

    assert_released_and_recovered(run, static_fsdp, [("failure", 3)])


@pytest.mark.parametrize("stayer", [0, 1])
def test_a_stayer_killed_in_a_3_to_2_scale_in_reshard_takes_the_leavers_rows(tmp_path: Path, static_fsdp: FsdpRun,
                                                                             stayer: int) -> None:
    """2 workers grown to 3 after step 2, rank 2 removed after step 4 (3 -> 2); stayer 0 or 1 SIGKILLs itself at its
    third transfer of that reshard. In a ring of 3 the leaver holds rank 1's mirror and rank 0 holds the leaver's: the
    shards were taken from the survivors only, so either death lost a shard with its mirror (``ShardsLost``). The
    living leaver takes part in the recovery's reshard (its own shard, and rank 1's from its mirror) and then leaves;
    the lone survivor trains on; the result is the static run's."""
    run = run_fsdp_job(tmp_path, f"fsdpkillstayer{stayer}", "--kill-step", "4", "--kill-at", "reshard",
                       "--kill-rank", str(stayer), schedule="2:add=1,4:remove=rank:2")

    assert "ShardsLost" not in run.output and "died with their mirrors" not in run.output, run.excerpt()
    assert_released_and_recovered(run, static_fsdp, [("failure", 1)])
    assert "leaves the job: a member died in the live reshard" in run.output, run.excerpt()


def run_with_a_library_kill(home: Path, name: str, kill: str, schedule: str) -> FsdpRun:
    """``run_fsdp_job`` with ``kill`` (``WORKER:PHASE``): that worker SIGKILLs itself at a point inside the library
    (``fault_kill/sitecustomize.py``)."""
    shm = shm_dir(home)
    env = {**elan_env(home), "ELAN_SHM_DIR": str(shm), "ELAN_TEST_KILL": kill, "ELAN_PRELOAD_SITECUSTOMIZE": "worker",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULT_KILL_DIR), os.environ.get("PYTHONPATH")]))}
    command = [*elan_command(home, name, 2, schedule), "--", sys.executable, str(SCRIPT), str(home / "out")]
    try:
        return run_to_end(command, home, RUN_TIMEOUT_S, env)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize("victim", ["w1", "w2"])
def test_a_member_killed_right_after_a_reshard_committed_is_restored_from_the_new_mirrors(
        tmp_path: Path, static_fsdp: FsdpRun, victim: str) -> None:
    """2 workers grow to 3 after step 2; w1 (a holder) or w2 (the joiner) SIGKILLs itself as soon as the reshard's
    commit vote decided that it stands. The new layout's mirrors were seeded only after the vote, so its shard was in
    no mirror: the job stopped with ``LostShard``. They are seeded before the vote (a death in the seed abandons the
    reshard), so the survivors restore its shard from its mirror in the new layout; the result is the static run's."""
    run = run_with_a_library_kill(tmp_path, f"fsdpkillcommitted{victim}", f"{victim}:reshard_committed", "2:add=1")

    assert (tmp_path / "elan-home" / "fault-kills.log").read_text().split()[:2] == [victim, "reshard_committed"]
    assert "LostShard" not in run.output, run.excerpt()
    assert_recovered_exactly(run, static_fsdp, [("failure", 2)], recorded=("failure",))


def test_a_member_killed_while_the_new_mirrors_are_seeded_abandons_the_reshard(tmp_path: Path,
                                                                              static_fsdp: FsdpRun) -> None:
    """2 workers grow to 3 after step 2; w1 SIGKILLs itself as it seeds the new layout's mirrors (its rows moved,
    before the commit vote): the reshard is abandoned, and the survivors recover from the 2-member layout (w1's shard
    from w0's old mirror; the joiner joins again); the result is the static run's."""
    run = run_with_a_library_kill(tmp_path, "fsdpkillseed", "w1:reshard_seed", "2:add=1")

    assert (tmp_path / "elan-home" / "fault-kills.log").read_text().split()[:2] == ["w1", "reshard_seed"]
    assert_released_and_recovered(run, static_fsdp, [("failure", 2)])


def test_a_member_killed_as_rank_0_got_a_resizes_plan_is_restored_from_its_generations_layout(
        tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """2 workers, a third added after step 2: w1 SIGKILLs itself at the coordination at which the AM decides the growth
    (rank 0 has the plan, w1 has not read it): rank 0 meets the death in the plan's broadcast and never enters the
    resize. The recovery's newest failed generation is the growth's (w0, w1, w2), but the shards are in the 2-member
    layout: w1's is in w0's mirror. Before, the survivors took the growth's layout and stopped with ``ShardsLost``
    (``shard 1 (worker w1) and its mirror (worker w2)``: the joiner, which holds nothing); the recovery plan names each
    failed generation's members, and each survivor reshards from the layout of the generation it was in."""
    run = run_with_a_library_kill(tmp_path, "fsdpkillplanned", "w1:planned", "2:add=1")

    assert (tmp_path / "elan-home" / "fault-kills.log").read_text().split()[:2] == ["w1", "planned"]
    assert "ShardsLost" not in run.output, run.excerpt()
    assert_recovered_exactly(run, static_fsdp, [("failure", 2)], recorded=("failure",))
