"""A LightningModule that makes its FSDP2 units itself, as under Lightning's ``ModelParallelStrategy``:
``configure_model`` calls ``fully_shard(block, mesh=self.device_mesh)`` for each block and
``fully_shard(last, mesh=self.device_mesh, reshard_after_forward=False)`` (``user_scripts/fsdp_mlp.py --own-units``,
float64, Adam, real ``elan run``).

The job keeps the user's units through every live reshard (each unit made again on the new mesh with its options) and
adds only the LightningModule's; a joiner's ``configure_model`` runs before its admission on a stand-in mesh of the
job's launch size (``self.device_mesh`` is never None there), and its units are made again on the job's mesh when it
joins. Each
run must equal the static 2-worker ``elan_fsdp`` run (the whole module one unit: the units do not change the numbers)
within 1e-9, every sample trained once per epoch, every batch on the user's units.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.test_elan_fsdp import (
    SCRIPT,
    FsdpRun,
    assert_each_sample_once,
    assert_ok,
    assert_states_close,
    run_fsdp_job,
    static_fsdp_run,
)
from tests.integration.test_enrolled_workers import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # sharded training beyond its CI-tier checks

OWN_UNITS = ("--own-units", "--configure-model")
UNITS = ["", "net.1", "net.2", "net.3", "net.4"]
"""The user's four units and the LightningModule (``""``), which the strategy wraps."""


@pytest.fixture(scope="module")
def static_fsdp(tmp_path_factory: pytest.TempPathFactory) -> FsdpRun:
    return static_fsdp_run(tmp_path_factory, "ownstatic")


def units_trained_on(run: FsdpRun) -> set[tuple[str, ...]]:
    """The unit lists every member's batches were trained with."""
    return {tuple(json.loads(line)["units"]) for path in run.out.glob("trained-*.jsonl")
            for line in path.read_text().splitlines()}


def mesh_sizes_in_configure_model(run: FsdpRun) -> list[int]:
    return sorted(json.loads(path.read_text())["mesh_size"] for path in run.out.glob("units-*.json"))


def test_own_units_kept_through_a_grow_and_a_shrink(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """2 → 3 after step 3 (the joiner's configure_model on its stand-in mesh of 2, its units made again on the
    job's 3) → 2 after step 7: every batch on the user's units, the static run's result."""
    run = run_fsdp_job(tmp_path, "ownunits", *OWN_UNITS, schedule="3:add=1,7:remove=1")

    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3), ("remove", 2)]
    assert run.output.count("resharded live") == 6, run.excerpt()  # every member of both reshards
    assert mesh_sizes_in_configure_model(run) == [2, 2, 2]  # the joiner's stand-in: the launch size
    assert units_trained_on(run) == {tuple(UNITS)}
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())


def test_own_units_kept_when_a_member_is_killed_in_its_forward(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """2 → 3 after step 2 (a joiner with the user's units); rank 1 SIGKILLed in step 5's forward, in the user's unit
    ``net.2`` — the survivors wait in the next unit's all-gather, the root's and ``net.1``'s gathered parameters still
    registered: its shard restored from its mirror onto the survivors' mesh in the user's units, the step redone,
    the static run's result."""
    run = run_fsdp_job(tmp_path, "ownkill", *OWN_UNITS, "--kill-step", "5", "--kill-at", "forward", schedule="2:add=1")

    assert run.returncode == 0, run.excerpt()
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3), ("failure", 2)]
    assert units_trained_on(run) == {tuple(UNITS)}
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())


def tensor_parallel_sizes(run: FsdpRun) -> list[int]:
    return sorted(json.loads(path.read_text())["tensor_parallel"] for path in run.out.glob("units-*.json"))


def test_units_made_through_model_parallel_dimension_names(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """User code written for ``ModelParallelStrategy`` (Lightning's 2-D parallelism example's shape) runs unchanged:
    ``self.device_mesh["data_parallel"]`` is the job's mesh, ``["tensor_parallel"]`` a mesh of one, and it shards
    only over a data-parallel dimension of more than one — as the joiner does, on its stand-in mesh of the launch
    size, and then takes the job's units with its state. 2 → 3 → 2: every batch on the user's units, the static
    run's result."""
    run = run_fsdp_job(tmp_path, "dimnames", "--dimension-names", "--configure-model", schedule="3:add=1,7:remove=1")

    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3), ("remove", 2)]
    assert mesh_sizes_in_configure_model(run) == [2, 2, 2]
    assert tensor_parallel_sizes(run) == [1, 1, 1]
    assert units_trained_on(run) == {tuple(UNITS)}
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())


def test_blocks_under_activation_checkpointing_reshard_exactly(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """Each block wrapped by ``checkpoint_wrapper`` before it is sharded (Lightning's example does so): its parameters
    are ``net.1._checkpoint_wrapped_module.…`` while its state-dict keys drop that name. Before, the live reshard
    loaded each new shard under the parameter's name, which matched no key: every block stayed on the meta device and
    the job died at its first resize ("Cannot copy out of meta tensor"). 2 → 3 → 2, the static run's result."""
    run = run_fsdp_job(tmp_path, "ckptact", "--dimension-names", "--checkpoint-activations", "always",
                       "--configure-model", schedule="3:add=1,7:remove=1")

    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3), ("remove", 2)]
    assert units_trained_on(run) == {tuple(UNITS)}
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())


