"""Worker exits and the recovery from a dead member: every transition that changes ``recovery``, ``exits`` and
``failed_reason`` — an exit is expected or a death that fails the generation; the survivors check in (``recover``),
silent ones are declared dead, and the recovery plan forms (``master/recovery.py`` makes it) or the job fails.
Semantics: docs/architecture.md, *Worker failures*."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from lightning_elan.master.narration import plural, workers_phrase
from lightning_elan.master.recovery import CheckIn, Recovery, recovery_plan
from lightning_elan.master.state import (
    READY,
    Adjustment,
    JobState,
    StateError,
    WorkerExit,
    adjustment_failure,
    now_or_clock,
    require_non_negative,
)
from lightning_elan.master.transitions import adjustments, finishing, requests
from lightning_elan.protocol.contract import (
    ACTION_FAILURE,
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_RECOVERY_TIMEOUT_S,
    RecoverRequest,
    StalledRequest,
    WaitPlanReply,
    WorkerExitReply,
    WorkerExitRequest,
    WorkerPollReply,
    WorkerPollRequest,
)

logger = logging.getLogger(__name__)

FAILED_REPLACEMENTS_LIMIT = 3
"""``--replace-failed`` replaces no more than this many replacements in a row that died before they trained."""

LOST_RETURNCODE = -9
"""The exit recorded for a lost worker (``worker_lost``): dead to the job as if SIGKILLed; its ``elan worker``, if
it comes back, kills its command and reports the real exit."""

__all__ = ["collective_stalled", "declare_silent_survivors_dead", "fail_job", "form_plan_if_ready", "recover",
           "set_failure_policy", "worker_exit", "worker_lost", "worker_poll"]


def worker_exit(state: JobState, request: WorkerExitRequest) -> WorkerExitReply:
    """A worker exited: judge the exit (one the AM waited for, a death to recover from, …), then whether the job is
    done (``finishing``: this may have been the last member to finish)."""
    reply = _judge_exit(state, request)
    finishing.finish_if_done(state)
    return reply


def worker_lost(state: JobState, worker_id: str, silent_s: float) -> WorkerExitReply:
    """The AM has not heard from ``worker_id``'s ``elan worker`` for ``silent_s`` (``master/heartbeats.py``): its host
    is lost, paused or cut off. It is dead to the job (recorded as exited ``LOST_RETURNCODE``, declared dead: killed if
    it comes back); the reply says which generations fail, for the AM to announce."""
    logger.warning("job %s: no word from the `elan worker` of %s for %.0f s (its host lost, paused or cut off): "
                   "declared dead", state.job, worker_id, silent_s)
    if worker_id not in state.declared_dead:
        state.declared_dead.append(worker_id)
    reply = worker_exit(state, WorkerExitRequest(worker_id, LOST_RETURNCODE))
    state.exits[worker_id] = dataclasses.replace(state.exits[worker_id], lost=True)
    return reply


def _judge_exit(state: JobState, request: WorkerExitRequest) -> WorkerExitReply:
    """``expected``: a leaver, a cancelled joiner or (after shutdown) a member, exiting 0; the exit is recorded with
    what the launcher saw of it. A worker already judged (lost, then its exit reported) is only recorded again."""
    worker_id, returncode = request.worker_id, request.returncode
    if worker_id in state.exits and worker_id in state.declared_dead:
        _record_exit(state, request, left=False)
        return WorkerExitReply(expected=False)
    state.require_known(worker_id)
    clean = returncode == 0
    in_flight = state.in_flight
    leaver = worker_id in state.left_workers or (in_flight is not None and worker_id in in_flight.plan.leavers)
    _record_exit(state, request, left=leaver and clean)
    if leaver:
        needed = _reshards_with_the_stayers(state, worker_id)  # even exiting 0: its rows never reached the stayers
        if clean and not needed:
            return WorkerExitReply(expected=True)
        if not _serves_a_joiner(state, worker_id) and not needed:
            return WorkerExitReply(expected=False, left=True)  # killed after it left: the job goes on
        return _member_failed(state, worker_id, returncode, time.time(), replace=False)
    if not clean and not state.finished and _takes_part(state, worker_id):
        if state.training_over():
            logger.warning("member %s exited with code %s after a member of generation %s finished training: "
                           "the job's training is complete", worker_id, returncode, state.generation)
            return WorkerExitReply(expected=True)
        return _member_failed(state, worker_id, returncode, time.time())
    pending = state.pending_workers.get(worker_id)
    if pending is not None:
        return WorkerExitReply(expected=requests.pending_worker_exited(state, pending, returncode))
    if not clean:  # a member (a leaver, a joiner or a standby is answered above)
        logger.warning("member %s of generation %s exited with code %s", worker_id, state.generation, returncode)
    return WorkerExitReply(expected=clean and state.finished)


def _record_exit(state: JobState, request: WorkerExitRequest, left: bool) -> None:
    """Keep how the worker exited (``finishing`` decides from the members' exits whether the job is done; a joiner
    whose exit came before its plan committed is a member then)."""
    state.exits[request.worker_id] = WorkerExit(request.returncode, bool(request.training_ended),
                                                bool(request.script_failed), left)


def recover(state: JobState, request: RecoverRequest, now: float | None = None) -> WaitPlanReply:
    """A survivor of a failed generation checks in; the reply is ``wait_plan``'s (it then long-polls that)."""
    worker_id = request.worker_id
    dead = adjustments.declared_dead_answer(state, worker_id)
    if dead is not None:
        return dead
    state.require_known(worker_id)
    require_non_negative(generation=request.generation, step=request.step)
    recovery = state.recovery
    if recovery is None:
        answer = adjustments.wait_plan(state, worker_id)
        if answer is not None and (answer.plan is None or answer.plan.generation > request.generation):
            return answer  # asked again after the recovery plan was formed, or cancelled
        raise StateError(f"generation {request.generation} has not failed (current generation {state.generation})")
    if request.generation not in recovery.failed_generations:
        raise StateError(f"generation {request.generation} is not one of the failed generations "
                         f"{recovery.failed_generations}")
    if worker_id in recovery.survivors:
        step = request.step if request.has_state else None
        recovery.checked_in[worker_id] = CheckIn(request.has_state, step, now_or_clock(now),
                                                 uncertain=request.has_state and request.uncertain,
                                                 before_loop=request.has_state and request.before_loop)
        form_plan_if_ready(state, now_or_clock(now))
    answer = adjustments.wait_plan(state, worker_id)
    return answer or WaitPlanReply.wait()


