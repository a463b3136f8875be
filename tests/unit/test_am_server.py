from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from bench.procs import free_port
from lightning_elan.master import registry
from lightning_elan.master import server as server_module
from lightning_elan.master.server import (
    REPLY_CACHE_MAX_AGE_S,
    WARNING_BURST,
    ApplicationMaster,
    ReplyCache,
    reply_body,
)
from lightning_elan.master.store import FileStore, MemoryStore
from lightning_elan.protocol import AMClient, AMError, AMUnavailable
from lightning_elan.protocol.contract import (
    AdjustmentPlan,
    AdjustmentReport,
    CoordinateReply,
    CoordinateRequest,
    RegisterRequest,
    ScaleReply,
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


# ---------------------------------------------------------------------- the reply cache is bounded


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_reply_cache_keeps_at_most_max_entries_newest_last() -> None:
    cache = ReplyCache(max_entries=3)
    for index in range(5):
        cache.put(f"m{index}", "register", {"i": index})

    assert len(cache) == 3
    assert cache.get("m0") is None and cache.get("m1") is None
    assert cache.get("m4") == ("register", {"i": 4})


def test_reply_cache_forgets_replies_older_than_its_age_limit() -> None:
    clock = FakeClock()
    cache = ReplyCache(max_age_s=60.0, clock=clock)
    cache.put("old", "scale", {"request_id": "r1"})
    clock.now += 30
    cache.put("new", "scale", {"request_id": "r2"})

    clock.now += 31  # "old" is 61 s old, "new" 31 s
    assert cache.get("old") is None
    assert cache.get("new") == ("scale", {"request_id": "r2"})
    assert len(cache) == 1


def test_reply_cache_bounds_the_bytes_it_holds() -> None:
    cache = ReplyCache(max_bytes=2_000)
    for index in range(10):
        cache.put(f"m{index}", "coordinate", {"pad": "x" * 500})

    assert cache.size_bytes <= 2_000
    assert len(cache) == 3 and cache.get("m9") is not None


def test_persisted_entries_keep_their_age_and_expire_on_load() -> None:
    clock = FakeClock()
    cache = ReplyCache(clock=clock)
    cache.put("old", "scale", {"request_id": "r1"})
    clock.now += REPLY_CACHE_MAX_AGE_S - 10
    cache.put("new", "scale", {"request_id": "r2"})
    saved = json.loads(json.dumps(cache.to_list()))

    clock.now += 20
    loaded = ReplyCache.from_list(saved, clock=clock)
    legacy = ReplyCache.from_list([["m1", "register", {}]], clock=clock)  # written before entries had a time

    assert [entry[0] for entry in loaded.to_list()] == ["new"]
    assert loaded.to_list()[0][3] == 1000.0 + REPLY_CACHE_MAX_AGE_S - 10
    assert legacy.get("m1") == ("register", {})


def test_a_restarted_am_drops_expired_replies_from_its_store(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "state.json")
    with ApplicationMaster(JOB, store, register=False) as first, AMClient(first.address, JOB) as client:
        client.request("start_job", {"nproc": 2})
        client.scale("add", count=1)
    document = store.load()
    assert document is not None and len(document["replies"]) == 2
    for entry in document["replies"]:
        entry[3] -= REPLY_CACHE_MAX_AGE_S + 1  # both replies are now past the age limit
    store.save(document)

    restarted = ApplicationMaster(JOB, store, register=False)

    assert restarted._replies.to_list() == []
    assert store.load()["replies"] == []


# ---------------------------------------------------------------------- bad frames: error reply, state unchanged


def durable_state(am: ApplicationMaster) -> dict[str, Any]:
    state = am._state.to_dict()
    del state["progress"]
    return state


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper than"),  # used to kill the AM's thread
        (b'{"v": 1, "id": "d1", "job": "job", "type": "status", "body": {"x": ' + b"[" * 40 + b"]" * 40 + b"}}",
         "nests deeper than"),
        (b'{"v": 1, "id": "t1", "job": "job", "type": "coordinate", "body": {"worker_id": "w0", "generation": "0",'
         b' "step": 1}}', "field 'generation' must be int, got str"),
        (b'{"v": 1, "id": "t2", "job": "job", "type": "scale", "body": {"action": "add", "count": true}}',
         "field 'count' must be int, got bool"),
        (b'{"v": 1, "id": "t3", "job": "job", "type": "report", "body": {"worker_id": "w0", "generation": 1,'
         b' "role": "stayer", "pause_s": NaN}}', "not valid JSON"),
        (b'{"v": 1, "id": "t4", "job": "job", "type": "register", "body": {"worker_id": "w0", "pid": 1e400}}',
         "field 'pid' must be int"),
        (b'{"v": 1, "id": "t5", "job": "job", "type": "coordinate", "body": {"worker_id": "w0", "generation": -3,'
         b' "step": 1}}', "generation must be ≥ 0, got -3"),
        (b'{"v": 1, "id": "t6", "job": "job", "type": "coordinate", "body": {"worker_id": "w0", "generation": 4,'
         b' "step": 1}}', "generation 4 is not current"),
        (b'{"v": 1, "id": "t7", "job": "job", "type": "register", "body": {"worker_id": "w99"}}', "unknown worker"),
        (b'{"v": 2, "id": "t8", "job": "job", "type": "status", "body": {}}', "unsupported protocol version 2"),
        (b'{"v": 1, "id": "t9", "job": "job", "type": "status", "body": []}', "body must be an object"),
        (b'{"v": 1, "id": "t10", "job": "' + b"x" * 5000 + b'", "type": "status", "body": {}}', "wrong job"),
        (b'{"v": 1, "id": "t11", "job": "job", "type": "scale", "body": {"action": "add", "count": 100000}}',
         "at most 4096 workers"),
        (b"", "not valid JSON"),
        (b'{"v": 1, "id": "t12", "job": "job", "type": "start_job", "body": {"nproc": 3, "hosts": [[], 1, 2]}}',
         None),  # start_job on a started job answers the current membership, whatever it asks
    ],
)
def test_malformed_and_stale_frames_are_answered_and_change_nothing(
    am: ApplicationMaster, client: AMClient, raw: RawDealer, payload: bytes, message: str | None
) -> None:
    before = durable_state(am)

    reply = raw.ask(payload)

    if message is None:
        assert reply["ok"] is True and reply["body"] == {"generation": 0, "members": ["w0", "w1"]}
    else:
        assert reply["ok"] is False and message in reply["error"], reply
        assert len(reply["error"]) <= 1001
    assert durable_state(am) == before
    assert client.status()["members"][0]["worker_id"] == "w0"


