"""Adjustments: every transition that changes ``members`` and ``generation`` — generation 0 forms, rank 0's
coordinate decides the head request into a plan (``in_flight``), a worker of the new generation commits it, the
members report it done (``completing``, ``last_adjustment``) — and what a joiner's ``wait_plan`` answers."""

from __future__ import annotations

import logging
from typing import Any

from lightning_elan.master.narration import plural
from lightning_elan.master.state import (
    CANCELLED,
    READY,
    STEP_FROM_COORDINATE,
    STEP_FROM_REPORT,
    Adjustment,
    JobState,
    Member,
    ScaleRequest,
    StateError,
    adjustment_failure,
    named,
    now_or_clock,
    require_non_negative,
)
from lightning_elan.master.transitions import requests, resolving
from lightning_elan.protocol.contract import (
    REPORT_ROLES,
    AdjustmentPlan,
    AdjustmentReport,
    CoordinateReply,
    CoordinateRequest,
    Transfer,
    WaitPlanReply,
    WorkerStats,
    WorkerStatsReply,
    worker_number,
)
from lightning_elan.replication.sources import plan_replication

logger = logging.getLogger(__name__)

__all__ = ["MAX_COMPLETING", "commit_if_new_generation", "coordinate", "form_generation_zero", "report",
           "report_completing", "wait_plan", "worker_stats"]

MAX_COMPLETING = 8  # committed adjustments still waiting for reports; older ones are dropped


def form_generation_zero(state: JobState, members: list[Member]) -> None:
    """The job starts: ``members`` (in rank order) are generation 0."""
    state.members = members
    state.launch_world_size = len(members)


def coordinate(state: JobState, request: CoordinateRequest, now: float | None = None) -> CoordinateReply:
    """Rank 0's periodic question: no decision, or the plan to adjust to; ``request.scaling`` is rank 0's latest
    scaling summary when it sends one (kept until the next)."""
    worker_id, generation = request.worker_id, request.generation
    state.require_started()
    require_non_negative(generation=generation, step=request.step)
    state.require_known(worker_id)
    commit_if_new_generation(state, worker_id, generation, now)
    if generation != state.generation:
        raise StateError(f"generation {generation} is not current (current generation {state.generation})")
    if state.member(worker_id) is None:
        raise StateError(f"worker {worker_id} is not a member of generation {state.generation}")
    if state.progress.is_stale(generation, request.step):
        logger.debug("stale coordinate from %s at step %s (already at %s): ignored", worker_id, request.step,
                     state.progress.step)
        return CoordinateReply.adjust(state.in_flight.plan) if state.in_flight else CoordinateReply.none()
    _note_progress(state, request, now_or_clock(now))
    if state.in_flight is not None:
        return CoordinateReply.adjust(state.in_flight.plan)
    if state.recovery is not None:  # the members are about to learn that the generation failed
        return CoordinateReply.none()
    plan = None if state.finished else _decide_head(state, request.step, now, bool(request.live_reshard))
    return CoordinateReply.none(requests.joiners_coming(state)) if plan is None else CoordinateReply.adjust(plan)


def worker_stats(state: JobState, stats: WorkerStats) -> WorkerStatsReply:
    """A member's compute time per step (informational: feeds the straggler detector); answers the stragglers."""
    if stats.generation != state.generation or state.member(stats.worker_id) is None:
        return WorkerStatsReply([], ignored=True)
    return WorkerStatsReply(state.measured.observe_compute(stats.worker_id, stats.generation, stats.compute_s,
                                                           state.member_ids))


def report(state: JobState, report: AdjustmentReport, now: float | None = None) -> dict[str, Any] | None:
    """Record a worker's report after an adjustment; returns the adjustment record once all members reported.
    ``global_batch`` and ``scaling`` are the global batch and the scaling decision the worker applied."""
    records = report_completing(state, report, now)
    return records[-1] if records else None


def report_completing(state: JobState, report: AdjustmentReport, now: float | None = None) -> list[dict[str, Any]]:
    """:func:`report`, returning every record it completes: a recovery's, once all its members reported, comes after
    the records of the earlier adjustments it cut short (a member died, or recovered, before it reported them)."""
    worker_id, generation = report.worker_id, report.generation
    require_non_negative(generation=generation, step=report.step)
    state.require_known(worker_id)
    if report.role not in REPORT_ROLES:
        raise StateError(f"unknown role {report.role!r} (expected stayer, joiner or leaver)")
    commit_if_new_generation(state, worker_id, generation, now)
    adjustment = _adjustment_to(state, generation)
    if adjustment is None:
        if generation <= state.generation:  # a late duplicate: the adjustment is already recorded
            return []
        raise StateError(f"no adjustment to generation {generation} (current generation {state.generation})")
    if not adjustment.plan.involves(worker_id):
        raise StateError(f"worker {worker_id} is not part of the adjustment to generation {generation}")
    if worker_id in adjustment.reports:  # a duplicate (resent under a new id): the first report stands
        logger.debug("duplicate report of %s for generation %s: ignored", worker_id, generation)
        return []
    adjustment.reports[worker_id] = _stored_report(report, now_or_clock(now))
    if worker_id in adjustment.plan.members and state.member(worker_id) is not None:
        step = adjustment.plan.step if report.step is None else report.step
        state.progress.note_step(worker_id, step, STEP_FROM_REPORT, now_or_clock(now))
    return _complete_if_all_reported(state, adjustment, now)


