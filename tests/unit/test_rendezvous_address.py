"""Which rendezvous store an address names: ``HOST:PORT`` → a TCPStore client, ``etcd://…?job=JOB`` → etcd; the enrol
reply's ``store_url`` wins over ``store_host``/``store_port`` in ``elan worker``."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_elan.elastic.etcd_rendezvous import EtcdRendezvousStore, open_rendezvous_store
from lightning_elan.launcher.enrolled import EnrolledWorker, NotEnrolled, WorkerConfig
from lightning_elan.protocol.contract import EnrolReply

pytest.importorskip("etcd3gw")


def test_host_port_opens_a_tcpstore_client():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = open_rendezvous_store(f"127.0.0.1:{server.port}", timedelta(seconds=5))
    assert isinstance(client, dist.TCPStore)
    client.set("k", b"v")
    assert server.get("k") == b"v"


def test_etcd_url_opens_the_etcd_store_without_a_request():
    store = open_rendezvous_store("etcd://127.0.0.1:1/prefix?job=j", timedelta(seconds=1))
    assert isinstance(store, EtcdRendezvousStore)
    assert store.root == "/lightning_elan/prefix/j/rdzv/" and store.timeout == timedelta(seconds=1)


def test_enrol_reply_store_url_wins():
    worker = EnrolledWorker(WorkerConfig("tcp://10.0.0.5:29400", "j", ["true"]), base_env={})
    try:
        url = "etcd://10.0.0.9:2379/p?job=j"
        assert worker.store_address(EnrolReply("w0", "member", store_url=url, store_port=5)) == url
        assert worker.store_address(EnrolReply("w0", "member", store_port=5)) == "10.0.0.5:5"
        with pytest.raises(NotEnrolled, match="no rendezvous store"):
            worker.store_address(EnrolReply("w0", "member"))
        assert EnrolReply.from_body(EnrolReply("w0", "joiner", store_url=url).to_body()).store_url == url
    finally:
        worker._client.close()
