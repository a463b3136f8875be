"""The typed contract between the launcher, the application master and the workers (pure: no torch, Lightning, zmq).

This module owns, once each:

* the protocol version and the defaults every side shares (coordination interval, report and join timeouts);
* the worker environment the launcher sets (``ELAN_*`` names, :class:`WorkerEnvironment`);
* the request body schemas (``BODY_SCHEMAS``; :mod:`lightning_elan.protocol.messages` validates against them);
* every message as a dataclass, each request next to its schema, and every reply as a dataclass (the workers', the
  launcher's, the command line's), with the :class:`AdjustmentPlan` and its :class:`Transfer` routes;
* the one registry of message types (``MESSAGES``: request dataclass, reply dataclass, whether it mutates the AM).

Wire forms are the JSON of docs/architecture.md, unchanged: ``to_body()``/``to_dict()`` omit optional fields that are
None where the protocol does, and ``from_body()``/``from_dict()`` ignore keys they do not know (as validation does).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from lightning_elan.protocol.addresses import am_address_list

PROTOCOL_VERSION = 1
CONTRACT_VERSION = PROTOCOL_VERSION  # the wire forms below are those of protocol version ``v``

# ---- defaults (one place each) ---------------------------------------------------------------------------------------

DEFAULT_COORDINATE_EVERY = 10
"""Rank 0 asks the AM whether to adjust every this many optimizer steps."""
DEFAULT_REPORT_TIMEOUT_S = 600.0
"""A request fails if one of its new workers has not reported ready this long after it was started."""
DEFAULT_JOIN_TIMEOUT_S = 1800.0
"""A joiner gives up when no plan includes it this long after it reported ready."""
DEFAULT_RECOVERY_TIMEOUT_S = 60.0
"""After a member dies, a survivor that has not checked in (``recover``) this long is declared dead too."""
ACTION_FAILURE = "failure"
"""The ``action`` of a plan the AM forms after a member died (forced scale-in; the interrupted step is redone)."""


def failure_key(generation: int) -> str:
    """The rendezvous-store key whose existence tells ``generation``'s members that one of them died."""
    return f"elan/failed/gen{generation}"


def script_ended_key(worker_id: str) -> str:
    """The rendezvous-store key a worker sets at interpreter exit once its script ended without an uncaught exception:
    a signal that kills it after that is a crash in the interpreter's teardown, not in training."""
    return f"elan/script_ended/{worker_id}"

def script_failed_key(worker_id: str) -> str:
    """The rendezvous-store key a worker sets at interpreter exit when an uncaught exception ended its script: a signal
    that kills it after that is that failure, also after its training loop ended."""
    return f"elan/script_failed/{worker_id}"

def training_ended_key(worker_id: str) -> str:
    """The rendezvous-store key a member sets once its training loop ended (the job's last step trained, not left, no
    error): a death after that comes after the job's training was complete."""
    return f"elan/training_ended/{worker_id}"

SIGTERM_EXITS = (-signal.SIGTERM, 128 + signal.SIGTERM)
"""How a process stopped by SIGTERM ends: killed by it, or exiting 143 as a shell (or a handler) reports it."""

DEFAULT_TERM_GRACE_S = 30.0
"""A worker that received SIGTERM and has not left the job this long after falls back to the crash path."""
MAX_WORLD_SIZE = 4096
"""The most workers a job may have or request (members plus pending joiners): bounds the AM's memory and keeps the
``status`` reply under the message size limit."""

# ---- environment variables -------------------------------------------------------------------------------------------

ENV_PREFIX = "ELAN_"
ENV_JOB = ENV_PREFIX + "JOB"
ENV_AM_ADDRESS = ENV_PREFIX + "AM_ADDRESS"
ENV_STORE_ADDRESS = ENV_PREFIX + "STORE_ADDRESS"
ENV_WORKER_ID = ENV_PREFIX + "WORKER_ID"
ENV_ROLE = ENV_PREFIX + "ROLE"
ENV_GENERATION = ENV_PREFIX + "GENERATION"
ENV_RANK = ENV_PREFIX + "RANK"
ENV_WORLD_SIZE = ENV_PREFIX + "WORLD_SIZE"
ENV_LAUNCH_WORLD_SIZE = ENV_PREFIX + "LAUNCH_WORLD_SIZE"  # a joiner: the job's world at its launch (``--nproc``)
ENV_COORDINATE_EVERY = ENV_PREFIX + "COORDINATE_EVERY"
ENV_SPAWN_TIME = ENV_PREFIX + "SPAWN_TIME"
ENV_DEVICE_INDEX = ENV_PREFIX + "DEVICE_INDEX"
ENV_TERM_GRACE = ENV_PREFIX + "TERM_GRACE"
WORKER_ENV_VARS: tuple[str, ...] = (
    ENV_JOB,
    ENV_AM_ADDRESS,
    ENV_STORE_ADDRESS,
    ENV_WORKER_ID,
    ENV_ROLE,
    ENV_GENERATION,
    ENV_RANK,
    ENV_WORLD_SIZE,
    ENV_LAUNCH_WORLD_SIZE,
    ENV_COORDINATE_EVERY,
    ENV_SPAWN_TIME,
    ENV_DEVICE_INDEX,
    ENV_TERM_GRACE,
)
"""What the launcher sets for each worker (and strips from the environment the workers inherit)."""

SCHEDULER_WORLD_ENV_VARS: tuple[str, ...] = (
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
)
"""A scheduler's fixed task geometry, stripped from what the workers inherit: an elastic job's world is elan's. Under
``srun`` (or ``elan run`` inside an allocation) Lightning's ``SLURMEnvironment.detect()`` takes a process with
``SLURM_NTASKS`` for one rank of a fixed-size step, ahead of the strategy's own environment, and refuses ``--ntasks``
without ``--ntasks-per-node``; a script reading ``SLURM_PROCID`` for its rank would be wrong after the first resize."""

OTHER_LAUNCHER_WORLD_ENV_VARS: tuple[str, ...] = ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
"""How another launcher tells a process it is one of several (a standalone process with a world above 1 is refused)."""

STRIPPED_ENV_VARS = frozenset(WORKER_ENV_VARS + SCHEDULER_WORLD_ENV_VARS)
"""Not inherited by a worker from its launcher's environment."""

# user settings, read where they apply and inherited by the workers
ENV_REPLICATION = ENV_PREFIX + "REPLICATION"  # "collective" forces collective replication (no topology registered)
ENV_SEND_AHEAD = ENV_PREFIX + "SEND_AHEAD"  # when a source makes its shared-memory segment ahead: joiners, always, off
ENV_SHM_DIR = ENV_PREFIX + "SHM_DIR"  # directory of the shared-memory segments (default /dev/shm)
ENV_HOME = ENV_PREFIX + "HOME"  # the job registry and default state dirs (default ~/.elan)
ENV_BUILD_CUDA_EXT = ENV_PREFIX + "BUILD_CUDA_EXT"  # "1": build the optional CUDA extension on first use
ENV_NO_CUDA_EXT = ENV_PREFIX + "NO_CUDA_EXT"  # "1": never load the CUDA extension (pure-torch path)
ENV_CUDA_EXT_DIR = ENV_PREFIX + "CUDA_EXT_DIR"  # where the CUDA extension is built and looked for
ENV_CUDA_ARCHS = ENV_PREFIX + "CUDA_ARCHS"  # GPU architectures the CUDA extension is built for
ENV_IFACE = ENV_PREFIX + "IFACE"  # the network interface collectives bind (default: the one towards the AM)
ENV_SECRET_FILE = ENV_PREFIX + "SECRET_FILE"  # the shared secret authenticating every message to and from the AM
ENV_AM = ENV_PREFIX + "AM"  # `elan worker --am` from the environment (a pod spec or an `srun` line sets it)
ENV_SCALE_OUT_COUNT = ENV_PREFIX + "SCALE_OUT_COUNT"  # the workers a `--scale-out-command` is asked to start
USER_ENV_VARS: tuple[str, ...] = (
    ENV_REPLICATION, ENV_SEND_AHEAD, ENV_SHM_DIR, ENV_HOME, ENV_BUILD_CUDA_EXT, ENV_NO_CUDA_EXT, ENV_CUDA_EXT_DIR,
    ENV_CUDA_ARCHS, ENV_IFACE, ENV_SECRET_FILE,
)
"""The user's settings: inherited by every worker (never stripped by the launcher)."""
COMMAND_ENV_VARS: tuple[str, ...] = (ENV_AM, ENV_SCALE_OUT_COUNT)
"""Read by a command, not by a worker: ``elan worker``'s ``--am`` (not passed on to its training command), and what the
AM tells a ``--scale-out-command``."""

