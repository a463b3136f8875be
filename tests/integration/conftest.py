"""Fixtures of the integration tests; the helpers they use are in ``elastic_runs.py`` (shared with ``tests/gpu``)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.accelerate_runs import EPOCHS as ACCELERATE_EPOCHS
from tests.integration.accelerate_runs import JOB_ARGS, plain_accelerate_run
from tests.integration.accelerate_runs import SAMPLES as ACCELERATE_SAMPLES
from tests.integration.elastic_runs import (
    PROBE_ARGS,
    RunResult,
    assert_counted_once,
    check_static_run,
    consumed_per_epoch,
    elan_command,
    elan_env,
    elan_run,
)
from tests.shared_runs import shared_run


@pytest.fixture(scope="session")
def static_run(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The static 2-worker run of the default probe job (``PROBE_ARGS``), run once per session: the reference every
    elastic run's final parameters must equal within ``TOLERANCE``."""
    return shared_run(tmp_path_factory, "static",
                      lambda directory: check_static_run(elan_run(directory, "static", 2, PROBE_ARGS)))


@pytest.fixture(scope="session")
def plain_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, RunResult]:
    """The static references of the Accelerate tests: a plain 2-process ``Accelerator`` run of
    ``accelerate_probe.py`` for each of ``JOB_ARGS`` (gradient accumulation 1; 2 with shuffling and loader workers),
    run once per session."""
    return {accumulation: shared_run(tmp_path_factory, f"plain-accelerate-{accumulation}",
                                     lambda directory, args=args: _checked_plain_run(directory, args))
            for accumulation, args in JOB_ARGS.items()}


def _checked_plain_run(directory: Path, args: list[str]) -> RunResult:
    run = plain_accelerate_run(directory, "plain", 2, args)
    assert run.returncode == 0, run.excerpt()
    assert_counted_once(consumed_per_epoch(run.records()), ACCELERATE_SAMPLES, ACCELERATE_EPOCHS)
    return run


@pytest.fixture
def live_job(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen, dict]]]:
    """Start ``elan run`` of the probe script in the background: ``start(name, nproc, probe_args, schedule=None,
    coordinate_every=1)`` → ``(process, env)`` (``env`` points ``elan status/scale`` at it). A job still running at
    the end of the test is terminated."""
    jobs: list[subprocess.Popen] = []

    def start(name: str, nproc: int, probe_args: list[str], schedule: str | None = None,
              coordinate_every: int = 1, launcher_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict]:
        env = elan_env(tmp_path)
        command = elan_command(tmp_path, name, nproc, probe_args, schedule, coordinate_every, launcher_args)
        job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        jobs.append(job)
        return job, env

    yield start
    for job in jobs:
        if job.poll() is None:
            job.terminate()
            job.communicate(timeout=60)
