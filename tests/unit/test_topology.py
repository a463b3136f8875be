from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

from lightning_elan.replication import topology as topo_mod
from lightning_elan.replication.topology import (
    L0_SAME_DEVICE,
    L1_P2P,
    L2_HOST_BRIDGE,
    L3_CROSS_SOCKET,
    L4_NETWORK,
    WorkerTopology,
    detect,
    link_level,
    normalize_bus_id,
    parse_cpulist,
    parse_smi_bus_ids,
    parse_topo_matrix,
    pci_ancestors,
    smi_links_for,
)


def gpu(bus: str, host: str = "n0", socket: int | None = 0, **fields: object) -> WorkerTopology:
    return WorkerTopology(host=host, device_type="cuda", device_index=0, pci_bus_id=bus, socket=socket, **fields)


def cpu(host: str = "n0", socket: int | None = 0, **fields: object) -> WorkerTopology:
    return WorkerTopology(host=host, socket=socket, **fields)


# ------------------------------------------------------------------ parsing


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),
        ("0000:3b:00.0", "0000:3b:00.0"),
        ("3B:00.0", "0000:3b:00.0"),
        (b"00000001:C1:1F.3\x00", "0001:c1:1f.3"),
    ],
)
def test_bus_ids_normalise_to_the_sysfs_form(raw: str | bytes, expected: str) -> None:
    assert normalize_bus_id(raw) == expected


def test_a_bad_bus_id_is_refused() -> None:
    with pytest.raises(ValueError, match="PCI bus id"):
        normalize_bus_id("GPU-1234")


def test_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []


TOPO_M = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV12\tPXB\tSYS\tPXB\t0-23\t0\t\tN/A\n"
    "GPU1\tNV12\t X \tPHB\tSYS\tPXB\t0-23\t0\t\tN/A\n"
    "GPU2\tPXB\tPHB\t X \tSYS\tSYS\t0-23\t0\t\tN/A\n"
    "GPU3\tSYS\tSYS\tSYS\t X \tSYS\t24-47\t1\t\tN/A\n"
    "NIC0\tPXB\tPXB\tSYS\tSYS\t X \n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
)
SMI_IDS = "0, 00000000:18:00.0\n1, 00000000:3B:00.0\n2, 00000000:86:00.0\n3, 00000000:AF:00.0\n"


def test_topo_matrix_keeps_gpu_columns_and_numa_affinity() -> None:
    matrix = parse_topo_matrix(TOPO_M)

    assert set(matrix) == {"GPU0", "GPU1", "GPU2", "GPU3"}
    assert matrix["GPU0"] == {"GPU1": "NV12", "GPU2": "PXB", "GPU3": "SYS", "NUMA Affinity": "0"}
    assert matrix["GPU3"]["NUMA Affinity"] == "1"


def test_smi_row_of_one_gpu_is_keyed_by_bus_id() -> None:
    links = smi_links_for("0000:3b:00.0", parse_topo_matrix(TOPO_M), parse_smi_bus_ids(SMI_IDS))

    assert links == {"0000:18:00.0": "NV12", "0000:86:00.0": "PHB", "0000:af:00.0": "SYS"}
    assert smi_links_for("0000:99:00.0", parse_topo_matrix(TOPO_M), parse_smi_bus_ids(SMI_IDS)) is None


# ------------------------------------------------------------------ link levels


def test_levels_from_host_and_device() -> None:
    a = gpu("0000:18:00.0")
    assert link_level(a, gpu("0000:18:00.0")) == L0_SAME_DEVICE
    assert link_level(a, gpu("0000:18:00.0", host="n1")) == L4_NETWORK
    assert link_level(cpu(), cpu(socket=0)) == L2_HOST_BRIDGE
    assert link_level(cpu(), cpu(socket=1)) == L3_CROSS_SOCKET
    assert link_level(cpu(), cpu(host="n1")) == L4_NETWORK


def test_unknown_sockets_on_one_host_count_as_one_socket_but_numa_nodes_split() -> None:
    assert link_level(cpu(socket=None), cpu(socket=None)) == L2_HOST_BRIDGE
    assert link_level(cpu(socket=None, numa_node=0), cpu(socket=None, numa_node=1)) == L3_CROSS_SOCKET


