"""The etcd store and the leader lease against a real etcd (Debian's etcd-server 3.4; skipped without the binary):
round trip, compare-and-swap between two writers, hand-over when the leader's lease is lost, outages ridden out."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from lightning_elan.master.etcd_store import EtcdStore, LeadershipLost, parse_etcd_url
from lightning_elan.master.leadership import Leadership, current_leader
from lightning_elan.master.store import StoreConflict, StoreUnavailable
from tests.integration.etcd_server import EtcdServer, free_port, require_etcd

pytest.importorskip("etcd3gw")
pytestmark = pytest.mark.integration


@pytest.fixture
def etcd(tmp_path):
    require_etcd()
    with EtcdServer(tmp_path / "etcd") as server:
        yield server


def test_state_round_trips_under_the_project_prefix(etcd):
    store = EtcdStore.from_url(etcd.url("rt"), "job1")
    assert isinstance(store, EtcdStore)
    assert store.load() is None
    document = {"format": 1, "job": "job1", "state": {"generation": 3, "members": ["w0", "w1"]}, "replies": []}
    store.save(document)
    store.save({**document, "state": {"generation": 4, "members": ["w0"]}})
    fresh = EtcdStore.from_url(etcd.url("rt"), "job1")
    assert fresh.load() == {**document, "state": {"generation": 4, "members": ["w0"]}}
    assert fresh.key == "/lightning_elan/rt/job1/state"
    assert EtcdStore.from_url(etcd.url("other"), "job1").load() is None  # another prefix, another job's keys


def test_a_second_writer_loses_the_compare_and_swap(etcd):
    first, second = EtcdStore.from_url(etcd.url(), "cas"), EtcdStore.from_url(etcd.url(), "cas")
    assert first.load() is None and second.load() is None
    first.save({"v": 1})
    with pytest.raises(StoreConflict, match="another writer"):
        second.save({"v": 2})
    assert second.load() == {"v": 1}
    second.save({"v": 2})  # after reading the new revision it may write
    with pytest.raises(StoreConflict):
        first.save({"v": 3})
    assert EtcdStore.from_url(etcd.url(), "cas").load() == {"v": 2}


def test_a_store_that_never_loaded_does_not_overwrite_a_state(etcd):
    EtcdStore.from_url(etcd.url(), "blind").save({"v": 1})
    with pytest.raises(StoreConflict):
        EtcdStore.from_url(etcd.url(), "blind").save({"v": 0})


def test_the_standby_leads_when_the_leaders_lease_is_lost_and_the_old_leader_is_fenced(etcd):
    locator = parse_etcd_url(etcd.url("lead"))
    lost = threading.Event()
    leader = Leadership(locator, "job", "tcp://a:1", ttl_s=2, on_lost=lambda reason: lost.set())
    standby = Leadership(locator, "job", "tcp://b:2", ttl_s=2)
    try:
        assert leader.campaign(timeout_s=10)
        assert leader.is_leader and current_leader(locator, "job") == "tcp://a:1"
        store = EtcdStore(locator, "job", fence=leader.fence())
        store.load()
        store.save({"by": "a"})
        assert not standby.campaign(timeout_s=3)  # the leader holds its lease: the standby waits
        leader.announce("tcp://a:11")
        assert current_leader(locator, "job") == "tcp://a:11"
        # the leader's lease is revoked behind its back (as if it had expired): it is fenced at once
        leader._keeper.revoke(leader.lease_id)
        started = time.monotonic()
        with pytest.raises(LeadershipLost):
            store.save({"by": "a, deposed"})
        assert standby.campaign(timeout_s=10)
        took_over = time.monotonic() - started
        assert current_leader(locator, "job") == "tcp://b:2"
        assert lost.wait(5) and not leader.is_leader  # the keep-alive saw it
        successor = EtcdStore(locator, "job", fence=standby.fence())
        assert successor.load() == {"by": "a"}
        successor.save({"by": "b"})
        print(f"hand-over after a revoked lease: {took_over:.2f} s")
    finally:
        leader.resign()
        standby.resign()
    assert current_leader(locator, "job") is None


def test_a_leader_that_stops_refreshing_is_replaced_within_the_ttl(etcd):
    locator = parse_etcd_url(etcd.url("ttl"))
    leader = Leadership(locator, "job", "tcp://a:1", ttl_s=2)
    standby = Leadership(locator, "job", "tcp://b:2", ttl_s=2)
    try:
        assert leader.campaign(timeout_s=10)
        leader._closing.set()  # its keep-alive stops, as if the process were frozen
        leader._thread.join()
        started = time.monotonic()
        assert standby.campaign(timeout_s=10)
        waited = time.monotonic() - started
        print(f"standby led {waited:.2f} s after the leader's last refresh stopped (TTL 2 s)")
        assert waited < 2 + 2.5  # TTL + etcd's expiry check and our poll
    finally:
        standby.resign()


def test_a_save_rides_out_a_short_outage(etcd):
    store = EtcdStore.from_url(etcd.url(), "outage", retry_s=20, request_timeout_s=0.5)
    store.load()
    store.save({"v": 1})
    etcd.pause()
    resumer = threading.Timer(5.0, etcd.resume)
    resumer.start()
    started = time.monotonic()
    store.save({"v": 2})
    assert time.monotonic() - started >= 4.5
    resumer.join()
    assert EtcdStore.from_url(etcd.url(), "outage").load() == {"v": 2}


def test_an_outage_longer_than_the_retry_budget_raises_and_a_restart_keeps_the_data(etcd):
    store = EtcdStore.from_url(etcd.url(), "restart", retry_s=1.0, request_timeout_s=0.3)
    store.load()
    store.save({"v": 1})
    etcd.stop()
    with pytest.raises(StoreUnavailable, match="unavailable"):
        store.save({"v": 2})
    etcd.start()
    store.save({"v": 2})  # nothing was written meanwhile: the compare-and-swap still holds
    assert EtcdStore.from_url(etcd.url(), "restart").load() == {"v": 2}


def test_a_new_member_whose_client_port_was_taken_starts_on_another(tmp_path):
    """The test server itself: a port picked free, then bound by someone else before etcd binds it (CI stop 44)."""
    require_etcd()
    server = EtcdServer(tmp_path / "taken")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", server.client_port))
        squatter.listen()
        taken = server.client_port
        with server:
            assert server.client_port != taken
            store = EtcdStore.from_url(server.url("taken"), "job1")
            assert store.load() is None
            store.save({"answer": 42})
            assert EtcdStore.from_url(server.url("taken"), "job1").load() == {"answer": 42}
        assert "address already in use" in server.log_path.read_text()


def test_picked_ports_lie_below_the_kernels_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports) and len(ports) > 1
