"""A job across hosts (issue 12's multi-host test): network namespaces on a bridge, each its own host name, IPC
namespace and ``/dev/shm`` (``hosts.py``).

The AM (``elan am --min-workers 2``, bound to its host's bridge address, with a shared secret) runs on host 0; an
``elan worker`` on each of hosts 1 and 2 enrols and the job starts with them; a worker started on host 3 joins the
running job and receives its state over the network level (the collective transport, L4 — no shared memory crosses
hosts); the scheduler's SIGTERM to host 1's worker makes it leave. The job ends equal to the static run within 1e-9,
every sample used once per epoch. The training script is the ordinary probe, unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import static_run  # noqa: F401  (the session's static reference run)
from tests.integration.elastic_runs import (
    PROBE,
    PROBE_ARGS,
    RunResult,
    assert_exact,
)
from tests.multihost.conftest import REPO_ROOT, worker_env
from tests.multihost.hosts import FakeHost, FakeHosts

pytestmark = [pytest.mark.multihost, pytest.mark.integration]

JOB, AM_PORT, RDZV_PORT = "multihost", 29400, 29401
SLOW = ["--step-sleep", "0.6"]  # ~16 s of training: room for a joiner's start-up and a leave


def elan(host: FakeHost, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return host.popen([sys.executable, "-m", "lightning_elan.cli", *args], env, cwd=REPO_ROOT, stdout=out,
                          stderr=subprocess.STDOUT)


def adjustments(state_dir: Path) -> list[dict]:
    path = state_dir / "adjustments.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate, what: str, logs: Path, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen in {timeout:.0f} s\n" + "\n".join(
        f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(logs.glob("*.log"))))


def test_job_across_hosts_grows_over_the_network_and_loses_a_host_by_sigterm(
    fake_hosts_available: None, static_run: RunResult, tmp_path: Path  # noqa: F811
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    env = worker_env(ELAN_SECRET_FILE=str(secret), ELAN_HOME=str(tmp_path / "home"), PYTHONWARNINGS="ignore")
    state_dir, out = tmp_path / "state", tmp_path / "out"
    with FakeHosts(4) as hosts:
        am_host = hosts[0]
        am = elan(am_host, ["am", "--job", JOB, "--bind", f"tcp://{am_host.address}:{AM_PORT}", "--state-dir",
                            str(state_dir), "--min-workers", "2", "--max-workers", "3", "--start-grace", "0.5",
                            "--coordinate-every", "1", "--rdzv-port", str(RDZV_PORT)], env, tmp_path / "am.log")
        worker = ["worker", "--am", f"{am_host.address}:{AM_PORT}", "--job", JOB, "--", sys.executable, str(PROBE),
                  "--out", str(out), *PROBE_ARGS, *SLOW]
        first = [elan(host, worker, env, tmp_path / f"worker-{host.hostname}.log") for host in hosts[1:3]]
        wait_for(lambda: list(out.glob("completed-*")), "training", tmp_path)
        joiner = elan(hosts[3], worker, env, tmp_path / f"worker-{hosts[3].hostname}.log")
        (grown,) = wait_for(lambda: adjustments(state_dir), "the join", tmp_path)

        first[0].send_signal(signal.SIGTERM)  # host 1's scheduler stops its worker
        codes = [process.wait(180) for process in [*first, joiner]]
        assert codes == [0, 0, 0], [p.read_text()[-2000:] for p in sorted(tmp_path.glob("*.log"))]
        assert am.wait(60) == 0, (tmp_path / "am.log").read_text()[-3000:]

    assert grown["action"] == "add" and len(grown["members"]) == 3
    (transfer,) = grown["transfers"]
    assert (transfer["level"], transfer["transport"]) == (4, "collective"), transfer  # the network level
    assert grown["received"][transfer["joiner"]]["route"] == "collective"
    run = RunResult(out, state_dir, 0, "")
    records = assert_exact(run, static_run)
    shrunk = adjustments(state_dir)[1]
    assert len(shrunk["members"]) == 2 and len(shrunk["leavers"]) == 1
    assert sorted(r["worker"] for r in records if r["left"]) == shrunk["leavers"]
