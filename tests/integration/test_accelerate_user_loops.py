"""Accelerate loops written the ways users write them (``accelerate_user_loop.py``), under the real `elan run`: what
the user corpus (``tests/users/accelerate``) found breaking, each in a small job of a 64-sample dataset, 8 global
batches per epoch, 3 epochs.

A job that must fail fails fast with the reason: each such run is bounded well below gloo's 300 s collective timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.elastic_runs import RunResult, elan_env

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_user_loop.py")
SAMPLES, EPOCHS, STEPS = 64, 3, 24
GLOBAL_BATCH = 8  # accelerate_user_loop.py: 4 samples per process at 2 workers
FAIL_FAST_S = 240  # a hang would wait out the 300 s collective timeout first


def user_loop_run(tmp: Path, name: str, ways: str, schedule: str, *launcher_args: str,
                  timeout: float = 420) -> RunResult:
    """``accelerate_user_loop.py WAYS`` as job ``name`` at 2 workers (output in ``tmp/name``)."""
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", name, "--coordinate-every",
               "1", "--state-dir", str(tmp / f"{name}-state"), "--schedule", schedule, *launcher_args, "--",
               sys.executable, str(LOOP), ways, str(tmp / name)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=elan_env(tmp))
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(tmp / name, tmp / f"{name}-state", proc.returncode, output)


def records(run: RunResult) -> dict[str, dict]:
    return {record["worker"]: record for record in run.records()}


def trained_per_epoch(run: RunResult) -> dict[int, Counter]:
    per_epoch: dict[int, Counter] = {}
    for record in run.records():
        for epoch, indices in record["trained"].items():
            per_epoch.setdefault(int(epoch), Counter()).update(indices)
    return per_epoch


def test_registered_after_prepare_autonamed_saves_and_a_leaver_that_saves(tmp_path):
    """``register_for_checkpointing`` after ``prepare()``, ``save_state()`` with automatic checkpoint naming after every
    epoch; 2 → 3 at step 2, rank 0 leaves at step 4, a worker joins at step 8 — after the epoch's last batch: it
    saves ``checkpoint_0`` with the members (a collective) before epoch 1 —, another at step 12 (after
    ``checkpoint_0``). Every joiner receives the registered counter and the checkpoint counter; the leaver writes
    nothing into the job's folders and is no main process; each checkpoint holds one RNG state per process of the
    world that saved it."""
    run = user_loop_run(tmp_path, "objects", "register_after,autoname", "2:add=1,4:remove=rank:0,8:add=1,12:add=1")
    assert run.returncode == 0, run.excerpt()
    assert [len(adjustment["members"]) for adjustment in run.adjustments()] == [3, 2, 3, 4]
    assert [adjustment["step"] for adjustment in run.adjustments()] == [2, 4, 8, 12]
    (leaver,) = run.adjustments()[1]["leavers"]
    by_worker = records(run)
    assert by_worker[leaver]["left"] and not by_worker[leaver]["main"] and not by_worker[leaver]["local_main"]
    stayers = [record for worker, record in by_worker.items() if worker != leaver]
    assert len(stayers) == 4 and all(record["counter"] == STEPS for record in stayers), by_worker
    assert sum(record["main"] for record in stayers) == 1
    assert all(counts == Counter(range(SAMPLES)) for counts in trained_per_epoch(run).values())
    checkpoints = run.out / "checkpoints"
    worlds = {"checkpoint_0": 3, "checkpoint_1": 4, "checkpoint_2": 4}
    assert sorted(path.name for path in checkpoints.iterdir()) == sorted(worlds)
    for name, world in worlds.items():
        states = sorted(path.name for path in (checkpoints / name).glob("random_states_*.pkl"))
        assert states == [f"random_states_{rank}.pkl" for rank in range(world)], (name, states)
        saved = json.loads((checkpoints / name / "elan_state.json").read_text())
        assert saved["loop"]["optimizer_steps"] == 8 * (int(name[-1]) + 1)


def test_skip_first_batches_on_a_joiner_keeps_the_jobs_position(tmp_path):
    """The resume idiom ``skip_first_batches(train, 2)`` in epoch 0, run by a worker that joins in epoch 0 too: its
    position is the job's (skipped there, as ``load_state`` is); the job trains the rest of each epoch once."""
    run = user_loop_run(tmp_path, "skip", "skip", "1:add=1")
    assert run.returncode == 0, run.excerpt()
    assert [len(adjustment["members"]) for adjustment in run.adjustments()] == [3]
    assert all(record["optimizer_steps"] == STEPS - 2 for record in run.records())
    per_epoch = trained_per_epoch(run)
    assert per_epoch[0] == Counter(range(16, SAMPLES)), "the first 2 global batches (of 8 samples) skipped, once"
    assert per_epoch[1] == per_epoch[2] == Counter(range(SAMPLES))


def test_a_range_epoch_loop_is_refused_at_the_start_on_every_worker(tmp_path):
    """``for epoch in range(3)``: a joiner in epoch 1 would train an epoch more than the others (and hang them); the
    loop is refused at its first batch, with what to write instead."""
    run = user_loop_run(tmp_path, "range", "range", "10:add=1", timeout=FAIL_FAST_S)
    assert run.returncode != 0
    assert run.output.count("RuntimeError: ElasticAccelerator: iterate the training DataLoader inside "
                            "`for epoch in accelerator.epochs(num_epochs):`") == 2, run.excerpt()
    assert not any(record["trained"] for record in run.records()), "nothing trained (the joiner is not needed)"


def test_a_joiner_whose_local_step_counter_trains_on_stops_with_the_reason(tmp_path):
    """``run_*_no_trainer.py``'s ``completed_steps`` local, both loops left with ``break`` at 20 steps: the joiner of
    step 10 counts from 0 and would train on alone (the others wait for it in ``wait_for_everyone``: a 300 s hang);
    it stops at once with the reason instead, and the others' loops ended after 20 steps. It does not take the
    collectives it failed with the reason for a peer's death it must wait up to a minute to hear of (it did: the
    error surfaced 60 s late)."""
    run = user_loop_run(tmp_path, "counter", "counter", "10:add=1", timeout=FAIL_FAST_S)
    assert run.returncode != 0
    assert "the AM has not said that a member died" not in run.output, run.excerpt()
    assert "LoopEnded: the job's other workers ended their training loop after 20 optimizer steps" in run.output
    assert "accelerator.optimizer_steps" in run.output
    members = [record for record in run.records() if record["counter"] == 20]
    assert len(members) == 2, run.records()


def test_gathering_a_global_batch_whose_shares_are_uneven(tmp_path):
    """``accelerator.gather`` of each batch's indices at 2 and 3 workers (3, 3 and 2 of 8): every worker gathers the
    whole global batch at every step (the shorter share padded, as ``DistributedSampler`` pads), nobody aborts."""
    run = user_loop_run(tmp_path, "gather", "gather", "2:add=1,10:remove=1")
    assert run.returncode == 0, run.excerpt()
    assert [len(adjustment["members"]) for adjustment in run.adjustments()] == [3, 2]
    assert "padded to 3 rows by repeating their last row" in run.output
    for record in records(run).values():
        if record["left"] and not record["gathered"]:
            continue
        for epoch, batches in record["gathered"].items():
            trained = {index for worker in records(run).values() for index in worker["trained"].get(epoch, [])}
            assert all(len(batch) == GLOBAL_BATCH for batch in batches), (record["worker"], epoch, batches)
            assert set().union(*map(set, batches)) <= trained
