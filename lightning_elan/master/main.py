"""Serving a job's AM in this process until it is told to stop: what ``elan am`` does (``elan run`` starts its AM as an
``elan am`` child). With the file store: one AM (and, for a job of ``elan worker``s, the job's TCPStore); with etcd: an
elected AM that leads or stands by (:class:`~lightning_elan.master.elected.ElectedAM`)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_elan.etcd import is_etcd_url, parse_etcd_url, rendezvous_url
from lightning_elan.master.enrolment import Enrolment
from lightning_elan.protocol.contract import CLEAN_FINISHES, AutoscaleRequest, StragglersRequest

log = logging.getLogger("lightning_elan.cli")  # the lines `elan am` prints (its log format names no module)

__all__ = ["CLEAN_FINISHES", "AMOptions", "AMStartError", "Stop", "serve", "stop_line"]



class AMStartError(Exception):
    """The AM cannot start (its store, its address, its rendezvous port): one line for the user, and an exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class AMOptions:
    """What ``elan am`` was asked for, validated by the command line."""

    job: str
    state_dir: Path
    bind: str
    store: str | None = None  # a file path, ``etcd://…``, or None (``STATE_DIR/state.json``)
    parent_pid: int | None = None  # stop when this process is no longer our parent (the launcher died)
    enrolment: Enrolment | None = None  # a job of ``elan worker``s
    coordinate_every: int | None = None
    join_timeout_s: float | None = None
    lease_ttl_s: float | None = None
    rdzv_port: int = 0
    sizing: list[AutoscaleRequest | StragglersRequest] = field(default_factory=list)  # sent once it serves

    @property
    def in_etcd(self) -> bool:
        return self.store is not None and is_etcd_url(self.store)


def serve(options: AMOptions) -> int:
    """Serve the job's AM until SIGINT/SIGTERM, the launcher's death or (``elan worker`` jobs) the job's end; the exit
    code of ``elan am``. :class:`AMStartError` if it cannot start."""
    with StopSignals() as signals:
        return _serve_elected(options, signals) if options.in_etcd else _serve_with_file_store(options, signals)


def _serve_with_file_store(options: AMOptions, signals: StopSignals) -> int:
    from lightning_elan.master import ApplicationMaster, FileStore
    from lightning_elan.master.failure_notice import tcp_store_notice
    from lightning_elan.protocol.auth import AuthError, secret_from_env

    make_state_dir(options.state_dir)
    store = FileStore(options.store or options.state_dir / "state.json")
    rendezvous = None if options.enrolment is None else _serve_rendezvous_store(options.rdzv_port)
    try:
        store.discard_partial_writes()
        am = ApplicationMaster(options.job, store, state_dir=options.state_dir, bind=options.bind,
                               secret=secret_from_env(),
                               rendezvous=None if rendezvous is None else (_advertised_host(options.bind),
                                                                           rendezvous.port),
                               announce_failure=None if rendezvous is None else tcp_store_notice(rendezvous))
    except AuthError as error:
        raise AMStartError(str(error)) from None
    except (OSError, ValueError) as error:
        raise AMStartError(f"cannot use the store {store.path}: {_reason(error)}") from None
    if options.enrolment is not None:
        am.accept_enrolments(options.enrolment, coordinate_every=options.coordinate_every,
                             join_timeout_s=options.join_timeout_s)
    _start(am, options.bind)
    _configure_sizing(am.address, options.job, options.sizing)
    log.info("AM of job %s (pid %d) at %s: state in %s; Ctrl-C stops it", options.job, os.getpid(), am.address,
             options.state_dir)
    enrolled = options.enrolment is not None
    stopped = wait_for_stop(signals, options.parent_pid, done=lambda: am.over if enrolled else False)
    log_stop(stop_line(options.job, stopped, am.finished, am.finish_reason))
    am.stop()
    return 0


