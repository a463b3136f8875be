"""Resizes of a sharded job: ``elan_fsdp``'s live reshard against the copy floor and against stop-and-restart through a
sharded (DCP) checkpoint, as torchrun elastic would do it (issue 24).

    python -m bench.fsdp_reshard --model 25m --runs 2
    python -m bench.fsdp_reshard --model 100m --runs 1 --skip restart

* **elan_fsdp**: whole ``elan run --nproc 2 --schedule S`` jobs of ``bench.train --strategy elan_fsdp`` (the model one
  FSDP2 unit, Adam), as ``bench.pauses`` runs them: each adjustment's pause on the job-wide clock (a step completes when
  its last rank completes it; the gap around the change minus the median of the next 8 steps).
* **restart**: Lightning's own ``ModelParallelStrategy`` (FSDP2 over the data-parallel mesh) stops at each adjustment's
  step after a sharded checkpoint (every rank writes its shards, fsynced), and a new set of processes of the new size
  loads it (DCP reshards on load) and trains on; the pause runs from the old set's last step to the new set's first
  (minus a typical step).
* **floor**: the bytes the adjustment must move (the rows of every parameter and Adam moment whose holder changes,
  from FSDP2's row layout and the job's own membership records) over the two-process gloo broadcast bandwidth measured
  for that many bytes.

Prints one line per adjustment kind: elan_fsdp and restart pauses as median (min–max) over the runs, the bytes moved
and the floor. ``--json FILE`` writes every figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import pauses
from bench.analysis import Spread
from bench.common import Scenario
from bench.procs import Children
from bench.restart_runs import run_restart_job
from bench.sizes import CLASSES, IN_FEATURES, MODEL_SIZES
from lightning_elan.replication.shard_layout import row_moves

log = logging.getLogger("bench.fsdp_reshard")

DEFAULT_SCHEDULE = "10:add=1,30:remove=1,50:migrate=1"
STATE_COPIES = 3
"""Rows per parameter row that move: the parameter and Adam's two moments (float32)."""
FLOAT_BYTES = 4


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="25m", help="tiny, 1m, 11m, 25m or 100m")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--schedule", default=DEFAULT_SCHEDULE, help="adds, removes and migrations, as elan run's")
    parser.add_argument("--global-batch", type=int, default=48)
    parser.add_argument("--skip", default="", help="comma-separated: restart, floor")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per job")
    return parser.parse_args(argv)


def parameter_rows(model: str) -> list[tuple[int, int]]:
    """``(rows, bytes per row)`` of every parameter of the benchmark MLP, float32 (weights are ``(out, in)``)."""
    size = MODEL_SIZES[model]
    widths = [IN_FEATURES] + [size.width] * size.depth + [CLASSES]
    shapes: list[tuple[int, int]] = []
    for fan_in, fan_out in itertools.pairwise(widths):
        shapes += [(fan_out, fan_in * FLOAT_BYTES), (fan_out, FLOAT_BYTES)]
    return shapes


def moved_bytes(model: str, previous: Sequence[str], members: Sequence[str], joiners: Sequence[str]) -> int:
    """Bytes of parameters and Adam moments whose holder changes when ``previous`` reshards onto ``members``, in the
    live reshard's own group order (the old members in their order, then the joiners)."""
    order = [*previous, *[joiner for joiner in joiners if joiner not in previous]]
    holders, receivers = list(range(len(previous))), [order.index(member) for member in members]
    total = 0
    for rows, row_bytes in parameter_rows(model):
        moved = sum(move.end - move.start for move in row_moves(rows, holders, receivers) if move.source != move.target)
        total += moved * row_bytes * STATE_COPIES
    return total


def restart_schedule(schedule: str, world: int = 2) -> list[tuple[str, int, int]]:
    """``(action, step, world after)`` for each item of an ``elan run --schedule`` (``add=N``, ``remove=N``,
    ``migrate=N``)."""
    out = []
    for item in (part.strip() for part in schedule.split(",") if part.strip()):
        step, _, change = item.partition(":")
        action, _, count = change.partition("=")
        world += int(count) if action == "add" else -int(count) if action == "remove" else 0
        out.append((action, int(step), world))
    return out


