"""elan: one ``elan run`` job per model, scaled live by the harness acting as the scheduler.

The harness sends ``add 1`` / ``remove 1`` / ``migrate 1`` through the AM's client API once the job has trained a
few steps after the previous adjustment (like ``elan scale`` from another shell), so a joiner is started when it is
asked for and its start-up (process start → first step) is the time asynchronous coordination hides.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.analysis import Pause, ProcessSteps, load_steps, pause_around
from bench.common import STALL_S, Follower, Scenario, StallWatch, stop_margin, write_stop_file
from bench.procs import Children, bench_env, train_command
from lightning_elan.protocol.client import AMClient, AMError

log = logging.getLogger(__name__)



@dataclass
class ElanAdjustment:
    """One adjustment: the AM's record and what the workers' step files say about it."""

    action: str
    record: dict[str, Any]
    pause: Pause | None
    joiner_startup_s: list[float]
    requested_at: float
    joiner_first_step_s: list[float] = field(default_factory=list)  # the request → each joiner's first step

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "step": self.record.get("step"),
            "pause": self.pause.as_dict() if self.pause else None,
            "joiner_startup_s": self.joiner_startup_s,
            "bytes_replicated": self.record.get("bytes_replicated"),
            "am_pause_s": self.record.get("pause_s"),
            "am_joiner_startup_s": self.record.get("joiner_startup_s"),
            "requested_at": self.requested_at,
            "joiner_first_step_s": self.joiner_first_step_s,
        }


@dataclass
class ElanJob:
    model: str
    launched_at: float
    steps_dir: Path
    returncode: int
    adjustments: list[ElanAdjustment] = field(default_factory=list)

    def schedule(self) -> list[tuple[int, int]]:
        """(step, new world size) of every adjustment: the schedule stop-and-restart replays."""
        return [(int(a.record["step"]), len(a.record["members"])) for a in self.adjustments]

    def final_step(self) -> int:
        return max((p.max_step for p in load_steps(self.steps_dir)), default=-1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "launched_at": self.launched_at,
            "steps_dir": str(self.steps_dir),
            "returncode": self.returncode,
            "adjustments": [a.as_dict() for a in self.adjustments],
        }


def elan_command(scenario: Scenario, job: str, state_dir: Path, steps_dir: Path, stop_file: Path,
                 coordinate_every: int, max_steps: int, nproc: int = 2,
                 run_options: Sequence[str] = ()) -> list[str]:
    """``elan run`` of bench/train.py; ``run_options`` are extra ``elan run`` options (e.g. ``--replace-failed``)."""
    devices = ["--devices", "cuda"] if scenario.accelerator == "gpu" else []
    return [
        sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(nproc), "--job", job,
        "--coordinate-every", str(coordinate_every), "--state-dir", str(state_dir), *devices, *run_options, "--",
        *train_command(
            "--launcher", "elan", "--model", scenario.model, "--global-batch", str(scenario.global_batch),
            "--max-steps", str(max_steps), "--steps-dir", str(steps_dir), "--label", "elan",
            "--accelerator", scenario.accelerator, "--stop-file", str(stop_file), module=scenario.workload,
        ),
    ]


def run_elan_job(scenario: Scenario, out: Path, children: Children, coordinate_every: int = 10,
                 run_options: Sequence[str] = (),
                 before_request: Callable[[str, AMClient, Callable[[], bool]], None] | None = None) -> ElanJob:
    """Start 2 workers, then ``cycles`` × ``actions`` (add, remove, migrate), each after ``settle_steps``; analyse.
    ``run_options``: extra ``elan run`` options; ``before_request(action, client, alive)`` runs before each request."""
    job = f"bench-{scenario.model}-{int(time.time())}"
    out.mkdir(parents=True, exist_ok=True)
    steps_dir, state_dir, home = out / "steps", out / "state", out / "elan-home"
    stop_file = out / "stop"
    env = bench_env({"ELAN_HOME": str(home)})
    command = elan_command(scenario, job, state_dir, steps_dir, stop_file, coordinate_every, max_steps=10**7,
                           run_options=run_options)
    launched = time.time()
    proc = children.start(command, env, out / "elan-run.log")
    follower = Follower(steps_dir)
    requested: list[tuple[str, float]] = []
    try:
        alive = lambda: proc.poll() is None  # noqa: E731
        follower.wait_for_step(scenario.warmup_steps, scenario.timeout_s, alive, stall_s=STALL_S)
        client = AMClient(_am_address(job, home, scenario.timeout_s), job, timeout_s=5.0)
        try:
            for _ in range(scenario.cycles):
                for action in scenario.actions:
                    if before_request is not None:
                        before_request(action, client, alive)
                    requested.append((action, _scale(client, action)))
                    record = _wait_for_adjustment(state_dir, len(requested), scenario.timeout_s, alive,
                                                  StallWatch(follower, STALL_S))
                    follower.wait_for_step(int(record["step"]) + scenario.settle_steps, scenario.timeout_s, alive,
                                           stall_s=STALL_S)
        finally:
            client.close()
        write_stop_file(stop_file, follower.max_step() + stop_margin(follower, scenario.stop_margin_steps))
        returncode = proc.wait(scenario.timeout_s)
    finally:
        children.stop(proc)
    result = ElanJob(scenario.model, launched, steps_dir, returncode)
    result.adjustments = analyse_elan(load_steps(steps_dir), _records(state_dir), requested)
    return result


def _am_address(job: str, home: Path, timeout_s: float) -> str:
    path = home / "jobs" / f"{job}.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no registry file {path}")
        time.sleep(0.05)
    return str(json.loads(path.read_text())["address"])


def _scale(client: AMClient, action: str) -> float:
    """Send ``action 1``; an adjustment still in flight is retried."""
    while True:
        try:
            client.scale(action=action, count=1)
            return time.time()
        except AMError as exc:
            if "in flight" not in str(exc):
                raise
            time.sleep(0.05)


def _records(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "adjustments.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait_for_adjustment(
    state_dir: Path, count: int, timeout_s: float, alive: Any, watch: StallWatch | None = None
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        records = _records(state_dir)
        if len(records) >= count:
            return records[count - 1]
        if watch is not None:
            watch.check()
        if not alive():
            raise RuntimeError(f"elan job ended with {len(records)} of {count} adjustments done")
        if time.monotonic() > deadline:
            raise TimeoutError(f"adjustment {count} not completed in {timeout_s:.0f} s")
        time.sleep(0.05)


def analyse_elan(
    processes: list[ProcessSteps], records: list[dict[str, Any]], requested: list[tuple[str, float]]
) -> list[ElanAdjustment]:
    by_worker: dict[str, ProcessSteps] = {process.worker: process for process in processes}
    adjustments = []
    for record, (action, requested_at) in zip(records, requested, strict=False):
        joiners = set(record["joiners"])
        stayers = [by_worker[w] for w in record["members"] if w not in joiners and w in by_worker]
        startups = [by_worker[w].startup_s() for w in record["joiners"] if w in by_worker]
        firsts = [by_worker[w].first_step_time() for w in record["joiners"] if w in by_worker]
        adjustments.append(
            ElanAdjustment(
                action=action,
                record=record,
                pause=pause_around(stayers, stayers, int(record["step"])),
                joiner_startup_s=[s for s in startups if s is not None],
                requested_at=requested_at,
                joiner_first_step_s=[first - requested_at for first in firsts if first is not None],
            )
        )
    return adjustments
