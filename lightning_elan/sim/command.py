"""``elan simulate``: what the command does once ``lightning_elan.cli`` has parsed its arguments."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

from lightning_elan.sim.cluster import parse_cluster
from lightning_elan.sim.errors import SimulationError
from lightning_elan.sim.policies import parse_policies
from lightning_elan.sim.report import markdown_table, write_reports
from lightning_elan.sim.runner import load_jobs, run_policies
from lightning_elan.sim.workload import ElasticBounds

log = logging.getLogger(__name__)

PNG_HINT = "pip install matplotlib, or pip install 'lightning_elan[bench]'"


def run_simulate(args: argparse.Namespace) -> int:
    """Run every policy under every cost model, print the table, write the reports; SimulationError on bad input."""
    cluster = parse_cluster(args.cluster)
    policies = parse_policies(args.policy)
    cost_models = [name.strip() for name in args.adjust_cost.split(",") if name.strip()]
    if not cost_models:
        raise SimulationError("--adjust-cost needs at least one cost model")
    if not 0 < args.min_res_factor <= 1 <= args.max_res_factor < math.inf:
        raise SimulationError("need 0 < --min-res-factor <= 1 <= --max-res-factor")
    if not 0 <= args.dp_interval < math.inf:
        raise SimulationError(f"--dp-interval must be 0 (every event) or a positive number of seconds, not "
                              f"{args.dp_interval}")
    png = False
    if args.out is not None:
        _make_out_dir(args.out)  # before the simulation: a long run should not fail at its very end
        png = not args.no_png and _can_plot()
    bounds = ElasticBounds(args.min_res_factor, args.max_res_factor)
    jobs = load_jobs(args.trace, cluster, args.seed, bounds, args.profiles)
    runs = run_policies(jobs, cluster.total_gpus, policies, cost_models, args.dp_interval)
    setup: dict[str, Any] = {
        "trace": args.trace, "jobs": len(jobs), "cluster": cluster.describe(), "seed": args.seed,
        "adjust_cost": ",".join(cost_models), "min_res_factor": args.min_res_factor,
        "max_res_factor": args.max_res_factor, "dp_interval_s": args.dp_interval,
    }
    sys.stdout.write(markdown_table([run.metrics for run in runs]) + "\n")
    if args.out is not None:
        try:
            written = write_reports(args.out, setup, [run.metrics for run in runs], [run.result for run in runs],
                                    png=png)
        except OSError as error:
            raise SimulationError(f"--out {args.out}: cannot write the reports ({error})") from None
        sys.stdout.write("wrote " + ", ".join(str(path) for path in written) + "\n")
    return 0


def _make_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise SimulationError(f"--out {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SimulationError(f"--out {out}: cannot create the directory ({error.strerror or error})") from None


def _can_plot() -> bool:
    """True when matplotlib imports; else one warning line saying how to get the PNG (the reports go on without)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        log.warning("skipping simulate.png: matplotlib cannot be imported (%s); for the plot: %s", error, PNG_HINT)
        return False
    return True
