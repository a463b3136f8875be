"""A member killed while the survivor's ``training_step`` has already counted the batch in the user's own attributes
(``scripts/step_counters.py``): an int, a float and a tensor the LightningModule keeps, and a callback's counts. The
redone window must not count its abandoned attempt: the counters and the final state are the static run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.users.corpus import (
    TOLERANCE,
    Job,
    Run,
    assert_ok,
    assert_states_close,
    last_attempts,
    run_job,
)

pytestmark = pytest.mark.integration

COMMAND = ("{scripts}/step_counters.py", "{out}")
# 96 samples, a global batch of 12: 8 batches an epoch, windows of 2 batches, 4 optimizer steps an epoch. Rank 1 dies
# as the first micro-batch of the window at step 5 starts: the survivor trains that micro-batch alone (no gradient
# all-reduce under no_sync), meets the death in the second one's all-reduce and redoes the window from its first.


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_job(tmp_path_factory.mktemp("static"), Job("static", COMMAND))
    assert_ok(run)
    return run


def counters(run: Run) -> dict:
    return json.loads((run.out / "counters.json").read_text())


@pytest.mark.parametrize("kill", ["5:start", "6:backward"])
def test_a_redone_window_leaves_the_users_counters_as_the_static_run(tmp_path: Path, static: Run, kill: str) -> None:
    """The module's int, float and in-place tensor and the callback's per-epoch counts equal the static run's, and so
    does the final state (the int steers the loss's weight)."""
    run = run_job(tmp_path, Job("killed", COMMAND, kill=kill))
    assert_ok(run)
    assert [f"{k['step']}:{k['phase']}" for k in run.kills()] == [kill]
    assert [a["action"] for a in run.adjustments()] == ["failure"]
    assert last_attempts(run) == last_attempts(static)
    mine, theirs = counters(run), counters(static)
    assert theirs["batches_seen"] == 24 and theirs["per_epoch"] == [8, 8, 8], theirs
    for name in ("batches_seen", "per_epoch", "epochs", "step"):
        assert mine[name] == theirs[name], (name, mine, theirs)
    for name in ("weight_sum", "weight_trace"):
        assert abs(mine[name] - theirs[name]) <= TOLERANCE, (name, mine, theirs)
    assert_states_close(run.final_state(), static.final_state())