def collective_stalled(state: JobState, request: StalledRequest, now: float | None = None) -> WorkerExitReply:
    """A member's collective timed out and nobody was said to have died: a member stopped answering. The generation
    fails as for a death, with every member a survivor; the one that stopped does not check in, and is declared dead
    ``waited_s`` after this (:func:`declare_silent_survivors_dead`: a member silent for as long as a collective may
    take is hung). The generation may be the one a plan in flight forms (a joiner frozen as it joins): the plan fails
    with it. A report of a generation that failed already answers its recovery's generations; an old generation's is
    refused."""
    now = now_or_clock(now)
    state.require_known(request.worker_id)
    require_non_negative(generation=request.generation)
    if request.waited_s <= 0:
        raise StateError(f"waited_s must be > 0, got {request.waited_s}")
    recovery, in_flight = state.recovery, state.in_flight
    if recovery is not None and request.generation in recovery.failed_generations:
        return WorkerExitReply(expected=False, recovering=True, failed_generations=list(recovery.failed_generations))
    if in_flight is not None and in_flight.plan.action == ACTION_FAILURE and request.generation == state.generation:
        return WorkerExitReply(expected=False, recovering=True, failed_generations=[state.generation])  # recovered
    forming = [] if in_flight is None else [in_flight.plan.generation]  # a stall as the plan's generation forms
    if request.generation not in [state.generation, *forming] or recovery is not None or state.finished:
        raise StateError(f"generation {request.generation} is not the current one (generation {state.generation}"
                         f"{', recovering' if recovery is not None else ''}): its stall is over")
    if request.worker_id not in [*state.member_ids, *([] if in_flight is None else in_flight.plan.members)]:
        raise StateError(f"worker {request.worker_id} is not a member of generation {request.generation}")
    logger.warning("worker %s: a collective of generation %s timed out after %.0f s and no member died (%s): a member "
                   "stopped answering; the members that answer recover without it", request.worker_id,
                   request.generation, request.waited_s, _first_line(request.detail))
    recovery = _begin_recovery(state, now)
    recovery.deadline = min(recovery.deadline, now + request.waited_s)
    state.record_failure({"kind": "stall", "outcome": "generation failed", "worker_id": request.worker_id,
                          "reason": f"a collective timed out after {request.waited_s:.0f} s and no member died",
                          "generation": request.generation, "failure_id": recovery.failure_id,
                          "waited_s": request.waited_s, "detail": request.detail}, now)
    return WorkerExitReply(expected=False, recovering=True, failed_generations=list(recovery.failed_generations))