def test_a_replayed_id_is_answered_from_the_cache_whatever_its_body(client: AMClient, raw: RawDealer) -> None:
    first = raw.ask(encode_request("s-1", JOB, "scale", {"action": "add", "count": 1}))
    replayed = raw.ask(encode_request("s-1", JOB, "scale", {"action": "add", "count": 3}))
    other_type = raw.ask(encode_request("s-1", JOB, "register", {"worker_id": "w0"}))

    assert replayed == first and first["ok"] is True
    assert other_type["ok"] is False and "already used for a scale request" in other_type["error"]
    assert [request["request_id"] for request in client.status()["pending"]] == ["r1"]


def test_a_resent_poll_gets_the_first_copys_answer_and_the_next_poll_starts_the_worker(
    client: AMClient, raw: RawDealer
) -> None:
    """The launcher resends a ``launcher_poll`` the AM was slow to answer (same id): the first copy found no worker to
    start, a ``scale`` came between the copies. The second copy gets the first copy's answer (the launcher keeps the
    first answer and drops the second: a worker handed out there was never started), and the next poll hands the new
    worker out."""
    poll = encode_request("poll-1", JOB, "launcher_poll", {})
    first = raw.ask(poll)
    new_worker = client.scale("add", count=1)["new_workers"][0]
    resent = raw.ask(poll)
    next_poll = raw.ask(encode_request("poll-2", JOB, "launcher_poll", {}))

    assert first["ok"] and first["body"]["spawn"] == []
    assert resent == first
    assert [order["worker_id"] for order in next_poll["body"]["spawn"]] == [new_worker]