def elan_runs(args: argparse.Namespace, work: Path) -> tuple[list[pauses.AdjustmentPause], list[dict[str, Any]]]:
    """The elan_fsdp jobs' pauses, and the first job's membership records (for the bytes moved)."""
    job_args = argparse.Namespace(model=args.model, schedule=args.schedule, global_batch=args.global_batch,
                                  strategy="elan_fsdp", log_level="INFO", timeout_s=args.timeout_s)
    found: list[pauses.AdjustmentPause] = []
    records: list[dict[str, Any]] = []
    for run in range(args.runs):
        log.info("elan_fsdp run %d of %d (load average %s)", run + 1, args.runs, pauses.load_average())
        run_dir = work / f"elan{run}"
        found += pauses.run_job(job_args, run, run_dir)
        records = records or pauses.records(run_dir / "state")
    return found, records


def restart_runs(args: argparse.Namespace, work: Path) -> list[tuple[str, float]]:
    """``(action, pause_s)`` of every adjustment of the stop-and-restart jobs."""
    schedule = restart_schedule(args.schedule)
    final_step = schedule[-1][1] + pauses.TRAILING_STEPS
    scenario = Scenario(args.model, global_batch=args.global_batch, timeout_s=args.timeout_s)
    found = []
    for run in range(args.runs):
        log.info("restart run %d of %d (load average %s)", run + 1, args.runs, pauses.load_average())
        children = Children()
        try:
            job = run_restart_job(scenario, schedule, final_step, work / f"restart{run}", children, "model_parallel")
        finally:
            children.stop_all()
        found += [(a.action, a.pause.pause_s) for a in job.adjustments if a.pause is not None]
    return found


def floors(args: argparse.Namespace, records: list[dict[str, Any]], work: Path) -> dict[str, dict[str, float]]:
    """Per adjustment kind of the first elan_fsdp job: the bytes moved and their time at the measured bandwidth."""
    from bench.run import measure_bandwidth

    moved: dict[str, int] = {}
    previous = ["w0", "w1"]
    for record in records:
        moved.setdefault(record["action"], moved_bytes(args.model, previous, record["members"], record["joiners"]))
        previous = list(record["members"])
    sizes = sorted(set(moved.values()) - {0})
    children = Children()
    try:
        measured = measure_bandwidth(sizes, "cpu", work, children) if sizes else {"results": []}
    finally:
        children.stop_all()
    seconds = {entry["bytes"]: statistics.median(entry["seconds"]) for entry in measured["results"]}
    return {action: {"bytes": nbytes, "floor_s": seconds.get(nbytes, 0.0)} for action, nbytes in moved.items()}


def _spread(values: list[float]) -> str:
    spread = Spread.of(values)
    return "—" if spread is None else f"{spread.median:.2f} ({spread.low:.2f}–{spread.high:.2f})"


def report(args: argparse.Namespace, elan: list[pauses.AdjustmentPause], restart: list[tuple[str, float]],
           floor: dict[str, dict[str, float]]) -> list[str]:
    lines = [f"model {args.model}, schedule {args.schedule}, {args.runs} run(s) each, load average now "
             f"{pauses.load_average()}",
             f"{'adjustment':<10} {'elan_fsdp pause, s':<22} {'restart (DCP) pause, s':<24} {'moved, MB':<10} floor, s"]
    for action in dict.fromkeys(item.action for item in elan):
        mine = [item.pause.pause_s for item in elan if item.action == action and item.pause is not None]
        theirs = [pause for kind, pause in restart if kind == action]
        moved = floor.get(action, {})
        lines.append(f"{action:<10} {_spread(mine):<22} {_spread(theirs):<24} "
                     f"{moved.get('bytes', 0) / 1e6:<10.1f} {moved.get('floor_s', float('nan')):.4f}")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(argv)
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="elan-fsdp-reshard-"))
    elan, records = elan_runs(args, work)
    restart = [] if "restart" in skip else restart_runs(args, work)
    floor = {} if "floor" in skip else floors(args, records, work)
    print("\n".join(report(args, elan, restart, floor)))
    if args.json is not None:
        args.json.write_text(json.dumps({"elan_fsdp": [item.as_dict() for item in elan], "restart": restart,
                                         "floor": floor, "model": args.model, "schedule": args.schedule}, indent=1))


if __name__ == "__main__":
    main()
