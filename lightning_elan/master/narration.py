"""One readable line per AM event, for the default log (the JSON stays in ``adjustments.jsonl`` and at debug level).

Pure functions of a plan's and an adjustment record's dicts (``AdjustmentPlan.to_dict()``, ``Adjustment.record()``):
a user reads what changed, at which step, and what it cost, the way the demo's closing summary reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_elan.words import plural, workers_phrase

__all__ = ["completed_line", "decided_line", "plural", "workers_phrase"]

_VERBS = {"add": "grows", "remove": "shrinks", "migrate": "migrates", "to": "resizes", "failure": "recovers",
          "leave": "lets a worker leave", "replace": "replaces a straggler"}


def decided_line(job: str, plan: Mapping[str, Any]) -> str:
    """The AM decided an adjustment: who joins and leaves, at which step, from which generation to which."""
    before, after = len(plan.get("previous_members") or []), len(plan.get("members") or [])
    verb = _VERBS.get(str(plan.get("action")), "adjusts")
    changes = _changes(plan.get("joiners") or [], plan.get("leavers") or [])
    sizes = f"{before} → {plural(after, 'worker')}" if before else plural(after, "worker")
    return (f"job {job!r} {verb} after step {plan.get('step')}: {changes}{sizes}, generation "
            f"{plan.get('previous_generation')} → {plan.get('generation')}")


def _changes(joiners: list[str], leavers: list[str]) -> str:
    parts = []
    if joiners:
        parts.append(f"{workers_phrase(joiners)} {'joins' if len(joiners) == 1 else 'join'}")
    if leavers:
        parts.append(f"{workers_phrase(leavers)} {'leaves' if len(leavers) == 1 else 'leave'}")
    return f"{'; '.join(parts)}; " if parts else ""


def completed_line(job: str, record: Mapping[str, Any]) -> str:
    """An adjustment (or a recovery) is complete: the new generation, the pause and what was copied."""
    members = record.get("members") or []
    head = f"job {job!r}: generation {record.get('generation')} trains with {plural(len(members), 'worker')}"
    failure = record.get("failure")
    if failure:
        return f"{head} after the death of {workers_phrase(failure.get('dead') or [])}{_recovery(failure)}"
    unreported = record.get("unreported")
    cut_short = f" (no report from {workers_phrase(unreported)}: a failure came first)" if unreported else ""
    return f"{head}{_pause(record.get('pause_s') or {})}{_copied(record)}{_startup(record)}{cut_short}"


def _recovery(failure: Mapping[str, Any]) -> str:
    redone = failure.get("step_redone")
    took = _seconds_between(failure.get("detected_at"), failure.get("recovered_at"))
    where = " (outside the training loop: no step redone)" if failure.get("outside_training") else \
        f" (step {redone} redone)" if redone is not None else ""
    return "".join([where,
                    f", recovered in {took:.2f} s" if took is not None else ""])


def _pause(pauses: Mapping[str, Any]) -> str:
    values = [float(value) for value in pauses.values() if value is not None]
    return f", paused {max(values):.2f} s" if values else ""


def _copied(record: Mapping[str, Any]) -> str:
    nbytes = record.get("bytes_replicated") or 0
    if not nbytes:
        return ""
    routes = sorted({str(received.get("route")) for received in (record.get("received") or {}).values()
                     if received.get("route")})
    return f", {nbytes / 1e6:.1f} MB copied" + (f" over {'/'.join(routes)}" if routes else "")


def _startup(record: Mapping[str, Any]) -> str:
    startups = [float(value) for value in (record.get("joiner_startup_s") or {}).values() if value is not None]
    return f" (joiners ready after {max(startups):.1f} s)" if startups else ""


def _seconds_between(start: Any, end: Any) -> float | None:
    if isinstance(start, int | float) and isinstance(end, int | float):
        return float(end) - float(start)
    return None
