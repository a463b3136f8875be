"""Elastic FSDP2 under Accelerate (issue 24 item 4): ``ElasticAccelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2))`` with an ordinary Accelerate FSDP2 loop (``user_scripts/accelerate_fsdp2.py``: float64 MLP, Adam,
``accelerator.prepare(model, optimizer, loader)``, ``backward``, ``step``, ``get_state_dict`` at the end), real
`elan run` processes on gloo.

Plain Accelerate cannot be the reference on a CPU: ``AcceleratorState`` keeps an ``fsdp_plugin`` only for the GPU-like
distributed types, so a CPU job with the plugin silently trains with DDP (``MULTI_CPU``; tried: ``torchrun
--nproc_per_node 2`` of such a script prints ``DistributedType.MULTI_CPU`` and a ``DistributedDataParallel`` model).
The reference is the same loop without the plugin under `elan run` at 2 workers (the elastic DDP, the same global
batches); FSDP2's reduce-scatter averages as DDP's all-reduce does, so every run must end within 1e-9 of it.

Each run: exit 0, every sample trained once per epoch (the batches whose step stood), the final full model within 1e-9
of the reference; the members end with DTensor parameters sharded over the final world.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.accelerate_runs import loop_run
from tests.integration.elastic_runs import TOLERANCE, RunResult, assert_counted_once, assert_states_close

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # sharded training beyond its CI-tier checks

SCRIPT = Path(__file__).parent / "user_scripts" / "accelerate_fsdp2.py"
SAMPLES, EPOCHS, STEPS = 96, 3, 24


def fsdp_run(tmp: Path, name: str, *script_args: str, nproc: int = 2, schedule: str | None = None) -> RunResult:
    """``elan run --nproc N [--schedule S] -- python accelerate_fsdp2.py tmp/name ARGS`` to its end."""
    return loop_run(tmp, name, SCRIPT, script_args, nproc=nproc, schedule=schedule)


def trained_per_epoch(run: RunResult) -> dict[int, Counter]:
    """``{epoch: Counter(sample)}`` over every worker's batches whose step stood (a discarded step writes none)."""
    per_epoch: dict[int, Counter] = {}
    for path in run.out.glob("batches-*.jsonl"):
        for line in map(json.loads, path.read_text().splitlines()):
            per_epoch.setdefault(line["epoch"], Counter()).update(line["indices"])
    return per_epoch


def check_exact(run: RunResult, reference: RunResult, final_world: int) -> list[dict]:
    """Exit 0, each sample once per epoch, the reference's final model within 1e-9, the final members sharded over
    ``final_world`` (every row of every parameter held by exactly one of them); returns the job's records."""
    assert run.returncode == 0, run.excerpt()
    assert "Traceback" not in run.output, run.excerpt()
    assert_counted_once(trained_per_epoch(run), SAMPLES, EPOCHS)
    assert_states_close(run.final_state(), reference.final_state(), TOLERANCE)
    records = run.records()
    members = [record for record in records if not record["left"]]
    assert len(members) == final_world and all(record["optimizer_steps"] == STEPS for record in members), records
    assert all(record["parameters"] == ["DTensor"] for record in members), records
    rows = [sum(shares) for shares in zip(*(record["local_rows"] for record in members), strict=True)]
    assert rows == [32, 32, 16, 16, 1, 1], rows  # each parameter's rows once across the members
    return records


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> RunResult:
    """The same loop with the elastic DDP (no plugin), 2 workers, nothing changing; it evaluates after each epoch."""
    run = fsdp_run(tmp_path_factory.mktemp("ddp"), "ddp", "--ddp", "--evaluate")
    assert run.returncode == 0, run.excerpt()
    return run


def test_a_static_fsdp2_job_equals_the_data_parallel_run(tmp_path, reference):
    check_exact(fsdp_run(tmp_path, "static"), reference, final_world=2)


def test_grow_shrink_and_migrate_reshard_live_and_stay_exact(tmp_path, reference):
    """2 -> 3 after step 3 (w2 receives only its shard), 3 -> 2 after step 9 (w2's rows go to the stayers), a
    migration after step 14 (w1's rows to the joiner w3)."""
    run = fsdp_run(tmp_path, "elastic", "--hold", schedule="3:add=1,9:remove=1,14:migrate=1")
    records = check_exact(run, reference, final_world=2)
    grow, shrink, migrate = run.adjustments()
    assert (grow["step"], len(grow["members"]), grow["joiners"]) == (3, 3, ["w2"]), grow
    assert (shrink["step"], len(shrink["members"]), shrink["leavers"]) == (9, 2, ["w2"]), shrink
    assert (migrate["step"], migrate["joiners"], migrate["leavers"]) == (14, ["w3"], ["w1"]), migrate
    assert sorted(record["worker"] for record in records if record["left"]) == ["w1", "w2"]


