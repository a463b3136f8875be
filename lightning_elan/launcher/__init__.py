"""The local launcher behind ``elan run`` and the parsing of scale actions and schedules.

The schedule helpers are pure and imported eagerly; the launcher classes (which need the AM and
the client) are imported on first use, so ``lightning_elan.launcher.schedule`` stays dependency-free.
"""

from __future__ import annotations

from lightning_elan._lazy import lazy_exports
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

__all__ = [
    "ACTIONS",
    "JobLauncher",
    "LaunchConfig",
    "LaunchError",
    "ScaleAction",
    "ScheduleError",
    "WorkerProcess",
    "format_scale_args",
    "format_schedule",
    "parse_action",
    "parse_ranks",
    "parse_schedule",
]

_LAUNCHER_NAMES = ("JobLauncher", "LaunchConfig", "LaunchError", "WorkerProcess")  # need the AM and the client: lazy

__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(_LAUNCHER_NAMES, "run"))
