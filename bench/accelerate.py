"""The Accelerate benchmark: ``python -m bench.accelerate`` (see docs/benchmarks.md, *Accelerate*).

1. Adjustment pause, per model: an ``elan run`` job of ``bench.accelerate_train`` (an ``ElasticAccelerator`` loop)
   scaled live by the harness — ``cycles`` × (scale out 2→3, scale in 3→2, migrate one worker); the same schedule
   replayed by stop-and-restart of a plain ``Accelerator`` (``save_state`` at the step, relaunch at the new size,
   ``load_state``: what a plain Accelerate job does to change its size); and, with ``--with-lightning``, the schedule
   on the Lightning workload (``bench.train``) in the same run. Pauses come from the workers' own step timestamps.
2. Runtime overhead without adjustments: a plain ``accelerate.Accelerator`` (DDP, 2 processes) against
   ``ElasticAccelerator`` at each ``coordinate_every``, interleaved rounds whose order rotates.
Writes ``results.json`` and ``results.md`` to ``--out``; step files and logs go to ``--work-dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.analysis import Spread
from bench.common import Scenario
from bench.procs import Children
from bench.report import ACTIONS, fmt, overhead_table, pauses, ratio

log = logging.getLogger("bench.accelerate")

WORKLOADS = {"accelerate": "bench.accelerate_train", "lightning": "bench.train"}
ELAN_ATTEMPTS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/accelerate"), help="results.json/.md")
    parser.add_argument("--work-dir", type=Path, default=None, help="step files and logs (default: a temp dir)")
    parser.add_argument("--models", default="1m,25m", help="comma-separated model sizes (bench/sizes.py)")
    parser.add_argument("--cycles", type=int, default=3, help="(scale out, scale in, migrate) cycles per model")
    parser.add_argument("--actions", default="add,remove,migrate", help="one cycle, in order")
    parser.add_argument("--settle-steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                        help="replay each schedule by stop-and-restart of a plain Accelerator")
    parser.add_argument("--with-lightning", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the Lightning workload's job on the same schedule")
    parser.add_argument("--overhead-configs", default="ddp,1,10", help="ddp and/or elan coordinate_every values")
    parser.add_argument("--overhead-model", default="1m")
    parser.add_argument("--overhead-rounds", type=int, default=5)
    parser.add_argument("--overhead-steps", type=int, default=300)
    parser.add_argument("--keep-work-dir", action="store_true")
    return parser.parse_args(argv)


def environment() -> dict[str, Any]:
    from bench.run import environment as base

    return {**base(), "accelerate": metadata.version("accelerate")}


def run_adjustments(args: argparse.Namespace, work: Path, children: Children, results: dict[str, Any],
                    save: Any) -> None:
    """Each model's job per workload; a job that fails is retried once, then recorded as a failure."""
    from bench.elan_runs import run_elan_job

    workloads = ["accelerate", "lightning"] if args.with_lightning else ["accelerate"]
    for model in _names(args.models):
        entry = results["models"].setdefault(model, {})
        for workload in workloads:
            scenario = _scenario(args, model, workload)
            for attempt in range(1, ELAN_ATTEMPTS + 1):
                where = work / model / f"{workload}-{attempt}"
                log.info("%s: %s job (attempt %d)", model, workload, attempt)
                try:
                    job = run_elan_job(scenario, where, children)
                    entry[workload] = job.as_dict()
                    break
                except Exception as exc:
                    _failed(results, model, f"{workload} attempt {attempt}", exc, where)
            save()
            if workload == "accelerate" and args.restart and workload in entry:
                run_restart(scenario, job, work / model / "restart", children, results)
                save()


def run_restart(scenario: Scenario, job: Any, where: Path, children: Children, results: dict[str, Any]) -> None:
    """The elastic job's schedule replayed by stop-and-restart of a plain Accelerator."""
    from bench.restart_runs import run_restart_job

    schedule = [(a.action, step, world) for a, (step, world) in zip(job.adjustments, job.schedule(), strict=True)]
    log.info("%s: stop-and-restart of a plain Accelerator on the same schedule", scenario.model)
    try:
        restart = run_restart_job(scenario, schedule, job.final_step(), where, children)
        results["models"][scenario.model]["restart"] = restart.as_dict()
    except Exception as exc:
        _failed(results, scenario.model, "restart", exc, where)


