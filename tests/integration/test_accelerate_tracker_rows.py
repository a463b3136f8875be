"""A main process SIGKILLed just before ``accelerator.log`` lost that row: the other processes had passed their
``log`` (a no-op off the main process) and recovered at their next collective, the new main process started its
trackers and never wrote the row. Now every process keeps the rows it logged and the new main process writes those its
predecessor had not marked as written (``lightning_elan/accelerate/tracker_rows.py``).

User script: ``accelerate_tracker_rows_loop.py`` (a custom JSON-lines ``GeneralTracker`` as Accelerate's docs show
it), 3 workers, no --replace-failed; the main process (rank 0) SIGKILLs itself just before its ``log`` of epoch 1's
evaluation row, or of an applied step's training-loss row. The tracker's configuration row is written by each main
process that starts the trackers (2 here): a new main process starts its own tracker run, which needs its
configuration (wandb's is a new run), and is not counted as a duplicate.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.integration.elastic_runs import RunResult, elan_env

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_tracker_rows_loop.py")
SAMPLES, EPOCHS, STEPS = 96, 3, 24  # 8 global batches of 12 per epoch


def loop_run(tmp: Path, name: str, *script_args: str) -> RunResult:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "3", "--job", name,
               "--state-dir", str(tmp / f"{name}-state"), "--", sys.executable, str(LOOP), str(tmp / name),
               *script_args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=elan_env(tmp))
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(tmp / name, tmp / f"{name}-state", proc.returncode, output)


def rows(run: RunResult) -> list[dict]:
    return [json.loads(line) for line in (run.out / "logs" / "run.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def static(tmp_path_factory) -> RunResult:
    run = loop_run(tmp_path_factory.mktemp("static"), "static")
    assert run.returncode == 0, run.excerpt()
    return run


@pytest.mark.parametrize("die_at", ["epoch_log:0:1", "step_log:0:9"])
def test_a_main_process_killed_before_its_log_loses_no_row(tmp_path, static, die_at):
    run = loop_run(tmp_path, "killed", "--die-at", die_at)
    assert run.returncode == 0, run.excerpt()
    assert "Traceback" not in run.output, run.excerpt()
    assert (run.out / f"died-{die_at.split(':')[0]}").exists(), "the main process did not die where asked"
    assert [adjustment["failure"]["dead"] for adjustment in run.adjustments()] == [["w0"]]
    written = rows(run)
    assert len([row for row in written if "config" in row]) == 2, "one configuration per main process"
    steps = Counter(row["step"] for row in written if "train_loss" in row)
    assert steps == Counter(range(STEPS)), f"training rows logged not exactly once: {steps}"
    evaluations = {row["epoch"]: row for row in written if "val_mse" in row}
    assert len([row for row in written if "val_mse" in row]) == EPOCHS == len(evaluations), written
    expected = {row["epoch"]: row for row in rows(static) if "val_mse" in row}
    for epoch, row in evaluations.items():
        assert row["step"] == expected[epoch]["step"]
        assert abs(row["val_mse"] - expected[epoch]["val_mse"]) <= 1e-9, (row, expected[epoch])
    trained: dict[int, Counter] = {}
    for path in run.out.glob("samples-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            trained.setdefault(record["epoch"], Counter()).update(record["samples"])
    assert all(trained[epoch] == Counter(range(SAMPLES)) for epoch in range(EPOCHS)), trained
    final, reference = torch.load(run.out / "final.pt"), torch.load(static.out / "final.pt")
    assert max((final[key] - reference[key]).abs().max().item() for key in reference) <= 1e-9
