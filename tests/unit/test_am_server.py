from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from lightning_elan.master import registry
from lightning_elan.master.server import ApplicationMaster
from lightning_elan.master.store import FileStore, MemoryStore
from lightning_elan.protocol import AMClient, AMError, AMUnavailable
from lightning_elan.protocol.contract import (
    AdjustmentPlan,
    AdjustmentReport,
    CoordinateReply,
    CoordinateRequest,
    RegisterRequest,
    WaitPlanReply,
)
from lightning_elan.protocol.messages import MAX_MESSAGE_BYTES, encode_request

JOB = "job"


def make_am(tmp_path: Path, **options: Any) -> ApplicationMaster:
    options.setdefault("register", False)
    return ApplicationMaster(JOB, FileStore(tmp_path / "state.json"), state_dir=tmp_path, **options).start()


@pytest.fixture
def am(tmp_path: Path) -> Iterator[ApplicationMaster]:
    master = make_am(tmp_path)
    yield master
    master.stop()


@pytest.fixture
def client(am: ApplicationMaster) -> Iterator[AMClient]:
    with AMClient(am.address, JOB, timeout_s=1.0, retries=1) as am_client:
        am_client.request("start_job", {"nproc": 2, "coordinate_every": 5})
        yield am_client


class RawDealer:
    """A bare DEALER socket: sends exact bytes, returns decoded replies."""

    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def ask(self, *frames: bytes, timeout_s: float = 2.0) -> dict[str, Any]:
        self.socket.send_multipart(list(frames))
        assert self.socket.poll(int(timeout_s * 1000)), "no reply"
        return json.loads(self.socket.recv())

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture
def raw(am: ApplicationMaster) -> Iterator[RawDealer]:
    dealer = RawDealer(am.address)
    yield dealer
    dealer.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def add_and_decide(client: AMClient) -> AdjustmentPlan:
    """Scale out by one worker, let it report ready, and have rank 0 decide; returns the plan."""
    new_worker = client.scale("add", count=1)["new_workers"][0]
    client.register(RegisterRequest(new_worker, host="127.0.0.1", pid=1))
    reply = client.coordinate(CoordinateRequest("w0", 0, 5))
    assert reply.decision == "adjust" and reply.plan is not None
    assert reply.plan.joiners == [new_worker] and reply.plan.rank_of(new_worker) == 2
    return reply.plan


def test_address_has_the_bound_port(am: ApplicationMaster) -> None:
    assert am.address.startswith("tcp://127.0.0.1:")
    assert int(am.address.rsplit(":", 1)[1]) > 0


def test_a_replayed_request_id_applies_once_even_after_an_am_restart(am: ApplicationMaster, tmp_path: Path) -> None:
    with AMClient(am.address, JOB) as setup:
        setup.request("start_job", {"nproc": 2})
    scale = encode_request("scale-1", JOB, "scale", {"action": "add", "count": 1})
    dealer = RawDealer(am.address)
    first, second = dealer.ask(scale), dealer.ask(scale)
    dealer.close()
    am.stop()

    with make_am(tmp_path) as restarted:
        dealer = RawDealer(restarted.address)
        after_restart = dealer.ask(scale)
        dealer.close()
        with AMClient(restarted.address, JOB) as status_client:
            status = status_client.status()

    assert first == second == after_restart
    assert first["body"] == {"request_id": "r1", "new_workers": ["w2"]}
    assert [request["request_id"] for request in status["pending"]] == ["r1"]


def test_a_restarted_am_resumes_members_and_the_in_flight_plan(am: ApplicationMaster, tmp_path: Path) -> None:
    with AMClient(am.address, JOB) as first_client:
        first_client.request("start_job", {"nproc": 2})
        plan = add_and_decide(first_client)
    am.stop()

    with make_am(tmp_path) as restarted, AMClient(restarted.address, JOB, timeout_s=1.0) as client:
        again = client.request("coordinate", {"worker_id": "w0", "generation": 0, "step": 6})
        with pytest.raises(AMError, match=r"adjustment in flight \(generation 0 → 1\); retry"):
            client.scale("add", count=1)
        client.coordinate(CoordinateRequest("w2", 1, 6))
        status = client.status()

    assert again == {"decision": "adjust", "plan": plan.to_dict()}  # the wire form, unchanged by the restart
    assert status["generation"] == 1
    assert [member["worker_id"] for member in status["members"]] == ["w0", "w1", "w2"]


