"""Where a worker lives (host, GPU, PCIe path, NUMA node, socket, peers) and the link level between two workers.

A worker gathers its :class:`WorkerTopology` once, cheaply, with :func:`detect` and sends it (``to_dict()``, plain
JSON) to the application master with its ``register`` message. The master only uses the pure function
:func:`link_level`, which ranks the link between two workers as in Elan §IV:

* ``L0`` the same GPU (two processes on one device),
* ``L1`` GPU peer-to-peer: NVLink, or PCIe switches only (``NV#``, ``PIX``, ``PXB`` in ``nvidia-smi topo -m``),
* ``L2`` through a PCIe host bridge on one socket (``PHB``, ``NODE``): shared memory; CPU workers on one socket,
* ``L3`` across sockets (``SYS``: QPI/UPI/Infinity Fabric): shared memory, but a link that copies contend for,
* ``L4`` the network (another machine, or another IPC namespace on the same machine).

Detection order for the GPU fields: NVML (``pynvml``, from the ``nvidia-ml-py`` package) if importable, else
``nvidia-smi topo -m`` if on ``PATH``, else ``torch.cuda`` (bus id and ``can_device_access_peer`` over the visible
devices); NUMA node, socket and PCIe path always come from ``/sys``. Every probe is best effort: a field that cannot
be read stays ``None``/empty and :func:`link_level` falls back to coarser evidence.

This module imports neither torch nor NVML at import time (the application master imports it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "L0_SAME_DEVICE",
    "L1_P2P",
    "L2_HOST_BRIDGE",
    "L3_CROSS_SOCKET",
    "L4_NETWORK",
    "LEVEL_NAMES",
    "WorkerTopology",
    "detect",
    "link_level",
    "normalize_bus_id",
    "parse_cpulist",
    "parse_smi_bus_ids",
    "parse_topo_matrix",
]

L0_SAME_DEVICE = 0
L1_P2P = 1
L2_HOST_BRIDGE = 2
L3_CROSS_SOCKET = 3
L4_NETWORK = 4
LEVEL_NAMES = {
    L0_SAME_DEVICE: "L0 same device",
    L1_P2P: "L1 peer-to-peer",
    L2_HOST_BRIDGE: "L2 host bridge",
    L3_CROSS_SOCKET: "L3 cross-socket",
    L4_NETWORK: "L4 network",
}

# nvidia-smi topo -m vocabulary -> level ("NV<n>" is handled apart)
_SMI_CODE_LEVEL = {"X": L0_SAME_DEVICE, "PIX": L1_P2P, "PXB": L1_P2P, "PHB": L2_HOST_BRIDGE, "NODE": L2_HOST_BRIDGE}
_SMI_SYS = "SYS"
# NVML nvmlGpuTopologyLevel_t values -> nvidia-smi codes
_NVML_TOPOLOGY_CODES = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_NVML_P2P_CAPS_INDEX_READ = 0
_NVML_P2P_CAPS_INDEX_NVLINK = 2
_NVML_P2P_STATUS_OK = 0
_SMI_TIMEOUT_S = 5.0


@dataclass
class WorkerTopology:
    """Where one worker lives. JSON-able through :meth:`to_dict` / :meth:`from_dict`.

    ``pci_bus_id`` and the keys of ``gpu_links`` / entries of ``p2p_peers`` / ``nvlink_peers`` are normalised bus ids
    (``"0000:3b:00.0"``, see :func:`normalize_bus_id`). ``p2p_peers`` is ``None`` when unknown (an empty list means
    "known: no peer"). ``pci_path`` lists the PCI ancestors of the GPU from its root complex down (``["pci0000:3a",
    "0000:3a:00.0", "0000:3b:00.0", ...]``). ``gpu_links`` maps other GPUs of the host to their ``nvidia-smi topo -m``
    code as seen from this GPU (``"NV12"``, ``"PIX"``, ``"PXB"``, ``"PHB"``, ``"NODE"``, ``"SYS"``).
    """

    host: str
    device_type: str = "cpu"
    device_index: int | None = None
    pci_bus_id: str | None = None
    gpu_uuid: str | None = None
    numa_node: int | None = None
    socket: int | None = None
    pci_path: list[str] = field(default_factory=list)
    p2p_peers: list[str] | None = None
    nvlink_peers: list[str] = field(default_factory=list)
    gpu_links: dict[str, str] = field(default_factory=dict)
    boot_id: str | None = None
    ipc_namespace: str | None = None
    gpu_source: str = "none"  # where the GPU link fields came from: nvml, nvidia-smi, torch or none

    @property
    def is_gpu(self) -> bool:
        return self.device_type == "cuda" and (self.pci_bus_id is not None or self.gpu_uuid is not None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerTopology:
        """Build from :meth:`to_dict` output; unknown keys (a newer sender) are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    @classmethod
    def coerce(cls, value: WorkerTopology | Mapping[str, Any]) -> WorkerTopology:
        return value if isinstance(value, WorkerTopology) else cls.from_dict(value)


