"""Several hosts on this machine: network namespaces joined by a Linux bridge (tests and ``bench.netns_bandwidth``).

:class:`FakeHosts` creates, in the root namespace, a bridge ``<prefix>br`` with the address ``10.X.Y.1/24`` and, for
each host ``i``, a network namespace ``<prefix>h<i>`` whose end of a veth pair (renamed ``eth0``) has ``10.X.Y.(10+i)``
and is enslaved to the bridge on the other side. Each host also gets a *holder* process started as::

    ip netns exec NS unshare --uts --ipc --mount --propagation private \\
        sh -c 'hostname hostI; mount -t tmpfs tmpfs /dev/shm; exec cat'

so it has its own host name, IPC namespace and ``/dev/shm``: to the topology probe it is another machine and no shared
memory crosses between hosts. :meth:`FakeHost.popen` / :meth:`FakeHost.run` enter the holder's namespaces
(``nsenter --target HOLDER --net --uts --ipc --mount``), so every process of one host shares its host name, IPC
namespace and ``/dev/shm``, as processes on one machine do.

Names start with ``elan<pid in base 36><counter>`` (unique per process and per instance; every interface name stays
within the kernel's 15 characters) and the subnet is picked so that it overlaps no route of this machine. The hosts
reach only each other and the bridge's address: no default route, nothing else on the network.
:meth:`FakeHosts.close` (also run by ``atexit`` and on a failed setup) kills every process started through a host by
its process group, then any process left in a namespace by its PID, the holders, and deletes the namespaces and the
bridge (the veth pairs go with their namespaces). Needs root, ``ip`` (iproute2), ``unshare`` and ``nsenter``
(util-linux); :class:`FakeHostsUnavailable` says why not otherwise.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["FakeHost", "FakeHosts", "FakeHostsUnavailable", "unavailable_reason"]

_COUNTER = itertools.count()
_MAX_HOSTS = 36  # one base-36 digit per host in the interface names
_CMD_TIMEOUT_S = 20.0
_KILL_WAIT_S = 5.0
_HOLDER_SCRIPT = 'hostname "$0" && mount -t tmpfs -o size=50% tmpfs /dev/shm && echo ready && exec cat'
_REQUIRED_TOOLS = ("ip", "unshare", "nsenter")


class FakeHostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, a tool missing, or the kernel refused)."""


