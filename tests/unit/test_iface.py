"""The interface collectives bind (``replication/iface.py``): parsing the AM address, choosing, and this machine's real
interfaces (loopback only: nothing here sends a packet or asks a DNS server)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from lightning_elan.protocol.contract import ENV_AM_ADDRESS, ENV_IFACE
from lightning_elan.replication import iface
from lightning_elan.replication.iface import (
    am_host,
    bind_transfer_interface,
    interface_of,
    interface_towards,
    local_address_towards,
    transfer_interface,
)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interfaces are read the Linux way")


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("tcp://10.0.0.5:7000", "10.0.0.5"),
        ("tcp://10.0.0.5:7000,tcp://10.0.0.6:7000", "10.0.0.5"),
        (" tcp://am.example:5555 , tcp://b:1", "am.example"),
        ("tcp://[fd00::2]:5555", "fd00::2"),
        ("10.0.0.7:5555", "10.0.0.7"),
        ("am-host", "am-host"),
        ("tcp://*:5555", None),
        ("tcp://0.0.0.0:5555", None),
        ("", None),
    ],
)
def test_am_host_is_the_first_address_host(address: str, host: str | None) -> None:
    assert am_host(address) == host


@linux
def test_loopback_is_reached_through_lo() -> None:
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_towards("127.0.0.1") == "lo"
    assert interface_towards("127.0.0.2") == "lo"  # the whole 127/8 is local


@linux
def test_every_primary_ipv4_address_maps_back_to_its_interface() -> None:
    for _, name in socket.if_nameindex():
        address = iface._ipv4_address_of(name)
        if address is not None:
            assert interface_of(address) == name
            assert interface_towards(address) == name  # one's own address is routed over lo: the holder is named


def test_unknown_or_malformed_addresses_give_none() -> None:
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: held by no interface here
    assert interface_of("not an address") is None


def test_elan_iface_wins() -> None:
    env = {ENV_IFACE: " eth7 ", ENV_AM_ADDRESS: "tcp://127.0.0.1:5555"}
    assert transfer_interface(env) == "eth7"


@linux
def test_default_is_the_interface_towards_the_am() -> None:
    assert transfer_interface({ENV_AM_ADDRESS: "tcp://127.0.0.1:5555,tcp://127.0.0.9:1"}) == "lo"
    assert transfer_interface({}, am_address="tcp://127.0.0.1:1") == "lo"


def test_nothing_without_an_am_or_a_setting() -> None:
    assert transfer_interface({}) is None
    assert transfer_interface({ENV_AM_ADDRESS: "tcp://*:5555"}) is None


@linux
def test_bind_sets_only_what_the_user_did_not() -> None:
    env = {ENV_AM_ADDRESS: "tcp://127.0.0.1:5555", "NCCL_SOCKET_IFNAME": "ib0"}
    assert bind_transfer_interface(env) == "lo"
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["NCCL_SOCKET_IFNAME"] == "ib0"


def test_bind_without_an_interface_sets_nothing() -> None:
    env: dict[str, str] = {}
    assert bind_transfer_interface(env) is None
    assert env == {}


def test_no_torch_import() -> None:
    code = "import sys, lightning_elan.replication.iface; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