ROLE_MEMBER = "member"
ROLE_JOINER = "joiner"
ROLE_STANDALONE = "standalone"
ROLE_WAITING = "waiting"  # enrolled with the AM (``elan worker``), the job has not started yet
LAUNCHED_ROLES = (ROLE_MEMBER, ROLE_JOINER)


def shm_directory(env: Mapping[str, str]) -> Path:
    """Where a worker makes its shared-memory segments (``elan-<pid>-<id>``): ``$ELAN_SHM_DIR`` if set (e.g. a larger
    tmpfs than a container's 64 MB ``/dev/shm``), else ``/dev/shm`` where it exists (Linux tmpfs), else the temporary
    directory."""
    if env.get(ENV_SHM_DIR):
        return Path(env[ENV_SHM_DIR])
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class ProtocolError(ValueError):
    """A message that breaks the protocol; ``msg_id`` is the request id when it could be read."""

    def __init__(self, message: str, msg_id: str | None = None) -> None:
        super().__init__(message)
        self.msg_id = msg_id


# ---- schemas ---------------------------------------------------------------------------------------------------------



def worker_number(worker_id: str) -> int:
    """The AM's counter value in a worker id, for ordering: ``"w12"`` → 12 (0 for an id without one)."""
    return int(worker_id[1:]) if worker_id[1:].isdigit() else 0

@dataclass(frozen=True)
class Field:
    """One body field: the JSON types it accepts and whether it must be present (optional fields may be null)."""

    types: tuple[type, ...]
    required: bool = False
    item_type: type | None = None
    schema: dict[str, Field] | None = None  # the fields of a nested object


_INT = (int,)
_NUMBER = (int, float)
_STR = (str,)

# a HybridScaling decision (ScalingDecision.to_dict()), in reports and in the scaling summary
SCALING_DECISION: dict[str, Field] = {
    "global_batch": Field(_INT, required=True),
    "local_batch": Field(_INT, required=True),
    "k": Field(_NUMBER, required=True),
    "reason": Field(_STR, required=True),
    "lr_scale": Field(_NUMBER),
}

# the scaling summary rank 0 sends with a coordinate, for `elan status` (lightning_elan.scaling.scaling_summary)
SCALING_SUMMARY: dict[str, Field] = {
    "policy": Field(_STR, required=True),
    "model_ready": Field((bool,), required=True),
    "observations": Field((dict,)),
    "world_size": Field(_INT),
    "global_batch": Field(_INT),
    "throughput": Field((list,), item_type=dict),
    "last_decision": Field((dict,), schema=SCALING_DECISION),
}

# ---- wire helpers ----------------------------------------------------------------------------------------------------

_T = TypeVar("_T")


def _wire(message: Any) -> dict[str, Any]:
    """A message dataclass as its body: every field in declaration order, None-valued ones omitted."""
    body = {f.name: getattr(message, f.name) for f in fields(message)}
    return {name: value for name, value in body.items() if value is not None}


def _record(message: Any) -> dict[str, Any]:
    """A message dataclass as its body with every field, None-valued ones too (wire forms that always hold every
    key)."""
    return {f.name: getattr(message, f.name) for f in fields(message)}


