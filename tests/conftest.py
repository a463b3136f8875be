"""Shared by every test directory: the CI tier (``extended``), and at the end of the session, no process a test
started may still run.

The CI tier: a parametrized multi-process test (``integration``) runs its first case — every parameter at its first
value — under ``-m "not extended"`` (the README's test command, what CI runs); its other cases are marked ``extended``
and run with ``-m extended`` or a plain ``pytest``. A test marked ``every_case`` (the corpora of user scripts) runs all
its cases in the tier. The whole suite no longer fits CI's 90 minutes on the 2-core machine; each kind of fault and
each user script keeps a case in the tier. Whole files and tests are marked ``extended`` where they stand (the
benchmark tools' checks, throughput measurements, sharded training beyond its CI checks): README, "Tests".

A stray is a running process that is a descendant of this pytest process, or whose environment or command line names
this session's temporary directory (a job's ``ELAN_HOME``, a state directory, a script under ``tmp_path``: that finds
an orphan whose parent died, which is no descendant any more) or whose ``TMPDIR`` is this session's (below). Other
pytest sessions on this machine have their own temporary directories and are not descendants, so they are never
matched. Strays are given a moment to exit, then named, killed, and the session fails.

Files: the processes a test starts get ``TMPDIR`` set to a directory of this session's own, removed when it ends. torch
leaves a ``pymp-*`` directory in the temporary directory for every DataLoader worker it terminates rather than ends
(``persistent_workers`` at exit, a worker killed with its training process: about 130 a CI run); this process keeps
its own temporary directory (pytest's ``tmp_path`` lies there), and torch.compile's cache stays where it is shared.
"""

from __future__ import annotations

import getpass
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import processes
from tests.cores import cores

STRAY_GRACE_S = 3.0
"""A process the last teardown is still stopping gets this long before it counts as a stray."""

HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch._inductor.compile_worker")
"""Helpers that live as long as the pytest process that started them, by design."""


SCRATCH = pytest.StashKey[str]()
"""The children's ``TMPDIR``."""


def pytest_configure(config: pytest.Config) -> None:
    shared = tempfile.gettempdir()  # read (and kept by tempfile) before TMPDIR changes: this process's stays
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(shared, f"torchinductor_{getpass.getuser()}"))
    config.stash[SCRATCH] = tempfile.mkdtemp(prefix="elan-tests-tmp-")
    os.environ["TMPDIR"] = config.stash[SCRATCH]


def pytest_unconfigure(config: pytest.Config) -> None:
    scratch = config.stash.get(SCRATCH, None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # pluggy calls the deeper conftests' hooks first (tests/engine's marks its tests `integration`) and this one before
    # pytest's own, which deselects by `-m`
    for item in items:
        if _beyond_the_first_case(item):
            item.add_marker(pytest.mark.extended)


def _beyond_the_first_case(item: pytest.Item) -> bool:
    """A case of a parametrized ``integration`` test other than its first, unless the test runs ``every_case``."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or item.get_closest_marker("integration") is None:
        return False
    return item.get_closest_marker("every_case") is None and any(callspec.indices.values())


@pytest.fixture(autouse=True)
def _cores(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under ``pytest -n`` (pytest-xdist) a test marked ``solo`` runs with no other test beside it (``cores.py``)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    run_dir = tmp_path_factory.getbasetemp().parent  # one per run, shared by its xdist workers
    with cores(run_dir, alone=request.node.get_closest_marker("solo") is not None):
        yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    strays = _strays(session.config)
    if strays:
        strays = processes.wait_gone(strays, STRAY_GRACE_S)
    if not strays:
        return
    named = {pid: processes.command_line(pid) for pid in sorted(strays)}
    processes.kill(strays)
    _report(session.config, named)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _strays(config: pytest.Config) -> set[int]:
    """The running processes this session started (see the module docstring), helpers excepted."""
    me = os.getpid()
    found = processes.descendants(me)
    basetemp = _basetemp(config)
    if basetemp is not None:
        found |= processes.mentioning(f"{basetemp}{os.sep}")
    found |= processes.mentioning(f"TMPDIR={config.stash[SCRATCH]}\0")  # the whole value: an xdist worker's is longer
    found.discard(me)
    return {pid for pid in found if not any(helper in processes.command_line(pid) for helper in HELPERS)}


def _basetemp(config: pytest.Config) -> Path | None:
    """This session's temporary directory, if a test created one (asking for it would create it)."""
    factory = getattr(config, "_tmp_path_factory", None)
    return getattr(factory, "_basetemp", None)


def _report(config: pytest.Config, named: dict[int, str]) -> None:
    lines = [f"pid {pid}: {command or '?'}" for pid, command in named.items()]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        print("\n".join(["stray processes (killed):", *lines]))
        return
    reporter.ensure_newline()
    reporter.write_sep("=", f"{len(named)} stray process(es) still running after the tests: killed", red=True)
    for line in lines:
        reporter.write_line(line, red=True)
