"""Smoke test of the benchmark harness (`python -m bench.run`): tiny model, one adjustment (scale out 2→3).

Runs the copy-floor broadcast, the elan job, its stop-and-restart replay and a one-round overhead comparison (the
last two side by side: their timings are not representative), then checks that every figure the report shows is
present and positive. Every Lightning process costs ~3.5 s of CPU to start on the 2-core CI machine, so torchrun
elastic (8 more processes per adjustment; its etcd-v2 rendezvous also needs a Debian etcd server) is left to the
full benchmark (docs/benchmarks.md) to keep this test under a minute; so is the crash-recovery section (its own
smoke test: test_bench_faults_smoke.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.report import figures

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # a benchmark tool's check: outside the CI tier

REPO = Path(__file__).resolve().parents[2]


def test_bench_smoke_reports_every_figure(tmp_path):
    command = [
        sys.executable, "-m", "bench.run", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"),
        "--device", "cpu", "--models", "tiny", "--cycles", "1", "--actions", "add", "--settle-steps", "3",
        "--warmup-steps", "3",
        "--overhead-model", "tiny", "--overhead-configs", "ddp,10", "--overhead-rounds", "1",
        "--overhead-steps", "45", "--parallel-baselines", "--skip", "torchrun-c10d,torchrun-etcd-v2,faults,goodput",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    results = json.loads((tmp_path / "out" / "results.json").read_text())
    values = figures(results)
    expected = ["elan_pause_s", "elan_gap_s", "copy_floor_s", "joiner_startup_s", "restart_pause_s"]
    for name in expected:
        assert f"cpu/tiny/add/{name}" in values, f"{name} missing from {sorted(values)}"
    for name in ("cpu/tiny/bandwidth_Bps", "cpu/overhead/ddp/steps_per_s", "cpu/overhead/elan/10/steps_per_s"):
        assert name in values, f"{name} missing from {sorted(values)}"
    for name, value in values.items():
        assert value is not None, f"{name} is missing"
        if name.endswith("/elan_pause_s"):
            # gap minus a typical step: can round to 0 for a tiny model; the raw gap must still be positive
            assert value >= 0, f"{name} = {value}"
        else:
            assert value > 0, f"{name} = {value}"

    report = (tmp_path / "out" / "results.md").read_text()
    assert "| model | adjustment | elan pause (s)" in report and "scale out 2→3" in report
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out" / "timeline.png").stat().st_size > 0