def test_same_host_name_but_other_boot_or_ipc_namespace_is_network() -> None:
    assert link_level(cpu(boot_id="a"), cpu(boot_id="b")) == L4_NETWORK
    assert link_level(cpu(ipc_namespace="ipc:[1]"), cpu(ipc_namespace="ipc:[2]")) == L4_NETWORK
    assert link_level(cpu(boot_id="a"), cpu(boot_id=None)) == L2_HOST_BRIDGE


def test_smi_codes_map_to_levels_and_are_symmetric() -> None:
    links = {"0000:02:00.0": "NV4", "0000:03:00.0": "PIX", "0000:04:00.0": "PHB", "0000:05:00.0": "SYS"}
    a = gpu("0000:01:00.0", gpu_links=links)
    expected = {"0000:02:00.0": L1_P2P, "0000:03:00.0": L1_P2P, "0000:04:00.0": L2_HOST_BRIDGE}
    expected["0000:05:00.0"] = L3_CROSS_SOCKET
    for bus, level in expected.items():
        b = gpu(bus, socket=None)
        assert link_level(a, b) == level
        assert link_level(b, a) == level


def test_a_switch_without_p2p_is_a_host_bridge_copy() -> None:
    a = gpu("0000:01:00.0", gpu_links={"0000:02:00.0": "PIX"}, p2p_peers=[])

    assert link_level(a, gpu("0000:02:00.0")) == L2_HOST_BRIDGE


def test_nvlink_peer_is_l1_even_across_sockets() -> None:
    a = gpu("0000:01:00.0", socket=0, nvlink_peers=["0000:81:00.0"])

    assert link_level(a, gpu("0000:81:00.0", socket=1)) == L1_P2P


def test_pci_paths_give_switch_host_bridge_and_socket_levels() -> None:
    root0, root1 = "pci0000:00", "pci0000:80"
    a = gpu("0000:03:00.0", pci_path=[root0, "0000:00:01.0", "0000:01:00.0", "0000:02:08.0"])
    same_switch = gpu("0000:04:00.0", pci_path=[root0, "0000:00:01.0", "0000:01:00.0", "0000:02:10.0"])
    other_port = gpu("0000:05:00.0", pci_path=[root0, "0000:00:02.0"])
    other_root_same_socket = gpu("0000:41:00.0", pci_path=["pci0000:40", "0000:40:01.0"])
    other_socket = gpu("0000:83:00.0", socket=1, pci_path=[root1, "0000:80:01.0"])

    assert link_level(a, same_switch) == L1_P2P
    assert link_level(a, other_port) == L2_HOST_BRIDGE
    assert link_level(a, other_root_same_socket) == L2_HOST_BRIDGE
    assert link_level(a, other_socket) == L3_CROSS_SOCKET


def test_p2p_capability_alone_is_l1() -> None:
    a = gpu("0000:01:00.0", p2p_peers=["0000:02:00.0"])
    assert link_level(a, gpu("0000:02:00.0")) == L1_P2P
    assert link_level(gpu("0000:02:00.0"), a) == L1_P2P


def test_cpu_and_gpu_worker_compare_sockets() -> None:
    assert link_level(cpu(socket=1), gpu("0000:01:00.0", socket=1)) == L2_HOST_BRIDGE
    assert link_level(cpu(socket=0), gpu("0000:01:00.0", socket=1)) == L3_CROSS_SOCKET


def test_topology_round_trips_through_json_and_ignores_unknown_keys() -> None:
    t = gpu("0000:01:00.0", gpu_links={"0000:02:00.0": "NV4"}, p2p_peers=["0000:02:00.0"], pci_path=["pci0000:00"])

    data = json.loads(json.dumps(t.to_dict()))
    data["added_in_a_later_version"] = 1

    assert WorkerTopology.from_dict(data) == t


# ------------------------------------------------------------------ detection


