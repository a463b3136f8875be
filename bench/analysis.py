"""Pure analysis of per-worker step timestamps: job progress, adjustment pauses, start-up times, throughput.

A *pause* is measured where training progress stops, from the workers' own step completion times: the gap
between the last step of the old configuration and the first *new* step after it (a step number never completed
before), minus a typical step of the new configuration (the median of the following steps). Steps redone after a
restart from an older checkpoint (torchrun elastic) are inside that gap: they are not progress.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TYPICAL_WINDOW = 8  # steps after the adjustment whose median duration is "a typical step"


@dataclass
class StepRecord:
    step: int
    time: float
    world: int
    rank: int


@dataclass
class ProcessSteps:
    """One worker process's step file."""

    pid: int
    worker: str
    label: str
    spawn: float
    start: float
    steps: list[StepRecord] = field(default_factory=list)

    def first_step_time(self) -> float | None:
        return self.steps[0].time if self.steps else None

    def startup_s(self) -> float | None:
        """Process start (spawn) → end of its first training step."""
        first = self.first_step_time()
        return None if first is None else first - self.spawn

    def time_of(self, step: int, after: float = float("-inf")) -> float | None:
        """The first completion of ``step`` later than ``after``."""
        return next((record.time for record in self.steps if record.step == step and record.time > after), None)

    def last_time_of(self, step: int) -> float | None:
        times = [record.time for record in self.steps if record.step == step]
        return max(times) if times else None

    @property
    def max_step(self) -> int:
        return max((record.step for record in self.steps), default=-1)


@dataclass
class Pause:
    """One adjustment seen from the workers: ``pause_s = gap_s - typical_step_s`` (never negative)."""

    step: int
    gap_s: float
    typical_step_s: float
    pause_s: float
    redone_steps: int = 0
    restart_gap_s: float | None = None  # to the first step of any number (torchrun: redone ones included)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread | None:
        data = [float(value) for value in values if value is not None]
        if not data:
            return None
        return cls(statistics.median(data), min(data), max(data), len(data))


def load_steps(directory: Path) -> list[ProcessSteps]:
    """Every ``*.jsonl`` step file of a folder (a partially written last line is ignored)."""
    processes = []
    for path in sorted(directory.glob("*.jsonl")):
        lines = path.read_text().splitlines()
        if not lines:
            continue
        head = json.loads(lines[0])
        process = ProcessSteps(head["pid"], str(head["worker"]), path.stem.rsplit("-", 1)[0], head["spawn"], head["t"])
        for line in lines[1:]:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            process.steps.append(StepRecord(record["s"], record["t"], record["w"], record["r"]))
        processes.append(process)
    return processes


def max_step(processes: Iterable[ProcessSteps]) -> int:
    return max((process.max_step for process in processes), default=-1)


def progress_series(processes: Sequence[ProcessSteps], after: float = float("-inf")) -> dict[int, float]:
    """Job-level completion time of each step first completed after ``after``: the latest worker's time."""
    series: dict[int, float] = {}
    for process in processes:
        seen: set[int] = set()
        for record in process.steps:
            if record.time <= after or record.step in seen:
                continue
            seen.add(record.step)
            series[record.step] = max(series.get(record.step, record.time), record.time)
    return series


def pause_around(
    before: Sequence[ProcessSteps], after: Sequence[ProcessSteps], step: int, window: int = TYPICAL_WINDOW
) -> Pause | None:
    """The pause after ``step``, the last step the old configuration (``before``) completed.

    ``after`` are the processes of the new configuration (the same stayer processes for elan; new processes for a
    restart). Returns None when a step needed is missing (the job ended too early).
    """
    ends = [t for t in (process.last_time_of(step) for process in before) if t is not None]
    if not ends:
        return None
    t_before = max(ends)
    series = progress_series(after, after=t_before)
    if step + 1 not in series:
        return None
    following = [
        series[k + 1] - series[k] for k in range(step + 1, step + 1 + window) if k in series and k + 1 in series
    ]
    typical = statistics.median(following) if following else 0.0
    gap = series[step + 1] - t_before
    first_any = min(series.values())
    first_new_step = min(series)
    return Pause(
        step=step,
        gap_s=gap,
        typical_step_s=typical,
        pause_s=max(0.0, gap - typical),
        redone_steps=max(0, step + 1 - first_new_step),
        restart_gap_s=first_any - t_before,
    )


def job_pause(processes: Sequence[ProcessSteps], step: int, window: int = TYPICAL_WINDOW) -> Pause | None:
    """The pause after ``step`` on the job-wide clock: a step completes when the last rank training it completes it
    (leavers and joiners included), the gap runs from the job's ``step`` to its ``step + 1``."""
    return pause_around(processes, processes, step, window)


def split_at(processes: Iterable[ProcessSteps], when: float) -> tuple[list[ProcessSteps], list[ProcessSteps]]:
    """Processes started before ``when`` and those started at or after it."""
    processes = list(processes)
    return [p for p in processes if p.start < when], [p for p in processes if p.start >= when]


def steps_per_second(process: ProcessSteps, skip: int) -> float | None:
    """Steady-state rate of one process: steps after the first ``skip`` ones over the time they took."""
    records = process.steps[skip:]
    if len(records) < 2:
        return None
    return (len(records) - 1) / (records[-1].time - records[0].time)


def throughput_timeline(
    processes: Sequence[ProcessSteps], global_batch: int, origin: float, bin_s: float = 1.0
) -> tuple[list[float], list[float], list[float], list[int]]:
    """Samples/s in ``bin_s`` bins, and the world size at every step, over wall time since ``origin``.

    Returns ``(bin_centres, samples_per_s, step_times, world_sizes)``. Only the first completion of each step counts
    (a redone step is no progress).
    """
    series = progress_series(processes)
    worlds: dict[int, int] = {}
    for process in processes:
        for record in process.steps:
            worlds.setdefault(record.step, record.world)
    if not series:
        return [], [], [], []
    times = sorted((t - origin, step) for step, t in series.items())
    end = times[-1][0]
    bins = int(end / bin_s) + 1
    counts = [0] * bins
    for t, _ in times:
        counts[min(bins - 1, max(0, int(t / bin_s)))] += 1
    centres = [(index + 0.5) * bin_s for index in range(bins)]
    rates = [count * global_batch / bin_s for count in counts]
    return centres, rates, [t for t, _ in times], [worlds[step] for _, step in times]
