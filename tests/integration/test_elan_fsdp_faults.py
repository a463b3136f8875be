"""``strategy="elan_fsdp"`` loses no step when a member is SIGKILLed (issue 24, item 3): each member's shard is mirrored
in the next member's memory, the survivors restore a dead member's shard from its mirror and redo the interrupted
step. Real ``elan run`` jobs of ``user_scripts/fsdp_mlp.py`` (float64, Adam), a process SIGKILLing itself at a chosen
point of a chosen step; each run must equal the static 2-worker ``elan_fsdp`` run within 1e-9 with every sample
trained once per epoch. A shard killed together with its mirror fails the job with a message naming both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_elan_fsdp import (
    FsdpRun,
    assert_each_sample_once,
    assert_ok,
    assert_states_close,
    run_fsdp_job,
    static_fsdp_run,
)

pytestmark = pytest.mark.integration

KILL_STEP = "5"
GROW = "2:add=1"
"""The 2-worker job grows to 3 at step 2 (a live reshard; strong scaling keeps the static run's global batches), so the
kill at step 5 takes one of 3 members."""


@pytest.fixture(scope="module")
def static_fsdp(tmp_path_factory: pytest.TempPathFactory) -> FsdpRun:
    return static_fsdp_run(tmp_path_factory, "fsdpfaultstatic")


def assert_recovered_exactly(run: FsdpRun, static: FsdpRun, adjustments: list[tuple[str, int]],
                             recorded: tuple[str, ...] = ("add", "failure")) -> None:
    """Exit 0, a shard restored from a mirror, the ``recorded`` kinds of adjustment as expected, each sample once per
    epoch, the final state within 1e-9 of the static run's."""
    assert_ok(run)
    assert "restores the shard of dead rank" in run.output, run.excerpt()
    done = [(a["action"], len(a["members"])) for a in run.adjustments() if a["action"] in recorded]
    assert done == adjustments, run.adjustments()
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static.final_state())


@pytest.mark.parametrize("phase", ["start", "forward", "backward", "optimizer"])
def test_a_member_killed_in_a_step_loses_no_step(tmp_path: Path, static_fsdp: FsdpRun, phase: str) -> None:
    """3 workers (2 grown to 3); rank 1 SIGKILLs itself as step 5's batch starts (the survivors in the root unit's
    all-gather, before its forward), in its forward, in its backward (the survivors in the reduce-scatter), or in its
    optimizer step (the step committed, its own update applied, its mirror not advanced): the 2 survivors restore its
    shard from rank 2's mirror, reshard to 2 and train on; the result is the static run's."""
    run = run_fsdp_job(tmp_path, f"fsdpkill{phase}", "--kill-step", KILL_STEP, "--kill-at", phase, schedule=GROW)

    assert_recovered_exactly(run, static_fsdp, [("add", 3), ("failure", 2)])


