"""From the user's side: an ordinary Lightning script under `elan run`, one of its workers SIGKILLed from outside in
the middle of an epoch. The job ends with exit 0; the user's logger and checkpoints are whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.elastic_runs import elan_env, read_metrics_csv, wait_for_status

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "user_scripts" / "fit_with_logger.py"
STEPS = 2 * 8  # 2 epochs of 96 samples, global batch 12 (4 per worker × 3)


def test_a_worker_killed_mid_epoch_leaves_the_users_job_whole(tmp_path: Path) -> None:
    env = elan_env(tmp_path)
    state_dir = tmp_path / "state"
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "3", "--job", "user", "--state-dir",
               str(state_dir), "--", sys.executable, str(SCRIPT), str(tmp_path / "out")]
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        status = wait_for_status(env, "user", lambda s: (s["step"] or 0) >= 4)
        victim = next(member for member in status["members"] if member["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        output, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-4000:]

    records = [json.loads(line) for line in (state_dir / "adjustments.jsonl").read_text().splitlines()]
    assert [(r["action"], r["failure"]["dead"], len(r["members"])) for r in records] == [
        ("failure", [victim["worker_id"]], 2)
    ]
    header, rows = read_metrics_csv(tmp_path / "out" / "logs" / "lightning_logs" / "version_0" / "metrics.csv")
    assert {"train_loss_step", "train_loss_epoch", "val_loss"} <= set(header)
    assert [int(r["step"]) for r in rows if r["train_loss_step"]] == list(range(STEPS)), "every step logged once"
    assert len([r for r in rows if r["val_loss"]]) == 2, "one validation per epoch"
    checkpoints = sorted((tmp_path / "out" / "checkpoints").glob("*.ckpt"))
    assert [int(p.stem.split("step=")[1]) for p in checkpoints] == [5, 10, 15]
    assert torch.load(checkpoints[-1], weights_only=False)["global_step"] == 15
