"""One leader among the AMs of a job: a leader key held by an etcd lease.

``Leadership.campaign()`` puts ``/lightning_elan/PREFIX/JOB/leader`` = the AM's address, attached to this process's
lease, if the key does not exist (compare ``create_revision == 0``); otherwise it stands by, polling, until the
leader's lease expires and the key vanishes. A thread refreshes the lease every TTL/3. Leadership is lost when the
lease expired (etcd says so), when no refresh succeeded for a whole TTL (etcd may have expired it meanwhile), or when
the key no longer carries this lease: ``lost`` is set and ``on_lost`` called. The state writes of a leader compare
the leader key's lease in the same transaction (``etcd_store.Fence``), so a deposed leader cannot write even before
it notices.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from lightning_elan.etcd import (
    EtcdConnection,
    EtcdLocator,
    StoreError,
    StoreUnavailable,
    compare_create_revision,
    compare_lease,
    delete,
    get,
    put,
    range_results,
)
from lightning_elan.master.etcd_store import Fence

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 5.0
MAX_POLL_S = 0.25


class Leadership:
    """Campaign for the leadership of ``job`` with ``value`` (the AM's address) under ``locator``."""

    def __init__(self, locator: EtcdLocator, job: str, value: str, ttl_s: float = DEFAULT_LEASE_TTL_S,
                 on_lost: Callable[[str], None] | None = None, request_timeout_s: float | None = None) -> None:
        if ttl_s < 1:
            raise ValueError(f"the lease TTL must be ≥ 1 s, got {ttl_s}")
        self.locator = locator
        self.job = job
        self.key = locator.key(job, "leader")
        self.value = value
        self.ttl_s = math.ceil(ttl_s)
        self.on_lost = on_lost
        self.poll_s = min(MAX_POLL_S, self.ttl_s / 10)
        timeout = request_timeout_s if request_timeout_s is not None else max(0.5, self.ttl_s / 4)
        self._campaigner = EtcdConnection(locator.endpoints, request_timeout_s=timeout)
        self._keeper = EtcdConnection(locator.endpoints, request_timeout_s=timeout)
        self._lock = threading.Lock()
        self._lease_id = 0
        self._lease_valid_until = 0.0  # time.monotonic(): send time of the last successful refresh + TTL
        self._leader = False
        self.lost = threading.Event()
        self.lost_reason: str | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- state ---------------------------------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        with self._lock:
            return self._leader and time.monotonic() < self._lease_valid_until

    @property
    def lease_id(self) -> int:
        return self._lease_id

    def fence(self) -> Fence:
        """The condition a leader's state writes carry (the leader key is still on this lease)."""
        if not self._leader:
            raise RuntimeError("not the leader")
        return Fence(self.key, self._lease_id)

    # ---- campaign ------------------------------------------------------------------------------------------------

    def campaign(self, stop: threading.Event | None = None, timeout_s: float | None = None) -> bool:
        """Block until this process leads (True), or ``stop`` is set / ``timeout_s`` passes (False)."""
        self._start_keeper()
        self.lost.clear()
        self.lost_reason = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        standing_by_for: str | None = None
        while not (stop is not None and stop.is_set()) and not self._closing.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            try:
                holder = self._try_acquire()
            except StoreUnavailable as error:
                logger.warning("job %r: campaign: %s", self.job, error)
                continue
            if holder is None:
                logger.info("job %r: this AM (%s) leads (lease %x, TTL %d s)", self.job, self.value,
                            self._lease_id, self.ttl_s)
                return True
            if holder != standing_by_for:
                logger.info("job %r: standing by; the leader is %s", self.job, holder)
                standing_by_for = holder
            time.sleep(self.poll_s)
        return False

    def _try_acquire(self) -> str | None:
        """Put the leader key if it is free; None on success, else the current leader's value."""
        lease_id = self._ensure_lease()
        result = self._campaigner.txn([compare_create_revision(self.key, 0)], [put(self.key, self.value.encode(),
                                      lease_id)], [get(self.key)], retry_s=self.ttl_s)
        if result.get("succeeded"):
            with self._lock:
                self._leader = True
            return None
        found = range_results(result)
        holder = found[0] if found else None
        if holder is not None and holder.lease == lease_id:  # our own put whose answer was lost
            with self._lock:
                self._leader = True
            return None
        return "(none)" if holder is None else holder.value.decode(errors="replace")

    def _ensure_lease(self) -> int:
        """This process's lease, granted anew when there is none or it has expired."""
        with self._lock:
            if self._lease_id and time.monotonic() < self._lease_valid_until:
                return self._lease_id
        sent = time.monotonic()
        lease_id, granted = self._campaigner.grant(self.ttl_s, retry_s=self.ttl_s)
        with self._lock:
            self._lease_id, self._lease_valid_until = lease_id, sent + granted
        return lease_id

    def announce(self, value: str) -> None:
        """Replace the leader key's value (the AM's address once bound), keeping the lease; a leader only."""
        result = self._campaigner.txn([compare_lease(self.key, self._lease_id)],
                                      [put(self.key, value.encode(), self._lease_id)], retry_s=self.ttl_s)
        if not result.get("succeeded"):
            self._mark_lost("the leader key is no longer on this AM's lease")
            return
        self.value = value

    # ---- keep-alive ------------------------------------------------------------------------------------------------

    def _start_keeper(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._closing.clear()
            self._thread = threading.Thread(target=self._keep_alive, name=f"elan-lease-{self.job}", daemon=True)
            self._thread.start()

    def _keep_alive(self) -> None:
        period = self.ttl_s / 3
        while not self._closing.wait(period):
            lease_id = self._lease_id
            if not lease_id:
                continue
            self._refresh(lease_id)
            if self._leader:
                self._check_key(lease_id)

    def _refresh(self, lease_id: int) -> None:
        sent = time.monotonic()
        try:
            ttl = self._keeper.keepalive(lease_id, retry_s=0)
        except StoreError as error:
            if time.monotonic() >= self._lease_valid_until:
                self._mark_lost(f"no lease refresh succeeded for {self.ttl_s} s ({error})")
            return
        if ttl <= 0:
            self._mark_lost("the lease expired")
            with self._lock:
                self._lease_id, self._lease_valid_until = 0, 0.0
            return
        with self._lock:
            if lease_id == self._lease_id:
                self._lease_valid_until = sent + ttl

    def _check_key(self, lease_id: int) -> None:
        try:
            holder = self._keeper.get(self.key, retry_s=0)
        except StoreError:
            return  # the refresh above decides on unavailability
        if holder is None or holder.lease != lease_id:
            self._mark_lost("the leader key is no longer on this AM's lease")

    def _mark_lost(self, reason: str) -> None:
        with self._lock:
            was_leader, self._leader = self._leader, False
        if not was_leader:
            return
        self.lost_reason = reason
        logger.error("job %r: this AM (%s) lost the leadership: %s", self.job, self.value, reason)
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost(reason)

    # ---- the end -----------------------------------------------------------------------------------------------------

    def resign(self) -> None:
        """Give the leadership up at once (delete the key if it is ours, revoke the lease) and stop the keep-alive."""
        self._closing.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.ttl_s)
        lease_id, self._lease_id = self._lease_id, 0
        with self._lock:
            self._leader = False
        if not lease_id:
            return
        try:
            self._campaigner.txn([compare_lease(self.key, lease_id)], [delete(self.key)], retry_s=1.0)
            self._campaigner.revoke(lease_id, retry_s=1.0)
        except StoreError as error:
            logger.warning("job %r: could not resign cleanly (the lease expires by itself): %s", self.job, error)

    close = resign


def current_leader(locator: EtcdLocator, job: str, retry_s: float = 1.0) -> str | None:
    """The leading AM's address of ``job`` (the leader key's value), or None when no AM leads."""
    holder = EtcdConnection(locator.endpoints).get(locator.key(job, "leader"), retry_s=retry_s)
    return None if holder is None else holder.value.decode()