def test_an_evaluation_pass_per_epoch_follows_the_resizes(tmp_path, reference):
    """The loop evaluates after each epoch (a second prepared loader, ``model.eval()``, FSDP2's forward,
    ``gather_for_metrics``): epoch 0 ends at 3 workers (grown after step 3), epoch 1 at 2 (shrunk after step 12); every
    epoch's MSE on every member equals the data-parallel run's."""
    run = fsdp_run(tmp_path, "evaluated", "--hold", "--evaluate", schedule="3:add=1,12:remove=1")
    records = check_exact(run, reference, final_world=2)
    expected = next(record["val_mse"] for record in reference.records())
    assert sorted(expected) == ["0", "1", "2"], expected
    for record in records:
        if not record["left"]:
            assert record["val_mse"].keys() == expected.keys(), record
            assert all(abs(record["val_mse"][epoch] - mse) <= TOLERANCE for epoch, mse in expected.items()), record


def test_a_member_killed_in_its_forward_loses_no_step(tmp_path, reference):
    """3 workers (grown after step 3); w1 SIGKILLs itself in the forward of its 7th step, where the survivors are in
    FSDP2's all-gather: the step is discarded, w1's shard comes from its mirror (w2), the step is redone by the two
    survivors."""
    run = fsdp_run(tmp_path, "killed", "--hold", "--kill", "w1:6", schedule="3:add=1")
    check_exact(run, reference, final_world=2)
    _grow, failure = run.adjustments()
    assert failure["action"] == "failure" and failure["failure"]["dead"] == ["w1"], failure
    assert failure["failure"]["step_redone"] == 7, failure
    assert "restores the shard of dead rank 1 from its mirror" in run.output, run.excerpt()


def test_a_member_killed_in_the_first_step_loses_no_step(tmp_path, reference):
    """2 workers; w1 SIGKILLs itself in the forward of the job's first step: the mirrors were seeded as the training
    loop started, so w0 restores w1's shard from its mirror and trains on alone, step 1 redone."""
    run = fsdp_run(tmp_path, "first", "--kill", "w1:0")
    check_exact(run, reference, final_world=1)
    (failure,) = run.adjustments()
    assert failure["failure"]["dead"] == ["w1"] and failure["failure"]["step_redone"] == 1, failure


def test_a_shard_killed_with_its_mirror_fails_the_job_clearly(tmp_path):
    """3 workers; w1 and w2 (rank 1's mirror holder) SIGKILL themselves in the same forward: the survivor stops the
    job, naming the lost shard and its mirror, never hanging."""
    run = fsdp_run(tmp_path, "double", "--hold", "--kill", "w1:6,w2:6", schedule="3:add=1")
    assert run.returncode != 0
    assert "still running after" not in run.output, run.excerpt()
    assert "died with their mirrors: shard 1 (worker w1) and its mirror (worker w2)" in run.output, run.excerpt()


def test_the_auto_wrap_policys_units_reshard_too(tmp_path, reference):
    """The plugin's size-based auto-wrap policy makes the two larger Linear layers units of their own; the recorded
    wrapping is applied again at each resize: 2 -> 3 after step 3, rank 0 (the main process) removed after step 9."""
    run = fsdp_run(tmp_path, "units", "--hold", "--units", schedule="3:add=1,9:remove=rank:0")
    records = check_exact(run, reference, final_world=2)
    assert all(record["units"] == ["FSDPLinear", "FSDPLinear", "FSDPSequential"]
               for record in records if not record["left"]), records
    _grow, leave = run.adjustments()
    assert leave["leavers"] == ["w0"], leave


def test_a_member_killed_during_an_lr_ramp_is_restored_exactly(tmp_path):
    """Weak scaling (``ElasticPlugin(scaling="weak", lr_ramp_steps=8)``): the growth 2 -> 3 after step 3 scales the
    global batch and ramps the LR over the next 8 steps; w1 SIGKILLed in its 7th step, inside the ramp. The recovery
    keeps the global batch and the ramp, so the job must end as the same growth without the kill does: the mirror
    replays each step with the ramp's scaled learning rate (it took the unscaled one before: 1.4e-3 off)."""
    calm = fsdp_run(tmp_path, "weak", "--hold", "--weak", schedule="3:add=1")
    killed = fsdp_run(tmp_path, "weak_killed", "--hold", "--weak", "--kill", "w1:6", schedule="3:add=1")
    for run in (calm, killed):
        assert run.returncode == 0, run.excerpt()
        assert_counted_once(trained_per_epoch(run), SAMPLES, EPOCHS)
    assert killed.adjustments()[-1]["failure"]["dead"] == ["w1"]
    assert_states_close(killed.final_state(), calm.final_state(), TOLERANCE)


