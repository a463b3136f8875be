"""From the user's side: buffers a ``training_step`` updates (an EMA kept with ``register_buffer``, a counter
buffer replaced by assignment; BatchNorm's running statistics alike) when a member dies inside a step. The survivors
discard the step and redo it; before, their buffers kept the discarded attempt's update, so the step counted twice:
the EMA logged from the redone step on and the final one differed from the static run's (probe round 6: 3.1e-3 at
the end, the batch counter one too high), exit 0, no word. User script: ``user_scripts/ema_buffer.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.users.corpus import TOLERANCE, Job, assert_ok, assert_states_close, logged, read_csv, run_job

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parent / "user_scripts" / "ema_buffer.py"


def test_a_step_redone_after_a_death_updates_the_buffers_once(tmp_path: Path) -> None:
    command = (str(SCRIPT), "{out}")
    static = run_job(tmp_path / "static", Job("static", command))
    assert_ok(static)
    # rank 1 dies between the forward and the backward of step 5: rank 0 ran that training_step (its buffers updated)
    # and meets the death in the gradient all-reduce, so the step is discarded and redone
    elastic = run_job(tmp_path / "elastic", Job("elastic", (*command, "--die-at", "5")))
    assert_ok(elastic)
    assert (elastic.out / "died").exists(), "rank 1 never killed itself"
    assert [a["action"] for a in elastic.adjustments()] == ["failure"]
    assert "(step 6 redone)" in elastic.output
    final, expected = torch.load(elastic.out / "final.pt"), torch.load(static.out / "final.pt")
    assert int(final["seen"]) == int(expected["seen"]) == 16, (final["seen"], expected["seen"])
    assert_states_close(final, expected)
    _, expected_rows = read_csv(static.out / "logs" / "metrics.csv")
    _, rows = read_csv(elastic.out / "logs" / "metrics.csv")
    expected_ema, seen_ema = logged(expected_rows, "ema_norm"), logged(rows, "ema_norm")
    assert sorted(seen_ema) == sorted(expected_ema)
    for step, value in expected_ema.items():
        assert abs(seen_ema[step] - value) <= TOLERANCE, f"ema_norm at step {step}: {seen_ema[step]!r} != {value!r}"
