"""A job resumed with ``fit(ckpt_path="last")`` from a checkpoint saved on an epoch's last batch, then grown by one
worker (user script ``user_scripts/resume_from_last_batch.py``: ``ModelCheckpoint(every_n_train_steps=8,
save_last=True)`` over 8-step epochs, validation after every epoch). A first job trains 2 epochs on 2 workers (its
``last.ckpt`` is step 16, the last batch of epoch 1); a second one resumes it for 4 epochs under
``elan run --nproc 2 --schedule 20:add=1``: exit 0, validations after steps 24 and 32, every sample once in epochs 2
and 3, the final model equal to a static resumed run's (within 1e-9).

On the old code the second job hung at the end of the epoch the worker joined in (found by probe round 8, with a
random SIGKILL and ``--replace-failed``; a plain ``add`` does it too): a loop resumed from a checkpoint saved on an
epoch's last batch goes on without counting the next epochs as started (Lightning 2.6.6's ``epoch_progress``), so the
joiner's restore of the members' state took it for a restart at an epoch's end, its batch index started again at 0,
and it missed the epoch's last batch and the validation the members ran after it (this test: timed out after 180 s).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.integration.elastic_runs import TOLERANCE, assert_states_close, elan_env

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "resume_from_last_batch.py"
SAMPLES = 96


def elan_job(tmp: Path, name: str, out: Path, epochs: int, schedule: str | None = None) -> str:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", name, "--coordinate-every",
               "1", "--state-dir", str(tmp / f"{name}-state"), *(["--schedule", schedule] if schedule else []), "--",
               sys.executable, str(SCRIPT), str(out), str(epochs)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=180, env=elan_env(tmp))
    except subprocess.TimeoutExpired as expired:
        output = b"".join(part for part in (expired.stdout, expired.stderr) if isinstance(part, bytes))
        pytest.fail(f"job {name} hung:\n{output.decode(errors='replace')[-4000:]}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def samples_per_epoch(out: Path) -> dict[int, Counter]:
    epochs: dict[int, Counter] = {}
    for path in out.glob("samples-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            epochs.setdefault(record["epoch"], Counter()).update(record["samples"])
    return epochs


def validations(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "validations.jsonl").read_text().splitlines()]


def resumed_copy(first: Path, out: Path) -> Path:
    out.mkdir(parents=True)
    shutil.copytree(first / "checkpoints", out / "checkpoints")
    return out


def test_a_joiner_into_a_job_resumed_from_an_epochs_last_batch(tmp_path):
    first = tmp_path / "first"
    elan_job(tmp_path, "first", first, 2)
    assert torch.load(first / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 16
    static = resumed_copy(first, tmp_path / "static")
    elan_job(tmp_path, "static", static, 4)
    grown = resumed_copy(first, tmp_path / "grown")
    elan_job(tmp_path, "grown", grown, 4, schedule="20:add=1")
    adjustments = [json.loads(line) for line in (tmp_path / "grown-state" / "adjustments.jsonl").read_text()
                   .splitlines()]
    assert [record["action"] for record in adjustments] == ["add"], adjustments
    assert 16 < adjustments[0]["step"] < 31, adjustments  # mid-epoch, in the resumed job
    assert validations(grown) == validations(static) == [24, 32]
    epochs = samples_per_epoch(grown)
    assert sorted(epochs) == [2, 3]
    for epoch, counts in epochs.items():
        assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}, (epoch, counts)
    assert_states_close(torch.load(grown / "final.pt"), torch.load(static / "final.pt"), TOLERANCE)
