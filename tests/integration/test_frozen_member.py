"""A member that stops answering while the others train: its process frozen (SIGSTOP, as a host that swaps, a
hypervisor pause or a debugger stop leave it), never dead.

Before, the others waited in the step's collective until its timeout, raised out of ``fit`` (the timeout read as
their own error) and died, and ``elan run`` waited for ever on the frozen one: the healthy workers gone, the job hung.
Now a collective that times out with no member said to have died asks the AM to fail the generation (``stalled``);
the members that answer recover, the frozen one does not check in and is declared dead after the timeout and
SIGKILLed by its launcher, and the job goes on without it: the interrupted step redone, every sample once, the final
state the static run's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.users.corpus import (
    Job,
    assert_members_agree,
    assert_ok,
    assert_same_samples,
    assert_states_close,
    read_run,
    run_job,
)

pytestmark = pytest.mark.integration

TIMEOUT_S = 10
COMMAND = ("{scripts}/short_timeout.py", "{out}", str(TIMEOUT_S))
FREEZE_AFTER_STEP = 4


def _pid_of(home: Path, worker: str) -> int | None:
    log = home / "output.log"
    found = re.search(rf"spawned {worker} \(member, rank \d+ of \d+, pid (\d+)\)", log.read_text()) if (
        log.exists()) else None
    return int(found.group(1)) if found else None


def _trained_steps(home: Path) -> int:
    run = read_run(home, Job("probe", ()), 0)
    return max((record["step"] for record in run.events("start")), default=-1)


def freeze_w1_while_training(home: Path) -> Callable[[subprocess.Popen], None]:
    """``run_job``'s ``during``: SIGSTOP w1 once the job trained past step ``FREEZE_AFTER_STEP``; it stays stopped
    (its launcher kills it, or the harness after the job)."""

    def freeze(launcher: subprocess.Popen) -> None:
        while launcher.poll() is None:
            pid = _pid_of(home, "w1")
            if pid is not None and _trained_steps(home) >= FREEZE_AFTER_STEP:
                os.kill(pid, signal.SIGSTOP)
                (home / "frozen.json").write_text(json.dumps({"pid": pid, "at": time.time()}))
                return
            time.sleep(0.02)

    return freeze


def test_a_frozen_member_is_declared_dead_and_the_job_goes_on_without_it(tmp_path: Path) -> None:
    static = run_job(tmp_path / "static", Job("frozen_static", COMMAND, nproc=3))
    assert_ok(static)
    home = tmp_path / "frozen"
    run = run_job(home, Job("frozen_member", COMMAND, nproc=3), during=freeze_w1_while_training(home))

    assert (home / "frozen.json").exists(), "the job ended before w1 could be frozen"
    assert_ok(run)
    adjustments = run.adjustments()
    assert [(a["action"], len(a["members"])) for a in adjustments] == [("failure", 2)], adjustments
    assert adjustments[0]["failure"]["dead"] == ["w1"]
    assert "did not check in after the failure" in run.output and "killing w1" in run.output
    assert "Traceback" not in run.output, run.excerpt()
    assert_same_samples(run, static, victims=frozenset({"w1"}))  # frozen after its step stood: trained, unrecorded
    assert_members_agree(run)
    assert_states_close(run.final_state(), static.final_state())


def test_a_member_frozen_after_the_training_is_killed_and_the_job_ends(tmp_path: Path) -> None:
    """w1 stops itself in ``on_fit_end`` (``$USERS_FREEZE``): nobody waits for it in a collective any more, so no
    timeout ends the wait. ``elan run`` kills it once it has been stopped for ``stopped_grace_s`` (30 s) after the
    other member exited with its training ended, and exits 0 (before: it waited on it for ever)."""
    static = run_job(tmp_path / "static", Job("after_fit_static", COMMAND))
    assert_ok(static)
    run = run_job(tmp_path / "frozen", Job("after_fit_frozen", COMMAND), env={"USERS_FREEZE": "fit_end"})

    assert [kill["phase"] for kill in run.kills()] == ["freeze:fit_end"]
    assert_ok(run)
    assert "has been stopped (SIGSTOP) for" in run.output and not run.adjustments()
    assert_same_samples(run, static)
    assert_states_close(run.final_state(), static.final_state())
