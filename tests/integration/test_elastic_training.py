"""Live elasticity end to end: real `elan run` jobs of a real Lightning script, gloo on CPU, float64.

Every elastic run is checked for: each sample used exactly once per epoch, bit-identical parameters and optimizer
state on every worker at every step, and final parameters equal to a static 2-worker run (strong scaling).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.integration.elastic_runs import (
    EPOCHS,
    PROBE,
    PROBE_ARGS,
    SAMPLES,
    STEPS_PER_EPOCH,
    TOLERANCE,
    assert_each_sample_once,
    assert_ranks_agree,
    assert_states_close,
    check_adjustment_steps,
    check_elastic_run,
    elan_cli,
    elan_run,
    epoch_ends,
    free_port,
    read_metrics_csv,
    wait_for_status,
)

pytestmark = pytest.mark.integration

# rank 0 holds a batch until the joiners due at its step are ready: a scheduled adjustment then lands at the first
# coordination at or after its step however long the joiners take to start (no effect on the numbers)
ELASTIC_ARGS = [*PROBE_ARGS, "--wait-for-joiners"]


def test_static_elan_run_matches_lightning_ddp_sample_for_sample(static_run, tmp_path):
    """The elastic loader reproduces DistributedSampler's global batches: a static run equals plain Lightning DDP."""
    out = tmp_path / "ddp"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROBE), "--out", str(out), *PROBE_ARGS, "--strategy", "ddp", "--devices", "2"],
            env={**env, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
                 "LOCAL_WORLD_SIZE": "2", "ELAN_WORKER_ID": f"ddp{rank}"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    assert not failed, "\n".join(f"rank {r} (exit {procs[r].returncode}):\n{outputs[r][-3000:]}" for r in failed)
    records = [json.loads(path.read_text()) for path in sorted(out.glob("record-*.json"))]
    assert {record["world_size"] for record in records} == {2} and len(records) == 2
    assert_each_sample_once(records, SAMPLES, EPOCHS)
    assert_states_close(torch.load(out / "final.pt"), static_run.final_state(), TOLERANCE)


def test_grow_shrink_remove_rank0_migrate_across_epochs(static_run, tmp_path):
    """2→3→2→1→(migrate the only worker)→3 with the epoch boundary at step 9 inside the schedule: the remove
    scheduled at 9 (the coordination after epoch 0's last batch) must wait for the next batch, wherever it lands."""
    schedule = "3:add=1,6:remove=1,9:remove=rank:0,13:migrate=1,20:to=3"
    run = elan_run(tmp_path, "mixed", 2, ELASTIC_ARGS, schedule=schedule)
    adjustments = check_elastic_run(run, static_run, schedule, sizes=[3, 2, 1, 1, 3])
    grow, shrink, remove_rank0, migration, to3 = adjustments
    assert (len(grow["joiners"]), grow["leavers"]) == (1, [])
    assert (shrink["joiners"], len(shrink["leavers"])) == ([], 1)
    assert remove_rank0["leavers"] == [shrink["members"][0]], "remove rank:0 removes the generation's rank 0"
    assert migration["leavers"] == [migration["sources"][migration["joiners"][0]]], "the only source is a leaver"
    assert migration["leavers"] == remove_rank0["members"] and len(migration["joiners"]) == 1
    assert len(to3["joiners"]) == 2 and set(to3["members"]) >= set(migration["members"])
    assert all(a["pause_s"] for a in adjustments if len(a["members"]) > len(a["joiners"]))


def test_adjustments_with_dataloader_workers_and_validation(static_run, tmp_path):
    """num_workers=2 (persistent): the prefetched batches are rebuilt at every resize; validation reshards."""
    schedule = "2:add=1,5:migrate=1,11:remove=rank:0,14:add=2"
    run = elan_run(tmp_path, "workers", 2, [*ELASTIC_ARGS, "--num-workers", "2", "--val"], schedule=schedule)
    assert run.config()["num_workers"] == 2 and run.config()["val"]
    adjustments = check_elastic_run(run, static_run, schedule, sizes=[3, 3, 2, 4])
    assert [len(a["joiners"]) > 0 for a in adjustments] == [True, True, False, True]
    assert [a["bytes_replicated"] > 0 for a in adjustments] == [True, True, False, True]
    validations = {tuple(v) for record in run.records() for v in record["validations"]}
    assert validations == {(epoch, (epoch + 1) * STEPS_PER_EPOCH) for epoch in range(EPOCHS)}


def test_global_batch_not_divisible_by_world_size(static_run, tmp_path):
    """12 samples over 5 workers (3,3,2,2,2) and the last global batch of 4 over 5 (one worker gets weight 0)."""
    run = elan_run(tmp_path, "uneven", 2, ELASTIC_ARGS, schedule="2:to=5")
    (adjustment,) = check_elastic_run(run, static_run, "2:to=5", sizes=[5])
    assert len(adjustment["joiners"]) == 3
    records = run.records()
    assert len(records) == 5 and all(record["digests"] for record in records), "every worker trained"
    assert {record["world_size"] for record in records} == {5}


def test_rank0_leaving_hands_over_logger_checkpoints_and_progress_bar(static_run, tmp_path):
    """With a CSV logger, ModelCheckpoint and the progress bar on, rank 0 leaves within the first epoch: the new
    rank 0 carries on. (After an epoch end: ``test_rank0_handover_after_an_epoch_end_keeps_the_csv_whole``.)"""
    schedule = "3:add=1,6:remove=rank:0"
    run = elan_run(tmp_path, "handover", 2, [*ELASTIC_ARGS, "--full-lightning"], schedule=schedule)
    _, handover = check_elastic_run(run, static_run, schedule, sizes=[3, 2])
    assert handover["leavers"] == ["w0"]
    # with --wait-for-joiners nothing defers the remove past step 6 (no validation, no accumulation): this test's case
    assert handover["step"] < STEPS_PER_EPOCH, "precondition: the handover happens before the first epoch ends"
    check_logger_and_checkpoints(run)


def check_logger_and_checkpoints(run) -> None:
    """One experiment, continued by the new rank 0: every step logged exactly once, every epoch's mean logged, the
    header holds every column; a checkpoint every 4 steps."""
    versions = sorted((run.out / "logs" / "lightning_logs").iterdir())
    assert [v.name for v in versions] == ["version_0"], "one experiment, continued by the new rank 0"
    header, rows = read_metrics_csv(versions[0] / "metrics.csv")
    assert set(header) == {"epoch", "step", "train_loss_step", "train_loss_epoch"}, header
    step_rows = [int(row["step"]) for row in rows if row["train_loss_step"]]
    assert step_rows == list(range(EPOCHS * STEPS_PER_EPOCH)), "every step logged once, none lost at handover"
    epoch_rows = [(int(row["epoch"]), int(row["step"])) for row in rows if row["train_loss_epoch"]]
    assert epoch_rows == [(epoch, (epoch + 1) * STEPS_PER_EPOCH - 1) for epoch in range(EPOCHS)]
    checkpoints = sorted(int(p.stem.split("step=")[1]) for p in (versions[0] / "checkpoints").glob("*.ckpt"))
    assert checkpoints == list(range(4, EPOCHS * STEPS_PER_EPOCH + 1, 4))


def test_rank0_handover_after_an_epoch_end_keeps_the_csv_whole(tmp_path):
    """A user's job with Lightning's CSV logger: rank 0 leaves after the first epoch ended. The job must finish and
    its metrics.csv stay whole. (Filed as a known bug in issue 10; it does not reproduce on this tree, so this is an
    ordinary test: a strict xfail would fail as XPASS.)"""
    schedule = "3:add=1,11:remove=rank:0"
    run = elan_run(tmp_path, "csv", 2, [*ELASTIC_ARGS, "--full-lightning"], schedule=schedule)
    assert run.returncode == 0, run.excerpt()
    _, handover = run.adjustments()
    assert handover["leavers"] == ["w0"] and handover["step"] > STEPS_PER_EPOCH
    check_logger_and_checkpoints(run)


def test_single_process_without_launcher_is_plain_lightning(tmp_path):
    """`Trainer(strategy="elan")` with no `elan run`: one process, same result as Lightning's default strategy."""
    results = {}
    for strategy in ("elan", "auto"):
        out = tmp_path / strategy
        args = [sys.executable, str(PROBE), "--out", str(out), *PROBE_ARGS, "--no-shuffle", "--strategy", strategy]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELAN_")}
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        record = json.loads((out / "record-w0.json").read_text())
        assert record["config"]["strategy"] == strategy and record["config"]["no_shuffle"]
        assert record["world_size"] == 1 and record["global_step"] == EPOCHS * 17
        results[strategy] = torch.load(out / "final.pt")
    assert_states_close(results["elan"], results["auto"], 1e-12)


def test_scale_and_status_against_a_running_job(live_job, tmp_path):
    """A user's flow: start a job, then `elan scale` and `elan status` from another shell while it trains."""
    epochs = 60
    job, env = live_job("live", 2, [*PROBE_ARGS, "--epochs", str(epochs), "--step-sleep", "0.03"],
                        coordinate_every=2)
    status = wait_for_status(env, "live", lambda s: s["step"] and s["step"] >= 2)
    assert status["generation"] == 0 and [m["worker_id"] for m in status["members"]] == ["w0", "w1"]
    elan_cli(env, "scale", "--job", "live", "add", "1")
    status = wait_for_status(env, "live", lambda s: s["generation"] == 1)
    assert [m["rank"] for m in status["members"]] == [0, 1, 2]
    assert [m["worker_id"] for m in status["members"]] == ["w0", "w1", "w2"]
    elan_cli(env, "scale", "--job", "live", "remove", "rank:0")
    # the last adjustment is the last one its members reported done, some steps after the generation changed
    status = wait_for_status(env, "live", lambda s: (s["last_adjustment"] or {}).get("generation") == 2)
    assert [m["worker_id"] for m in status["members"]] == ["w1", "w2"]
    assert status["last_adjustment"]["leavers"] == ["w0"]
    human = elan_cli(env, "status", "--job", "live")
    assert "generation 2" in human and "w1" in human
    bad = subprocess.run([sys.executable, "-m", "lightning_elan.cli", "scale", "--job", "nope", "add", "1"],
                         env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "nope" in bad.stderr
    output = job.communicate(timeout=600)[0]
    assert job.returncode == 0, output[-4000:]
    records = [json.loads(p.read_text()) for p in (tmp_path / "live").glob("record-*.json")]
    assert_each_sample_once(records, SAMPLES, epochs)
    assert assert_ranks_agree(records) == epochs * STEPS_PER_EPOCH
    state = tmp_path / "live-state" / "adjustments.jsonl"
    adjustments = [json.loads(line) for line in state.read_text().splitlines()]
    assert [(len(a["members"]), a["joiners"], a["leavers"]) for a in adjustments] == [(3, ["w2"], []), (2, [], ["w0"])]
    # w2 took the source's parameters into its own model, Adam's moments into memory it faulted in while it waited
    received = adjustments[0]["received"]["w2"]
    model_bytes = sum(t.numel() * t.element_size() for t in torch.load(tmp_path / "live" / "final.pt").values())
    assert (received["route"], received["in_place_bytes"], received["prefaulted"]) == ("shm", model_bytes, True)
    check_adjustment_steps(adjustments, None, coordinate_every=2, epoch_ends=epoch_ends(epochs))
