"""Runtime overhead with no adjustment: steady-state steps/s of strategy="elan" (coordinate_every 1, 10, 50) against
Lightning's strategy="ddp" on the same script, 2 workers, runs interleaved (the order rotates every round)."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.analysis import load_steps, steps_per_second
from bench.procs import TRAIN_MODULE, Children, bench_env, train_command, wait_all
from bench.restart_runs import launch_ddp_set

log = logging.getLogger(__name__)

CONFIGS: tuple[tuple[str, int | None], ...] = (("ddp", None), ("elan", 1), ("elan", 10), ("elan", 50))
SKIP_STEPS = 30  # warm-up steps left out of the rate


@dataclass
class OverheadRun:
    strategy: str
    coordinate_every: int | None
    round: int
    steps_per_s: float

    @property
    def name(self) -> str:
        return "ddp" if self.coordinate_every is None else f"elan/{self.coordinate_every}"

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.name, "round": self.round, "steps_per_s": self.steps_per_s}


def rotated(configs: tuple[tuple[str, int | None], ...], round_index: int) -> list[tuple[str, int | None]]:
    shift = round_index % len(configs)
    return list(configs[shift:] + configs[:shift])


def parse_configs(text: str) -> tuple[tuple[str, int | None], ...]:
    """``"ddp,1,10,50"`` → ddp and elan at those coordination intervals."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    return tuple(("ddp", None) if item == "ddp" else ("elan", int(item)) for item in items)


def run_overhead(model: str, rounds: int, steps: int, out: Path, children: Children, accelerator: str = "cpu",
                 timeout_s: float = 600.0, configs: tuple[tuple[str, int | None], ...] = CONFIGS,
                 module: str = TRAIN_MODULE) -> list[OverheadRun]:
    """``rounds`` × every config (ddp = the workload's plain DDP launcher), in an order that rotates per round."""
    runs = []
    for round_index in range(rounds):
        for strategy, every in rotated(configs, round_index):
            name = "ddp" if every is None else f"elan{every}"
            run_dir = out / f"r{round_index}-{name}"
            rate = _one_run(strategy, every, model, steps, run_dir, children, accelerator, timeout_s, module)
            log.info("overhead round %d %s: %.2f steps/s", round_index, name, rate)
            runs.append(OverheadRun(strategy, every, round_index, rate))
    return runs


def _one_run(strategy: str, every: int | None, model: str, steps: int, run_dir: Path, children: Children,
             accelerator: str, timeout_s: float, module: str = TRAIN_MODULE) -> float:
    steps_dir = run_dir / "steps"
    args = ["--model", model, "--max-steps", str(steps), "--steps-dir", str(steps_dir)]
    if strategy == "ddp":
        procs = launch_ddp_set(children, 2, args, "ddp", run_dir, accelerator, module)
    else:
        devices = ["--devices", "cuda"] if accelerator == "gpu" else []
        command = [
            sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", f"overhead-{int(time.time())}",
            "--coordinate-every", str(every), "--state-dir", str(run_dir / "state"), *devices, "--",
            *train_command(*args, "--launcher", "elan", "--label", "elan", "--accelerator", accelerator, module=module),
        ]
        procs = [children.start(command, bench_env({"ELAN_HOME": str(run_dir / "home")}), run_dir / "elan-run.log")]
    try:
        codes = wait_all(procs, timeout_s, poll_s=0.2)
    finally:
        for proc in procs:
            children.stop(proc)
    if any(codes):
        raise RuntimeError(f"overhead run {run_dir.name} failed with {codes}")
    rates = [steps_per_second(process, SKIP_STEPS) for process in load_steps(steps_dir)]
    rates = [rate for rate in rates if rate is not None]
    if not rates:
        raise RuntimeError(f"overhead run {run_dir.name} recorded no steps")
    return min(rates)  # the job goes as fast as its slowest rank
