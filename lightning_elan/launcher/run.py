"""``elan run``: start the AM process and the long-lived TCPStore, spawn the workers, supervise them.

The launcher is the local *scheduler* of docs/architecture.md: it starts generation 0, submits the
``--schedule`` as ``scale`` requests, then polls the AM (``launcher_poll``) for joiners to start and
reports every child's exit (``worker_exit``), with what the rendezvous store says of it (its training loop had ended,
its script failed). The AM decides from these when the job is done (``master/transitions/finishing.py``: every member
of the current generation has exited having finished training); the launcher obeys: it sees the job finished, stops
the joiners of a plan still in flight (stranded: rank 0 never learned of it) as expected exits, and ends. A worker
that fails unexpectedly stops the whole job. Only an exit the AM waited for (a leaver, a cancelled joiner) is logged
``(expected)``; a death the survivors recover from is logged as such, never as expected.

The AM is a child process (``launcher.am_process``) restarted from its store whenever it dies; the TCPStore
server lives as long as the launcher (in the store host the preload process forks, else in the launcher:
``launcher/job_store.py``), so neither an AM nor a worker takes it down. Every launcher request is resent
with the same message id until the (possibly restarted) AM answers, so none applies twice or gets lost.

Every child dies with the launcher (``launcher/lifeline.py``): a SIGKILLed ``elan run`` leaves no worker, standby,
joiner or AM behind (the workers get SIGKILL from the kernel, the AM SIGTERM); the workers' DataLoader processes
follow within torch's 5 s watchdog interval. Every worker starts with SIGTERM blocked until its SIGTERM watch is
installed, so a SIGTERM during its start-up is a leave, not a crash; one it holds is SIGKILLed ``--term-grace`` seconds
later (a command that never starts the engine), or at once when the launcher itself stops the worker.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from lightning_elan.launcher.am_process import DEFAULT_MAX_RESTARTS, AMFailed, AMProcess, describe_status
from lightning_elan.launcher.job_store import JobStore, LauncherStore, StoreLost
from lightning_elan.launcher.lifeline import die_with_parent, is_stopped, sigterm_held
from lightning_elan.launcher.preload import ForkedWorker, PreloadedInterpreter, PreloadUnavailable, preloadable_command
from lightning_elan.launcher.schedule import ScaleAction, format_schedule_item
from lightning_elan.launcher.segments import remove_segments_of
from lightning_elan.protocol.client import AMClient, AMError, AMUnavailable
from lightning_elan.protocol.contract import (
    DEFAULT_COORDINATE_EVERY,
    DEFAULT_REPORT_TIMEOUT_S,
    DEFAULT_TERM_GRACE_S,
    FINISHED_BY_LAUNCHER,
    MESSAGES,
    ROLE_JOINER,
    ROLE_MEMBER,
    SIGTERM_EXITS,
    STANDBY_REQUEST,
    STRIPPED_ENV_VARS,
    AdjustmentPlan,
    AutoscaleReply,
    AutoscaleRequest,
    LauncherPollReply,
    LauncherPollRequest,
    ScaleCommand,
    ScaleReply,
    ShutdownRequest,
    StartJobReply,
    StartJobRequest,
    StatusReply,
    StatusRequest,
    StragglersReply,
    StragglersRequest,
    WorkerEnvironment,
    WorkerExitReply,
    WorkerExitRequest,
    failure_key,
    script_ended_key,
    script_failed_key,
    training_ended_key,
)
from lightning_elan.protocol.messages import new_message_id
from lightning_elan.words import describe_autoscale, plural, workers_phrase

log = logging.getLogger(__name__)

LOCAL_HOST = "127.0.0.1"
STATE_FILES: tuple[str, ...] = ("state.json", "adjustments.jsonl")
SizingRequest = AutoscaleRequest | StragglersRequest
"""What ``--autoscale``/``--stragglers`` ask the AM for once the job has started."""

class LaunchError(RuntimeError):
    """The job cannot be started as configured (the CLI reports it as a usage error)."""


@dataclass
class LaunchConfig:
    """Everything ``elan run`` needs; timings are fields so tests can shorten them."""

    job: str
    nproc: int
    command: list[str]
    state_dir: Path
    coordinate_every: int = DEFAULT_COORDINATE_EVERY
    report_timeout_s: float = DEFAULT_REPORT_TIMEOUT_S
    term_grace_s: float = DEFAULT_TERM_GRACE_S  # SIGTERM → leave; not left this long after → the crash path
    schedule: list[ScaleAction] = field(default_factory=list)
    devices: str = "cpu"
    poll_interval_s: float = 0.05
    status_interval_s: float = 0.5
    shutdown_grace_s: float = 30.0
    kill_grace_s: float = 10.0
    stopped_grace_s: float = 30.0  # a worker stopped (SIGSTOP) this long after the training completed is killed
    am_timeout_s: float = 0.5  # one attempt of a launcher request; resent (same id) until the AM answers
    am_patience_s: float = 60.0  # give up on an AM process that is alive but does not answer for this long
    am_max_restarts: int = DEFAULT_MAX_RESTARTS
    replace_failed: bool = False  # start a replacement for each worker that dies
    min_workers: int | None = None  # below this many survivors the job waits for joiners
    join_timeout_s: float | None = None  # ... for at most this long, then fails
    standby: int = 0  # workers kept started and warmed up, taken first by an `add`
    sizing: list[SizingRequest] = field(default_factory=list)  # sent to the AM once the job has started
    preload: bool = True  # fork the workers from a preloaded interpreter (launcher/preload.py) where the command allows
    preload_timeout_s: float = 120.0  # start workers without it when its imports take longer


@dataclass
class WorkerProcess:
    """The launcher's record of one worker: its child process and what the launcher knows about it."""

    worker_id: str
    role: str
    process: subprocess.Popen[bytes] | ForkedWorker
    device_index: int | None = None
    returncode: int | None = None
    stranded: bool = False  # a joiner of a plan whose old members all finished: stopped by the launcher
    terminated: bool = False  # the launcher sent it SIGTERM (to stop it, not to make it leave)
    held_since: float | None = None  # when the launcher first saw it hold a SIGTERM (blocked: no handler yet)
    unresponsive: bool = False  # killed by the launcher: the AM declared it dead (it stopped answering)
    stopped_since: float | None = None  # when the launcher first saw it stopped (SIGSTOP) after the training ended

    @property
    def alive(self) -> bool:
        return self.returncode is None


