"""A request/reply client for the application master (ZeroMQ DEALER with timeout and resend).

The worker ↔ AM messages go in and out as the contract's dataclasses (:mod:`lightning_elan.protocol.contract`);
``request`` is the untyped form every call goes through.
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType
from typing import Any

import zmq

from lightning_elan.protocol.addresses import split_am_addresses
from lightning_elan.protocol.auth import AuthError, FrameSigner, is_signed, secret_from_env
from lightning_elan.protocol.contract import (
    ENV_SECRET_FILE,
    AdjustmentReport,
    CoordinateReply,
    CoordinateRequest,
    LeaveReply,
    LeaveRequest,
    RegisterReply,
    RegisterRequest,
    ScaleCommand,
    StatusRequest,
    WaitPlanReply,
    WaitPlanRequest,
)
from lightning_elan.protocol.messages import ProtocolError, Reply, decode_reply, encode_request, new_message_id

logger = logging.getLogger(__name__)


class AMError(RuntimeError):
    """The AM answered with an error; ``str(error)`` is the AM's message."""

    def __init__(self, message: str, msg_type: str | None = None, msg_id: str | None = None) -> None:
        super().__init__(message)
        self.msg_type = msg_type
        self.msg_id = msg_id


class _FromEnvironment:
    """The default secret of a client: the file named by ``$ELAN_SECRET_FILE``, if set."""


FROM_ENVIRONMENT = _FromEnvironment()


class AMUnavailable(ConnectionError):
    """The AM did not answer a request, even after every resend."""


def split_addresses(address: str) -> list[str]:
    """``"tcp://a:1,b:2"`` → ``["tcp://a:1", "tcp://b:2"]`` (:func:`~lightning_elan.protocol.addresses.am_address`
    forms); ValueError on an empty list, an empty entry or a wrong address."""
    return split_am_addresses(address)


