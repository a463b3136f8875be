"""An AM process among several for one job, its state in etcd: it leads or stands by (``elan am --store etcd://…``).

``ElectedAM.run()`` campaigns for the leader key (``leadership.py``); the winner loads the state from etcd (which
counts an AM restart when a state exists, as any resume does), binds its ZeroMQ address, writes that address into the
leader key and serves. Its state writes carry its lease (``etcd_store.Fence``). When it loses the leadership (its
lease expired or etcd was unreachable for a whole TTL) or a write is refused, it stops serving at once and campaigns
again as a standby: it leads again (reloading the state from etcd) when the key is free, e.g. after etcd came back
with nobody else running. A supervisor therefore never has to restart it.

A job of ``elan worker``s (``enrolment``): each term passes the enrolment rule to its AM, which keeps the stored one
when the state has it (a standby taking over keeps the rule and the waiting workers of the state), and tells enrolled
workers ``rendezvous``, the URL of the job's rendezvous store in etcd, which outlives every AM process.
:meth:`ElectedAM.job_over` says when the job has finished — from the leading AM, or from the stored state for a
standby — so that every ``elan am`` of the job exits when it is over.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from lightning_elan.etcd import EtcdLocator
from lightning_elan.master.enrolment import Enrolment
from lightning_elan.master.etcd_store import EtcdStore
from lightning_elan.master.failure_notice import etcd_notice
from lightning_elan.master.leadership import DEFAULT_LEASE_TTL_S, Leadership
from lightning_elan.master.server import FINISH_LINGER_S, ApplicationMaster
from lightning_elan.master.state import CANCELLED
from lightning_elan.master.store import StoreConflict, StoreUnavailable

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.1
RETRY_PAUSE_S = 0.5
FINISHED_POLL_S = 1.0
"""How often a standby reads the stored state to learn that the job is over."""


class ElectedAM:
    """Lead or stand by for ``job``; serve while leading."""

    def __init__(self, job: str, locator: EtcdLocator, bind: str, state_dir: Path | None = None,
                 secret: bytes | None = None, ttl_s: float = DEFAULT_LEASE_TTL_S, register: bool = True,
                 enrolment: Enrolment | None = None, enrolment_options: dict[str, Any] | None = None,
                 rendezvous: str | None = None) -> None:
        self.job = job
        self.locator = locator
        self.bind = bind
        self.state_dir = state_dir
        self.secret = secret
        self.register = register
        self.leadership = Leadership(locator, job, bind, ttl_s=ttl_s)
        self.terms = 0  # how many times this process has led
        self.enrolment = enrolment
        self.enrolment_options = dict(enrolment_options or {})
        self.rendezvous = rendezvous
        self._am: ApplicationMaster | None = None  # the AM of the current term, while leading
        self._finished = False
        self._next_finished_poll = 0.0
        self._finished_read_at: float | None = None  # when the stored state first said finished (monotonic)
        self._reader: EtcdStore | None = None  # reads the stored state for job_over (the caller's thread)

    def job_over(self) -> bool:
        """Whether the job is over: the leading AM says so (``ApplicationMaster.over``), or (standing by) the stored
        state does."""
        if not self._finished:
            am = self._am
            self._finished = am.over if am is not None else self._stored_finished()
        return self._finished

    def _stored_finished(self) -> bool:
        now = time.monotonic()
        if now < self._next_finished_poll:
            return False
        self._next_finished_poll = now + FINISHED_POLL_S
        if self._reader is None:
            self._reader = EtcdStore(self.locator, self.job, retry_s=0.5)
        try:
            document = self._reader.load()
        except (StoreUnavailable, ValueError) as error:
            logger.debug("job %r: cannot read the stored state: %s", self.job, error)
            return False
        state = (document or {}).get("state", {})
        return bool(state.get("finished")) and self._told_or_lingered(state)

    def _told_or_lingered(self, state: dict[str, Any]) -> bool:
        """No cancelled joiner of the finished job is left to learn it (the leader serves them), or
        ``FINISH_LINGER_S`` passed since this AM first read the job finished: a standby that stopped first would
        leave no AM to serve them if the leader died meanwhile."""
        if self._finished_read_at is None:
            self._finished_read_at = time.monotonic()
        cancelled = [w for w, pending in state.get("pending_workers", {}).items() if pending.get("status") == CANCELLED]
        return not cancelled or time.monotonic() - self._finished_read_at >= FINISH_LINGER_S

    def run(self, stop: threading.Event) -> None:
        """Campaign, serve while leading, campaign again after a loss; return once ``stop`` is set."""
        try:
            while not stop.is_set():
                logger.info("job %r: AM campaigning for the leadership (etcd %s)", self.job, self.locator.url())
                if not self.leadership.campaign(stop):
                    break
                self._lead(stop)
        finally:
            self.leadership.resign()

    def _lead(self, stop: threading.Event) -> None:
        am = self._start_serving()
        if am is None:
            time.sleep(RETRY_PAUSE_S)
            return
        self.terms += 1
        self._am = am
        try:
            while not stop.is_set() and am.serving and not self.leadership.lost.is_set():
                time.sleep(WATCH_INTERVAL_S)
        finally:
            self._finished = self._finished or am.over
            self._am = None
            am.stop()
        if stop.is_set():
            return
        reason = am.fenced_reason or self.leadership.lost_reason or "the AM stopped"
        logger.error("job %r: AM at %s stopped serving (%s); standing by", self.job, am.address, reason)
        if am.fenced_reason and not self.leadership.lost.is_set():
            self.leadership.resign()  # another writer changed the state: let any AM lead and reload it

    def _start_serving(self) -> ApplicationMaster | None:
        """The AM of this term, serving with the leader's fence; None when the store cannot be read now."""
        try:
            fence = self.leadership.fence()
        except RuntimeError:  # lost between the campaign and here
            return None
        store = EtcdStore(self.locator, self.job, fence=fence, retry_s=max(2.0, float(self.leadership.ttl_s)))
        try:
            am = ApplicationMaster(self.job, store, bind=self.bind, state_dir=self.state_dir,
                                   register=self.register, secret=self.secret, rendezvous=self.rendezvous,
                                   announce_failure=None if self.rendezvous is None
                                   else etcd_notice(self.locator, self.job))
            if self.enrolment is not None:  # kept from the state when it has one (a standby taking over)
                am.accept_enrolments(copy.deepcopy(self.enrolment), **self.enrolment_options)
        except (StoreUnavailable, StoreConflict) as error:
            logger.warning("job %r: could not load the state as the new leader: %s", self.job, error)
            return None
        try:
            am.start()
        except (OSError, RuntimeError, zmq.ZMQError) as error:  # e.g. the previous term's socket not closed yet
            logger.warning("job %r: could not serve on %s: %s", self.job, self.bind, error)
            return None
        self.bind = am.address  # a later term binds the same port: clients keep one address list
        try:
            self.leadership.announce(am.address)
        except StoreUnavailable as error:  # the keep-alive decides whether this AM still leads
            logger.warning("job %r: could not write the leader's address %s: %s", self.job, am.address, error)
        logger.info("job %r: AM (leader, term %d) serving on %s", self.job, self.terms + 1, am.address)
        return am
