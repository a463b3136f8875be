"""Adjustment pauses on the job-wide clock, the job's first adjustment apart from later ones (issue 25).

    python -m bench.pauses --model 25m --runs 3
    python -m bench.pauses --model 25m --runs 3 --schedule "10:add=1,40:remove=1,60:add=1,90:migrate=1"

Each run is one whole ``elan run --nproc 2 --schedule S`` job of ``bench.train`` (the user's view: the launcher
submits the schedule, starts the joiners and ends the job), nothing driven from outside. A step completes when the
last rank that trains it completes it; an adjustment's pause is the gap from the job's last step before it to the
job's first step after it, minus the median of the job's next 8 steps (``bench.analysis.job_pause``). The job's
first adjustment is reported apart from the later ones of the same kind: it is the one that meets memory no process
has touched yet. Prints, per kind, the median and min–max over the runs; with ``--log-level INFO`` the workers'
adjustment phase lines (``lightning_elan`` logger) are in each run's ``elan-run.log`` under ``--work-dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.analysis import Pause, Spread, job_pause, load_steps
from bench.procs import Children, bench_env, train_command

log = logging.getLogger("bench.pauses")

DEFAULT_SCHEDULE = "10:add=1,40:remove=1,60:migrate=1"
TRAILING_STEPS = 20  # steps trained after the last scheduled one: room for the last adjustment and its window


@dataclass(frozen=True)
class AdjustmentPause:
    """One adjustment of one run: its kind, whether it was the job's first, its pause on the job-wide clock."""

    run: int
    index: int
    action: str
    step: int
    pause: Pause | None
    bytes_replicated: int

    @property
    def kind(self) -> str:
        return f"{self.action} ({'first of the job' if self.index == 0 else 'later'})"

    def as_dict(self) -> dict[str, Any]:
        return {"run": self.run, "index": self.index, "action": self.action, "step": self.step,
                "pause": None if self.pause is None else self.pause.as_dict(),
                "bytes_replicated": self.bytes_replicated}  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="25m", help="tiny, 1m, 11m or 25m")
    parser.add_argument("--runs", type=int, default=3, help="whole jobs, one after the other")
    parser.add_argument("--schedule", default=DEFAULT_SCHEDULE, help="elan run --schedule")
    parser.add_argument("--global-batch", type=int, default=48)
    parser.add_argument("--work-dir", type=Path, default=None, help="each run's logs and step files (default: temp)")
    parser.add_argument("--json", type=Path, default=None, help="write every adjustment's figures here")
    parser.add_argument("--log-level", default="WARNING", help="the workers' lightning_elan log level")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    parser.add_argument("--phases", action="store_true", help="print every rank's step phases around each adjustment")
    parser.add_argument("--strategy", choices=("elan", "elan_fsdp", "elan_hsdp"), default="elan",
                        help="elan_fsdp: the model sharded with FSDP2, resharded live at each adjustment; elan_hsdp: "
                             "ElanFSDPStrategy(hsdp_group_size=2), HSDP at 4, 6... workers")
    return parser.parse_args(argv)


def last_scheduled_step(schedule: str) -> int:
    return max(int(item.split(":", 1)[0]) for item in schedule.split(",") if item.strip())


def job_command(args: argparse.Namespace, job: str, run_dir: Path) -> list[str]:
    max_steps = last_scheduled_step(args.schedule) + TRAILING_STEPS
    return [
        sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", job,
        "--state-dir", str(run_dir / "state"), "--schedule", args.schedule, "--",
        *train_command("--launcher", "elan", "--strategy", args.strategy, "--model", args.model, "--global-batch",
                       str(args.global_batch),
                       "--max-steps", str(max_steps), "--steps-dir", str(run_dir / "steps"), "--label", "elan"),
    ]


