"""A job of ``elan worker``s whose two AMs keep the state — and the rendezvous store — in a real etcd.

Two ``elan am --store etcd://… --min-workers 2 --max-workers 3 --lease-ttl 2`` processes (one leads, one stands by)
and ``elan worker --am A1,A2`` processes running the probe: the rendezvous store is in etcd, so it outlives the AM
processes. SIGKILL the leading AM mid-job: the standby leads within the TTL (+ slack), a third worker started then
joins through it, and the job's result equals the static run within 1e-9 with each sample used once per epoch.
SIGSTOP etcd for 5 s (longer than the TTL) mid-job, then SIGCONT: every worker goes on training *during* the outage
(each step's commit vote is in the generation's fast store, a ``TCPStore`` served by its rank 0, not in etcd), one AM
leads again and a join requested afterwards completes, with the same exact result. Fail-over times are logged.
SIGSTOP etcd as the training loop starts: the first batch boundary's write to the job store (rank 0's notice of the
state size a joiner receives) waits off the training thread, and the first steps go on during the outage.
SIGKILL the training process of rank 0 (the vote store's host) between its all-reduce and its vote (the survivors,
waiting for the decision, lose the store: uncertain, the recovery discards the step), or right after its commit (every
member read the decision before rank 0 could apply it: the step stands); the job ends exact. (A death in the backward
pass is the same as in any job: tests/integration/test_worker_faults.py.)
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

from lightning_elan.elastic.etcd_rendezvous import open_rendezvous_store
from lightning_elan.elastic.worker import DECLARED_DEAD_EXIT, LOOP_STARTED_KEY
from tests.integration.elastic_runs import (
    EPOCHS,
    PROBE,
    PROBE_ARGS,
    SAMPLES,
    STEPS_PER_EPOCH,
    TOLERANCE,
    RunResult,
    assert_counted_once,
    assert_each_sample_once,
    assert_ranks_agree,
    assert_states_close,
    elan_env,
    free_port,
)
from tests.integration.etcd_server import EtcdServer, require_etcd
from tests.integration.worker_faults import assert_completed_once, completed_per_epoch

pytest.importorskip("etcd3gw")
pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

JOB = "standby-job"
TTL_S = 2
SLACK_S = 4.0  # etcd's expiry check, the standby's poll, its state load and bind, a client's resend on 2 busy cores
SLOW = ["--step-sleep", "0.6", "--progress"]
GATE_STEP = 18  # past the steps a 5 s outage lets the job train (0.6 s a step), 9 before its end
GATE_OPEN = "gate-open"  # probe_train.GATE_OPEN
GATED = ["--gate-at", str(GATE_STEP), "--wait-for-joiners"]
"""A join requested mid-job cannot be overtaken by the job's end (a joiner's start-up on 2 busy cores outlasted the
steps left once): rank 0 holds at step GATE_STEP until the test saw the AM list the join
(:func:`open_gate_once_queued`), then until its joiner is ready."""


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

    def am(self, index: int, start_grace: float = 0.5, *extra: str) -> subprocess.Popen:
        return self._start(f"am{index}", [
            "am", "--job", JOB, "--bind", f"tcp://{self.addresses[index]}", "--state-dir", str(self.state_dir),
            "--store", self.store, "--lease-ttl", str(TTL_S), "--min-workers", "2", "--max-workers", "3",
            "--start-grace", str(start_grace), "--coordinate-every", "1", *extra,
        ])

    def worker(self, name: str, *extra: str) -> subprocess.Popen:
        return self._start(name, ["worker", "--am", self.am_list, "--job", JOB, "--", sys.executable, str(PROBE),
                                  "--out", str(self.out), *PROBE_ARGS, *SLOW, *extra])

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


def start_job(cluster: StandbyCluster, *extra: str, until_training: bool = True) -> list[subprocess.Popen]:
    """Both AMs (the first leads), two workers (the probe's ``extra`` flags), training under way (each worker completed
    a step) unless ``until_training`` is False."""
    cluster.am(0)
    cluster.wait_until(lambda: "serving on" in (cluster.tmp / "am0.log").read_text(), "the first AM leading", 60)
    cluster.am(1)
    cluster.wait_until(lambda: "standing by" in (cluster.tmp / "am1.log").read_text(), "the second AM standing by", 60)
    workers = [cluster.worker("w-a", *extra), cluster.worker("w-b", *extra)]
    if until_training:
        cluster.wait_until(lambda: len(cluster.progress()) == 2 and min(cluster.progress().values()) >= 1,
                           "training under way")
    return workers


def open_gate_once_queued(cluster: StandbyCluster) -> None:
    """Let rank 0 past GATE_STEP once an AM lists the join request (``--wait-for-joiners`` then holds it until the
    joiner is ready)."""
    cluster.wait_until(lambda: cluster.status(timeout_s=10).get("pending"), "the join request queued", 60)
    (cluster.out / GATE_OPEN).touch()


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
    workers = start_job(cluster, *GATED)
    assert cluster.leader() == "am0"
    leader = cluster.procs["am0"]
    os.kill(leader.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    leader.wait()
    workers.append(cluster.worker("w-c", *GATED))  # enrols through whichever AM answers: only the new leader can
    cluster.wait_until(lambda: cluster.status(timeout_s=10).get("am", {}).get("pid") == cluster.procs["am1"].pid,
                       "the standby answering", 60)
    failover_s = time.monotonic() - killed_at
    log.warning("fail-over: the standby answered `status` %.2f s after the leader's SIGKILL (lease TTL %d s)",
                failover_s, TTL_S)
    (cluster.tmp / "failover.txt").write_text(f"{failover_s:.3f}\n")
    assert failover_s < TTL_S + SLACK_S, cluster.logs()
    open_gate_once_queued(cluster)

    adjustments = check_result(cluster, workers, "am1")
    assert [(a["action"], len(a["members"])) for a in adjustments] == [("add", 3)], adjustments
    check_exact(cluster, static_run)


def test_etcd_stopped_as_training_starts_the_first_steps_go_on(static_run, cluster):
    """The outage covers the first batch boundary, where rank 0 tells joiners the size of the state they will receive
    (a write to the job's store, in etcd): the write waits for etcd off the training thread, the steps go on."""
    start_job(cluster, until_training=False)
    loop_started = open_rendezvous_store(f"{cluster.store}?job={JOB}")
    try:
        cluster.wait_until(lambda: loop_started.check([LOOP_STARTED_KEY]), "a member in its training loop")
    finally:
        loop_started.close()
    cluster.etcd.pause()
    time.sleep(5.0)
    during = cluster.progress()
    cluster.etcd.resume()
    log.warning("etcd stopped 5 s from the start of the training loop: each worker's last step %s", during)
    assert sorted(during) == ["w0", "w1"] and min(during.values()) >= 2, (during, cluster.logs())
    survivor = "am0" if cluster.procs["am0"].poll() is None else "am1"
    assert check_result(cluster, [cluster.procs["w-a"], cluster.procs["w-b"]], survivor) == []
    check_exact(cluster, static_run)


def test_etcd_stopped_for_longer_than_the_ttl_mid_job_then_a_join(static_run, cluster):
    workers = start_job(cluster, *GATED)
    before = cluster.progress()
    cluster.etcd.pause()
    paused_at = time.monotonic()
    time.sleep(5.0)
    during = cluster.progress()
    cluster.etcd.resume()
    log.warning("etcd stopped 5 s: progress %s before, %s at the end of the outage", before, during)
    assert all(during.get(worker, 0) > step for worker, step in before.items()), (before, during, cluster.logs())
    cluster.wait_until(lambda: min(cluster.progress().values()) > max(during.values()), "training resuming", 60)
    resumed_s = time.monotonic() - paused_at
    cluster.wait_until(lambda: cluster.status(timeout_s=10).get("generation") == 0, "an AM answering", 60)
    answered_s = time.monotonic() - paused_at
    log.warning("after SIGCONT: training resumed %.2f s and an AM answered %.2f s after the outage began",
                resumed_s, answered_s)
    workers.append(cluster.worker("w-c", *GATED))
    open_gate_once_queued(cluster)
    survivor = "am0" if cluster.procs["am0"].poll() is None else "am1"
    adjustments = check_result(cluster, workers, survivor)
    other = cluster.procs["am1" if survivor == "am0" else "am0"]
    assert other.wait(60) == 0, cluster.logs()  # the standby exits too once the job is over
    assert [(a["action"], len(a["members"])) for a in adjustments] == [("add", 3)], adjustments
    check_exact(cluster, static_run)


@pytest.mark.parametrize("phase", ["vote", "optimizer"], ids=["rank-0-before-its-vote", "rank-0-after-its-commit"])
def test_sigkill_rank_0_the_fast_store_host_survivors_recover_exactly(static_run, cluster, phase):
    cluster.am(0, start_grace=10.0)  # the three workers form generation 0 together: w0 (enrolled first) is rank 0
    cluster.wait_until(lambda: "serving on" in (cluster.tmp / "am0.log").read_text(), "the AM leading", 60)
    kill = ["--kill-at", f"w0:5:{phase}", "--global-batch", "12"]  # 12 over 3 workers, then 2: the static run's
    workers = {}
    for name in ("w-a", "w-b", "w-c"):
        workers[name] = cluster.worker(name, *kill)
        time.sleep(0.5)  # enrolment order: w-a is w0
    codes = {name: proc.wait(240) for name, proc in workers.items()}
    assert codes["w-a"] != 0 and codes["w-b"] == codes["w-c"] == 0, (codes, cluster.logs())
    assert cluster.procs["am0"].wait(60) == 0, cluster.logs()
    adjustments = cluster.adjustments()
    assert [(a["action"], len(a["members"])) for a in adjustments] == [("failure", 2)], adjustments
    failure = adjustments[0]
    assert failure["failure"]["dead"] == ["w0"], failure
    assert failure["failure"]["step_redone"] == (7 if phase == "optimizer" else 6), failure
    if phase == "vote":  # the survivors voted and lost the vote's store: uncertain, the recovery discards the step
        for name in ("w-b", "w-c"):
            assert "lost the commit vote of step 6" in (cluster.tmp / f"{name}.log").read_text(), cluster.logs()
    run = RunResult(cluster.out, cluster.state_dir, 0, cluster.logs())
    assert_completed_once(cluster.out)
    assert assert_ranks_agree(run.records()) == EPOCHS * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static_run.final_state(), TOLERANCE)
    log.warning("rank 0 killed (%s): survivors recovered in %.2f s", phase,
                failure["failure"]["recovered_at"] - failure["failure"]["detected_at"])


