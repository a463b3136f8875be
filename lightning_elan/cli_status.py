"""``elan status`` and the other replies of the AM, in words: everything the CLI prints (sizing and profiles too)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_elan.launcher.schedule import ScaleAction
from lightning_elan.protocol.contract import AdjustmentPlan, AMStatus, MemberStatus, ScaleReply, StatusReply
from lightning_elan.scaling.report import format_summary
from lightning_elan.sizing.profile import ProfileRun
from lightning_elan.words import describe_autoscale_config, plural

__all__ = ["describe_adjustment", "describe_am", "describe_enrolment", "describe_failure", "describe_plan",
           "describe_profile_start", "describe_recovery", "describe_request", "describe_scale_reply",
           "describe_standby", "format_profile", "format_sizing", "format_status", "rates_phrase"]


def describe_scale_reply(action: ScaleAction, reply: ScaleReply) -> str:
    new_workers = ", ".join(reply.new_workers) or "none"
    return f"request {reply.request_id}: {action} (new workers: {new_workers})"


def describe_request(request: Mapping[str, Any]) -> str:
    """One pending request from the status reply, e.g. ``r2: add 1 at step 20 (new workers: w3)``."""
    action = str(request.get("action", "?"))
    if request.get("ranks") is not None:
        arg = "rank:" + ",".join(str(rank) for rank in request["ranks"])
    elif request.get("workers") is not None:  # a leave (a worker that received SIGTERM)
        arg = ", ".join(request["workers"])
    elif action == "to":
        arg = str(request.get("size"))
    else:
        arg = str(request.get("count"))
    text = f"{request.get('request_id', request.get('id', '?'))}: {action} {arg}"
    if request.get("at_step") is not None:
        text += f" at step {request['at_step']}"
    new_workers = request.get("new_workers")
    if new_workers:
        text += f" (new workers: {', '.join(new_workers)})"
    return text


def describe_plan(plan: AdjustmentPlan) -> str:
    return (
        f"{plan.request_id} {plan.action} at step {plan.step}: generation "
        f"{plan.previous_generation} → {plan.generation}, members {_ids(plan.members)}, "
        f"joiners {_ids(plan.joiners)}, leavers {_ids(plan.leavers)}"
    )


def describe_adjustment(record: Mapping[str, Any]) -> str:
    text = (
        f"{record.get('request_id')} {record.get('action')} at step {record.get('step')} → generation "
        f"{record.get('generation')}, joiners {_ids(record.get('joiners'))}, leavers {_ids(record.get('leavers'))}"
    )
    pauses = [float(value) for value in (record.get("pause_s") or {}).values()]
    if pauses:
        text += f", pause max {max(pauses):.3f} s"
    if record.get("bytes_replicated") is not None:
        text += f", {_bytes(record['bytes_replicated'])} replicated"
    if record.get("global_batch") is not None:
        text += f", global batch {record['global_batch']}"
    decision = record.get("scaling")
    if decision:
        text += f" (lr x{decision.get('lr_scale')}: {decision.get('reason')})"
    start, end = record.get("requested_at"), record.get("completed_at")
    if start is not None and end is not None:
        text += f", {float(end) - float(start):.2f} s from request to completion"
    if end is not None:
        text += f" (completed {time.strftime('%H:%M:%S', time.localtime(float(end)))})"
    return text


def format_status(status: StatusReply) -> str:
    """The human ``elan status`` text."""
    state = "finished" if status.finished else "running"
    if status.failed_reason:
        state = f"failed: {status.failed_reason}"
    lines = [f"job {status.job}: generation {status.generation}, {state}"]
    lines.append(f"members ({len(status.members)}):")
    header = ["RANK", "WORKER", "HOST", "DEVICE", "PID", "LAST_STEP", "FROM"]
    lines += ["  " + row for row in _table(header, _member_rows(status.members))]
    lines.append("  (LAST_STEP: the step of the member's last coordinate (rank 0) or adjustment report)")
    lines.append(
        f"progress: step {_dash(status.step)}, epoch {_dash(status.epoch)}, "
        f"position {_dash(status.position)}, global batch {_dash(status.global_batch)}"
    )
    if status.am:
        lines.append(describe_am(status.am))
    lines.append(f"pending requests ({len(status.pending)}):" if status.pending else "pending requests: none")
    lines += [f"  {describe_request(request)}" for request in status.pending]
    lines.append(f"in flight: {describe_plan(status.in_flight) if status.in_flight else 'none'}")
    if status.recovery:
        lines.append(describe_recovery(status.recovery))
    if status.enrolment:
        lines.append(describe_enrolment(status.enrolment))
    if status.standby:
        lines.append(describe_standby(status.standby))
    last = status.last_adjustment
    lines.append(f"last adjustment: {describe_adjustment(last) if last else 'none'}")
    failures = status.failures
    lines.append(f"failed or cancelled ({len(failures)}):" if failures else "failed or cancelled: none")
    lines += [f"  {describe_failure(failure)}" for failure in failures]
    if status.scaling:
        lines += format_summary(status.scaling)
    if status.sizing:
        lines += format_sizing(status.sizing, [member.worker_id for member in _by_rank(status.members)])
    return "\n".join(lines)


def describe_standby(standby: Mapping[str, Any]) -> str:
    """The pool line, e.g. ``standby: 1 of 2 ready (w4 ready, w5 spawned)``."""
    workers = list(standby.get("workers") or [])
    ready = sum(1 for worker in workers if worker.get("status") == "ready")
    listed = ", ".join(f"{worker['worker_id']} {worker['status']}" for worker in workers) or "none"
    return f"standby: {ready} of {standby.get('target')} ready ({listed})"


def describe_enrolment(enrolment: Mapping[str, Any]) -> str:
    """The `elan worker` line, e.g. ``enrolment: 2–4 workers; waiting for the start: w0 (node-a pid 7)``."""
    low, high = enrolment.get("min_workers"), enrolment.get("max_workers")
    text = f"enrolment: {plural(low, 'worker') if low == high else f'{low}–{high} workers'}"
    if enrolment.get("started"):
        return text + "; started"
    waiting = ", ".join(f"{w['worker_id']} ({w['host']} pid {w['pid']})" for w in enrolment.get("waiting") or [])
    return text + f"; waiting for the start: {waiting or 'none enrolled yet'}"


def describe_am(am: AMStatus) -> str:
    """The AM process line, e.g. ``AM: pid 4242 at tcp://127.0.0.1:5555, restarted 1 time``."""
    text = f"AM: pid {_dash(am.pid)}"
    if am.address:
        text += f" at {am.address}"
    return text + (f", restarted {plural(am.restarts, 'time')}" if am.restarts else ", never restarted")