def make_state_dir(state_dir: Path) -> None:
    """Create the job's state directory; one that cannot be made (a file there, no permission) → AMStartError."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise AMStartError(f"cannot create the state directory {state_dir}: {_reason(error)}") from None


def _reason(error: Exception) -> str:
    """An OSError's ``strerror`` (``File exists``), else the error's own message."""
    return getattr(error, "strerror", None) or str(error)


def _start(am: Any, bind: str) -> None:
    """Bind and serve; an address the system refuses (port taken, unknown host or interface) → AMStartError."""
    import zmq

    try:
        am.start()
    except zmq.ZMQError as error:
        raise AMStartError(f"cannot bind the AM to {bind}: {error.strerror}") from None


def _configure_sizing(address: str, job: str, requests: list[AutoscaleRequest | StragglersRequest]) -> None:
    """Send the sizing options to the AM this process serves (the state keeps them across restarts)."""
    from lightning_elan.protocol.client import AMClient, AMError, AMUnavailable

    for request in requests:
        client = AMClient(address.replace("0.0.0.0", "127.0.0.1"), job)
        try:
            client.request(request.TYPE, request.to_body())
        except AMUnavailable:
            raise AMStartError(f"job {job}'s AM at {client.address} does not answer") from None
        except AMError as error:
            raise AMStartError(str(error), code=1) from None
        finally:
            client.close()


def _serve_rendezvous_store(port: int) -> Any:
    """The job's TCPStore (joiners' rendezvous, failure keys), served by this AM process for enrolled workers."""
    from torch.distributed import TCPStore

    try:
        return TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)
    except RuntimeError as error:
        raise AMStartError(f"cannot serve the rendezvous store on port {port}: {error}") from None


def _advertised_host(bind: str) -> str | None:
    """The host enrolled workers reach the store at: the AM's bind host, unless it is a wildcard (then the host each
    worker reaches the AM at)."""
    host = bind.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return None if host in ("*", "0.0.0.0", "::", "") else host


def _serve_elected(options: AMOptions, signals: StopSignals) -> int:
    """``--store etcd://…``: lead or stand by until stopped. The rendezvous store of such a job is in etcd too (no
    TCPStore): it outlives every AM process, so the workers' next rendezvous survives a fail-over."""
    from lightning_elan.etcd import StoreError
    from lightning_elan.master.elected import ElectedAM
    from lightning_elan.master.leadership import DEFAULT_LEASE_TTL_S
    from lightning_elan.protocol.auth import AuthError, refuse_open_bind, secret_from_env

    assert options.store is not None
    locator = parse_etcd_url(options.store)  # the command line validated it
    try:
        secret = secret_from_env()
        refuse_open_bind(options.bind, secret)
        elected = ElectedAM(options.job, locator, options.bind, state_dir=options.state_dir, secret=secret,
                            ttl_s=options.lease_ttl_s or DEFAULT_LEASE_TTL_S, enrolment=options.enrolment,
                            enrolment_options={"coordinate_every": options.coordinate_every,
                                               "join_timeout_s": options.join_timeout_s},
                            rendezvous=None if options.enrolment is None else rendezvous_url(locator, options.job))
    except (AuthError, StoreError, ValueError) as error:
        raise AMStartError(str(error)) from None
    stop, failed = threading.Event(), threading.Event()
    runner = threading.Thread(target=_run_elected, args=(elected, options, stop, failed), name="elan-elected-am",
                              daemon=True)
    runner.start()
    log.info("AM of job %s (pid %d): state in %s; Ctrl-C stops it", options.job, os.getpid(), locator.url())
    done = elected.job_over if options.enrolment is not None else (lambda: False)
    stopped = wait_for_stop(signals, options.parent_pid, done=done)
    log_stop(stop_line(options.job, stopped, elected.job_over(), None))
    stop.set()
    runner.join(30)
    return 1 if failed.is_set() else 0


def _run_elected(elected: Any, options: AMOptions, stop: threading.Event, failed: threading.Event) -> None:
    import zmq

    try:
        elected.run(stop)
    except zmq.ZMQError as error:  # the leader's bind: a port taken, an unknown host or interface
        log.error("the AM of job %s cannot bind %s: %s", options.job, options.bind, error.strerror)
    except BaseException:
        log.exception("the AM of job %s failed", options.job)
    else:
        return
    failed.set()
    signal.raise_signal(signal.SIGTERM)  # wakes wait_for_stop on the main thread


@dataclass(frozen=True)
class Stop:
    """Why ``elan am`` stopped waiting: a signal, its launcher gone (``--parent-pid``), or the job over."""

    cause: str  # "signal", "parent" or "done"
    signal: str | None = None  # the signal's name, when one came
    parent_pid: int | None = None


def stop_line(job: str, stop: Stop, finished: bool, reason: str | None) -> tuple[int, str]:
    """The level and line ``elan am`` logs as it stops: the job's end, its launcher gone, or a signal from outside."""
    if finished:
        return logging.INFO, f"AM of job {job!r} stopped: {_job_end(reason)}"
    if stop.cause == "parent":
        return logging.WARNING, f"AM of job {job!r} stopped: its launcher (pid {stop.parent_pid}) is gone"
    if stop.cause == "done":
        return logging.INFO, f"AM of job {job!r} stopped: the job is over"
    return logging.INFO, f"received {stop.signal}: stopping the AM of job {job!r}"


def log_stop(line: tuple[int, str]) -> None:
    """Log a :func:`stop_line`."""
    log.log(line[0], "%s", line[1])


def _job_end(reason: str | None) -> str:
    """``the job finished`` / ``the job failed: …`` / ``the job was stopped: …`` from the job's finish reason."""
    if reason is None:
        return "the job is over"
    if reason in CLEAN_FINISHES:
        return "the job finished"
    if reason.startswith("failed: "):
        return f"the job failed: {reason.removeprefix('failed: ')}"
    return "the job was shut down" if reason == "shutdown" else f"the job was stopped: {reason}"


STOP_POLL_S = 0.1
"""How often ``elan am`` looks for a stop (a signal recorded, its launcher gone, the job over)."""


class StopSignals:
    """SIGINT and SIGTERM recorded from the moment ``serve`` starts: one that comes while the AM starts (after its
    registry entry is written, before it waits) is a stop like any other, never the default handler's death that
    would leave the entry behind. ``elan run`` starts its AM with SIGTERM blocked (the lifeline's ``hold_sigterm``):
    a SIGTERM during the imports waits here, and is unblocked once the handler is in place.

    The handler only appends to a list: it runs on the main thread between any two of its bytecodes, so it must take
    no lock (an ``Event.set`` there deadlocks when the signal lands while the main thread holds the event's lock
    inside ``Event.wait``: the AM then never stopped, and its registry entry outlived it)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self._previous = {signum: signal.signal(signum, self._on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received.append(signum)


def wait_for_stop(signals: StopSignals, parent_pid: int | None = None,
                  done: Callable[[], bool] = lambda: False) -> Stop:
    """Block until ``signals`` records SIGINT or SIGTERM (or until ``parent_pid`` is no longer our parent, or
    ``done()``); return why."""
    while not signals.received:
        if parent_pid is not None and os.getppid() != parent_pid:
            return Stop("parent", parent_pid=parent_pid)
        if done():
            return Stop("done")
        time.sleep(STOP_POLL_S)
    name = signal.Signals(signals.received[0]).name
    if parent_pid is not None and os.getppid() != parent_pid:  # the kernel's SIGTERM as the launcher died
        return Stop("parent", name, parent_pid)
    return Stop("signal", name)
