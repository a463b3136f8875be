"""One parser for every AM address (``lightning_elan.protocol.addresses``): ``HOST:PORT``, ``tcp://HOST:PORT`` and
``HOST`` become ``tcp://HOST:PORT`` wherever an address comes in (``elan am --bind``, ``--am``, ``$ELAN_AM``,
``$ELAN_AM_ADDRESS``, ``AMClient``); anything else is refused with one line naming the accepted forms."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.procs import free_port
from lightning_elan.launcher.enrolled import am_addresses
from lightning_elan.master.server import ApplicationMaster
from lightning_elan.master.store import MemoryStore
from lightning_elan.protocol import AMClient
from lightning_elan.protocol.addresses import (
    ADDRESS_FORMS,
    DEFAULT_AM_PORT,
    am_address,
    am_address_list,
    bind_address,
    split_am_addresses,
)
from lightning_elan.protocol.client import split_addresses
from lightning_elan.protocol.contract import WorkerEnvironment

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("text", "canonical"), [
    ("127.0.0.1:29400", "tcp://127.0.0.1:29400"),
    ("tcp://127.0.0.1:29400", "tcp://127.0.0.1:29400"),
    (" elan-am:5555 ", "tcp://elan-am:5555"),
    ("node-7.cluster.local", f"tcp://node-7.cluster.local:{DEFAULT_AM_PORT}"),
    ("tcp://10.0.0.5", f"tcp://10.0.0.5:{DEFAULT_AM_PORT}"),
    ("[::1]:80", "tcp://[::1]:80"),
    ("tcp://[fe80::1%eth0]:80", "tcp://[fe80::1%eth0]:80"),
    ("[::1]", f"tcp://[::1]:{DEFAULT_AM_PORT}"),
])
def test_the_three_forms_become_one(text: str, canonical: str) -> None:
    assert am_address(text) == canonical
    assert bind_address(text) == canonical


@pytest.mark.parametrize("text", [
    "", "tcp://", ":80", "h:", "h:x", "h:0", "h:65536", "h:-1", "h:1:2", "::1:80", "[::1", "[zz]:1", "[::1]x",
    "h :1", "*:80", "ipc:///tmp/am", "http://h:80", "udp://h:80", "h/x:80", "h:１２",
])
def test_other_forms_are_refused_naming_the_accepted_ones(text: str) -> None:
    with pytest.raises(ValueError, match="bad AM address") as error:
        am_address(text)
    assert ADDRESS_FORMS in str(error.value) and "\n" not in str(error.value)


def test_a_bind_address_may_be_any_port_and_every_interface() -> None:
    assert bind_address("127.0.0.1:0") == "tcp://127.0.0.1:0"
    assert bind_address("*:29400") == "tcp://*:29400"
    assert bind_address("tcp://0.0.0.0") == f"tcp://0.0.0.0:{DEFAULT_AM_PORT}"
    with pytest.raises(ValueError, match=r"0\.\.65535"):
        bind_address("h:70000")


def test_address_lists_everywhere_use_the_one_parser() -> None:
    text = "a:1, tcp://b:2,c"
    expected = ["tcp://a:1", "tcp://b:2", f"tcp://c:{DEFAULT_AM_PORT}"]
    assert split_am_addresses(text) == split_addresses(text) == expected
    assert am_address_list(text) == am_addresses(text) == ",".join(expected)
    for bad in ("", ",", "a:1,", ",a:1", "a:1,,b:2"):
        with pytest.raises(ValueError, match="bad AM address list"):
            split_addresses(bad)
    with pytest.raises(ValueError, match="bad AM address 'b:x'"):
        am_addresses("a:1,b:x")


def test_elan_am_address_is_read_in_any_form_and_a_bad_one_is_named() -> None:
    env = {"ELAN_AM_ADDRESS": "127.0.0.1:7,node-b", "ELAN_STORE_ADDRESS": "127.0.0.1:2", "ELAN_JOB": "j",
           "ELAN_WORKER_ID": "w0"}
    assert WorkerEnvironment.from_env(env).am_address == f"tcp://127.0.0.1:7,tcp://node-b:{DEFAULT_AM_PORT}"
    with pytest.raises(ValueError, match="ELAN_AM_ADDRESS: bad AM address 'x:y'"):
        WorkerEnvironment.from_env({**env, "ELAN_AM_ADDRESS": "x:y"})


def test_a_client_given_host_colon_port_reaches_the_am() -> None:
    port = free_port()
    with ApplicationMaster("job", MemoryStore(), bind=f"tcp://127.0.0.1:{port}", register=False), \
            AMClient(f"127.0.0.1:{port}", "job", timeout_s=2.0) as client:
        assert client.status()["job"] == "job"


def test_elan_am_binds_host_colon_port_and_elan_status_reaches_it(tmp_path: Path) -> None:
    """The form of the issue (`elan am --bind 127.0.0.1:29400` died with a ZMQError traceback)."""
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ELAN_")}, "ELAN_HOME": str(tmp_path)}
    elan = [sys.executable, "-m", "lightning_elan.cli"]
    am = subprocess.Popen([*elan, "am", "--job", "bindjob", "--bind", f"127.0.0.1:{port}"], env=env, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            status = subprocess.run([*elan, "status", "--job", "bindjob", "--am", f"127.0.0.1:{port}", "--timeout",
                                     "0.5"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
            if status.returncode == 0 or time.monotonic() > deadline or am.poll() is not None:
                break
        assert status.returncode == 0, status.stderr
        assert "job bindjob" in status.stdout
    finally:
        am.send_signal(signal.SIGTERM)
        _, err = am.communicate(timeout=30)
    assert am.returncode == 0, err
    assert "Traceback" not in err and f"tcp://127.0.0.1:{port}" in err, err
