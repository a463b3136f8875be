"""Several hosts on this machine (network namespaces on a bridge, ``hosts.py``): a gloo all-reduce between them, host
identity and the planner's network level, and a state replicated across hosts bit-exactly over the collective."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest

from lightning_elan.protocol.contract import ENV_AM_ADDRESS, AdjustmentPlan
from lightning_elan.replication.planner import TRANSPORT_COLLECTIVE, TRANSPORT_SHM, plan_transfers
from lightning_elan.replication.topology import L2_HOST_BRIDGE, L4_NETWORK, WorkerTopology, link_level
from tests.multihost.conftest import Spawn, result_of, worker_env
from tests.multihost.hosts import FakeHosts, FakeHostsUnavailable

pytestmark = [pytest.mark.multihost, pytest.mark.integration]

PORT = 29511  # free in a fresh namespace


def test_hosts_are_separate_machines_on_one_network(two_hosts: FakeHosts) -> None:
    a, b = two_hosts
    probe = "hostname; readlink /proc/self/ns/ipc; touch /dev/shm/elan-probe; ls /dev/shm"
    out_a = a.run(["sh", "-c", probe]).stdout.split()
    out_b = b.run(["sh", "-c", "hostname; readlink /proc/self/ns/ipc; ls /dev/shm"]).stdout.split()
    again_a = a.run(["sh", "-c", probe]).stdout.split()
    assert out_a[0] == "host0" and out_b[0] == "host1"
    assert out_a[1] != out_b[1] and again_a[1] == out_a[1]  # one IPC namespace per host, shared by its processes
    assert out_b[2:] == [] and "elan-probe" in out_a[2:]  # /dev/shm is the host's own
    routes = b.run(["ip", "-4", "-o", "route"]).stdout
    assert "default" not in routes and str(two_hosts.subnet) in routes  # they reach each other only


def test_gloo_all_reduce_across_hosts(two_hosts: FakeHosts, spawn: Spawn) -> None:
    master = two_hosts[0].address
    runs = []
    for rank, host in enumerate(two_hosts):
        args = {"master": master, "port": PORT, "rank": rank, "world_size": 2}
        runs.append((spawn(host, "allreduce", args), args))
    results = [result_of(process, args) for process, args in runs]
    assert [r["sum"] for r in results] == [[3.0] * 4, [3.0] * 4]
    assert [r["ifname"] for r in results] == ["eth0", "eth0"]
    assert [r["hostname"] for r in results] == ["host0", "host1"]


def _topologies(spawn: Spawn, hosts: list[Any]) -> list[WorkerTopology]:
    runs = []
    for host in hosts:
        args: dict[str, Any] = {}
        runs.append((spawn(host, "topology", args), args))
    return [WorkerTopology.from_dict(result_of(process, args)) for process, args in runs]


def test_host_identity_and_the_network_level(two_hosts: FakeHosts, spawn: Spawn) -> None:
    a, b = two_hosts
    on_a, also_on_a, on_b = _topologies(spawn, [a, a, b])
    assert (on_a.host, also_on_a.host, on_b.host) == ("host0", "host0", "host1")
    assert on_a.ipc_namespace == also_on_a.ipc_namespace != on_b.ipc_namespace
    assert link_level(on_a, on_b) == L4_NETWORK
    assert link_level(on_a, also_on_a) == L2_HOST_BRIDGE

    transfers = {t.joiner: t for t in plan_transfers({"w0": on_a}, {"w1": also_on_a, "w2": on_b})}
    assert (transfers["w1"].source, transfers["w1"].level, transfers["w1"].transport) == ("w0", 2, TRANSPORT_SHM)
    assert (transfers["w2"].source, transfers["w2"].level, transfers["w2"].transport) == (
        "w0", L4_NETWORK, TRANSPORT_COLLECTIVE)
    # a host name alone tells machines apart too (two containers with one IPC namespace type, another boot)
    renamed = WorkerTopology.from_dict({**on_a.to_dict(), "host": "elsewhere"})
    assert link_level(on_a, renamed) == L4_NETWORK


def _plan(source: WorkerTopology, joiner: WorkerTopology) -> AdjustmentPlan:
    transfers = plan_transfers({"w0": source}, {"w1": joiner})
    return AdjustmentPlan(
        request_id="r1", action="add", generation=1, previous_generation=0, step=10, members=["w0", "w1"],
        previous_members=["w0"], joiners=["w1"], leavers=[], sources={"w1": "w0"},
        hosts={"w0": source.host, "w1": joiner.host}, transfers=transfers,
    )  # fmt: skip


def test_replication_across_hosts_is_bit_exact(two_hosts: FakeHosts, spawn: Spawn) -> None:
    a, b = two_hosts
    plan = _plan(*_topologies(spawn, [a, b]))
    assert plan.transfers is not None and plan.transfers[0].transport == TRANSPORT_COLLECTIVE
    # the AM's address is only used to find the interface: the route towards it (no AM runs here)
    env = worker_env(**{ENV_AM_ADDRESS: f"tcp://{a.address}:5555"})
    common = {"store_host": a.address, "store_port": PORT, "plan": plan.to_dict(), "seed": 7, "numel": 300_000}
    runs: list[tuple[subprocess.Popen, dict[str, Any]]] = []
    for host, role, worker in ((a, "source", "w0"), (b, "joiner", "w1")):
        args = {**common, "worker": worker}
        runs.append((spawn(host, role, args, env), args))
    source, joiner = (result_of(process, args) for process, args in runs)
    assert joiner["route"] == TRANSPORT_COLLECTIVE
    assert joiner["digest"] == source["digest"]
    assert joiner["bytes_received"] == source["bytes_sent"] > 300_000 * 8
    assert source["gloo_ifname"] == joiner["gloo_ifname"] == "eth0"  # chosen by bind_transfer_interface
    assert (source["hostname"], joiner["hostname"]) == ("host0", "host1")


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _left_behind(hosts: FakeHosts) -> list[str]:
    names = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names += subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in names.splitlines() if hosts.prefix in line]


def test_close_kills_what_ran_in_the_hosts_and_removes_them(fake_hosts_available: None) -> None:
    hosts = FakeHosts(2)
    sleeper = hosts[1].popen(["sleep", "60"])
    escaped = int(hosts[0].run(["sh", "-c", "setsid sleep 60 >/dev/null 2>&1 & echo $!"]).stdout)  # own session
    assert _left_behind(hosts)
    hosts.close()
    assert sleeper.poll() is not None
    assert _gone(escaped)  # found in the namespace by `ip netns pids` and killed by its PID
    assert _left_behind(hosts) == []
    hosts.close()  # idempotent


def test_a_failed_setup_removes_what_it_made(fake_hosts_available: None, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[FakeHosts] = []

    def refuse(self: FakeHosts, host: Any) -> None:
        made.append(self)
        raise FakeHostsUnavailable("refused for the test")

    monkeypatch.setattr(FakeHosts, "_start_holder", refuse)
    with pytest.raises(FakeHostsUnavailable, match="refused for the test"):
        FakeHosts(2)
    assert made and _left_behind(made[0]) == []
