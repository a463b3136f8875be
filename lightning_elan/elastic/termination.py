"""Graceful leave on SIGTERM: a preemption notice, a Kubernetes pod being stopped, ``scancel``.

A worker of an ``elan run`` job takes its first SIGTERM as a request to leave the job. It asks the application master
to remove it (``leave``) and leaves at the next batch boundary through an ordinary adjustment: it finishes the step it
is in, reports, ``fit()`` returns normally and the process exits 0; the others go on from the same step with nothing
redone (exactly as for ``elan scale remove``). How:

1. The signal handler (Python runs it on the main thread between two bytecodes) only counts the signal and wakes
   this module's thread, started with the handler: nothing in it blocks, allocates a socket or takes a lock the
   training thread may hold.
2. The thread sends ``leave`` to the AM on its own connection, resent until the AM answers. The AM queues the removal
   ahead of every scale request (``master/transitions/leaving.py``) and answers ``queued``; a joiner whose plan is not
   decided yet is cancelled with its request instead (``cancelled``): it then exits 0 as a cancelled joiner does, when
   it reaches ``join`` (at once if it is already waiting there).
3. Only rank 0 asks the AM, and every rank must take part in that agreement at the same step. So at every batch
   boundary that is not a coordination point anyway, each rank contributes "my leave is queued" to **one int32
   all-reduce (MAX)** on the job's group (:func:`any_rank_leaving`); when it gives 1, rank 0 coordinates at this
   boundary, the AM hands it the plan that removes the worker, and the worker leaves. The terminated worker itself
   raises the flag, so no store key and no extra round trip to rank 0 is needed, and the all-reduce agrees by
   construction. The engine skips it at coordination points (``coordinate_every`` multiples, deferred ones), where
   rank 0 asks the AM anyway.

Per-step cost: that one all-reduce of 4 bytes (in ``elan run`` jobs only; a standalone run has none). The Lightning
front-end drops Lightning's own per-batch broadcast of its SIGTERM flag in exchange, which elan's handler makes
always 0 (``compat.drop_sigterm_broadcast``), so a step runs as many collectives as under Lightning's DDP.

The crash path (the process kills itself with SIGKILL, as a preempted machine would) is the fallback: on a second
SIGTERM (one within :data:`REPEAT_WINDOW_S` of the first is the same notice delivered twice), when the worker has not
left ``ELAN_TERM_GRACE`` seconds (``elan run --term-grace``, default 30) after the first, and at once when the AM
answers that the job is finished or shutting down (``elan run`` stopping its workers). An AM that refuses the leave (the
last member of the job) leaves the worker training until the grace period ends: the job may finish in time. When the
engine closes (the training loop is over: left, finished or cancelled) the watch is disarmed and SIGTERM does again what
it did before (the previous handler).

Python runs a signal handler only when the main thread is back in the interpreter, so a worker stuck inside one long
C++ call (a rendezvous, a ``new_group`` of a user's ``prepare_data``, a collective on a hung peer) would never see its
SIGTERM. The watch therefore does not depend on the handler: it installs a socket as Python's *wakeup fd*
(``signal.set_wakeup_fd``), to which the interpreter's C-level handler writes the signal's number the moment it is
delivered, whatever the main thread is doing. The watch's thread reads it, asks the AM, and takes the crash path
``ELAN_TERM_GRACE`` seconds later even if the main thread never comes back: the worker enforces its grace period
itself, with or without a live launcher. (A C++ call that blocks *holding the GIL* still stops every thread; the
orchestrator's SIGKILL stays the backstop for that.) A forked child (a DataLoader worker) drops the inherited wakeup fd
at once (``os.register_at_fork``), so its signals are not taken for the worker's. When another wakeup fd is already set
(an asyncio loop on the main thread) it is left alone and the handler alone starts the watch, as before.

SIGTERM during start-up: ``elan run`` and ``elan worker`` start the worker with SIGTERM blocked
(``launcher/lifeline.py``), so a SIGTERM that comes while it imports torch and Lightning waits, pending, and
:meth:`TerminationWatch.install` unblocks it right after the handler (and the watch's thread, which keeps it blocked)
is installed: one that came meanwhile is delivered then, to the handler, and is a leave like any other (a joiner
still warming up is cancelled, a member of generation 0 leaves at its first batch boundary). The grace period starts
at that delivery, and ``install`` returns once the AM has answered the leave (at most :data:`HELD_ANSWER_WAIT_S`), so
a joiner's cancellation is decided before it can report ready. Until the watch is installed only SIGKILL ends the
worker; one that never installs it (a command that never starts the engine, an engine started off the main thread)
keeps SIGTERM blocked, and the launcher SIGKILLs it ``ELAN_TERM_GRACE`` seconds after the SIGTERM
(``lifeline.sigterm_held``). A child forked meanwhile (a DataLoader worker) unblocks SIGTERM at once: the launcher's
hold is the worker's alone. A process ``exec``'d by the worker before the watch is installed (a ``subprocess``, a
``spawn`` multiprocessing context) inherits the blocked mask.

SIGTERM to the worker's DataLoader processes: ``scancel`` and a machine's shutdown signal every process, and torch's
DataLoader worker dies of a SIGTERM that is not its parent's, which crashes the worker mid-step. A DataLoader worker
forked while the watch is armed therefore leaves such a SIGTERM to the worker's leave (:class:`_ChildSigterm`).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from lightning_elan import torch_compat
from lightning_elan.protocol.client import AMClient, AMError, AMUnavailable
from lightning_elan.protocol.contract import ENV_AM_ADDRESS, LEAVE_FINISHED, LEAVE_QUEUED, WorkerEnvironment
from lightning_elan.protocol.messages import new_message_id

log = logging.getLogger(__name__)

__all__ = ["TerminationWatch", "any_rank_leaving"]

LEAVE_ATTEMPT_S = 1.0
"""One attempt of the ``leave`` request; it is resent until the AM answers or the grace period ends."""

REPEAT_WINDOW_S = 1.0
"""A SIGTERM this soon after the first is the same notice, not the second that takes the crash path: Slurm's
``scancel``/``srun`` signal every process of a job step, so the training process gets the signal directly and again
from the ``elan worker`` that forwards it (as under an init process that forwards to its process group)."""

HELD_ANSWER_WAIT_S = 5.0
"""How long :meth:`TerminationWatch.install` waits for the AM's answer to the leave of a SIGTERM held since the start:
the AM knows of the leave before the worker goes on (a joiner is cancelled before it can report ready)."""

WAKEUP_POLL_S = 0.5
"""How often the watch's thread, waiting for the first SIGTERM on the wakeup socket, looks whether it was disarmed."""


