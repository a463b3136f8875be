"""``ElanFSDPStrategy(hsdp_group_size=2)`` (issue 24, HSDP) as a user runs it: ``user_scripts/fsdp_mlp.py --hsdp 2``
(float64, Adam) through the real ``elan run``.

At 4 members the job is HSDP — a 2-D mesh ``(replicate=2, shard=2)``: each shard held by two replicas, gradients
reduce-scattered in the shard group and averaged over the replicas; at 2 or 3 members (no two replica groups) it is
FSDP over all of them, mirrored. The live reshard moves between the layouts: a joining shard group is healed shard for
shard from a replica, a leaving one moves nothing. A member's death in the HSDP layout is covered by its shard's
replica (no mirror); one that takes a shard with all its replicas stops the job naming them. Each run must equal the
static 2-worker ``elan_fsdp`` run within 1e-9, with every sample trained once per epoch, on the meshes expected.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_elan_fsdp import (
    FsdpRun,
    assert_checkpoints_alike,
    assert_each_sample_once,
    assert_ok,
    assert_states_close,
    run_fsdp_job,
    static_fsdp_run,
)

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # sharded training beyond its CI-tier checks

HSDP = ("--hsdp", "2")
GROW = "2:add=2"
"""The 2-worker job grows by a shard group to 4 at step 2 (strong scaling keeps the static run's global batches)."""


@pytest.fixture(scope="module")
def static_fsdp(tmp_path_factory: pytest.TempPathFactory) -> FsdpRun:
    return static_fsdp_run(tmp_path_factory, "hsdpstatic")


def meshes_by_step(run: FsdpRun) -> dict[int, set[tuple[int, ...]]]:
    """The shapes of the device meshes the batches were trained on (every member's record), by the global step after
    the batch (a resize after step ``s`` shows from ``s + 1``)."""
    meshes: dict[int, set[tuple[int, ...]]] = {}
    for path in run.out.glob("trained-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            meshes.setdefault(record["step"], set()).add(tuple(record["mesh"]))
    return meshes


def assert_meshes(run: FsdpRun, expected: dict[range, tuple[int, ...]]) -> None:
    seen = meshes_by_step(run)
    for steps, shape in expected.items():
        for step in steps:
            assert seen.get(step) == {shape}, (step, seen.get(step), shape)


def test_hsdp_grows_by_a_shard_group_and_shrinks_back_exactly(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """2 → 4 after step 3 (HSDP: the joining shard group receives shard for shard from the launch members) → 2 after
    step 6 (the leaving replica group moves nothing): the static run's result, checkpoints and samples."""
    run = run_fsdp_job(tmp_path, "hsdpgrow", *HSDP, schedule="3:add=2,6:remove=2")

    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 4), ("remove", 2)]
    assert run.output.count("resharded live") == 8, run.excerpt()
    assert_meshes(run, {range(1, 4): (2,), range(4, 7): (2, 2), range(7, 17): (2,)})
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())
    assert_checkpoints_alike(run, static_fsdp)


def test_hsdp_through_sizes_that_are_not_a_multiple_of_the_group(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """2 → 3 (FSDP over 3: no two replica groups) → 4 (HSDP) → 3 (FSDP again, mirrors seeded) with each block a
    unit: every layout change resharded live, exact."""
    run = run_fsdp_job(tmp_path, "hsdpodd", *HSDP, "--shard-blocks", schedule="3:add=1,6:add=1,10:remove=1")

    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3), ("add", 4), ("remove", 3)]
    assert_meshes(run, {range(1, 4): (2,), range(4, 7): (3,), range(7, 11): (2, 2), range(11, 17): (3,)})
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())


def assert_recovered_from_a_replica(run: FsdpRun, static: FsdpRun, adjustments: list[tuple[str, int]]) -> None:
    assert_ok(run)
    assert "as its replica (HSDP shard" in run.output, run.excerpt()
    assert "restores the shard of dead rank" not in run.output, run.excerpt()  # no mirror in the HSDP layout
    done = [(a["action"], len(a["members"])) for a in run.adjustments() if a["action"] in ("add", "failure")]
    assert done == adjustments, run.adjustments()
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static.final_state())


@pytest.mark.parametrize(("phase", "rank"), [("forward", "1"), ("backward", "3"), ("optimizer", "0")])
def test_a_member_killed_in_the_hsdp_layout_is_restored_from_its_replica(tmp_path: Path, static_fsdp: FsdpRun,
                                                                         phase: str, rank: str) -> None:
    """4 members (2 grown by a shard group): the victim SIGKILLs itself in step 5's forward, backward (the survivors
    in the reduce-scatter or the replicas' all-reduce) or optimizer step: its shard's replica holds its rows, the
    3 survivors reshard to FSDP over 3 and redo the step; the result is the static run's."""
    run = run_fsdp_job(tmp_path, f"hsdpkill{phase}", *HSDP, "--kill-step", "5", "--kill-at", phase,
                       "--kill-rank", rank, schedule=GROW)

    assert_recovered_from_a_replica(run, static_fsdp, [("add", 4), ("failure", 3)])
    assert_meshes(run, {range(3, 6): (2, 2), range(7, 17): (3,)})