def test_rank_0_killed_while_a_member_has_not_read_the_decision_that_member_applies_it(static_run, cluster):
    """w1 votes last on step 6 (it sleeps after its all-reduce); w2 voted and is SIGSTOPped before it reads the
    decision; w1 decides commit and applies; rank 0 (w0, the vote store's host) waits for w2 to read, and is
    SIGKILLed there; w2 resumes, finds the store gone, checks in uncertain — and applies step 6, which w1 applied."""
    cluster.am(0, start_grace=10.0)
    cluster.wait_until(lambda: "serving on" in (cluster.tmp / "am0.log").read_text(), "the AM leading", 60)
    late = ["--late-vote", "w1:5:4", "--global-batch", "12"]
    workers = {}
    for name in ("w-a", "w-b", "w-c"):
        workers[name] = cluster.worker(name, *late)
        time.sleep(0.5)  # enrolment order: w-a is w0 (rank 0), w-b is w1, w-c is w2
    cluster.wait_until(lambda: (cluster.out / "late-vote-w1").exists(), "w1 at its late vote", 120)
    time.sleep(1.0)  # w0 and w2 have voted and wait for the decision
    pids = {worker: json.loads((cluster.out / f"progress-{worker}.json").read_text())["pid"] for worker in ("w0", "w2")}
    os.kill(pids["w2"], signal.SIGSTOP)
    try:
        time.sleep(4.5)  # w1 voted last: commit; it applied step 6; w0 waits for w2 to read the decision
        os.kill(pids["w0"], signal.SIGKILL)
        time.sleep(1.0)
    finally:
        os.kill(pids["w2"], signal.SIGCONT)
    codes = {name: proc.wait(240) for name, proc in workers.items()}
    assert codes["w-a"] != 0 and codes["w-b"] == codes["w-c"] == 0, (codes, cluster.logs())
    assert cluster.procs["am0"].wait(60) == 0, cluster.logs()
    (failure,) = cluster.adjustments()
    assert failure["action"] == "failure" and failure["failure"]["dead"] == ["w0"], failure
    assert failure["failure"]["step_redone"] == 7, failure  # step 6 stands: w1 applied it, w2 too
    w2_log = (cluster.tmp / "w-c.log").read_text()
    assert "lost the commit vote of step 6" in w2_log and "applies step 6" in w2_log, cluster.logs()
    # w0 died inside the vote, before logging its share of step 6; the step committed, so its share counts: the
    # global batch of that step (the static run's, the same serial position) less what w1 and w2 logged
    survivors_share = logged_at_step(cluster.out, 6)
    dead_share = logged_at_step(static_run.out, 6) - survivors_share
    assert len(survivors_share) == 8 and len(dead_share) == 4, (survivors_share, dead_share)
    per_epoch = completed_per_epoch(cluster.out)
    per_epoch[0].update(dead_share)
    assert_counted_once(per_epoch, SAMPLES, EPOCHS)
    run = RunResult(cluster.out, cluster.state_dir, 0, cluster.logs())
    assert assert_ranks_agree(run.records()) == EPOCHS * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static_run.final_state(), TOLERANCE)


