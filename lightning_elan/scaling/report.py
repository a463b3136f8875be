"""What ``elan status`` shows about scaling: the fitted throughput per world size and the last decision. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_elan.scaling.batch import ScalingDecision
from lightning_elan.scaling.throughput import ThroughputModel


def listed_world_sizes(model: ThroughputModel, world_size: int) -> tuple[list[int], list[int]]:
    """World sizes to show (powers of two, the current and the observed ones) and to search for the optimum
    (every size), both up to twice the largest of the current and the observed world sizes."""
    limit = 2 * max([world_size, *model.world_sizes_seen()])
    powers = {2**i for i in range(limit.bit_length()) if 2**i <= limit}
    shown = sorted(powers | {world_size} | set(model.world_sizes_seen()))
    return shown, list(range(1, limit + 1))


def throughput_table(
    model: ThroughputModel, global_batch: int, shown: list[int], searched: list[int]
) -> dict[str, Any]:
    """Samples/s per shown world size at ``global_batch``, and the optimum over the searched ones (world sizes the
    model cannot predict yet are left out)."""
    rates = {str(n): round(model.throughput(global_batch, n), 3) for n in shown if model.can_predict(n)}
    predictable = [n for n in searched if model.can_predict(n)]
    best = model.optimal_workers(global_batch, predictable) if predictable else None
    return {"global_batch": global_batch, "samples_per_s": rates, "optimal_workers": best}


def scaling_summary(
    model: ThroughputModel,
    policy: str,
    global_batch: int | None,
    world_size: int,
    last_decision: ScalingDecision | None,
) -> dict[str, Any]:
    """JSON-able: policy, model readiness and observation counts, throughput at the current and next (×2) global
    batch per world size, and the last decision with its reason."""
    tables = []
    if global_batch is not None:
        shown, searched = listed_world_sizes(model, world_size)
        tables = [throughput_table(model, batch, shown, searched) for batch in (global_batch, 2 * global_batch)]
    return {
        "policy": policy,
        "model_ready": model.ready(),
        "observations": model.observation_counts(),
        "world_size": world_size,
        "global_batch": global_batch,
        "throughput": tables,
        "last_decision": None if last_decision is None else last_decision.to_dict(),
    }


def format_summary(summary: Mapping[str, Any]) -> list[str]:
    """Human lines for ``elan status``."""
    ready = "ready" if summary.get("model_ready") else "not ready (strong scaling until it is)"
    lines = [f"scaling: policy {summary.get('policy')}, throughput model {ready}"]
    for table in summary.get("throughput") or []:
        rates = ", ".join(f"{n}: {rate:.1f}" for n, rate in table["samples_per_s"].items()) or "-"
        lines.append(
            f"  global batch {table['global_batch']}: samples/s by workers {{{rates}}}, best {table['optimal_workers']}"
        )
    decision = summary.get("last_decision")
    if decision:
        lines.append(
            f"  last decision: global batch {decision['global_batch']} (local {decision['local_batch']}, "
            f"k={decision['k']:g}): {decision['reason']}"
        )
    return lines