def _first_line(detail: str | None, limit: int = 200) -> str:
    lines = (detail or "").strip().splitlines()
    return lines[0][:limit] if lines else "no detail"


def declare_silent_survivors_dead(state: JobState, now: float) -> list[str]:
    """Survivors that did not check in by the deadline are hung: dead to the job (the launcher stops them). A member
    that has not registered yet is still starting (importing its framework, maybe from a slow shared filesystem, on
    busy cores): it checks in once it has started, and is declared dead only after the job's start-up allowance
    (``join_timeout_s``, as a joiner that never reports ready)."""
    recovery = state.recovery
    if recovery is None or now < recovery.deadline:
        return []
    starting_until = recovery.detected_at + state.join_timeout_s
    silent = [worker for worker in recovery.missing() if _has_started(state, worker) or now >= starting_until]
    for worker in silent:
        logger.warning("worker %s did not check in after the failure %s: declared dead", worker,
                       recovery.failure_id)
        recovery.mark_dead(worker)
    state.declared_dead.extend(silent)
    if silent and not recovery.survivors:
        fail_job(state, f"no survivor checked in after {recovery.failure_id}", now)
    elif silent:
        form_plan_if_ready(state, now)
    return silent


def worker_poll(state: JobState, request: WorkerPollRequest) -> WorkerPollReply:
    """``elan worker`` asks about its command: declared dead (kill it), and whether the job's training is over."""
    worker = request.worker_id
    if not state.is_known(worker) and worker not in state.exits:
        raise StateError(f"worker {worker} is not a worker of job {state.job}")
    return WorkerPollReply(kill=worker in state.declared_dead, training_over=state.training_over())


def _has_started(state: JobState, worker_id: str) -> bool:
    """A member registered (its engine formed its first generation), or a joiner of the interrupted plan."""
    member = state.member(worker_id)
    return member is None or member.pid is not None


def form_plan_if_ready(state: JobState, now: float) -> None:
    """Once every survivor checked in (and enough ready joiners replace the dead), the recovery plan is in flight."""
    recovery = state.recovery
    if recovery is None:
        return
    replacements = _replacements_for(state, recovery, now)
    if replacements is None or recovery.missing():
        return
    _take_replacements(state, replacements)
    workers = [*recovery.checked_in, *replacements]
    try:
        plan = recovery_plan(recovery, state.generation, replacements, {w: state.host_of(w) for w in workers},
                             {w: state.topology_of(w) for w in workers})
    except ValueError as error:
        fail_job(state, str(error), now)
        return
    state.left_workers.extend(w for w in recovery.dead if w not in state.left_workers)
    for worker in recovery.dead:
        state.pending_workers.pop(worker, None)
    failure = {"failure_id": recovery.failure_id, "dead": list(recovery.dead),
               "failed_generations": list(recovery.failed_generations), "detected_at": recovery.detected_at,
               "recovered_at": now, "step_redone": plan.step + 1,
               "outside_training": _outside_training(recovery), "interrupted_request": recovery.interrupted_request}
    checked = max(c.at for c in recovery.checked_in.values())
    state.in_flight = Adjustment(plan, recovery.detected_at, checked, decided_at=now, failure=failure,
                                 live_reshard=bool(recovery.leavers))
    state.recovery = None
    logger.info("job %s recovers from %s (%s died): generation %d will train with %s", state.job,
                recovery.failure_id, workers_phrase(recovery.dead), plan.generation, workers_phrase(plan.members))
    logger.debug("job %s: recovery plan %s: %s", state.job, recovery.failure_id, json.dumps(plan.to_dict()))


def fail_job(state: JobState, reason: str, now: float) -> None:
    """Too few workers are left to go on: the job fails (recorded) and shuts down."""
    logger.error("job %s fails: %s", state.job, reason)
    state.record_failure({"kind": "job", "outcome": "failed", "reason": reason}, now)
    state.failed_reason = reason
    state.recovery = None
    requests.shutdown(state, f"failed: {reason}")


def set_failure_policy(state: JobState, replace_failed: bool, min_workers: int | None,
                       join_timeout_s: float | None) -> None:
    """Whether a dead member is replaced, below how many workers the recovery waits for joiners, and how long."""
    if min_workers is not None and min_workers < 1:
        raise StateError(f"min_workers must be ≥ 1, got {min_workers}")
    if join_timeout_s is not None and join_timeout_s <= 0:
        raise StateError(f"join_timeout_s must be > 0, got {join_timeout_s}")
    state.replace_failed = bool(replace_failed)
    state.min_workers = min_workers or 1
    state.join_timeout_s = float(join_timeout_s or DEFAULT_JOIN_TIMEOUT_S)


