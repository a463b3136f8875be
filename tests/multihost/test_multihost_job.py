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

from lightning_elan.elastic.worker import DECLARED_DEAD_EXIT
from tests.integration.conftest import static_run  # noqa: F401  (the session's static reference run)
from tests.integration.elastic_runs import (
    EPOCHS,
    PROBE,
    PROBE_ARGS,
    STEPS_PER_EPOCH,
    TOLERANCE,
    RunResult,
    assert_exact,
    assert_ranks_agree,
    assert_states_close,
)
from tests.integration.worker_faults import assert_completed_once
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


def start_three_hosts(hosts: FakeHosts, tmp_path: Path) -> tuple[subprocess.Popen, list[subprocess.Popen], Path, Path]:
    """The AM on host 0 (`--heartbeat-timeout 15`) and one `elan worker` of the probe on each of hosts 1–3, enrolled
    in that order (host 3's is w2), training under way (each past step 3); returns the AM, the workers, the state
    directory and the probe's output directory."""
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    env = worker_env(ELAN_SECRET_FILE=str(secret), ELAN_HOME=str(tmp_path / "home"), PYTHONWARNINGS="ignore")
    state_dir, out = tmp_path / "state", tmp_path / "out"
    am_host = hosts[0]
    am = elan(am_host, ["am", "--job", JOB, "--bind", f"tcp://{am_host.address}:{AM_PORT}", "--state-dir",
                        str(state_dir), "--min-workers", "2", "--max-workers", "3", "--start-grace", "60",
                        "--coordinate-every", "1", "--rdzv-port", str(RDZV_PORT), "--heartbeat-timeout", "15"],
              env, tmp_path / "am.log")
    worker = ["worker", "--am", f"{am_host.address}:{AM_PORT}", "--job", JOB, "--", sys.executable, str(PROBE),
              "--out", str(out), *PROBE_ARGS, *SLOW, "--global-batch", "12", "--progress"]
    workers = []
    for host in hosts[1:4]:  # one after the other: host 3's worker is w2
        log = tmp_path / f"worker-{host.hostname}.log"
        workers.append(elan(host, worker, env, log))
        wait_for(lambda log=log: "enrolled in job" in log.read_text(), "the enrolment", tmp_path)
    wait_for(lambda: len(progress(out)) == 3 and min(progress(out).values()) >= 3, "training", tmp_path)
    return am, workers, state_dir, out


def test_a_host_cut_off_the_network_is_lost_and_the_others_recover_without_waiting_out_their_timeout(
    fake_hosts_available: None, static_run: RunResult, tmp_path: Path  # noqa: F811
) -> None:
    """Three hosts train, each with one `elan worker`; host 3's link to the bridge goes down after step 3 (a cable
    pulled, a switch port lost: its packets vanish, nothing resets a connection, its processes run on). The AM no
    longer hears host 3's `elan worker`; after `--heartbeat-timeout 15` it takes w2 for lost and announces the failure
    in the rendezvous store; the two others recover at once and end exact (the collective timeout is the default
    300 s: before, they waited that long). The link comes back: host 3's command learns it was declared dead and
    ends with one line (exit 1; before, a RuntimeError traceback), or its `elan worker` learns it first and kills it
    (137)."""
    with FakeHosts(4) as hosts:
        am, workers, state_dir, out = start_three_hosts(hosts, tmp_path)
        subprocess.run(["ip", "link", "set", hosts[3].veth, "down"], check=True)
        cut = time.monotonic()
        (failure,) = wait_for(lambda: adjustments(state_dir), "the recovery", tmp_path)
        recovered_s = time.monotonic() - cut
        subprocess.run(["ip", "link", "set", hosts[3].veth, "up"], check=True)
        codes = [process.wait(180) for process in workers]
        logs = [p.read_text()[-2000:] for p in sorted(tmp_path.glob("*.log"))]
        assert codes[:2] == [0, 0] and codes[2] in (DECLARED_DEAD_EXIT, 128 + signal.SIGKILL), logs
        assert "Traceback" not in (tmp_path / f"worker-{hosts[3].hostname}.log").read_text(), logs
        assert am.wait(60) == 0, (tmp_path / "am.log").read_text()[-3000:]

    assert recovered_s < 60, (tmp_path / "am.log").read_text()[-3000:]  # the 15 s heartbeat, not the 300 s timeout
    assert (failure["action"], failure["failure"]["dead"]) == ("failure", ["w2"]), failure
    assert "no word from the `elan worker` of w2" in (tmp_path / "am.log").read_text()
    assert_completed_once(out)
    run = RunResult(out, state_dir, 0, "")
    assert assert_ranks_agree(run.records()) == EPOCHS * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static_run.final_state(), TOLERANCE)


def test_the_ams_host_cut_off_longer_than_the_heartbeat_timeout_loses_nobody(
    fake_hosts_available: None, static_run: RunResult, tmp_path: Path  # noqa: F811
) -> None:
    """The AM's host (host 0: the AM and the rendezvous store) is cut off for 20 s, longer than `--heartbeat-timeout
    10`: every `elan worker` falls silent at once. The AM declares nobody lost (that is its own network's fault, not
    three hosts failing together: it warns), the members wait for it at their next coordination point, and the job
    ends as the static run, with no adjustment."""
    with FakeHosts(4) as hosts:
        am, workers, state_dir, out = start_three_hosts(hosts, tmp_path)
        subprocess.run(["ip", "link", "set", hosts[0].veth, "down"], check=True)
        time.sleep(20)
        subprocess.run(["ip", "link", "set", hosts[0].veth, "up"], check=True)
        codes = [process.wait(180) for process in workers]
        assert codes == [0, 0, 0], [p.read_text()[-2000:] for p in sorted(tmp_path.glob("*.log"))]
        assert am.wait(60) == 0, (tmp_path / "am.log").read_text()[-3000:]

    am_log = (tmp_path / "am.log").read_text()
    assert "no word from any `elan worker`" in am_log and "declared dead" not in am_log, am_log[-3000:]
    assert adjustments(state_dir) == []
    run = RunResult(out, state_dir, 0, "")
    assert_exact(run, static_run)


def progress(out: Path) -> dict[str, int]:
    """Each worker's last completed step (the probe's ``--progress`` files)."""
    steps = {}
    for path in out.glob("progress-*.json"):
        try:
            steps[path.stem] = json.loads(path.read_text())["step"]
        except (ValueError, KeyError):  # replaced while read
            continue
    return steps
