"""The job of ``elan run``: every transition its launcher drives — ``start_job`` (generation 0, the failure policy,
the standby pool) and ``launcher_poll`` (the workers to start and to stop, the AM's clock for this job)."""

from __future__ import annotations

from typing import Any

from lightning_elan.master.standby import StandbyPool
from lightning_elan.master.state import JobState, Member, StateError, now_or_clock
from lightning_elan.master.transitions import adjustments, finishing, pool, recovering, requests
from lightning_elan.protocol.contract import MAX_WORLD_SIZE, LauncherPollReply, StartJobReply

__all__ = ["launcher_poll", "start_job"]


def start_job(
    state: JobState, nproc: int, coordinate_every: int | None = None, hosts: Any = None,
    report_timeout_s: float | None = None, replace_failed: bool = False, min_workers: int | None = None,
    join_timeout_s: float | None = None, standby: int = 0,
) -> StartJobReply:
    """Create generation 0 with members w0..w{nproc-1} (and ``standby`` standby workers, started by the next
    ``launcher_poll``); a started job just returns its current membership."""
    if state.started:
        return _membership(state)
    if nproc < 1:
        raise StateError(f"nproc must be ≥ 1, got {nproc}")
    if nproc > MAX_WORLD_SIZE:
        raise StateError(f"nproc must be ≤ {MAX_WORLD_SIZE}, got {nproc}")
    if coordinate_every is not None and coordinate_every < 1:
        raise StateError(f"coordinate_every must be ≥ 1, got {coordinate_every}")
    worker_ids = [f"w{state.next_worker + index}" for index in range(nproc)]
    host_of = _initial_hosts(worker_ids, hosts)
    adjustments.form_generation_zero(state, [Member(worker, 0, host=host_of.get(worker)) for worker in worker_ids])
    state.next_worker += nproc
    state.coordinate_every = coordinate_every
    if report_timeout_s is not None:
        if report_timeout_s <= 0:
            raise StateError(f"report_timeout_s must be > 0, got {report_timeout_s}")
        state.report_timeout_s = float(report_timeout_s)
    recovering.set_failure_policy(state, replace_failed, min_workers, join_timeout_s)
    try:
        state.standby = StandbyPool(target=int(standby))
    except ValueError as error:
        raise StateError(str(error)) from None
    state.started = True
    pool.refill(state)
    return _membership(state)


def launcher_poll(state: JobState, now: float | None = None) -> LauncherPollReply:
    """Hand the launcher the workers it has to start (marked spawned), those it has to stop (their request failed
    because a worker of it never reported ready) and those it has to kill (a survivor that never checked in after a
    failure: hung or frozen), and whether the job is finished (``finishing`` looks again: the AM's clock for this
    job)."""
    now = now_or_clock(now)
    spawn = requests.spawn_requested(state, now)
    stop = requests.fail_unreported(state, now)
    kill = recovering.declare_silent_survivors_dead(state, now)
    recovering.form_plan_if_ready(state, now)  # a joiner it waited for may be ready, or its wait over
    finishing.finish_if_done(state)
    return LauncherPollReply(spawn, stop, state.finished, kill)


def _membership(state: JobState) -> StartJobReply:
    return StartJobReply(state.generation, state.member_ids)


def _initial_hosts(worker_ids: list[str], hosts: Any) -> dict[str, str]:
    """``hosts`` of start_job: one host per rank (list) or a worker → host mapping."""
    if hosts is None:
        return {}
    if isinstance(hosts, dict):
        unknown = sorted(set(hosts) - set(worker_ids))
        if unknown:
            raise StateError(f"hosts names unknown workers {unknown}")
        named = dict(hosts)
    elif len(hosts) != len(worker_ids):
        raise StateError(f"hosts must list one host per worker: got {len(hosts)} for nproc {len(worker_ids)}")
    else:
        named = dict(zip(worker_ids, hosts, strict=True))
    if not all(host is None or isinstance(host, str) for host in named.values()):
        raise StateError("hosts must be host names (strings)")
    return named
