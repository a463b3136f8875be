"""A job of ``elan worker``s whose two AMs keep the state — and the rendezvous store — in a real etcd.

Two ``elan am --store etcd://… --min-workers 2 --max-workers 3 --lease-ttl 2`` processes (one leads, one stands by)
and ``elan worker --am A1,A2`` processes running the probe: the rendezvous store is in etcd, so it outlives the AM
processes. SIGKILL the leading AM mid-job: the standby leads within the TTL (+ slack), a third worker started then
joins through it, and the job's result equals the static run within 1e-9 with each sample used once per epoch.
SIGSTOP etcd for 5 s (longer than the TTL) mid-job, then SIGCONT: the workers resume at once, one AM leads again and a
join requested afterwards completes, with the same exact result. Fail-over times are logged.

Limit (measured): the workers do not advance *during* the outage. Each step's commit vote (``CommitVote``) and the
failure keys live in the rendezvous store, here etcd, so a step waits at its vote until etcd answers again (the
store retries for its timeout, 5 min); nothing fails and nothing is redone.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.elastic_runs import (
    EPOCHS,
    PROBE,
    PROBE_ARGS,
    SAMPLES,
    STEPS_PER_EPOCH,
    TOLERANCE,
    RunResult,
    assert_each_sample_once,
    assert_ranks_agree,
    assert_states_close,
    elan_env,
    free_port,
)
from tests.integration.etcd_server import EtcdServer, require_etcd

pytest.importorskip("etcd3gw")
pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

JOB = "standby-job"
TTL_S = 2
SLACK_S = 4.0  # etcd's expiry check, the standby's poll, its state load and bind, a client's resend on 2 busy cores
SLOW = ["--step-sleep", "0.6", "--progress"]


class StandbyCluster:
    """Two ``elan am`` of one job (etcd store, one state dir) and the ``elan worker``s started against them."""

    def __init__(self, tmp: Path, etcd: EtcdServer) -> None:
        self.tmp, self.env, self.store = tmp, elan_env(tmp), etcd.url("job")
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        self.am_list = ",".join(self.addresses)
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"

    @property
    def out(self) -> Path:
        return self.tmp / "out"

    def am(self, index: int) -> subprocess.Popen:
        return self._start(f"am{index}", [
            "am", "--job", JOB, "--bind", f"tcp://{self.addresses[index]}", "--state-dir", str(self.state_dir),
            "--store", self.store, "--lease-ttl", str(TTL_S), "--min-workers", "2", "--max-workers", "3",
            "--start-grace", "0.5", "--coordinate-every", "1",
        ])

    def worker(self, name: str) -> subprocess.Popen:
        return self._start(name, ["worker", "--am", self.am_list, "--job", JOB, "--", sys.executable, str(PROBE),
                                  "--out", str(self.out), *PROBE_ARGS, *SLOW])

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log_file = (self.tmp / f"{name}.log").open("w")
        proc = subprocess.Popen([sys.executable, "-m", "lightning_elan.cli", *args], env=self.env, stdout=log_file,
                                stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def status(self, timeout_s: float = 30.0) -> dict:
        try:
            proc = subprocess.run([sys.executable, "-m", "lightning_elan.cli", "status", "--job", JOB, "--am",
                                   self.am_list, "--json"], env=self.env, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {}
        return json.loads(proc.stdout) if proc.returncode == 0 else {}

    def wait_until(self, predicate: Callable[[], object], what: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"{what} not within {timeout_s} s\n{self.logs()}"
            time.sleep(0.2)

    def leader(self) -> str:
        """The name of the AM process whose log says it serves as the leader (the last one to say so)."""
        serving = {name: (self.tmp / f"{name}.log").read_text().rfind("serving on") for name in ("am0", "am1")}
        return max(serving, key=serving.__getitem__)

    def progress(self) -> dict[str, int]:
        """Each worker's last completed step (``--progress`` files)."""
        steps = {}
        for path in self.out.glob("progress-*.json"):
            try:
                steps[path.stem.removeprefix("progress-")] = json.loads(path.read_text())["step"]
            except (ValueError, KeyError):  # replaced while read
                continue
        return steps

    def adjustments(self) -> list[dict]:
        path = self.state_dir / "adjustments.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def cluster(tmp_path):
    require_etcd()
    with EtcdServer(tmp_path / "etcd") as etcd:
        started = StandbyCluster(tmp_path, etcd)
        started.etcd = etcd
        try:
            yield started
        finally:
            started.stop()


