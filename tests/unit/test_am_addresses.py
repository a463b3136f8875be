"""``AMClient`` with a comma list of AM addresses (a leader and its standbys): it reaches whichever AM is bound,
resends the same id, and a store refusal (unavailable, conflict) leaves the AM unanswering or stopped, never wrong."""

from __future__ import annotations

from typing import Any

import pytest

from bench.procs import free_port
from lightning_elan.master.server import ApplicationMaster
from lightning_elan.master.store import MemoryStore, StoreConflict, StoreUnavailable
from lightning_elan.protocol import AMClient, AMUnavailable
from lightning_elan.protocol.client import split_addresses

JOB = "job"


def free_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class FlakyStore(MemoryStore):
    """A memory store whose next saves raise the given errors (an etcd outage, a lost leadership)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[Exception] = []

    def save(self, state: dict[str, Any]) -> None:
        if self.failures:
            raise self.failures.pop(0)
        super().save(state)


def test_split_addresses():
    assert split_addresses("tcp://a:1") == ["tcp://a:1"]
    assert split_addresses("tcp://a:1, tcp://b:2") == ["tcp://a:1", "tcp://b:2"]
    for bad in ("", "tcp://a:1,", ",tcp://a:1"):
        with pytest.raises(ValueError, match="bad AM address list"):
            split_addresses(bad)


def test_a_client_listing_several_addresses_reaches_the_one_am_that_serves():
    standby = free_address()  # nobody binds it: a standby that does not lead
    with ApplicationMaster(JOB, MemoryStore(), bind=free_address(), register=False) as am:
        with AMClient(f"{standby},{am.address}", JOB, timeout_s=1.0, retries=2) as client:
            assert client.request("start_job", {"nproc": 2})["members"] == ["w0", "w1"]
            for _ in range(5):
                assert client.status()["generation"] == 0
    with AMClient(f"{standby},{free_address()}", JOB, timeout_s=0.2, retries=1) as client, \
            pytest.raises(AMUnavailable):
        client.status()


def test_the_am_does_not_answer_while_its_store_is_unavailable_and_applies_the_resend_once():
    store = FlakyStore()
    with ApplicationMaster(JOB, store, register=False) as am, AMClient(am.address, JOB, timeout_s=0.5) as client:
        client.request("start_job", {"nproc": 1})
        store.failures = [StoreUnavailable("etcd down")] * 2
        reply = client.request("scale", {"action": "add", "count": 1}, retries=3)  # 2 attempts unanswered
        assert reply["new_workers"] == ["w1"]
        assert [r["request_id"] for r in client.status()["pending"]] == [reply["request_id"]]
        assert store.load()["state"] == am._state.to_dict()


def test_an_am_whose_write_is_refused_stops_serving():
    store = FlakyStore()
    with ApplicationMaster(JOB, store, register=False) as am, AMClient(am.address, JOB, timeout_s=0.3) as client:
        client.request("start_job", {"nproc": 1})
        store.failures = [StoreConflict("another AM leads")]
        with pytest.raises(AMUnavailable):
            client.request("scale", {"action": "add", "count": 1}, retries=1)
        assert am.fenced_reason == "another AM leads" and not am.serving