def _from_wire(cls: type[_T], data: Mapping[str, Any], what: str) -> _T:
    """Build ``cls`` from the keys it knows; a missing required key raises ``ProtocolError`` naming it."""
    if not isinstance(data, Mapping):
        raise ProtocolError(f"{what} must be an object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    missing = [name for name in required_fields(cls) if data.get(name) is None]
    if missing:
        raise ProtocolError(f"{what}: missing field(s) {', '.join(repr(name) for name in missing)}")
    return cls(**{name: value for name, value in data.items() if name in known})


def required_fields(cls: type) -> list[str]:
    """The fields of a contract dataclass that have no default (the schema's required keys)."""
    return [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]


# ---- the adjustment plan ---------------------------------------------------------------------------------------------

TRANSPORT_CUDA_IPC = "cuda_ipc"
TRANSPORT_SHM = "shm"
TRANSPORT_COLLECTIVE = "collective"
TRANSPORTS = (TRANSPORT_CUDA_IPC, TRANSPORT_SHM, TRANSPORT_COLLECTIVE)


@dataclass(frozen=True)
class Transfer:
    """One copy of the training state from ``source`` to ``joiner``, as the replication planner routes it."""

    source: str
    joiner: str
    level: int
    wave: int = 0
    transport: str = TRANSPORT_COLLECTIVE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Transfer:
        """From :meth:`to_dict`'s form; keys this version does not know (an older plan's ``slice_*``) are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    @classmethod
    def coerce(cls, value: Transfer | Mapping[str, Any]) -> Transfer:
        """``value`` itself, or the transfer its dict form describes."""
        return value if isinstance(value, Transfer) else cls.from_dict(value)


@dataclass(frozen=True)
class AdjustmentPlan:
    """What every participant of an adjustment receives (docs/architecture.md, *Plan*).

    ``members`` is the new rank order; ``sources`` maps each joiner to the old member that sends it the state;
    ``transfers`` is the topology-aware planner's routes, None (absent from the wire form) when a topology was missing.
    """

    request_id: str
    action: str
    generation: int
    previous_generation: int
    step: int
    members: list[str]
    previous_members: list[str]
    joiners: list[str]
    leavers: list[str]
    sources: dict[str, str]
    hosts: dict[str, str | None]
    transfers: list[Transfer] | None = None
    layouts: dict[str, list[str]] | None = None
    """A recovery plan's: the members of each failed generation, by generation number (a string: the wire is JSON).
    A survivor holds its shards in the layout of the generation it was in (unless a reshard it began had not
    committed): a death may interrupt a resize before some members learned of its plan."""

    @property
    def stayers(self) -> list[str]:
        """Old members that are members of the new generation, in new rank order."""
        return [worker for worker in self.members if worker not in self.joiners]

    @property
    def world_size(self) -> int:
        return len(self.members)

    def involves(self, worker_id: str) -> bool:
        """Whether ``worker_id`` takes part: a member of the new generation or a leaver."""
        return worker_id in self.members or worker_id in self.leavers

    def rank_of(self, worker_id: str) -> int:
        """``worker_id``'s rank in the new generation; ``ValueError`` if it is not a member."""
        try:
            return self.members.index(worker_id)
        except ValueError:
            raise ValueError(f"worker {worker_id} is not a member of generation {self.generation}") from None

    def joiners_served_by(self, source: str) -> list[str]:
        """The joiners whose ``sources`` entry is ``source``, in plan order."""
        return [joiner for joiner in self.joiners if self.sources.get(joiner) == source]

    def to_dict(self) -> dict[str, Any]:
        """The wire form (``transfers`` only when there are some)."""
        data: dict[str, Any] = {
            "request_id": self.request_id,
            "action": self.action,
            "generation": self.generation,
            "previous_generation": self.previous_generation,
            "step": self.step,
            "members": list(self.members),
            "previous_members": list(self.previous_members),
            "joiners": list(self.joiners),
            "leavers": list(self.leavers),
            "sources": dict(self.sources),
            "hosts": dict(self.hosts),
        }
        if self.transfers is not None:
            data["transfers"] = [transfer.to_dict() for transfer in self.transfers]
        if self.layouts is not None:
            data["layouts"] = {generation: list(members) for generation, members in self.layouts.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdjustmentPlan:
        if isinstance(data, Mapping) and data.get("transfers") is not None:
            transfers = [t if isinstance(t, Transfer) else Transfer.from_dict(t) for t in data["transfers"]]
            data = {**data, "transfers": transfers}
        return _from_wire(cls, data, "plan")


# ---- worker → AM requests (each next to its schema) ------------------------------------------------------------------


@dataclass(frozen=True)
class RegisterRequest:
    """``register``: where a worker lives; for a joiner this is *report ready*."""

    TYPE: ClassVar[str] = "register"
    SCHEMA: ClassVar[dict[str, Field]] = {
        "worker_id": Field(_STR, required=True),
        "host": Field(_STR),
        "device": Field((str, int)),
        "pid": Field(_INT),
        "topology": Field((dict,)),
    }

    worker_id: str
    host: str | None = None
    device: str | int | None = None
    pid: int | None = None
    topology: dict[str, Any] | None = None  # replication.topology.detect()'s dict

    def to_body(self) -> dict[str, Any]:
        return _wire(self)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> RegisterRequest:
        return _from_wire(cls, body, cls.TYPE)


@dataclass(frozen=True)
class EnrolRequest:
    """``enrol``: a worker started by a scheduler (``elan worker``) asks for a place in the job; with the
    ``worker_id`` it was given, it polls until the job starts (see :mod:`lightning_elan.master.enrolment`)."""

    TYPE: ClassVar[str] = "enrol"
    SCHEMA: ClassVar[dict[str, Field]] = {
        "host": Field(_STR, required=True),
        "pid": Field(_INT, required=True),
        "worker_id": Field(_STR),
    }

    host: str
    pid: int
    worker_id: str | None = None

    def to_body(self) -> dict[str, Any]:
        return _wire(self)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> EnrolRequest:
        return _from_wire(cls, body, cls.TYPE)


@dataclass(frozen=True)
class EnrolReply:
    """The reply to ``enrol``: ``role`` is ``waiting`` (poll again), ``member`` (of generation 0: ``rank`` of
    ``world_size``) or ``joiner``; ``store_port`` (and ``store_host`` when the AM knows it) locate the job's
    rendezvous store when it is a TCPStore; ``store_url`` names it otherwise (``etcd://HOST:PORT/PREFIX?job=JOB``, the
    store of a job whose AMs keep their state in etcd). A joiner's ``launch_world_size`` is generation 0's size (0
    where the AM does not know it): what the members' ``configure_model`` saw, and what the joiner's builds for."""

    worker_id: str
    role: str
    generation: int = -1
    rank: int = -1
    world_size: int = 0
    coordinate_every: int = DEFAULT_COORDINATE_EVERY
    store_port: int | None = None
    store_host: str | None = None
    store_url: str | None = None
    launch_world_size: int = 0

    @property
    def waiting(self) -> bool:
        return self.role == ROLE_WAITING

    def to_body(self) -> dict[str, Any]:
        return _wire(self)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> EnrolReply:
        return _from_wire(cls, body, "enrol reply")


@dataclass(frozen=True)
class CoordinateRequest:
    """``coordinate``: rank 0's periodic question, with the training progress and (sometimes) the scaling summary."""

    TYPE: ClassVar[str] = "coordinate"
    SCHEMA: ClassVar[dict[str, Field]] = {
        "worker_id": Field(_STR, required=True),
        "generation": Field(_INT, required=True),
        "step": Field(_INT, required=True),
        "epoch": Field(_INT),
        "position": Field(_INT),
        "global_batch": Field(_INT),
        "scaling": Field((dict,), schema=SCALING_SUMMARY),
        "remaining_samples": Field(_INT),
        "live_reshard": Field((bool,)),
    }

    worker_id: str
    generation: int
    step: int
    epoch: int | None = None
    position: int | None = None
    global_batch: int | None = None
    scaling: dict[str, Any] | None = None  # SCALING_SUMMARY
    remaining_samples: int | None = None  # samples left to train (None: the loop's length is unknown)
    live_reshard: bool | None = None  # the members hold shards: a plan's leavers take part until its reshard commits

    def to_body(self) -> dict[str, Any]:
        return _wire(self)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> CoordinateRequest:
        return _from_wire(cls, body, cls.TYPE)


@dataclass(frozen=True)
class WaitPlanRequest:
    """``wait_plan``: a joiner's long poll for its plan."""

    TYPE: ClassVar[str] = "wait_plan"
    SCHEMA: ClassVar[dict[str, Field]] = {"worker_id": Field(_STR, required=True), "timeout_s": Field(_NUMBER)}

    worker_id: str
    timeout_s: float | None = None

    def to_body(self) -> dict[str, Any]:
        return _wire(self)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> WaitPlanRequest:
        return _from_wire(cls, body, cls.TYPE)


@dataclass(frozen=True)
class RecoverRequest:
    """``recover``: a survivor of a failed generation checks in and long-polls for the recovery plan.

    ``step`` is the last optimizer step every member committed (None with ``has_state`` False: a joiner that had not
    received its state when the generation failed). ``uncertain``: the survivor voted on step ``step + 1`` and lost
    the store holding the vote before it read the decision; it applies that step if another survivor did (the plan's
    ``step`` says which) and discards it otherwise. ``before_loop``: the survivor has not entered its training loop
    yet (a death in a collective before it): the recovery then admits no joiner (see ``transitions/recovering.py``).
    """

    TYPE: ClassVar[str] = "recover"
    SCHEMA: ClassVar[dict[str, Field]] = {
        "worker_id": Field(_STR, required=True),
        "generation": Field(_INT, required=True),
        "has_state": Field((bool,), required=True),
        "step": Field(_INT),
        "timeout_s": Field(_NUMBER),
        "uncertain": Field((bool,)),
        "before_loop": Field((bool,)),
    }

    worker_id: str
    generation: int
    has_state: bool
    step: int | None = None
    timeout_s: float | None = None
    uncertain: bool = False
    before_loop: bool = False

    def to_body(self) -> dict[str, Any]:
        return _wire(self)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> RecoverRequest:
        return _from_wire(cls, body, cls.TYPE)


@dataclass(frozen=True)
class WorkerStats:
    """``worker_stats``: a member's mean compute time per optimizer step over its last ``steps`` steps, sent now and
    then off the training thread (straggler detection, ``elan profile``). Compute is the time no peer can delay: the
    forward passes of the step's batches (DDP's backward holds the all-reduce and the wait for slower ranks)."""

    TYPE: ClassVar[str] = "worker_stats"
    SCHEMA: ClassVar[dict[str, Field]] = {
        "worker_id": Field(_STR, required=True),
        "generation": Field(_INT, required=True),
        "step": Field(_INT, required=True),
        "steps": Field(_INT, required=True),
        "compute_s": Field(_NUMBER, required=True),
    }

    worker_id: str
    generation: int
    step: int
    steps: int
    compute_s: float

    def to_body(self) -> dict[str, Any]:
        return _wire(self)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> WorkerStats:
        stats = _from_wire(cls, body, cls.TYPE)
        if stats.steps < 1 or not 0 <= stats.compute_s < 1e6:
            raise ProtocolError(f"worker_stats: steps must be >= 1 and compute_s in [0, 1e6) s, got {stats.steps} "
                                f"and {stats.compute_s}")
        return stats


REPORT_ROLES = ("stayer", "joiner", "leaver")


@dataclass(frozen=True)
class AdjustmentReport:
    """``report``: what one worker measured and applied in the adjustment to ``generation``."""

    TYPE: ClassVar[str] = "report"
    SCHEMA: ClassVar[dict[str, Field]] = {
        "worker_id": Field(_STR, required=True),
        "generation": Field(_INT, required=True),
        "role": Field(_STR, required=True),
        "pause_s": Field(_NUMBER),
        "bytes_sent": Field(_INT),
        "bytes_received": Field(_INT),
        "startup_s": Field(_NUMBER),
        "global_batch": Field(_INT),
        "scaling": Field((dict,), schema=SCALING_DECISION),
        "received_from": Field(_STR),
        "received_over": Field(_STR),
        "bytes_in_place": Field(_INT),
        "prefaulted": Field((bool,)),
        "step": Field(_INT),
    }

    worker_id: str
    generation: int
    role: str  # one of REPORT_ROLES
    pause_s: float | None = None
    bytes_sent: int | None = None
    bytes_received: int | None = None
    startup_s: float | None = None
    global_batch: int | None = None
    scaling: dict[str, Any] | None = None  # SCALING_DECISION
    received_from: str | None = None  # a joiner: the source it copied its state from
    received_over: str | None = None  # a joiner: the route it used (e.g. "shm", or "shm-fallback" after a fallback)
    bytes_in_place: int | None = None  # a joiner: bytes received straight into its own tensors (its parameters)
    prefaulted: bool | None = None  # a joiner: the rest landed in memory it faulted in before the adjustment
    step: int | None = None  # the last step the worker completed when it reported (None: the plan's step is used)

    def to_body(self) -> dict[str, Any]:
        return _wire(self)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> AdjustmentReport:
        return _from_wire(cls, body, cls.TYPE)


@dataclass(frozen=True)
class LeaveRequest:
    """``leave``: a worker asks to be removed from the job (it received SIGTERM); see the AM's ``request_leave``.

    A member is removed by the next adjustment (queued ahead of the scale requests), a joiner whose plan is not decided
    yet is cancelled with its request; repeating it changes nothing.
    """

    TYPE: ClassVar[str] = "leave"
    SCHEMA: ClassVar[dict[str, Field]] = {"worker_id": Field(_STR, required=True)}

    worker_id: str

    def to_body(self) -> dict[str, Any]:
        return _wire(self)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> LeaveRequest:
        return _from_wire(cls, body, cls.TYPE)


# ---- AM → worker replies ---------------------------------------------------------------------------------------------

DECISION_NONE = "none"
DECISION_ADJUST = "adjust"
STATUS_WAIT = "wait"
STATUS_PLAN = "plan"
STATUS_CANCELLED = "cancelled"
STATUS_STANDBY = "standby"  # a standby worker: no plan yet, wait on with no deadline
STANDBY_REQUEST = "standby"
"""The ``request_id`` of a pending worker kept in the standby pool (``launcher_poll``'s spawn items carry it)."""
MAX_STANDBY = 64
"""At most this many standby workers (``elan run --standby K``)."""


@dataclass(frozen=True)
class CoordinateReply:
    """The answer to ``coordinate``: ``none``, or ``adjust`` with the plan; ``joiners_coming`` (with ``none``): a queued
    request starts new workers, so the members may prepare to serve them (``ELAN_SEND_AHEAD``)."""

    decision: str
    plan: AdjustmentPlan | None = None
    joiners_coming: bool = False

    def __post_init__(self) -> None:
        if self.decision not in (DECISION_NONE, DECISION_ADJUST):
            raise ProtocolError(f"coordinate reply: unknown decision {self.decision!r} (expected none or adjust)")
        if (self.plan is not None) != (self.decision == DECISION_ADJUST):
            raise ProtocolError(f"coordinate reply: decision {self.decision!r} with plan {self.plan!r}")

    @classmethod
    def none(cls, joiners_coming: bool = False) -> CoordinateReply:
        return cls(DECISION_NONE, joiners_coming=joiners_coming)

    @classmethod
    def adjust(cls, plan: AdjustmentPlan) -> CoordinateReply:
        return cls(DECISION_ADJUST, plan)

    def to_body(self) -> dict[str, Any]:
        if self.plan is None:
            return {"decision": self.decision, **({"joiners_coming": True} if self.joiners_coming else {})}
        return {"decision": self.decision, "plan": self.plan.to_dict()}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> CoordinateReply:
        plan = body.get("plan")
        return cls(body.get("decision"), None if plan is None else AdjustmentPlan.from_dict(plan),
                   bool(body.get("joiners_coming", False)))


@dataclass(frozen=True)
class WaitPlanReply:
    """The answer to ``wait_plan``: ``wait``, ``plan`` with the plan, ``cancelled`` with the reason, or ``standby``
    (a worker of the standby pool: no request has taken it yet; it waits on with no deadline)."""

    status: str
    plan: AdjustmentPlan | None = None
    reason: str | None = None
    declared_dead: bool = False  # cancelled because the AM declared this worker dead: its process must end

    def __post_init__(self) -> None:
        if self.status not in (STATUS_WAIT, STATUS_PLAN, STATUS_CANCELLED, STATUS_STANDBY):
            raise ProtocolError(f"wait_plan reply: unknown status {self.status!r} (expected wait, plan, cancelled or "
                                "standby)")
        if (self.plan is not None) != (self.status == STATUS_PLAN):
            raise ProtocolError(f"wait_plan reply: status {self.status!r} with plan {self.plan!r}")

    @classmethod
    def wait(cls) -> WaitPlanReply:
        return cls(STATUS_WAIT)

    @classmethod
    def with_plan(cls, plan: AdjustmentPlan) -> WaitPlanReply:
        return cls(STATUS_PLAN, plan)

    @classmethod
    def cancelled(cls, reason: str) -> WaitPlanReply:
        return cls(STATUS_CANCELLED, reason=reason)

    @classmethod
    def standby(cls) -> WaitPlanReply:
        return cls(STATUS_STANDBY)

    @classmethod
    def dead(cls, reason: str) -> WaitPlanReply:
        """The AM declared the asking worker dead (silent after a failure, or its host lost): the job went on
        without it."""
        return cls(STATUS_CANCELLED, reason=reason, declared_dead=True)

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"status": self.status}
        if self.plan is not None:
            body["plan"] = self.plan.to_dict()
        if self.reason is not None:
            body["reason"] = self.reason
        if self.declared_dead:
            body["declared_dead"] = True
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> WaitPlanReply:
        plan = body.get("plan")
        return cls(body.get("status"), None if plan is None else AdjustmentPlan.from_dict(plan), body.get("reason"),
                   bool(body.get("declared_dead", False)))


LEAVE_QUEUED = "queued"  # a member (or a joiner of the plan in flight): an adjustment will remove it
LEAVE_CANCELLED = "cancelled"  # a joiner whose plan was not decided: cancelled with its request
LEAVE_FINISHED = "finished"  # the job is finished or shutting down: there is nothing to leave
LEAVE_OUTCOMES = (LEAVE_QUEUED, LEAVE_CANCELLED, LEAVE_FINISHED)


@dataclass(frozen=True)
class LeaveReply:
    """The answer to ``leave``: its ``outcome`` (one of ``LEAVE_OUTCOMES``) and the request that carries it out."""

    outcome: str
    request_id: str | None = None

    def __post_init__(self) -> None:
        if self.outcome not in LEAVE_OUTCOMES:
            raise ProtocolError(f"leave reply: unknown outcome {self.outcome!r} (expected one of {LEAVE_OUTCOMES})")

    def to_body(self) -> dict[str, Any]:
        return _record(self)  # ``request_id`` null when no request carries it out

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> LeaveReply:
        return _from_wire(cls, body, "leave reply")


# ---- launcher and command-line requests -----------------------------------------------------------------------------


def _request(type_name: str, schema: dict[str, Field], doc: str) -> Callable[[type[_T]], type[_T]]:
    """Give a request dataclass its ``TYPE``, ``SCHEMA``, ``to_body`` and ``from_body`` (the workers' requests spell
    them out; these bodies are plain records of their fields)."""

    def decorate(cls: type[_T]) -> type[_T]:
        cls.TYPE = type_name  # type: ignore[attr-defined]
        cls.SCHEMA = schema  # type: ignore[attr-defined]
        cls.to_body = _wire  # type: ignore[attr-defined]
        cls.from_body = classmethod(lambda c, body: _from_wire(c, body, type_name))  # type: ignore[attr-defined]
        cls.__doc__ = doc
        return cls

    return decorate


@_request("start_job", {
    "nproc": Field(_INT, required=True),
    "coordinate_every": Field(_INT),
    "hosts": Field((list, dict)),
    "report_timeout_s": Field(_NUMBER),
    "replace_failed": Field((bool,)),
    "min_workers": Field(_INT),
    "join_timeout_s": Field(_NUMBER),
    "standby": Field(_INT),
}, "``start_job``: the launcher starts the job with ``nproc`` members and its failure policy.")
@dataclass(frozen=True)
class StartJobRequest:
    nproc: int
    coordinate_every: int | None = None
    hosts: list[Any] | dict[str, Any] | None = None
    report_timeout_s: float | None = None
    replace_failed: bool | None = None
    min_workers: int | None = None
    join_timeout_s: float | None = None
    standby: int | None = None


@_request("scale", {
    "action": Field(_STR, required=True),
    "count": Field(_INT),
    "ranks": Field((list,), item_type=int),
    "size": Field(_INT),
    "at_step": Field(_INT),
}, "``scale``: ``elan scale`` (or a schedule, or the autoscaler) asks to add, remove, migrate or resize to ``size``.")
@dataclass(frozen=True)
class ScaleCommand:
    action: str
    count: int | None = None
    ranks: list[int] | None = None
    size: int | None = None
    at_step: int | None = None


@_request("status", {}, "``status``: the job's state for ``elan status`` and the launcher.")
@dataclass(frozen=True)
class StatusRequest:
    pass


@_request("launcher_poll", {}, "``launcher_poll``: the launcher asks which workers to spawn or stop.")
@dataclass(frozen=True)
class LauncherPollRequest:
    pass


@_request("worker_exit", {
    "worker_id": Field(_STR, required=True),
    "returncode": Field(_INT, required=True),
    "training_ended": Field((bool,)),
    "script_failed": Field((bool,)),
}, "``worker_exit``: the launcher reports a worker process that exited, how, and what the rendezvous store says of it "
   "(its training loop had ended: ``training_ended_key``; an uncaught exception ended its script: "
   "``script_failed_key``); the AM decides from these whether the job's training is complete. A sender that cannot "
   "read the store leaves both out.")
@dataclass(frozen=True)
class WorkerExitRequest:
    worker_id: str
    returncode: int
    training_ended: bool | None = None
    script_failed: bool | None = None


@_request("stalled", {
    "worker_id": Field(_STR, required=True),
    "generation": Field(_INT, required=True),
    "waited_s": Field(_NUMBER, required=True),
    "detail": Field(_STR),
}, "``stalled``: a member's collective of ``generation`` timed out after ``waited_s`` seconds and no member was said "
   "to have died: one stopped answering (its process frozen, or hung outside the collective). The AM fails the "
   "generation as for a death (the reply is ``worker_exit``'s: ``recovering`` and the ``failed_generations``, whose "
   "failure keys the sender sets); the survivors check in, and one that does not within ``waited_s`` is declared dead "
   "and killed (``launcher_poll``'s ``kill``).")
@dataclass(frozen=True)
class StalledRequest:
    worker_id: str
    generation: int
    waited_s: float
    detail: str | None = None


@_request("worker_poll", {
    "worker_id": Field(_STR, required=True),
}, "``worker_poll``: ``elan worker``, while its command runs, asks whether the AM declared that worker dead (it did "
   "not check in after a failure: frozen or hung; the silent survivors of ``elan run`` are killed through "
   "``launcher_poll``'s ``kill``) and whether the job's training is over (a command stopped after it is killed).")
@dataclass(frozen=True)
class WorkerPollRequest:
    worker_id: str


FINISHED_BY_LAUNCHER = "all members finished"
"""The reason the AM finishes a job of ``elan run`` with, once its launcher reported the exit of every member, having
finished training (``master/transitions/finishing.py`` decides it)."""
FINISHED_BY_AM = "training complete: every member finished"
"""The reason the AM finishes a job of ``elan worker``s with, once every member reported the end of its training."""
CLEAN_FINISHES = (FINISHED_BY_LAUNCHER, FINISHED_BY_AM)
"""The ``shutdown`` reasons of a job whose training completed."""


@_request("shutdown", {"reason": Field(_STR)}, "``shutdown``: the job ends (every member finished, or it is stopped).")
@dataclass(frozen=True)
class ShutdownRequest:
    reason: str | None = None


@_request("profile", {
    "min": Field(_INT, required=True),
    "max": Field(_INT, required=True),
    "steps": Field(_INT),
    "settle": Field(_STR),
}, "``profile``: ``elan profile`` measures the job's throughput at each world size from ``min`` to ``max``.")
@dataclass(frozen=True)
class ProfileRequest:
    min: int
    max: int
    steps: int | None = None
    settle: str | None = None


@_request("autoscale", {
    "policy": Field(_STR, required=True),
    "every": Field(_INT),
    "step": Field(_INT),
    "threshold": Field(_NUMBER),
    "min_workers": Field(_INT),
    "max_workers": Field(_INT),
    "cooldown_s": Field(_NUMBER),
    "price": Field(_NUMBER),
    "utility": Field((dict,)),
    "scale_out_command": Field(_STR),
}, "``autoscale``: the autoscaling policy the AM applies from now on (``off`` stops it).")
@dataclass(frozen=True)
class AutoscaleRequest:
    policy: str
    every: int | None = None
    step: int | None = None
    threshold: float | None = None
    min_workers: int | None = None
    max_workers: int | None = None
    cooldown_s: float | None = None
    price: float | None = None
    utility: dict[str, Any] | None = None
    scale_out_command: str | None = None


@_request("stragglers", {
    "mode": Field(_STR, required=True),
    "threshold": Field(_NUMBER),
    "window": Field(_INT),
    "alpha": Field(_NUMBER),
}, "``stragglers``: how the AM treats a member much slower than the others (``off``, ``report``, ``replace``).")
@dataclass(frozen=True)
class StragglersRequest:
    mode: str
    threshold: float | None = None
    window: int | None = None
    alpha: float | None = None


# ---- AM → launcher and command-line replies --------------------------------------------------------------------------


def _list_of(body: Mapping[str, Any], key: str, parse: Callable[[Any], _T], what: str) -> list[_T]:
    """``body[key]`` (a list, absent or null: empty) with each item parsed; anything else raises ``ProtocolError``."""
    items = body.get(key)
    if items is None:
        return []
    if not isinstance(items, list):
        raise ProtocolError(f"{what}: {key!r} must be a list, got {type(items).__name__}")
    return [parse(item) for item in items]


def _reply(what: str, *, nulls: bool = False) -> Callable[[type[_T]], type[_T]]:
    """Give a reply dataclass whose body is the plain record of its fields ``to_body`` (None-valued fields left out,
    or kept with ``nulls``) and ``from_body`` (a missing required field raises ``ProtocolError`` naming ``what``)."""

    def decorate(cls: type[_T]) -> type[_T]:
        cls.to_body = _record if nulls else _wire  # type: ignore[attr-defined]
        cls.from_body = classmethod(lambda c, body: _from_wire(c, body, what))  # type: ignore[attr-defined]
        return cls

    return decorate


@_reply("start_job reply")
@dataclass(frozen=True)
class StartJobReply:
    """The answer to ``start_job``: generation 0 and its members (a started job answers its current ones)."""

    generation: int
    members: list[str]


@_reply("scale reply")
@dataclass(frozen=True)
class ScaleReply:
    """The answer to ``scale`` (and the record of a request the AM queues itself): the request's id and the workers
    it starts (standbys first; none for a removal)."""

    request_id: str
    new_workers: list[str]


@_reply("spawn item")
@dataclass(frozen=True)
class SpawnOrder:
    """One worker ``launcher_poll`` asks the launcher to start: a joiner of ``request_id``, or a standby
    (``STANDBY_REQUEST``)."""

    worker_id: str
    request_id: str


@dataclass(frozen=True)
class LauncherPollReply:
    """The answer to ``launcher_poll``: the workers to start (the AM marks them spawned), those to stop (a joiner that
    never reported ready: SIGTERM), those to kill (a survivor that never checked in after a failure: hung or frozen,
    SIGKILL) and whether the job is finished (the launcher ends it)."""

    spawn: list[SpawnOrder]
    stop: list[str]
    finished: bool
    kill: list[str] = field(default_factory=list)

    def to_body(self) -> dict[str, Any]:
        body = {"spawn": [_wire(order) for order in self.spawn], "stop": list(self.stop), "finished": self.finished}
        return {**body, "kill": list(self.kill)} if self.kill else body  # without ``kill``: the older wire form

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> LauncherPollReply:
        reply = _from_wire(cls, body, "launcher_poll reply")
        spawn = _list_of(body, "spawn", lambda item: _from_wire(SpawnOrder, item, "spawn item"), "launcher_poll reply")
        return cls(spawn, list(reply.stop), reply.finished, list(reply.kill or []))


@_reply("worker_poll reply")
@dataclass(frozen=True)
class WorkerPollReply:
    """The answer to ``worker_poll``: ``kill``: the AM declared the worker dead (it stopped answering): ``elan worker``
    SIGKILLs its command, whose exit is then reported as a death's. ``training_over``: a member's ``fit`` returned, the
    job's training is complete (no collective waits for the others any more)."""

    kill: bool
    training_over: bool = False


@_reply("worker_exit reply")
@dataclass(frozen=True)
class WorkerExitReply:
    """The answer to ``worker_exit``. ``expected``: an exit the AM waited for (a leaver's or a cancelled joiner's exit
    0, a member's after the end; a member's non-zero exit once another member's exit 0 showed the training complete).
    ``left``: killed after it left the job, serving nobody (the job goes on). ``recovering``: a member's death the
    survivors recover from, announced to the ``failed_generations``; False: nobody survives it, the job failed."""

    expected: bool
    recovering: bool | None = None
    left: bool | None = None
    failed_generations: list[int] | None = None


@_reply("status member", nulls=True)
@dataclass(frozen=True)
class MemberStatus:
    """One member in the ``status`` reply: where it runs and its last known step (``last_step_from``: ``coordinate``
    or ``report``, how it is known; None: not heard of yet)."""

    worker_id: str
    rank: int
    host: str | None = None
    device: str | int | None = None
    pid: int | None = None
    joined_generation: int | None = None
    last_step: int | None = None
    last_step_from: str | None = None
    last_seen_at: float | None = None


@dataclass(frozen=True)
class AMStatus:
    """The AM in the ``status`` reply: how many AM processes resumed this job's store (``restarts``), and the one
    serving it now (the server adds these): its pid and address, when it started, its reply cache and parked polls."""

    restarts: int
    pid: int | None = None
    address: str | None = None
    started_at: float | None = None
    reply_cache_entries: int | None = None
    parked_waits: int | None = None


@dataclass(frozen=True)
class StatusReply:
    """The answer to ``status`` (docs/architecture.md, *Status*): the members, the plan in flight and the AM typed, the
    other parts (requests, failures, the recovery, enrolment, the standby pool, sizing) as the AM renders them.

    ``finished``: the job ended, ``finish_reason`` says why (``FINISHED_BY_LAUNCHER``: every member finished training;
    ``failed_reason`` set: it could not go on)."""

    job: str
    generation: int
    members: list[MemberStatus]
    finished: bool
    step: int | None = None
    epoch: int | None = None
    position: int | None = None
    global_batch: int | None = None
    scaling: dict[str, Any] | None = None  # SCALING_SUMMARY
    pending: list[dict[str, Any]] = field(default_factory=list)
    in_flight: AdjustmentPlan | None = None
    last_adjustment: dict[str, Any] | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)
    am: AMStatus | None = None
    recovery: dict[str, Any] | None = None
    enrolment: dict[str, Any] | None = None
    standby: dict[str, Any] | None = None
    sizing: dict[str, Any] | None = None
    failed_reason: str | None = None
    finish_reason: str | None = None

    def member_ids(self) -> list[str]:
        """The members' worker ids, in the order the reply lists them (rank order)."""
        return [member.worker_id for member in self.members]

    def to_body(self) -> dict[str, Any]:
        """Every key, null ones too, in the order the AM has always sent them."""
        body = _record(self)
        body["members"] = [_record(member) for member in self.members]
        body["in_flight"] = None if self.in_flight is None else self.in_flight.to_dict()
        body["am"] = None if self.am is None else _record(self.am)
        order = ("job", "generation", "members", "step", "epoch", "position", "global_batch", "scaling", "pending",
                 "in_flight", "last_adjustment", "failures", "am", "recovery", "enrolment", "standby", "sizing",
                 "finished", "failed_reason", "finish_reason")
        return {key: body[key] for key in order}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> StatusReply:
        status = _from_wire(cls, body, "status reply")
        in_flight, am = body.get("in_flight"), body.get("am")
        return dataclasses.replace(
            status,
            members=_list_of(body, "members", lambda item: _from_wire(MemberStatus, item, "status member"),
                             "status reply"),
            in_flight=None if in_flight is None else AdjustmentPlan.from_dict(in_flight),
            am=None if am is None else _from_wire(AMStatus, am, "status am"),
            pending=list(status.pending or []),
            failures=list(status.failures or []),
        )