# --------------------------------------------------------------------------------------------
# link level (pure)
# --------------------------------------------------------------------------------------------


def link_level(a: WorkerTopology, b: WorkerTopology) -> int:
    """The level of the link between two workers (``L0``..``L4``); symmetric.

    Different machines (host names, or boot ids when both are known) or different IPC namespaces (no shared memory, no
    CUDA IPC) are ``L4``. Two GPU workers: the same bus id/UUID is ``L0``; otherwise the best evidence either side
    reported (NVLink peers, the ``nvidia-smi``/NVML code, the PCIe paths, P2P capability) and finally the sockets. CPU
    workers, or a CPU and a GPU worker: ``L2`` on one socket, ``L3`` across sockets (unknown sockets count as one).
    """
    if not _same_machine(a, b) or not _same_ipc_domain(a, b):
        return L4_NETWORK
    if a.is_gpu and b.is_gpu:
        return L0_SAME_DEVICE if _same_gpu(a, b) else _gpu_level(a, b)
    return _socket_level(a, b)


def _same_machine(a: WorkerTopology, b: WorkerTopology) -> bool:
    if a.host != b.host:
        return False
    return a.boot_id is None or b.boot_id is None or a.boot_id == b.boot_id


def _same_ipc_domain(a: WorkerTopology, b: WorkerTopology) -> bool:
    return a.ipc_namespace is None or b.ipc_namespace is None or a.ipc_namespace == b.ipc_namespace


def _same_gpu(a: WorkerTopology, b: WorkerTopology) -> bool:
    if a.pci_bus_id is not None and b.pci_bus_id is not None:
        return a.pci_bus_id == b.pci_bus_id
    return a.gpu_uuid is not None and a.gpu_uuid == b.gpu_uuid


def _gpu_level(a: WorkerTopology, b: WorkerTopology) -> int:
    """Two distinct GPUs on one machine: the level the strongest evidence either side reported gives.

    Evidence, strongest first: NVLink peers, a link code (NVML / ``nvidia-smi``), the two PCIe paths, P2P capability,
    sockets. Equal evidence from both sides (they normally agree) resolves to the lower level, so the result is
    symmetric.
    """
    strength_ab, level_ab = _gpu_evidence(a, b)
    strength_ba, level_ba = _gpu_evidence(b, a)
    if strength_ab != strength_ba:
        return level_ab if strength_ab > strength_ba else level_ba
    return min(level_ab, level_ba)


def _gpu_evidence(a: WorkerTopology, b: WorkerTopology) -> tuple[int, int]:
    """``(strength, level)`` of ``a`` -> ``b`` from what ``a`` reported."""
    peer = b.pci_bus_id
    if peer is not None and peer in a.nvlink_peers:
        return 4, L1_P2P
    code = a.gpu_links.get(peer) if peer is not None else None
    if code is not None:
        return 3, _code_level(code, a, b)
    if a.pci_path and b.pci_path:
        return 2, _code_level(_path_code(a, b), a, b)
    if a.p2p_peers is not None and peer in a.p2p_peers:
        return 1, L1_P2P
    return 0, _socket_level(a, b)


def _code_level(code: str, a: WorkerTopology, b: WorkerTopology) -> int:
    if code.startswith("NV"):
        return L1_P2P
    if code == _SMI_SYS:
        return L3_CROSS_SOCKET
    level = _SMI_CODE_LEVEL.get(code)
    if level is None:
        return _socket_level(a, b)
    if level == L1_P2P and not _p2p_allowed(a, b):
        return L2_HOST_BRIDGE  # one switch, but P2P disabled (ACS, consumer boards): copies go through the host
    return level