class TerminationWatch:
    """One worker's SIGTERM handling while it is part of an elastic job (see the module docstring).

    ``kill`` is ``os.kill`` (tests pass a recorder); ``leave_queued`` is read by the engine at every batch boundary.
    """

    def __init__(self, environment: WorkerEnvironment, *, kill: Callable[[int, int], None] = os.kill,
                 repeat_window_s: float = REPEAT_WINDOW_S) -> None:
        if environment.am_address is None:
            raise ValueError("a standalone worker has no application master to leave")
        self.environment = environment
        self.grace_s = environment.term_grace_s
        self.signals = 0
        self.repeat_window_s = repeat_window_s
        self.outcome: str | None = None  # the AM's answer to leave (contract.LEAVE_*), None until it answered
        self.refusal: str | None = None  # why the AM refused, if it did
        self.fell_back: str | None = None  # why the crash path was taken, if it was
        self.held_at_start = False  # a SIGTERM came while the worker started: held until the watch was installed
        self._kill = kill
        self._pid = os.getpid()
        self._previous: Any = None
        self._installed = False
        self._received_at: float | None = None  # the first SIGTERM's delivery: the grace period starts
        self._handled_at: float | None = None  # the handler's first run: a second SIGTERM is one past the repeat window
        self._wakeup: _WakeupSocket | None = None
        self._wake = threading.Event()
        self._disarmed = threading.Event()
        self._answered = threading.Event()  # the leave was answered (or given up on)
        self._thread = threading.Thread(target=self._run, name="elan-sigterm", daemon=True)

    @classmethod
    def watch(cls, environment: WorkerEnvironment) -> TerminationWatch:
        """A watch installed as this process's SIGTERM handler (when called on the main thread)."""
        watch = cls(environment)
        watch.install()
        return watch

    @property
    def leave_queued(self) -> bool:
        """The AM queued this worker's removal: the job coordinates at the next batch boundary."""
        return self.outcome == LEAVE_QUEUED

    @property
    def installed(self) -> bool:
        return self._installed

    def install(self) -> bool:
        """Become the SIGTERM handler (Python allows it on the main thread only; elsewhere nothing changes)."""
        if self._installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            log.warning("the elastic engine started off the main thread: SIGTERM keeps its handler (no graceful leave)")
            return False
        self._wakeup = _WakeupSocket.install()
        self._previous = signal.signal(signal.SIGTERM, self.handle)
        self._thread.start()  # before the unblock: the thread keeps SIGTERM blocked and the main thread takes it
        self._installed = True
        _ARMED_IN.add(self._pid)
        self.held_at_start = _held_sigterm_pending()
        _unblock_sigterm()  # a SIGTERM held since the start runs the handler now
        if self.held_at_start and not self._answered.wait(HELD_ANSWER_WAIT_S):
            log.warning("the application master has not answered worker %s's leave in %g s: it starts meanwhile",
                        self.environment.worker_id, HELD_ANSWER_WAIT_S)
        return True

    def disarm(self) -> None:
        """The training loop is over: stop the watch and give SIGTERM back its previous handler."""
        self._disarmed.set()
        self._wake.set()
        _ARMED_IN.discard(self._pid)
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self.handle:
            signal.signal(signal.SIGTERM, self._previous)
        if self._wakeup is not None:
            self._wakeup.uninstall()

    # ------------------------------------------------------------------ the signal handler (main thread)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid or self._disarmed.is_set():
            # a forked child (DataLoader worker) inherited the handler, or the training loop is over
            _call_previous(self._previous, signum, frame)
            return
        self.signals += 1
        now = time.monotonic()
        if self._handled_at is None:  # the first (its delivery may have started the grace period already)
            self._handled_at = now
            self._start(now)
        elif now - self._handled_at >= self.repeat_window_s:
            self._fall_back("a second SIGTERM")

    def _start(self, now: float) -> None:
        """The first SIGTERM was delivered: the grace period starts and the watch's thread goes to work."""
        if self._received_at is None:
            self._received_at = now
        self._wake.set()
        if self._wakeup is not None:
            self._wakeup.nudge()

    # ------------------------------------------------------------------ the watch's thread

    def _run(self) -> None:
        if not self._await_sigterm():
            return
        assert self._received_at is not None
        deadline = self._received_at + self.grace_s
        when = " while it started" if self.held_at_start else ""
        log.warning("worker %s received SIGTERM%s: it asks to leave the job and leaves at the next batch boundary "
                    "(the crash path if it has not left in %g s)", self.environment.worker_id, when, self.grace_s)
        try:
            self._ask_to_leave(deadline)
        finally:
            self._answered.set()
        if self._disarmed.is_set():
            return
        if self.outcome == LEAVE_FINISHED:
            self._fall_back("the job is finished or shutting down: there is nothing to leave")
            return
        if not self._disarmed.wait(max(0.0, deadline - time.monotonic())):
            self._fall_back(f"it has not left the job {self.grace_s:g} s after SIGTERM")

    def _await_sigterm(self) -> bool:
        """Block until the first SIGTERM is delivered (True) or the watch is disarmed (False)."""
        while not self._disarmed.is_set():
            if self._received_at is not None:
                return True
            if self._wakeup is None:
                self._wake.wait()
            elif self._wakeup.sigterm_delivered(WAKEUP_POLL_S):
                self._start(time.monotonic())
        return False

    def _ask_to_leave(self, deadline: float) -> None:
        worker_id = self.environment.worker_id
        client = AMClient(self.environment.am_address or "", self.environment.job, timeout_s=LEAVE_ATTEMPT_S)
        msg_id = new_message_id()  # one request however often it is resent: a cancelled joiner's second leave is
        try:  # answered from the AM's reply cache, not refused as an unknown worker's
            while not self._disarmed.is_set() and time.monotonic() < deadline:
                try:
                    reply = client.leave(worker_id, retries=0, msg_id=msg_id)
                except AMUnavailable:
                    log.warning("the application master does not answer worker %s's leave; asking again", worker_id)
                    continue
                except AMError as error:
                    self.refusal = str(error)
                    log.error("the application master refused to let worker %s leave (%s): it trains on until the "
                              "job ends or the grace period does", worker_id, error)
                    return
                self.outcome = reply.outcome
                log.info("worker %s: leave %s (request %s)", worker_id, reply.outcome, reply.request_id)
                return
        finally:
            client.close()

    def _fall_back(self, reason: str) -> None:
        """The crash path: SIGKILL this process, as a preempted machine would."""
        if self._disarmed.is_set():
            return
        self.fell_back = reason
        log.error("worker %s takes the crash path (%s): killing itself with SIGKILL", self.environment.worker_id,
                  reason)
        _flush_logs()
        self._kill(os.getpid(), signal.SIGKILL)