@dataclass(frozen=True)
class ExitVerdict:
    """What the AM made of a worker's exit (its ``worker_exit`` reply)."""

    expected: bool = False  # an exit 0 the AM waited for: a leaver, a cancelled joiner, a member after the end
    recovering: bool = False  # a death the survivors recover from: the job goes on without it
    after_training: bool = False  # a non-zero exit once another member's exit 0 showed the training complete
    left: bool = False  # killed after it had left the job (or while it left, serving nobody): the job goes on

    @classmethod
    def from_reply(cls, reply: WorkerExitReply, returncode: int) -> ExitVerdict:
        if reply.recovering:
            return cls(recovering=True)
        if reply.left:
            return cls(left=True)
        return cls(expected=reply.expected and returncode == 0, after_training=reply.expected and returncode != 0)

    @property
    def tolerated(self) -> bool:
        """Not a failure of the job."""
        return self.expected or self.recovering or self.after_training or self.left

    @property
    def note(self) -> str | None:
        """How the exit is described in the launcher's log besides ``(expected)``."""
        if self.recovering:
            return "the job recovers without it"
        if self.after_training:
            return "after the job's training completed"
        if self.left:
            return "after it left the job: the job goes on"
        return None


class _Interrupted(Exception):
    """Raised inside the supervision loop once the launcher received SIGINT/SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class JobLauncher:
    """Runs one elastic job on this host; :meth:`run` returns the process exit code."""

    def __init__(self, config: LaunchConfig, *, base_env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._am: AMProcess | None = None
        self._store: JobStore | None = None
        self._client: AMClient | None = None
        self._workers: dict[str, WorkerProcess] = {}
        self._launch_world_size = 0  # the members of generation 0, once spawned: every joiner is told it
        self._device_count = self._count_devices(config.devices)
        self._device_cursor = 0
        self._signals: list[int] = []
        self._saved_handlers: dict[int, Any] = {}
        self._exit_seen = False
        self._last_held_check = 0.0
        self._training_seen_complete = False  # a worker exited 0 with its training ended
        self._preload: PreloadedInterpreter | None = None

    # ------------------------------------------------------------------ public

    @property
    def am_address(self) -> str:
        assert self._am is not None, "services are not started"
        return self._am.address

    @property
    def store_address(self) -> str:
        return f"{LOCAL_HOST}:{self._store.port}"

    @property
    def workers(self) -> dict[str, WorkerProcess]:
        return dict(self._workers)

    def run(self) -> int:
        """Start everything, supervise until the job ends, tear everything down; return the exit code."""
        self._install_signal_handlers()
        try:
            self._start_preload()
            self._start_services()
            members = self._start_job()
            self._submit_schedule()
            self._submit_sizing()
            self._spawn_members(members)
            return self._supervise()
        except _Interrupted as exc:
            log.error("received %s: stopping job %s", exc, self.config.job)
            self._abort(f"the launcher received {exc}")
            return 128 + exc.signum
        except AMError as exc:
            log.error("%s", exc)
            self._abort(f"AM refused a launcher request: {exc}")
            return 1
        except AMUnavailable as exc:
            log.error("job %s's AM does not answer: %s", self.config.job, exc)
            self._terminate_children()
            return 1
        except AMFailed as exc:
            log.error("%s: stopping job %s", exc, self.config.job)
            self._terminate_children()
            return 1
        except StoreLost as exc:
            log.error("%s: stopping job %s", exc, self.config.job)
            self._abort(str(exc))
            return 1
        except OSError as exc:
            log.error("cannot start worker command %r: %s", self.config.command[0], exc)
            self._abort(f"cannot start the worker command: {exc}")
            return 1
        finally:
            self._remove_dead_workers_segments()
            self._stop_preload()
            self._stop_services()
            self._restore_signal_handlers()

    # ------------------------------------------------------------------ services

    def _start_services(self) -> None:
        state_dir = Path(self.config.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        archive_previous_run(state_dir)
        self._am = AMProcess(self.config.job, state_dir, env=self._base_env, max_restarts=self.config.am_max_restarts)
        self._am.start()
        self._store = self._start_store()
        self._client = AMClient(self.am_address, self.config.job, timeout_s=self.config.am_timeout_s, retries=0)
        log.info("job %s: AM at %s, store at %s", self.config.job, self.am_address, self.store_address)

    def _start_store(self) -> JobStore:
        """The job's store (``launcher/job_store.py``): in the store host the preload process forks, when it serves
        (the launcher then never imports torch), else in this process."""
        if self._preload is not None and self._preload_serves():
            store = self._preload.forked_store()
            if store is not None:
                return store
        return LauncherStore(LOCAL_HOST)

    def _stop_services(self) -> None:
        if self._client is not None:
            self._close_quietly(self._client)
            self._client = None
        if self._am is not None:
            try:
                self._am.stop(self.config.kill_grace_s)
            except Exception:
                log.exception("stopping the AM of job %s failed", self.config.job)
            self._am = None
        if self._store is not None:
            self._store.close()
            self._store = None

    @staticmethod
    def _close_quietly(client: AMClient) -> None:
        close = getattr(client, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                log.debug("closing the AM client failed", exc_info=True)

    # ------------------------------------------------------------------ AM requests

    def _request(self, message: Any, *, patient: bool = True) -> dict[str, Any]:
        """Send one request (a message dataclass of ``contract.MESSAGES``); resend it with the same id (restarting a
        dead AM) until answered, unless not patient. Returns the reply's body (its reply dataclass parses it)."""
        assert self._client is not None and self._am is not None, "services are not started"
        msg_id = new_message_id()
        deadline = time.monotonic() + self.config.am_patience_s
        while True:
            try:
                return self._client.request(message.TYPE, message.to_body(), msg_id=msg_id)
            except AMUnavailable:
                if not patient or time.monotonic() >= deadline:
                    raise
                self._check_signals()
                self._am.check()

    def _start_job(self) -> list[str]:
        config = self.config
        reply = StartJobReply.from_body(self._request(StartJobRequest(
            config.nproc, config.coordinate_every, report_timeout_s=config.report_timeout_s,
            replace_failed=config.replace_failed, min_workers=config.min_workers or None,
            join_timeout_s=config.join_timeout_s or None, standby=config.standby or None,
        )))
        log.info("job %s: generation %s starts with %s (%s)", self.config.job, reply.generation,
                 plural(len(reply.members), "member"), workers_phrase(reply.members))
        return list(reply.members)

    def _submit_schedule(self) -> None:
        for item in self.config.schedule:
            try:
                reply = ScaleReply.from_body(self._request(ScaleCommand(**item.request_kwargs())))
            except AMError as exc:
                raise AMError(f"schedule item {format_schedule_item(item)!r} refused: {exc}", "scale") from exc
            new_workers = ", ".join(reply.new_workers) or "none"
            log.info("scheduled %s as request %s (new workers: %s)", item, reply.request_id, new_workers)

    def _submit_sizing(self) -> None:
        for request in self.config.sizing:
            reply = MESSAGES[request.TYPE].reply.from_body(self._request(request))
            log.info("%s", describe_sizing(self.config.job, request, reply))
            log.debug("job %s: %s %s", self.config.job, request.TYPE, json.dumps(request.to_body()))

    def _status(self) -> StatusReply:
        return StatusReply.from_body(self._request(StatusRequest()))

    # ------------------------------------------------------------------ spawning

    def _spawn_members(self, members: list[str]) -> None:
        world_size = self._launch_world_size = len(members)
        for rank, worker_id in enumerate(members):
            detail = f"member, rank {rank} of {world_size}"
            self._spawn(worker_id, ROLE_MEMBER, rank=rank, world_size=world_size, detail=detail)

    def _spawn_requested(self) -> bool:
        """Start every joiner the AM asks for, stop those it gives up on; return the AM's ``finished`` flag."""
        reply = LauncherPollReply.from_body(self._request(LauncherPollRequest()))
        for order in reply.spawn:
            if order.worker_id in self._workers:
                log.warning("AM asked again for %s, which is already started; ignored", order.worker_id)
                continue
            detail = "standby" if order.request_id == STANDBY_REQUEST else f"joiner for request {order.request_id}"
            self._spawn(order.worker_id, ROLE_JOINER, detail=detail)
        for worker_id in reply.stop:
            self._stop_unreported(worker_id)
        for worker_id in reply.kill:
            self._kill_unresponsive(worker_id)
        return reply.finished

    def _stop_unreported(self, worker_id: str) -> None:
        """Terminate a joiner whose request failed because it never reported ready (the AM logged why)."""
        worker = self._workers.get(worker_id)
        if worker is not None and worker.process.poll() is None:
            log.warning("stopping %s: it never reported ready, its request failed", worker_id)
            self._send_signal(worker, signal.SIGTERM)
            self._end_held_sigterms([worker])

    def _kill_unresponsive(self, worker_id: str) -> None:
        """SIGKILL a survivor the AM declared dead: it did not check in after a failure (frozen, or hung where no
        failure notice reaches it), and a SIGTERM would wait for it too. Its exit is then reported as a death's."""
        worker = self._workers.get(worker_id)
        if worker is not None and worker.process.poll() is None:
            log.warning("killing %s (pid %d): it stopped answering and did not check in after the failure",
                        worker_id, worker.process.pid)
            worker.unresponsive = True
            self._send_signal(worker, signal.SIGKILL)

    def _spawn(self, worker_id: str, role: str, *, rank: int = -1, world_size: int = 0, detail: str) -> WorkerProcess:
        device_index = self._next_device()
        description = WorkerEnvironment.launched(
            job=self.config.job,
            worker_id=worker_id,
            role=role,
            am_address=self.am_address,
            store_address=self.store_address,
            coordinate_every=self.config.coordinate_every,
            rank=rank,
            world_size=world_size,
            device_index=device_index,
            term_grace_s=self.config.term_grace_s,
            launch_world_size=self._launch_world_size if role == ROLE_JOINER else 0,
        )
        process = self._start_process(self._worker_env(description))
        worker = WorkerProcess(worker_id, role, process, device_index)
        self._workers[worker_id] = worker
        where = "" if device_index is None else f", device {device_index}"
        log.info("spawned %s (%s%s, pid %d)", worker_id, detail, where, process.pid)
        return worker

    def _start_process(self, env: dict[str, str]) -> subprocess.Popen[bytes] | ForkedWorker:
        """A worker process: forked by the preload process when it serves, else the command started afresh."""
        if self._preload is not None and self._preload_serves():
            try:
                return self._preload.spawn(env)
            except PreloadUnavailable:
                self._preload = None
        return subprocess.Popen(self.config.command, env=env,
                                preexec_fn=die_with_parent(signal.SIGKILL, hold_sigterm=True))

    def _worker_env(self, description: WorkerEnvironment) -> dict[str, str]:
        """The environment common to every worker (:meth:`_common_env`), then this worker's ``ELAN_*`` variables."""
        env = self._common_env()
        env.update(description.to_env())
        return env

    def _common_env(self) -> dict[str, str]:
        """The inherited environment without any ``ELAN_*`` worker variable."""
        env = {key: value for key, value in self._base_env.items() if key not in STRIPPED_ENV_VARS}
        # as torchrun does: several workers on one host, each with an OpenMP pool sized for the whole machine, spin
        # against each other (measured here: packing a 100 MB state for replication took 1.2 s instead of 0.1 s)
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    # ------------------------------------------------------------------ the preloaded interpreter

    def _start_preload(self) -> None:
        """Start the preload process (``launcher/preload.py``) when asked for and the command allows it."""
        command = preloadable_command(self.config.command) if self.config.preload else None
        if command is None:
            return
        self._preload = PreloadedInterpreter(command, self._common_env(), store_host=LOCAL_HOST)
        try:
            self._preload.start()
        except OSError as exc:
            log.warning("workers start without the preloaded interpreter: %s", exc)
            self._preload = None

    def _preload_serves(self) -> bool:
        """Whether the preload process forks workers (waiting for its imports the first time)."""
        assert self._preload is not None
        if self._preload.ready or self._preload.wait_ready(self.config.preload_timeout_s, self._check_signals):
            return True
        self._preload.close()
        self._preload = None
        return False

    def _stop_preload(self) -> None:
        if self._preload is not None:
            self._preload.close()
            self._preload = None

    @staticmethod
    def _count_devices(devices: str) -> int:
        if devices == "cpu":
            return 0
        if devices != "cuda":
            raise LaunchError(f"--devices must be cpu or cuda, got {devices!r}")
        import torch  # only GPU runs need it here

        count = torch.cuda.device_count()
        if count < 1:
            raise LaunchError("--devices cuda, but no CUDA device is visible")
        return count

    def _next_device(self) -> int | None:
        """The device for the next worker (None on CPU): see :func:`pick_device`."""
        if self._device_count == 0:
            return None
        load = [0] * self._device_count
        for worker in self._live_workers():
            if worker.device_index is not None:
                load[worker.device_index] += 1
        index = pick_device(load, self._device_cursor)
        self._device_cursor = (index + 1) % self._device_count
        return index

    # ------------------------------------------------------------------ supervision

    def _supervise(self) -> int:
        assert self._am is not None
        while True:
            self._check_signals()
            self._am.check()
            self._check_held_sigterms()
            finished = self._spawn_requested()
            failed = self._reap()
            if failed is not None:
                return self._fail(failed)
            if finished or self._exit_seen:
                self._exit_seen = False
                status = self._status()
                if status.finished:
                    return self._finished_by_am(status)
                if not self._live_workers():
                    return self._stuck(status)
            time.sleep(self.config.poll_interval_s)

    def _reap(self) -> WorkerProcess | None:
        """Collect exited children, report them to the AM; return the first unexpected failure."""
        failed: WorkerProcess | None = None
        for worker in self._live_workers():
            returncode = worker.process.poll()
            if returncode is None:
                continue
            if returncode != 0:  # killed or crashed: its shared-memory segments are still there
                remove_segments_of(worker.process.pid)
            worker.returncode = returncode = self._counted_exit(worker, returncode)
            self._exit_seen = True
            verdict = self._report_exit(worker)
            note = "declared dead as it stopped answering: the job went on without it" if worker.unresponsive else (
                verdict.note)
            log.info("%s (pid %d) %s", worker.worker_id, worker.process.pid,
                     describe_exit(returncode, verdict.expected, note))
            if returncode == 0 or verdict.tolerated or worker.stranded or failed is not None:
                continue
            if self._is_undecided_joiner(worker):
                log.error("joiner %s failed before its plan was decided: the AM dropped its request", worker.worker_id)
                continue
            failed = worker
        return failed

    def _counted_exit(self, worker: WorkerProcess, returncode: int) -> int:
        """A worker killed by a signal after its script had ended (see ``script_ended_key``) finished: 0, with a
        warning (the crash is in the interpreter's teardown; its training and everything after it ran).

        A death after the worker's training loop ended is still a death: the other members may be in collectives of
        the script's code after ``fit`` (``trainer.test``, a barrier before saving), which only the generation's
        failure releases; whether the job's training was complete the AM judges once every member has exited, from
        what :meth:`_exit_report` tells it."""
        if returncode >= 0 or not self._marked(script_ended_key(worker.worker_id)):
            return returncode
        log.warning("%s (pid %d) %s after its script had ended (a crash while the interpreter shut down): "
                    "counted as finished", worker.worker_id, worker.process.pid, describe_status(returncode))
        return 0

    def _is_undecided_joiner(self, worker: WorkerProcess) -> bool:
        """A joiner that is neither a member nor part of the plan in flight: its failure only fails its request."""
        if worker.role != "joiner":
            return False
        status = self._status()
        involved = status.member_ids() + (status.in_flight.members if status.in_flight is not None else [])
        return worker.worker_id not in involved

    def _report_exit(self, worker: WorkerProcess) -> ExitVerdict:
        """Tell the AM; a member's death it recovers from is announced to the survivors (not a failure of the job, but
        not an expected exit either)."""
        try:
            reply = WorkerExitReply.from_body(self._request(self._exit_report(worker)))
        except AMError as exc:
            log.warning("AM refused worker_exit for %s: %s", worker.worker_id, exc)
            return ExitVerdict()
        verdict = ExitVerdict.from_reply(reply, worker.returncode or 0)
        if verdict.recovering:
            self._announce_failure(worker, list(reply.failed_generations or []))
        return verdict

    def _exit_report(self, worker: WorkerProcess) -> WorkerExitRequest:
        """``worker``'s exit code and what the rendezvous store says of it: whether its training loop had ended and
        whether an uncaught exception ended its script (the AM decides from these whether the job is done)."""
        return WorkerExitRequest(worker.worker_id, worker.returncode or 0,
                                 training_ended=self._marked(training_ended_key(worker.worker_id)),
                                 script_failed=self._marked(script_failed_key(worker.worker_id)))

    def _marked(self, key: str) -> bool:
        """Whether the rendezvous store holds ``key`` (a worker's mark; False without a store)."""
        return self._store is not None and bool(self._store.check([key]))

    def _announce_failure(self, worker: WorkerProcess, generations: list[int]) -> None:
        """Set the failure keys the survivors' watch threads poll: their collectives are released at once."""
        for generation in generations:
            self._store.set(failure_key(generation), worker.worker_id)
        cause = ": its script raised an error (its traceback is above), which ends it as a death would;" if (
            self._marked(script_failed_key(worker.worker_id))) else ":"
        log.warning("%s died (%s)%s the survivors of %s recover without it", worker.worker_id,
                    describe_exit(worker.returncode or 0, False), cause, generations_phrase(generations))

    def _finished_by_am(self, status: StatusReply) -> int:
        """The AM ended the job: its members finished training (it decided so from the exits this launcher reported),
        it could not go on (no survivor, too few workers), or something else shut it down."""
        if status.failed_reason:
            log.error("job %s failed: %s", self.config.job, status.failed_reason)
            self._terminate_children()
            return 1
        if status.finish_reason == FINISHED_BY_LAUNCHER:
            self._end_after_training(status)
        else:
            log.info("job %s: the AM marked the job finished", self.config.job)
        return self._shutdown()

    def _end_after_training(self, status: StatusReply) -> None:
        """Every member of the current generation finished: say which were stopped after the training, and stop the
        joiners of a plan still in flight (the members finished training instead of entering it: it is stranded)."""
        log.info("job %s: every member of generation %s has finished", self.config.job, status.generation)
        self._note_stopped_members(status)
        if status.in_flight is not None:
            self._stop_stranded_joiners(status.in_flight)

    def _stop_stranded_joiners(self, in_flight: AdjustmentPlan) -> None:
        """The old members finished training before the plan in flight could be carried out (rank 0's last
        ``coordinate`` went unanswered, e.g. while the AM restarted): its joiners wait in a rendezvous for a generation
        that will never form. They never trained, so the job's result is whole: stop them, as expected exits."""
        joiners = [self._workers[w] for w in in_flight.joiners if w in self._workers]
        stranded = [worker for worker in joiners if worker.alive]
        if not stranded:
            return
        log.warning("job %s: the members finished before adjustment %s was carried out; stopping its %s %s",
                    self.config.job, in_flight.request_id, "joiner" if len(stranded) == 1 else "joiners",
                    workers_phrase(w.worker_id for w in stranded))
        for worker in stranded:
            worker.stranded = True
            self._send_signal(worker, signal.SIGTERM)
        self._end_held_sigterms(stranded)
        deadline = time.monotonic() + self.config.kill_grace_s
        while time.monotonic() < deadline and any(self._poll_quietly(worker) for worker in stranded):
            time.sleep(self.config.poll_interval_s)
        self._kill([worker for worker in stranded if self._poll_quietly(worker)])

    def _note_stopped_members(self, status: StatusReply) -> None:
        """Say which finished members were stopped or killed after the training was complete."""
        members = [self._workers.get(worker_id) for worker_id in status.member_ids()]
        for worker in members:
            if worker is not None and worker.returncode:
                log.warning("job %s: %s %s after the training was complete (another member finished it)%s",
                            self.config.job, worker.worker_id, describe_status(worker.returncode),
                            "" if worker.returncode in SIGTERM_EXITS else ": what its script does after training "
                            "did not run")

    def _live_workers(self) -> list[WorkerProcess]:
        return [worker for worker in self._workers.values() if worker.alive]

    # ------------------------------------------------------------------ ending

    def _shutdown(self) -> int:
        """Normal end (the AM finished the job): let the remaining joiners exit (they get ``cancelled``), kill
        stragglers."""
        failed = self._wait_children(self.config.shutdown_grace_s)
        stragglers = self._live_workers()
        if stragglers:
            names = ", ".join(worker.worker_id for worker in stragglers)
            log.warning("killing %s: still running %.0f s after shutdown", names, self.config.shutdown_grace_s)
            self._kill(stragglers)
        if failed:
            log.error("job %s: %s failed during shutdown", self.config.job, ", ".join(w.worker_id for w in failed))
            return 1
        log.info("job %s finished", self.config.job)
        return 0

    def _wait_children(self, timeout_s: float) -> list[WorkerProcess]:
        """Reap children until none is left or ``timeout_s`` passes; return unexpected failures."""
        failed: list[WorkerProcess] = []
        deadline = time.monotonic() + timeout_s
        while self._live_workers() and time.monotonic() < deadline:
            self._check_signals()
            worker = self._reap()
            if worker is not None:
                failed.append(worker)
            time.sleep(self.config.poll_interval_s)
        return failed

    def _stuck(self, status: StatusReply) -> int:
        in_flight = status.in_flight
        detail = f"adjustment {in_flight.request_id} is in flight" if in_flight else "members did not finish"
        log.error("job %s: every worker has exited but generation %s is unfinished (%s)", self.config.job,
                  status.generation, detail)
        self._abort("every worker exited before the job finished")
        return 1

    def _fail(self, worker: WorkerProcess) -> int:
        log.error(
            "%s failed (%s): stopping job %s",
            worker.worker_id,
            describe_exit(worker.returncode or 0, False),
            self.config.job,
        )
        self._abort(f"{worker.worker_id} failed with exit code {worker.returncode}")
        return 1

    def _abort(self, reason: str) -> None:
        """Best-effort ``shutdown`` (so parked ``wait_plan``s end), then stop every child."""
        if self._client is not None:
            try:
                self._request(ShutdownRequest(reason), patient=False)
            except (AMError, AMUnavailable) as exc:
                log.debug("shutdown after failure not acknowledged: %s", exc)
        self._terminate_children()

    def _remove_dead_workers_segments(self) -> None:
        """However the run ended: the shared-memory segments of every worker that did not exit 0 (a stop kills
        workers without reaping them, see :meth:`_terminate_children`)."""
        for worker in self._workers.values():
            if worker.process.poll() not in (None, 0):
                remove_segments_of(worker.process.pid)

    def _terminate_children(self) -> None:
        """SIGTERM every live child, SIGKILL whatever is still running after ``kill_grace_s``."""
        live = self._live_workers()
        if not live:
            return
        for worker in live:
            self._send_signal(worker, signal.SIGTERM)
        self._end_held_sigterms(live)
        deadline = time.monotonic() + self.config.kill_grace_s
        while time.monotonic() < deadline and len(self._signals) < 2:
            live = [worker for worker in live if self._poll_quietly(worker)]
            if not live:
                return
            time.sleep(self.config.poll_interval_s)
        self._kill(self._live_workers())

    def _kill(self, workers: list[WorkerProcess]) -> None:
        for worker in workers:
            self._send_signal(worker, signal.SIGKILL)
        for worker in workers:
            worker.returncode = worker.process.wait()
            log.info("%s (pid %d) %s", worker.worker_id, worker.process.pid, describe_exit(worker.returncode, False))

    @staticmethod
    def _send_signal(worker: WorkerProcess, signum: int) -> None:
        worker.terminated = worker.terminated or signum == signal.SIGTERM
        try:
            worker.process.send_signal(signum)
        except ProcessLookupError:
            pass

    # ------------------------------------------------------------------ workers stopped after the training

    def _end_stopped_after_training(self) -> None:
        """SIGKILL a worker stopped (SIGSTOP: a frozen process, a paused host) for ``stopped_grace_s`` seconds once
        another member exited with its training ended: nobody waits for it in a collective any more, so no timeout
        ends the wait, and ``elan run`` would wait on it for ever. Its exit is then one after the training completed.
        (Frozen during the training, it is declared dead when a collective times out: ``stalled``.)"""
        if not self._training_completed():
            return
        now = time.monotonic()
        for worker in self._live_workers():
            if not is_stopped(worker.process.pid):
                worker.stopped_since = None
                continue
            worker.stopped_since = now if worker.stopped_since is None else worker.stopped_since
            if now - worker.stopped_since >= self.config.stopped_grace_s:
                log.warning("%s (pid %d) has been stopped (SIGSTOP) for %.0f s after the job's training completed: "
                            "killing it", worker.worker_id, worker.process.pid, now - worker.stopped_since)
                worker.unresponsive = True
                self._send_signal(worker, signal.SIGKILL)

    def _training_completed(self) -> bool:
        """A worker exited 0 with its training loop ended (``training_ended_key``): the job's training is complete."""
        if not self._training_seen_complete:
            self._training_seen_complete = any(
                worker.returncode == 0 and self._marked(training_ended_key(worker.worker_id))
                for worker in self._workers.values() if not worker.alive)
        return self._training_seen_complete

    # ------------------------------------------------------------------ SIGTERMs a worker holds

    def _check_held_sigterms(self) -> None:
        """Every ``status_interval_s``: :meth:`_end_held_sigterms` for every live worker."""
        now = time.monotonic()
        if now - self._last_held_check >= self.config.status_interval_s:
            self._last_held_check = now
            self._end_held_sigterms(self._live_workers())
            self._end_stopped_after_training()

    def _end_held_sigterms(self, workers: list[WorkerProcess]) -> None:
        """SIGKILL each of ``workers`` that holds a SIGTERM (it started with SIGTERM blocked, ``launcher/lifeline.py``,
        and has not installed its handler): at once when the launcher sent it to stop the worker, ``--term-grace``
        seconds after one from elsewhere (the worker's own crash path, for a command that never starts the engine)."""
        now = time.monotonic()
        for worker in workers:
            if not sigterm_held(worker.process.pid):
                worker.held_since = None
                continue
            worker.held_since = now if worker.held_since is None else worker.held_since
            if worker.terminated:
                log.info("%s has not installed its SIGTERM handler yet: killing it", worker.worker_id)
            elif now - worker.held_since >= self.config.term_grace_s:
                log.warning("%s has held a SIGTERM for %.0f s without installing its handler (does the command start "
                            "the elan engine?): killing it, as a worker that has not left in time", worker.worker_id,
                            now - worker.held_since)
            else:
                continue
            self._send_signal(worker, signal.SIGKILL)

    @staticmethod
    def _poll_quietly(worker: WorkerProcess) -> bool:
        """Poll without reporting to the AM (used while tearing down); True while still running."""
        returncode = worker.process.poll()
        if returncode is None:
            return True
        worker.returncode = returncode
        log.info("%s (pid %d) %s", worker.worker_id, worker.process.pid, describe_exit(returncode, False))
        return False

    # ------------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        if not _on_main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._saved_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._saved_handlers.items():
            signal.signal(signum, handler)
        self._saved_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _check_signals(self) -> None:
        if self._signals:
            raise _Interrupted(self._signals[0])