def start_job(cluster: StandbyCluster) -> list[subprocess.Popen]:
    """Both AMs (the first leads), two workers, training under way (each worker completed a step)."""
    cluster.am(0)
    cluster.wait_until(lambda: "serving on" in (cluster.tmp / "am0.log").read_text(), "the first AM leading", 60)
    cluster.am(1)
    cluster.wait_until(lambda: "standing by" in (cluster.tmp / "am1.log").read_text(), "the second AM standing by", 60)
    workers = [cluster.worker("w-a"), cluster.worker("w-b")]
    cluster.wait_until(lambda: len(cluster.progress()) == 2 and min(cluster.progress().values()) >= 1,
                       "training under way")
    return workers


def check_result(cluster: StandbyCluster, workers: list[subprocess.Popen], survivor: str) -> list[dict]:
    """Every worker and the surviving AM exit 0; the run equals the static one; returns the adjustments."""
    codes = [proc.wait(240) for proc in workers]
    assert codes == [0] * len(workers), cluster.logs()
    assert cluster.procs[survivor].wait(60) == 0, cluster.logs()
    return cluster.adjustments()


def check_exact(cluster: StandbyCluster, static_run: RunResult) -> None:
    run = RunResult(cluster.out, cluster.state_dir, 0, cluster.logs())
    records = run.records()
    assert_each_sample_once(records, SAMPLES, EPOCHS)
    assert assert_ranks_agree(records) == EPOCHS * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static_run.final_state(), TOLERANCE)


def test_sigkill_the_leading_am_mid_job_the_standby_leads_and_a_worker_joins(static_run, cluster):
    workers = start_job(cluster)
    assert cluster.leader() == "am0"
    leader = cluster.procs["am0"]
    os.kill(leader.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    leader.wait()
    workers.append(cluster.worker("w-c"))  # enrols through whichever AM answers: only the new leader can
    cluster.wait_until(lambda: cluster.status(timeout_s=10).get("am", {}).get("pid") == cluster.procs["am1"].pid,
                       "the standby answering", 60)
    failover_s = time.monotonic() - killed_at
    log.warning("fail-over: the standby answered `status` %.2f s after the leader's SIGKILL (lease TTL %d s)",
                failover_s, TTL_S)
    (cluster.tmp / "failover.txt").write_text(f"{failover_s:.3f}\n")
    assert failover_s < TTL_S + SLACK_S, cluster.logs()

    adjustments = check_result(cluster, workers, "am1")
    assert [(a["action"], len(a["members"])) for a in adjustments] == [("add", 3)], adjustments
    check_exact(cluster, static_run)


def test_etcd_stopped_for_longer_than_the_ttl_mid_job_then_a_join(static_run, cluster):
    workers = start_job(cluster)
    before = cluster.progress()
    cluster.etcd.pause()
    paused_at = time.monotonic()
    time.sleep(5.0)
    during = cluster.progress()
    cluster.etcd.resume()
    log.warning("etcd stopped 5 s: progress %s before, %s at the end of the outage (steps wait at their commit vote)",
                before, during)
    cluster.wait_until(lambda: min(cluster.progress().values()) > max(during.values()), "training resuming", 60)
    resumed_s = time.monotonic() - paused_at
    cluster.wait_until(lambda: cluster.status(timeout_s=10).get("generation") == 0, "an AM answering", 60)
    answered_s = time.monotonic() - paused_at
    log.warning("after SIGCONT: training resumed %.2f s and an AM answered %.2f s after the outage began",
                resumed_s, answered_s)
    workers.append(cluster.worker("w-c"))
    survivor = "am0" if cluster.procs["am0"].poll() is None else "am1"
    adjustments = check_result(cluster, workers, survivor)
    other = cluster.procs["am1" if survivor == "am0" else "am0"]
    assert other.wait(60) == 0, cluster.logs()  # the standby exits too once the job is over
    assert [(a["action"], len(a["members"])) for a in adjustments] == [("add", 3)], adjustments
    check_exact(cluster, static_run)