@pytest.mark.parametrize(
    ("frames", "expected_id", "message"),
    [
        ([b"\xff\xfe\xfd"], None, "not UTF-8"),
        ([b"{this is not json"], None, "not valid JSON"),
        ([b"[1, 2, 3]"], None, "must be a JSON object"),
        ([b"{" + b" " * MAX_MESSAGE_BYTES + b"}"], None, "exceeds the limit"),
        ([b'{"v": 1, "id": "m1", "job": "other", "type": "status", "body": {}}'], "m1", "wrong job 'other'"),
        ([b'{"v": 1, "id": "m2", "job": "job", "type": "dance", "body": {}}'], "m2", "unknown message type"),
        ([b'{"v": 1, "id": "m3", "job": "job", "type": "register", "body": {}}'], "m3", "missing field"),
        ([b"one", b"two", b"three"], None, "exactly one frame"),
    ],
)
def test_bad_messages_get_an_error_reply_and_the_am_keeps_serving(
    client: AMClient, raw: RawDealer, frames: list[bytes], expected_id: str | None, message: str
) -> None:
    reply = raw.ask(*frames)

    assert reply["ok"] is False
    assert reply["id"] == expected_id
    assert message in reply["error"]
    assert client.status()["members"][0]["worker_id"] == "w0"


def test_state_errors_reach_the_client_verbatim(client: AMClient) -> None:
    with pytest.raises(AMError, match=r"^cannot remove all 2 workers$"):
        client.scale("remove", count=2)
    with pytest.raises(AMError, match=r"^unknown worker w9$"):
        client.request("register", {"worker_id": "w9"})


def test_a_failing_store_rolls_the_transition_back_and_the_am_keeps_serving(tmp_path: Path) -> None:
    class FlakyStore(MemoryStore):
        failures = 0

        def save(self, state: dict[str, Any]) -> None:
            if self.failures:
                self.failures -= 1
                raise OSError("disk full")
            super().save(state)

    store = FlakyStore()
    with ApplicationMaster(JOB, store, register=False) as master, AMClient(master.address, JOB) as client:
        client.request("start_job", {"nproc": 2})
        store.failures = 1
        with pytest.raises(AMError, match="internal error in the AM: OSError: disk full"):
            client.scale("add", count=1)
        retried = client.scale("add", count=1)
        status = client.status()

    assert retried == {"request_id": "r1", "new_workers": ["w2"]}
    assert len(status["pending"]) == 1


def test_wait_plan_is_woken_as_soon_as_a_plan_is_decided(am: ApplicationMaster, client: AMClient) -> None:
    new_worker = client.scale("add", count=1)["new_workers"][0]
    client.register(RegisterRequest(new_worker))
    answers: list[tuple[WaitPlanReply, float]] = []

    def joiner() -> None:
        with AMClient(am.address, JOB) as joiner_client:
            answer = joiner_client.wait_plan(new_worker, timeout_s=5.0)
            answers.append((answer, time.monotonic()))

    thread = threading.Thread(target=joiner)
    thread.start()
    time.sleep(0.2)  # let the joiner park
    decided_at = time.monotonic()
    plan = client.coordinate(CoordinateRequest("w0", 0, 5)).plan
    thread.join(5.0)

    assert answers, "the parked wait_plan was not answered"
    answer, answered_at = answers[0]
    assert plan is not None and answer == WaitPlanReply.with_plan(plan)
    assert answered_at - decided_at < 1.0


def test_wait_plan_answers_wait_when_its_timeout_passes(client: AMClient) -> None:
    new_worker = client.scale("add", count=1)["new_workers"][0]

    started = time.monotonic()
    answer = client.wait_plan(new_worker, timeout_s=0.2)

    assert answer == WaitPlanReply.wait()
    assert 0.15 <= time.monotonic() - started < 1.0


def test_shutdown_cancels_a_parked_wait_plan(am: ApplicationMaster, client: AMClient) -> None:
    new_worker = client.scale("add", count=1)["new_workers"][0]
    answers: list[WaitPlanReply] = []
    thread = threading.Thread(
        target=lambda: answers.append(AMClient(am.address, JOB).wait_plan(new_worker, timeout_s=5.0))
    )
    thread.start()
    time.sleep(0.2)
    client.request("shutdown", {"reason": "done"})
    thread.join(5.0)

    assert answers == [WaitPlanReply.cancelled("job shut down: done")]
    assert client.request("launcher_poll")["finished"] is True