def pick_device(load: list[int], cursor: int) -> int:
    """Round-robin from ``cursor`` over the least-loaded devices (``load[d]`` = live workers on device d).

    Plain round-robin while every device is in use; a device freed by a leaver is refilled first (migration).
    """
    count = len(load)
    return min(range(count), key=lambda device: (load[device], (device - cursor) % count))


def archive_previous_run(state_dir: Path) -> Path | None:
    """Move a previous run's ``state.json`` and ``adjustments.jsonl`` to ``state_dir/previous/``.

    ``elan run`` always starts a new job at generation 0 (the previous launcher's workers are gone), so an old
    state file must not be resumed. Only the last previous run is kept. Returns the archive folder, if any.
    """
    files = [state_dir / name for name in STATE_FILES if (state_dir / name).exists()]
    if not files:
        return None
    archive = state_dir / "previous"
    shutil.rmtree(archive, ignore_errors=True)
    archive.mkdir()
    for path in files:
        path.replace(archive / path.name)
    log.info("moved the state of the previous run to %s", archive)
    return archive


def describe_exit(returncode: int, expected: bool, note: str | None = None) -> str:
    """``exited with code 3`` / ``was killed by SIGKILL``, + ``(expected)`` for an exit the AM waited for (a leaver, a
    cancelled joiner, a member after the end) or else ``(note)``: never ``(expected)`` for a death it recovers from."""
    text = describe_status(returncode)
    if expected:
        return f"{text} (expected)"
    return f"{text} ({note})" if note else text