def describe_recovery(recovery: Mapping[str, Any]) -> str:
    """The recovery in progress, e.g. ``recovering (f1): w1 died; checked in: w0 of w0, w2``."""
    dead = ", ".join(recovery.get("dead") or []) or "nobody"
    survivors = ", ".join(recovery.get("survivors") or []) or "none"
    checked = ", ".join(recovery.get("checked_in") or []) or "none"
    return f"recovering ({recovery.get('failure_id')}): {dead} died; checked in: {checked} of {survivors}"


def describe_failure(failure: Mapping[str, Any]) -> str:
    """One failed or cancelled request or adjustment with its cause, e.g.
    ``r2: add 1 (new workers: w3): failed at step 40 (12:00:01): worker(s) w3 did not report ready within 600 s``."""
    if failure.get("kind") == "worker":
        what = f"worker {failure.get('worker_id')} (generation {failure.get('generation')}, exit code " \
               f"{failure.get('returncode')})"
        failure = {**failure, "reason": failure.get("reason") or f"recovered by {failure.get('failure_id')}"}
    elif failure.get("kind") == "replacement":
        what = f"--replace-failed (after {failure.get('worker_id')})"
    elif failure.get("kind") == "job":
        what = "job"
    elif failure.get("kind") == "adjustment":
        what = f"{failure.get('request_id')} {failure.get('action') or ''} adjustment".replace("  ", " ")
        if failure.get("generation") is not None:
            what += f" to generation {failure['generation']}"
    else:
        what = describe_request(failure)
    when = f" at step {failure['step']}" if failure.get("step") is not None else ""
    if failure.get("at") is not None:
        when += f" ({time.strftime('%H:%M:%S', time.localtime(float(failure['at'])))})"
    return f"{what}: {failure.get('outcome', 'failed')}{when}: {failure.get('reason')}"


def _by_rank(members: list[MemberStatus]) -> list[MemberStatus]:
    """The members in rank order."""
    return sorted(members, key=lambda member: member.rank)


