"""Kills at moments nobody picked (``random_kills.py``) on the Accelerate corpus' scripts, for a few fixed plans: a
random worker of the running job gets the signal a fraction of the static run's wall time after the launch, and the
job must keep what the corpus keeps — exit 0, the static run's final model within 1e-9, each step applied by one
world, each sample once per epoch, members bit-identical at every micro-batch. Where the signal lands varies with the
machine's load: the invariants are asserted, never the phase it hit."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from tests.users.accelerate.random_kills import GROW_SCHEDULE, SCRIPTS, run, static_run, verdict

pytestmark = pytest.mark.integration

PLANS = {  # name: (script, fraction of the static wall time, signal, schedule)
    "gpt2-fsdp-kill-with-a-joiner": ("gpt2_fsdp", 0.6, signal.SIGKILL, GROW_SCHEDULE),
    "bert-kill-mid-run": ("bert", 0.5, signal.SIGKILL, None),
    "nosync-term-with-a-joiner": ("nosync", 0.5, signal.SIGTERM, GROW_SCHEDULE),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("accelerate-random-kills")


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_a_signal_at_an_unpicked_moment_keeps_the_static_result(root: Path, plan: str) -> None:
    name, fraction, sig, schedule = PLANS[plan]
    span_s = static_run(root, name)
    home = root / plan
    returncode, note, _, victim = run(home, name, schedule, fraction * span_s, sig, random.Random(plan))
    assert victim is not None, f"no worker to signal: {note}"
    assert returncode == 0, f"{note}: exit {returncode}\n{(home / 'output.log').read_text()[-3000:]}"
    outcome = verdict(home, root / f"static-{name}", victim, SCRIPTS[name])
    assert outcome == "held", f"{note}: {outcome}"
