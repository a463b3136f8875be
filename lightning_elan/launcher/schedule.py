"""Pure parsing and formatting of scale actions and ``--schedule`` strings.

Two spellings of the same :class:`ScaleAction`:

* the ``elan scale`` form, two tokens: ``add 2``, ``remove 1``, ``remove rank:0,3``, ``migrate 1``, ``to 4``;
* the ``--schedule`` form, comma-separated ``STEP:ACTION=ARG`` items, where a rank list is written with
  ``;`` because ``,`` separates items: ``"10:add=1,20:remove=rank:0;2,30:migrate=1,40:to=4"``.

Nothing here talks to the AM or imports torch: every function is unit-testable on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ACTIONS: tuple[str, ...] = ("add", "remove", "migrate", "to")
RANK_PREFIX = "rank:"
SCALE_RANK_SEP = ","
SCHEDULE_RANK_SEP = ";"


class ScheduleError(ValueError):
    """An action or schedule string that cannot be parsed; the message names the problem."""


@dataclass(frozen=True)
class ScaleAction:
    """One scale request: exactly one of ``count`` (add/remove/migrate), ``ranks`` (remove) or ``size`` (to)."""

    action: str
    count: int | None = None
    ranks: tuple[int, ...] | None = None
    size: int | None = None
    at_step: int | None = None

    def request_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``AMClient.scale`` (fields that are not set are left out)."""
        kwargs: dict[str, Any] = {"action": self.action}
        if self.count is not None:
            kwargs["count"] = self.count
        if self.ranks is not None:
            kwargs["ranks"] = list(self.ranks)
        if self.size is not None:
            kwargs["size"] = self.size
        if self.at_step is not None:
            kwargs["at_step"] = self.at_step
        return kwargs

    def format_arg(self, rank_sep: str = SCALE_RANK_SEP) -> str:
        """The argument alone: ``2``, ``rank:0,3`` (or ``rank:0;3`` with ``rank_sep=";"``)."""
        if self.ranks is not None:
            return RANK_PREFIX + rank_sep.join(str(rank) for rank in self.ranks)
        value = self.size if self.action == "to" else self.count
        return str(value)

    def __str__(self) -> str:
        text = f"{self.action} {self.format_arg()}"
        return text if self.at_step is None else f"{text} at step {self.at_step}"


def parse_non_negative_int(text: str, what: str = "") -> int:
    """``int(text)`` if it is a plain decimal ≥ 0, else :class:`ScheduleError` naming ``what``."""
    stripped = text.strip()
    if not stripped.isdecimal():
        raise ScheduleError(f"{what} must be a non-negative integer, got {text!r}".lstrip())
    return int(stripped)


def parse_positive_int(text: str, what: str = "") -> int:
    """``int(text)`` if it is a plain decimal ≥ 1, else :class:`ScheduleError` naming ``what``."""
    stripped = text.strip()
    if not stripped.isdecimal() or int(stripped) < 1:
        raise ScheduleError(f"{what} must be an integer >= 1, got {text!r}".lstrip())
    return int(stripped)


def parse_ranks(text: str, sep: str = SCALE_RANK_SEP) -> tuple[int, ...]:
    """Parse ``rank:R[<sep>R…]`` into a tuple of distinct ranks, in the order given."""
    if not text.startswith(RANK_PREFIX):
        raise ScheduleError(f"rank list must look like rank:R{sep}R…, got {text!r}")
    body = text[len(RANK_PREFIX) :]
    if not body.strip():
        raise ScheduleError(f"rank list {text!r} names no rank")
    ranks: list[int] = []
    for part in body.split(sep):
        rank = parse_non_negative_int(part, f"rank in {text!r}")
        if rank in ranks:
            raise ScheduleError(f"rank {rank} is listed twice in {text!r}")
        ranks.append(rank)
    return tuple(ranks)


def parse_action(action: str, arg: str, *, at_step: int | None = None, rank_sep: str = SCALE_RANK_SEP) -> ScaleAction:
    """Parse an action name and its argument (``"remove"``, ``"rank:0,2"``) into a :class:`ScaleAction`."""
    name = action.strip()
    if name not in ACTIONS:
        raise ScheduleError(f"unknown action {action!r} (expected one of: {', '.join(ACTIONS)})")
    if at_step is not None and at_step < 0:
        raise ScheduleError(f"step must be a non-negative integer, got {at_step}")
    value = arg.strip()
    if value.startswith(RANK_PREFIX):
        if name != "remove":
            raise ScheduleError(f"only remove accepts a rank list, got {name} {value!r}")
        return ScaleAction(name, ranks=parse_ranks(value, rank_sep), at_step=at_step)
    if name == "to":
        return ScaleAction(name, size=parse_positive_int(value, "size for 'to'"), at_step=at_step)
    hint = " or rank:R…" if name == "remove" else ""
    return ScaleAction(name, count=parse_positive_int(value, f"count for {name!r}{hint}"), at_step=at_step)


def parse_schedule_item(item: str) -> ScaleAction:
    """Parse one ``STEP:ACTION=ARG`` item."""
    text = item.strip()
    if not text:
        raise ScheduleError("empty schedule item (stray comma?)")
    step_text, colon, rest = text.partition(":")
    name, equals, arg = rest.partition("=")
    if not colon or not equals or not name.strip() or not arg.strip():
        raise ScheduleError(f"schedule item {text!r} must look like STEP:ACTION=ARG, e.g. 10:add=1")
    try:
        step = parse_non_negative_int(step_text, "step")
        return parse_action(name, arg, at_step=step, rank_sep=SCHEDULE_RANK_SEP)
    except ScheduleError as exc:
        raise ScheduleError(f"schedule item {text!r}: {exc}") from None


def parse_schedule(text: str) -> list[ScaleAction]:
    """Parse a whole ``--schedule`` string; items come back sorted by step (stable for equal steps).

    The AM queues requests FIFO, so submitting them in step order is what the user means.
    """
    if not text.strip():
        raise ScheduleError("schedule is empty (expected STEP:ACTION=ARG[,…], e.g. 10:add=1)")
    items = [parse_schedule_item(part) for part in text.split(",")]
    return sorted(items, key=lambda item: item.at_step or 0)


def format_schedule_item(item: ScaleAction) -> str:
    """The ``STEP:ACTION=ARG`` spelling of one scheduled action (``at_step`` must be set)."""
    if item.at_step is None:
        raise ValueError(f"{item} has no step: only actions with at_step belong in a schedule")
    return f"{item.at_step}:{item.action}={item.format_arg(SCHEDULE_RANK_SEP)}"


def format_schedule(items: Iterable[ScaleAction]) -> str:
    """Inverse of :func:`parse_schedule` (for items already in step order)."""
    return ",".join(format_schedule_item(item) for item in items)


def format_scale_args(item: ScaleAction) -> list[str]:
    """The ``elan scale`` argument vector for ``item``: ``["--at-step", "S", ACTION, ARG]``."""
    args = [] if item.at_step is None else ["--at-step", str(item.at_step)]
    return [*args, item.action, item.format_arg(SCALE_RANK_SEP)]