def generations_phrase(generations: list[int]) -> str:
    """``generation 3``, ``generations 2 and 3``."""
    noun = "generation" if len(generations) == 1 else "generations"
    return f"{noun} {workers_phrase(map(str, generations))}"


def describe_sizing(job: str, request: SizingRequest, reply: AutoscaleReply | StragglersReply) -> str:
    """The launcher's line for an ``autoscale`` or ``stragglers`` request it submitted, in words."""
    if isinstance(reply, AutoscaleReply):
        scale_out = request.scale_out_command if isinstance(request, AutoscaleRequest) else None
        return describe_autoscale(job, reply.autoscale, scale_out)
    settings = reply.stragglers
    fate = _STRAGGLER_FATES.get(settings.mode, settings.mode)
    return (f"stragglers of job {job!r} are {fate}: a worker whose throughput stays below {settings.threshold:g} of "
            f"the median for {plural(int(settings.window), 'round')}")


_STRAGGLER_FATES = {"off": "only reported", "replace": "replaced", "remove": "removed"}


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


__all__ = [
    "ExitVerdict",
    "JobLauncher",
    "LaunchConfig",
    "LaunchError",
    "WorkerProcess",
    "archive_previous_run",
    "describe_exit",
    "describe_sizing",
    "generations_phrase",
    "pick_device",
]
