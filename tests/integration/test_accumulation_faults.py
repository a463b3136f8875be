"""A member SIGKILLed inside a Lightning gradient-accumulation window (``accumulate_grad_batches=2``, issue 27 item 4):
the survivors rewind to the window's first micro-batch — the loop's progress, the data position and the accumulated
gradients — and redo the whole step in the new generation, so the job ends exactly as the static run with the same
accumulation: exit 0, every sample once per epoch, bit-identical survivors, final parameters within 1e-9.

The hold step's first micro-batch is where the members hold; the victim dies there, and the survivors (except at
``optimizer``, the window's last micro-batch, after the step was committed) notice the death in the window's second
micro-batch (its ``sync_dist`` metric or its gradient all-reduce): the window's first micro-batch is then redone too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.elastic_runs import PROBE_ARGS, RunResult, elan_run
from tests.integration.held_faults import held_lightning_run
from tests.integration.worker_faults import assert_completed_once, check_fault_run

pytestmark = pytest.mark.integration

ACCUMULATION = ("--accumulate", "2")
HOLD_STEP = 3  # the fourth optimizer step: micro-batches 6 and 7 of epoch 0


@pytest.fixture(scope="module")
def static_accumulating(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    run = elan_run(tmp_path_factory.mktemp("static-accumulating"), "static", 2, [*PROBE_ARGS, *ACCUMULATION])
    assert run.returncode == 0, run.excerpt()
    assert_completed_once(run.out)
    return run


def expected_redone(phase: str) -> int:
    """Counted from 1: the held step, or the next once it was committed (``optimizer``: the window's last batch)."""
    return HOLD_STEP + (2 if phase == "optimizer" else 1)


@pytest.mark.parametrize("phase", ["metric", "allreduce", "vote", "batch_end", "optimizer"])
def test_a_death_inside_an_accumulation_window_redoes_the_whole_step(
        tmp_path: Path, static_accumulating: RunResult, phase: str) -> None:
    run, kill = held_lightning_run(tmp_path, "held", 3, f"w1:{HOLD_STEP}:{phase}", members=3,
                                   launcher_args=("--replace-failed",),
                                   probe_args=("--wait-for-joiners", *ACCUMULATION))

    assert kill.killed_at is not None, f"the members never all held (arrived: {kill.arrived})\n{run.excerpt()}"
    failures = check_fault_run(run, static_accumulating, dead=["w1"])
    assert failures[0]["failure"]["step_redone"] == expected_redone(phase), failures
