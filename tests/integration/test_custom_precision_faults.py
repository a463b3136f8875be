"""A user's own precision plugin whose ``optimizer_step`` runs the closure itself and never calls Lightning's
``Precision._after_closure`` (``user_scripts/custom_precision.py``: it skips the update of a non-finite loss), real
``elan run``: a member SIGKILLed after its gradients were all-reduced, before its update, loses no step.

elan's commit vote runs in ``_after_closure``; such a plugin never called it, so no step was ever voted on: the
survivor applied the step and the recovery could not know it had. The vote now also runs right before the update
(the optimizer's step pre-hook) when ``_after_closure`` did not: the survivor meets the death there and the step is
redone, so the job ends as the static run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.fsdp_runs import assert_ok, elan_command, run_to_end
from tests.integration.test_hook_collective_faults import assert_killed_step_redone_exactly

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "custom_precision.py"
KILL_STEP = "5"


def run(home: Path, name: str, *args: str):
    command = [*elan_command(home, name, 2), "--", sys.executable, str(SCRIPT), str(home / "out"), *args]
    return run_to_end(command, home, 300)


def test_a_death_before_a_custom_plugins_update_redoes_the_step(tmp_path: Path) -> None:
    static = run(tmp_path / "static", "static")
    assert_ok(static)
    killed = run(tmp_path / "killed", "killed", "--kill-step", KILL_STEP)
    assert_killed_step_redone_exactly(killed, static, int(KILL_STEP))
