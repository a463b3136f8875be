"""Write a simulation's results: a Markdown table, JSON, and a PNG (JCT CDF, utilisation over time)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_elan.sim.engine import SimulationResult
from lightning_elan.sim.metrics import PolicyMetrics

log = logging.getLogger(__name__)

TABLE_HEADER = (
    "| policy | adjust cost | mean JCT (s) | median JCT (s) | p95 JCT (s) | mean pending (s) | makespan (s) "
    "| GPU util. | adjustments | preemptions | paused (s) | paused (GPU·s) |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def markdown_table(metrics: Sequence[PolicyMetrics]) -> str:
    rows = [
        f"| {m.policy} | {m.cost_model} | {m.mean_jct_s:,.0f} | {m.median_jct_s:,.0f} | {m.p95_jct_s:,.0f} "
        f"| {m.mean_pending_s:,.0f} | {m.makespan_s:,.0f} | {m.gpu_utilisation:.1%} | {m.adjustments} "
        f"| {m.preemptions} | {m.adjustment_pause_s:,.1f} | {m.adjustment_gpu_s:,.1f} |"
        for m in metrics
    ]
    return "\n".join([TABLE_HEADER, *rows])


def markdown_report(setup: dict[str, Any], metrics: Sequence[PolicyMetrics]) -> str:
    lines = ["# elan simulate", ""]
    lines += [f"- {key}: {value}" for key, value in setup.items()]
    return "\n".join([*lines, "", markdown_table(metrics), ""])


def json_report(setup: dict[str, Any], metrics: Sequence[PolicyMetrics], results: Sequence[SimulationResult]) -> str:
    runs = []
    for summary, result in zip(metrics, results, strict=True):
        jobs = [
            {"job_id": job.job_id, "submit_s": job.spec.submit_time, "start_s": job.first_start, "finish_s": job.finish,
             "adjustments": job.adjustments, "preemptions": job.preemptions, "pause_s": round(job.pause_s, 6)}
            for job in result.jobs
        ]
        runs.append({"metrics": summary.as_dict(), "jobs": jobs})
    return json.dumps({"setup": setup, "runs": runs}, indent=1)


def write_reports(
    out: Path, setup: dict[str, Any], metrics: Sequence[PolicyMetrics], results: Sequence[SimulationResult],
    png: bool = True,
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "simulate.md", out / "simulate.json"]
    written[0].write_text(markdown_report(setup, metrics))
    written[1].write_text(json_report(setup, metrics, results))
    if png:
        written.append(write_png(out / "simulate.png", results))
    log.debug("wrote %s", ", ".join(str(path) for path in written))
    return written


def write_png(path: Path, results: Sequence[SimulationResult]) -> Path:
    """Left: JCT CDF per run; right: allocated GPUs over time. Imports matplotlib only here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (cdf, utilisation) = plt.subplots(1, 2, figsize=(13, 4.8))
    policies = list(dict.fromkeys(result.policy for result in results))
    costs = list(dict.fromkeys(result.cost_model for result in results))
    for result in results:
        label = f"{result.policy} ({result.cost_model})"
        style = {"color": f"C{policies.index(result.policy) % 10}",
                 "linestyle": ("-", "--", ":", "-.")[costs.index(result.cost_model) % 4]}
        jcts = sorted(job.finish - job.spec.submit_time for job in result.jobs)  # type: ignore[operator]
        cdf.step(jcts, [(i + 1) / len(jcts) for i in range(len(jcts))], where="post", label=label, **style)
        times = [time for time, _ in result.timeline]
        busy = [gpus / result.total_gpus for _, gpus in result.timeline]
        utilisation.step(times, busy, where="post", label=label, linewidth=0.9, **style)
    cdf.set(xscale="log", xlabel="job completion time (s)", ylabel="fraction of jobs", title="JCT CDF")
    utilisation.set(xlabel="time (s)", ylabel="GPUs allocated (fraction)", title="cluster utilisation", ylim=(0, 1.05))
    cdf.legend(fontsize=7)
    utilisation.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