@pytest.mark.extended  # sharded training beyond its CI-tier checks
def test_a_member_killed_in_the_forward_of_a_block_unit_loses_no_step(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """Each block a unit (``shard_modules={Block}``); rank 1 SIGKILLs itself in step 5's forward, in the second block:
    the survivors wait in the third block's all-gather with the root's and the first block's gathered parameters
    still registered (before, the recovery's reshard failed on them: ``KeyError`` in ``describe_optimizers``); they are
    sharded again first, and the result is the static run's."""
    run = run_fsdp_job(tmp_path, "fsdpkillblock", "--shard-blocks", "--kill-step", KILL_STEP, "--kill-at", "forward",
                       schedule=GROW)

    assert_recovered_exactly(run, static_fsdp, [("add", 3), ("failure", 2)])


@pytest.mark.extended  # sharded training beyond its CI-tier checks
def test_a_member_killed_in_the_first_step_after_a_resize_loses_no_step(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """Rank 1 SIGKILLs itself in the forward of step 2, the first of the generation the growth to 3 formed: the mirrors
    were seeded at the end of the resize's reshard, so its shard is restored all the same."""
    run = run_fsdp_job(tmp_path, "fsdpkillfirst", "--kill-step", "2", "--kill-at", "forward", schedule=GROW)

    # the growth's record may be cut by the death (its members had not all reported): only the recovery is checked
    assert_recovered_exactly(run, static_fsdp, [("failure", 2)], recorded=("failure",))
    assert "grows after step 2" in run.output, run.excerpt()


@pytest.mark.extended  # sharded training beyond its CI-tier checks
@pytest.mark.parametrize("phase", ["start", "backward"])
def test_a_member_killed_in_the_launch_generations_first_step_loses_no_step(tmp_path: Path, static_fsdp: FsdpRun,
                                                                             phase: str) -> None:
    """Rank 1 of the 2 launch workers SIGKILLs itself in step 0, the job's first, as its batch starts or in its
    backward (the survivor in the reduce-scatter): the launch generation's mirrors are seeded as its training loop
    starts, so rank 0 restores rank 1's shard from its mirror and trains on alone; the result is the static run's."""
    run = run_fsdp_job(tmp_path, f"fsdpkilllaunch{phase}", "--kill-step", "0", "--kill-at", phase)

    assert_recovered_exactly(run, static_fsdp, [("failure", 1)], recorded=("failure",))


def test_rank_0_killed_loses_no_step(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """Rank 0 (the one that asks the AM and writes checkpoints) SIGKILLs itself in step 5's forward."""
    run = run_fsdp_job(tmp_path, "fsdpkill0", "--kill-step", KILL_STEP, "--kill-at", "forward", "--kill-rank", "0",
                       schedule=GROW)

    assert_recovered_exactly(run, static_fsdp, [("add", 3), ("failure", 2)])


@pytest.mark.extended  # sharded training beyond its CI-tier checks
def test_a_member_killed_in_the_reduce_scatter_of_4_releases_every_survivor(tmp_path: Path,
                                                                          static_fsdp: FsdpRun) -> None:
    """2 workers grown to 4; rank 3 SIGKILLs itself in step 5's backward. In gloo's ring a survivor that is not the
    dead rank's neighbour waits in the reduce-scatter on a live peer; gloo's reduce-scatter work has no future, so the
    failure could not release it: it sat there until a connection closed and the AM declared it dead 60 s later (then
    ShardsLost). Every survivor is released at once and the step is redone exactly."""
    run = run_fsdp_job(tmp_path, "fsdpkillrs4", "--kill-step", KILL_STEP, "--kill-at", "backward", "--kill-rank", "3",
                       schedule="2:add=2")

    assert "did not check in after the failure" not in run.output, run.excerpt()
    assert_recovered_exactly(run, static_fsdp, [("add", 4), ("failure", 3)])


@pytest.mark.extended  # sharded training beyond its CI-tier checks
def test_a_killed_member_is_replaced(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """``--replace-failed --min-workers 2``, 2 workers: rank 1 dies in step 5's backward; the recovery waits for the
    replacement, and its reshard gives the replacement only its new shard: its rows from the survivor's own shard and
    from the survivor's mirror of the dead member's."""
    run = run_fsdp_job(tmp_path, "fsdpreplace", "--kill-step", KILL_STEP, "--kill-at", "backward", nproc=2,
                       launcher=("--replace-failed", "--min-workers", "2"))

    assert_recovered_exactly(run, static_fsdp, [("failure", 2)])


def test_a_shard_killed_with_its_mirror_fails_the_job_clearly(tmp_path: Path) -> None:
    """3 workers (2 grown to 3): ranks 1 and 2 (rank 1's mirror holder) die in the same forward: the survivor stops
    the job, naming the lost shard and its mirror, never hanging."""
    run = run_fsdp_job(tmp_path, "fsdpdouble", "--kill-step", KILL_STEP, "--kill-at", "forward", "--kill-rank", "1",
                       "--kill-rank", "2", schedule=GROW)

    assert run.returncode != 0
    assert "still running after" not in run.output, run.excerpt()
    text = run.output.replace("\n", " ")
    assert "died with their mirrors: shard 1 (worker" in text, run.excerpt()


def assert_released_and_recovered(run: FsdpRun, static: FsdpRun, adjustments: list[tuple[str, int]]) -> None:
    """A death in a live reshard: every survivor released at once (none declared dead for not checking in), the
    reshard abandoned, the recovery from the old layout (a shard restored from its mirror), exact."""
    assert "did not check in after the failure" not in run.output, run.excerpt()
    assert "abandons the live reshard" in run.output, run.excerpt()
    assert_recovered_exactly(run, static, adjustments, recorded=("failure",))


@pytest.mark.extended  # sharded training beyond its CI-tier checks
def test_a_member_killed_in_a_scale_out_reshard_releases_every_survivor(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """2 workers grow to 4 after step 2; rank 1 SIGKILLs itself at its third transfer of the live reshard (some rows
    moved). gloo's point-to-point transfers could not be released: a survivor waited on a live peer until the AM
    declared it dead 60 s later, and the job failed. Every participant is released at once, the reshard is abandoned
    (no one has let its old shard go), and the recovery takes rank 0's shard and rank 1's from rank 0's mirror to the
    3 survivors (the joiners included); the result is the static run's."""
    run = run_fsdp_job(tmp_path, "fsdpkillgrow", "--kill-step", "2", "--kill-at", "reshard", "--kill-rank", "1",
                       schedule="2:add=2")

    assert_released_and_recovered(run, static_fsdp, [("failure", 3)])


@pytest.mark.extended  # sharded training beyond its CI-tier checks
def test_a_member_killed_in_a_scale_in_reshard_releases_every_survivor(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """2 workers grown to 4 after step 2, rank 3 removed after step 4; rank 1 SIGKILLs itself in that reshard: the
    leaver leaves, the survivors 0 and 2 recover from the 4-member layout (rank 1's shard from rank 2's mirror, the
    leaver's from rank 0's)."""
    run = run_fsdp_job(tmp_path, "fsdpkillshrink", "--kill-step", "4", "--kill-at", "reshard", "--kill-rank", "1",
                       schedule="2:add=2,4:remove=rank:3")

    assert_released_and_recovered(run, static_fsdp, [("failure", 2)])
    assert "leaves the job: a member died in the live reshard" in run.output, run.excerpt()


@pytest.mark.extended  # sharded training beyond its CI-tier checks
def test_a_member_killed_in_a_recovery_reshard_recovers_from_the_same_old_layout(tmp_path: Path,
                                                                                 static_fsdp: FsdpRun) -> None:
    """2 workers grown to 4; rank 3 dies in step 5's backward and rank 1 in the reshard of the recovery from that
    death (its third transfer): that reshard is abandoned too, and the second recovery starts from the same 4-member
    layout (rank 3's shard from rank 0's mirror, rank 1's from rank 2's); the result is the static run's."""
    run = run_fsdp_job(tmp_path, "fsdpkillrecovery", "--kill-step", KILL_STEP, "--kill-at", "backward",
                       "--kill-rank", "3", "--reshard-kill-rank", "1", schedule="2:add=2")

    assert_released_and_recovered(run, static_fsdp, [("failure", 2)])
    assert "failed during the recovery's reshard" in run.output, run.excerpt()
