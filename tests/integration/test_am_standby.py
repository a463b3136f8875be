"""Two real ``elan am --store etcd://…`` processes for one job against a real etcd: one leads, the other stands by.
SIGKILL the leader: the standby leads within the lease TTL (+ slack) and answers a client that lists both addresses,
with the state intact. etcd paused for 5 s and for longer than the TTL: the AM resumes, nothing is lost."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_elan.master.etcd_store import parse_etcd_url
from lightning_elan.master.leadership import current_leader
from lightning_elan.protocol.client import AMClient
from lightning_elan.protocol.contract import RegisterRequest
from tests.integration.etcd_server import EtcdServer, free_port, require_etcd

pytest.importorskip("etcd3gw")
pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

JOB = "standby"
TTL_S = 3
SLACK_S = 3.0  # etcd's expiry check (500 ms), the standby's poll, its state load and bind


@pytest.fixture
def etcd(tmp_path):
    require_etcd()
    with EtcdServer(tmp_path / "etcd") as server:
        yield server


class AMProcess:
    """One ``elan am`` process with its log; SIGKILLed by the test or SIGTERMed at the end."""

    def __init__(self, tmp: Path, name: str, store: str, ttl_s: float) -> None:
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{name}.log"
        env = {**os.environ, "ELAN_HOME": str(tmp / f"home-{name}"), "PYTHONWARNINGS": "ignore"}
        command = [sys.executable, "-m", "lightning_elan.cli", "am", "--job", JOB, "--bind", self.address,
                   "--store", store, "--lease-ttl", str(ttl_s), "--state-dir", str(tmp / f"state-{name}")]
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            assert self.proc.poll() is None, f"elan am exited with {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"no {text!r} in the log:\n{self.log()}"
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


@pytest.fixture
def ams(tmp_path):
    started: list[AMProcess] = []

    def start(name: str, store: str, ttl_s: float = TTL_S) -> AMProcess:
        started.append(AMProcess(tmp_path, name, store, ttl_s))
        return started[-1]

    yield start
    for am in started:
        am.stop()


def wait_for_leader(store: str, address: str, timeout_s: float = 30.0) -> None:
    locator = parse_etcd_url(store)
    deadline = time.monotonic() + timeout_s
    while current_leader(locator, JOB) != address:
        assert time.monotonic() < deadline, f"{address} did not lead within {timeout_s} s"
        time.sleep(0.05)


def start_and_grow(client: AMClient) -> dict:
    """A started job: 2 members that registered, a pending add whose joiner reported ready; returns the status."""
    assert client.request("start_job", {"nproc": 2})["members"] == ["w0", "w1"]
    for worker in ("w0", "w1"):
        client.register(RegisterRequest(worker, host="127.0.0.1", pid=1))
    new_worker = client.scale("add", count=1)["new_workers"][0]
    client.register(RegisterRequest(new_worker, host="127.0.0.1", pid=2))
    return client.status()


def essentials(status: dict) -> dict:
    """What must survive an AM change: generation, members, pending requests, failures."""
    return {"generation": status["generation"], "members": [m["worker_id"] for m in status["members"]],
            "pending": [(r["request_id"], r["action"]) for r in status["pending"]], "failures": status["failures"]}


def test_the_standby_leads_within_the_ttl_when_the_leader_is_sigkilled(etcd, ams):
    store = etcd.url("standby")
    first = ams("first", store)
    wait_for_leader(store, first.address)
    second = ams("second", store)
    second.wait_for_log("standing by")
    with AMClient(f"{first.address},{second.address}", JOB, timeout_s=1.0, retries=20) as client:
        before = start_and_grow(client)
        assert before["am"]["pid"] == first.proc.pid and before["am"]["restarts"] == 0
        first.kill()
        killed_at = time.monotonic()
        scaled = client.scale("add", count=1)  # a mutating request: answered by the new leader, applied once
        answered_after = time.monotonic() - killed_at
        after = client.status()
    log.info("fail-over: the standby answered %.2f s after the leader's SIGKILL (lease TTL %d s)", answered_after,
             TTL_S)
    print(f"\nfail-over: answered {answered_after:.2f} s after SIGKILL (TTL {TTL_S} s)")
    assert answered_after < TTL_S + SLACK_S, second.log()
    assert after["am"]["pid"] == second.proc.pid and after["am"]["restarts"] == 1
    assert essentials(after)["members"] == essentials(before)["members"] == ["w0", "w1"]
    assert essentials(after)["generation"] == essentials(before)["generation"] == 0
    assert [r[1] for r in essentials(after)["pending"]] == ["add", "add"]
    assert essentials(after)["pending"][0] == essentials(before)["pending"][0]
    assert scaled["new_workers"] == ["w3"]
    assert current_leader(parse_etcd_url(store), JOB) == second.address
    assert "this AM" in second.log() and "leads" in second.log()


def test_a_request_resent_to_the_new_leader_is_answered_from_the_persisted_reply_cache(etcd, ams):
    store = etcd.url("replay")
    first = ams("first", store)
    wait_for_leader(store, first.address)
    second = ams("second", store)
    second.wait_for_log("standing by")
    addresses = f"{first.address},{second.address}"
    with AMClient(addresses, JOB, timeout_s=1.0, retries=20) as client:
        client.request("start_job", {"nproc": 1})
        reply = client.request("scale", {"action": "add", "count": 1}, msg_id="scale-once")
        first.kill()
        again = client.request("scale", {"action": "add", "count": 1}, msg_id="scale-once")
        status = client.status()
    assert again == reply and len(status["pending"]) == 1 and status["am"]["pid"] == second.proc.pid


@pytest.mark.parametrize(("outage_s", "ttl_s", "how"),
                         [(5.0, 10, "sigstop"), (2 * TTL_S + 2.0, TTL_S, "sigstop"), (5.0, 10, "restart")])
def test_an_etcd_outage_pauses_the_am_and_it_resumes_with_nothing_lost(etcd, ams, outage_s, ttl_s, how):
    """SIGSTOP etcd (or stop it and start it again on the same data dir) while a scale request waits for its write."""
    store = etcd.url(f"outage{int(outage_s)}{how}")
    am = ams("only", store, ttl_s=ttl_s)
    wait_for_leader(store, am.address)
    with AMClient(am.address, JOB, timeout_s=1.0, retries=60) as client:
        before = start_and_grow(client)
        etcd.pause() if how == "sigstop" else etcd.stop()
        answers: dict[str, dict] = {}

        def scale_during_the_outage() -> None:
            with AMClient(am.address, JOB, timeout_s=1.0, retries=90) as other:
                answers["scale"] = other.scale("add", count=1)

        during = threading.Thread(target=scale_during_the_outage)
        during.start()
        time.sleep(outage_s)
        etcd.resume() if how == "sigstop" else etcd.start()
        resumed_at = time.monotonic()
        during.join(90)
        answered_after = time.monotonic() - resumed_at
        after = client.status()
    print(f"\netcd {how} {outage_s:.0f} s (TTL {ttl_s} s): the scale sent meanwhile was answered "
          f"{answered_after:.2f} s after etcd resumed")
    assert answers["scale"]["new_workers"] == ["w3"], am.log()
    assert essentials(after)["members"] == essentials(before)["members"]
    assert essentials(after)["pending"][0] == essentials(before)["pending"][0]
    assert [r[1] for r in essentials(after)["pending"]] == ["add", "add"]
    assert am.proc.poll() is None
    if outage_s > ttl_s:  # the lease ran out: it stopped serving, led again and reloaded the state from etcd
        assert "lost the leadership" in am.log() and after["am"]["restarts"] == 1
    else:
        assert "lost the leadership" not in am.log() and after["am"]["restarts"] == 0
