"""A small client of etcd's v3 API through its HTTP/JSON gateway (``etcd3gw``), shared by the AM and the workers.

The AM keeps its state and its leadership in etcd (:mod:`lightning_elan.master.etcd_store`,
:mod:`lightning_elan.master.leadership`); a job of ``elan worker``s keeps its rendezvous keys there too
(:mod:`lightning_elan.elastic.etcd_rendezvous`). Both sides use what is here: the cluster's address
(``etcd://HOST:PORT[,HOST:PORT…]/PREFIX``, :class:`EtcdLocator`), a connection that tries endpoint after endpoint and
then backs off (bounded, exponential) until its retry budget is spent (:class:`StoreUnavailable`), and the gateway's
JSON form of a transaction's parts.
"""

from __future__ import annotations

import base64
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

logger = logging.getLogger(__name__)

__all__ = [
    "KEY_ROOT",
    "EtcdConnection",
    "EtcdLocator",
    "KeyValue",
    "StoreError",
    "StoreUnavailable",
    "compare_create_revision",
    "compare_lease",
    "compare_mod_revision",
    "delete",
    "get",
    "is_etcd_url",
    "parse_etcd_url",
    "parse_rendezvous_url",
    "put",
    "range_results",
    "rendezvous_url",
    "revision_of",
]

SCHEME = "etcd://"
KEY_ROOT = "/lightning_elan"
RENDEZVOUS_KEY = "rdzv"
"""Under a job's prefix, the keys of its rendezvous store (``elastic/etcd_rendezvous.py``)."""
DEFAULT_PORT = 2379
DEFAULT_REQUEST_TIMEOUT_S = 2.0
DEFAULT_RETRY_S = 10.0
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 1.0
_PREFIX_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*)$")


class StoreError(RuntimeError):
    """A store kept in etcd (the AM's state, a job's rendezvous keys) could not do a request."""


class StoreUnavailable(StoreError):
    """The store did not answer within its retry budget; nothing is known to be written."""


@dataclass(frozen=True)
class EtcdLocator:
    """Where a job's keys live: the cluster's client endpoints and the key prefix."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str

    def job_prefix(self, job: str) -> str:
        return f"{KEY_ROOT}/{self.prefix}/{job}/"

    def key(self, job: str, name: str) -> str:
        """The key ``name`` of ``job``, e.g. ``/lightning_elan/PREFIX/JOB/state``."""
        return self.job_prefix(job) + name

    def rendezvous_root(self, job: str) -> str:
        """Where ``job``'s rendezvous store keeps its keys: ``/lightning_elan/PREFIX/JOB/rdzv/``."""
        return self.key(job, RENDEZVOUS_KEY) + "/"

    def url(self) -> str:
        hosts = ",".join(f"{host}:{port}" for host, port in self.endpoints)
        return f"{SCHEME}{hosts}/{self.prefix}"


def is_etcd_url(text: str) -> bool:
    return text.startswith(SCHEME)


def parse_etcd_url(url: str) -> EtcdLocator:
    """``etcd://h1:p1,h2:p2/prefix`` → ``EtcdLocator`` (a port defaults to 2379); ``ValueError`` says what is wrong."""
    if not isinstance(url, str) or not is_etcd_url(url):
        raise ValueError(f"not an etcd URL: {url!r} (expected etcd://HOST:PORT[,HOST:PORT…]/PREFIX)")
    rest = url[len(SCHEME):]
    hosts, slash, prefix = rest.partition("/")
    if not slash or not prefix.strip("/"):
        raise ValueError(f"etcd URL {url!r} names no key prefix (etcd://HOST:PORT/PREFIX)")
    return EtcdLocator(tuple(_parse_endpoint(part, url) for part in hosts.split(",")), _parse_prefix(prefix, url))