def make_sysfs(root: Path) -> Path:
    """A fake /sys: two sockets, one NUMA node each, a GPU behind a switch on node 1."""
    for cpu_id, package in enumerate([0, 0, 1, 1]):
        top = root / "devices" / "system" / "cpu" / f"cpu{cpu_id}" / "topology"
        top.mkdir(parents=True)
        (top / "physical_package_id").write_text(f"{package}\n")
    for node, cpus in enumerate(["0-1", "2-3"]):
        node_dir = root / "devices" / "system" / "node" / f"node{node}"
        node_dir.mkdir(parents=True)
        (node_dir / "cpulist").write_text(cpus + "\n")
    device = root / "devices" / "pci0000:80" / "0000:80:01.0" / "0000:81:00.0" / "0000:82:08.0" / "0000:83:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    (root / "bus" / "pci" / "devices").mkdir(parents=True)
    (root / "bus" / "pci" / "devices" / "0000:83:00.0").symlink_to(device)
    return root


def test_pci_ancestors_from_a_sysfs_link(tmp_path: Path) -> None:
    sysfs = make_sysfs(tmp_path)

    path = pci_ancestors(sysfs / "bus" / "pci" / "devices" / "0000:83:00.0", sysfs)

    assert path == ["pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:08.0"]


def test_detect_cpu_worker_reads_host_and_locality(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sysfs = make_sysfs(tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3}, raising=False)

    t = detect("cpu", sysfs=sysfs)

    assert t.device_type == "cpu" and t.pci_bus_id is None
    assert (t.socket, t.numa_node) == (1, 1)
    assert t.host and t.ipc_namespace == os.readlink("/proc/self/ns/ipc")


def test_detect_cpu_worker_spanning_sockets_leaves_them_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sysfs = make_sysfs(tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)

    t = detect(None, sysfs=sysfs)

    assert (t.socket, t.numa_node) == (None, None)


def test_detect_on_this_machine_is_cheap_and_json_able() -> None:
    t = detect("cpu")
    assert WorkerTopology.from_dict(json.loads(json.dumps(t.to_dict()))) == t


class FakeNvml(types.SimpleNamespace):
    """Two NVLinked GPUs on socket 0 and one GPU on socket 1, as NVML reports them."""

    BUSES = ["00000000:18:00.0", "00000000:3B:00.0", "00000000:86:00.0"]

    def __init__(self) -> None:
        super().__init__(NVML_NVLINK_MAX_LINKS=4, shut=False)

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 3

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetHandleByPciBusId(self, bus: bytes) -> int:
        return [normalize_bus_id(b) for b in self.BUSES].index(bus.decode())

    def nvmlDeviceGetPciInfo(self, h: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(busId=self.BUSES[h].encode())

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, caps: int) -> int:
        nvlinked = {a, b} == {0, 1}
        return 0 if (nvlinked or caps == 0) and {a, b} != {0, 2} else 1

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return 50 if 2 in (a, b) else 20

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> types.SimpleNamespace:
        if h == 0 and link < 2:
            return types.SimpleNamespace(busId=self.BUSES[1].encode())
        raise RuntimeError("no link")


def test_nvml_fills_links_p2p_and_nvlink_peers() -> None:
    t = WorkerTopology(host="n0", device_type="cuda", device_index=0, pci_bus_id="0000:18:00.0")
    nvml = FakeNvml()

    assert topo_mod._fill_from_nvml(t, nvml)

    assert t.gpu_links == {"0000:3b:00.0": "NV2", "0000:86:00.0": "SYS"}
    assert t.nvlink_peers == ["0000:3b:00.0"]
    assert t.p2p_peers == ["0000:3b:00.0"]
    assert t.gpu_source == "nvml" and nvml.shut


def test_detect_falls_back_to_cpu_fields_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails

    t = detect("cuda:0", use_smi=False)

    # this machine has no GPU: identity unknown, so the worker compares by host and socket only
    assert t.device_type == "cuda" and t.device_index == 0
    assert not t.is_gpu
    assert link_level(t, cpu(host=t.host, socket=t.socket)) == L2_HOST_BRIDGE