def _member_failed(state: JobState, worker_id: str, returncode: int, now: float,
                   replace: bool = True) -> WorkerExitReply:
    """A member (or a joiner of the plan in flight, or a leaver the plan still needs) died: recover without it,
    unless nobody is left (``replace``: a joiner replaces it under ``--replace-failed``; not a leaver's)."""
    logger.warning("worker %s of generation %s died (exit code %s)", worker_id, state.generation, returncode)
    recovery = state.recovery or _begin_recovery(state, now)
    replace = replace and worker_id not in recovery.leavers
    recovery.mark_dead(worker_id)
    state.record_failure({"kind": "worker", "outcome": "died", "worker_id": worker_id, "returncode": returncode,
                          "generation": state.generation, "failure_id": recovery.failure_id}, now)
    if state.replace_failed and replace:
        _queue_replacement(state, worker_id, now)
    if not recovery.survivors:
        fail_job(state, f"every worker of generation {state.generation} died", now)
        return WorkerExitReply(expected=False, recovering=False)
    form_plan_if_ready(state, now)
    return WorkerExitReply(expected=False, recovering=True, failed_generations=list(recovery.failed_generations))


def _begin_recovery(state: JobState, now: float) -> Recovery:
    """Fail the current generation and the plan in flight (its joiners survive without state)."""
    failed, survivors, previous = [state.generation], list(state.member_ids), list(state.member_ids)
    layouts = {str(state.generation): list(state.member_ids)}
    interrupted, dead, leavers = state.in_flight, [], []
    if interrupted is not None:
        dead = list(interrupted.failure["dead"]) if interrupted.failure else []  # a recovery's, not carried out
        plan = interrupted.plan
        failed.append(plan.generation)
        layouts[str(plan.generation)] = list(plan.members)
        # the plan's members: not its leavers, nor members that died before it (a recovery plan in flight)
        survivors = [w for w in survivors if w in plan.members and w not in plan.leavers] + list(plan.joiners)
        leavers = _leavers_holding_shards(state, interrupted)
        untold = _leavers_left_by_the_recovery(state, interrupted)
        previous = list(plan.members) + untold  # the heir takes their epoch aggregates, as the leave's would have
        state.left_workers.extend(w for w in untold if w not in state.left_workers)
        state.record_failure(adjustment_failure(interrupted, plan.request_id, "interrupted by a worker's death"))
        state.in_flight = None
    state.recovery = Recovery(
        failure_id=f"f{state.next_failure}", failed_generations=failed, previous_members=previous,
        survivors=survivors, detected_at=now, deadline=now + DEFAULT_RECOVERY_TIMEOUT_S, dead=dead,
        interrupted_request=None if interrupted is None else interrupted.plan.request_id, leavers=leavers,
        layouts=layouts,
    )
    state.next_failure += 1
    return state.recovery


def _leavers_left_by_the_recovery(state: JobState, interrupted: Adjustment) -> list[str]:
    """The leavers of an interrupted leave (not a live reshard) that had neither reported nor exited: the death may
    have come before they learned of the plan (in its agreement's broadcast). The survivors recover without them, so
    they have left the job: their ``recover`` is answered so (``wait_plan``: cancelled, it has left) and they end as
    leavers, at the step the survivors hold (every member committed it)."""
    if interrupted.live_reshard:
        return []
    untold = [worker for worker in interrupted.plan.leavers
              if worker not in interrupted.reports and worker not in state.exits]
    if untold:
        logger.warning("job %s: a death interrupted adjustment %s: %s %s the job without a report", state.job,
                       interrupted.plan.request_id, workers_phrase(untold), "leaves" if len(untold) == 1 else "leave")
    return untold


def _leavers_holding_shards(state: JobState, interrupted: Adjustment) -> list[str]:
    """The leavers of an interrupted live reshard that still hold their shards (they had not reported, nor exited):
    the recovery's reshard takes their rows from them (a shard whose mirror died with a stayer, too)."""
    if not interrupted.live_reshard:
        return []
    return [worker for worker in interrupted.plan.leavers
            if worker not in interrupted.reports and worker not in state.exits]


