"""The job's rendezvous store in etcd: a ``torch.distributed.Store`` on the v3 JSON gateway (client ``etcd3gw``).

With ``elan am --store etcd://…`` several AM processes serve one job and any of them may die; a ``TCPStore`` served by
the leader would die with it and strand the workers' next rendezvous. :class:`EtcdRendezvousStore` keeps the
rendezvous keys (each generation's gloo rendezvous, replication headers and acknowledgements, failure keys, commit
votes) in the same etcd cluster as the AM's state, so they outlive every AM process.

* **Address**: ``etcd://HOST:PORT[,HOST:PORT…]/PREFIX?job=JOB`` (:func:`rendezvous_url`); keys live under
  ``/lightning_elan/PREFIX/JOB/rdzv/``. :func:`open_rendezvous_store` opens either this or a ``TCPStore`` client
  (``HOST:PORT``), whichever the address names.
* **Operations**: ``set``/``get``/``check``/``delete_key``/``num_keys``/``list_keys`` are one request each; ``add``,
  ``append`` and ``compare_set`` are compare-and-swap loops on the key's ``mod_revision``; ``get`` and ``wait`` poll
  (2 ms, growing to 50 ms) until the key exists or the store's timeout passes (``DistStoreError``, as TCPStore).
* **Unavailability**: a request is retried (endpoint after endpoint, bounded back-off) for the store's timeout, so an
  etcd outage shorter than that only delays the workers; then ``DistStoreError``.
* **Closing**: :meth:`EtcdRendezvousStore.close` makes every call raise (a clone closes alone: ``clone()``).
* Values are bytes (base64 on the wire); counters are decimal ASCII, as ``TCPStore`` keeps them. One HTTP session per
  thread (the store is shared by the training thread and helper threads).
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_elan.etcd import (
    EtcdConnection,
    EtcdLocator,
    KeyValue,
    StoreError,
    compare_mod_revision,
    is_etcd_url,
    parse_rendezvous_url,
    put,
    range_results,
    rendezvous_url,
)

__all__ = ["EtcdRendezvousStore", "open_rendezvous_store", "parse_rendezvous_url", "rendezvous_url"]

POLL_INITIAL_S = 0.002
POLL_MAX_S = 0.05
POLL_GROWTH = 1.5
REQUEST_TIMEOUT_S = 2.0
DEFAULT_TIMEOUT = timedelta(minutes=5)


def open_rendezvous_store(address: str, timeout: timedelta = DEFAULT_TIMEOUT) -> dist.Store:
    """A client of the job's rendezvous store: ``HOST:PORT`` → ``TCPStore``; ``etcd://…?job=JOB`` → etcd."""
    if is_etcd_url(address):
        locator, job = parse_rendezvous_url(address)
        return EtcdRendezvousStore(locator, job, timeout)
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad rendezvous store address {address!r} (HOST:PORT or etcd://HOST:PORT/PREFIX?job=JOB)")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


class EtcdRendezvousStore(dist.Store):
    """A c10d store whose keys are etcd keys under ``/lightning_elan/PREFIX/JOB/rdzv/`` (see the module docstring)."""

    def __init__(self, locator: EtcdLocator, job: str, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self.locator = locator
        self.job = job
        self.root = locator.rendezvous_root(job)
        self.set_timeout(timeout)
        self._local = threading.local()
        self._closed = threading.Event()

    def clone(self) -> EtcdRendezvousStore:
        """A store on the same keys that can be closed on its own (``TCPStore.clone``'s counterpart)."""
        return EtcdRendezvousStore(self.locator, self.job, self.timeout)

    def close(self) -> None:
        """Every later call, and every poll under way, raises ``DistStoreError``: a backend's rendezvous abandoned
        on this store ends before the interpreter finalizes (a thread that polls a Python store from C++ and takes
        the GIL during finalization kills the process: ``process_group._end_abandoned_connects``)."""
        self._closed.set()

    # ---- the c10d interface ----------------------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._call("kv/put", {"key": self._b64key(key), "value": _b64(_bytes(value))})

    def get(self, key: str) -> bytes:
        deadline = self._deadline()
        delay = POLL_INITIAL_S
        while True:
            kv = self._read(key)
            if kv is not None:
                return kv.value
            delay = self._pause(deadline, delay, [key])

    def add(self, key: str, amount: int) -> int:
        while True:
            kv = self._read(key)
            value = (int(kv.value) if kv is not None and kv.value else 0) + amount
            if self._swap(key, kv, str(value).encode()):
                return value

    def append(self, key: str, value: bytes | str) -> None:
        while True:
            kv = self._read(key)
            if self._swap(key, kv, (kv.value if kv is not None else b"") + _bytes(value)):
                return

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """TCPStore's rule: set ``desired`` when the key holds ``expected`` (or is absent and ``expected`` is empty);
        return the value the key holds afterwards (``expected`` when it is absent and ``expected`` is not empty)."""
        expected, desired = _bytes(expected_value), _bytes(desired_value)
        while True:
            kv = self._read(key)
            if kv is None and expected:
                return expected
            if kv is not None and kv.value != expected:
                return kv.value
            if self._swap(key, kv, desired):
                return desired

    def check(self, keys: list[str]) -> bool:
        if not keys:
            return True
        result = self._call("kv/txn", {"compare": [], "success": [self._range_op(key) for key in keys]})
        return all(kv is not None for kv in range_results(result))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = self._deadline(timeout)
        delay = POLL_INITIAL_S
        while not self.check(keys):
            delay = self._pause(deadline, delay, keys)

    def delete_key(self, key: str) -> bool:
        result = self._call("kv/deleterange", {"key": self._b64key(key)})
        return int(result.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        result = self._call("kv/range", {**self._prefix_range(), "count_only": True})
        return int(result.get("count", 0))

    def list_keys(self) -> list[str]:
        result = self._call("kv/range", {**self._prefix_range(), "keys_only": True})
        return [base64.b64decode(kv["key"]).decode()[len(self.root):] for kv in result.get("kvs") or []]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def has_extended_api(self) -> bool:
        return False

    def clear(self) -> int:
        """Delete every rendezvous key of the job (tests, a job's clean-up); returns how many there were."""
        result = self._call("kv/deleterange", self._prefix_range())
        return int(result.get("deleted", 0))

    def __repr__(self) -> str:
        return f"EtcdRendezvousStore({rendezvous_url(self.locator, self.job)!r})"

    # ---- helpers -------------------------------------------------------------------------------------------------

    def _connection(self) -> EtcdConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = EtcdConnection(self.locator.endpoints, REQUEST_TIMEOUT_S, self.timeout.total_seconds())
            self._local.connection = connection
        return connection

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self._raise_if_closed()
        try:
            return self._connection().call(path, body)
        except StoreError as error:
            raise dist.DistStoreError(f"{self!r}: {error}") from None

    def _read(self, key: str) -> KeyValue | None:
        kvs = self._call("kv/range", {"key": self._b64key(key)}).get("kvs") or []
        return KeyValue.from_json(kvs[0]) if kvs else None

    def _swap(self, key: str, seen: KeyValue | None, value: bytes) -> bool:
        """Put ``value`` if ``key`` still has the revision ``seen`` had (absent: still absent)."""
        full = self.root + key
        revision = 0 if seen is None else seen.mod_revision
        body = {"compare": [compare_mod_revision(full, revision)], "success": [put(full, value)]}
        result = self._call("kv/txn", body)
        return bool(result.get("succeeded"))

    def _deadline(self, timeout: timedelta | None = None) -> float:
        limit = self.timeout if timeout is None else timeout
        return time.monotonic() + limit.total_seconds()

    def _pause(self, deadline: float, delay: float, keys: Sequence[str]) -> float:
        if time.monotonic() + delay > deadline:
            raise dist.DistStoreError(f"{self!r}: timed out waiting for key(s) {list(keys)}")
        if self._closed.wait(delay):
            self._raise_if_closed()
        return min(delay * POLL_GROWTH, POLL_MAX_S)

    def _raise_if_closed(self) -> None:
        if self._closed.is_set():
            raise dist.DistStoreError(f"{self!r} is closed")

    def _b64key(self, key: str) -> str:
        return _b64((self.root + key).encode())

    def _range_op(self, key: str) -> dict[str, Any]:
        return {"request_range": {"key": self._b64key(key), "keys_only": True}}

    def _prefix_range(self) -> dict[str, str]:
        return {"key": _b64(self.root.encode()), "range_end": _b64(_prefix_end(self.root.encode()))}


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's ``range_end`` for a prefix)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    end[-1] += 1
    return bytes(end)


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode()

