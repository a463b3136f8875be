"""Kills at moments nobody picked (``random_kills.py``) on a user script, for a few fixed plans whose moments count
from a training step (so they land in about the same phase on a faster or slower machine): each run must keep what the
corpus keeps — exit 0, only the signalled workers declared dead, the static run's samples once per epoch, members
bit-identical at every step, the static run's final state (1e-9) and outputs (``validate``/``test`` results and every
prediction). Where a kill lands varies with the machine's load: the invariants are asserted, never the phase it hit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.users.corpus import Run
from tests.users.random_kills import GROW_SCHEDULE, Plan, check, plan_at, run_trial, static_run

pytestmark = pytest.mark.integration

SCRIPT = "evaluate_after_fit"
PLANS = {  # name: (the step the moments count from, seconds after it, signals, schedule)
    "kill-after-a-join-then-term": (4, (0.0, 0.7), ("KILL", "TERM"), GROW_SCHEDULE),
    "kill-late-in-training": (10, (0.0,), ("KILL",), None),
}


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, float]:
    return static_run(tmp_path_factory.mktemp("static"), SCRIPT, {})


@pytest.mark.parametrize("name", sorted(PLANS))
def test_kills_at_unpicked_moments_keep_the_static_result(static: tuple[Run, float], tmp_path: Path,
                                                           name: str) -> None:
    anchor_step, moments, signals, schedule = PLANS[name]
    plan: Plan = plan_at(sorted(PLANS).index(name), anchor_step, moments, signals, schedule)
    trial = run_trial(tmp_path, SCRIPT, plan, {})
    assert any(shot.pid is not None for shot in trial.shots), f"no shot hit a worker: {trial.shots}"
    failure = check(trial, static[0])
    assert failure is None, f"[{failure[0]}] {failure[1]}\nshots: {trial.shots}"
