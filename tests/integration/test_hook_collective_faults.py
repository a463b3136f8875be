"""A member killed in ``on_before_optimizer_step`` while the others are in a collective of that hook — the user's
``self.log(grad_norm, sync_dist=True)``, or FSDP2's gradient clipping — loses no step
(``user_scripts/grad_norm_logged.py``, real ``elan run``, the victim SIGKILLing itself).

Before, the commit vote followed the backward: the survivor had voted, met the death in the hook's all-reduce, never
applied the update, and the recovery took the step as done — one step silently lost (the final model 1.5e-2 off, exit
0). The vote now comes after the hooks and the clipping, right before the update: the step is redone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.integration.fsdp_runs import assert_ok, elan_command, run_to_end

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "grad_norm_logged.py"
KILL_STEP = "5"


def run(home: Path, name: str, nproc: int, *args: str):
    command = [*elan_command(home, name, nproc), "--", sys.executable, str(SCRIPT), str(home / "out"), *args]
    return run_to_end(command, home, 300)


@pytest.mark.parametrize("options", [("--strategy", "elan"), ("--strategy", "elan_fsdp", "--clip", "0.5")],
                         ids=["elan", "elan_fsdp-clipped"])
def test_a_death_in_a_collective_of_on_before_optimizer_step_redoes_the_step(tmp_path: Path, options) -> None:
    static = run(tmp_path / "static", "static", 2, *options)
    assert_ok(static)
    killed = run(tmp_path / "killed", "killed", 2, *options, "--kill-step", KILL_STEP)
    assert_killed_step_redone_exactly(killed, static, int(KILL_STEP))


def assert_killed_step_redone_exactly(killed, static, kill_step: int) -> None:
    """The job that lost its victim (``OUT/killed``) at ``kill_step`` exited 0, redid that step, and ended with the
    static run's ``OUT/final.pt`` within 1e-9."""
    assert_ok(killed)
    assert (killed.out / "killed").exists()
    (failure,) = [a for a in killed.adjustments() if a["action"] == "failure"]
    assert failure["failure"]["step_redone"] == kill_step + 1, failure  # counted from 1: the killed step
    mine, theirs = torch.load(killed.out / "final.pt"), torch.load(static.out / "final.pt")
    for key, value in theirs.items():
        difference = (mine[key] - value).abs().max().item()
        assert difference <= 1e-9, f"{key}: {difference:.3e}"