def _member_rows(members: list[MemberStatus]) -> list[list[str]]:
    return [[_dash(value) for value in (m.rank, m.worker_id, m.host, m.device, m.pid, m.last_step, m.last_step_from)]
            for m in _by_rank(members)]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def _dash(value: Any) -> str:
    """``value`` as text, ``-`` for none."""
    return "-" if value is None else str(value)


def _ids(ids: Any) -> str:
    return ",".join(str(i) for i in ids) if ids else "none"


def _bytes(count: Any) -> str:
    value = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def format_profile(result: Mapping[str, Any], state_dir: Path | None = None) -> str:
    lines = [f"profile: {'WORKERS':>7}  SAMPLES/S"]
    best = result.get("best")
    for size, rate in sorted((int(k), v) for k, v in (result.get("rates") or {}).items()):
        lines.append(f"         {size:>7}  {rate:9.1f}{'  (best)' if size == best else ''}")
    if result.get("seconds") is not None:
        lines.append(f"profiled in {float(result['seconds']):.1f} s")
    if state_dir is not None:
        lines.append(f"throughput model: {state_dir / 'profile.json'} (HybridScaling(profile=...))")
    return "\n".join(lines)


def format_sizing(sizing: Mapping[str, Any], members: Sequence[str] = ()) -> list[str]:
    """``elan status`` lines: measured throughput, the current ``members``' compute scores, profile and autoscaler
    state, recent decisions."""
    measured = sizing.get("measured") or {}
    lines = []
    rates = measured.get("samples_per_s") or {}
    if rates:
        lines.append(f"throughput: {rates_phrase(rates)}")
    compute = _compute_line(measured, sizing.get("stragglers") or {}, members)
    if compute:
        lines.append(compute)
    if sizing.get("profile"):
        lines.append(_profile_running(sizing["profile"]))
    if sizing.get("profile_result"):
        result = sizing["profile_result"]
        best = f"; best {plural(int(result['best']), 'worker')}" if result.get("best") is not None else ""
        lines.append(f"last profile: {rates_phrase(result.get('rates') or {}) or 'nothing measured'}{best}")
    if sizing.get("autoscale"):
        lines.append(f"autoscale: {describe_autoscale_config(sizing['autoscale'])}")
    decisions = sizing.get("decisions") or []
    if decisions:
        lines.append("sizing decisions (newest last):")
    for decision in decisions:
        lines.append(f"  {decision.get('kind')}: {decision.get('decision')}: {decision.get('reason')}")
    return lines


def rates_phrase(rates: Mapping[Any, float]) -> str:
    """``1 worker 100.0/s, 2 workers 190.0/s`` (sizes ascending; JSON gives them as strings)."""
    return ", ".join(f"{plural(size, 'worker')} {rate:.1f}/s"
                     for size, rate in sorted((int(size), float(rate)) for size, rate in rates.items()))


def _compute_line(measured: Mapping[str, Any], stragglers: Mapping[str, Any], members: Sequence[str]) -> str | None:
    """The current members' compute scores (a worker that left is not listed; one that joined has no score yet)."""
    scores = measured.get("straggler_scores") or {}
    if not scores and not measured.get("compute_s"):
        return None
    flagged = set(measured.get("stragglers") or [])
    workers = list(members) or list(scores)
    listed = ", ".join(f"{worker} {scores[worker]:.2f}{' SLOW' if worker in flagged else ''}" if worker in scores
                       else f"{worker} not scored yet" for worker in workers)
    return f"compute (EWMA of throughput / median, stragglers {stragglers.get('mode')}): {listed}"


def _profile_running(profile: Mapping[str, Any]) -> str:
    """``profile running (2 → 1 → 3 → 2 workers): measured 2 workers 190.0/s``."""
    run = profile.get("run") or {}
    route = ""
    if run:
        route = f" ({' → '.join(str(size) for size in ProfileRun.from_dict(run).route())} workers)"
    return f"profile running{route}: measured {rates_phrase(profile.get('measured') or {}) or 'nothing yet'}"


def describe_profile_start(job: str, profile: Mapping[str, Any] | None, steps: int) -> str:
    """``profile of job 'x' started: 2 → 1 → 3 → 2 workers, 20 steps measured at each size``."""
    run = (profile or {}).get("run")
    route = "" if not run else " → ".join(str(size) for size in ProfileRun.from_dict(run).route())
    then = ", then the best size" if run and run.get("settle") == "best" else ""
    return f"profile of job {job!r} started: {route} workers{then}, {plural(steps, 'step')} measured at each size"