def wait_plan(state: JobState, worker_id: str) -> WaitPlanReply | None:
    """The answer to a joiner's ``wait_plan``: a plan, a cancellation, or None to keep waiting."""
    dead = declared_dead_answer(state, worker_id)
    if dead is not None:
        return dead
    state.require_known(worker_id)
    recovery = state.recovery
    if recovery is not None and (worker_id in recovery.survivors or worker_id in recovery.leavers):
        return None  # the recovery plan is not formed yet (a leaver of an abandoned live reshard is in it too)
    if state.in_flight is not None and state.in_flight.plan.involves(worker_id):
        return WaitPlanReply.with_plan(state.in_flight.plan)
    if worker_id in state.left_workers:  # before its join plan: a joiner of the current generation may have left
        return WaitPlanReply.cancelled(f"worker {worker_id} has left the job")
    last = state.last_plan
    if last is not None and last.generation == state.generation and worker_id in last.joiners:
        return WaitPlanReply.with_plan(last)  # asked again after its plan was committed
    pending = state.pending_workers.get(worker_id)
    if pending is not None and pending.status == CANCELLED:
        return WaitPlanReply.cancelled(pending.reason or f"worker {worker_id} was cancelled")
    if state.finished:
        return WaitPlanReply.cancelled(f"job finished: {state.finish_reason}")
    return None


def declared_dead_answer(state: JobState, worker_id: str) -> WaitPlanReply | None:
    """The answer to a worker the AM declared dead (it stopped answering, or its host was lost) that speaks again:
    the job went on without it, so its process must end."""
    recovery = state.recovery
    if worker_id in state.declared_dead or (recovery is not None and worker_id in recovery.dead):
        return WaitPlanReply.dead(f"worker {worker_id} was declared dead by the job's AM (it stopped answering: its "
                                  "host lost, paused or cut off, or its process frozen); the job went on without it")
    return None


def commit_if_new_generation(state: JobState, worker_id: str, generation: int, now: float | None) -> None:
    """A member of the in-flight plan's generation has spoken: that generation becomes current."""
    adjustment = state.in_flight
    if adjustment is None or generation != adjustment.plan.generation:
        return
    if worker_id not in adjustment.plan.members:
        return
    _commit(state, adjustment, now)


# ---- deciding --------------------------------------------------------------------------------------------------------


def _note_progress(state: JobState, request: CoordinateRequest, now: float) -> None:
    """Record rank 0's progress (and scaling summary, kept until the next) and the coordinating worker's step."""
    progress = state.progress
    progress.step, progress.epoch, progress.position = request.step, request.epoch, request.position
    progress.global_batch, progress.updated_at, progress.generation = request.global_batch, now, request.generation
    progress.scaling = request.scaling or progress.scaling
    progress.remaining_samples = request.remaining_samples
    progress.note_step(request.worker_id, request.step, STEP_FROM_COORDINATE, now)
    state.measured.observe_coordinate(request.generation, state.world_size, request.step, request.global_batch, now)


def _decide_head(state: JobState, step: int, now: float | None, live_reshard: bool = False) -> AdjustmentPlan | None:
    """Decide the head request if its step has come and, resolved against the members now (``resolving.py``), its
    new workers are ready. ``live_reshard``: the members hold shards (the plan's leavers take part until they
    report)."""
    while state.pending:
        head = state.pending[0]
        if head.at_step is not None and step < head.at_step:
            return None
        try:
            if not resolving.resolve(state, head, now_or_clock(now)):
                continue  # nothing to do: it left the queue
            if any(state.pending_workers[worker].status != READY for worker in head.new_workers):
                return None
            plan = _make_plan(state, head, step)
        except StateError as error:
            requests.fail_request(state, head, str(error))
            continue
        state.pending.pop(0)
        state.in_flight = Adjustment(plan, head.requested_at, head.all_reported_at, decided_at=now_or_clock(now),
                                     cause=head.cause, live_reshard=live_reshard)
        return plan
    return None