def unavailable_reason() -> str | None:
    """Why :class:`FakeHosts` cannot work on this machine before trying (None: it may; creating them is the test)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "fake hosts need root (network namespaces, a bridge and veth pairs)"
    missing = [tool for tool in _REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"fake hosts need {', '.join(missing)} (iproute2, util-linux)"
    return None


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        number, rest = divmod(number, 36)
        out = digits[rest] + out
        if number == 0:
            return out


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
    if check and result.returncode != 0:
        raise FakeHostsUnavailable(f"`{' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _routed_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 destination this machine routes somewhere, in any table (``default`` excluded)."""
    networks = []
    for line in _sh("ip", "-4", "-o", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        if words and words[0] in ("local", "broadcast", "unicast", "multicast", "anycast", "blackhole"):
            words = words[1:]
        if not words or words[0] == "default":
            continue
        try:
            networks.append(ipaddress.IPv4Network(words[0], strict=False))
        except ValueError:
            continue
    return networks


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A ``10.X.Y.0/24`` (X in 100..199) that overlaps no route of this machine, tried from a seed."""
    taken = _routed_networks()
    for attempt in range(256):
        value = (seed * 7919 + attempt * 104729) % (100 * 256)
        candidate = ipaddress.IPv4Network(f"10.{100 + value // 256}.{value % 256}.0/24")
        if not any(candidate.overlaps(network) for network in taken):
            return candidate
    raise FakeHostsUnavailable("no free 10.X.Y.0/24 subnet for the fake hosts")


@dataclass
class FakeHost:
    """One fake host: a network namespace with its own host name, IPC namespace and ``/dev/shm``."""

    index: int
    namespace: str
    hostname: str
    address: str  # its address on the bridge
    veth: str  # the root namespace's end of its veth pair (on the bridge)
    interface: str = "eth0"
    holder: subprocess.Popen[bytes] | None = None
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def command(self, argv: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """``argv`` wrapped to run inside this host, in ``cwd`` (default: the current directory)."""
        if self.holder is None or self.holder.poll() is not None:
            raise RuntimeError(f"fake host {self.hostname} is not running")
        target, wd = str(self.holder.pid), os.fspath(cwd or os.getcwd())
        return ["nsenter", "--target", target, "--net", "--uts", "--ipc", "--mount", f"--wd={wd}", "--", *argv]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host in a process group of its own; it is killed by :meth:`FakeHosts.close`."""
        kwargs.setdefault("start_new_session", True)
        argv = self.command(argv, kwargs.pop("cwd", None))
        process = subprocess.Popen(argv, env=dict(env) if env is not None else None, **kwargs)
        self.processes.append(process)
        return process

    def run(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this host to completion; stdout and stderr are captured as text."""
        process = self.popen(argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            stdout, stderr = process.communicate()
            raise
        result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, process.args, stdout, stderr)
        return result

    def kill_processes(self) -> None:
        """Kill (by process group, then wait for) every process started through this host."""
        for process in self.processes:
            _kill_group(process)
        self.processes.clear()


def _kill_group(process: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group ``process`` leads (it was started with a session of its own) and reap it."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:
            process.kill()
    try:
        process.wait(timeout=_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        log.warning("process %d did not exit after SIGKILL", process.pid)


class FakeHosts:
    """``n`` fake hosts joined by a bridge; a context manager (``with FakeHosts(2) as hosts: hosts[0].run(...)``)."""

    def __init__(self, n: int = 2) -> None:
        if not 1 <= n <= _MAX_HOSTS:
            raise ValueError(f"between 1 and {_MAX_HOSTS} fake hosts, got {n}")
        reason = unavailable_reason()
        if reason is not None:
            raise FakeHostsUnavailable(reason)
        serial = next(_COUNTER)
        self.prefix = f"elan{_base36(os.getpid())}{_base36(serial)}"
        self.bridge = f"{self.prefix}br"
        self.subnet = _free_subnet(os.getpid() * 64 + serial)
        self.bridge_address = str(self.subnet.network_address + 1)
        self.hosts: list[FakeHost] = []
        self._bridge_made = False
        self._closed = False
        atexit.register(self.close)
        try:
            self._create(n)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ life cycle

    def _create(self, n: int) -> None:
        t0 = time.perf_counter()
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        _sh("ip", "addr", "add", f"{self.bridge_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for i in range(n):
            name = _base36(i)
            address = str(self.subnet.network_address + 10 + i)
            host = FakeHost(i, f"{self.prefix}h{name}", f"host{i}", address, f"{self.prefix}v{name}")
            _sh("ip", "netns", "add", host.namespace)
            self.hosts.append(host)  # from here on close() removes it
            self._wire(host)
        for host in self.hosts:
            self._start_holder(host)
        log.info("fake hosts %s on %s ready in %.2f s", [h.hostname for h in self.hosts], self.subnet,
                 time.perf_counter() - t0)

    def _wire(self, host: FakeHost) -> None:
        """A veth pair from the bridge into the host's namespace (``eth0`` there, with its address), loopback up."""
        outside, inside = host.veth, f"{self.prefix}p{_base36(host.index)}"
        _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        _sh("ip", "link", "set", inside, "netns", host.namespace)
        _sh("ip", "link", "set", outside, "master", self.bridge)
        _sh("ip", "link", "set", outside, "up")
        ns = ("ip", "-n", host.namespace)
        _sh(*ns, "link", "set", inside, "name", host.interface)
        _sh(*ns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", host.interface)
        _sh(*ns, "link", "set", host.interface, "up")
        _sh(*ns, "link", "set", "lo", "up")

    def _start_holder(self, host: FakeHost) -> None:
        argv = ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "--ipc", "--mount", "--propagation",
                "private", "sh", "-c", _HOLDER_SCRIPT, host.hostname]
        holder = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  start_new_session=True)
        host.holder = holder
        assert holder.stdout is not None
        line = holder.stdout.readline()  # "ready", or EOF when the set-up failed
        if line.strip() != b"ready":
            _, stderr = holder.communicate(timeout=_CMD_TIMEOUT_S)
            raise FakeHostsUnavailable(f"cannot make fake host {host.hostname}: {stderr.decode().strip()}")

    def close(self) -> None:
        """Kill everything started in the hosts, then delete the namespaces and the bridge (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for host in self.hosts:
            host.kill_processes()
        for host in self.hosts:
            self._stop_holder(host)
            self._kill_leftovers(host)
            _sh("ip", "link", "del", host.veth, check=False)  # at once: a namespace's devices go asynchronously
            _sh("ip", "netns", "del", host.namespace, check=False)
        if self._bridge_made:
            _sh("ip", "link", "del", self.bridge, check=False)
        log.info("fake hosts %s removed", self.prefix)

    @staticmethod
    def _stop_holder(host: FakeHost) -> None:
        holder = host.holder
        if holder is None:
            return
        if holder.stdin is not None:
            holder.stdin.close()  # cat ends at EOF
        if holder.poll() is None:
            try:
                holder.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                _kill_group(holder)
        for stream in (holder.stdout, holder.stderr):
            if stream is not None:
                stream.close()

    @staticmethod
    def _kill_leftovers(host: FakeHost) -> None:
        """Whatever still runs in the namespace (a daemon a test started): only our processes can be in it."""
        pids = _sh("ip", "netns", "pids", host.namespace, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                continue
            log.warning("killed process %s left in fake host %s", pid, host.hostname)

    def __enter__(self) -> FakeHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ access

    def __getitem__(self, index: int) -> FakeHost:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[FakeHost]:
        return iter(self.hosts)
