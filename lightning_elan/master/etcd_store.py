"""The AM's state in etcd (the v3 API through its HTTP/JSON gateway, client ``etcd3gw``).

``etcd://HOST:PORT[,HOST:PORT…]/PREFIX`` names a cluster and the project's key prefix; a job's keys are
``/lightning_elan/PREFIX/JOB/state`` (the state document) and ``/lightning_elan/PREFIX/JOB/leader`` (see
``leadership.py``). Every ``save`` is a transaction: compare the state key's ``mod_revision`` with the one this
store last read or wrote (and, for a leader, the leader key's lease with its own) → put; otherwise ``StoreConflict``.
An unavailable cluster is retried with bounded exponential back-off, endpoint after endpoint, then
``StoreUnavailable`` (the client: :mod:`lightning_elan.etcd`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import zlib
from dataclasses import dataclass
from typing import Any

from lightning_elan.etcd import (
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_RETRY_S,
    KEY_ROOT,
    EtcdConnection,
    EtcdLocator,
    KeyValue,
    compare_lease,
    compare_mod_revision,
    delete,
    get,
    is_etcd_url,
    parse_etcd_url,
    put,
    range_results,
    revision_of,
)
from lightning_elan.master.store import StateStore, StoreConflict

logger = logging.getLogger(__name__)

# KEY_ROOT, EtcdLocator, is_etcd_url and parse_etcd_url are lightning_elan.etcd's, named here as they always were
__all__ = ["COMPRESS_OVER_BYTES", "KEY_ROOT", "EtcdLocator", "EtcdStore", "Fence", "LeadershipLost", "decode_document",
           "encode_document", "is_etcd_url", "parse_etcd_url"]

COMPRESS_OVER_BYTES = 256 * 1024  # larger documents are stored zlib-compressed (etcd refuses requests > 1.5 MiB)


class LeadershipLost(StoreConflict):
    """The leader key no longer carries this AM's lease: another AM leads (or may lead) the job."""


@dataclass(frozen=True)
class Fence:
    """A write is allowed only while ``key`` is attached to ``lease_id`` (this AM's leadership)."""

    key: str
    lease_id: int


class EtcdStore(StateStore):
    """A job's state document in etcd; every ``save`` is a compare-and-swap on the revision this store read."""

    def __init__(self, locator: EtcdLocator, job: str, fence: Fence | None = None,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, retry_s: float = DEFAULT_RETRY_S) -> None:
        self.locator = locator
        self.job = job
        self.key = locator.key(job, "state")
        self.fence = fence
        self.connection = EtcdConnection(locator.endpoints, request_timeout_s, retry_s)
        self._revision = 0  # mod_revision of the state this store last read or wrote; 0: none
        self._unconfirmed: list[bytes] = []  # digests of writes whose outcome is unknown (a lost answer)

    @classmethod
    def from_url(cls, url: str, job: str, **options: Any) -> EtcdStore:
        return cls(parse_etcd_url(url), job, **options)

    @property
    def revision(self) -> int:
        """The mod_revision of the state this store last read or wrote (0: none)."""
        return self._revision

    def load(self) -> dict[str, Any] | None:
        kv = self.connection.get(self.key)
        self._revision = 0 if kv is None else kv.mod_revision
        self._unconfirmed.clear()
        return None if kv is None else decode_document(kv.value, self)

    def save(self, state: dict[str, Any]) -> None:
        payload = encode_document(state)
        digest = hashlib.sha256(payload).digest()
        for _ in range(2):  # a second round only after adopting a write of ours whose answer was lost
            self._unconfirmed.append(digest)
            del self._unconfirmed[:-64]
            result = self.connection.txn(self._conditions(), [put(self.key, payload)],
                                         [get(self.key)] + ([get(self.fence.key)] if self.fence else []))
            if result.get("succeeded"):
                self._revision = revision_of(result)
                self._unconfirmed.clear()
                return
            self._resolve_refusal(range_results(result))
        raise StoreConflict(f"{self!r}: the state changed again under this AM")

    def _conditions(self) -> list[dict[str, Any]]:
        conditions = [compare_mod_revision(self.key, self._revision)]
        if self.fence is not None:
            conditions.append(compare_lease(self.fence.key, self.fence.lease_id))
        return conditions

    def _resolve_refusal(self, found: list[KeyValue | None]) -> None:
        """Raise the reason a save was refused, unless the state holds a write of ours whose answer was lost."""
        state = found[0] if found else None
        if self.fence is not None:
            leader = found[1] if len(found) > 1 else None
            if leader is None or leader.lease != self.fence.lease_id:
                raise LeadershipLost(f"{self!r}: the leader key {self.fence.key} is no longer on this AM's lease "
                                     f"{self.fence.lease_id:x} (it expired, or another AM leads): this AM stops "
                                     "writing")
        if state is not None and hashlib.sha256(state.value).digest() in self._unconfirmed:
            logger.info("%r: a write whose answer was lost had landed (revision %d)", self, state.mod_revision)
            self._revision = state.mod_revision
            return
        current = 0 if state is None else state.mod_revision
        raise StoreConflict(f"{self!r}: the state was changed by another writer (revision {current}, this AM read "
                            f"{self._revision}); this AM stops writing")

    def delete(self) -> None:
        """Remove the job's state (tests, a job's clean-up)."""
        self.connection.txn([], [delete(self.key)])
        self._revision = 0

    def __repr__(self) -> str:
        return f"EtcdStore({self.locator.url()!r}, {self.job!r})"


def encode_document(state: dict[str, Any]) -> bytes:
    """Compact JSON; zlib-compressed above ``COMPRESS_OVER_BYTES`` (JSON starts with ``{``, zlib never does)."""
    payload = json.dumps(state, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return zlib.compress(payload, 6) if len(payload) > COMPRESS_OVER_BYTES else payload


def decode_document(value: bytes, source: object) -> dict[str, Any]:
    try:
        text = value if value[:1] == b"{" else zlib.decompress(value)
        state = json.loads(text)
    except (ValueError, zlib.error) as error:
        raise ValueError(f"{source!r} does not hold a valid state document: {error}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{source!r} does not hold a JSON object")
    return state
