"""The plain-SSH recipe (``deploy/ssh/elan-ssh.sh``) runs a job: the AM here, one `elan worker` per host of the host
file, and a worker started later by the recipe's grow line joins. Every host is this machine and ``ssh`` is replaced
by a local shell (``SSH`` setting of the script; no ssh server here): what runs is the script's own command lines.
The job ends equal to the static run within 1e-9, every sample once per epoch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.elastic_runs import (
    PROBE,
    PROBE_ARGS,
    RunResult,
    assert_exact,
    elan_env,
    free_port,
)

# alone under -n (its joiner must join within 120 s); outside the CI tier: the Slurm recipe keeps a join started
# by a scheduler there
pytestmark = [pytest.mark.integration, pytest.mark.solo, pytest.mark.extended]

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "ssh" / "elan-ssh.sh"
PACED = ["--step-sleep", "0.6", "--wait-for-joiners"]  # rank 0 holds once the join is queued until it is ready: the
# job cannot end before a slow joiner's start-up


def test_ssh_recipe_starts_a_job_that_a_later_worker_joins(static_run, tmp_path):
    local_ssh = tmp_path / "local-ssh"
    local_ssh.write_text('#!/bin/sh\nshift\nexec sh -c "$1"\n')  # `ssh HOST CMD` → CMD here
    local_ssh.chmod(0o755)
    (tmp_path / "hosts").write_text("# two workers\nnode-a\nnode-b\n")
    am_port, secret = free_port(), tmp_path / "secret"
    env = {**elan_env(tmp_path), "ELAN_AM_HOST": "127.0.0.1", "ELAN_AM_PORT": str(am_port),
           "ELAN_RDZV_PORT": str(free_port()), "ELAN_SECRET_FILE": str(secret), "MIN_WORKERS": "2",
           "MAX_WORKERS": "3", "SSH": str(local_ssh)}
    out, log = tmp_path / "out", (tmp_path / "recipe.log").open("w")
    command = [str(SCRIPT), str(tmp_path / "hosts"), "sshjob", "--", sys.executable, str(PROBE), "--out", str(out),
               *PROBE_ARGS, *PACED]
    recipe = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("completed-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        grow = [sys.executable, "-m", "lightning_elan.cli", "worker", "--am", f"127.0.0.1:{am_port}", "--job",
                "sshjob", "--secret-file", str(secret), "--", sys.executable, str(PROBE), "--out", str(out),
                *PROBE_ARGS, *PACED]  # the recipe's grow line, run on "node-c"
        joiner = subprocess.Popen(grow, env=env, stdout=log, stderr=subprocess.STDOUT)
        assert joiner.wait(180) == 0 and recipe.wait(180) == 0, (tmp_path / "recipe.log").read_text()[-4000:]
    finally:
        for proc in (recipe, *([joiner] if "joiner" in locals() else [])):
            if proc.poll() is None:
                proc.kill()
    assert secret.stat().st_mode & 0o077 == 0, "the secret the recipe created is private"
    state_dir = Path(env["ELAN_HOME"]) / "jobs" / "sshjob"
    adjustments = [json.loads(line) for line in (state_dir / "adjustments.jsonl").read_text().splitlines()]
    assert [(a["action"], len(a["members"])) for a in adjustments] == [("add", 3)]
    run = RunResult(out, state_dir, 0, "")
    assert_exact(run, static_run)
