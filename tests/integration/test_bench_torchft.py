"""Smoke test of the torchft side-by-side benchmark (`python -m bench.torchft_peer`): tiny model, one trial.

A torchft 0.2.0 lighthouse and two replica groups on 127.0.0.1; a third group joins, leaves with SIGTERM, rejoins and
is SIGKILLed. Checks that every adjustment has a measured, finite, non-negative pause with a positive gap, that the
joiners' time to first step and the kill's recovery time are positive, and that the sample accounting saw the
batches the workers drew (and the rejoined slot's duplicates). Skipped when torchft is not installed. ≈ 40 s.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # a benchmark tool's check: outside the CI tier

REPO = Path(__file__).resolve().parents[2]


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_worker_model_and_data_are_the_benchmarks():
    from bench import torchft_train, workload
    from bench.sizes import MODEL_SIZES

    for size in ("tiny", "1m"):
        ours = [tuple(p.shape) for p in torchft_train.build_mlp(MODEL_SIZES[size]).parameters()]
        theirs = [tuple(p.shape) for p in workload.build_mlp(MODEL_SIZES[size]).parameters()]
        assert ours == theirs
    indexed, plain = torchft_train.IndexedRepeatedDataset(100), workload.RepeatedDataset(100)
    for index in (0, 7, 99):
        x, y, i = indexed[index]
        assert i == index and bool((x == plain[index][0]).all()) and int(y) == int(plain[index][1])


def test_torchft_join_leave_kill_are_measured(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "bench.torchft_peer", "--models", "tiny", "--trials", "1", "--warmup-steps",
               "5", "--settle-steps", "5", "--timeout-s", "60", "--out", str(out), "--work-dir", str(tmp_path / "w")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    results = json.loads((out / "results.json").read_text())
    [trial] = results["models"]["tiny"]["trials"]
    assert "error" not in trial, trial
    adjustments = {a["action"]: a for a in trial["adjustments"]}
    assert list(adjustments) == ["add", "remove", "rejoin", "kill"]
    for action, adjustment in adjustments.items():
        pause = adjustment["pause"]
        assert pause is not None, f"{action}: no pause measured"
        assert _finite(pause["pause_s"]) and pause["pause_s"] >= 0, (action, pause)
        assert _finite(pause["gap_s"]) and pause["gap_s"] > 0, (action, pause)
        assert pause["gap_s"] >= pause["pause_s"]
    for action in ("add", "rejoin"):
        startup = adjustments[action]["joiner_startup_s"]
        assert _finite(startup) and startup > 0, (action, startup)
        assert adjustments[action]["joiner_first_own_gradient_s"] >= startup
    recovery = adjustments["kill"]["recovery"]
    assert _finite(recovery["recovery_s"]) and recovery["recovery_s"] > 0, recovery

    samples = trial["samples"]
    epochs = samples["epochs"].values()  # the tiny model is fast: the stayers may pass the end of an epoch
    assert samples["batches_drawn"] > 0
    uses = sum(epoch["uses"] for epoch in epochs)
    assert uses == samples["uses_by_role"]["stayer"] + samples["uses_by_role"].get("joiner", 0)
    for epoch in epochs:
        assert epoch["used_once"] + epoch["duplicated"] == epoch["distinct_used"]
    assert sum(epoch["used_once"] for epoch in epochs) > 0
    # the rejoined group restarts its sampler slot from the top: the first joiner's samples come round again
    assert samples["epochs"]["0"]["duplicated"] > 0
    # its healing step contributes no gradient: at least the joiners' first batches were drawn and never used
    assert sum(epoch["drawn_never_used"] for epoch in epochs) > 0
    assert "| tiny | scale out 2→3 (join) |" in (out / "results.md").read_text()