@_reply("profile reply")
@dataclass(frozen=True)
class ProfileReply:
    """The answer to ``profile``: the profile run that started (its route ``run``, what is measured so far)."""

    profile: dict[str, Any]


@_reply("autoscale reply", nulls=True)
@dataclass(frozen=True)
class AutoscaleReply:
    """The answer to ``autoscale``: the autoscaler now on (``{policy, config}``), or None (``{"autoscale": null}``):
    it is off."""

    autoscale: dict[str, Any] | None = None


@_reply("straggler settings")
@dataclass(frozen=True)
class StragglerSettings:
    """How the AM treats stragglers: ``mode`` (``off``: reported only, ``replace``, ``remove``), the EWMA's ``alpha``,
    and a worker below ``threshold`` of the median for ``window`` rounds is one."""

    mode: str
    alpha: float
    threshold: float
    window: int


@dataclass(frozen=True)
class StragglersReply:
    """The answer to ``stragglers``: the settings now in force."""

    stragglers: StragglerSettings

    def to_body(self) -> dict[str, Any]:
        return {"stragglers": _wire(self.stragglers)}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> StragglersReply:
        reply = _from_wire(cls, body, "stragglers reply")
        return cls(_from_wire(StragglerSettings, reply.stragglers, "straggler settings"))