class _WakeupSocket:
    """The socket Python's C-level signal handler writes every delivered signal's number to (``signal.set_wakeup_fd``),
    at once, even while the main thread is stuck in C++ and the Python handler cannot run."""

    def __init__(self) -> None:
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)

    @classmethod
    def install(cls) -> _WakeupSocket | None:
        """Become this process's wakeup fd (main thread); None when another one is set (it stays)."""
        wakeup = cls()
        previous = signal.set_wakeup_fd(wakeup._writer.fileno(), warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            wakeup.close()
            log.debug("a signal wakeup fd is already set: SIGTERM is seen when its Python handler runs")
            return None
        _WAKEUP_FDS.add(wakeup._writer.fileno())
        return wakeup

    def sigterm_delivered(self, timeout_s: float) -> bool:
        """Whether a SIGTERM came within ``timeout_s`` (other signals and nudges are read and dropped)."""
        try:
            readable, _, _ = select.select([self._reader], [], [], timeout_s)
            return bool(readable) and signal.SIGTERM in self._reader.recv(4096)
        except (OSError, ValueError):  # closed by uninstall
            return False

    def nudge(self) -> None:
        """Wake the thread waiting in :meth:`sigterm_delivered`."""
        try:
            self._writer.send(b"\0")
        except OSError:
            pass

    def uninstall(self) -> None:
        """Stop being the wakeup fd and close (main thread only: elsewhere it stays, as closing would let the signal
        handler write into whatever file takes the descriptor's number next)."""
        fileno = self._writer.fileno()
        current = signal.set_wakeup_fd(-1)
        if current not in (fileno, -1):
            signal.set_wakeup_fd(current)  # replaced since: that one stays
        _WAKEUP_FDS.discard(fileno)
        self.close()

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


_WAKEUP_FDS: set[int] = set()
"""The wakeup fds the watches of this process installed."""


def _drop_wakeup_in_child() -> None:
    """A forked child (a DataLoader worker) must not report its signals on the worker's wakeup socket."""
    if not _WAKEUP_FDS:
        return
    try:
        current = signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread
        return
    if current not in _WAKEUP_FDS:
        signal.set_wakeup_fd(current)
    _WAKEUP_FDS.clear()


os.register_at_fork(after_in_child=_drop_wakeup_in_child)


def _held_sigterm_pending() -> bool:
    """A SIGTERM waits for this thread to unblock it (it came while the worker started)."""
    return _sigterm_blocked() and signal.SIGTERM in signal.sigpending()


def _unblock_sigterm() -> None:
    """Unblock SIGTERM on this thread (the launcher started the worker with it blocked): one that came during the
    start-up is delivered now, to the handler just installed (``pthread_sigmask`` runs it before returning)."""
    if _sigterm_blocked():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _sigterm_blocked() -> bool:
    """Whether this thread has SIGTERM blocked (never where there are no signal masks)."""
    return hasattr(signal, "pthread_sigmask") and signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, ())


