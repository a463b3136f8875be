"""The worker's side of the conversation with the application master."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import Any

from lightning_elan.protocol import AMClient, AMError, AMUnavailable
from lightning_elan.strategy.identity import WorkerIdentity  # TODO contract

log = logging.getLogger(__name__)

NO_DECISION: dict[str, Any] = {"decision": "none"}


class AMLink:
    """Synchronous calls from the training thread, plus a background sender for reports off the hot path."""

    def __init__(self, identity: WorkerIdentity, timeout_s: float = 0.5, retries: int = 2) -> None:
        assert identity.am_address is not None
        self.identity = identity
        self._client = AMClient(identity.am_address, identity.job, timeout_s=timeout_s, retries=retries)
        self._reports: queue.Queue[dict | None] = queue.Queue()
        self._sender = threading.Thread(target=self._send_reports, name="elan-report-sender", daemon=True)
        self._sender.start()
        self._quiet_until = 0.0

    def register(self, device: str, topology: dict[str, Any] | None = None) -> None:
        """Tell the AM where this worker lives; for a joiner this is *report ready*."""
        body = {
            "worker_id": self.identity.worker_id, "host": socket.gethostname(), "device": device, "pid": os.getpid()
        }
        if topology is not None:
            body["topology"] = topology
        self._client.request("register", body, timeout_s=5.0, retries=5)

    def coordinate(self, body: dict[str, Any]) -> dict[str, Any]:
        """Ask whether to adjust; any failure means "no decision" and training goes on."""
        if time.monotonic() < self._quiet_until:
            return NO_DECISION
        try:
            return self._client.request("coordinate", {"worker_id": self.identity.worker_id, **body})
        except AMUnavailable:
            log.warning("application master does not answer; training goes on, asking again in 5 s")
            self._quiet_until = time.monotonic() + 5.0
        except AMError as error:
            log.error("application master refused coordination: %s", error)
        return NO_DECISION

    def wait_plan(self, deadline_s: float) -> dict[str, Any]:
        """Long-poll until the AM decides a plan that includes this joiner (or cancels it)."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                reply = self._client.request(
                    "wait_plan", {"worker_id": self.identity.worker_id, "timeout_s": 5.0}, timeout_s=8.0, retries=3
                )
            except AMUnavailable:
                log.warning("application master does not answer while this joiner waits; retrying")
                continue
            if reply.get("status") != "wait":
                return reply
        return {"status": "cancelled", "reason": f"no plan within {deadline_s:.0f} s"}

    def report(self, body: dict[str, Any], wait: bool = False) -> None:
        """Queue an adjustment report; ``wait`` sends it now (a leaver about to exit)."""
        body = {"worker_id": self.identity.worker_id, **body}
        if wait:
            self._send_now(self._client, body)
        else:
            self._reports.put(body)

    def close(self) -> None:
        self._reports.put(None)
        self._sender.join(timeout=5.0)
        self._client.close()

    def _send_reports(self) -> None:
        client = AMClient(self.identity.am_address, self.identity.job, timeout_s=2.0, retries=3)
        try:
            while (body := self._reports.get()) is not None:
                self._send_now(client, body)
        finally:
            client.close()

    @staticmethod
    def _send_now(client: AMClient, body: dict[str, Any]) -> None:
        try:
            client.request("report", body)
        except (AMError, AMUnavailable) as error:
            log.warning("adjustment report not delivered: %s", error)
