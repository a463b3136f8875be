"""Smoke test of the crash-recovery benchmark (`python -m bench.faults`): torchrun elastic, 1m model, one SIGKILL.

One torchrun agent with 3 workers; after a few steps the harness SIGKILLs the rank-1 training process, the agent
restarts all three from the last checkpoint, and the harness measures the time from the kill to their first step.
Checks that the measured time is a positive finite number and that the job really restarted: new worker processes,
started after the kill, completed steps. ≈ 35 s on the 2-core CI machine (6 Lightning process starts).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.analysis import load_steps

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # a benchmark tool's check: outside the CI tier

REPO = Path(__file__).resolve().parents[2]


def test_torchrun_kill_is_measured(tmp_path):
    command = [
        sys.executable, "-m", "bench.faults", "--models", "1m", "--kills", "1", "--launchers", "torchrun",
        "--warmup-steps", "3", "--settle-steps", "3", "--out", str(tmp_path / "out"),
        "--work-dir", str(tmp_path / "work"),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    results = json.loads((tmp_path / "out" / "faults.json").read_text())
    run = results["devices"]["cpu"]["models"]["1m"]["faults"]["torchrun"]
    assert run["error"] is None
    [kill] = run["kills"]
    for name in ("recovery_s", "progress_s"):
        assert kill[name] is not None and math.isfinite(kill[name]) and kill[name] > 0, f"{name} = {kill[name]}"
    assert kill["progress_s"] >= kill["recovery_s"]

    processes = load_steps(Path(run["steps_dir"]))
    restarted = [p for p in processes if p.start >= kill["killed_at"]]
    assert len(restarted) == 3, f"{len(restarted)} workers started after the kill"
    assert all(p.steps and p.pid != kill["pid"] for p in restarted)
    assert max(p.max_step for p in restarted) > kill["last_step"], "no progress after the restart"
    assert "| 1m | torchrun elastic" in (tmp_path / "out" / "faults.md").read_text()
