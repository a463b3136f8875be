"""One trial of each fault-matrix cell beyond ``tests/integration/test_held_faults.py`` (which holds every step phase
with w1 as the victim): the phases only the Lightning front-end has (data loading with the loader's workers alive,
validation with ``sync_dist`` logging, ``ModelCheckpoint`` saving, the epoch end), rank 0 as the victim, and two
members killed within a second (the second during the recovery from the first); and the kills inside the library
that ``test_worker_faults.py`` does not make: at a coordination point, with an adjustment agreed, and a joiner still
warming up. The full matrix, several jittered
trials per cell: ``python -m tests.faults.matrix --trials N``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.faults.matrix import Cell, run_accelerate, run_library, run_lightning
from tests.integration.elastic_runs import RunResult

pytestmark = pytest.mark.integration

LIGHTNING_CELLS = [("data", "w1"), ("validation", "w1"), ("checkpoint", "w1"), ("checkpoint", "w0"), ("forward", "w0"),
                   ("vote", "w0"), ("validation", "w0"), ("epoch_end", "w1"), ("forward", "w1+w2")]


@pytest.mark.parametrize(("phase", "victim"), LIGHTNING_CELLS, ids=[f"{p}-{v}" for p, v in LIGHTNING_CELLS])
def test_lightning_cell(tmp_path: Path, static_run: RunResult, phase: str, victim: str) -> None:
    run_lightning(Cell("lightning", phase, victim), tmp_path, static_run, random.Random(f"{phase}{victim}"))


@pytest.mark.parametrize("phase", ["forward", "vote"])
def test_accelerate_rank0_cell(tmp_path: Path, plain_runs: dict[int, RunResult], phase: str) -> None:
    run_accelerate(Cell("accelerate2", phase, "w0"), tmp_path, plain_runs, random.Random(phase))


LIBRARY_CELLS = [("coordination", "w0"), ("adjusting", "w0"), ("adjusting", "w1"), ("warming", "joiner")]


@pytest.mark.parametrize(("phase", "victim"), LIBRARY_CELLS, ids=[f"{p}-{v}" for p, v in LIBRARY_CELLS])
def test_library_cell(tmp_path: Path, static_run: RunResult, phase: str, victim: str) -> None:
    run_library(Cell("lightning", phase, victim), tmp_path, static_run, random.Random(f"{phase}{victim}"))
