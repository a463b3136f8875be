"""Stop-and-restart: what a user without elasticity does, done honestly.

At each adjustment step every worker takes part in a full Lightning checkpoint (``trainer.save_checkpoint``: weights,
Adam state, loop progress), rank 0 fsyncs it, all workers stop cleanly, and once the last one has exited the harness
starts the new set of plain Lightning ``strategy="ddp"`` processes (MASTER_ADDR/PORT, RANK, WORLD_SIZE), which load
the checkpoint (``fit(ckpt_path=...)``) and train on. The pause runs from the last step of the old set to the first
step of the new set (minus a typical step).
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.analysis import Pause, ProcessSteps, load_steps, pause_around
from bench.common import Scenario
from bench.procs import LOOPBACK, TRAIN_MODULE, Children, bench_env, free_port, train_command, wait_all

log = logging.getLogger(__name__)


@dataclass
class RestartAdjustment:
    action: str
    step: int
    world: int
    pause: Pause | None
    relaunched_at: float

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "step": self.step, "world": self.world, "relaunched_at": self.relaunched_at,
                "pause": self.pause.as_dict() if self.pause else None}


@dataclass
class RestartJob:
    model: str
    launched_at: float
    steps_dir: Path
    adjustments: list[RestartAdjustment] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "launched_at": self.launched_at, "steps_dir": str(self.steps_dir),
                "adjustments": [a.as_dict() for a in self.adjustments]}


def launch_ddp_set(
    children: Children, world: int, args: list[str], label: str, out: Path, accelerator: str,
    module: str = TRAIN_MODULE, launcher: str = "ddp",
) -> list[subprocess.Popen]:
    """Start ``world`` plain DDP processes (Lightning's, or a plain Accelerator; ``launcher="model_parallel"``:
    Lightning's FSDP2 ``ModelParallelStrategy``) that rendezvous on a fresh loopback port."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = bench_env({
            "MASTER_ADDR": LOOPBACK, "MASTER_PORT": port, "WORLD_SIZE": str(world), "RANK": str(rank),
            "LOCAL_RANK": str(rank), "NODE_RANK": "0", "LOCAL_WORLD_SIZE": str(world),
            "BENCH_SPAWN_TIME": repr(time.time()),
        })
        command = train_command(*args, "--launcher", launcher, "--label", f"{label}-r{rank}", "--accelerator",
                                accelerator, module=module)
        procs.append(children.start(command, env, out / "logs" / f"{label}-r{rank}.log"))
    return procs


def run_restart_job(
    scenario: Scenario, schedule: list[tuple[str, int, int]], final_step: int, out: Path, children: Children,
    launcher: str = "ddp",
) -> RestartJob:
    """Replay ``schedule`` — (action, step, new world size) — by stopping and restarting; train to ``final_step``
    (``launcher="model_parallel"``: through a sharded DCP checkpoint directory, resharded on load)."""
    out.mkdir(parents=True, exist_ok=True)
    steps_dir, checkpoint = out / "steps", out / "checkpoint" / "restart.ckpt"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    common = ["--model", scenario.model, "--global-batch", str(scenario.global_batch), "--max-steps", str(final_step),
              "--steps-dir", str(steps_dir), "--checkpoint", str(checkpoint)]
    segments: list[tuple[str, int, int]] = [("start", 0, 2), *schedule]
    job = RestartJob(scenario.model, time.time(), steps_dir)
    relaunched: list[float] = []
    for index, (_action, _step, world) in enumerate(segments):
        args = list(common)
        if index + 1 < len(segments):
            args += ["--stop-at-step", str(segments[index + 1][1])]
        if index > 0:
            args += ["--resume", str(checkpoint)]
        relaunched.append(time.time())
        procs = launch_ddp_set(children, world, args, f"seg{index:02d}", out, scenario.accelerator,
                               scenario.workload, launcher)
        try:
            codes = wait_all(procs, scenario.timeout_s)
        finally:
            for proc in procs:
                children.stop(proc)
        if any(codes):
            raise RuntimeError(f"stop-and-restart segment {index} failed with exit codes {codes} (logs in {out})")
    job.adjustments = analyse_restart(load_steps(steps_dir), schedule, relaunched[1:])
    return job


def analyse_restart(
    processes: list[ProcessSteps], schedule: list[tuple[str, int, int]], relaunched: list[float]
) -> list[RestartAdjustment]:
    adjustments = []
    for index, ((action, step, world), when) in enumerate(zip(schedule, relaunched, strict=True)):
        before = [p for p in processes if p.label.startswith(f"seg{index:02d}-")]
        after = [p for p in processes if p.label.startswith(f"seg{index + 1:02d}-")]
        adjustments.append(RestartAdjustment(action, step, world, pause_around(before, after, step), when))
    return adjustments