_HELD_BY_LAUNCHER = ENV_AM_ADDRESS in os.environ and _sigterm_blocked()
"""This worker was started with SIGTERM blocked (``launcher/lifeline.py``): its forked children must not be."""



def _unblock_sigterm_in_child() -> None:
    """A forked child (a DataLoader worker) dies of SIGTERM as usual: the launcher's hold is for the worker alone (the
    child starts with no pending signal, so none is delivered by this)."""
    if _HELD_BY_LAUNCHER:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


os.register_at_fork(after_in_child=_unblock_sigterm_in_child)

_ARMED_IN: set[int] = set()
"""The pid of this process while its watch is armed (installed, not disarmed)."""


class _ChildSigterm:
    """SIGTERM in a ``multiprocessing`` child forked while the worker's watch is armed (a DataLoader worker).

    ``scancel``, a machine's shutdown, an init process forwarding to a process group: each signals every process, so a
    DataLoader worker gets the worker's preemption notice too. Torch's worker handler dies of a SIGTERM that is not
    its parent's, and the worker's DataLoader then raises "DataLoader worker ... is killed by signal: Terminated" in
    the middle of a step: a crash where the worker would have left at the next batch boundary. So the child keeps
    SIGTERM blocked and a thread takes it (``sigwaitinfo`` tells who sent it): a DataLoader worker leaves a SIGTERM
    from anyone but its parent to the parent's leave (which ends it as a DataLoader ends its workers; were the parent
    to die, ``data.loader.EndWithParent``'s SIGKILL or torch's watchdog ends it); its parent's SIGTERM is delivered to
    it as before (torch's handler ends it). ``multiprocessing`` runs this in its forked children only
    (``util.register_after_fork``), before their target, and only a DataLoader worker defers: any other child keeps
    SIGTERM as it was (a Python handler must run on the child's main thread, which a signal taken by another thread
    does not interrupt in a blocking call); a process that ``exec``s (a ``subprocess``, a ``spawn`` or ``forkserver``
    context) is left alone, as a blocked SIGTERM would outlive the exec.
    """

    @classmethod
    def in_child(cls, _mark: object) -> None:
        armed = os.getppid() in _ARMED_IN
        _ARMED_IN.clear()
        loader_worker = torch_compat.is_dataloader_worker(multiprocessing.current_process())
        if armed and loader_worker and hasattr(signal, "sigwaitinfo"):
            cls.defer()

    @classmethod
    def defer(cls) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=cls._take, args=(os.getppid(),), name="elan-child-sigterm", daemon=True).start()

    @classmethod
    def _take(cls, parent: int) -> None:
        while True:
            sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
            if sender != parent:
                log.info("DataLoader worker %d: SIGTERM from pid %d left to its parent's leave", os.getpid(), sender)
                continue
            cls._deliver()

    @staticmethod
    def _deliver() -> None:
        """Deliver a SIGTERM to this process as if never deferred: sent to itself while only this thread takes it."""
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


_AFTER_FORK_MARK = _ChildSigterm()  # multiprocessing keeps its after-fork callbacks by a weak reference to an object
multiprocessing.util.register_after_fork(_AFTER_FORK_MARK, _ChildSigterm.in_child)


def _flush_logs() -> None:
    """Flush what can be flushed before the SIGKILL; a handler whose stream is closed must not stop the kill."""
    for stream in [*logging.getLogger().handlers, sys.stderr]:
        try:
            stream.flush()
        except (OSError, ValueError):
            continue


def _call_previous(previous: Any, signum: int, frame: FrameType | None) -> None:
    """What SIGTERM did before the watch: a Python handler, ignored, or the default (terminate the process)."""
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL, or None (a handler not installed from Python): die of the signal
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def any_rank_leaving(group: Any, leaving: bool, device: torch.device) -> bool:
    """Whether some rank of ``group`` has its SIGTERM leave queued: one int32 all-reduce (MAX). Every rank calls it at
    the same batch boundaries, so every rank gets the same answer."""
    flag = torch.tensor([1 if leaving else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