def _p2p_allowed(a: WorkerTopology, b: WorkerTopology) -> bool:
    """False only when ``a`` knows its P2P peers and ``b`` is not among them."""
    return a.p2p_peers is None or b.pci_bus_id in a.p2p_peers


def _path_code(a: WorkerTopology, b: WorkerTopology) -> str:
    """An ``nvidia-smi`` style code from the two PCIe ancestor paths."""
    if a.pci_path[0] != b.pci_path[0]:
        return "SYS" if _socket_level(a, b) == L3_CROSS_SOCKET else "NODE"
    common = 0
    for x, y in zip(a.pci_path, b.pci_path, strict=False):
        if x != y:
            break
        common += 1
    if common <= 1:
        return "PHB"  # only the root complex (host bridge) in common
    return "PIX" if common == len(a.pci_path) == len(b.pci_path) else "PXB"


def _socket_level(a: WorkerTopology, b: WorkerTopology) -> int:
    if a.socket is not None and b.socket is not None:
        return L2_HOST_BRIDGE if a.socket == b.socket else L3_CROSS_SOCKET
    if a.numa_node is not None and b.numa_node is not None and a.numa_node != b.numa_node:
        return L3_CROSS_SOCKET
    return L2_HOST_BRIDGE


# --------------------------------------------------------------------------------------------
# parsing helpers (pure)
# --------------------------------------------------------------------------------------------

_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def normalize_bus_id(bus_id: str | bytes) -> str:
    """``"00000000:3B:00.0"`` (NVML), ``"0000:3b:00.0"`` (sysfs, CUDA) or ``"3b:00.0"`` -> ``"0000:3b:00.0"``."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    match = _BUS_ID.match(text.strip().rstrip("\x00"))
    if match is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def parse_topo_matrix(text: str) -> dict[str, dict[str, str]]:
    """The GPU-to-GPU part of ``nvidia-smi topo -m``: ``{"GPU0": {"GPU1": "NV12", ...}, ...}``.

    Also returns, under the row's ``"NUMA Affinity"`` key, that column when present. NIC rows and columns are skipped.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return {}
    header = [cell.strip() for cell in lines[0].split("\t")]
    matrix: dict[str, dict[str, str]] = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.split("\t")]
        name = cells[0]
        if not re.fullmatch(r"GPU\d+", name):
            if name.startswith("Legend"):
                break
            continue
        row: dict[str, str] = {}
        for column, value in zip(header[1:], cells[1:], strict=False):
            if re.fullmatch(r"GPU\d+", column) and column != name:
                row[column] = value
            elif column == "NUMA Affinity" and value:
                row[column] = value
        matrix[name] = row
    return matrix


