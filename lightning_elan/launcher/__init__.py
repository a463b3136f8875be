"""The local launcher behind ``elan run`` and the parsing of scale actions and schedules.

The schedule helpers are pure and imported eagerly; the launcher classes (which need the AM and
the client) are imported on first use, so ``lightning_elan.launcher.schedule`` stays dependency-free.
"""

from __future__ import annotations

from typing import Any

from lightning_elan.launcher.schedule import (
    ACTIONS,
    ScaleAction,
    ScheduleError,
    format_scale_args,
    format_schedule,
    parse_action,
    parse_ranks,
    parse_schedule,
)

_LAUNCHER_NAMES = ("JobLauncher", "LaunchConfig", "LaunchError", "Worker")


def __getattr__(name: str) -> Any:
    if name in _LAUNCHER_NAMES:
        from lightning_elan.launcher import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ACTIONS",
    "JobLauncher",
    "LaunchConfig",
    "LaunchError",
    "ScaleAction",
    "ScheduleError",
    "Worker",
    "format_scale_args",
    "format_schedule",
    "parse_action",
    "parse_ranks",
    "parse_schedule",
]
