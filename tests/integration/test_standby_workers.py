"""`elan run --standby 1`: a worker started and warmed up before anyone asks for it.

A user's flow with real processes: the job trains with 2 workers and keeps one standby (w2) ready; `elan scale add
1` takes it — no process start in the way — and the launcher starts a new standby (w3) to refill the pool. The run
equals the static run within 1e-9, every sample once per epoch; at the end the standby left is released and the job
exits 0. The time from the request to the joiner's first step is logged (the figures are in docs/benchmarks.md).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.integration.elastic_runs import (
    PROBE_ARGS,
    RunResult,
    assert_exact,
    elan_cli,
    wait_for_status,
)

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)


def test_an_add_takes_the_warm_standby_and_the_pool_refills(static_run, live_job, tmp_path):
    job, env = live_job("pool", 2, [*PROBE_ARGS, "--step-sleep", "0.5"], launcher_args=("--standby", "1"))
    ready = wait_for_status(env, "pool", lambda s: s["standby"] and s["standby"]["workers"]
                            and s["standby"]["workers"][0]["status"] == "ready" and (s["step"] or 0) >= 1)
    assert [m["worker_id"] for m in ready["members"]] == ["w0", "w1"]
    assert ready["standby"]["workers"][0]["worker_id"] == "w2"
    assert "standby: 1 of 1 ready (w2 ready)" in elan_cli(env, "status", "--job", "pool")

    elan_cli(env, "scale", "--job", "pool", "add", "1")
    grown = wait_for_status(env, "pool", lambda s: s["generation"] == 1 and s["last_adjustment"])
    assert [m["worker_id"] for m in grown["members"]] == ["w0", "w1", "w2"]
    refilled = wait_for_status(env, "pool", lambda s: s["standby"]["workers"]
                               and s["standby"]["workers"][0]["status"] == "ready")
    assert [w["worker_id"] for w in refilled["standby"]["workers"]] == ["w3"]

    output = job.communicate(timeout=600)[0]
    assert job.returncode == 0, output[-4000:]
    run = RunResult(tmp_path / "pool", tmp_path / "pool-state", 0, output)
    assert_exact(run, static_run)
    (added,) = run.adjustments()
    assert added["joiners"] == ["w2"] and added["action"] == "add"
    records = {r["worker"]: r for r in map(json.loads, map(Path.read_text, run.out.glob("record-*.json")))}
    assert sorted(records) == ["w0", "w1", "w2", "w3"]
    released = records["w3"]  # the standby left at the end: fit returned without training, like a cancelled joiner
    assert released["left"] and released["global_step"] == 0 and not any(released["consumed"].values())
    log.warning("standby w2: %.2f s from `elan scale add 1` to the end of the adjustment (pause %s)",
                added["completed_at"] - added["requested_at"], added["pause_s"])