def parse_smi_bus_ids(text: str) -> dict[str, str]:
    """``nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader`` -> ``{"GPU0": "0000:3b:00.0", ...}``."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        index, _, bus_id = line.partition(",")
        if index.strip().isdigit() and bus_id.strip():
            out[f"GPU{index.strip()}"] = normalize_bus_id(bus_id.strip())
    return out


# --------------------------------------------------------------------------------------------
# detection (best effort, on the worker)
# --------------------------------------------------------------------------------------------


def detect(
    device: Any = None, *, sysfs: str | os.PathLike[str] = "/sys", use_nvml: bool = True, use_smi: bool = True
) -> WorkerTopology:
    """Gather this worker's topology for ``device`` (``None``/``"cpu"``, ``"cuda:1"``, an int or a torch device).

    Cheap: a few ``/sys`` reads, one NVML session or one ``nvidia-smi`` call for a GPU worker. Never raises for a
    missing probe; what could not be read stays unknown.
    """
    topo = WorkerTopology(
        host=socket.gethostname(), boot_id=_read(Path("/proc/sys/kernel/random/boot_id")), ipc_namespace=_ipc_ns()
    )
    sys_root = Path(sysfs)
    index = _cuda_index(device)
    if index is None:
        _fill_cpu_locality(topo, sys_root)
        return topo
    topo.device_type, topo.device_index = "cuda", index
    _fill_cuda_identity(topo, index)
    if topo.pci_bus_id is not None:
        _fill_gpu_links(topo, use_nvml=use_nvml, use_smi=use_smi)
        _fill_pci_locality(topo, sys_root)
    if topo.socket is None and topo.numa_node is None:
        _fill_cpu_locality(topo, sys_root)
    log.debug("topology of this worker: %s", topo)
    return topo


def _cuda_index(device: Any) -> int | None:
    if device is None:
        return None
    if isinstance(device, int):
        return device
    text = str(device)
    if not text.startswith("cuda"):
        return None
    _, _, index = text.partition(":")
    if index:
        return int(index)
    try:
        import torch

        return torch.cuda.current_device()
    except Exception:
        return 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ipc_ns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/ipc")
    except OSError:
        return None


def _fill_cuda_identity(topo: WorkerTopology, index: int) -> None:
    """Bus id and UUID of CUDA device ``index`` (as this process numbers it) through torch."""
    try:
        import torch

        props = torch.cuda.get_device_properties(index)
        topo.pci_bus_id = normalize_bus_id(f"{props.pci_domain_id:x}:{props.pci_bus_id:x}:{props.pci_device_id:x}.0")
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            topo.gpu_uuid = str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}"
    except Exception as error:
        log.debug("no CUDA identity for device %s: %s", index, error)


def _fill_gpu_links(topo: WorkerTopology, *, use_nvml: bool, use_smi: bool) -> None:
    if use_nvml:
        nvml = _import_nvml()
        if nvml is not None and _fill_from_nvml(topo, nvml):
            return
    if use_smi and shutil.which("nvidia-smi") and _fill_from_smi(topo):
        return
    _fill_from_torch(topo)


def _import_nvml() -> Any:
    try:
        import pynvml  # type: ignore[import-not-found]
    except Exception:
        return None
    return pynvml


def _fill_from_nvml(topo: WorkerTopology, nvml: Any) -> bool:
    """GPU links, P2P and NVLink peers from NVML; False if NVML does not answer."""
    try:
        nvml.nvmlInit()
    except Exception as error:
        log.debug("NVML unavailable: %s", error)
        return False
    try:
        me = nvml.nvmlDeviceGetHandleByPciBusId(topo.pci_bus_id.encode())
        links, p2p, nvlink = {}, [], []
        for i in range(nvml.nvmlDeviceGetCount()):
            other = nvml.nvmlDeviceGetHandleByIndex(i)
            bus = normalize_bus_id(nvml.nvmlDeviceGetPciInfo(other).busId)
            if bus == topo.pci_bus_id:
                continue
            if _nvml_p2p(nvml, me, other, _NVML_P2P_CAPS_INDEX_NVLINK):
                nvlink.append(bus)
            ancestor = nvml.nvmlDeviceGetTopologyCommonAncestor(me, other)
            links[bus] = (
                f"NV{_nvlink_count(nvml, me, bus)}"
                if bus in nvlink
                else _NVML_TOPOLOGY_CODES.get(int(ancestor), _SMI_SYS)
            )
            if _nvml_p2p(nvml, me, other, _NVML_P2P_CAPS_INDEX_READ):
                p2p.append(bus)
        topo.gpu_links, topo.p2p_peers, topo.nvlink_peers, topo.gpu_source = links, p2p, nvlink, "nvml"
        return True
    except Exception as error:
        log.debug("NVML topology query failed: %s", error)
        return False
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _nvml_p2p(nvml: Any, a: Any, b: Any, caps_index: int) -> bool:
    try:
        return int(nvml.nvmlDeviceGetP2PStatus(a, b, caps_index)) == _NVML_P2P_STATUS_OK
    except Exception:
        return False


def _nvlink_count(nvml: Any, handle: Any, peer_bus: str) -> int:
    """How many NVLinks of ``handle`` end at ``peer_bus`` (at least 1 when NVML says they are NVLink peers)."""
    count = 0
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        except Exception:
            continue
        try:
            count += normalize_bus_id(remote.busId) == peer_bus
        except ValueError:
            continue
    return max(count, 1)


def _fill_from_smi(topo: WorkerTopology) -> bool:
    try:
        matrix_text = _run(["nvidia-smi", "topo", "-m"])
        ids_text = _run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"])
    except (OSError, subprocess.SubprocessError) as error:
        log.debug("nvidia-smi failed: %s", error)
        return False
    links = smi_links_for(topo.pci_bus_id or "", parse_topo_matrix(matrix_text), parse_smi_bus_ids(ids_text))
    if links is None:
        return False
    topo.gpu_links = links
    topo.nvlink_peers = [bus for bus, code in links.items() if code.startswith("NV")]
    topo.gpu_source = "nvidia-smi"
    return True


def smi_links_for(bus_id: str, matrix: dict[str, dict[str, str]], bus_ids: dict[str, str]) -> dict[str, str] | None:
    """This GPU's row of a parsed ``topo -m`` matrix, keyed by bus id; None if the GPU is not in it."""
    name = next((gpu for gpu, bus in bus_ids.items() if bus == bus_id), None)
    if name is None or name not in matrix:
        return None
    return {bus_ids[other]: code for other, code in matrix[name].items() if other in bus_ids}


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=_SMI_TIMEOUT_S).stdout


