"""An Accelerate loop that freezes its backbone for the first epoch and prunes its head at step 12
(``accelerate_finetune_loop.py``), under the real `elan run`: a worker joins after the unfreeze (step 10), another
migrates in after the pruning (step 14), rank 0 leaves (step 18); the job ends with the static 2-worker run's
parameters, pruning masks included (within 1e-9), each sample once per epoch. A joiner takes which parameters require a
gradient and the pruning reparametrisation with the state, and every member's DDP all-reduces the backbone's gradients
once it is unfrozen."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.integration.elastic_runs import RunResult, elan_env

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_finetune_loop.py")
SAMPLES, EPOCHS = 96, 3


def run(tmp: Path, name: str, schedule: str | None) -> RunResult:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", name, "--coordinate-every",
               "1", "--state-dir", str(tmp / f"{name}-state"), *(["--schedule", schedule] if schedule else []), "--",
               sys.executable, str(LOOP), str(tmp / name)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=420, env=elan_env(tmp))
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(tmp / name, tmp / f"{name}-state", proc.returncode, output)


def test_a_joiner_after_an_unfreeze_and_a_pruning_trains_as_the_members(tmp_path: Path) -> None:
    static = run(tmp_path, "static", None)
    assert static.returncode == 0, static.excerpt()
    elastic = run(tmp_path, "elastic", "10:add=1,14:migrate=1,18:remove=rank:0")
    assert elastic.returncode == 0, elastic.excerpt()

    assert [(a["action"], a["step"]) for a in elastic.adjustments()] == [("add", 10), ("migrate", 14),
                                                                           ("remove", 18)]
    expected, actual = torch.load(static.out / "final.pt"), torch.load(elastic.out / "final.pt")
    assert sorted(actual) == sorted(expected) and "head.weight_mask" in actual, sorted(actual)
    for key, value in expected.items():
        assert torch.allclose(actual[key], value, rtol=0, atol=1e-9), key
    assert int((expected["head.weight_mask"] == 0).sum()) == 5  # 30% of 16
    for record_run in (static, elastic):
        per_epoch: dict[str, Counter] = {}
        for record in record_run.records():
            for epoch, indices in record["trained"].items():
                per_epoch.setdefault(epoch, Counter()).update(indices)
        assert sorted(per_epoch) == ["0", "1", "2"]
        assert all(counts == Counter(range(SAMPLES)) for counts in per_epoch.values()), per_epoch
