"""``etcd://`` store URLs: endpoints, default port, key prefix, and clear errors for garbage (no etcd needed)."""

from __future__ import annotations

import pytest

from lightning_elan.etcd import KEY_ROOT, EtcdLocator, parse_etcd_url
from lightning_elan.master.etcd_store import EtcdStore, decode_document, encode_document


def test_one_endpoint_and_prefix():
    locator = parse_etcd_url("etcd://127.0.0.1:2379/jobs")
    assert locator == EtcdLocator(endpoints=(("127.0.0.1", 2379),), prefix="jobs")
    assert locator.key("mnist", "state") == f"{KEY_ROOT}/jobs/mnist/state"
    assert locator.url() == "etcd://127.0.0.1:2379/jobs"


def test_several_endpoints_default_port_ipv6_and_nested_prefix():
    locator = parse_etcd_url("etcd://a.example:1,b,[::1]:3/team/x/")
    assert locator.endpoints == (("a.example", 1), ("b", 2379), ("[::1]", 3))
    assert locator.prefix == "team/x"
    assert locator.key("j", "leader") == f"{KEY_ROOT}/team/x/j/leader"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://127.0.0.1:2379/p", "not an etcd URL"),
        ("etcd://127.0.0.1:2379", "no key prefix"),
        ("etcd://127.0.0.1:2379/", "no key prefix"),
        ("etcd://:2379/p", "bad host"),
        ("etcd://h:0/p", "bad port"),
        ("etcd://h:70000/p", "bad port"),
        ("etcd://h:x/p", "bad port"),
        ("etcd://h1:1,,h2:2/p", "bad host"),
        ("etcd://h:1/p/../q", "bad key prefix"),
        ("etcd://h:1/p q", "bad key prefix"),
        ("etcd://h u:1/p", "bad host"),
    ],
)
def test_garbage_is_refused_with_the_reason(url, reason):
    with pytest.raises(ValueError, match=reason):
        parse_etcd_url(url)


def test_an_etcd_store_is_built_from_its_url_without_contacting_etcd():
    pytest.importorskip("etcd3gw")
    store = EtcdStore.from_url("etcd://127.0.0.1:1/p", "job1")
    assert store.key == f"{KEY_ROOT}/p/job1/state"
    assert "etcd://127.0.0.1:1/p" in repr(store)


def test_documents_round_trip_and_large_ones_are_compressed():
    small = {"a": 1, "b": [1, 2]}
    assert decode_document(encode_document(small), "x") == small
    large = {"replies": ["x" * 100] * 10_000}
    encoded = encode_document(large)
    assert encoded[:1] != b"{" and len(encoded) < 100_000
    assert decode_document(encoded, "x") == large
    with pytest.raises(ValueError, match="valid state document"):
        decode_document(b"garbage", "x")
