"""``elan worker``: one worker started by any scheduler (Kubernetes, Slurm, ssh, a shell) that enrols with a job.

The worker asks the job's AM (``elan am --min-workers N``) for a place, waits while the job has not started, then
runs the training command with the ``ELAN_*`` environment of a member of generation 0 or of a joiner — exactly what
``elan run`` gives its children. It forwards SIGTERM to the command (the graceful leave a scheduler asks for when it
deletes a pod or ends a step), and so takes Ctrl-C (SIGINT): the command starts with SIGINT ignored, since a
terminal sends Ctrl-C to the whole process group and the command's own KeyboardInterrupt would end its ``fit`` (a
death, its step redone) instead of the leave. It tells the AM how the command exited and exits with the same code.
A command that died is announced to the survivors through the rendezvous store, as ``elan run`` does, so their
collectives are released.
While the command runs it asks the AM about it (``worker_poll``) and SIGKILLs a command the AM declared dead (it
stopped answering: frozen or hung) or one stopped (SIGSTOP) for ``stopped_grace_s`` after the job's training ended,
as ``elan run`` does for its children: the scheduler's allocation then ends instead of holding a frozen process.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType

from lightning_elan.launcher.lifeline import die_with_parent, is_stopped, sigterm_held
from lightning_elan.launcher.run import generations_phrase
from lightning_elan.launcher.segments import remove_segments_of
from lightning_elan.protocol.addresses import am_address_list
from lightning_elan.protocol.client import AMClient, AMError, AMUnavailable
from lightning_elan.protocol.contract import (
    DEFAULT_TERM_GRACE_S,
    ENV_AM,
    ROLE_MEMBER,
    STRIPPED_ENV_VARS,
    EnrolReply,
    EnrolRequest,
    WorkerEnvironment,
    WorkerExitReply,
    WorkerExitRequest,
    WorkerPollReply,
    WorkerPollRequest,
    failure_key,
    script_failed_key,
    split_host_port,
    training_ended_key,
)
from lightning_elan.protocol.messages import new_message_id

log = logging.getLogger(__name__)

ENROL_ATTEMPT_S = 1.0
ANNOUNCE_TIMEOUT_S = 60.0
"""How long announcing a death may wait for the rendezvous store (e.g. an etcd outage)."""
MARKS_TIMEOUT_S = 10.0
"""How long reading the command's marks in the rendezvous store may take when its exit is reported."""
EXIT_NOT_ENROLLED = 3
"""``elan worker``'s exit code when the AM refused it (job finished, full, not taking workers) or never answered."""


def command_preexec() -> Callable[[], None]:
    """The command's ``preexec_fn``: it dies with this process, starts with SIGTERM held (``lifeline``) and with SIGINT
    ignored (Ctrl-C is this process's to forward as the leave; Python keeps an ignored SIGINT ignored)."""
    lifeline = die_with_parent(signal.SIGTERM, hold_sigterm=True)

    def preexec() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if lifeline is not None:
            lifeline()

    return preexec


class NotEnrolled(RuntimeError):
    """The AM refused this worker, or no AM answered in time."""


def am_addresses(text: str) -> str:
    """``ADDRESS[,ADDRESS…]`` (each ``HOST:PORT``, ``tcp://HOST:PORT`` or ``HOST``) → the list ``AMClient`` takes."""
    return am_address_list(text)


@dataclass
class WorkerConfig:
    """What ``elan worker`` was told."""

    am: str  # ZeroMQ address list (am_addresses)
    job: str
    command: list[str]
    device_index: int | None = None
    term_grace_s: float = DEFAULT_TERM_GRACE_S
    enrol_timeout_s: float = 600.0  # for an AM to answer and, before the start, for the job to start
    poll_s: float = 0.5
    am_poll_s: float = 5.0  # how often the AM is asked about the running command (``worker_poll``): 200 workers, 40/s
    stopped_grace_s: float = 30.0  # a command stopped (SIGSTOP) this long after the training ended is killed

    @property
    def am_host(self) -> str:
        """The host of the first AM address: where the rendezvous store is, unless the AM names another."""
        return split_host_port(self.am.split(",")[0].removeprefix("tcp://"))[0]