def _make_plan(state: JobState, request: ScaleRequest, step: int) -> AdjustmentPlan:
    previous = state.member_ids
    leavers = _leavers(state, request)
    stayers = [worker for worker in previous if worker not in leavers]
    joiners = sorted(request.new_workers, key=worker_number)
    if not stayers and not joiners:
        raise StateError(requests.cannot_remove_all(len(previous)))
    hosts = {worker: state.host_of(worker) for worker in previous + joiners}
    topologies = {worker: state.topology_of(worker) for worker in previous + joiners}
    sources, transfers = plan_replication(stayers, leavers, joiners, topologies)
    routes = None if transfers is None else [Transfer.from_dict(transfer) for transfer in transfers]
    return AdjustmentPlan(
        request_id=request.request_id,
        action=request.action,
        generation=state.generation + 1,
        previous_generation=state.generation,
        step=step,
        members=stayers + joiners,
        previous_members=previous,
        joiners=joiners,
        leavers=leavers,
        sources=sources,
        hosts=hosts,
        transfers=routes,
    )


def _leavers(state: JobState, request: ScaleRequest) -> list[str]:
    """The members a request removes, resolved against the current generation, in rank order."""
    if request.workers is not None:
        return _leaving_members(state, request)
    members = state.member_ids
    if request.ranks is not None:
        for rank in request.ranks:
            if rank >= len(members):
                raise StateError(
                    f"rank {rank} does not exist in generation {state.generation} (world size {len(members)})"
                )
        return [members[rank] for rank in sorted(request.ranks)]
    if request.remove_count > len(members):
        raise StateError(f"cannot remove {request.remove_count} of the {plural(len(members), 'worker')}")
    newest_first = sorted(state.members, key=lambda m: (m.joined_generation, worker_number(m.worker_id)))[::-1]
    leaving = {member.worker_id for member in newest_first[: request.remove_count]}
    return [worker for worker in members if worker in leaving]


def _leaving_members(state: JobState, request: ScaleRequest) -> list[str]:
    """The members a ``leave`` request removes (those still members), in rank order."""
    workers = request.workers or []
    leaving = [worker for worker in state.member_ids if worker in workers]
    if not leaving:
        raise StateError(f"{named(workers)} asked to leave but {'is' if len(workers) == 1 else 'are'} no "
                         f"longer {'a member' if len(workers) == 1 else 'members'}")
    return leaving


# ---- committing and completing ---------------------------------------------------------------------------------------


def _commit(state: JobState, adjustment: Adjustment, now: float | None) -> None:
    plan = adjustment.plan
    old_members = {member.worker_id: member for member in state.members}
    state.members = [old_members.get(worker) or _promote(state, worker, plan.generation) for worker in plan.members]
    state.left_workers.extend(plan.leavers)
    for joiner in plan.joiners:  # it trains: a replacement's chain of failed joins is over
        state.unjoined_replacements.pop(joiner, None)
    state.generation = plan.generation
    adjustment.committed_at = now_or_clock(now)
    state.in_flight = None
    state.last_plan = plan
    state.progress.forget(state.member_ids)
    completing = [*state.completing, adjustment]
    for dropped in completing[:-MAX_COMPLETING]:
        missing = [worker for worker in dropped.plan.members if worker not in dropped.reports]
        state.record_failure(adjustment_failure(
            dropped, dropped.plan.request_id, f"never completed: no report from {', '.join(missing) or 'nobody'}"
        ))
    state.completing = completing[-MAX_COMPLETING:]


def _promote(state: JobState, worker_id: str, generation: int) -> Member:
    pending = state.pending_workers.pop(worker_id)
    return Member(
        worker_id, generation, host=pending.host, device=pending.device, pid=pending.pid, topology=pending.topology
    )


def _adjustment_to(state: JobState, generation: int) -> Adjustment | None:
    if state.in_flight is not None and state.in_flight.plan.generation == generation:
        return state.in_flight
    return next((a for a in state.completing if a.plan.generation == generation), None)


def _complete_if_all_reported(state: JobState, adjustment: Adjustment, now: float | None) -> list[dict[str, Any]]:
    if not adjustment.all_members_reported():
        return []
    records = _complete_cut_short(state, adjustment, now) if adjustment.failure is not None else []
    record = adjustment.record(state.job, now_or_clock(now))
    state.completing.remove(adjustment)
    state.last_adjustment = record
    return [*records, record]


def _complete_cut_short(state: JobState, recovery: Adjustment, now: float | None) -> list[dict[str, Any]]:
    """The committed adjustments before ``recovery`` still waiting for reports: none will come (a dead member sends
    none, a survivor's recovery report replaced its own), so they are recorded with the reports they have."""
    cut_short = [adjustment for adjustment in state.completing
                 if adjustment.committed_at is not None and adjustment.plan.generation < recovery.plan.generation]
    for adjustment in cut_short:
        state.completing.remove(adjustment)
    return [adjustment.record(state.job, now_or_clock(now)) for adjustment in cut_short]


def _stored_report(report: AdjustmentReport, reported_at: float) -> dict[str, Any]:
    """A report as the adjustment keeps it (and persists it): every field but who sent it, plus when it arrived."""
    stored = report.to_body()
    del stored["worker_id"], stored["generation"]
    return {**stored, "reported_at": reported_at}