def _queue_replacement(state: JobState, dead: str, now: float) -> None:
    """One joiner for the dead member, unless the dead was the last of ``FAILED_REPLACEMENTS_LIMIT`` replacements in a
    row that died before they trained (each in its own join: a joiner that cannot load the job's state, say)."""
    if state.finished:
        return
    chain = state.unjoined_replacements.pop(dead, 0) + 1
    if chain > FAILED_REPLACEMENTS_LIMIT:
        logger.error("job %s: %d replacements in a row died before they trained (the last: %s); --replace-failed "
                     "replaces no more of them, the job trains on with its members (see the workers' logs for why "
                     "they died)", state.job, FAILED_REPLACEMENTS_LIMIT, dead)
        state.record_failure({"kind": "replacement", "outcome": "stopped", "worker_id": dead,
                              "reason": f"{FAILED_REPLACEMENTS_LIMIT} replacements in a row died before they "
                                        "trained"}, now)
        return
    reply = requests.queue_add(state, now, replaces=dead)
    state.unjoined_replacements.update(dict.fromkeys(reply.new_workers, chain))
    logger.info("replacement %s requested (%s)", ", ".join(reply.new_workers), reply.request_id)


def _replacements_for(state: JobState, recovery: Recovery, now: float) -> list[str] | None:
    """Ready joiners (of whole add requests) that bring the world up to ``min_workers`` ([] when not needed); None:
    keep waiting — or, past ``join_timeout_s`` since the death, the job fails (whether or not every survivor
    checked in). [] while a survivor holding the state is before its training loop: a joiner admitted there would
    receive a state the survivors have not set up, and would not make their collectives before the loop; the
    survivors go on below the minimum and the replacement joins at their first batch boundary."""
    needed = state.min_workers - len(recovery.survivors)
    if needed <= 0 or any(check_in.before_loop for check_in in recovery.checked_in.values()):
        return []
    ready: list[str] = []
    for request in state.pending:
        if request.remove_count or request.ranks or not request.new_workers:
            continue
        if all(state.pending_workers[w].status == READY for w in request.new_workers):
            ready += request.new_workers
        if len(ready) >= needed:
            return ready
    if now - recovery.detected_at > state.join_timeout_s:
        fail_job(state, f"{plural(len(recovery.survivors), 'worker')} left after {recovery.failure_id}, fewer than "
                        f"--min-workers {state.min_workers}, and no joiner came within {state.join_timeout_s:.0f} s",
                 now)
        return None
    if not recovery.waiting_logged:
        recovery.waiting_logged = True
        logger.warning("job %s: %s left, below --min-workers %d: waiting up to %.0f s for joiners",
                       state.job, plural(len(recovery.survivors), "worker"), state.min_workers, state.join_timeout_s)
    return None


def _take_replacements(state: JobState, replacements: list[str]) -> None:
    """The requests whose joiners replace the dead leave the queue — but a ``to N`` stays without them: it is
    resolved again against the members when it is decided (``resolving.py``), and starts what it then lacks."""
    kept = []
    for request in state.pending:
        if request.action == "to":
            request.new_workers = [worker for worker in request.new_workers if worker not in replacements]
        if request.action == "to" or not set(request.new_workers) & set(replacements):
            kept.append(request)
    state.pending = kept


def _serves_a_joiner(state: JobState, worker_id: str) -> bool:
    """A leaver of the plan in flight that is a joiner's replication source (a migration): its joiner needs it."""
    return state.in_flight is not None and worker_id in state.in_flight.plan.sources.values()


def _reshards_with_the_stayers(state: JobState, worker_id: str) -> bool:
    """A leaver of the plan in flight whose members hold shards (a live reshard, elan_fsdp) and that has not reported:
    its rows may not have reached the stayers yet, so they wait for it in the reshard."""
    in_flight = state.in_flight
    return in_flight is not None and in_flight.live_reshard and worker_id in in_flight.plan.leavers and \
        worker_id not in in_flight.reports


def _takes_part(state: JobState, worker_id: str) -> bool:
    """A member, a joiner of the plan in flight, or a survivor of the failure being recovered."""
    if state.member(worker_id) is not None:
        return True
    if state.in_flight is not None and worker_id in state.in_flight.plan.members:
        return True
    return state.recovery is not None and worker_id in state.recovery.survivors


def _outside_training(recovery: Recovery) -> bool:
    """Every survivor holding the training state met the death outside its training loop (before it, or in an
    evaluation or save after it): no step is redone."""
    holders = [check_in for check_in in recovery.checked_in.values() if check_in.has_state]
    return bool(holders) and all(check_in.before_loop for check_in in holders)