class EnrolledWorker:
    """Enrol, run the command as a member or a joiner, report its exit; :meth:`run` returns the exit code."""

    def __init__(self, config: WorkerConfig, base_env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._client = AMClient(config.am, config.job, timeout_s=ENROL_ATTEMPT_S, retries=0)
        self._child: subprocess.Popen[bytes] | None = None
        self._next_am_poll = 0.0
        self._am_polls = True  # False once an AM refused ``worker_poll`` (an older AM): not asked again
        self._stopped_since: float | None = None

    def run(self) -> int:
        try:
            enrolment = self._enrol()
            returncode = self._run_command(enrolment)
            self._report_exit(enrolment, returncode)
            return returncode
        finally:
            self._client.close()

    # ------------------------------------------------------------------ enrolment

    def _enrol(self) -> EnrolReply:
        """A place in the job: first the AM's answer, then (before the start) polls until the job starts."""
        request = EnrolRequest(socket.gethostname(), os.getpid())
        deadline = time.monotonic() + self.config.enrol_timeout_s
        log.info("enrolling with the AM of job %s at %s", self.config.job, self.config.am)
        reply = self._ask(request, deadline)
        log.info("enrolled in job %s as %s (%s)", self.config.job, reply.worker_id, reply.role)
        while reply.waiting:
            time.sleep(self.config.poll_s)
            reply = self._ask(EnrolRequest(request.host, request.pid, reply.worker_id), deadline)
        return reply

    def _ask(self, request: EnrolRequest, deadline: float) -> EnrolReply:
        """Ask until answered, every attempt under one message id: attempts queued for an AM that is not yet
        listening all reach it once it is, and its reply cache answers all but the first (a new id each would enrol
        this worker once per attempt, under several ids)."""
        msg_id = new_message_id()
        while True:
            try:
                return EnrolReply.from_body(self._client.request(request.TYPE, request.to_body(), msg_id=msg_id))
            except AMUnavailable:
                if time.monotonic() > deadline:
                    raise NotEnrolled(f"no AM of job {self.config.job} answered at {self.config.am} within "
                                      f"{self.config.enrol_timeout_s:g} s") from None
            except AMError as error:
                raise NotEnrolled(f"the AM of job {self.config.job} refused this worker: {error}") from None
            if time.monotonic() > deadline:
                raise NotEnrolled(f"job {self.config.job} did not start within {self.config.enrol_timeout_s:g} s")

    # ------------------------------------------------------------------ the command

    def _run_command(self, enrolment: EnrolReply) -> int:
        env = self._command_env(enrolment)
        self._child = subprocess.Popen(self.config.command, env=env, preexec_fn=command_preexec())
        where = f"rank {enrolment.rank} of {enrolment.world_size}" if enrolment.role == ROLE_MEMBER else "joiner"
        log.info("%s (%s) started: pid %d", enrolment.worker_id, where, self._child.pid)
        previous = {signum: signal.signal(signum, self._forward) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            returncode = self._wait(self._child, enrolment.worker_id)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if returncode != 0:  # killed or crashed: its shared-memory segments are still there
            remove_segments_of(self._child.pid, env)
        return returncode

    def _wait(self, child: subprocess.Popen[bytes], worker_id: str) -> int:
        """The command's exit code. One the AM declared dead, one stopped after the training ended, and one holding a
        SIGTERM too long are SIGKILLed first."""
        held_since: float | None = None
        while True:
            try:
                return child.wait(timeout=self.config.poll_s)
            except subprocess.TimeoutExpired:
                pass
            if self._unresponsive(child, worker_id):
                child.kill()
                return child.wait()
            if not sigterm_held(child.pid):
                held_since = None
                continue
            held_since = time.monotonic() if held_since is None else held_since
            if time.monotonic() - held_since >= self.config.term_grace_s:
                # it starts with SIGTERM blocked (``launcher/lifeline.py``) until its SIGTERM watch is installed; one
                # that never starts the elan engine would hold it for ever: killed, as the watch's crash path would
                log.warning("the worker (pid %d) has held a SIGTERM for %.0f s without installing its handler (does "
                            "the command start the elan engine?): killing it", child.pid, self.config.term_grace_s)
                child.kill()
                return child.wait()

    def _unresponsive(self, child: subprocess.Popen[bytes], worker_id: str) -> bool:
        """Every ``am_poll_s``: whether the AM declared the command dead, or it has been stopped for
        ``stopped_grace_s`` since the job's training ended (nobody waits for it in a collective any more)."""
        now = time.monotonic()
        if not self._am_polls or now < self._next_am_poll:
            return False
        self._next_am_poll = now + self.config.am_poll_s
        reply = self._poll_am(worker_id)
        if reply is None:
            return False
        if reply.kill:
            log.warning("killing %s (pid %d): it stopped answering and did not check in after the failure: the AM "
                        "declared it dead", worker_id, child.pid)
            return True
        return self._stopped_after_training(child, worker_id, reply.training_over, now)

    def _poll_am(self, worker_id: str) -> WorkerPollReply | None:
        """The AM's answer to ``worker_poll``; None when it does not answer now (it may be failing over)."""
        request = WorkerPollRequest(worker_id)
        try:
            return WorkerPollReply.from_body(self._client.request(request.TYPE, request.to_body(), timeout_s=1.0,
                                                                  retries=0))
        except AMUnavailable:
            return None
        except AMError as error:
            log.warning("the AM of job %s does not answer worker_poll (%s): a frozen command is not detected",
                        self.config.job, error)
            self._am_polls = False
            return None

    def _stopped_after_training(self, child: subprocess.Popen[bytes], worker_id: str, training_over: bool,
                                now: float) -> bool:
        if not training_over or not is_stopped(child.pid):
            self._stopped_since = None
            return False
        self._stopped_since = now if self._stopped_since is None else self._stopped_since
        if now - self._stopped_since < self.config.stopped_grace_s:
            return False
        log.warning("%s (pid %d) has been stopped (SIGSTOP) for %.0f s after the job's training completed: killing it",
                    worker_id, child.pid, now - self._stopped_since)
        return True

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM from the scheduler, or Ctrl-C (SIGINT): the command leaves the job gracefully (SIGTERM: it exits 0
        once it has left)."""
        if self._child is not None and self._child.poll() is None:
            log.info("received %s: the worker (pid %d) leaves the job (SIGTERM)", signal.Signals(signum).name,
                     self._child.pid)
            self._child.send_signal(signal.SIGTERM)

    def _command_env(self, enrolment: EnrolReply) -> dict[str, str]:
        description = WorkerEnvironment.launched(
            job=self.config.job, worker_id=enrolment.worker_id, role=enrolment.role,
            am_address=self.config.am, store_address=self.store_address(enrolment),
            coordinate_every=enrolment.coordinate_every, rank=enrolment.rank, world_size=enrolment.world_size,
            device_index=self.config.device_index, term_grace_s=self.config.term_grace_s,
            launch_world_size=enrolment.launch_world_size,
        )
        env = {key: value for key, value in self._base_env.items() if key not in STRIPPED_ENV_VARS}
        env.pop(ENV_AM, None)
        env.update(description.to_env())
        return env

    def store_address(self, enrolment: EnrolReply) -> str:
        """``HOST:PORT`` of the AM's TCPStore, or the URL of a store the AM names (etcd)."""
        if enrolment.store_url is not None:
            return enrolment.store_url
        if enrolment.store_port is None:
            raise NotEnrolled(f"the AM of job {self.config.job} runs no rendezvous store (is it an `elan run` AM?)")
        host = enrolment.store_host or self.config.am_host
        return f"{host}:{enrolment.store_port}"

    # ------------------------------------------------------------------ the exit

    def _report_exit(self, enrolment: EnrolReply, returncode: int) -> None:
        """Tell the AM (resent until it answers), with what the rendezvous store says of the command (as ``elan run``
        does: the AM decides from these whether the job is done); a death it recovers from is announced to the
        survivors."""
        training_ended, script_failed = self._store_marks(enrolment)
        message = WorkerExitRequest(enrolment.worker_id, returncode, training_ended=training_ended,
                                    script_failed=script_failed)
        try:
            body = self._client.request(message.TYPE, message.to_body(), timeout_s=1.0, retries=30)
        except (AMError, AMUnavailable) as error:
            log.warning("could not report the exit of %s (code %d) to the AM: %s", enrolment.worker_id, returncode,
                        error)
            return
        reply = WorkerExitReply.from_body(body)
        if reply.recovering:
            self._announce_failure(enrolment, list(reply.failed_generations or []))

    def _store_marks(self, enrolment: EnrolReply) -> tuple[bool | None, bool | None]:
        """Whether the command's training loop had ended and whether an uncaught exception ended its script (the
        marks it left in the rendezvous store); unknown (None) when the store does not answer."""
        from lightning_elan.elastic.etcd_rendezvous import open_rendezvous_store

        worker = enrolment.worker_id
        try:
            store = open_rendezvous_store(self.store_address(enrolment), timedelta(seconds=MARKS_TIMEOUT_S))
            return bool(store.check([training_ended_key(worker)])), bool(store.check([script_failed_key(worker)]))
        except Exception as error:  # the exit is still reported, without the marks
            log.warning("could not read the marks of %s in the rendezvous store: %s", worker,
                        str(error).splitlines()[0] if str(error) else type(error).__name__)
            return None, None

    def _announce_failure(self, enrolment: EnrolReply, generations: list[int]) -> None:
        from lightning_elan.elastic.etcd_rendezvous import open_rendezvous_store

        store = open_rendezvous_store(self.store_address(enrolment), timedelta(seconds=ANNOUNCE_TIMEOUT_S))
        for generation in generations:
            store.set(failure_key(generation), enrolment.worker_id)
        log.warning("%s died: the survivors of %s recover without it", enrolment.worker_id,
                    generations_phrase(generations))
