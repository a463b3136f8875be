"""An application master that answers rank 0's ``coordinate`` late (a loaded host) must not strand the plan it
decided on that request: the job still carries it out, with the same result as a static run.

Seen in a loaded full test run (``test_accelerate_user_loops.py``, the user's step counter): the launcher logged "job
grows after step 10: w2 joins" and then "the members finished before adjustment r1 was carried out": rank 0's link
gave up on the AM after 1.5 s and kept quiet for 5 s, the AM decided the plan on the request it answered late, and
the members trained to their end without asking again; the joiner was started for nothing and stopped.

Here the AM is really stopped (SIGSTOP) for 2.5 s from just before step 10 (``accelerate_slow_am_loop.py``).
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

LOOP = Path(__file__).with_name("accelerate_slow_am_loop.py")
SAMPLES, EPOCHS = 64, 3


def loop_run(tmp: Path, name: str, *args: str) -> RunResult:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", name, "--coordinate-every",
               "1", "--state-dir", str(tmp / f"{name}-state"), *args, "--", sys.executable, str(LOOP), str(tmp / name)]
    if "--schedule" in args:
        command.append("10")  # the loop silences the AM before step 10
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=elan_env(tmp))
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(tmp / name, tmp / f"{name}-state", proc.returncode, output)


def test_a_plan_decided_on_a_coordinate_the_am_answered_late_is_carried_out(tmp_path):
    static = loop_run(tmp_path, "static")
    assert static.returncode == 0, static.excerpt()
    run = loop_run(tmp_path, "slow", "--schedule", "10:add=1")
    assert run.returncode == 0, run.excerpt()
    assert "application master does not answer" in run.output, "the AM was not silenced during a coordinate"
    assert "members finished before adjustment" not in run.output, run.excerpt()
    assert [adjustment["members"] for adjustment in run.adjustments()] == [["w0", "w1", "w2"]]
    records = [json.loads(path.read_text()) for path in sorted(run.out.glob("record-*.json"))]
    assert sorted(record["worker"] for record in records) == ["w0", "w1", "w2"]
    for epoch in range(EPOCHS):
        trained = Counter(index for record in records for index in record["trained"].get(str(epoch), []))
        assert trained == Counter(range(SAMPLES)), (epoch, trained)
    reference = torch.load(static.out / "final-w0.pt")
    for worker in ("w0", "w1", "w2"):
        final = torch.load(run.out / f"final-{worker}.pt")
        assert max((final[k] - reference[k]).abs().max().item() for k in reference) <= 1e-9, worker
