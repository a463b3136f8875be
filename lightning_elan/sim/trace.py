"""Read the Tiresias trace format: ``job_id,num_gpu,submit_time,iterations,model_name,duration,interval``."""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from lightning_elan.sim.errors import SimulationError

log = logging.getLogger(__name__)

TRACE_FIELDS = ("job_id", "num_gpu", "submit_time", "iterations", "model_name", "duration", "interval")
SHIPPED_TRACE = Path(__file__).parent / "data" / "tiresias_60_job.csv"


@dataclass(frozen=True)
class TraceJob:
    """One line of a Tiresias trace; times in seconds, ``duration`` measured at ``num_gpu`` GPUs."""

    job_id: int
    num_gpu: int
    submit_time: float
    iterations: int
    model_name: str
    duration: float
    interval: float


def read_tiresias_trace(path: str | Path) -> list[TraceJob]:
    """Parse a trace file; raise :class:`SimulationError` naming the file and line of the first bad record."""
    path = Path(path)
    if not path.is_file():
        raise SimulationError(f"trace file not found: {path}")
    rows = read_csv_rows(path, "trace")
    if not rows or tuple(cell.strip() for cell in rows[0]) != TRACE_FIELDS:
        raise SimulationError(f"{path}:1: header must be {','.join(TRACE_FIELDS)}")
    jobs = [_parse_row(path, number, row) for number, row in enumerate(rows[1:], start=2) if any(row)]
    if not jobs:
        raise SimulationError(f"{path}: no jobs")
    ids = [job.job_id for job in jobs]
    if len(set(ids)) != len(ids):
        raise SimulationError(f"{path}: duplicate job_id")
    log.debug("read %d jobs from %s", len(jobs), path)
    return jobs


def _parse_row(path: Path, number: int, row: list[str]) -> TraceJob:
    if len(row) != len(TRACE_FIELDS):
        raise SimulationError(f"{path}:{number}: expected {len(TRACE_FIELDS)} fields, got {len(row)}: {row!r}")
    cells = [cell.strip() for cell in row]
    try:
        job = TraceJob(
            job_id=int(cells[0]), num_gpu=int(cells[1]), submit_time=float(cells[2]), iterations=int(cells[3]),
            model_name=cells[4], duration=float(cells[5]), interval=float(cells[6]),
        )
    except ValueError as error:
        raise SimulationError(f"{path}:{number}: malformed line {','.join(cells)!r}: {error}") from None
    if not all(math.isfinite(value) for value in (job.submit_time, job.duration, job.interval)):
        raise SimulationError(f"{path}:{number}: submit_time, duration and interval must be finite numbers")
    if job.num_gpu < 1 or job.submit_time < 0 or job.duration <= 0 or not job.model_name:
        raise SimulationError(f"{path}:{number}: need num_gpu >= 1, submit_time >= 0, duration > 0 and a model name")
    return job


def read_csv_rows(path: Path, what: str) -> list[list[str]]:
    """The rows of a CSV file; :class:`SimulationError` when it cannot be read as text (binary, unreadable)."""
    try:
        with path.open(newline="", encoding="utf-8") as stream:
            return list(csv.reader(stream))
    except UnicodeDecodeError:
        raise SimulationError(f"{path}: not a {what} CSV (not UTF-8 text)") from None
    except (OSError, csv.Error) as error:
        raise SimulationError(f"{path}: cannot read the {what} ({error})") from None
