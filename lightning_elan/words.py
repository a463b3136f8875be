"""Counts and lists in words, for every user-facing line (the AM's, the launcher's, the CLI's, the autoscaler's).

Pure functions at the bottom of the package: any layer may use them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["describe_autoscale", "describe_autoscale_config", "plural", "workers_phrase"]


def plural(count: int, noun: str) -> str:
    """``1 worker``, ``2 workers``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def workers_phrase(workers: Iterable[str]) -> str:
    """``w1``, ``w1 and w2``, ``w1, w2 and w3``."""
    names = list(workers)
    if len(names) <= 1:
        return "".join(names)
    return f"{', '.join(names[:-1])} and {names[-1]}"


def describe_autoscale(job: str, autoscale: Mapping[str, Any] | None, scale_out_command: str | None = None) -> str:
    """What ``elan autoscale`` did, in words: ``autoscaling of job 'x' is off`` / ``… is on: throughput policy, …``."""
    growth = f"; growth runs {scale_out_command!r}" if scale_out_command else ""
    if not autoscale:
        return f"autoscaling of job {job!r} is off{growth}"
    return f"autoscaling of job {job!r} is on: {describe_autoscale_config(autoscale)}{growth}"


def describe_autoscale_config(autoscale: Mapping[str, Any]) -> str:
    """``throughput policy, 1 to 4 workers, 1 worker a step, a decision every 20 measured steps, …``."""
    config = autoscale.get("config") or {}
    low, high = config.get("min_workers") or 1, config.get("max_workers")
    parts = [f"{autoscale.get('policy')} policy",
             f"{low} to {plural(high, 'worker')}" if high else f"at least {plural(low, 'worker')}",
             f"{plural(config.get('step') or 1, 'worker')} a step",
             f"a decision every {plural(config.get('every') or 0, 'measured step')}"]
    if autoscale.get("policy") == "throughput" and config.get("threshold") is not None:
        parts.append(f"grows while the scaling efficiency is above {config['threshold']:g}")
    if config.get("price") is not None:
        parts.append(f"{config['price']:g} per worker-second")
    if config.get("cooldown_s"):
        parts.append(f"at least {config['cooldown_s']:g} s between decisions")
    return ", ".join(parts)