def test_client_resends_until_a_late_am_answers_and_the_request_applies_once(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with ApplicationMaster(JOB, FileStore(tmp_path / "state.json"), bind=address, register=False) as first:
        AMClient(first.address, JOB).request("start_job", {"nproc": 2})
    late = ApplicationMaster(JOB, FileStore(tmp_path / "state.json"), bind=address, register=False)
    timer = threading.Timer(0.7, late.start)
    timer.start()
    try:
        with AMClient(address, JOB, timeout_s=0.25, retries=12) as client:
            started = time.monotonic()
            reply = client.scale("add", count=1)
            waited = time.monotonic() - started
            status = client.status()
    finally:
        timer.join()
        late.stop()

    assert waited >= 0.5
    assert reply == {"request_id": "r1", "new_workers": ["w2"]}
    assert [request["request_id"] for request in status["pending"]] == ["r1"]


def test_client_discards_a_late_reply_to_an_earlier_request(client: AMClient) -> None:
    new_worker = client.scale("add", count=1)["new_workers"][0]
    with pytest.raises(AMUnavailable):
        client.request("wait_plan", {"worker_id": new_worker, "timeout_s": 0.3}, timeout_s=0.1, retries=0)
    time.sleep(0.4)  # the AM's late {"status": "wait"} is now queued on the client's socket

    status = client.status()

    assert status["job"] == JOB
    assert "status" not in status


def test_client_gives_up_when_nothing_answers() -> None:
    with AMClient(f"tcp://127.0.0.1:{free_port()}", JOB, timeout_s=0.1, retries=2) as client:
        started = time.monotonic()
        with pytest.raises(AMUnavailable, match=r"after 3 attempt\(s\)"):
            client.status()

    assert time.monotonic() - started >= 0.3


def test_adjustment_record_is_appended_to_the_state_dir(
    am: ApplicationMaster, client: AMClient, tmp_path: Path
) -> None:
    plan = add_and_decide(client)
    for worker in plan.members:
        role = "joiner" if worker in plan.joiners else "stayer"
        client.report(AdjustmentReport(worker, 1, role, pause_s=0.1, bytes_received=10, startup_s=1.0))

    lines = (tmp_path / "adjustments.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["request_id"] == plan.request_id
    assert record["bytes_replicated"] == 30
    assert client.status()["last_adjustment"] == record


def test_the_registry_entry_lives_as_long_as_the_am(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELAN_HOME", str(tmp_path / "home"))
    master = make_am(tmp_path, register=True)
    entry = registry.read(JOB)
    master.stop()

    assert entry is not None
    assert entry["address"] == master.address
    assert entry["state_dir"] == str(tmp_path)
    assert registry.job_file(JOB) == tmp_path / "home" / "jobs" / f"{JOB}.json"
    assert registry.read(JOB) is None


def test_a_store_of_another_job_is_refused(tmp_path: Path) -> None:
    with make_am(tmp_path) as master, AMClient(master.address, JOB) as client:
        client.request("start_job", {"nproc": 1})

    with pytest.raises(ValueError, match="holds the state of job 'job', not 'other'"):
        ApplicationMaster("other", FileStore(tmp_path / "state.json"), register=False)


def test_start_reports_a_bind_failure(am: ApplicationMaster, tmp_path: Path) -> None:
    second = ApplicationMaster(JOB, MemoryStore(), bind=am.address, register=False)

    with pytest.raises(zmq.ZMQError):
        second.start()


def test_coordinate_without_a_decision_does_not_write_the_store_but_updates_status():
    class CountingStore(MemoryStore):
        saves = 0

        def save(self, state: dict[str, Any]) -> None:
            CountingStore.saves += 1
            super().save(state)

    with ApplicationMaster(JOB, CountingStore(), register=False) as am:
        with AMClient(am.address, JOB) as client:
            client.request("start_job", {"nproc": 2})
            saves_after_start = CountingStore.saves
            for step in range(5):
                body = {"worker_id": "w0", "generation": 0, "step": step, "epoch": 0, "position": 12 * step,
                        "global_batch": 12}
                assert client.coordinate(CoordinateRequest(**body)) == CoordinateReply.none()
            assert CountingStore.saves == saves_after_start
            assert client.status()["step"] == 4
            client.scale("add", count=1)
            assert CountingStore.saves == saves_after_start + 1