def _scenario(args: argparse.Namespace, model: str, workload: str) -> Scenario:
    return Scenario(model, cycles=args.cycles, settle_steps=args.settle_steps, warmup_steps=args.warmup_steps,
                    workload=WORKLOADS[workload], actions=tuple(_names(args.actions)))


def _failed(results: dict[str, Any], model: str, part: str, exc: Exception, where: Path) -> None:
    log.error("%s %s failed: %s (logs in %s)", model, part, exc, where)
    results["failures"].append({"model": model, "part": part, "error": f"{type(exc).__name__}: {exc}",
                                "logs": str(where)})


def run_overhead_rounds(args: argparse.Namespace, work: Path, children: Children, results: dict[str, Any]) -> None:
    from bench.overhead import parse_configs, run_overhead

    if args.overhead_rounds <= 0:
        return
    runs = run_overhead(args.overhead_model, args.overhead_rounds, args.overhead_steps, work / "overhead", children,
                        configs=parse_configs(args.overhead_configs), module=WORKLOADS["accelerate"])
    results["overhead"] = {"model": args.overhead_model, "steps": args.overhead_steps,
                           "runs": [run.as_dict() for run in runs]}


# ---------------------------------------------------------------------- report


def pause_table(results: dict[str, Any]) -> list[str]:
    lines = ["| model | adjustment | ElasticAccelerator pause (s) | plain Accelerator stop-and-restart (s) "
             "| restart ÷ elastic | Lightning `elan` pause (s), same run | joiner start-up, hidden (Accelerate) (s) |",
             "|---|---|---|---|---|---|---|"]
    for model, entry in results["models"].items():
        if "accelerate" not in entry:
            continue
        for action in dict.fromkeys(a["action"] for a in entry["accelerate"]["adjustments"]):
            accelerate = Spread.of(pauses(entry["accelerate"], action))
            restart = Spread.of(pauses(entry.get("restart"), action))
            lightning = Spread.of(pauses(entry.get("lightning"), action))
            startup = Spread.of(s for a in entry["accelerate"]["adjustments"] if a["action"] == action
                                for s in a["joiner_startup_s"])
            lines.append(f"| {model} | {ACTIONS.get(action, action)} | {fmt(accelerate)} | {fmt(restart, 1)} "
                         f"| {ratio(restart, accelerate)} | {fmt(lightning)} "
                         f"| {fmt(startup, 1) if action != 'remove' else '—'} |")
    return lines


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    parts = [
        "# lightning_elan: Accelerate benchmark", "",
        f"{env['date']} · {env['cpu']}, {env['cores']} cores · python {env['python']}, torch {env['torch']}, "
        f"accelerate {env['accelerate']}, lightning {env['lightning']} · load average at start "
        f"{env['loadavg_start'][0]:.1f}, whole run {env.get('wall_s', 0) / 60:.1f} min", "",
        "CPU, gloo, 2 workers at launch, global batch 48 (strong scaling). Medians with (min–max) over every "
        "adjustment of that kind; a pause is the survivors' step gap around the adjustment minus a typical step.", "",
        "## Adjustment pause", "", *pause_table(results), "",
    ]
    if "overhead" in results:
        table = overhead_table(results, baseline="plain `Accelerator` (DDP)", subject="`ElasticAccelerator`")
        parts += ["## Runtime overhead without adjustments", "", *table, ""]
    if results["failures"]:
        parts += ["## Failed runs", "", *[f"- {f['model']} {f['part']}: {f['error']}" for f in results["failures"]],
                  ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="elan-bench-accelerate-"))
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"environment": environment(), "models": {}, "failures": [],
                               "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    started, children = time.monotonic(), Children()

    def save() -> None:
        results["environment"]["wall_s"] = time.monotonic() - started
        (args.out / "results.json").write_text(json.dumps(results, indent=1))

    try:
        run_adjustments(args, work, children, results, save)
        run_overhead_rounds(args, work, children, results)
    finally:
        children.stop_all()
        save()
    (args.out / "results.md").write_text(markdown(results))
    log.info("done in %.0f s: %s", results["environment"]["wall_s"], args.out / "results.md")
    if not args.keep_work_dir and args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(not entry.get("accelerate") for entry in results["models"].values()) else 0


def _names(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


if __name__ == "__main__":
    raise SystemExit(main())
