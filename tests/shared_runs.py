"""Reference runs made once per test run and shared by its pytest-xdist workers.

A session fixture runs once per xdist worker: a static reference that files on both workers compare with would run
twice. :func:`shared_run` makes it under the run's directory (the parent of each worker's ``basetemp``, which
``tests/cores.py`` shares too) while holding a lock; the other worker waits for it and reads the result the first one
recorded. A reference that failed records nothing: the next worker to ask runs it again (and fails as loudly).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.elastic_runs import RunResult


def shared_run(factory: pytest.TempPathFactory, key: str, make: Callable[[Path], RunResult]) -> RunResult:
    """The run ``make(directory)`` returns, made once per test run under a directory named ``key``."""
    base = factory.getbasetemp()
    home = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "shared-runs"
    home.mkdir(parents=True, exist_ok=True)
    record = home / f"{key}.json"
    with open(home / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if record.exists():
            return _loaded(json.loads(record.read_text()))
        directory = home / key
        directory.mkdir(exist_ok=True)  # left by a failed attempt: the run writes under it again
        run = make(directory)
        record.write_text(json.dumps({"out": str(run.out), "state_dir": str(run.state_dir),
                                      "returncode": run.returncode, "output": run.output}))
        return run


def _loaded(fields: dict) -> RunResult:
    return RunResult(Path(fields["out"]), Path(fields["state_dir"]), fields["returncode"], fields["output"])
