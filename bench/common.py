"""What every scenario driver shares: its settings, the step files it follows, the stop file it writes."""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.analysis import ProcessSteps, load_steps, max_step

log = logging.getLogger(__name__)

POLL_S = 0.02
STALL_S = 120.0  # an elan job whose step count does not move for this long is hung (stayers never stop for long)


class Stalled(RuntimeError):
    """No worker completed a step for ``STALL_S``: the job is hung (see the py-spy dump next to its logs)."""


@dataclass(frozen=True)
class Scenario:
    """One model's adjustment benchmark: ``cycles`` × (scale out 2→3, scale in 3→2, migrate one worker)."""

    model: str
    cycles: int = 2
    torchrun_cycles: int = 1  # (add a node, remove it) cycles per rendezvous backend
    actions: tuple[str, ...] = ("add", "remove", "migrate")  # one cycle, in order
    warmup_steps: int = 10
    settle_steps: int = 10  # steps after an adjustment before the next request (> the typical-step window)
    global_batch: int = 48
    accelerator: str = "cpu"  # "cpu" or "gpu"
    timeout_s: float = 600.0
    torchrun_ckpt_every: int = 10
    stop_margin_steps: int = 5
    workload: str = "bench.train"  # the training script's module: bench.train (Lightning), bench.accelerate_train


class Follower:
    """Reads a job's step files as it runs."""

    def __init__(self, steps_dir: Path) -> None:
        self.steps_dir = steps_dir

    def processes(self) -> list[ProcessSteps]:
        return load_steps(self.steps_dir) if self.steps_dir.exists() else []

    def max_step(self, started_after: float = float("-inf")) -> int:
        return max_step(process for process in self.processes() if process.start >= started_after)

    def wait_for_step(
        self, step: int, timeout_s: float, alive: Callable[[], bool], started_after: float = float("-inf"),
        stall_s: float | None = None,
    ) -> int:
        """Block until a process (started after ``started_after``) has completed ``step``; returns the max step.

        With ``stall_s``, raise :class:`Stalled` once no new step has been completed for that long.
        """
        deadline = time.monotonic() + timeout_s
        watch = StallWatch(self, stall_s)
        while True:
            current = self.max_step(started_after)
            if current >= step:
                return current
            watch.check(current)
            if not alive():
                raise RuntimeError(f"the job ended before step {step} (reached {current})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step} not reached in {timeout_s:.0f} s (reached {current})")
            time.sleep(POLL_S)


class StallWatch:
    """Raises :class:`Stalled` when the job's step count has not moved for ``stall_s`` (None: never)."""

    def __init__(self, follower: Follower, stall_s: float | None) -> None:
        self.follower = follower
        self.stall_s = stall_s
        self._last: tuple[int, float] | None = None

    def check(self, current: int | None = None) -> None:
        if self.stall_s is None:
            return
        current = self.follower.max_step() if current is None else current
        now = time.monotonic()
        if self._last is None or current != self._last[0]:
            self._last = (current, now)
        elif now - self._last[1] > self.stall_s:
            dump_stacks(self.follower)
            raise Stalled(f"no step completed for {self.stall_s:.0f} s (stuck after step {current}); "
                          f"stacks in {self.follower.steps_dir.parent / 'stall-stacks.txt'}")


def dump_stacks(follower: Follower) -> None:
    """``py-spy dump --native`` of every live worker, for the record of a hang (best effort)."""
    lines = []
    for process in follower.processes():
        if not Path(f"/proc/{process.pid}").exists():
            continue
        try:
            dump = subprocess.run(["py-spy", "dump", "--native", "--pid", str(process.pid)], capture_output=True,
                                  text=True, timeout=60)
            lines.append(f"### {process.worker} pid {process.pid}\n{dump.stdout}{dump.stderr}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            lines.append(f"### {process.worker} pid {process.pid}: no dump ({exc})")
    (follower.steps_dir.parent / "stall-stacks.txt").write_text("\n".join(lines))


def write_stop_file(path: Path, step: int) -> None:
    """Atomically tell every worker to stop at ``step``."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, path)
    log.debug("stop file %s: step %d", path, step)


def stop_margin(follower: Follower, minimum: int) -> int:
    """Steps of head room for the stop file: at least ``minimum`` and about one second of training."""
    processes = follower.processes()
    durations = []
    for process in processes:
        steps = process.steps[-20:]
        durations += [b.time - a.time for a, b in itertools.pairwise(steps) if b.time > a.time]
    if not durations:
        return minimum
    durations.sort()
    typical = durations[len(durations) // 2]
    return max(minimum, int(1.0 / max(typical, 1e-3)) + 1)