class AMClient:
    """Talks to one job's AM. Use one client per thread: a ZeroMQ socket must not be shared between threads.

    (A lock serialises accidental sharing, but a parked ``wait_plan`` then blocks every other caller.)
    Each request waits ``timeout_s`` for its reply, then is resent with the **same id** up to ``retries`` times, so
    the AM applies it at most once; replies carrying another id (late answers to earlier requests) are discarded.

    ``address`` may list the addresses of several AMs of the job, comma-separated (``tcp://a:1,tcp://b:2``: a leader
    and its standbys, ``elan am --store etcd://…``). The socket connects to all of them, and each attempt goes to one
    that is connected (only the leader binds its address; a standby binds once it leads); an attempt waits up to
    ``timeout_s`` for a connected AM, then up to ``timeout_s`` for the reply.
    """

    def __init__(self, address: str, job: str, timeout_s: float = 2.0, retries: int = 3,
                 secret: bytes | _FromEnvironment | None = FROM_ENVIRONMENT) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be ≥ 0, got {retries}")
        self.address = address
        self.addresses = split_addresses(address)
        self.job = job
        self.timeout_s = timeout_s
        self.retries = retries
        if isinstance(secret, _FromEnvironment):
            secret = secret_from_env()
        self._signer = None if secret is None else FrameSigner(secret)
        self._lock = threading.Lock()
        self._socket: zmq.Socket | None = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if len(self.addresses) > 1:  # queue nothing for an AM that is not there (a standby, a dead leader)
            self._socket.setsockopt(zmq.IMMEDIATE, 1)
        for each in self.addresses:
            self._socket.connect(each)

    def request(
        self,
        type: str,
        body: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
        msg_id: str | None = None,
    ) -> dict[str, Any]:
        """Send one request and return the reply body; raises ``AMError`` or ``AMUnavailable``."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        retries = self.retries if retries is None else retries
        msg_id = msg_id or new_message_id()
        payload = encode_request(msg_id, self.job, type, body)
        attempts = retries + 1
        with self._lock:
            socket = self._open_socket()
            for attempt in range(1, attempts + 1):
                # each attempt signed anew (a fresh nonce); the same id lets the AM answer a resend from its cache
                self._send(socket, payload if self._signer is None else self._signer.sign(payload), timeout_s)
                reply = self._await_reply(socket, msg_id, timeout_s)
                if reply is not None:
                    return self._unwrap(reply, type)
                if attempt < attempts:
                    logger.debug("no reply to %s %s within %.3gs; resending", type, msg_id, timeout_s)
        raise AMUnavailable(
            f"no reply from the AM of job {self.job!r} at {self.address} to {type} (id {msg_id}) "
            f"after {attempts} attempt(s) of {timeout_s:g}s"
        )

    def scale(
        self,
        action: str,
        count: int | None = None,
        ranks: list[int] | None = None,
        size: int | None = None,
        at_step: int | None = None,
    ) -> dict[str, Any]:
        """Ask for an adjustment; returns the reply's body ``{request_id, new_workers}`` (``ScaleReply.from_body``)."""
        command = ScaleCommand(action, count, ranks, size, at_step)
        return self.request(command.TYPE, command.to_body())

    def status(self) -> dict[str, Any]:
        """The job's status as the AM sent it (docs/architecture.md, *Status*; ``StatusReply.from_body`` types it)."""
        return self.request(StatusRequest.TYPE)

    def register(self, request: RegisterRequest, *, timeout_s: float | None = None, retries: int | None = None) -> bool:
        """Tell the AM where a worker lives; for a joiner this is *report ready*. Returns whether new workers are
        coming (a member's registration: a queued request starts some)."""
        body = self.request(request.TYPE, request.to_body(), timeout_s=timeout_s, retries=retries)
        return bool(RegisterReply.from_body(body).joiners_coming)

    def coordinate(
        self, request: CoordinateRequest, *, timeout_s: float | None = None, retries: int | None = None
    ) -> CoordinateReply:
        """Rank 0's question: adjust now (with the plan) or not."""
        return CoordinateReply.from_body(
            self.request(request.TYPE, request.to_body(), timeout_s=timeout_s, retries=retries)
        )

    def wait_plan(self, worker_id: str, timeout_s: float, *, retries: int | None = None) -> WaitPlanReply:
        """Long-poll for this joiner's plan; the client waits ``timeout_s`` plus its own timeout for the answer."""
        request = WaitPlanRequest(worker_id, timeout_s)
        body = self.request(request.TYPE, request.to_body(), timeout_s=timeout_s + self.timeout_s, retries=retries)
        return WaitPlanReply.from_body(body)

    def report(self, report: AdjustmentReport, *, timeout_s: float | None = None, retries: int | None = None) -> None:
        """Send one worker's adjustment report."""
        self.request(report.TYPE, report.to_body(), timeout_s=timeout_s, retries=retries)

    def leave(self, worker_id: str, *, timeout_s: float | None = None, retries: int | None = None,
              msg_id: str | None = None) -> LeaveReply:
        """Ask the AM to remove ``worker_id`` from the job (it received SIGTERM)."""
        request = LeaveRequest(worker_id)
        body = self.request(request.TYPE, request.to_body(), timeout_s=timeout_s, retries=retries, msg_id=msg_id)
        return LeaveReply.from_body(body)

    def close(self) -> None:
        """Close the socket (pending messages are dropped)."""
        with self._lock:
            if self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None

    def __enter__(self) -> AMClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _open_socket(self) -> zmq.Socket:
        if self._socket is None:
            raise RuntimeError("AMClient is closed")
        return self._socket

    def _send(self, socket: zmq.Socket, payload: bytes, timeout_s: float) -> None:
        if len(self.addresses) > 1 and not socket.poll(max(1, round(timeout_s * 1000)), zmq.POLLOUT):
            logger.debug("no AM of %s is connected; the attempt is lost", self.address)
            return
        try:
            socket.send(payload, zmq.NOBLOCK)
        except zmq.Again:  # send queue full; count it as a lost attempt
            logger.debug("send queue to %s is full; the attempt is lost", self.address)

    def _await_reply(self, socket: zmq.Socket, msg_id: str, timeout_s: float) -> Reply | None:
        """The reply with ``msg_id``, or None when ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not socket.poll(max(1, round(remaining * 1000)), zmq.POLLIN):
                continue
            try:
                reply = decode_reply(self._authenticated(socket.recv(zmq.NOBLOCK)))
            except zmq.Again:
                continue
            except AuthError as error:
                if "bad signature" in str(error):  # nobody but a holder of the secret could have answered at all
                    raise AMError(f"the reply of the AM of job {self.job!r} at {self.address} does not verify: "
                                  "is the secret file the AM's?", msg_type=None, msg_id=msg_id) from None
                logger.warning("discarding a reply from %s: %s", self.address, error)
                continue
            except ProtocolError as error:
                logger.warning("discarding an invalid reply from %s: %s", self.address, error)
                continue
            if reply.id == msg_id:
                return reply
            logger.debug("discarding a reply for id %s while waiting for %s", reply.id, msg_id)
        return None

    def _authenticated(self, frame: bytes) -> bytes:
        if self._signer is not None and not is_signed(frame):
            refusal = decode_reply(frame)  # an AM without our secret answers unsigned: only its refusal is heard
            reason = refusal.error if not refusal.ok else "it answered without a signature"
            raise AMError(f"the AM of job {self.job!r} at {self.address} refused the request: {reason}")
        if self._signer is not None:
            return self._signer.verify(frame)
        if is_signed(frame):
            raise AMError(f"the AM of job {self.job!r} at {self.address} requires a shared secret: pass "
                          f"--secret-file or set ${ENV_SECRET_FILE}")
        return frame

    def _unwrap(self, reply: Reply, msg_type: str) -> dict[str, Any]:
        if not reply.ok:
            raise AMError(reply.error or "unknown error", msg_type=msg_type, msg_id=reply.id)
        return reply.body
