"""The elastic engine: one object per worker that runs the membership protocol (no Lightning, no Accelerate).

:class:`ElasticWorker` owns the link to the application master (AM), the worker's one process group
(:class:`~lightning_elan.elastic.process_group.ElasticProcessGroup`), the job's data position and the adjustment
sequence. A front-end (:class:`~lightning_elan.elastic.frontend.FrontEnd`) calls it at three places:

* :meth:`ElasticWorker.start` when the framework sets up its distributed state: a member enters generation 0, a
  joiner only connects;
* :meth:`ElasticWorker.join` on a joiner once it has built everything (its *report ready*): it waits for the plan,
  enters the new generation, receives the training state from its source and hands it to the front-end;
* :meth:`ElasticWorker.at_batch_boundary` after the last hook of every trained batch: every ``coordinate_every``
  steps rank 0 asks the AM, one broadcast on the group tells every rank, and an adjustment runs as one sequence —
  scaling decision, snapshot, re-form, send, rewire (or leave), report.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from lightning_elan.data.positions import LocalShare
from lightning_elan.data.sampler import DataPosition, EpochOrder
from lightning_elan.elastic.am_link import AMLink
from lightning_elan.elastic.compute import ComputeMeter
from lightning_elan.elastic.epoch_aggregates import AggregateHandover, Inheritance, heir_of
from lightning_elan.elastic.error_origin import is_a_collective_timeout, may_be_a_peers_death
from lightning_elan.elastic.etcd_rendezvous import open_rendezvous_store
from lightning_elan.elastic.failures import CommitVote, FailureWatch, PeerFailure, UncertainCommit
from lightning_elan.elastic.frontend import FrontEnd, ScalingParticipant
from lightning_elan.elastic.live_reshard import LiveResharding, ReshardAbandoned, reshard_live
from lightning_elan.elastic.logged_rows import LoggedRows
from lightning_elan.elastic.process_group import (
    ElasticProcessGroup,
    blocked_seconds,
    install_default_group,
    uninstall_default_group,
)
from lightning_elan.elastic.rng import rng_state, set_rng_state
from lightning_elan.elastic.scaling import ScalingLink
from lightning_elan.elastic.script_end import mark_script_end_at_exit, mark_training_ended
from lightning_elan.elastic.send_ahead import SendAhead
from lightning_elan.elastic.state_size import StateSizeNotice, fault_in_for_joiner
from lightning_elan.elastic.store_chores import StoreChores
from lightning_elan.elastic.termination import TerminationWatch, any_rank_leaving
from lightning_elan.elastic.timeline import PhaseClock, StepTimeline
from lightning_elan.protocol.contract import (
    DEFAULT_JOIN_TIMEOUT_S,
    ENV_REPLICATION,
    ENV_SEND_AHEAD,
    AdjustmentPlan,
    AdjustmentReport,
    CoordinateRequest,
    WorkerEnvironment,
    WorkerStats,
    failure_key,
)
from lightning_elan.replication.exchange import OutgoingReplication, ReplicationContext, receive_replica, send_replica
from lightning_elan.replication.iface import bind_transfer_interface, collective_address
from lightning_elan.replication.keys import delete_prefix
from lightning_elan.replication.packing import join_tensors, split_tensors
from lightning_elan.replication.reception import PrefaultedMemory, ReceiveInto
from lightning_elan.replication.topology import detect as detect_topology
from lightning_elan.replication.transports import Received

log = logging.getLogger(__name__)

__all__ = ["ElasticWorker", "NotAMember", "PeerFailure", "engine_of_process", "generation_prefix"]

FAILURE_NOTICE_S = 60.0
"""How long a worker whose collective raised waits for the AM to declare a member dead before it treats the error as
its own (a bug, not a peer's death) and re-raises it. The notice travels from the dead worker's launcher or ``elan
worker`` through the AM and its store (etcd: a write) to each member's watch: on a host whose cores are oversubscribed
that took more than 10 s (a storm of jobs on 2 cores, load 16), and a survivor that gave up then failed the job."""

FAILURE_NOTICE_WARNING_S = 10.0
"""After this long without the AM's notice, the waiting worker says what it waits for."""

LEAVER_STEP_ASIDE_S = 1.0
"""How long a worker that left the job waits before its teardown: the stayers' first steps run without it."""

VOTE_STORE_KEY = "vote-store"
"""Under a generation's prefix in the job store: ``HOST:PORT`` of the generation's fast store (etcd job stores only)."""
PRE_LOOP_POSITION_KEY = "pre_loop_position/"
"""Under a recovery generation's prefix: each survivor's position among the collectives made before the training
loop (``elastic/pre_loop.py``)."""
LOOP_STARTED_KEY = "elan/loop_started"
"""In the job store, set by each member as it enters its training loop: the job is past the collectives made before
it (a main process's data preparation behind a barrier), which a joiner's barrier before its admission waits for."""
LOOP_WAIT_NOTICE_S = 30.0
"""How often a joiner waiting for the job's training loop (or a result of its start) says so."""
CHORES_DRAIN_S = 5.0
"""At the end of its training loop a worker waits this long at most for its queued store writes (a store that does
not answer: the bookkeeping is left behind, not the job)."""
START_RESULT_PREFIX = "elan/start/"
"""In the job store: what the launch members computed at the script's start and a joiner takes instead of computing
it alone (the LR finder's range test: ``elan/start/lr_find/<n>``)."""

# what rank 0 broadcasts at a coordination point (_PREPARE: no change, but a queued request's joiners warm up)
_NO_CHANGE, _ADJUST, _DEFERRED, _PREPARE = 0, 1, 2, 3
REPLICATION_MODES = ("auto", "collective")

_PROCESS_ENGINE: ElasticWorker | None = None
"""The engine of this process's ``elan run`` job once it started: it owns torch's default group, so every later
front-end of the process (a second ``Trainer``) takes it (:func:`engine_of_process`)."""


def engine_of_process() -> ElasticWorker | None:
    """The started engine of this process's job, if any (None in a standalone run: each Trainer starts its own)."""
    return _PROCESS_ENGINE


DECLARED_DEAD_EXIT = 1
"""The exit of a worker that learns, once it can reach the AM again, that the AM declared it dead."""


class NotAMember(RuntimeError):
    """Raised by :meth:`ElasticWorker.join` when the AM cancelled this joiner (its request failed or the job ended)."""


def step_aside() -> None:
    """A leaver, out of the job: what it still runs (the framework's teardown, freeing its state, the rest of the
    script) waits :data:`LEAVER_STEP_ASIDE_S`, so that it does not slow the stayers' first steps on a shared host.
    A wait, not a lower priority: an unprivileged process cannot raise its priority again, and at niceness 19 on a busy
    host a leaver's teardown (its interpreter's last garbage collection alone) took minutes."""
    time.sleep(LEAVER_STEP_ASIDE_S)


def generation_prefix(generation: int) -> str:
    """Store prefix of everything that forms ``generation``: its group's rendezvous and the transfers to joiners."""
    return f"elan/gen{generation}/"


def _delete_generation_keys(store: dist.Store, prefix: str) -> None:
    removed = delete_prefix(store, prefix)
    log.debug("deleted %d store keys under %s", removed, prefix)


@dataclass(frozen=True)
class _Adjust:
    """What rank 0 broadcasts when the AM says *adjust*: the plan, rank 0's shared state, the scaling decision."""

    plan: AdjustmentPlan
    shared: dict[str, Any]
    scaling: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "shared": self.shared, "scaling": self.scaling}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> _Adjust:
        return cls(AdjustmentPlan.from_dict(data["plan"]), data["shared"], data["scaling"])


def broadcast_json(value: Any, group: dist.ProcessGroup, device: torch.device) -> Any:
    """Rank 0's JSON-able ``value`` on every rank: a length, then UTF-8 bytes (JSON, not pickle: nothing that arrives
    over the network is unpickled)."""
    data = json.dumps(value).encode() if group.rank() == 0 else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=0, group=group)
    payload = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if group.rank() == 0:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(payload, src=0, group=group)
    return json.loads(bytes(payload.cpu().tolist()))