def run_job(args: argparse.Namespace, run: int, run_dir: Path) -> list[AdjustmentPause]:
    """One whole job; the pause of each adjustment it completed."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = bench_env({"ELAN_HOME": str(run_dir / "home"), "BENCH_ELAN_LOG": args.log_level})
    children = Children()
    try:
        proc = children.start(job_command(args, f"pauses-{run}-{int(time.time())}", run_dir), env,
                              run_dir / "elan-run.log")
        returncode = proc.wait(args.timeout_s)
    finally:
        children.stop_all()
    if returncode != 0:
        log.warning("run %d: elan run exited %d (see %s)", run, returncode, run_dir / "elan-run.log")
    return analyse(run, load_steps(run_dir / "steps"), records(run_dir / "state"))


def records(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "adjustments.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def analyse(run: int, processes: list[Any], adjustment_records: list[dict[str, Any]]) -> list[AdjustmentPause]:
    found = []
    for index, record in enumerate(adjustment_records):
        step = int(record["step"])
        found.append(AdjustmentPause(run, index, str(record["action"]), step, job_pause(processes, step),
                                     int(record.get("bytes_replicated") or 0)))
    return found


PHASES = ("between", "forward", "backward", "vote", "optimizer")


def phase_lines(steps_dir: Path, step: int, after: int = 3) -> list[str]:
    """Each worker's phases (s) of the steps from ``step`` to ``step + after`` (the step files' ``p``): where the
    time around an adjustment after ``step`` went, rank by rank."""
    lines = []
    for process in load_steps_with_phases(steps_dir):
        for record in process:
            if step <= record["s"] <= step + after and record.get("p"):
                phases = "  ".join(f"{name} {seconds:.3f}" for name, seconds in zip(PHASES, record["p"], strict=True))
                lines.append(f"    {record['worker']} step {record['s']} (world {record['w']}): {phases}")
    return lines


def load_steps_with_phases(steps_dir: Path) -> list[list[dict[str, Any]]]:
    """Every step file's records, each with its worker's id."""
    processes = []
    for path in sorted(steps_dir.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
        if lines:
            processes.append([{**record, "worker": lines[0]["worker"]} for record in lines[1:]])
    return processes


def summary(pauses: list[AdjustmentPause]) -> list[str]:
    """One line per kind of adjustment: pause median (min–max) over the runs, and the raw gaps."""
    kinds: dict[str, list[AdjustmentPause]] = {}
    for item in sorted(pauses, key=lambda p: (p.index != 0, p.index)):
        kinds.setdefault(item.kind, []).append(item)
    lines = []
    for kind, items in kinds.items():
        measured = [item.pause for item in items if item.pause is not None]
        pause, gap = Spread.of(p.pause_s for p in measured), Spread.of(p.gap_s for p in measured)
        typical = Spread.of(p.typical_step_s for p in measured)
        lines.append(f"{kind:<28} n={len(measured)}  pause {_fmt(pause)} s   gap {_fmt(gap)} s   "
                     f"typical step {_fmt(typical)} s   runs: {' '.join(f'{p.pause_s:.2f}' for p in measured)}")
    return lines


def _fmt(spread: Spread | None) -> str:
    return "—" if spread is None else f"{spread.median:.2f} ({spread.low:.2f}–{spread.high:.2f})"


def load_average() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="elan-pauses-"))
    pauses: list[AdjustmentPause] = []
    for run in range(args.runs):
        log.info("run %d of %d (load average %s), in %s", run + 1, args.runs, load_average(), work / f"run{run}")
        found = run_job(args, run, work / f"run{run}")
        log.info("run %d: %s", run + 1, ", ".join(f"{p.action} {p.pause.pause_s:.2f} s" if p.pause else p.action
                                                  for p in found))  # fmt: skip
        for item in found if args.phases else []:
            print(f"run {run + 1}, {item.action} after step {item.step}:")
            print("\n".join(phase_lines(work / f"run{run}" / "steps", item.step)))
        pauses += found
    print(f"model {args.model} ({args.strategy}), schedule {args.schedule}, {args.runs} runs, load average now "
          f"{load_average()}")
    print("\n".join(summary(pauses)))
    if args.json is not None:
        args.json.write_text(json.dumps([p.as_dict() for p in pauses], indent=1))


if __name__ == "__main__":
    main()