def _fill_from_torch(topo: WorkerTopology) -> None:
    """P2P peers among the devices this process sees (the coarsest source; no link codes)."""
    try:
        import torch

        peers = []
        for other in range(torch.cuda.device_count()):
            if other == topo.device_index:
                continue
            props = torch.cuda.get_device_properties(other)
            bus = normalize_bus_id(f"{props.pci_domain_id:x}:{props.pci_bus_id:x}:{props.pci_device_id:x}.0")
            if torch.cuda.can_device_access_peer(topo.device_index, other):
                peers.append(bus)
        topo.p2p_peers, topo.gpu_source = peers, "torch"
    except Exception as error:
        log.debug("torch.cuda peer query failed: %s", error)


def _fill_pci_locality(topo: WorkerTopology, sys_root: Path) -> None:
    """PCIe ancestors, NUMA node and socket of the GPU from ``/sys/bus/pci/devices/<bus id>``."""
    device_dir = sys_root / "bus" / "pci" / "devices" / (topo.pci_bus_id or "")
    if not device_dir.exists():
        return
    topo.pci_path = pci_ancestors(device_dir, sys_root)
    node = _read(device_dir / "numa_node")
    if node is not None and node.lstrip("-").isdigit() and int(node) >= 0:
        topo.numa_node = int(node)
        topo.socket = _socket_of_cpus(_node_cpus(sys_root, int(node)), sys_root)
    if topo.socket is None:
        local = _read(device_dir / "local_cpulist")
        if local:
            topo.socket = _socket_of_cpus(parse_cpulist(local), sys_root)


def pci_ancestors(device_dir: Path, sys_root: Path = Path("/sys")) -> list[str]:
    """PCI ancestors of a device from its sysfs path: ``["pci0000:3a", "0000:3a:00.0", ...]`` (itself excluded)."""
    real = Path(os.path.realpath(device_dir))
    parts = real.parts
    devices = Path(os.path.realpath(sys_root / "devices")).parts
    if parts[: len(devices)] != devices:
        return []
    chain = list(parts[len(devices) :])
    start = next((i for i, part in enumerate(chain) if part.startswith("pci")), None)
    return chain[start:-1] if start is not None else []


def _fill_cpu_locality(topo: WorkerTopology, sys_root: Path) -> None:
    """NUMA node and socket of the CPUs this process may run on, when they are all on one."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return
    topo.socket = _socket_of_cpus(cpus, sys_root)
    nodes = {node for node, node_cpus in _numa_nodes(sys_root).items() if set(cpus) & set(node_cpus)}
    if len(nodes) == 1:
        topo.numa_node = nodes.pop()


def _numa_nodes(sys_root: Path) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    node_dir = sys_root / "devices" / "system" / "node"
    try:
        entries = list(node_dir.iterdir())
    except OSError:
        return out
    for entry in entries:
        match = re.fullmatch(r"node(\d+)", entry.name)
        text = _read(entry / "cpulist") if match else None
        if match and text is not None:
            out[int(match.group(1))] = parse_cpulist(text)
    return out


def _node_cpus(sys_root: Path, node: int) -> list[int]:
    text = _read(sys_root / "devices" / "system" / "node" / f"node{node}" / "cpulist")
    return parse_cpulist(text) if text else []


def _socket_of_cpus(cpus: Iterable[int], sys_root: Path) -> int | None:
    """The physical package (socket) of ``cpus`` when they all share one, else None."""
    packages = set()
    for cpu in cpus:
        text = _read(sys_root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology" / "physical_package_id")
        if text is None or not text.lstrip("-").isdigit():
            return None
        packages.add(int(text))
    return packages.pop() if len(packages) == 1 else None
