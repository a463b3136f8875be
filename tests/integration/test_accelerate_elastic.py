"""Live elasticity for Hugging Face Accelerate: real `elan run` jobs of an ordinary Accelerate loop
(``accelerate_probe.py``), gloo on CPU, float64.

Every elastic run is checked for: each sample used exactly once per epoch, bit-identical parameters, optimizer state,
EMA and LR on every worker at every step, and final parameters, optimizer state and EMA equal to a static
2-process run of a plain ``accelerate.Accelerator`` (DDP) with the same global batch, within 1e-9.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch

from tests.integration.accelerate_runs import (
    EPOCHS,
    JOB_ARGS,
    PROBE,
    SAMPLES,
    accelerate_run,
    check_accelerate_run,
    total_steps,
)
from tests.integration.elastic_runs import (
    TOLERANCE,
    assert_counted_once,
    assert_ranks_agree,
    assert_states_close,
    consumed_per_epoch,
    digests_by_step,
    elan_env,
)

pytestmark = pytest.mark.integration

def test_static_elastic_accelerator_equals_plain_accelerator_step_for_step(plain_runs, tmp_path):
    """Two workers, no adjustment: the same digests as plain Accelerate DDP at every step (bit for bit)."""
    run = accelerate_run(tmp_path, "static", 2, [])
    check_accelerate_run(run, plain_runs[1], sizes=[])
    assert digests_by_step(run.records()) == digests_by_step(plain_runs[1].records())


@pytest.mark.parametrize(("accumulation", "schedule"), [
    (1, "3:add=1,6:remove=rank:0,10:migrate=1,14:to=5"),
    (2, "2:add=1,4:remove=rank:0,6:migrate=1,8:to=5"),
])
def test_grow_remove_rank0_migrate_to5_across_epochs(plain_runs, tmp_path, accumulation, schedule):
    """2→3→2 (rank 0 leaves)→migrate→5 (a world the global batch does not divide) across an epoch boundary, with
    and without gradient accumulation; the tracker moves to the new main process with rank 0."""
    args = [*JOB_ARGS[accumulation], "--wait-for-joiners", "--tracker"]
    run = accelerate_run(tmp_path, f"elastic{accumulation}", 2, args, schedule=schedule)
    grow, remove, migrate, to5 = check_accelerate_run(run, plain_runs[accumulation], [3, 2, 2, 5], accumulation)
    assert [a["action"] for a in (grow, remove, migrate, to5)] == ["add", "remove", "migrate", "to"]
    assert remove["leavers"] == [grow["members"][0]], "remove rank:0 removes the generation's rank 0"
    assert len(migrate["joiners"]) == 1 and len(to5["joiners"]) == 3
    logged = [json.loads(line) for line in (run.out / "tracker.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in logged if "step" in line]
    assert sorted(steps) == list(range(total_steps(accumulation))), "each step logged once"
    writers = [line["worker"] for line in logged if "step" in line]
    assert writers[0] == remove["leavers"][0] and writers[-1] == remove["members"][0], "the tracker moved"
    assert sum("config" in line for line in logged) == 2, "started on the first main process and on the next"


def test_weak_scaling_doubles_the_global_batch_and_ramps_the_lr_on_every_rank(tmp_path):
    """Weak scaling 2→4: the global batch goes 12→24 and the LR multiplier ramps from 1 to 2 over 4 steps on every
    worker, joiners included; the LR schedule (StepLR stepped by the launch world) is not disturbed."""
    run = accelerate_run(tmp_path, "weak", 2, ["--scaling", "weak", "--ramp-steps", "4", "--wait-for-joiners"],
                         schedule="3:to=4")
    assert run.returncode == 0, run.excerpt()
    records = run.records()
    assert_counted_once(consumed_per_epoch(records), SAMPLES, EPOCHS)
    assert_ranks_agree(records)
    (adjustment,) = run.adjustments()
    start = adjustment["step"]
    for record in records:
        for step, _epoch, world, global_batch, lr, _gathered in record["steps"]:
            scheduled = 0.01 * 0.5 ** ((2 * step) // 7)
            scale = 1.0 if step <= start else min(2.0, 1.0 + (step - start) / 4)
            assert lr == pytest.approx(scheduled * scale, rel=1e-12), (record["worker"], step)
            assert (world, global_batch) == ((2, 12) if step < start else (4, 24)), (record["worker"], step)
    joiners = [record for record in records if record["worker"] in adjustment["joiners"]]
    assert len(joiners) == 2 and all(record["steps"][-1][4] > 0 for record in joiners)


def test_save_state_at_3_workers_load_state_at_2_continues_at_the_right_sample(tmp_path):
    """``save_state`` after 5 steps of a 3-worker job, ``load_state`` in a 2-worker job that grows to 3 at step 8:
    epoch 0 is completed with no sample twice or missing, and the result equals an uninterrupted 3-worker run (same
    global batch 18). The joiner runs the same ``load_state`` line and skips it: it holds the job's newer state."""
    first = accelerate_run(tmp_path, "first", 3, ["--save-at", "5", "--stop-after-save"])
    assert first.returncode == 0, first.excerpt()
    checkpoint = first.out / "checkpoint"
    saved = json.loads((checkpoint / "elan_state.json").read_text())
    assert saved["data"]["position"] == 5 * 18
    assert saved["loop"]["optimizer_steps"] == 5, "saved right after the 5th step: it counts"
    resumed = accelerate_run(tmp_path, "resumed", 2, ["--load", str(checkpoint), "--wait-for-joiners"],
                             schedule="8:add=1")
    reference = accelerate_run(tmp_path, "reference", 3, [])
    for run in (resumed, reference):
        assert run.returncode == 0, run.excerpt()
    per_epoch = consumed_per_epoch(first.records())
    for epoch, counts in consumed_per_epoch(resumed.records()).items():
        per_epoch.setdefault(epoch, Counter()).update(counts)
    assert_counted_once(per_epoch, SAMPLES, EPOCHS)
    assert [len(a["members"]) for a in resumed.adjustments()] == [3]
    assert_states_close(resumed.final_state(), reference.final_state(), TOLERANCE)


def test_a_standalone_script_trains_like_one_plain_process(tmp_path):
    """``python train.py`` without `elan run`: one process, the whole dataset every epoch."""
    out = tmp_path / "alone"
    proc = subprocess.run([sys.executable, str(PROBE), "--out", str(out), "--epochs", "1"], capture_output=True,
                          text=True, timeout=120, env={k: v for k, v in elan_env(tmp_path).items()
                                                      if not k.startswith("ELAN_") or k == "ELAN_HOME"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (record,) = [json.loads(path.read_text()) for path in out.glob("record-*.json")]
    assert record["world_size"] == 1 and sorted(record["consumed"]["0"]) == list(range(SAMPLES))
    assert torch.load(out / "final.pt").keys()
