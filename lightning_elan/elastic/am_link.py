"""The worker's side of the conversation with the application master, in the contract's types."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import Any

from lightning_elan.protocol.client import AMClient, AMError, AMUnavailable
from lightning_elan.protocol.contract import (
    STATUS_STANDBY,
    STATUS_WAIT,
    AdjustmentReport,
    CoordinateReply,
    CoordinateRequest,
    RecoverRequest,
    RegisterRequest,
    StalledRequest,
    WaitPlanReply,
    WorkerEnvironment,
    WorkerExitReply,
    WorkerStats,
)

log = logging.getLogger(__name__)

QUIET_AFTER_FAILURE_S = 5.0
"""After the AM failed to answer two ``coordinate``s in a row, training goes on and asks again this much later."""
WAIT_PLAN_POLL_S = 5.0
"""A joiner's long poll: the AM answers ``wait`` after this long when nothing was decided."""
STATS_ATTEMPT_S = 1.0
"""A member's compute stats are sent once; one the AM does not answer in time is dropped (the next one follows)."""
MAX_QUEUED = 64
"""Stats are not queued behind this many undelivered messages (an AM that does not answer)."""
REPORT_ATTEMPT_S, REPORT_ATTEMPTS = 1.0, 30
"""A report is resent (same message id) for up to 30 s: long enough for ``elan run`` to restart a killed AM."""


