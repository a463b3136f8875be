"""Fixtures of the multi-host tests: fake hosts (network namespaces on a bridge, ``hosts.py``), skipped with the reason
where they cannot be made (not root, no ``ip``/``unshare``/``nsenter``, the kernel refuses a namespace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.hosts import FakeHost, FakeHosts, FakeHostsUnavailable

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_TIMEOUT_S = 45.0

Spawn = Callable[..., subprocess.Popen]  # (host, role, args, env=None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/multihost/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.multihost)


@pytest.fixture(scope="session")
def fake_hosts_available() -> None:
    """Skip (with the reason) where fake hosts cannot be made: tried once per session with one host."""
    try:
        FakeHosts(1).close()
    except FakeHostsUnavailable as error:
        pytest.skip(f"no fake hosts here: {error}")


@pytest.fixture
def two_hosts(fake_hosts_available: None) -> Iterator[FakeHosts]:
    """Two fake hosts on a bridge; removed (with everything started in them) after the test."""
    with FakeHosts(2) as hosts:
        yield hosts


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker started in a fake host: this checkout first on the path, one thread."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("ELAN_", "GLOO_", "NCCL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


@pytest.fixture
def spawn(tmp_path: Path) -> Spawn:
    """``spawn(host, role, args)`` starts ``tests.multihost.workers ROLE`` in ``host``; its result goes to
    ``args["out"]`` (set here when missing), its output to a log next to it."""
    counter = iter(range(1000))

    def start(host: FakeHost, role: str, args: dict[str, Any], env: dict[str, str] | None = None) -> subprocess.Popen:
        args.setdefault("out", str(tmp_path / f"{role}{next(counter)}-{host.hostname}.json"))
        with open(args["out"] + ".log", "wb") as log:  # the child keeps its own descriptor
            return host.popen([sys.executable, "-m", "tests.multihost.workers", role, json.dumps(args)],
                              env or worker_env(), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)

    return start


def result_of(process: subprocess.Popen, args: dict[str, Any], timeout: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
    """Wait for a worker and return its JSON result; fail with its traceback or log otherwise."""
    out = Path(args["out"])
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.returncode != 0:
        err = out.with_name(out.name + ".err")
        detail = err.read_text() if err.exists() else Path(args["out"] + ".log").read_text()
        pytest.fail(f"worker {out.name} exited {process.returncode}:\n{detail}")
    return json.loads(out.read_text())