@_reply("worker_stats reply")
@dataclass(frozen=True)
class WorkerStatsReply:
    """The answer to ``worker_stats``: the members the straggler detector flags; ``ignored`` when the stats came from
    a worker that is not a member of the current generation."""

    stragglers: list[str]
    ignored: bool | None = None


@_reply("register reply")
@dataclass(frozen=True)
class RegisterReply:
    """The answer to ``register``: to a member, ``joiners_coming`` when a queued request starts new workers (it then
    prepares to serve them from its first step on); ``{}`` otherwise."""

    joiners_coming: bool | None = None


@dataclass(frozen=True)
class EmptyReply:
    """The answer to a request whose reply says nothing but that it was applied (``report``, ``shutdown``): ``{}``."""

    def to_body(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> EmptyReply:
        if not isinstance(body, Mapping):
            raise ProtocolError(f"reply must be an object, got {type(body).__name__}")
        return cls()


# ---- the message registry --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MessageKind:
    """What the AM accepts under one message type: the dataclass of its body (``TYPE``, ``SCHEMA``, ``to_body``,
    ``from_body``), the dataclass of its reply (``to_body``, ``from_body``: the AM's handler returns one, the server
    sends its body, a client parses it back) and whether it changes the AM's state (its successful replies are then
    cached, and persisted, by request id, so a retried request is answered without being applied twice)."""

    body: type
    reply: type
    mutating: bool


MESSAGES: dict[str, MessageKind] = {
    kind.body.TYPE: kind  # type: ignore[attr-defined]
    for kind in (
        MessageKind(StartJobRequest, StartJobReply, mutating=True),
        MessageKind(ScaleCommand, ScaleReply, mutating=True),
        MessageKind(StatusRequest, StatusReply, mutating=False),
        MessageKind(LauncherPollRequest, LauncherPollReply, mutating=True),
        MessageKind(WorkerExitRequest, WorkerExitReply, mutating=True),
        MessageKind(ShutdownRequest, EmptyReply, mutating=True),
        MessageKind(RegisterRequest, RegisterReply, mutating=True),
        MessageKind(EnrolRequest, EnrolReply, mutating=True),
        MessageKind(CoordinateRequest, CoordinateReply, mutating=True),
        MessageKind(WaitPlanRequest, WaitPlanReply, mutating=False),
        MessageKind(AdjustmentReport, EmptyReply, mutating=True),
        MessageKind(RecoverRequest, WaitPlanReply, mutating=True),
        MessageKind(StalledRequest, WorkerExitReply, mutating=True),
        MessageKind(WorkerPollRequest, WorkerPollReply, mutating=False),
        MessageKind(LeaveRequest, LeaveReply, mutating=True),
        MessageKind(WorkerStats, WorkerStatsReply, mutating=False),  # informational, never cached
        MessageKind(ProfileRequest, ProfileReply, mutating=True),
        MessageKind(AutoscaleRequest, AutoscaleReply, mutating=True),
        MessageKind(StragglersRequest, StragglersReply, mutating=True),
    )
}
"""Every message type of the protocol; the AM's handler table has exactly these keys (checked when it starts)."""

TYPED_REQUESTS: tuple[type, ...] = tuple(kind.body for kind in MESSAGES.values())
BODY_SCHEMAS: dict[str, dict[str, Field]] = {
    name: kind.body.SCHEMA for name, kind in MESSAGES.items()  # type: ignore[attr-defined]
}
MUTATING_TYPES = frozenset(name for name, kind in MESSAGES.items() if kind.mutating)
READ_ONLY_TYPES = frozenset(name for name, kind in MESSAGES.items() if not kind.mutating)
MESSAGE_TYPES = frozenset(MESSAGES)


# ---- the worker environment ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerEnvironment:
    """The launcher's description of one worker process, carried in ``ELAN_*`` variables.

    ``role`` is ``member`` (generation 0: ``generation``/``rank``/``world_size`` set), ``joiner`` (started for a
    scale request: they are -1/-1/0 until its plan) or ``standalone`` (no ``elan run``: world size 1, no AM).
    """

    job: str
    worker_id: str
    role: str
    am_address: str | None
    store_address: str | None
    generation: int
    rank: int
    world_size: int
    coordinate_every: int
    spawn_time: float
    device_index: int | None
    term_grace_s: float = DEFAULT_TERM_GRACE_S  # SIGTERM → leave; not left this long after → the crash path
    launch_world_size: int = 0  # the job's world at its launch, where the launcher knows it (0: unknown)

    @property
    def standalone(self) -> bool:
        return self.role == ROLE_STANDALONE

    @property
    def joiner(self) -> bool:
        return self.role == ROLE_JOINER

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerEnvironment:
        """Read the environment (``os.environ`` by default); without ``ELAN_AM_ADDRESS`` the process is standalone."""
        env = os.environ if env is None else env
        coordinate_every = int(env.get(ENV_COORDINATE_EVERY, DEFAULT_COORDINATE_EVERY))
        if ENV_AM_ADDRESS not in env:
            _refuse_other_launchers_world(env)
            return cls.standalone_process(coordinate_every)
        role = env.get(ENV_ROLE, ROLE_MEMBER)
        if role not in LAUNCHED_ROLES:
            raise ValueError(f"{ENV_ROLE} must be 'member' or 'joiner', got {role!r}")
        device = env.get(ENV_DEVICE_INDEX)
        return cls(
            job=env[ENV_JOB],
            worker_id=env[ENV_WORKER_ID],
            role=role,
            am_address=_am_address_from_env(env[ENV_AM_ADDRESS]),
            store_address=env[ENV_STORE_ADDRESS],
            generation=int(env.get(ENV_GENERATION, -1)),
            rank=int(env.get(ENV_RANK, -1)),
            world_size=int(env.get(ENV_WORLD_SIZE, 0)),
            coordinate_every=coordinate_every,
            spawn_time=float(env.get(ENV_SPAWN_TIME, time.time())),
            device_index=None if device in (None, "") else int(device),
            term_grace_s=_term_grace(env.get(ENV_TERM_GRACE)),
            launch_world_size=int(env.get(ENV_LAUNCH_WORLD_SIZE, 0)),
        )

    @classmethod
    def standalone_process(cls, coordinate_every: int = DEFAULT_COORDINATE_EVERY) -> WorkerEnvironment:
        """A process no launcher started: rank 0 of 1, no AM, no store."""
        return cls("standalone", "w0", ROLE_STANDALONE, None, None, 0, 0, 1, coordinate_every, time.time(), None)

    @classmethod
    def launched(
        cls,
        *,
        job: str,
        worker_id: str,
        role: str,
        am_address: str,
        store_address: str,
        coordinate_every: int = DEFAULT_COORDINATE_EVERY,
        rank: int = -1,
        world_size: int = 0,
        spawn_time: float | None = None,
        device_index: int | None = None,
        term_grace_s: float = DEFAULT_TERM_GRACE_S,
        launch_world_size: int = 0,
    ) -> WorkerEnvironment:
        """What the launcher gives a member of generation 0 (with ``rank``/``world_size``) or a joiner (with the job's
        ``launch_world_size`` where the launcher knows it)."""
        generation = 0 if role == ROLE_MEMBER else -1
        spawn_time = time.time() if spawn_time is None else spawn_time
        return cls(job, worker_id, role, am_address, store_address, generation, rank, world_size, coordinate_every,
                   spawn_time, device_index, term_grace_s, launch_world_size)

    def to_env(self) -> dict[str, str]:
        """The ``ELAN_*`` variables that make ``from_env`` return this description (joiners carry no rank)."""
        if self.role not in LAUNCHED_ROLES or self.am_address is None or self.store_address is None:
            raise ValueError(f"only a launched member or joiner has a worker environment, not {self!r}")
        env = {
            ENV_JOB: self.job,
            ENV_AM_ADDRESS: self.am_address,
            ENV_STORE_ADDRESS: self.store_address,
            ENV_WORKER_ID: self.worker_id,
            ENV_ROLE: self.role,
            ENV_COORDINATE_EVERY: str(self.coordinate_every),
            ENV_SPAWN_TIME: repr(self.spawn_time),
            ENV_TERM_GRACE: repr(self.term_grace_s),
        }
        if self.role == ROLE_MEMBER:
            env.update({ENV_GENERATION: str(self.generation), ENV_RANK: str(self.rank),
                        ENV_WORLD_SIZE: str(self.world_size)})
        if self.launch_world_size > 0:
            env[ENV_LAUNCH_WORLD_SIZE] = str(self.launch_world_size)
        if self.device_index is not None:
            env[ENV_DEVICE_INDEX] = str(self.device_index)
        return env


def _refuse_other_launchers_world(env: Mapping[str, str]) -> None:
    """A process another launcher started as one of several (torchrun and ``accelerate launch`` set ``WORLD_SIZE``,
    ``srun -n N`` sets ``SLURM_STEP_NUM_TASKS``) and not ``elan run``: each would train alone on the whole dataset."""
    for name in OTHER_LAUNCHER_WORLD_ENV_VARS:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 1:
            raise RuntimeError(
                f"this process is one of {value} started by another launcher ({name}={value}: torchrun, `accelerate "
                f"launch`, srun), not by `elan run`: each would train alone on the whole dataset. Start the job with "
                f"`elan run --nproc {value} -- python SCRIPT` (or `elan worker` under a scheduler: README, *Workers on "
                "many hosts*)."
            )


def _am_address_from_env(text: str) -> str:
    """``ELAN_AM_ADDRESS`` in the form ``tcp://HOST:PORT[,…]`` (any form :func:`am_address_list` takes)."""
    try:
        return am_address_list(text)
    except ValueError as error:
        raise ValueError(f"{ENV_AM_ADDRESS}: {error}") from None


def _term_grace(text: str | None) -> float:
    """``ELAN_TERM_GRACE`` in seconds (> 0; unset: ``DEFAULT_TERM_GRACE_S``)."""
    if text in (None, ""):
        return DEFAULT_TERM_GRACE_S
    grace = float(text)
    if not 0 < grace < float("inf"):
        raise ValueError(f"{ENV_TERM_GRACE} must be a number of seconds > 0, got {text!r}")
    return grace


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` → ``("host", port)`` (the host may itself contain colons)."""
    host, _, port = address.rpartition(":")
    return host, int(port)


__all__ = [
    "ACTION_FAILURE",
    "BODY_SCHEMAS",
    "CLEAN_FINISHES",
    "COMMAND_ENV_VARS",
    "CONTRACT_VERSION",
    "DECISION_ADJUST",
    "DECISION_NONE",
    "DEFAULT_COORDINATE_EVERY",
    "DEFAULT_JOIN_TIMEOUT_S",
    "DEFAULT_RECOVERY_TIMEOUT_S",
    "DEFAULT_REPORT_TIMEOUT_S",
    "DEFAULT_TERM_GRACE_S",
    "ENV_AM",
    "ENV_AM_ADDRESS",
    "ENV_COORDINATE_EVERY",
    "ENV_DEVICE_INDEX",
    "ENV_GENERATION",
    "ENV_HOME",
    "ENV_IFACE",
    "ENV_JOB",
    "ENV_LAUNCH_WORLD_SIZE",
    "ENV_PREFIX",
    "ENV_RANK",
    "ENV_REPLICATION",
    "ENV_ROLE",
    "ENV_SCALE_OUT_COUNT",
    "ENV_SECRET_FILE",
    "ENV_SEND_AHEAD",
    "ENV_SHM_DIR",
    "ENV_SPAWN_TIME",
    "ENV_STORE_ADDRESS",
    "ENV_TERM_GRACE",
    "ENV_WORKER_ID",
    "ENV_WORLD_SIZE",
    "FINISHED_BY_AM",
    "FINISHED_BY_LAUNCHER",
    "LEAVE_CANCELLED",
    "LEAVE_FINISHED",
    "LEAVE_OUTCOMES",
    "LEAVE_QUEUED",
    "MAX_WORLD_SIZE",
    "MESSAGES",
    "MESSAGE_TYPES",
    "MUTATING_TYPES",
    "PROTOCOL_VERSION",
    "READ_ONLY_TYPES",
    "REPORT_ROLES",
    "ROLE_JOINER",
    "ROLE_MEMBER",
    "ROLE_STANDALONE",
    "ROLE_WAITING",
    "SCALING_DECISION",
    "SCALING_SUMMARY",
    "SCHEDULER_WORLD_ENV_VARS",
    "SIGTERM_EXITS",
    "STATUS_CANCELLED",
    "STATUS_PLAN",
    "STATUS_WAIT",
    "STRIPPED_ENV_VARS",
    "TRANSPORTS",
    "TRANSPORT_COLLECTIVE",
    "TRANSPORT_CUDA_IPC",
    "TRANSPORT_SHM",
    "TYPED_REQUESTS",
    "WORKER_ENV_VARS",
    "AMStatus",
    "AdjustmentPlan",
    "AdjustmentReport",
    "AutoscaleReply",
    "AutoscaleRequest",
    "CoordinateReply",
    "CoordinateRequest",
    "EmptyReply",
    "EnrolReply",
    "EnrolRequest",
    "Field",
    "LauncherPollReply",
    "LauncherPollRequest",
    "LeaveReply",
    "LeaveRequest",
    "MemberStatus",
    "MessageKind",
    "ProfileReply",
    "ProfileRequest",
    "ProtocolError",
    "RecoverRequest",
    "RegisterReply",
    "RegisterRequest",
    "ScaleCommand",
    "ScaleReply",
    "ShutdownRequest",
    "SpawnOrder",
    "StalledRequest",
    "StartJobReply",
    "StartJobRequest",
    "StatusReply",
    "StatusRequest",
    "StragglerSettings",
    "StragglersReply",
    "StragglersRequest",
    "Transfer",
    "WaitPlanReply",
    "WaitPlanRequest",
    "WorkerEnvironment",
    "WorkerExitReply",
    "WorkerExitRequest",
    "WorkerPollReply",
    "WorkerPollRequest",
    "WorkerStatsReply",
    "failure_key",
    "required_fields",
    "script_ended_key",
    "script_failed_key",
    "split_host_port",
    "training_ended_key",
    "worker_number",
]