def test_two_members_of_different_shards_killed_together(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """Ranks 1 and 2 (one replica of each shard) die in the same forward: the survivors 0 and 3 hold both shards."""
    run = run_fsdp_job(tmp_path, "hsdpkilltwo", *HSDP, "--kill-step", "5", "--kill-at", "forward", "--kill-rank", "1",
                       "--kill-rank", "2", schedule=GROW)

    assert_recovered_from_a_replica(run, static_fsdp, [("add", 4), ("failure", 2)])


def test_a_shard_killed_with_all_its_replicas_fails_the_job_clearly(tmp_path: Path) -> None:
    """Ranks 1 and 3 (both replicas of shard 1) die in the same forward: the job stops naming the lost shard and its
    replica, never hanging."""
    run = run_fsdp_job(tmp_path, "hsdplost", *HSDP, "--kill-step", "5", "--kill-at", "forward", "--kill-rank", "1",
                       "--kill-rank", "3", schedule=GROW)

    assert run.returncode != 0
    assert "still running after" not in run.output, run.excerpt()
    assert "died with their replicas: shard 1 (worker" in run.output.replace("\n", " "), run.excerpt()


def test_a_member_killed_while_a_shard_group_is_healed(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """2 → 4: rank 1 SIGKILLs itself at its third transfer to the joining shard group; the reshard is abandoned and
    the recovery starts from the 2-member layout (rank 1's shard from rank 0's mirror) to FSDP over the 3 survivors."""
    run = run_fsdp_job(tmp_path, "hsdpkillheal", *HSDP, "--kill-step", "2", "--kill-at", "reshard", "--kill-rank", "1",
                       schedule=GROW)

    assert_ok(run)
    assert "abandons the live reshard" in run.output, run.excerpt()
    assert "restores the shard of dead rank" in run.output, run.excerpt()
    assert [(a["action"], len(a["members"])) for a in run.adjustments() if a["action"] == "failure"] == [("failure", 3)]
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())


def test_a_member_killed_in_a_recovery_from_the_hsdp_layout(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """4 members (HSDP): rank 3 dies in step 5's backward and rank 2 in the reshard of the recovery from it; the
    second recovery starts from the same 4-member layout: shard 0 from rank 0, shard 1 from rank 1 (rank 3's
    replica); exact."""
    run = run_fsdp_job(tmp_path, "hsdpkillrecovery", *HSDP, "--kill-step", "5", "--kill-at", "backward",
                       "--kill-rank", "3", "--reshard-kill-rank", "2", schedule=GROW)

    assert_ok(run)
    assert "failed during the recovery's reshard" in run.output, run.excerpt()
    assert [(a["action"], len(a["members"])) for a in run.adjustments() if a["action"] == "failure"] == [("failure", 2)]
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())


def test_shard_groups_of_one_replicate_the_whole_state(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """``hsdp_group_size=1``: every member of 2 or 3 holds the whole state (a mesh ``(n, 1)``, DDP's layout through
    FSDP2); 2 → 3 → 2 heals the joiner from one replica and moves nothing at the shrink; exact."""
    run = run_fsdp_job(tmp_path, "hsdpone", "--hsdp", "1", schedule="3:add=1,6:remove=1")

    assert_ok(run)
    assert_meshes(run, {range(1, 4): (2, 1), range(4, 7): (3, 1), range(7, 17): (2, 1)})
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())


def test_an_hsdp_job_whose_units_are_made_through_the_data_parallel_dimension(tmp_path: Path,
                                                                              static_fsdp: FsdpRun) -> None:
    """``configure_model`` shards its blocks over ``self.device_mesh["data_parallel"]`` (ModelParallelStrategy's
    name): under HSDP that is the whole data-parallel mesh, so the user's units are HSDP units once the job grows to
    two shard groups (2 → 4 → 2), and the result is the static run's."""
    run = run_fsdp_job(tmp_path, "hsdpnames", *HSDP, "--dimension-names", "--configure-model",
                       schedule="3:add=2,6:remove=2")

    assert run.returncode == 0, run.excerpt()
    assert_meshes(run, {range(1, 4): (2,), range(4, 7): (2, 2), range(7, 17): (2,)})
    units = {tuple(json.loads(line)["units"]) for path in run.out.glob("trained-*.jsonl")
             for line in path.read_text().splitlines()}
    assert units == {("", "net.1", "net.2", "net.3", "net.4")}
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())