def logged_at_step(out: Path, step: int) -> set[int]:
    """The samples every worker logged as completed in epoch 0 when ``step`` optimizer steps were done."""
    indices: set[int] = set()
    for path in out.glob("completed-*.jsonl"):
        for entry in map(json.loads, path.read_text().splitlines()):
            if entry["epoch"] == 0 and entry["step"] == step:
                indices.update(entry["indices"])
    return indices


def test_a_paused_host_is_lost_its_failure_announced_in_etcd_and_the_others_recover(static_run, cluster):
    """w2's whole host stops after step 3 (SIGSTOP to its `elan worker` and its command: a paused VM; nothing exits,
    no connection resets; the collective timeout is the default 300 s). The leading AM, no longer polled by that
    `elan worker`, takes w2 for lost after `--heartbeat-timeout 15` and sets the failure key in the job's
    rendezvous store in etcd; w0 and w1 recover without it and end exact. When the host resumes, its command learns
    it was declared dead and ends (exit 1, one line), or its `elan worker` learns it first and kills it (137).
    Before: the survivors waited out the 300 s."""
    cluster.am(0, 10.0, "--heartbeat-timeout", "15")  # all three form generation 0: w-c (enrolled last) is w2
    cluster.wait_until(lambda: "serving on" in (cluster.tmp / "am0.log").read_text(), "the AM leading", 60)
    workers = {}
    for name in ("w-a", "w-b", "w-c"):
        workers[name] = cluster.worker(name, "--global-batch", "12")
        time.sleep(0.5)  # enrolment order: w-c is w2
    cluster.wait_until(lambda: len(cluster.progress()) == 3 and min(cluster.progress().values()) >= 3,
                       "three workers past step 3")
    host = [workers["w-c"].pid, *children_of(workers["w-c"].pid)]
    for pid in host:
        os.kill(pid, signal.SIGSTOP)
    paused = time.monotonic()
    cluster.wait_until(cluster.adjustments, "the recovery", 120)
    recovered_s = time.monotonic() - paused
    for pid in host:
        os.kill(pid, signal.SIGCONT)
    codes = {name: proc.wait(240) for name, proc in workers.items()}

    assert codes["w-a"] == codes["w-b"] == 0 and codes["w-c"] in (DECLARED_DEAD_EXIT, 128 + signal.SIGKILL), (
        codes, cluster.logs())
    assert "Traceback" not in (cluster.tmp / "w-c.log").read_text(), cluster.logs()
    assert cluster.procs["am0"].wait(60) == 0, cluster.logs()
    assert recovered_s < 60, cluster.logs()  # the 15 s heartbeat timeout, not the 300 s collective timeout
    (failure,) = cluster.adjustments()
    assert (failure["action"], failure["failure"]["dead"]) == ("failure", ["w2"]), failure
    assert "no word from the `elan worker` of w2" in (cluster.tmp / "am0.log").read_text(), cluster.logs()
    run = RunResult(cluster.out, cluster.state_dir, 0, cluster.logs())
    assert_completed_once(cluster.out)
    assert assert_ranks_agree(run.records()) == EPOCHS * STEPS_PER_EPOCH
    assert_states_close(run.final_state(), static_run.final_state(), TOLERANCE)
    log.warning("a paused host: the others recovered %.1f s after the pause", recovered_s)


def children_of(pid: int) -> list[int]:
    """The processes ``pid`` started (its command, and their DataLoader processes, if any), depth first."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        found += [int(child), *children_of(int(child))]
    return found
