"""Which network interface a worker's collectives bind: the one that reaches the other hosts.

Gloo (and NCCL's sockets) pick an interface by resolving the host name unless told otherwise; on a machine whose name
does not resolve, or resolves to a loopback or management address, workers on other hosts cannot reach that
interface. :func:`bind_transfer_interface` runs once at a worker's start-up, before any process group exists: it sets
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` (each only when the user did not) to :func:`transfer_interface`:

1. ``$ELAN_IFACE`` when set;
2. else the interface of this host's route towards the application master (the first address of
   ``$ELAN_AM_ADDRESS``, ``tcp://HOST:PORT[,tcp://HOST:PORT…]``): the AM is reached by every worker, so the interface
   that reaches it is the one on the job's network (``lo`` for a job on one machine whose AM is on loopback);
3. else nothing is set (torch's defaults apply).

:func:`interface_towards` finds that interface without sending anything: a UDP socket ``connect`` only asks the
kernel for the route and the source address it would use; the address is then mapped to the interface that holds it
(``SIOCGIFADDR`` for IPv4 primary addresses, the connected routes of ``/proc/net/route`` for secondary ones,
``/proc/net/if_inet6`` for IPv6). Linux only; elsewhere the functions return None. No torch import.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from lightning_elan.protocol.contract import ENV_AM_ADDRESS, ENV_IFACE

log = logging.getLogger(__name__)

__all__ = [
    "SOCKET_IFNAME_VARS",
    "am_host",
    "bind_transfer_interface",
    "collective_address",
    "interface_of",
    "interface_towards",
    "local_address_towards",
    "transfer_interface",
]

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""What :func:`bind_transfer_interface` sets: the interface Gloo and NCCL's socket transport bind."""

_SIOCGIFADDR = 0x8915
_IFNAMSIZ = 16
_DISCARD_PORT = 9  # any port: a UDP connect sends nothing
_PROC_ROUTE = Path("/proc/net/route")
_PROC_IF_INET6 = Path("/proc/net/if_inet6")
_UNSPECIFIED_HOSTS = ("", "*", "0.0.0.0", "::")


def local_address_towards(host: str) -> str | None:
    """The local address this machine would send from to reach ``host`` (a name or an address); None if unroutable."""
    try:
        infos = socket.getaddrinfo(host, _DISCARD_PORT, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError) as error:
        log.debug("cannot resolve %r: %s", host, error)
        return None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(sockaddr)  # UDP: picks the route and the source address, sends no packet
            except OSError as error:
                log.debug("no route to %s: %s", sockaddr[0], error)
                continue
            return str(probe.getsockname()[0]).split("%", 1)[0]
    return None


def interface_of(address: str) -> str | None:
    """The name of the local interface that holds ``address`` (``"127.0.0.1"`` → ``"lo"``); None if none does."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if ip.version == 6:
        return _ipv6_interface(ip)
    return _ipv4_primary_interface(ip) or _ipv4_connected_interface(ip)


def interface_towards(host: str) -> str | None:
    """The local interface whose route reaches ``host`` (``"127.0.0.1"`` → ``"lo"``); None when unknown."""
    source = local_address_towards(host)
    return None if source is None else interface_of(source)


def am_host(address: str) -> str | None:
    """The host part of the first AM address: ``"tcp://10.0.0.5:7000,tcp://10.0.0.6:7000"`` → ``"10.0.0.5"``."""
    first = address.split(",", 1)[0].strip()
    _, _, rest = first.rpartition("://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        host = rest
    host = host.strip("[]")
    return None if host in _UNSPECIFIED_HOSTS else host


def transfer_interface(env: Mapping[str, str] | None = None, am_address: str | None = None) -> str | None:
    """The interface collectives should bind: ``$ELAN_IFACE``, else the one towards the AM's host, else None."""
    env = os.environ if env is None else env
    explicit = env.get(ENV_IFACE, "").strip()
    if explicit:
        return explicit
    address = am_address or env.get(ENV_AM_ADDRESS, "")
    host = am_host(address) if address else None
    if host is None:
        return None
    name = interface_towards(host)
    if name is None:
        log.debug("no interface found towards the AM at %s", host)
    return name


def bind_transfer_interface(env: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (those the user did not set) to :func:`transfer_interface`.

    Call before the first process group is built (torch reads them when a group is constructed). Returns the interface
    chosen, or None when nothing was set.
    """
    env = os.environ if env is None else env
    name = transfer_interface(env)
    if name is None:
        return None
    for var in SOCKET_IFNAME_VARS:
        if env.get(var):
            log.debug("%s=%s set by the user: kept (the interface towards the AM is %s)", var, env[var], name)
        else:
            env[var] = name
    log.info("collectives bind interface %s", name)
    return name


def collective_address(env: Mapping[str, str] | None = None) -> str:
    """The address this worker's gloo binds, for a server the other members must reach: the IPv4 address of the first
    ``GLOO_SOCKET_IFNAME`` interface (what :func:`bind_transfer_interface` set), else what the host name resolves to
    (gloo's own default), else ``127.0.0.1``."""
    env = os.environ if env is None else env
    names = [name.strip() for name in env.get("GLOO_SOCKET_IFNAME", "").split(",") if name.strip()]
    if names:
        address = _ipv4_address_of(names[0])
        if address is not None:
            return address
        log.debug("interface %s has no IPv4 address: the host name's address is used", names[0])
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# --------------------------------------------------------------------------------------------
# address -> interface (Linux)
# --------------------------------------------------------------------------------------------


def _interface_names() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _ipv4_address_of(name: str) -> str | None:
    """The primary IPv4 address of interface ``name`` (``SIOCGIFADDR``); None when it has none."""
    request = struct.pack("256s", name.encode()[: _IFNAMSIZ - 1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
        except OSError:  # no IPv4 address
            return None
    return socket.inet_ntoa(reply[20:24])


def _ipv4_primary_interface(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The interface whose primary IPv4 address is ``ip``."""
    return next((name for name in _interface_names() if _ipv4_address_of(name) == str(ip)), None)


def _ipv4_connected_interface(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The interface of the most specific directly connected route (no gateway) containing ``ip``: a secondary
    address's subnet route names the interface that holds it."""
    try:
        lines = _PROC_ROUTE.read_text().splitlines()[1:]
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or int(fields[2], 16) != 0:  # Iface Destination Gateway Flags ... Mask
            continue
        network = socket.inet_ntoa(struct.pack("<I", int(fields[1], 16)))
        mask = socket.inet_ntoa(struct.pack("<I", int(fields[7], 16)))
        subnet = ipaddress.IPv4Network(f"{network}/{mask}", strict=False)
        if subnet.prefixlen > 0 and ip in subnet and (best is None or subnet.prefixlen > best[0]):
            best = (subnet.prefixlen, fields[0])
    return None if best is None else best[1]


def _ipv6_interface(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The interface holding IPv6 address ``ip`` (``/proc/net/if_inet6``: address, index, prefix, scope, flags,
    name)."""
    try:
        lines = _PROC_IF_INET6.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and ipaddress.IPv6Address(int(fields[0], 16)) == ip:
            return fields[5]
    return None