def test_a_refused_request_resent_after_its_cause_is_gone_stays_refused(client: AMClient, raw: RawDealer) -> None:
    """A ``scale`` refused while an adjustment is in flight, resent with the same id once it completed (its first
    answer was slow to reach the client, which then asks again with a new id): the resent copy is refused again, so
    the scale applies once, by the new id."""
    plan = add_and_decide(client)
    scale = encode_request("scale-late", JOB, "scale", {"action": "add", "count": 1})
    refused = raw.ask(scale)
    for worker in plan.members:
        client.report(AdjustmentReport(worker, plan.generation, "joiner" if worker in plan.joiners else "stayer"))
    resent = raw.ask(scale)
    retried = client.scale("add", count=1)

    assert refused["ok"] is False and "adjustment in flight" in refused["error"]
    assert resent == refused
    assert [request["request_id"] for request in client.status()["pending"]] == [retried["request_id"]]


def test_a_flood_of_refused_messages_logs_a_bounded_number_of_warnings(
    client: AMClient, raw: RawDealer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_elan.master.server"):
        for index in range(WARNING_BURST * 3):
            assert raw.ask(b"not json %d" % index)["ok"] is False

    refused = [record for record in caplog.records if "refused a message" in record.getMessage()]
    assert len(refused) == WARNING_BURST


def test_one_parked_wait_per_worker_and_a_bounded_total(
    am: ApplicationMaster, client: AMClient, raw: RawDealer, monkeypatch: pytest.MonkeyPatch
) -> None:
    joiners = client.scale("add", count=3)["new_workers"]
    raw.socket.send(encode_request("wait-a", JOB, "wait_plan", {"worker_id": joiners[0], "timeout_s": 30}))
    displaced = raw.ask(encode_request("wait-b", JOB, "wait_plan", {"worker_id": joiners[0], "timeout_s": 30}))

    assert displaced["id"] == "wait-a" and displaced["body"] == {"status": "wait"}
    assert client.status()["am"]["parked_waits"] == 1

    monkeypatch.setattr(server_module, "MAX_PARKED", 2)
    raw.socket.send(encode_request("wait-c", JOB, "wait_plan", {"worker_id": joiners[1], "timeout_s": 30}))
    oldest = raw.ask(encode_request("wait-d", JOB, "wait_plan", {"worker_id": joiners[2], "timeout_s": 30}))

    assert oldest["id"] == "wait-b" and oldest["body"] == {"status": "wait"}
    assert client.status()["am"]["parked_waits"] == 2


# ---------------------------------------------------------------------- observability


def test_status_names_the_am_process_and_counts_its_restarts(am: ApplicationMaster, tmp_path: Path) -> None:
    with AMClient(am.address, JOB) as first_client:
        first_client.request("start_job", {"nproc": 2})
        first = first_client.status()["am"]
    am.stop()
    with make_am(tmp_path) as second, AMClient(second.address, JOB) as second_client:
        after_one = second_client.status()["am"]
    with make_am(tmp_path) as third, AMClient(third.address, JOB) as third_client:
        after_two = third_client.status()["am"]

    assert first["pid"] == os.getpid() and first["address"] == am.address and first["restarts"] == 0
    assert after_one["restarts"] == 1 and after_two["restarts"] == 2
    assert after_two["started_at"] >= first["started_at"]


def test_status_lists_a_failed_request_with_its_reason(client: AMClient) -> None:
    new_worker = client.scale("add", count=1)["new_workers"][0]
    client.request("launcher_poll")
    client.request("worker_exit", {"worker_id": new_worker, "returncode": 1})

    status = client.status()

    assert status["pending"] == []
    [failure] = status["failures"]
    assert (failure["request_id"], failure["outcome"]) == ("r1", "failed")
    assert failure["reason"] == f"worker {new_worker} exited with code 1 before its plan was decided"


def test_the_am_answers_only_with_the_reply_dataclass_of_the_type() -> None:
    """Handlers return the reply dataclass ``contract.MESSAGES`` names; the server sends its body, nothing else."""
    assert reply_body("scale", ScaleReply("r1", [])) == {"request_id": "r1", "new_workers": []}
    with pytest.raises(TypeError, match="the scale handler answered a dict, not a ScaleReply"):
        reply_body("scale", {"request_id": "r1", "new_workers": []})
