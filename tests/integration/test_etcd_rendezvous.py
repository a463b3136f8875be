"""The rendezvous store in etcd (``elastic/etcd_rendezvous.py``): the c10d operations against a real etcd, then real
gloo groups of 2 and 3 processes formed through it (``bench/rendezvous_worker.py``: successive generations, a commit
vote, the keys deleted with ``list_keys``)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_elan.elastic.etcd_rendezvous import (
    EtcdRendezvousStore,
    open_rendezvous_store,
    parse_rendezvous_url,
    rendezvous_url,
)
from tests.integration.etcd_server import EtcdServer, require_etcd

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    require_etcd()
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


def store_of(etcd: EtcdServer, job: str, timeout_s: float = 5.0) -> EtcdRendezvousStore:
    store = open_rendezvous_store(etcd.url("rdzv") + f"?job={job}", timedelta(seconds=timeout_s))
    assert isinstance(store, EtcdRendezvousStore)
    return store


def test_url_round_trip_and_errors():
    locator, job = parse_rendezvous_url("etcd://10.0.0.1:2379,10.0.0.2/pre/fix?job=train-1")
    assert job == "train-1" and locator.prefix == "pre/fix"
    assert rendezvous_url(locator, job) == "etcd://10.0.0.1:2379,10.0.0.2:2379/pre/fix?job=train-1"
    with pytest.raises(ValueError, match="names no job"):
        parse_rendezvous_url("etcd://127.0.0.1:2379/prefix")
    with pytest.raises(ValueError, match="bad rendezvous store address"):
        open_rendezvous_store("no-port")


def test_store_operations(etcd):
    store = store_of(etcd, "ops")
    store.set("a", b"x")
    assert store.get("a") == b"x"
    assert (store.add("n", 2), store.add("n", 3), store.get("n")) == (2, 5, b"5")
    assert store.compare_set("k", "", "v1") == b"v1"  # absent and expected empty: set
    assert store.compare_set("k", "other", "v2") == b"v1"  # mismatch: the current value
    assert store.compare_set("k", "v1", "v2") == b"v2"
    assert store.compare_set("absent", "e", "d") == b"e"  # TCPStore's answer for an absent key
    store.append("ap", b"1")
    store.append("ap", "2")
    assert store.multi_get(["ap", "n"]) == [b"12", b"5"]
    assert store.check(["a", "n"]) and not store.check(["a", "nope"])
    assert sorted(store.list_keys()) == ["a", "ap", "k", "n"] and store.num_keys() == 4
    assert store.delete_key("a") and not store.delete_key("a")
    prefixed = dist.PrefixStore("elan/gen0", store)
    prefixed.set("x", "1")
    assert prefixed.get("x") == b"1" and "elan/gen0/x" in store.list_keys()
    assert store_of(etcd, "other-job").num_keys() == 0  # jobs do not see each other's keys
    assert store.clear() == 4


def test_add_is_atomic_across_threads(etcd):
    store = store_of(etcd, "atomic")

    def bump() -> None:
        for _ in range(25):
            store.add("count", 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.get("count") == b"100"


def test_get_and_wait_time_out_and_wake(etcd):
    store = store_of(etcd, "wait", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timed out"):
        store.get("never")
    assert 0.4 < time.monotonic() - started < 2.0
    threading.Timer(0.2, lambda: store.set("later", b"1")).start()
    store.wait(["later"], timedelta(seconds=5))
    assert store.get("later") == b"1"


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_generations_over_etcd(etcd, tmp_path, world):
    address = etcd.url("rdzv") + f"?job=gloo{world}"
    outs = [tmp_path / f"rank{rank}.json" for rank in range(world)]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.rendezvous_worker", address, str(rank), str(world), "3",
                               str(outs[rank])], cwd=REPO) for rank in range(world)]
    for proc in procs:
        assert proc.wait(120) == 0
    results = [json.loads(out.read_text()) for out in outs]
    expected = world * (world + 1) / 2
    for result in results:
        assert result["sums"] == [expected] * 3 and result["commits"] == [True] * 3
    assert results[0]["deleted"] > 0
    left = store_of(etcd, f"gloo{world}").list_keys()
    assert not [key for key in left if key.startswith("bench/")], left


def test_a_closed_store_raises_at_once_and_its_clone_closes_alone(etcd):
    store = store_of(etcd, "closing", timeout_s=30.0)
    clone = store.clone()
    clone.set("key", b"v")

    clone.close()
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="is closed"):
        clone.get("absent")
    assert time.monotonic() - started < 1.0
    assert store.get("key") == b"v"


def test_a_survivor_that_abandoned_a_connect_on_etcd_exits_cleanly(etcd):
    """Its backend's rendezvous still polls the etcd store for the dead peer when the process exits: the exit hook
    closes that store client first, so the thread does not take the GIL during interpreter finalization (which killed
    the process: SIGABRT or SIGSEGV; etcd storm seed 9010)."""
    address = etcd.url("rdzv") + "?job=abandoned"
    script = REPO / "tests" / "integration" / "abandoned_connect.py"
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script), address], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
        assert "abandoned the connect" in proc.stdout