def test_a_member_sigtermed_leaves_with_its_shard_moved(tmp_path, reference):
    """3 workers (grown after step 3); w0, rank 0, receives SIGTERM (a preemption notice) in its 6th step: it
    finishes the step, its rows move to the two others at the next boundary, it exits 0; nothing is redone."""
    run = fsdp_run(tmp_path, "sigterm", "--hold", "--sigterm", "w0:5", schedule="3:add=1")
    records = check_exact(run, reference, final_world=2)
    _grow, leave = run.adjustments()
    assert leave["leavers"] == ["w0"] and "failure" not in leave, leave
    assert [record["worker"] for record in records if record["left"]] == ["w0"]


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_a_checkpoint_saved_at_2_resumes_at_3(tmp_path, reference, state_dict_type):
    """``save_state`` after epoch 1 at 2 workers (the plugin's state dict type), ``load_state`` of it in a job of 3:
    epoch 2 trains once, and the job ends equal to the uninterrupted run."""
    saved = fsdp_run(tmp_path, "saved", "--save", "--state-dict-type", state_dict_type)
    assert saved.returncode == 0, saved.excerpt()
    assert_states_close(saved.final_state(), reference.final_state(), TOLERANCE)
    resumed = fsdp_run(tmp_path, "resumed", "--resume", str(saved.out / "checkpoint"), "--state-dict-type",
                       state_dict_type, nproc=3)
    assert resumed.returncode == 0, resumed.excerpt()
    per_epoch = trained_per_epoch(resumed)
    assert sorted(per_epoch) == [2], sorted(per_epoch)
    assert_counted_once({0: per_epoch[2]}, SAMPLES, 1)
    assert_states_close(resumed.final_state(), reference.final_state(), TOLERANCE)
    assert all(record["parameters"] == ["DTensor"] for record in resumed.records())


@pytest.mark.parametrize("units", [False, True], ids=["root", "units"])
def test_a_member_killed_in_an_evaluation_pass_loses_nothing(tmp_path, reference, units):
    """3 workers (grown after step 3) evaluate after each epoch; w1 SIGKILLs itself before the forward of its second
    evaluation batch after epoch 1. The survivors meet the death in that forward's all-gather (``units``: the
    auto-wrapped units reshard after each forward) or, the root's parameters still gathered from the first batch, in
    ``gather_for_metrics``: they recover (the dead member's shard from its mirror) and the pass goes on; every
    epoch's MSE equals the data-parallel run's and training ends exact on the 2 survivors. (The old code: every
    survivor died in the recovery's reshard, ``KeyError`` in the optimizers' description.)"""
    extra = ["--units"] if units else []
    run = fsdp_run(tmp_path, "eval_killed", "--hold", "--evaluate", "--eval-kill", "w1:1:1", *extra,
                   schedule="3:add=1")
    records = check_exact(run, reference, final_world=2)
    assert run.adjustments()[-1]["failure"]["dead"] == ["w1"]
    expected = next(record["val_mse"] for record in reference.records())
    for record in records:
        if not record["left"]:
            assert all(abs(record["val_mse"][epoch] - mse) <= TOLERANCE for epoch, mse in expected.items()), record


# ---------------------------------------------------------------------------------------------- HSDP

def meshes_by_step(run: RunResult) -> dict[int, set[tuple[int, ...]]]:
    """The shapes of the meshes each optimizer step's batches were trained on, by the step's index (from 0)."""
    meshes: dict[int, set[tuple[int, ...]]] = {}
    for path in run.out.glob("batches-*.jsonl"):
        for line in map(json.loads, path.read_text().splitlines()):
            meshes.setdefault(line["step"], set()).add(tuple(line["mesh"]))
    return meshes


def test_hsdp_grows_by_a_shard_group_and_shrinks_back_exactly(tmp_path, reference):
    """``ElasticPlugin(hsdp_group_size=2)``: 2 -> 4 after step 3 (HSDP, a ``(2, 2)`` mesh: the joining shard group
    receives shard for shard from the launch members) -> 2 after step 9 (the leaving replica group moves nothing)."""
    run = fsdp_run(tmp_path, "hsdp", "--hold", "--hsdp", "2", schedule="3:add=2,9:remove=2")
    check_exact(run, reference, final_world=2)
    meshes = meshes_by_step(run)
    assert all(meshes[step] == {(2,)} for step in (0, 1, 2, *range(9, STEPS))), meshes
    assert all(meshes[step] == {(2, 2)} for step in range(3, 9)), meshes


def test_hsdp_a_member_killed_in_its_forward_is_restored_from_its_replica(tmp_path, reference):
    """4 workers in HSDP (grown after step 3); w1 SIGKILLs itself in the forward of its 7th step (the survivors in
    the shard group's all-gather, or the replicas' all-reduce of the step before's backward done): the step is
    discarded, w1's shard comes from its replica w3, and the 3 survivors (FSDP over 3) redo it."""
    run = fsdp_run(tmp_path, "hsdp_killed", "--hold", "--hsdp", "2", "--kill", "w1:6", schedule="3:add=2")
    check_exact(run, reference, final_world=3)
    _grow, failure = run.adjustments()
    assert failure["action"] == "failure" and failure["failure"]["dead"] == ["w1"], failure
    assert failure["failure"]["step_redone"] == 7, failure
    assert "restores the shard of dead rank" not in run.output, run.excerpt()  # no mirror in the HSDP layout
    meshes = meshes_by_step(run)
    assert meshes[5] == {(2, 2)} and meshes[6] == {(3,)}, meshes  # the step w1 died in, redone at 3
