"""Standby workers: ``python -m bench.standby`` (see docs/benchmarks.md, *Standby workers*).

Per model, two ``elan run`` jobs of the Lightning workload (``bench.train``) with 2 workers: one with ``--standby 1``,
one without. Each is scaled ``cycles`` × (``add 1``, then ``remove 1``). Before each ``add`` the standby job waits
until its pool holds a ready worker again (a new standby starts as soon as an ``add`` takes one). Measured per
``add``, from the workers' own step files: the time from the request to the joiner's first completed step, and the
stayers' pause (the same analysis as ``bench.run``). Writes ``results.json`` and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.analysis import Spread
from bench.common import Scenario
from bench.elan_runs import run_elan_job
from bench.procs import Children
from bench.report import fmt
from lightning_elan.protocol.client import AMClient

log = logging.getLogger("bench.standby")

POOL_READY_TIMEOUT_S = 300.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/standby"), help="results.json/.md")
    parser.add_argument("--work-dir", type=Path, default=None, help="step files and logs (default: a temp dir)")
    parser.add_argument("--models", default="1m,25m", help="comma-separated model sizes (bench/sizes.py)")
    parser.add_argument("--cycles", type=int, default=3, help="(add 1, remove 1) cycles per job")
    parser.add_argument("--settle-steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--coordinate-every", type=int, default=1)
    parser.add_argument("--keep-work-dir", action="store_true")
    return parser.parse_args(argv)


def run_job(scenario: Scenario, standby: int, out: Path, children: Children, coordinate_every: int) -> dict[str, Any]:
    """One job: ``cycles`` × (add 1, remove 1); returns each add's time to the joiner's first step and pause."""
    options = ["--standby", str(standby)] if standby else []

    def before_request(action: str, client: AMClient, alive: Callable[[], bool]) -> None:
        if action == "add" and standby:
            _wait_for_ready_standby(client, alive)

    job = run_elan_job(replace(scenario, actions=("add", "remove")), out, children, coordinate_every,
                       run_options=options, before_request=before_request)
    adds = [{"joiner": a.record["joiners"],
             "request_to_first_step_s": a.joiner_first_step_s[0] if a.joiner_first_step_s else None,
             "pause_s": a.pause.pause_s if a.pause else None,
             "joiner_startup_s": a.joiner_startup_s[0] if a.joiner_startup_s else None}
            for a in job.adjustments if a.action == "add"]
    return {"standby": standby, "returncode": job.returncode, "adds": adds}


def _wait_for_ready_standby(client: AMClient, alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + POOL_READY_TIMEOUT_S
    while time.monotonic() < deadline and alive():
        pool = (client.status().get("standby") or {}).get("workers") or []
        if any(worker["status"] == "ready" for worker in pool):
            return
        time.sleep(0.2)
    raise TimeoutError("no ready standby worker")


def table(results: dict[str, Any]) -> list[str]:
    lines = ["| model | standby | `elan scale add 1` → joiner's first step (s) | stayers' pause (s) | joiner process "
             "start → first step (s) | n |", "|---|---|---|---|---|---|"]
    for model, jobs in results["models"].items():
        for job in jobs:
            adds = job["adds"]
            first = Spread.of(a["request_to_first_step_s"] for a in adds if a["request_to_first_step_s"] is not None)
            pause = Spread.of(a["pause_s"] for a in adds if a["pause_s"] is not None)
            startup = Spread.of(a["joiner_startup_s"] for a in adds if a["joiner_startup_s"] is not None)
            lines.append(f"| {model} | {job['standby']} | {fmt(first)} | {fmt(pause)} | {fmt(startup, 1)} "
                         f"| {len(adds)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    from bench.run import environment

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="elan-standby-"))
    results: dict[str, Any] = {"environment": environment(), "arguments": vars(args) | {"out": str(args.out),
                               "work_dir": str(work)}, "models": {}}
    children = Children()
    try:
        for model in [m.strip() for m in args.models.split(",") if m.strip()]:
            scenario = Scenario(model, cycles=args.cycles, settle_steps=args.settle_steps,
                                warmup_steps=args.warmup_steps)
            results["models"][model] = []
            for standby in (1, 0):
                log.info("%s: job with --standby %d", model, standby)
                job = run_job(scenario, standby, work / model / f"standby{standby}", children, args.coordinate_every)
                results["models"][model].append(job)
    finally:
        children.stop_all()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
        (args.out / "results.md").write_text("\n".join(table(results)) + "\n")
        if not args.keep_work_dir and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    log.info("results in %s", args.out)
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
