"""The application master's server: one thread, a ZeroMQ ROUTER socket and a poll loop around ``JobState``."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import zmq

from lightning_elan.master import journal, registry, sizing
from lightning_elan.master.enrolment import Enrolment
from lightning_elan.master.failure_notice import FailureNotice
from lightning_elan.master.heartbeats import DEAF_S, Heartbeats, watched_workers
from lightning_elan.master.narration import completed_line, decided_line, plural, workers_phrase
from lightning_elan.master.state import JobState, StateError
from lightning_elan.master.store import StateStore, StoreConflict, StoreUnavailable
from lightning_elan.master.transitions import (
    adjustments,
    enrolling,
    launching,
    leaving,
    pool,
    recovering,
    requests,
    status_view,
)
from lightning_elan.protocol.auth import AuthError, FrameSigner, is_signed, refuse_open_bind
from lightning_elan.protocol.contract import (
    ENV_AM_ADDRESS,
    ENV_JOB,
    ENV_SCALE_OUT_COUNT,
    MESSAGES,
    MUTATING_TYPES,
    AdjustmentReport,
    AMStatus,
    AutoscaleRequest,
    CoordinateReply,
    CoordinateRequest,
    EmptyReply,
    EnrolReply,
    EnrolRequest,
    LeaveReply,
    LeaveRequest,
    ProfileRequest,
    RecoverRequest,
    RegisterRequest,
    ScaleCommand,
    ScaleReply,
    ShutdownRequest,
    StalledRequest,
    StartJobReply,
    StartJobRequest,
    StatusReply,
    StragglersRequest,
    WaitPlanReply,
    WaitPlanRequest,
    WorkerExitReply,
    WorkerExitRequest,
    WorkerPollReply,
    WorkerPollRequest,
    WorkerStats,
)
from lightning_elan.protocol.messages import (
    MAX_MESSAGE_BYTES,
    ProtocolError,
    Request,
    decode_request,
    encode_reply,
    error_reply,
    ok_reply,
)

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
POLL_INTERVAL_MS = 10
_T = TypeVar("_T")
HOUSEKEEPING_INTERVAL_S = 0.25  # the AM's own clock for a job of enrolled workers (no launcher polls it)
SIZING_INTERVAL_S = 0.25  # how often the AM looks at the job for its profile, autoscaler and stragglers
MAX_MESSAGES_PER_TICK = 256
FINISH_LINGER_S = 30.0
"""How long an AM of ``elan worker``s serves on after the job finished for the joiners it cancelled to learn it, and
for the workers that left to report their exits."""
MAX_WAIT_S = 3600.0
HARD_MESSAGE_LIMIT = 64 * MAX_MESSAGE_BYTES  # larger frames make ZeroMQ drop the connection (no reply)
ADJUSTMENTS_FILE = "adjustments.jsonl"
REPLY_CACHE_MAX_ENTRIES = 1024
REPLY_CACHE_MAX_AGE_S = 3600.0  # a client resending later than this may see its request applied again
REPLY_CACHE_MAX_BYTES = 16 * MAX_MESSAGE_BYTES
MAX_PARKED = 1024  # parked wait_plan requests (at most one per worker); the oldest is answered `wait` beyond it
WARNING_BURST = 20  # refused messages logged at WARNING per WARNING_WINDOW_S; the rest are counted
WARNING_WINDOW_S = 10.0


@dataclass
class _CachedReply:
    msg_type: str
    reply: dict[str, Any]
    stored_at: float  # time.time(): the age limit holds across AM restarts
    size: int  # bytes of the encoded reply


class ReplyCache:
    """Successful replies to mutating requests by request id, persisted with the state: at most ``max_entries``
    entries and ``max_bytes`` of replies, none older than ``max_age_s`` (oldest dropped first)."""

    def __init__(
        self,
        max_entries: int = REPLY_CACHE_MAX_ENTRIES,
        max_age_s: float = REPLY_CACHE_MAX_AGE_S,
        max_bytes: int = REPLY_CACHE_MAX_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, _CachedReply] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        """The encoded size of the cached replies."""
        return self._bytes

    def get(self, msg_id: str) -> tuple[str, dict[str, Any]] | None:
        """``(request type, reply)`` for an id answered less than ``max_age_s`` ago."""
        self._expire()
        entry = self._entries.get(msg_id)
        return None if entry is None else (entry.msg_type, entry.reply)

    def put(self, msg_id: str, msg_type: str, reply: dict[str, Any], stored_at: float | None = None) -> None:
        """Cache ``reply`` (``stored_at``: when it was first stored, for entries loaded from the store)."""
        self.discard(msg_id)
        size = len(json.dumps(reply, separators=(",", ":")))
        entry = _CachedReply(msg_type, reply, self._clock() if stored_at is None else stored_at, size)
        self._entries[msg_id] = entry
        self._bytes += size
        self._expire()
        while len(self._entries) > self.max_entries or (self._bytes > self.max_bytes and len(self._entries) > 1):
            self._pop_oldest()

    def discard(self, msg_id: str) -> None:
        entry = self._entries.pop(msg_id, None)
        if entry is not None:
            self._bytes -= entry.size

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._bytes -= entry.size

    def _expire(self) -> None:
        """Drop the entries older than ``max_age_s`` (entries are in insertion order, so the oldest come first)."""
        horizon = self._clock() - self.max_age_s
        while self._entries and next(iter(self._entries.values())).stored_at < horizon:
            self._pop_oldest()

    def to_list(self) -> list[list[Any]]:
        """``[[id, type, reply, stored_at], …]``, oldest first (the persisted form)."""
        return [[msg_id, e.msg_type, e.reply, e.stored_at] for msg_id, e in self._entries.items()]

    @classmethod
    def from_list(cls, entries: list[list[Any]], **limits: Any) -> ReplyCache:
        """Rebuild a persisted cache; entries past the age limit are dropped (3-item entries predate ``stored_at``
        and count as stored now)."""
        cache = cls(**limits)
        for msg_id, msg_type, reply, *rest in entries:
            cache.put(msg_id, msg_type, reply, stored_at=rest[0] if rest else None)
        return cache


@dataclass
class _ParkedWait:
    """A ``wait_plan`` request waiting for its answer."""

    envelope: list[bytes]
    msg_id: str
    worker_id: str
    deadline: float  # time.monotonic()


class _Park:
    """Returned by the wait_plan handler: no reply now."""


class _WarningBudget:
    """Log refused messages at WARNING up to ``burst`` per ``window_s``; count the rest and say how many."""

    def __init__(self, burst: int = WARNING_BURST, window_s: float = WARNING_WINDOW_S) -> None:
        self.burst = burst
        self.window_s = window_s
        self._window_start = -float("inf")
        self._logged = 0
        self.suppressed = 0

    def warn(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._window_start >= self.window_s:
            if self.suppressed:
                logger.warning("%s in the last %.0f s were not logged", plural(self.suppressed, "more refused message"),
                               self.window_s)
            self._window_start, self._logged, self.suppressed = now, 0, 0
        if self._logged < self.burst:
            self._logged += 1
            logger.warning(message, *args)
        else:
            self.suppressed += 1
            logger.debug(message, *args)


class ApplicationMaster:
    """Serves one job's ``JobState`` over ZeroMQ; persists it through ``store`` after every transition.

    The socket lives on the serving thread only: ``start()`` serves on a daemon thread, ``serve_forever()`` on the
    caller's. ``stop()`` ends either and removes the registry entry.
    """

    def __init__(
        self,
        job: str,
        store: StateStore,
        bind: str = "tcp://127.0.0.1:0",
        state_dir: str | Path | None = None,
        register: bool = True,
        secret: bytes | None = None,
        rendezvous: tuple[str | None, int] | str | None = None,
        announce_failure: FailureNotice | None = None,
    ) -> None:
        self.job = registry.check_job_name(job)
        self.store = store
        self.bind = bind
        refuse_open_bind(bind, secret)
        self._signer = None if secret is None else FrameSigner(secret)
        self.state_dir = None if state_dir is None else Path(state_dir)
        self.register = register
        self._warnings = _WarningBudget()
        self._started_at = time.time()
        self._finished_seen_at: float | None = None  # when ``over`` first saw the job finished (monotonic)
        self._state, self._replies = self._load(store)
        # every answer to a mutating request, for this process's lifetime: a copy the client resent before the first
        # answer reached it must get that answer, not a fresh application. ``_replies`` (persisted) holds only the
        # answers that changed the state; a first copy that changed nothing (a launcher_poll with no worker to start
        # yet) or was refused (a scale while an adjustment is in flight) is answered from here, or its resent copy,
        # applied after the state moved on, would start a worker or queue a request the client never hears of
        self._answered = ReplyCache()
        self._address: str | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._startup_error: BaseException | None = None
        self._serving = False
        self.fenced_reason: str | None = None  # set when a state write was refused (StoreConflict): stopped for good
        self._socket: zmq.Socket | None = None  # only touched by the serving thread
        self._parked: dict[str, _ParkedWait] = {}
        self._records_to_write: list[dict[str, Any]] = []
        self._rendezvous = rendezvous  # told to enrolled workers: (host or None, port) of a TCPStore, or a store URL
        self._announce = announce_failure  # sets a lost worker's failure keys in that store
        self._next_housekeeping = 0.0
        self._heartbeats: Heartbeats | None = None  # a job of `elan worker`s: when each was last heard from
        # each handler returns the reply dataclass contract.MESSAGES names for its type (sent as its ``to_body()``)
        self._handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
            "start_job": self._on_start_job,
            "scale": self._on_scale,
            "status": lambda body: self._status(),
            "launcher_poll": lambda body: launching.launcher_poll(self._state),
            "worker_exit": self._on_worker_exit,
            "shutdown": lambda body: requests.shutdown(self._state, ShutdownRequest.from_body(body).reason),
            "register": lambda body: requests.register(self._state, RegisterRequest.from_body(body)),
            "coordinate": self._on_coordinate,
            "wait_plan": self._on_wait_plan,
            "report": self._on_report,
            "recover": lambda body: recovering.recover(self._state, RecoverRequest.from_body(body)),
            "stalled": lambda body: recovering.collective_stalled(self._state, StalledRequest.from_body(body)),
            "worker_poll": self._on_worker_poll,
            "leave": self._on_leave,
            "enrol": self._on_enrol,
            "worker_stats": lambda body: adjustments.worker_stats(self._state, WorkerStats.from_body(body)),
            "profile": lambda body: sizing.start_profile(self._state, ProfileRequest.from_body(body), time.time()),
            "autoscale": lambda body: sizing.set_autoscale(self._state, AutoscaleRequest.from_body(body), time.time()),
            "stragglers": lambda body: sizing.set_stragglers(self._state, StragglersRequest.from_body(body),
                                                             time.time()),
        }
        _check_handlers(self._handlers)
        self._next_sizing = 0.0
        self._profile_written: float | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The bound address with its actual port, e.g. ``tcp://127.0.0.1:40123``."""
        if self._address is None:
            raise RuntimeError("the AM is not bound yet: call start() or serve_forever() first")
        return self._address

    def accept_enrolments(self, enrolment: Enrolment, **options: Any) -> None:
        """Let ``elan worker``s enrol (before ``start``): see :func:`enrolling.accept_enrolments`."""
        enrolling.accept_enrolments(self._state, enrolment, **options)
        self._persist()

    @property
    def finished(self) -> bool:
        return self._state.finished

    @property
    def over(self) -> bool:
        """Finished, and every joiner the finish cancelled and every worker that left has exited, or
        ``FINISH_LINGER_S`` passed since: an AM of ``elan worker``s that stopped at once left such a joiner asking an
        AM that was gone (etcd storm seed 9003), and a leaver still exiting when the job finished (its ``elan worker``
        spent a minute on the store and the AM that were gone before it could report its exit)."""
        if not self._state.finished:
            return False
        if self._finished_seen_at is None:
            self._finished_seen_at = time.monotonic()
        lingered = time.monotonic() - self._finished_seen_at >= FINISH_LINGER_S
        return lingered or not (self._state.cancelled_workers() or self._state.unreported_leavers())

    @property
    def finish_reason(self) -> str | None:
        """Why the job finished (``shutdown``'s reason, or the AM's own), None while it runs."""
        return self._state.finish_reason

    @property
    def serving(self) -> bool:
        """True while the serving loop runs (false once stopped, or fenced by a refused state write)."""
        return self._serving

    def start(self, timeout_s: float = 10.0) -> ApplicationMaster:
        """Bind and serve on a daemon thread; returns once the address is known."""
        if self._thread is not None or self._serving:
            raise RuntimeError("the AM is already serving")
        self._stopping.clear()
        self._ready.clear()
        self._startup_error = None
        self._address = None
        self._thread = threading.Thread(target=self._serve_on_thread, name=f"elan-am-{self.job}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the AM of job {self.job!r} did not bind within {timeout_s}s")
        if self._startup_error is not None:
            self._thread.join()
            self._thread = None
            raise self._startup_error
        return self

    def serve_forever(self) -> None:
        """Bind and serve on the calling thread until ``stop()``."""
        if self._serving:
            raise RuntimeError("the AM is already serving")
        self._stopping.clear()
        self._serve()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving, close the socket and remove the registry entry."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def __enter__(self) -> ApplicationMaster:
        """Start serving unless already started; ``__exit__`` stops."""
        if self._thread is None and not self._serving:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def _serve_on_thread(self) -> None:
        try:
            self._serve()
        except BaseException as error:
            if not self._ready.is_set():
                self._startup_error = error
                self._ready.set()
            else:
                logger.exception("the AM of job %r stopped on an error", self.job)

    def _serve(self) -> None:
        self._serving = True
        context = zmq.Context()
        socket = self._socket = context.socket(zmq.ROUTER)
        try:
            self._bind(socket)
            self._ready.set()
            self._loop(socket)
        finally:
            self._socket = None
            socket.close(linger=0)
            context.term()
            self._unregister()
            self._parked.clear()
            self._serving = False
            logger.debug("AM of job %r stopped serving", self.job)  # `elan am` says why at info

    def _bind(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_LIMIT)
        socket.bind(self.bind)
        self._address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.register:
            registry.write(self.job, self._address, self.state_dir)
        logger.debug("AM of job %r listening on %s (generation %s)", self.job, self._address, self._state.generation)

    def _unregister(self) -> None:
        if self.register and self._address is not None:
            try:
                registry.remove(self.job, address=self._address)
            except (OSError, ValueError):
                logger.warning("could not remove the registry entry of job %r", self.job, exc_info=True)

    def _loop(self, socket: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if poller.poll(POLL_INTERVAL_MS):
                self._drain(socket)
            self._expire_parked()
            self._keep_house()
            self._size_job()

    def _keep_house(self) -> None:
        """For a job of enrolled workers: start it, fail silent joiners, recover, finish (as a transaction)."""
        if self._state.enrolment is None or time.monotonic() < self._next_housekeeping:
            return
        self._next_housekeeping = time.monotonic() + HOUSEKEEPING_INTERVAL_S
        try:
            self._transaction(lambda: enrolling.housekeeping(self._state))
            self._declare_lost()
        except StoreUnavailable as error:
            self._warnings.warn("AM of job %r: the store is unavailable, housekeeping deferred: %s", self.job, error)
        except StoreConflict as error:
            self._fence(str(error))
            return
        self._wake_parked()

    def _declare_lost(self) -> None:
        """Workers whose `elan worker` went silent (``master/heartbeats.py``) are dead to the job; the failure is
        announced in the rendezvous store, as their `elan worker` would have."""
        heartbeats = self._job_heartbeats()
        if heartbeats is None:
            return
        was_deaf = heartbeats.deaf
        lost = heartbeats.silent(watched_workers(self._state), time.monotonic())
        self._log_deafness(was_deaf, heartbeats.deaf)
        for worker, silent_s in lost.items():
            heartbeats.forget(worker)
            try:
                reply = self._transaction(lambda w=worker, s=silent_s: recovering.worker_lost(self._state, w, s))
            except StateError as error:  # a bug: keep serving, the collective timeout stays the backstop
                logger.error("job %r: the loss of %s not recorded: %s", self.job, worker, error)
                continue
            if reply.recovering:
                self._announce_failure(worker, list(reply.failed_generations or []))

    def _log_deafness(self, was_deaf: bool, deaf: bool) -> None:
        if deaf and not was_deaf:
            logger.warning("AM of job %r: no word from any `elan worker` for %g s (is this AM's host cut off?): nobody "
                           "is declared lost meanwhile", self.job, DEAF_S)
        elif was_deaf and not deaf:
            logger.warning("AM of job %r: the `elan worker`s are heard again: each has its whole heartbeat timeout "
                           "from now", self.job)

    def _job_heartbeats(self) -> Heartbeats | None:
        enrolment = self._state.enrolment
        if enrolment is None:
            return None
        if self._heartbeats is None:
            self._heartbeats = Heartbeats(enrolment.heartbeat_timeout_s)
        return self._heartbeats

    def _heard_from(self, worker_id: str | None) -> None:
        heartbeats = self._job_heartbeats()
        if heartbeats is not None and worker_id is not None:
            heartbeats.heard(worker_id, time.monotonic())

    def _announce_failure(self, worker_id: str, generations: list[int]) -> None:
        """Set the failure keys of ``generations`` in the job's rendezvous store (``master/failure_notice.py``)."""
        if self._announce is None:
            return
        try:
            self._announce(worker_id, generations)
        except Exception as error:  # the survivors then see the loss at their collective's timeout
            logger.warning("job %r: could not announce the loss of %s in the rendezvous store: %s", self.job,
                           worker_id, str(error).splitlines()[0] if str(error) else type(error).__name__)
            return
        logger.warning("job %r: %s is lost: the survivors recover without it", self.job, worker_id)

    def _size_job(self) -> None:
        """The job's profile, autoscaler and stragglers (``master/sizing.py``), as a transaction; growth of a job of
        `elan worker`s runs the scale-out command."""
        if time.monotonic() < self._next_sizing:
            return
        self._next_sizing = time.monotonic() + SIZING_INTERVAL_S
        try:
            ask_for = self._transaction(lambda: sizing.tick(self._state))
        except (StateError, sizing.SizingError) as error:
            logger.warning("job %r: sizing decision not carried out: %s", self.job, error)
            return
        except StoreUnavailable as error:
            self._warnings.warn("AM of job %r: the store is unavailable, sizing deferred: %s", self.job, error)
            return
        except StoreConflict as error:
            self._fence(str(error))
            return
        self._write_profile()
        if ask_for:
            self._scale_out(ask_for)

    def _write_profile(self) -> None:
        """A finished profile as ``STATE_DIR/profile.json``: a ``ThroughputModel`` for ``HybridScaling(profile=…)``."""
        result = self._state.sizing.profile_result
        if result is None or self.state_dir is None or result.get("finished_at") == self._profile_written:
            return
        self._profile_written = result.get("finished_at")
        model = sizing.throughput_model(result)
        if model is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            (self.state_dir / sizing.PROFILE_FILE).write_text(json.dumps(model, indent=1))
            logger.info("job %r: profile written to %s", self.job, self.state_dir / sizing.PROFILE_FILE)

    def _scale_out(self, count: int) -> None:
        """Ask the cluster for ``count`` workers with the user's command (each joins by itself with `elan worker`)."""
        command = self._state.sizing.scale_out_command
        if not command:
            return
        env = {**os.environ, ENV_JOB: self.job, ENV_SCALE_OUT_COUNT: str(count), ENV_AM_ADDRESS: self._address or ""}
        for _ in range(count):
            logger.info("job %r: asking for a worker: %s", self.job, command)
            subprocess.Popen(command, shell=True, env=env, start_new_session=True, stdin=subprocess.DEVNULL)

    def _drain(self, socket: zmq.Socket) -> None:
        for _ in range(MAX_MESSAGES_PER_TICK):
            if self._stopping.is_set():  # fenced while draining: answer nothing more
                return
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_frames(frames)

    # ---- one message ---------------------------------------------------------------------------------------------

    def _on_frames(self, frames: list[bytes]) -> None:
        """Answer one message; nothing raised here may stop the loop."""
        envelope, payload = _split_envelope(frames)
        try:
            reply = self._reply_to(envelope, payload)
        except StoreUnavailable as error:  # nothing applied (rolled back); the client resends the same id
            self._warnings.warn("AM of job %r: the store is unavailable, request not answered: %s", self.job, error)
            reply = None
        except StoreConflict as error:
            self._fence(str(error))
            reply = None
        except Exception as error:  # a bug in a handler: answer and keep serving
            logger.exception("AM of job %r failed on a request", self.job)
            reply = error_reply(_peek_id(payload), f"internal error in the AM: {type(error).__name__}: {error}")
        if reply is not None:
            self._send(envelope, reply)

    def _fence(self, reason: str) -> None:
        """Another writer owns the state (or this AM lost its leadership): stop serving and writing at once."""
        logger.error("AM of job %r stops: its state write was refused: %s", self.job, reason)
        self.fenced_reason = reason
        self._stopping.set()

    def _reply_to(self, envelope: list[bytes], payload: bytes | None) -> dict[str, Any] | None:
        if payload is None:
            self._warnings.warn("AM of job %r: message with %d frames refused", self.job, len(envelope) + 1)
            return error_reply(None, "expected exactly one frame of JSON")
        try:
            payload = self._authenticated(payload)
        except AuthError as error:
            self._warnings.warn("AM of job %r refused a frame: %s", self.job, error)
            return error_reply(None, f"authentication failed: {error}")
        try:
            request = decode_request(payload, job=self.job)
        except ProtocolError as error:
            self._warnings.warn("AM of job %r refused a message: %.300s", self.job, error)
            return error_reply(error.msg_id, _clipped(str(error)))
        try:
            return self._handle(request, envelope)
        except (StateError, sizing.SizingError) as error:
            return self._refusal(request, error)

    def _authenticated(self, payload: bytes) -> bytes:
        """The request's JSON once its frame authenticates (with a secret), or as it came (without one)."""
        if self._signer is not None:
            return self._signer.verify(payload)
        if is_signed(payload):
            raise AuthError("this AM has no secret: start it with --secret-file (or send unsigned frames)")
        return payload

    def _handle(self, request: Request, envelope: list[bytes]) -> dict[str, Any] | None:
        if request.type not in MUTATING_TYPES:
            reply = self._handlers[request.type](request.body)
            if isinstance(reply, _Park):
                self._park(request, envelope)
                return None
            return ok_reply(request.id, reply_body(request.type, reply))
        cached = self._replies.get(request.id) or self._answered.get(request.id)
        if cached is not None:
            return self._replay(request, *cached)
        try:
            reply = self._apply(request)
        except (StateError, sizing.SizingError) as error:
            reply = self._refusal(request, error)
        else:
            self._wake_parked()
        self._answered.put(request.id, request.type, reply)
        return reply

    def _refusal(self, request: Request, error: Exception) -> dict[str, Any]:
        logger.debug("AM of job %r refused %s %s: %s", self.job, request.type, request.id, error)
        return error_reply(request.id, str(error))

    def _replay(self, request: Request, cached_type: str, reply: dict[str, Any]) -> dict[str, Any]:
        if cached_type != request.type:
            raise StateError(f"request id {request.id} was already used for a {cached_type} request")
        logger.debug("AM of job %r: duplicate %s %s answered from the reply cache", self.job, request.type, request.id)
        return reply

    def _apply(self, request: Request) -> dict[str, Any]:
        """Run a mutating handler as a transaction: persist on change, roll back on any error."""

        def handle() -> dict[str, Any]:
            return ok_reply(request.id, reply_body(request.type, self._handlers[request.type](request.body)))

        def remember(reply: dict[str, Any]) -> None:  # a reply that changed the state is answered again from here
            self._replies.put(request.id, request.type, reply)

        try:
            return self._transaction(handle, remember)
        except BaseException:
            self._replies.discard(request.id)
            raise

    def _transaction(self, change: Callable[[], _T], on_change: Callable[[_T], None] | None = None) -> _T:
        """Run ``change``; if the durable state changed, call ``on_change`` with its result and persist; roll back
        on any error."""
        before = self._state.to_dict()
        try:
            result = change()
            if _durable(self._state.to_dict()) != _durable(before):
                if on_change is not None:
                    on_change(result)
                self._persist()
        except BaseException:
            self._state = JobState.from_dict(before)
            self._records_to_write.clear()
            raise
        self._write_records()
        return result

    # ---- handlers ------------------------------------------------------------------------------------------------

    def _on_start_job(self, body: dict[str, Any]) -> StartJobReply:
        start = StartJobRequest.from_body(body)
        return launching.start_job(
            self._state, start.nproc, start.coordinate_every, start.hosts, start.report_timeout_s,
            bool(start.replace_failed), start.min_workers, start.join_timeout_s, start.standby or 0,
        )

    def _on_scale(self, body: dict[str, Any]) -> ScaleReply:
        command = ScaleCommand.from_body(body)
        reply = requests.scale(self._state, command.action, count=command.count, ranks=command.ranks,
                               size=command.size, at_step=command.at_step)
        asked = command.to_body()
        logger.info("%s", scale_line(self.job, reply.request_id, asked, reply.new_workers))
        logger.debug("job %r: scale request %s %s → new workers %s", self.job, reply.request_id, json.dumps(asked),
                     reply.new_workers)
        return reply

    def _on_worker_poll(self, body: dict[str, Any]) -> WorkerPollReply:
        request = WorkerPollRequest.from_body(body)
        self._heard_from(request.worker_id)
        return recovering.worker_poll(self._state, request)

    def _on_worker_exit(self, body: dict[str, Any]) -> WorkerExitReply:
        request = WorkerExitRequest.from_body(body)
        self._heard_from(request.worker_id)
        return recovering.worker_exit(self._state, request)

    def _on_enrol(self, body: dict[str, Any]) -> EnrolReply:
        request = EnrolRequest.from_body(body)
        self._heard_from(request.worker_id)
        reply = enrolling.enrol(self._state, request)
        if isinstance(self._rendezvous, str):
            return dataclasses.replace(reply, store_url=self._rendezvous)
        if self._rendezvous is not None:
            return dataclasses.replace(reply, store_host=self._rendezvous[0], store_port=self._rendezvous[1])
        return reply

    def _on_coordinate(self, body: dict[str, Any]) -> CoordinateReply:
        in_flight_before = self._state.in_flight
        reply = adjustments.coordinate(self._state, CoordinateRequest.from_body(body))
        if reply.plan is not None and in_flight_before is None:
            plan = reply.plan.to_dict()
            logger.info("%s", decided_line(self.job, plan))
            logger.debug("job %r: decided plan %s", self.job, json.dumps(plan))
        return reply

    def _on_report(self, body: dict[str, Any]) -> EmptyReply:
        self._records_to_write.extend(adjustments.report_completing(self._state, AdjustmentReport.from_body(body)))
        return EmptyReply()

    def _on_leave(self, body: dict[str, Any]) -> LeaveReply:
        worker_id = LeaveRequest.from_body(body).worker_id
        reply = leaving.request_leave(self._state, worker_id)
        logger.info("job %r: worker %s asks to leave: %s (request %s)", self.job, worker_id, reply.outcome,
                    reply.request_id)
        return reply

    def _on_wait_plan(self, body: dict[str, Any]) -> WaitPlanReply | _Park:
        request = WaitPlanRequest.from_body(body)
        answer = adjustments.wait_plan(self._state, request.worker_id)
        if answer is not None:
            return answer
        if (request.timeout_s or 0) <= 0:
            return pool.idle_answer(self._state, request.worker_id)
        return _Park()

    # ---- parked wait_plan requests -------------------------------------------------------------------------------

    def _park(self, request: Request, envelope: list[bytes]) -> None:
        """Park a wait_plan: a resend with the same id replaces the earlier one; a new one for the same worker
        answers the earlier one ``wait`` (a worker has one poll outstanding); beyond ``MAX_PARKED`` the oldest is
        answered ``wait`` too."""
        wait = WaitPlanRequest.from_body(request.body)
        deadline = time.monotonic() + min(float(wait.timeout_s or 0), MAX_WAIT_S)
        self._parked.pop(request.id, None)
        for earlier in [p for p in self._parked.values() if p.worker_id == wait.worker_id]:
            self._answer_parked(earlier, ok_reply(earlier.msg_id, WaitPlanReply.wait().to_body()))
        while len(self._parked) >= MAX_PARKED:
            oldest = next(iter(self._parked.values()))
            self._answer_parked(oldest, ok_reply(oldest.msg_id, WaitPlanReply.wait().to_body()))
        self._parked[request.id] = _ParkedWait(envelope, request.id, wait.worker_id, deadline)

    def _wake_parked(self) -> None:
        """Answer every parked wait_plan whose worker now has a plan or a cancellation."""
        for parked in list(self._parked.values()):
            try:
                answer = adjustments.wait_plan(self._state, parked.worker_id)
            except StateError as error:
                self._answer_parked(parked, error_reply(parked.msg_id, str(error)))
                continue
            if answer is not None:
                self._answer_parked(parked, ok_reply(parked.msg_id, answer.to_body()))

    def _expire_parked(self) -> None:
        now = time.monotonic()
        for parked in list(self._parked.values()):
            if parked.deadline <= now:
                answer = pool.idle_answer(self._state, parked.worker_id)
                self._answer_parked(parked, ok_reply(parked.msg_id, answer.to_body()))

    def _answer_parked(self, parked: _ParkedWait, reply: dict[str, Any]) -> None:
        del self._parked[parked.msg_id]
        self._send(parked.envelope, reply)

    def _send(self, envelope: list[bytes], reply: dict[str, Any]) -> None:
        if self._socket is None:
            return
        try:
            frame = encode_reply(reply)
            if self._signer is not None:
                frame = self._signer.sign(frame)
            self._socket.send_multipart([*envelope, frame], zmq.NOBLOCK)
        except zmq.ZMQError as error:  # peer gone or its queue full: it will resend
            logger.debug("AM of job %r could not send a reply: %s", self.job, error)

    # ---- persistence ---------------------------------------------------------------------------------------------

    def _load(self, store: StateStore) -> tuple[JobState, ReplyCache]:
        """The saved state, or a fresh one; resuming a saved state counts (and persists) one more AM restart."""
        saved = store.load()
        if saved is None:
            return JobState(job=self.job), ReplyCache()
        if saved.get("format") != STATE_FORMAT:
            raise ValueError(f"{store!r} holds state format {saved.get('format')!r}, expected {STATE_FORMAT}")
        if saved.get("job") != self.job:
            raise ValueError(f"{store!r} holds the state of job {saved.get('job')!r}, not {self.job!r}")
        state = JobState.from_dict(saved["state"])
        state.am_restarts += 1
        replies = ReplyCache.from_list(saved.get("replies", []))
        store.save(_document(self.job, state, replies))
        if self.state_dir is not None:  # a record the previous AM persisted but died before writing
            journal.repair(self.state_dir / ADJUSTMENTS_FILE, state.last_adjustment)
        logger.info(
            "AM of job %r resumes generation %s with %s (AM restart %d)",
            self.job,
            state.generation,
            plural(len(state.pending), "pending request"),
            state.am_restarts,
        )
        return state, replies

    def _persist(self) -> None:
        self.store.save(_document(self.job, self._state, self._replies))

    def _status(self) -> StatusReply:
        """The ``status`` reply: the job state's, with this AM process (pid, address, start time, restarts)."""
        status = status_view.status(self._state)
        am = AMStatus(self._state.am_restarts, os.getpid(), self._address, self._started_at, len(self._replies),
                      len(self._parked))
        return dataclasses.replace(status, am=am)

    def _write_records(self) -> None:
        """Append completed adjustment records to ``adjustments.jsonl`` (after the state that completes them)."""
        records, self._records_to_write = self._records_to_write, []
        for record in records:
            line = json.dumps(record, separators=(",", ":"))
            logger.info("%s", completed_line(self.job, record))
            logger.debug("job %r: adjustment complete: %s", self.job, line)
            if self.state_dir is not None:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                with open(self.state_dir / ADJUSTMENTS_FILE, "a", encoding="utf-8") as file:
                    file.write(line + "\n")
                    file.flush()
                    os.fsync(file.fileno())


def scale_line(job: str, request_id: str, asked: dict[str, Any], new_workers: list[str]) -> str:
    """A queued scale request in words: ``job 'x' queues r1: add 1 worker at step 20 (new worker w3)``."""
    text = f"job {job!r} queues {request_id}: {_asked(asked)}"
    if asked.get("at_step") is not None:
        text += f" at step {asked['at_step']}"
    if new_workers:
        text += f" ({'new worker' if len(new_workers) == 1 else 'new workers'} {workers_phrase(new_workers)})"
    return text


def _asked(asked: dict[str, Any]) -> str:
    """``add 2 workers`` / ``remove ranks 1 and 2`` / ``migrate 1 worker`` / ``resize to 3 workers``."""
    action = str(asked.get("action"))
    if asked.get("ranks") is not None:
        ranks = [str(rank) for rank in asked["ranks"]]
        return f"{action} {'rank' if len(ranks) == 1 else 'ranks'} {workers_phrase(ranks)}"
    if action == "to":
        return f"resize to {plural(int(asked.get('size') or 0), 'worker')}"
    return f"{action} {plural(int(asked.get('count') or 0), 'worker')}"


def _document(job: str, state: JobState, replies: ReplyCache) -> dict[str, Any]:
    """What the store holds: the state and the reply cache."""
    return {"format": STATE_FORMAT, "job": job, "state": state.to_dict(), "replies": replies.to_list()}


def _clipped(message: str, limit: int = 1000) -> str:
    """An error message short enough to echo back (a refused frame may quote much of itself)."""
    return message if len(message) <= limit else message[:limit] + "…"


def _split_envelope(frames: list[bytes]) -> tuple[list[bytes], bytes | None]:
    """``[identity, payload]`` from a DEALER (or ``[identity, b"", payload]`` from a REQ); payload None if neither."""
    if len(frames) == 2 or (len(frames) == 3 and frames[1] == b""):
        return frames[:-1], frames[-1]
    return frames[:1], None


def _peek_id(payload: bytes | None) -> str | None:
    """The request id, if the payload is a JSON object with a string id (for error replies); never raises."""
    try:
        message = json.loads(payload) if payload is not None and len(payload) <= MAX_MESSAGE_BYTES else None
    except (ValueError, RecursionError):
        return None
    msg_id = message.get("id") if isinstance(message, dict) else None
    return msg_id if isinstance(msg_id, str) else None


def _durable(state: dict[str, Any]) -> dict[str, Any]:
    """The state that must survive an AM restart: training progress (step, position) and the measurements
    (throughput, compute times) are refreshed by every ``coordinate`` and ``worker_stats`` and are only informational,
    so they alone never cost an fsync on rank 0's hot path."""
    return {key: value for key, value in state.items() if key not in ("progress", "measured")}


def reply_body(msg_type: str, reply: Any) -> dict[str, Any]:
    """The body sent for a handler's ``reply``: the reply dataclass ``contract.MESSAGES`` names for ``msg_type``, as
    its ``to_body()`` (any other reply is a bug in the handler: ``TypeError``)."""
    expected = MESSAGES[msg_type].reply
    if not isinstance(reply, expected):
        raise TypeError(f"the {msg_type} handler answered a {type(reply).__name__}, not a {expected.__name__}")
    return reply.to_body()


def _check_handlers(handlers: Mapping[str, Any]) -> None:
    """The AM handles exactly the protocol's message types (``contract.MESSAGES``): a type added on one side only
    fails here, when the AM is built, not when a worker first sends it."""
    missing, unknown = set(MESSAGES) - set(handlers), set(handlers) - set(MESSAGES)
    if missing or unknown:
        raise RuntimeError(f"the AM's handlers and contract.MESSAGES differ: no handler for {sorted(missing)}, "
                           f"handlers of unknown types {sorted(unknown)}")
