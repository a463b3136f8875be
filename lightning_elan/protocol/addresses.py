"""AM addresses as people write them (``HOST:PORT``, ``tcp://HOST:PORT``, ``HOST``) → the ZeroMQ form ``tcp://HOST:PORT``.

One parser for every place an AM address comes in: ``elan am --bind``, ``--am`` of the client commands and of
``elan worker`` (a comma list of a leader and its standbys), ``$ELAN_AM`` and ``$ELAN_AM_ADDRESS``, and
:class:`~lightning_elan.protocol.client.AMClient`. An IPv6 host is written in brackets: ``[::1]:29400``.
"""

from __future__ import annotations

import ipaddress
import re

SCHEME = "tcp://"
DEFAULT_AM_PORT = 29400
"""The AM's port when an address names only a host (the port the deployment recipes in ``deploy/`` use)."""
ADDRESS_FORMS = f"HOST:PORT, tcp://HOST:PORT or HOST (port {DEFAULT_AM_PORT}; IPv6 as [ADDR]:PORT)"
"""The accepted forms, as error messages name them."""

_HOST = re.compile(r"[A-Za-z0-9_.-]+")
_WILDCARD = "*"  # ZeroMQ's "every interface", for a bind address only


def am_address(text: str, *, bind: bool = False) -> str:
    """One AM address → ``tcp://HOST:PORT``; ``bind`` also takes port 0 (any free port) and the host ``*``."""
    rest = text.strip()
    if rest.startswith(SCHEME):
        rest = rest[len(SCHEME):]
    if "://" in rest:
        raise ValueError(_bad(text, "the AM serves tcp:// only"))
    host, port_text = _split(rest)
    if host is None or not _valid_host(host, bind):
        raise ValueError(_bad(text))
    port = _port(port_text, bind)
    if port is None:
        raise ValueError(_bad(text, "the port must be a number in " + ("0..65535" if bind else "1..65535")))
    return f"{SCHEME}{host}:{port}"


def split_am_addresses(text: str) -> list[str]:
    """A comma list of AM addresses (a leader and its standbys) → each in the form ``tcp://HOST:PORT``."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or not all(parts):
        raise ValueError(f"bad AM address list {text!r}: an empty entry; expected ADDRESS[,ADDRESS…], each "
                         f"{ADDRESS_FORMS}")
    return [am_address(part) for part in parts]


def am_address_list(text: str) -> str:
    """A comma list of AM addresses → the comma list of ``tcp://HOST:PORT`` that ``AMClient`` takes."""
    return ",".join(split_am_addresses(text))


def bind_address(text: str) -> str:
    """``elan am --bind``: an address to bind → ``tcp://HOST:PORT`` (port 0: any free port; host ``*``: all)."""
    return am_address(text, bind=True)


def _split(rest: str) -> tuple[str | None, str | None]:
    """``HOST[:PORT]`` or ``[IPV6][:PORT]`` → (host, port text or None); host None when the form is wrong."""
    if rest.startswith("["):
        end = rest.find("]")
        if end < 0:
            return None, None
        host, after = rest[: end + 1], rest[end + 1 :]
        if after and not after.startswith(":"):
            return None, None
        return host, after[1:] if after else None
    host, colon, port = rest.partition(":")
    if ":" in port:  # an IPv6 address without brackets, or a second port
        return None, None
    return host, port if colon else None


def _valid_host(host: str, bind: bool) -> bool:
    """A name, an IPv4 address, a bracketed IPv6 address, or (to bind) ``*``."""
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    return (bind and host == _WILDCARD) or bool(_HOST.fullmatch(host))


def _port(text: str | None, bind: bool) -> int | None:
    """The port (``DEFAULT_AM_PORT`` when absent), or None when it is not a valid one."""
    if text is None:
        return DEFAULT_AM_PORT
    if not text.isascii() or not text.isdigit():
        return None
    port = int(text)
    return port if (0 if bind else 1) <= port <= 65535 else None


def _bad(text: str, why: str | None = None) -> str:
    """The one-line error for a wrong address."""
    return f"bad AM address {text!r}: " + (f"{why}; " if why else "") + f"expected {ADDRESS_FORMS}"


__all__ = [
    "ADDRESS_FORMS",
    "DEFAULT_AM_PORT",
    "am_address",
    "am_address_list",
    "bind_address",
    "split_am_addresses",
]