class AMLink:
    """Synchronous calls from the training thread, plus a background sender for reports off the hot path."""

    def __init__(self, environment: WorkerEnvironment, timeout_s: float = 0.5, retries: int = 2) -> None:
        if environment.am_address is None:
            raise ValueError("a standalone worker has no application master")
        self.environment = environment
        self._client = AMClient(environment.am_address, environment.job, timeout_s=timeout_s, retries=retries)
        self._reports: queue.Queue[AdjustmentReport | WorkerStats | None] = queue.Queue()
        self._sender = threading.Thread(target=self._send_reports, name="elan-report-sender", daemon=True)
        self._sender.start()
        self._quiet_until = 0.0
        self.unanswered = False  # the last coordinate went unanswered: the AM may have decided a plan on it

    @property
    def worker_id(self) -> str:
        return self.environment.worker_id

    def register(self, device: str, topology: dict[str, Any] | None = None) -> bool:
        """Tell the AM where this worker lives; for a joiner this is *report ready*. Returns whether new workers are
        coming (to a member)."""
        request = RegisterRequest(self.worker_id, socket.gethostname(), device, os.getpid(), topology)
        return self._client.register(request, timeout_s=5.0, retries=5)

    def coordinate(self, request: CoordinateRequest) -> CoordinateReply:
        """Ask whether to adjust; any failure means "no decision" and training goes on.

        An AM that answers late (a loaded host) may still decide a plan on the request it did not answer in time: it
        holds that plan in flight and hands it to the next ``coordinate``. So after one unanswered request
        :attr:`unanswered` is set and the caller asks again at its next step; only after two in a row (an AM that is
        gone or restarting) does the link keep quiet for ``QUIET_AFTER_FAILURE_S``."""
        if time.monotonic() < self._quiet_until:
            return CoordinateReply.none()
        try:
            reply = self._client.coordinate(request)
        except AMUnavailable:
            self._note_unanswered()
            return CoordinateReply.none()
        except AMError as error:
            log.error("application master refused coordination: %s", error)
            reply = CoordinateReply.none()
        self.unanswered = False
        return reply

    def _note_unanswered(self) -> None:
        if not self.unanswered:
            log.warning("application master does not answer; training goes on, asking again at the next step")
            self.unanswered = True
            return
        log.warning("application master does not answer again; training goes on, asking again in %.0f s",
                    QUIET_AFTER_FAILURE_S)
        self.unanswered = False
        self._quiet_until = time.monotonic() + QUIET_AFTER_FAILURE_S

    def wait_plan(self, deadline_s: float) -> WaitPlanReply:
        """Long-poll until the AM decides a plan that includes this joiner (or cancels it)."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                reply = self._client.wait_plan(self.worker_id, WAIT_PLAN_POLL_S, retries=3)
            except AMUnavailable:
                log.warning("application master does not answer while this joiner waits; retrying")
                continue
            if reply.status == STATUS_STANDBY:  # in the standby pool: no request has taken it, no deadline runs
                end = time.monotonic() + deadline_s
            elif reply.status != STATUS_WAIT:
                return reply
        return WaitPlanReply.cancelled(f"no plan within {deadline_s:.0f} s")

    def recover(self, generation: int, step: int | None, deadline_s: float, uncertain: bool = False,
                before_loop: bool = False) -> WaitPlanReply:
        """Check in as a survivor of ``generation`` (``step`` None: no state held; ``uncertain``: it voted on the step
        after ``step`` and does not know the decision; ``before_loop``: not in its training loop yet), then wait for
        the recovery plan."""
        request = RecoverRequest(self.worker_id, generation, has_state=step is not None, step=step, uncertain=uncertain,
                                 before_loop=before_loop)
        try:
            body = self._client.request(request.TYPE, request.to_body(), timeout_s=REPORT_ATTEMPT_S,
                                        retries=REPORT_ATTEMPTS - 1)
        except AMUnavailable as error:
            return WaitPlanReply.cancelled(f"the application master does not answer: {error}")
        except AMError as error:
            return WaitPlanReply.cancelled(f"the application master refused recovery: {error}")
        reply = WaitPlanReply.from_body(body)
        return reply if reply.status != "wait" else self.wait_plan(deadline_s)

    def report_stalled(self, generation: int, waited_s: float, detail: str) -> list[int]:
        """Tell the AM that a collective of ``generation`` timed out with no member said to have died; returns the
        generations the AM failed for it (empty: it refused, e.g. the generation is over, or did not answer)."""
        request = StalledRequest(self.worker_id, generation, waited_s, detail[:500])
        try:
            body = self._client.request(request.TYPE, request.to_body(), timeout_s=REPORT_ATTEMPT_S,
                                        retries=REPORT_ATTEMPTS - 1)
        except (AMError, AMUnavailable) as error:
            log.warning("the application master did not take the stall of generation %d: %s", generation, error)
            return []
        return list(WorkerExitReply.from_body(body).failed_generations or [])

    def report(self, report: AdjustmentReport, wait: bool = False) -> None:
        """Queue an adjustment report; ``wait`` sends it now (a leaver about to exit)."""
        if wait:
            self._send_now(self._client, report)
        else:
            self._reports.put(report)

    def send_stats(self, stats: WorkerStats) -> None:
        """Queue this member's compute time for the AM (sent once, off the training thread; a lost one is skipped)."""
        if self._reports.qsize() < MAX_QUEUED:
            self._reports.put(stats)

    def close(self) -> None:
        self._reports.put(None)
        self._sender.join(timeout=5.0)
        self._client.close()

    def _send_reports(self) -> None:
        client = AMClient(self.environment.am_address or "", self.environment.job)
        try:
            while (report := self._reports.get()) is not None:
                if isinstance(report, WorkerStats):
                    self._send_stats(client, report)
                else:
                    self._send_now(client, report)
        finally:
            client.close()

    @staticmethod
    def _send_stats(client: AMClient, stats: WorkerStats) -> None:
        try:
            client.request(stats.TYPE, stats.to_body(), timeout_s=STATS_ATTEMPT_S, retries=0)
        except (AMError, AMUnavailable) as error:
            log.debug("compute stats not delivered (skipped): %s", error)

    @staticmethod
    def _send_now(client: AMClient, report: AdjustmentReport) -> None:
        try:
            client.report(report, timeout_s=REPORT_ATTEMPT_S, retries=REPORT_ATTEMPTS - 1)
        except (AMError, AMUnavailable) as error:
            log.warning("adjustment report not delivered: %s", error)
