"""Smoke test of the Accelerate benchmark (`python -m bench.accelerate`): tiny model, one cycle of scale out, scale
in and migrate of an ``ElasticAccelerator`` job, its stop-and-restart replay by a plain ``Accelerator``, one overhead
round against a plain ``Accelerator``; checks that
every adjustment was measured, that the step files show the world sizes the schedule asked for, and the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.analysis import load_steps

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # a benchmark tool's check: outside the CI tier
pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[2]


def test_bench_accelerate_smoke(tmp_path):
    command = [
        sys.executable, "-m", "bench.accelerate", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"),
        "--models", "tiny", "--cycles", "1", "--settle-steps", "3", "--warmup-steps", "3", "--no-with-lightning",
        "--overhead-model", "tiny", "--overhead-configs", "ddp,10", "--overhead-rounds", "1", "--overhead-steps", "45",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["failures"] == []
    adjustments = results["models"]["tiny"]["accelerate"]["adjustments"]
    assert [a["action"] for a in adjustments] == ["add", "remove", "migrate"]
    for adjustment in adjustments:
        assert adjustment["pause"]["gap_s"] > 0 and adjustment["pause"]["pause_s"] >= 0, adjustment
    assert all(a["joiner_startup_s"] and min(a["joiner_startup_s"]) > 0 for a in adjustments if a["action"] != "remove")

    worlds = _world_after_each(tmp_path / "work" / "tiny" / "accelerate-1" / "steps", [a["step"] for a in adjustments])
    assert worlds == [3, 2, 2], worlds
    restart = results["models"]["tiny"]["restart"]["adjustments"]
    assert [a["action"] for a in restart] == ["add", "remove", "migrate"]
    assert all(a["pause"]["pause_s"] > 0 for a in restart), restart  # a plain Accelerator relaunched and resumed
    rates = {run["config"]: run["steps_per_s"] for run in results["overhead"]["runs"]}
    assert set(rates) == {"ddp", "elan/10"} and min(rates.values()) > 0, rates

    report = (tmp_path / "out" / "results.md").read_text()
    assert "| tiny | scale out 2→3 |" in report and "plain `Accelerator` (DDP)" in report


def _world_after_each(steps_dir: Path, steps: list[int]) -> list[int]:
    """The world size the step files record for the first step after each adjustment."""
    records = [record for process in load_steps(steps_dir) for record in process.steps]
    return [next(r.world for r in sorted(records, key=lambda r: r.step) if r.step > step) for step in steps]