def _parse_endpoint(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [v6]:port
        host, _, port_text = text.partition("]")
        host, port_text = host + "]", port_text.removeprefix(":")
    else:
        host, _, port_text = text.partition(":")
    if not host or not _HOST.match(host):
        raise ValueError(f"etcd URL {url!r}: bad host {text!r}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"etcd URL {url!r}: bad port in {text!r}")
    return host, int(port_text)


def _parse_prefix(prefix: str, url: str) -> str:
    segments = prefix.strip("/").split("/")
    for segment in segments:
        if not _PREFIX_SEGMENT.match(segment):
            raise ValueError(f"etcd URL {url!r}: bad key prefix segment {segment!r} (letters, digits, . _ -)")
    return "/".join(segments)


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd returned it (value decoded from base64)."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(_b64decode(kv["key"]).decode(), _b64decode(kv.get("value", "")), int(kv.get("mod_revision", 0)),
                   int(kv.get("create_revision", 0)), int(kv.get("lease", 0)))


class EtcdConnection:
    """Requests to one etcd cluster's JSON gateway: each endpoint in turn (the last good one first), then bounded
    exponential back-off until ``retry_s`` has passed (``StoreUnavailable``). Use one per thread."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        try:
            import etcd3gw
        except ImportError:
            raise StoreError("the etcd store needs etcd3gw: pip install 'lightning_elan[etcd]'") from None
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = tuple(endpoints)
        self.retry_s = retry_s
        self._clients = [etcd3gw.Etcd3Client(host.strip("[]"), port, timeout=request_timeout_s)
                         for host, port in self.endpoints]
        self._good = 0
        self._outage_logged = False

    def call(self, path: str, body: dict[str, Any], retry_s: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>``; unavailability is retried for ``retry_s`` (default: the connection's)."""
        from etcd3gw import exceptions

        retryable = (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError,
                     exceptions.InternalServerError)
        deadline = time.monotonic() + (self.retry_s if retry_s is None else retry_s)
        delay = BACKOFF_INITIAL_S
        while True:
            last: Exception | None = None
            for index in self._order():
                client = self._clients[index]
                try:
                    result = client.post(client.get_url(path), json=body)
                except retryable as error:
                    last = error
                    continue
                except exceptions.Etcd3Exception as error:
                    raise StoreError(f"etcd refused {path}: {error.detail_text or error}") from None
                self._on_success(index)
                return result
            delay = self._back_off(path, last, deadline, delay)

    def _order(self) -> list[int]:
        count = len(self._clients)
        return [(self._good + step) % count for step in range(count)]

    def _on_success(self, index: int) -> None:
        if self._outage_logged:
            logger.warning("etcd answers again (%s:%d)", *self.endpoints[index])
            self._outage_logged = False
        self._good = index

    def _back_off(self, path: str, error: Exception | None, deadline: float, delay: float) -> float:
        """Sleep before the next round, or raise ``StoreUnavailable`` when that would pass ``deadline``."""
        where = ",".join(f"{host}:{port}" for host, port in self.endpoints)
        if time.monotonic() + delay > deadline:
            raise StoreUnavailable(f"etcd at {where} unavailable for {path}: {type(error).__name__}: {error}")
        if not self._outage_logged:
            logger.warning("etcd at %s unavailable (%s); retrying with back-off", where, type(error).__name__)
            self._outage_logged = True
        time.sleep(delay)
        return min(delay * 2, BACKOFF_MAX_S)

    # ---- the v3 operations the AM uses -------------------------------------------------------------------------

    def get(self, key: str, retry_s: float | None = None) -> KeyValue | None:
        result = self.call("kv/range", {"key": _b64(key)}, retry_s)
        kvs = result.get("kvs") or []
        return KeyValue.from_json(kvs[0]) if kvs else None

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]] | None = None, retry_s: float | None = None) -> dict[str, Any]:
        return self.call("kv/txn", {"compare": compare, "success": success, "failure": failure or []}, retry_s)

    def grant(self, ttl_s: int, retry_s: float | None = None) -> tuple[int, int]:
        """A new lease: ``(id, granted TTL)``."""
        result = self.call("lease/grant", {"TTL": ttl_s, "ID": 0}, retry_s)
        return int(result["ID"]), int(result["TTL"])

    def keepalive(self, lease_id: int, retry_s: float | None = None) -> int:
        """Refresh a lease; its TTL, or -1 when it has expired."""
        result = self.call("lease/keepalive", {"ID": lease_id}, retry_s)
        return int(result.get("result", {}).get("TTL", -1))

    def put(self, key: str, value: bytes, retry_s: float | None = None) -> None:
        self.call("kv/put", {"key": _b64(key), "value": base64.b64encode(value).decode()}, retry_s)

    def revoke(self, lease_id: int, retry_s: float | None = None) -> None:
        self.call("kv/lease/revoke", {"ID": lease_id}, retry_s)


# ---- transaction parts (the gateway's JSON form of etcdserverpb) ---------------------------------------------------


def compare_mod_revision(key: str, revision: int) -> dict[str, Any]:
    """True when ``key``'s mod_revision is ``revision`` (0: the key does not exist)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)}


def compare_create_revision(key: str, revision: int) -> dict[str, Any]:
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": str(revision)}


def compare_lease(key: str, lease_id: int) -> dict[str, Any]:
    """True when ``key`` exists and is attached to ``lease_id``."""
    return {"key": _b64(key), "result": "EQUAL", "target": "LEASE", "lease": str(lease_id)}


def put(key: str, value: bytes, lease_id: int = 0) -> dict[str, Any]:
    request: dict[str, Any] = {"key": _b64(key), "value": base64.b64encode(value).decode()}
    if lease_id:
        request["lease"] = str(lease_id)
    return {"request_put": request}


def get(key: str) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key)}}


def delete(key: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(key)}}


def range_results(txn_result: dict[str, Any]) -> list[KeyValue | None]:
    """The key of each ``request_range`` answer of a transaction, in order (None: the key does not exist)."""
    found: list[KeyValue | None] = []
    for response in txn_result.get("responses") or []:
        if "response_range" in response:
            kvs = response["response_range"].get("kvs") or []
            found.append(KeyValue.from_json(kvs[0]) if kvs else None)
    return found


def revision_of(txn_result: dict[str, Any]) -> int:
    return int(txn_result.get("header", {}).get("revision", 0))


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode()


def _b64decode(text: str) -> bytes:
    return base64.b64decode(text)


def rendezvous_url(locator: EtcdLocator, job: str) -> str:
    """The rendezvous store address of ``job``: ``etcd://HOST:PORT/PREFIX?job=JOB``."""
    return f"{locator.url()}?job={job}"


def parse_rendezvous_url(url: str) -> tuple[EtcdLocator, str]:
    """``etcd://HOST:PORT/PREFIX?job=JOB`` → (locator, job); ``ValueError`` says what is wrong."""
    base, _, query = url.partition("?")
    jobs = parse_qs(query).get("job", [])
    if len(jobs) != 1 or not jobs[0]:
        raise ValueError(f"rendezvous URL {url!r} names no job (etcd://HOST:PORT/PREFIX?job=JOB)")
    return parse_etcd_url(base), jobs[0]