class ElasticWorker:
    """One worker's side of the elastic job (see the module docstring)."""

    def __init__(
        self,
        environment: WorkerEnvironment,
        *,
        coordinate_every: int | None = None,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
        replication: str | None = None,
        global_batch: int | None = None,
        send_ahead: str | None = None,
    ) -> None:
        self.environment = environment
        # a joiner's comes with its state; the launcher tells it ahead (where it knows it) for code run before that
        self.launch_world_size = environment.world_size or environment.launch_world_size or None
        self.coordinate_every = coordinate_every or environment.coordinate_every
        if self.coordinate_every < 1:
            raise ValueError(f"coordinate_every must be >= 1, got {self.coordinate_every}")
        self.replication = replication or os.environ.get(ENV_REPLICATION, "auto")
        if self.replication not in REPLICATION_MODES:
            raise ValueError(f"replication must be one of {REPLICATION_MODES}, got {self.replication!r}")
        send_ahead = send_ahead or os.environ.get(ENV_SEND_AHEAD) or "joiners"
        self._send_ahead = SendAhead("off" if self.replication == "collective" else send_ahead)
        self.backend = "gloo"
        self.device = torch.device("cpu")
        self.timeout = timedelta(minutes=5)
        self.join_timeout_s = join_timeout_s
        self.data = DataPosition(global_batch=global_batch)
        self._epoch_order: EpochOrder | None = None  # the training loader's (see follow_epoch_order)
        self._received_order: dict[str, Any] | None = None  # a joiner's source's, until its loader exists
        self._configured_global_batch = global_batch
        self.training_fits = 0  # training loops this process ran to their end as a member
        self._start_results = 0  # results of the script's start published or taken (see start_result)
        self.group: ElasticProcessGroup | None = None
        self.generation: int | None = None
        self._launch_generation: int | None = None  # the generation formed at start (None for a joiner)
        self.has_left = False
        self._in_training_loop = False  # the front-end's loop started (a joiner: admitted at a batch boundary)
        self._frontend: FrontEnd | None = None
        self._scaling = ScalingLink()
        self._link: AMLink | None = None
        self._outgoing: OutgoingReplication | None = None
        self._pending_report: AdjustmentReport | None = None
        self._recovered_at: int | None = None  # the step a recovery since the last batch was taken ended at
        self._deferred = False
        self._keys_to_delete: str | None = None
        self._timeline = StepTimeline()
        self._compute = ComputeMeter()
        self._state_size = StateSizeNotice()
        self._chores = StoreChores()  # bookkeeping writes to the job store, off the training thread
        self._spare: PrefaultedMemory | None = None  # a joiner's memory faulted in for its state while it waits
        self._epoch_end: int | None = None  # the sampler's end of the current epoch (its length), for remaining_samples
        self._watch: FailureWatch | None = None
        self._vote: CommitVote | None = None
        self._recovered_plan: AdjustmentPlan | None = None  # the plan of the newest recovery
        self._shard_layout: list[str] | None = None  # a sharded front-end's shards after an abandoned live reshard
        self._vote_server: dist.TCPStore | None = None  # rank 0's fast store of its generation (etcd job store)
        self._recovery_plan: AdjustmentPlan | None = None  # decided while an uncertain commit was resolved
        self._uncommitted: dict[str, Any] | None = None  # the data position before the batch not yet committed
        self._termination: TerminationWatch | None = None
        self._leave_in_vote: bool | None = None  # this batch's commit vote said whether a leave is queued
        self._boundary_started: float | None = None  # when the last batch boundary began (the adjustment's log line)
        self._aggregates: AggregateHandover | None = None  # the front-end's epoch aggregates, once attached
        self._rows = LoggedRows()  # the logger rows of the last step that stood (elastic/logged_rows.py)
        self._evaluating = False  # recovering from a death in an evaluation outside the training loop

    # ------------------------------------------------------------------ wiring

    def attach(self, frontend: FrontEnd) -> None:
        self._frontend = frontend
        self._aggregates = AggregateHandover(self.worker_id, frontend)

    def follow_logged_rows(self, resend: Callable[[int], bool]) -> None:
        """``resend(window)`` writes a closed window's logger rows again: a new rank 0 calls it when its dead
        predecessor had not written them (see :meth:`rows_closed`)."""
        self._rows.follow(resend)

    @property
    def rows_marked(self) -> int:
        """While a closed window is sent again: the last window the dead rank 0 marked as written (0: none)."""
        return self._rows.marked

    def rows_closed(self, window: int) -> None:
        """The front-end sent (and saved) the logger rows of closed ``window``; rank 0's loggers wrote them."""
        if self._vote is not None and self.is_member:
            self._rows.closed(self._vote.store, self.generation or 0, self.rank, window)

    def register_scaling(self, participant: ScalingParticipant) -> None:
        """Hand every resize's global-batch decision to ``participant`` (default: strong scaling, no decision)."""
        self._scaling.participant = participant

    @property
    def frontend(self) -> FrontEnd:
        if self._frontend is None:
            raise RuntimeError("no front-end attached to the elastic worker")
        return self._frontend

    # ------------------------------------------------------------------ membership

    @property
    def is_member(self) -> bool:
        """In a generation now (a joiner becomes one in :meth:`join`; a leaver stops being one)."""
        return self.generation is not None and not self.has_left

    @property
    def rank(self) -> int:
        return self._group().rank()

    @property
    def world_size(self) -> int:
        return self._group().size()

    @property
    def generation_group(self) -> dist.ProcessGroup:
        """The current generation as a group of fixed size with abortable work: for DDP, whose reducer reads the C++
        size and must be released when a member dies."""
        return self._group().generation_view()

    def generation_subgroup(self, ranks: list[int], tolerating: Callable[[], bool] | None = None
                            ) -> dist.ProcessGroup | None:
        """A group of some ranks of the current generation, abortable with it and valid in it only
        (``ElasticProcessGroup.new_group``): every member makes the same groups in the same order; None when this
        member is not in ``ranks``. ``tolerating``: its failures kept while it says so (see
        :meth:`tolerant_generation_group`)."""
        return self._group().new_group(ranks, tolerating=tolerating)

    def tolerant_generation_group(self, tolerating: Callable[[], bool]) -> dist.ProcessGroup:
        """The current generation as :attr:`generation_group`, its collectives' failures kept instead of raised while
        ``tolerating()`` (``process_group.TolerantGenerationGroup``: a sharded model's collectives in user code)."""
        return self._group().generation_view(tolerating)

    @property
    def hosts(self) -> list[str]:
        """The host name of each member of the current generation, by rank."""
        return self._group().hosts

    @property
    def worker_id(self) -> str:
        return self.environment.worker_id

    def start(self, backend: str, device: torch.device, timeout: timedelta) -> None:
        """Connect to the job; a member (or a standalone process) enters its generation, a joiner waits for join().

        ``backend`` (gloo or nccl) and ``device`` are the framework's; ``timeout`` bounds every collective.
        """
        if self.group is not None:
            return
        self.backend, self.device, self.timeout = backend, device, timeout
        bind_transfer_interface()  # before the first gloo/NCCL group: bind the interface that reaches the other hosts
        store = self._connect_store()
        self.group = ElasticProcessGroup(store, self.backend, self.timeout, self.device)
        if not self.environment.standalone:
            global _PROCESS_ENGINE
            _PROCESS_ENGINE = self
            mark_script_end_at_exit(store, self.worker_id)
            self._link = AMLink(self.environment)
            self._watch = FailureWatch(self.environment.store_address or "", self._on_generation_failed, timeout)
            self._termination = TerminationWatch.watch(self.environment)
        if self.environment.joiner:
            return
        env = self.environment
        self.generation = self._form_launch_generation(env.generation, env.rank, env.world_size)
        self._launch_generation = self.generation
        install_default_group(self.group)
        self._generation_formed()
        if self._link is not None:
            self._send_ahead.joiners_coming_at_start = self._link.register(str(self.device), self._topology())

    def alone_until_admitted(self) -> None:
        """A joiner warming up: torch's default group is a world of this process alone until it joins, so that the
        script's own ``torch.distributed`` calls before its training (a ``setup`` or ``prepare_data`` ported from a DDP
        script: ``get_rank()``, ``barrier()``) complete here, as the strategy's collectives do, instead of raising that
        no default group exists; :meth:`join` makes it the job's."""
        if self.is_member or self.has_left or self.environment.standalone or self.group is None:
            return
        self.group.go_alone()
        install_default_group(self.group)

    @property
    def in_launch_generation(self) -> bool:
        """This worker is in the generation it formed when the job started, into which no state was replicated: its
        members start from rank 0's initial weights."""
        return self.generation is not None and self.generation == self._launch_generation

    def _form_launch_generation(self, generation: int, rank: int, world_size: int) -> int:
        """Form the job's first generation; if a member dies before it is formed (killed while it started), form
        the survivors' generation instead, as the AM's recovery plan says. Returns the generation formed."""
        while True:
            if self._watch is not None:
                self._watch.watch(generation)  # before it is formed: a member that dies meanwhile fails it
            try:
                self._group().configure(generation_prefix(generation), rank, world_size)
            except PeerFailure:
                self._timeline.adjustment_started()
                plan = self._recovery_plan_for(generation, 0)
                log.warning("worker %s: a member of generation %d died before it was formed; forming generation %d "
                            "with %s", self.worker_id, generation, plan.generation, ", ".join(plan.members))
                if plan.joiners:  # none before the first step: an adjustment is only decided at a batch boundary
                    raise RuntimeError(f"worker {self.worker_id}: the recovery plan of generation {generation} has "
                                       f"joiners {plan.joiners} before any state exists") from None
                generation, rank, world_size = plan.generation, plan.rank_of(self.worker_id), plan.world_size
                continue
            if generation != self.environment.generation:  # the recovery is complete once every member reports
                self._pending_report = AdjustmentReport(self.worker_id, generation, "stayer", bytes_sent=0)
            return generation

    def join(self) -> None:
        """A joiner, warmed up: report ready, wait for the adjustment, enter the generation, take the state."""
        link = self._require_link()
        self._fault_in_spare()
        link.register(str(self.device), self._topology())
        reply = link.wait_plan(self.join_timeout_s)
        while True:
            if reply.plan is None:
                self.has_left = True
                raise NotAMember(f"worker {self.worker_id} is not needed ({reply.reason})")
            plan = reply.plan
            phases = PhaseClock()
            try:
                self._enter(plan)
                install_default_group(self._group())
                phases.mark("group")
                state, got, route = self._receive(plan)
                phases.mark("receive")
                self._in_training_loop = True  # admitted at the members' batch boundary
                self._spare = None  # taken, or of no use to the route the plan chose: unmapped now
                self.frontend.load_training_state(state)
                self._reshard_live(plan)  # a death in it abandons it: this joiner holds no shard, as before it
                break
            except Exception as error:
                self._confirm_peer_failure(error)
                log.warning("worker %s: generation %d failed while it received its state", self.worker_id,
                            plan.generation)
                self._group().abort()
                reply = link.recover(plan.generation, None, self.join_timeout_s)
        if not plan.stayers:  # every old member left: their epoch aggregates come to the first joiner
            self._take_aggregates(plan, plan.leavers, self._group().store, plan.step)
        phases.mark("restore")
        log.info("worker %s joined generation %d after %s", self.worker_id, plan.generation, phases)
        self._pending_report = AdjustmentReport(
            self.worker_id, plan.generation, "joiner", bytes_received=got.nbytes,
            received_from=plan.sources[self.worker_id], received_over=route, bytes_in_place=got.in_place,
            prefaulted=got.prefaulted)
        self._timeline.adjustment_started()

    # ------------------------------------------------------------------ failures

    @property
    def peer_failed(self) -> bool:
        """Whether the current generation is known to have lost a member."""
        return self._recovery_plan is not None or (self._watch is not None and self._watch.failed(self.generation))

    def commit_step(self, committed_step: int, closes_batch: bool = True) -> None:
        """After the step's gradients were all-reduced, before the optimizer applies them (``committed_step`` steps
        applied so far): every member commits the step or none does; raises :class:`PeerFailure` when it is aborted
        (the step is then redone). ``closes_batch=False``: more steps of this batch may follow (manual optimization),
        so a failure before :meth:`batch_trained` still redoes the whole batch."""
        if self._vote is not None:
            self._record_aggregates(committed_step + 1, before_vote=True)
            try:
                committed = self._vote.commit(self._leave_queued_here())
                self._leave_in_vote = self._vote.leave_signalled
            except UncertainCommit as uncertain:
                committed = self._resolve_uncertain_commit(committed_step, uncertain)
            if not committed:
                raise PeerFailure(self.generation or 0, "the step was not committed")
        if closes_batch:
            self._uncommitted = None

    def batch_trained(self, step: int) -> None:
        """The batch's last optimizer step is applied (``step`` steps in all): a failure from now on leaves it
        standing, and its epoch aggregates are recorded as such (with what was logged after its optimizer steps)."""
        self._uncommitted = None
        self._record_aggregates(step)

    def _resolve_uncertain_commit(self, committed_step: int, uncertain: UncertainCommit) -> bool:
        """The vote's store died with the decision (its host, rank 0, died): check in with the AM as uncertain; the
        step stands if another survivor committed it. The recovery plan is kept for :meth:`recover`, which the
        failed generation's next collective or batch boundary enters. Returns whether to apply the step."""
        self._confirm_peer_failure(uncertain.cause)
        failed = self.generation
        assert failed is not None
        log.warning("worker %s lost the commit vote of step %d with generation %d: the recovery decides it",
                     self.worker_id, committed_step + 1, failed)
        reply = self._require_link().recover(failed, committed_step, self.join_timeout_s, uncertain=True)
        if reply.plan is None:
            raise RuntimeError(f"worker {self.worker_id} cannot recover from the failure of generation {failed}: "
                               f"{reply.reason}") from uncertain
        self._recovery_plan = reply.plan
        applied = reply.plan.step > committed_step
        log.warning("worker %s %s step %d: the survivors' newest committed step is %d", self.worker_id,
                    "applies" if applied else "discards", committed_step + 1, reply.plan.step)
        self._leave_in_vote = False if applied else None
        return applied

    @property
    def step_uncommitted(self) -> bool:
        """A global batch was taken and its step not committed: a failure now discards it (it is redone)."""
        return self._uncommitted is not None

    def confirm_peer_failure(self, error: BaseException) -> None:
        """``error`` came out of a collective: return once a member's death is confirmed, else re-raise ``error``."""
        self._confirm_peer_failure(error)

    def recover(self, committed_step: int) -> None:
        """A member died: discard the uncommitted step, check in with the AM, enter the recovery plan's generation,
        serve the state to survivors without it, rewire the front-end. The front-end has rolled its loop back."""
        failed = self.generation
        assert failed is not None
        started = time.perf_counter()
        self._timeline.adjustment_started()
        if self._uncommitted is not None:  # the global batch is redone by the next generation
            self.data.load_state_dict(self._uncommitted)
            self._uncommitted = None
        self._abandon_outgoing()
        self._group().abort()
        log.warning("worker %s recovers from the failure of generation %d at step %d", self.worker_id, failed,
                    committed_step)
        self._recovered_at = committed_step
        launch = self.in_launch_generation
        plan, sent = self._enter_recovery(failed, committed_step)
        while True:
            try:
                self._reshard_live(plan)  # a sharded front-end: the dead members' shards from their mirrors (elan_fsdp)
                break
            except ReshardAbandoned:  # another death in it: recover from that one, from the same old layout
                log.warning("worker %s: generation %d failed during the recovery's reshard", self.worker_id,
                            plan.generation)
                self._abandon_outgoing()
                self._group().abort()
                plan, sent = self._enter_recovery(plan.generation, committed_step)
        self._recovered_plan = plan
        if launch and not plan.joiners:  # no state was replicated into it: it starts as the launch generation did
            self._launch_generation = plan.generation
        self.frontend.after_resize()
        self._rows.resend_if_due(self._aggregate_store(), plan.generation, self.rank)
        log.info("worker %s recovered into generation %d (%s) in %.2f s", self.worker_id, plan.generation,
                 ", ".join(plan.members), time.perf_counter() - started)
        self._pending_report = AdjustmentReport(self.worker_id, plan.generation, "stayer", bytes_sent=sent)

    def recover_evaluation(self, committed_step: int) -> None:
        """A member died during an evaluation outside the training loop (the front-end's ``validate``, ``test`` or
        ``predict`` after its training, or without one): the survivors form the next generation as for any death
        (:meth:`recover`), with no joiner admitted (there is no training state to give one), and report it at once: no
        batch boundary follows. The AM link, closed when the training ended (:meth:`close`), is opened for it."""
        reopened = self._link is None and not self.environment.standalone
        if reopened:
            self._link = AMLink(self.environment)
        started = time.perf_counter()
        self._evaluating = True
        try:
            self.recover(committed_step)
            if self._pending_report is not None:
                report = replace(self._pending_report, pause_s=time.perf_counter() - started,
                                 global_batch=self.data.global_batch, step=committed_step)
                self._require_link().report(report, wait=True)
                self._pending_report = None
        finally:
            self._evaluating = False
            if reopened and self._link is not None:
                self._link.close()
                self._link = None

    def agree_evaluation_pass(self) -> None:
        """Every member finished an evaluation pass outside the training loop, or none did: one commit vote, as a
        step's, aborted once a member of the generation is known dead (a pass may make no collective at all: a
        prediction's). Raises :class:`PeerFailure` when it is aborted (the survivors run the pass again)."""
        if self._vote is None or not self.is_member:
            return
        try:
            committed = self._vote.commit()
        except UncertainCommit as uncertain:
            raise PeerFailure(self.generation or 0, "the vote on an evaluation pass was lost") from uncertain
        if not committed:
            raise PeerFailure(self.generation or 0, "a member died during an evaluation pass")

    def _enter_recovery(self, failed: int, committed_step: int) -> tuple[AdjustmentPlan, int]:
        """Enter the recovery plan's generation and serve its joiners; returns the plan and the bytes sent. A member
        that dies meanwhile (while the generation forms, or a joiner while it receives) fails that generation too:
        recover from it in turn."""
        plan = self._recovery_plan or self._recovery_plan_for(failed, committed_step)
        self._recovery_plan = None
        self._pin_shard_layout(plan, failed)
        tried = [failed]  # the generation that failed, then those this recovery tried to form
        inherited: dict[str, list[Inheritance]] = {}  # the heirs of the plans this recovery tried, and what they took
        self._take_aggregates_of_the_dead(plan, committed_step, tried, inherited)  # before the failed vote goes
        self._rows.check(self._aggregate_store(), failed)
        while True:
            self.frontend.before_resize()
            try:
                self._enter(plan)
                snapshot = self._snapshot() if plan.joiners_served_by(self.worker_id) else None
                return plan, (self._send(plan, snapshot) if snapshot is not None else 0)
            except Exception as error:
                self._confirm_peer_failure(error)
                log.warning("worker %s: generation %d failed during the recovery", self.worker_id, plan.generation)
                self._abandon_outgoing()
                self._group().abort()
                tried.append(plan.generation)
                plan = self._recovery_plan_for(plan.generation, committed_step)
                self._take_aggregates_of_the_dead(plan, committed_step, tried, inherited)

    def _take_aggregates_of_the_dead(self, plan: AdjustmentPlan, committed_step: int, tried: Sequence[int],
                                     inherited: dict[str, list[Inheritance]]) -> None:
        """The heir of a recovery plan adds the dead members' epoch aggregates to its own, each from the newest of the
        generations involved in which it wrote any: the plan's previous one, the one that failed (newer than the
        previous one when the AM had not committed it yet: a joiner died before its adjustment completed) and those
        the recovery tried to form (a member that died entering one wrote none there). If a dead member was the heir
        of a plan tried before and recorded nothing since, the parts it took count on their own (``inherited``, which
        this adds the plan's heir to)."""
        dead = [worker for worker in plan.previous_members if worker not in plan.members]
        generations = sorted({plan.previous_generation, *tried}, reverse=True)
        self._take_aggregates(plan, dead, self._aggregate_store(), committed_step, generations, inherited)
        heir = heir_of(plan)
        if heir is not None and dead:
            inherited.setdefault(heir, []).append(Inheritance(plan.generation, tuple(dead)))

    def _pin_shard_layout(self, plan: AdjustmentPlan, failed: int) -> None:
        """A survivor whose shards are not in an uncommitted reshard's old layout holds them in the layout of the
        generation it was in (``failed``): the plan's ``previous_members`` are the newest failed generation's, which
        may be a resize's that this member never learned of (a death in its plan's broadcast)."""
        if self._shard_layout is None and plan.layouts and str(failed) in plan.layouts:
            self._shard_layout = list(plan.layouts[str(failed)])

    def earliest_position(self, position: int | None) -> int | None:
        """After a recovery: publish this survivor's ``position`` (a count of the collectives it made before the
        training loop; None: it made none of the others', it joined) in the new generation and return the earliest of
        every survivor's (the plan's stayers); :class:`PeerFailure` if the generation fails meanwhile."""
        plan = self._recovered_plan
        assert plan is not None and self.generation == plan.generation
        store = self._group().store
        prefix = f"{generation_prefix(plan.generation)}{PRE_LOOP_POSITION_KEY}"
        store.set(f"{prefix}{self.worker_id}", "" if position is None else str(position))
        if position is None:
            return None
        positions = [position]
        for survivor in plan.stayers:
            if survivor != self.worker_id:
                self._await_key(store, f"{prefix}{survivor}", survivor)
                published = store.get(f"{prefix}{survivor}").decode()
                positions.extend([int(published)] if published else [])
        return min(positions)

    def _recovery_plan_for(self, failed: int, committed_step: int) -> AdjustmentPlan:
        reply = self._require_link().recover(failed, committed_step, self.join_timeout_s,
                                             before_loop=self._evaluating or not self._in_training_loop)
        if reply.declared_dead:
            self._end_declared_dead(reply.reason)
        if reply.plan is None and self._leave_queued_here():
            self._leave_cut_by_a_death(failed, reply.reason)
        if reply.plan is None:
            raise RuntimeError(f"worker {self.worker_id} cannot recover from the failure of generation {failed}: "
                               f"{reply.reason}")
        return reply.plan

    def _end_declared_dead(self, reason: str | None) -> NoReturn:
        """The AM declared this worker dead while it could not answer (its host paused or cut off): the job went on
        without it and its state is behind. The process ends (exit 1) with that line, not a traceback; ``SystemExit``
        lets the framework tear down on its way out (Lightning runs its ``on_exception`` hooks)."""
        log.error("%s: this process ends", reason or f"worker {self.worker_id} was declared dead by the job's AM")
        raise SystemExit(DECLARED_DEAD_EXIT)

    def _leave_cut_by_a_death(self, failed: int, reason: str | None) -> NoReturn:
        """A leaver whose leave was agreed and then cut short by a member's death (before it learned of the plan, in
        the agreement's broadcast): the survivors recover without it, so it leaves at the step every member committed
        (no report: its plan failed)."""
        log.warning("worker %s leaves the job: a member died before its leave was carried out (generation %d "
                    "failed; %s)", self.worker_id, failed, reason or "not in the recovery")
        self._step_out()

    def _confirm_peer_failure(self, error: BaseException, generation: int | None = None) -> None:
        """Return once a member's death in this worker's generation (or ``generation``: a leaver's live reshard is in
        the plan's) is confirmed, else re-raise ``error``."""
        if isinstance(error, PeerFailure):
            return  # raised because the watch saw a generation fail (one being formed, too)
        own = self._own_failure()
        if own is not None:
            raise own from error  # the generation failed by this process's own decision, not by a death
        if self._watch is None or not (self._peer_failed_in(generation) or may_be_a_peers_death(error)):
            raise error  # the process's own error (a bug, an out-of-memory...), raised outside any communication
        stalled = not self._peer_failed_in(generation) and is_a_collective_timeout(error)
        failed = self._declare_stall(error, generation) if stalled else []
        if failed:
            if self.peer_failure_within(FAILURE_NOTICE_S, generation, also=failed):  # the keys are set: seen soon
                return
            raise error
        if self.peer_failure_within(FAILURE_NOTICE_WARNING_S, generation):
            return
        log.warning("worker %s: a collective failed (%s: %s) and the AM has not said that a member died; waiting up "
                    "to %.0f s for it before taking the error as this process's own", self.worker_id,
                    type(error).__name__, str(error)[:200], FAILURE_NOTICE_S)
        if not self.peer_failure_within(FAILURE_NOTICE_S - FAILURE_NOTICE_WARNING_S, generation):
            raise error

    def _declare_stall(self, error: BaseException, generation: int | None) -> list[int]:
        """A collective timed out: a member stopped answering (frozen, or hung outside the collective), where a dead
        one would have failed it at once. Ask the AM to fail the generation and set its failure keys, so every member
        that answers recovers without the silent one (the AM declares it dead when it does not check in, and its
        launcher kills it). Returns the generations the AM failed (empty: it did not)."""
        failed = self.generation if generation is None else generation
        if self._link is None or self.group is None or failed is None:
            return []
        waited_s = self.timeout.total_seconds()
        log.warning("worker %s: a collective of generation %d timed out (%s); asking the AM to fail the generation "
                    "without the member that stopped answering", self.worker_id, failed, str(error)[:200])
        generations = self._link.report_stalled(failed, waited_s, f"{type(error).__name__}: {error}")
        for each in generations:
            self.group.store.set(failure_key(each), f"stalled:{self.worker_id}")
        return generations

    def _peer_failed_in(self, generation: int | None) -> bool:
        if generation is None or generation == self.generation:
            return self.peer_failed
        return self._watch is not None and self._watch.failed(generation)

    def _own_failure(self) -> BaseException | None:
        """What this process failed its generation's collectives with itself (a front-end's decision, e.g. a joiner
        training past the loop's end), rather than a peer's death the watch saw: the collective's error, wrapped by
        torch's future or the autograd engine, stands for it."""
        failure = None if self.group is None else self.group.failure
        return None if failure is None or isinstance(failure, PeerFailure) else failure

    def peer_failure_within(self, seconds: float, generation: int | None = None, also: Sequence[int] = ()) -> bool:
        """Whether the AM says, within ``seconds``, that a member of this worker's generation (or ``generation``)
        died, or that one of the generations ``also`` failed (those a stall this worker reported failed; the watch
        watches one: the current generation, or the one a plan forms)."""
        deadline = time.monotonic() + seconds
        while not (self._peer_failed_in(generation) or any(self._watch.failed(each) for each in also)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _on_generation_failed(self, generation: int) -> None:
        """The watch thread: release every collective of the failed generation (it raises :class:`PeerFailure`)."""
        if self.group is not None:
            self.group.fail(generation_prefix(generation), PeerFailure(generation))

    def _generation_formed(self) -> None:
        """A generation was entered: watch it for failures and vote on its steps."""
        group = self._group()
        self._compute.reset()
        self._state_size.new_generation()
        if self._watch is not None:
            self._watch.watch(self.generation)
            store = self._vote_store()
            self._vote = CommitVote(store, self.generation or 0, group.rank(), group.size(), lambda: self.peer_failed,
                                    hosted_by_rank_0=store is not group.store, timeout=self.timeout)

    def _vote_store(self) -> dist.Store:
        """Where this generation's commit votes go: the job store when it is a ``TCPStore`` (served by ``elan run``
        or the AM, which outlive the workers); with an etcd job store a *fast store* of the generation — a
        ``TCPStore`` served by its rank 0 on the address its gloo binds, published under the generation's prefix —
        so a step costs no etcd round trip and goes on while etcd does not answer."""
        group = self._group()
        store = group.store
        self._vote_server = None  # the previous generation's: every member is past its last vote
        if group.size() == 1 or isinstance(store, (dist.TCPStore, dist.HashStore)):
            return store
        key = f"{generation_prefix(self.generation or 0)}{VOTE_STORE_KEY}"
        if group.rank() == 0:
            host = collective_address()
            # torch's classic store server, not libuv's: ``~LibUVStoreDaemon`` joins its loop thread only while
            # ``is_running()``, else the thread object is destroyed joinable and the process aborts ("terminate called
            # without an active exception"), which a vote store's host did once at exit in CI (the suspected cause);
            # ``~TCPStoreMasterDaemon`` always joins
            self._vote_server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout,
                                              use_libuv=False)
            store.set(key, f"{host}:{self._vote_server.port}")
            log.debug("generation %s votes in the fast store %s:%d", self.generation, host, self._vote_server.port)
            return self._vote_server
        self._await_key(store, key)
        host, _, port = store.get(key).decode().rpartition(":")
        return dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout, wait_for_workers=False)

    def training_loop_started(self) -> None:
        """This member entered its training loop: the job is past its collectives before the loop."""
        self._in_training_loop = True
        if self.is_member and self.group is not None and not self.environment.standalone:
            store = self.group.store
            self._chores.submit("the training loop's start", lambda: store.set(LOOP_STARTED_KEY, "1"))

    def wait_for_training_loop(self) -> None:
        """A joiner not admitted yet, in a barrier of the code before its training loop: the members made that barrier
        (or will) before their loop, behind which the main process prepares what every process reads next; wait until
        they are in their loop (at once once they are: a joiner is admitted only at a batch boundary)."""
        if self.is_member or self.has_left or self.group is None or self.environment.standalone:
            return
        store, notice = self.group.store, 0.0
        while not store.check([LOOP_STARTED_KEY]):
            if time.monotonic() >= notice:
                log.info("worker %s waits in a barrier before its training loop until the job's members are in "
                         "theirs", self.worker_id)
                notice = time.monotonic() + LOOP_WAIT_NOTICE_S
            time.sleep(0.1)

    def follow_epoch_order(self, order: EpochOrder) -> None:
        """The training loader's epoch order: a user sampler's order travels to joiners with the data position (a
        joiner's loader made before its state arrived takes it now, a later one at once)."""
        self._epoch_order = order
        order.load_state_dict(self._received_order)
        self._received_order = None  # once: a loader made again later (reloaded each epoch) keeps its own order

    def next_start_result_name(self, kind: str) -> str:
        """The name of this process's next start result of ``kind``: the n-th of the script in every process."""
        self._start_results += 1
        return f"{kind}/{self._start_results - 1}"

    def publish_start_result(self, name: str, value: str | bytes) -> None:
        """Rank 0 of the launch generation: what the script's start computed (see :meth:`start_result`)."""
        if self.group is not None and not self.environment.standalone:
            self.group.store.set(START_RESULT_PREFIX + name, value)

    def published_start_result(self, name: str) -> bytes | None:
        """A start result rank 0 published, if it did (no wait)."""
        if self.group is None or self.environment.standalone:
            return None
        key = START_RESULT_PREFIX + name
        return self.group.store.get(key) if self.group.store.check([key]) else None

    def start_result(self, name: str) -> str:
        """A joiner: the launch members' result of a step of the script's start that ran before their training loop
        (it cannot run it with them); waits until rank 0 publishes it."""
        assert self.group is not None, "start() first"
        store, key, notice = self.group.store, START_RESULT_PREFIX + name, 0.0
        while not store.check([key]):
            if time.monotonic() >= notice:
                log.info("worker %s waits for the job's members to publish their %s", self.worker_id, name)
                notice = time.monotonic() + LOOP_WAIT_NOTICE_S
            time.sleep(0.1)
        return store.get(key).decode()

    def _await_key(self, store: dist.Store, key: str, publisher: str = "rank 0") -> None:
        """Wait for ``key`` (rank 0 sets the vote store's right after the group's rendezvous); :class:`PeerFailure`
        if the generation fails first."""
        pause = 0.001
        while not store.check([key]):
            if self.peer_failed:
                raise PeerFailure(self.generation or 0, f"{publisher} died before it published {key}")
            time.sleep(pause)
            pause = min(0.05, pause * 2)

    def _abandon_outgoing(self) -> None:
        """Transfers to joiners of a failed generation: no waiting for readers that may be dead."""
        outgoing, self._outgoing = self._outgoing, None
        if outgoing is not None:
            outgoing.close()

    def take_global_batch(self, epoch_end: int, opens_step: bool = True) -> LocalShare:
        """Advance the serial position by one global batch; return this rank's share of it.

        ``opens_step``: this batch is the first of its optimizer step. A micro-batch that continues a step being
        accumulated passes False, so a failure before the step's commit rewinds to the step's first micro-batch.
        """
        self._leave_in_vote = None
        self._recovered_at = None
        if self._vote is not None and (opens_step or self._uncommitted is None):
            self._uncommitted = self.data.state_dict()
        self._epoch_end = epoch_end
        self._compute.batch_started(time.perf_counter(), blocked_seconds())
        return self.data.advance(epoch_end, self.world_size, self.rank)

    def backward_started(self) -> None:
        """The front-end starts the backward pass of the batch taken last: its forward pass was compute."""
        self._compute.backward_started(time.perf_counter(), blocked_seconds())

    # ------------------------------------------------------------------ batch boundaries

    def at_batch_boundary(self, step: int, after_recovery: Callable[[], None] = lambda: None) -> None:
        """After the last hook of a trained batch (``step`` optimizer steps done): report, coordinate, adjust.

        A member's death noticed here (in a transfer, the agreement or the adjustment) leaves the step committed:
        the survivors recover from it, and ``after_recovery`` runs (the front-end replays the collectives it made
        since the batch stood with survivors behind). A boundary whose step a recovery already ended (the death was
        met in the batch's hooks, by this member or another) does not coordinate: survivors that met it here did not,
        so none does, and the next boundary coordinates.
        """
        self._boundary_started = time.perf_counter()
        try:
            self._record_aggregates(step)
            self._finish_outgoing()
            pause = self._timeline.step_ended()
            if pause is not None and self._pending_report is not None:
                self._send_report(pause, step)
            self._send_stats_if_due(step)
            self._publish_state_size()
            self._prepare_send_at_first_step()
            if self.peer_failed:
                raise PeerFailure(self.generation or 0)
            if self._recovered_at == step:
                self._deferred = True
            elif self._link is not None:
                self._coordinate_if_due(step)
        except Exception as error:
            if self.has_left or isinstance(error, NotAMember):
                raise  # the front-end's way out of its loop for a leaver
            self._confirm_peer_failure(error)
            self.recover(step)
            after_recovery()

    def _record_aggregates(self, step: int, before_vote: bool = False) -> None:
        """Every member where its ``step`` stands (entering a generation, at a batch boundary) and before the vote on
        it: its epoch aggregates so far, in the generation's vote store, for the heir should it leave or die."""
        if self._aggregates is None or self._vote is None or not self.is_member:
            return
        record = self._aggregates.record_before_vote if before_vote else self._aggregates.record
        record(self._vote.store, self.generation or 0, step, self.data.epoch)

    def _take_aggregates(self, plan: AdjustmentPlan, departed: list[str], store: dist.Store | None, step: int,
                         generations: Sequence[int] = (),
                         inherited: Mapping[str, list[Inheritance]] | None = None) -> None:
        """The heir of ``plan``: add the departed members' epoch aggregates of the previous generation (or of the
        newest of ``generations`` holding any; with the parts they took as heirs and hold no record of) to its own."""
        if self._aggregates is not None:
            self._aggregates.take(plan, departed, store, step, self.data.epoch, generations, inherited or {})

    def _aggregate_store(self) -> dist.Store | None:
        """Where the current generation's members record their epoch aggregates: its vote store."""
        return self._vote.store if self._vote is not None else None

    def _publish_state_size(self) -> None:
        """Rank 0: what a joiner will receive beyond its model, in the job store as soon as the optimizer has state
        (the first boundary of each generation, or the next ones while it is 0), so that a joiner ready before the
        first coordination faults its memory in before it, not in the pause."""
        if self.is_member and self._link is not None and self.rank == 0:
            self._state_size.publish_if_due(self._group().store, self.frontend.state_nbytes_beyond_model,
                                            self._chores)

    def _prepare_send_at_first_step(self) -> None:
        """A member that learned at its start that joiners are coming: prepare its send path after its first step
        (the state exists), before the first coordination, which may already bring them in."""
        if self._send_ahead.joiners_coming_at_start and self.is_member and self._may_send_ahead():
            self._send_ahead.joiners_coming_at_start = False
            self._send_ahead.at_coordination(True, self.frontend.state_nbytes)

    def _may_send_ahead(self) -> bool:
        return self.device.type == "cpu" or self._send_ahead.mode == "always"

    def _send_stats_if_due(self, step: int) -> None:
        """Every few seconds: this member's compute time per step to the AM (queued, sent off this thread)."""
        self._compute.step_done(step)
        measured = self._compute.take_due(time.monotonic())
        if measured is None or self._link is None or self.generation is None or not self.is_member:
            return
        steps, compute_s = measured
        self._link.send_stats(WorkerStats(self.worker_id, self.generation, step, steps, compute_s))

    def remaining_samples(self) -> int | None:
        """Samples left to train when the front-end knows its number of epochs (else None)."""
        epochs = getattr(self._frontend, "max_epochs", None)
        data, epoch_end = self.data, self._epoch_end
        if not isinstance(epochs, int) or epochs < 0 or epoch_end is None or data.epoch is None:
            return None
        return max(0, (epochs - data.epoch - 1) * epoch_end + epoch_end - (data.position or 0))

    def _coordinate_if_due(self, step: int) -> None:
        if not (self._deferred or step % self.coordinate_every == 0 or self._leave_requested()):
            return
        code, decision = self._agree(step)
        self._deferred = code == _DEFERRED
        self._delete_finished_keys()
        if decision is not None:
            self._adjust(decision, step)
        elif code != _DEFERRED and self._may_send_ahead():
            self._send_ahead.at_coordination(code == _PREPARE, self.frontend.state_nbytes)

    def _leave_requested(self) -> bool:
        """Whether a rank's SIGTERM leave is queued at the AM (then rank 0 coordinates now): carried by the step's
        commit vote under ``elan run``; a batch without a vote (gradient accumulation, a front-end that does not vote)
        asks with one int32 all-reduce (``elastic/termination.py``)."""
        if self._leave_in_vote is not None:  # the step's commit vote carried it: no collective needed
            return self._leave_in_vote
        return any_rank_leaving(self._group(), self._leave_queued_here(), self._collective_device())

    def _leave_queued_here(self) -> bool:
        return self._termination is not None and self._termination.leave_queued and self.is_member

    @property
    def sigterm_handler(self) -> Any:
        """The SIGTERM handler this worker installed when it started in an ``elan run`` job, else None."""
        watch = self._termination
        return watch.handle if watch is not None and watch.installed else None

    def _agree(self, step: int) -> tuple[int, _Adjust | None]:
        """Rank 0 asks the AM; one int32 broadcast tells every rank, the plan follows only when there is one."""
        code, decision = (self._ask_master(step) if self.rank == 0 else (_NO_CHANGE, None))
        group = self._group()
        flag = torch.tensor([code], dtype=torch.int32, device=self._collective_device())
        dist.broadcast(flag, src=0, group=group)
        code = int(flag.item())
        if code != _ADJUST:
            return code, None
        return code, _Adjust.from_dict(broadcast_json(None if decision is None else decision.to_dict(), group,
                                                       self._collective_device()))

    def _ask_master(self, step: int) -> tuple[int, _Adjust | None]:
        blocker = self.frontend.adjustment_blocker()
        if blocker is not None:
            log.debug("no adjustment after step %d: %s", step, blocker)
            return _DEFERRED, None
        assert self.generation is not None
        request = CoordinateRequest(
            self.worker_id, self.generation, step, epoch=self.data.epoch, position=self.data.position,
            global_batch=self.data.global_batch, scaling=self._scaling.summary_if_due(),
            remaining_samples=self.remaining_samples(),
            live_reshard=isinstance(self.frontend, LiveResharding) or None,
        )
        link = self._require_link()
        reply = link.coordinate(request)
        plan = reply.plan
        if plan is None and link.unanswered:
            return _DEFERRED, None  # the AM may have decided on the unanswered request: ask at the next step
        if plan is None:
            return (_PREPARE if reply.joiners_coming else _NO_CHANGE), None
        scaling = self._scaling.decide(self.world_size, plan.world_size, self.data.global_batch)
        return _ADJUST, _Adjust(plan, self.frontend.shared_state(), scaling)

    # ------------------------------------------------------------------ the adjustment sequence (old members)

    def _adjust(self, decision: _Adjust, step: int) -> None:
        """Stayers re-form and rewire, sources send the state, leavers leave."""
        plan, started = decision.plan, time.perf_counter()
        phases = PhaseClock(since=self._boundary_started)
        phases.mark("agree")  # since the batch boundary began: reports, the coordination, the plan's broadcast
        self._timeline.adjustment_started()
        self.frontend.adopt_shared_state(decision.shared)
        self._shard_layout = self._shard_layout or list(plan.previous_members)  # until the live reshard commits
        self._take_aggregates(plan, plan.leavers, self._aggregate_store(), step)
        self._scaling.apply(self.data, decision.scaling)  # before the snapshot: joiners inherit batch and LR ramp
        snapshot = self._snapshot() if plan.joiners_served_by(self.worker_id) else None
        phases.mark("snapshot")
        self.frontend.before_resize()
        staying = self.worker_id in plan.members
        if staying:
            self._enter(plan)
        else:
            self._group().shutdown()
            if self._watch is not None:
                self._watch.watch(plan.generation)  # a death in the live reshard it takes part in fails that one
        phases.mark("group")
        sent = self._send(plan, snapshot) if snapshot is not None else 0
        phases.mark("send")
        try:
            self._reshard_live(plan)
        except ReshardAbandoned:
            if staying:
                raise
            self._leave_abandoned(plan, step)
            return
        if not staying:
            self._leave(plan, sent, time.perf_counter() - started)
        self.frontend.after_resize()
        phases.mark("rewire")
        log.info("worker %s in generation %d after %s", self.worker_id, plan.generation, phases)
        self._pending_report = AdjustmentReport(self.worker_id, plan.generation, "stayer", bytes_sent=sent)

    def _enter(self, plan: AdjustmentPlan) -> None:
        previous = self.rank if self.is_member else None
        if self._watch is not None:
            self._watch.watch(plan.generation)  # before it is formed: a member that dies meanwhile fails it
        self._group().configure(generation_prefix(plan.generation), plan.rank_of(self.worker_id), plan.world_size)
        self.generation = plan.generation
        self._keys_to_delete = generation_prefix(plan.previous_generation)
        self._generation_formed()
        if previous is not None and self._in_training_loop:  # a joiner starts empty: nothing to record yet
            self._record_aggregates(plan.step)
        self.frontend.membership_changed(previous)

    def _leave_abandoned(self, plan: AdjustmentPlan, step: int) -> None:
        """A leaver whose live reshard a member's death abandoned: the survivors recover without it, from the old
        layout, in which it still holds its shard and its mirror: it is a leaver of the recovery plan and gives them in
        the recovery's reshard (a shard whose mirror died with a stayer comes from it), then leaves; it leaves at once
        when the recovery plan does not list it."""
        log.warning("worker %s leaves the job: a member died in the live reshard of generation %d", self.worker_id,
                    plan.generation)
        self._abandon_outgoing()
        started, failed = time.perf_counter(), plan.generation
        while (recovery := self._recovery_leaving(failed, step)) is not None:
            try:
                self._hand_over(recovery)
            except ReshardAbandoned:  # another death in the recovery's reshard: the next recovery, same old layout
                failed = recovery.generation
                continue
            self._leave(recovery, 0, time.perf_counter() - started)
            return
        self._step_out()  # not in the recovery plan: it leaves without a report (its plan failed)

    def _recovery_leaving(self, failed: int, step: int) -> AdjustmentPlan | None:
        """The recovery plan from the failure of ``failed`` if it lists this worker as a leaver (else None)."""
        reply = self._require_link().recover(failed, step, self.join_timeout_s)
        if reply.plan is None or self.worker_id not in reply.plan.leavers:
            log.warning("worker %s is not in the recovery from the failure of generation %d (%s)", self.worker_id,
                        failed, reply.reason or "another plan")
            return None
        return reply.plan

    def _hand_over(self, recovery: AdjustmentPlan) -> None:
        """A leaver's part in a recovery's live reshard: its old shard (and a dead ward's from its mirror) to the
        survivors."""
        log.warning("worker %s gives its shard to the recovery into generation %d before it leaves", self.worker_id,
                    recovery.generation)
        if self._watch is not None:
            self._watch.watch(recovery.generation)  # a death in the recovery's reshard fails that one
        self.frontend.before_resize()
        self._reshard_live(recovery)

    def _leave(self, plan: AdjustmentPlan, sent: int, elapsed: float) -> None:
        self._finish_outgoing()
        log.info("worker %s leaves the job at generation %d", self.worker_id, plan.generation)
        report = AdjustmentReport(self.worker_id, plan.generation, "leaver", pause_s=elapsed, bytes_sent=sent)
        self._require_link().report(report, wait=True)
        self._step_out()

    def _step_out(self) -> NoReturn:
        """Out of the job: the front-end ends its training loop as a leaver's (after :func:`step_aside`)."""
        self.has_left = True
        self._group().go_alone()  # the collectives it still makes involve it alone
        step_aside()
        self.frontend.leave()

    # ------------------------------------------------------------------ state replication

    def _reshard_live(self, plan: AdjustmentPlan) -> None:
        """A sharded front-end (``LiveResharding``: elan_fsdp) moves its shards, old members and joiners together, on
        a side group failed with the plan's generation; a death before every participant had its new shard abandons
        it, and the next reshard (the recovery's) starts from the layout it started from (``_shard_layout``: set from
        the adjustment's start — a death while the generation forms or the state is sent leaves the shards there too —
        until a reshard commits; a joiner takes its source's)."""
        group, generation = self._group(), plan.generation
        try:
            reshard_live(self.frontend, plan, self.worker_id, group.store, self.backend, self.timeout,
                         side_group=lambda connect: group.side_group(generation_prefix(generation), connect),
                         failed=lambda: self._watch is not None and self._watch.failed(generation),
                         confirm=lambda error: self._confirm_peer_failure(error, generation),
                         layout=self._shard_layout)
        except ReshardAbandoned as abandoned:
            self._shard_layout = abandoned.layout
            raise
        except Exception:  # after the reshard committed (the new mirror's seed), or this process's own error
            self._shard_layout = None
            raise
        self._shard_layout = None

    def _snapshot(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        skeleton, tensors = split_tensors(self.frontend.training_state())
        order = None if self._epoch_order is None else self._epoch_order.state_dict()
        engine = {"data": self.data.state_dict(), "rng": rng_state(), "order": order,
                  "launch_world_size": self.launch_world_size, "shard_layout": self._shard_layout}
        return {"frontend": skeleton, "engine": engine}, tensors

    def _send(self, plan: AdjustmentPlan, snapshot: tuple[dict[str, Any], list[torch.Tensor]]) -> int:
        cpu_state, tensors = snapshot
        outgoing = send_replica(self._replication_context(plan), plan, self.worker_id, cpu_state, tensors)
        routes = "; ".join(f"{transport}: {', '.join(names)}" for transport, names in outgoing.joiners.items())
        log.info("worker %s sent %.1f MB of state (%s)", self.worker_id, outgoing.bytes_sent / 1e6, routes)
        self._outgoing = outgoing
        return outgoing.bytes_sent

    def _receive(self, plan: AdjustmentPlan) -> tuple[dict[str, Any], Received, str]:
        into = ReceiveInto(lambda cpu_state: self.frontend.receive_destinations(cpu_state["frontend"]), self._spare)
        got, transport = receive_replica(self._replication_context(plan), plan, self.worker_id, self._device_for, into)
        cpu_state = got.cpu_state
        log.info("worker %s received %.1f MB of state from %s over %s (%.1f MB into its own tensors, the rest into %s "
                 "memory)", self.worker_id, got.nbytes / 1e6, plan.sources[self.worker_id], transport,
                 got.in_place / 1e6, "prefaulted" if got.prefaulted else "new")
        self.data.load_state_dict(cpu_state["engine"]["data"])
        set_rng_state(cpu_state["engine"]["rng"])
        self._received_order = cpu_state["engine"].get("order")
        self.launch_world_size = cpu_state["engine"].get("launch_world_size") or self.launch_world_size
        self._shard_layout = cpu_state["engine"].get("shard_layout")  # the layout its source's shards are in
        if self._epoch_order is not None:
            self.follow_epoch_order(self._epoch_order)
        return join_tensors(cpu_state["frontend"], got.tensors), got, transport

    def _fault_in_spare(self) -> None:
        """A CPU joiner that may be served through shared memory: fault in room for the state beyond its model while
        it waits for its adjustment."""
        if self.device.type == "cpu" and self.replication != "collective" and self._spare is None:
            self._spare = fault_in_for_joiner(self._group().store)

    def _finish_outgoing(self) -> None:
        """Same-host joiners copy while this source trains on; before its next adjustment (or exit) they are done."""
        if self._outgoing is not None:
            outgoing, self._outgoing = self._outgoing, None
            outgoing.finish(self.timeout)

    def _replication_context(self, plan: AdjustmentPlan) -> ReplicationContext:
        prefix = f"{generation_prefix(plan.generation)}transfer"
        generation = plan.generation
        return ReplicationContext(self._group().store, prefix, self.backend, self.timeout, self.device,
                                  lambda: self._watch is not None and self._watch.failed(generation),
                                  self._send_ahead.segment)

    def _device_for(self, device_type: str) -> torch.device:
        return torch.device("cpu") if device_type == "cpu" else self.device

    def _delete_finished_keys(self) -> None:
        """Rank 0, at the first coordination of a generation: the keys that formed the generation before it go.

        Every member passed the agreement, so every stayer source finished; the previous adjustment's leavers
        finished a whole generation ago. At most two generations' keys live in the store.
        """
        prefix, self._keys_to_delete = self._keys_to_delete, None
        if prefix is None or self.rank != 0:
            return
        store = self._group().store
        self._chores.submit(f"deleting the keys under {prefix}", lambda: _delete_generation_keys(store, prefix))

    # ------------------------------------------------------------------ reports

    def _send_report(self, pause: float, step: int) -> None:
        """The first step after an adjustment is over: its pause, start-up time, global batch and scaling decision."""
        assert self._pending_report is not None
        startup = time.time() - self.environment.spawn_time if self._pending_report.role == "joiner" else None
        report = replace(self._pending_report, pause_s=pause, startup_s=startup, global_batch=self.data.global_batch,
                         scaling=self._scaling.last_decision(), step=step)
        self._require_link().report(report)
        self._pending_report = None

    # ------------------------------------------------------------------ plumbing

    def training_ended(self, step: int) -> None:
        """This member's training loop ended having trained the job's last step (``step`` steps): once every member has
        exited, a death from here on is a death after the job's training (the launcher ends the job as finished)."""
        self.training_fits += 1
        if self.environment.standalone or self.has_left or self.group is None:
            return
        self._report_an_adjustment_after_the_last_step(step)
        mark_training_ended(self.group.store, self.worker_id)

    def _report_an_adjustment_after_the_last_step(self, step: int) -> None:
        """An adjustment no batch boundary followed (a recovery from a death at the last epoch's end, after its last
        step) is reported as the loop ends: the AM then records it, and the new generation is the job's."""
        if self._pending_report is None or self._link is None:
            return
        pause = self._timeline.step_ended()
        self._send_report(0.0 if pause is None else pause, step)

    def start_later_fit(self, epoch: int) -> None:
        """A member starts a training fit after the one it finished (a script that trains in stages): the data
        starts ``epoch`` afresh, its global batch from the new loader. Only the first fit is elastic: the AM link
        closed at its end, so this one trains on the current members, without adjustments."""
        self.data = DataPosition(epoch=epoch, global_batch=self._configured_global_batch)
        log.warning("worker %s starts a training fit after its first: the job changes size only in its first fit, "
                    "so this one trains on the job's %d current workers without adjustments (a member's death "
                    "fails the job)", self.worker_id, self.world_size)

    def close(self) -> None:
        """The training loop is over: same-host joiners finish copying, the AM link closes (the group stays, and so
        does the failure watch: a member's death still releases the others' collectives after the loop — Accelerate's
        ``wait_for_everyone`` before the main process saves, ``trainer.test`` — instead of leaving them to gloo's
        timeout)."""
        self._finish_outgoing()
        self._send_ahead.close()
        self._chores.drain(CHORES_DRAIN_S)
        if self._termination is not None:
            self._termination.disarm()
        if self._link is not None:
            self._link.close()
            self._link = None

    def shutdown(self) -> None:
        """Leave the job's group for good: torch's default group is destroyed (a later ``start`` installs anew)."""
        self.close()
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self.group is not None:
            uninstall_default_group(self.group)
        self.group, self.generation = None, None
        global _PROCESS_ENGINE
        if _PROCESS_ENGINE is self:
            _PROCESS_ENGINE = None

    def _connect_store(self) -> dist.Store:
        """Client of the job's long-lived rendezvous store (a TCPStore, or etcd with standby AMs), or an in-process
        store for a standalone run."""
        if self.environment.standalone:
            return dist.HashStore()
        return open_rendezvous_store(self.environment.store_address or "", self.timeout)

    def _topology(self) -> dict[str, Any] | None:
        """Where this worker lives, for the AM's replication planner (None: every transfer over the collective)."""
        if self.replication == "collective":
            return None
        try:
            return detect_topology(self.device).to_dict()
        except Exception as error:  # a probe we did not foresee: replicate over the collective rather than fail
            log.warning("topology detection failed (%s): this worker's transfers go over the collective", error)
            return None

    def _collective_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _group(self) -> ElasticProcessGroup:
        if self.group is None:
            raise RuntimeError("the elastic worker has not started")
        return self.group

    def _require_link(self) -> AMLink:
        if self._link is not None:
            return self._link
        if self.environment.standalone:
            raise RuntimeError("this worker has no application master (standalone run)")
        raise RuntimeError(f"worker {self.worker_id} is past the job's elastic fit (its link to the application "
                           "master closed when its first training fit ended): a later fit of the script cannot "
                           "recover from a member's death or change size")