def test_activation_checkpointing_only_when_sharded_as_lightnings_example_does(tmp_path: Path,
                                                                               static_fsdp: FsdpRun) -> None:
    """Lightning's example wraps the blocks for activation checkpointing only over a data-parallel dimension of more
    than one. A joiner's ``configure_model`` runs before it joins, on a stand-in mesh of the job's launch size: it
    builds the members' module. Before, the stand-in had one rank, the joiner built its blocks unwrapped, its reshard
    exchanged rows of other sizes than the holders sent (gloo aborted it) and the survivors' recovery then met the meta
    tensors it left. 2 → 3, the static run's result."""
    run = run_fsdp_job(tmp_path, "ckptwhen", "--dimension-names", "--checkpoint-activations", "when-sharded",
                       "--configure-model", schedule="3:add=1")

    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3)]
    assert mesh_sizes_in_configure_model(run) == [2, 2, 2]
    assert units_trained_on(run) == {tuple(UNITS)}
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())


def test_a_joiner_that_builds_another_module_is_refused_and_the_job_goes_on(tmp_path: Path,
                                                                           static_fsdp: FsdpRun) -> None:
    """A joiner whose host builds the network wider than the members' (another configuration): it refuses before any
    row moves, naming a parameter whose shape differs, exits with no second traceback (its teardown no longer moves
    its meta module to the CPU), and the members, not waiting on it as on a death, recover and end with the static
    run's result."""
    run = run_fsdp_job(tmp_path, "widerjoiner", "--joiner-width", "20", schedule="3:add=1")

    assert run.returncode == 0, run.excerpt()
    assert "ModuleMismatch: this worker's parameter 'net.0.bias' has the shape [20], the job's [16]" \
        in run.output, run.excerpt()
    assert "Cannot copy out of meta tensor" not in run.output and "a collective failed" not in run.output
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("failure", 2)]
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())


def test_units_sharded_on_another_dimension_are_refused_at_setup(tmp_path: Path) -> None:
    """A ``shard_placement_fn`` that shards the blocks' parameters on their last dimension: the live reshard moves
    rows, so the job refuses it as it sets up, naming the parameter — before, the units were made again at a resize
    with ``fully_shard``'s default rows, silently. Every process exits; nothing hangs."""
    run = run_fsdp_job(tmp_path, "columns", "--dimension-names", "--shard-columns", "--configure-model")

    assert run.returncode != 0
    assert "parameter 'net.3.linear.weight' is sharded on dimension 1 (fully_shard's shard_placement_fn)" \
        in run.output, run.excerpt()


def test_compiled_units_train_through_a_grow_and_a_shrink(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """Each sharded block compiled in ``configure_model`` (``block.compile()`` after ``fully_shard``, as torchtitan
    does; ``backend="aot_eager"``: dynamo and AOT autograd over the DTensor parameters on the job's mesh, without a C++
    build on this box): through 2 → 3 → 2 the compiled units train on the new meshes and the result is the static
    run's."""
    run = run_fsdp_job(tmp_path, "compiled", "--dimension-names", "--configure-model", "--compile", "aot_eager",
                       schedule="3:add=1,7:remove=1")

    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3), ("remove", 2)]
    assert units_trained_on(run) == {tuple(UNITS)}
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())


def test_a_joiner_started_by_elan_worker_builds_for_the_launch_world(tmp_path: Path, static_fsdp: FsdpRun) -> None:
    """The same user code in a job of ``elan worker``s (a scheduler's, ``elan am --min-workers 2``): the joiner's
    launcher did not start the job, so it learns the launch world from the AM at its enrolment (before, its stand-in
    mesh had one rank, it built its blocks unwrapped and was refused with ``ModuleMismatch``). 2 → 3 when the third
    worker is ready; the static run's result."""
    cluster = Cluster(tmp_path)
    args = ["--dimension-names", "--checkpoint-activations", "when-sharded", "--configure-model", "--step-sleep", "1"]
    cluster.start_am(max_workers=3, min_workers=2)
    try:
        members = [cluster.command(f"w-{name}", [sys.executable, str(SCRIPT), str(tmp_path / "out"), *args])
                   for name in "ab"]
        cluster.wait_status(lambda status: status["generation"] == 0 and len(status["members"]) == 2)
        joiner = cluster.command("w-c", [sys.executable, str(SCRIPT), str(tmp_path / "out"), *args])
        codes = [proc.wait(300) for proc in [*members, joiner]]
        assert codes == [0, 0, 0], cluster.logs()
        assert cluster.am.wait(60) == 0, cluster.logs()
    finally:
        cluster.stop()
    run = FsdpRun(tmp_path, 0, cluster.logs())
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3)], cluster.logs()
    assert mesh_sizes_in_configure_model(run) == [2, 2, 2]
    assert units_trained_on(run) == {tuple(UNITS)}
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())
