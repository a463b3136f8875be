"""A member killed in a training fit after the script's first (``scripts/fit_again_hparams.py`` calls ``trainer.fit``
again to train on): only a process's first training fit is elastic (README), so the job fails, and the survivor says
why in one error line before the collective's own error (found by ``random_kills.py --in-training``, seed 5600: the
survivor met the death in the barrier of its validation loader's setup, and its only words were gloo's "Connection
reset by peer")."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.users.corpus import Job, run_job

pytestmark = pytest.mark.integration

COMMAND = ("{scripts}/fit_again_hparams.py", "{out}")
LATER_FIT = "is past the job's elastic fit"


def test_a_member_killed_in_the_setup_of_a_second_fit_fails_the_job_saying_why(tmp_path: Path) -> None:
    run = run_job(tmp_path, Job("killed", COMMAND, kill="setup"), env={"USERS_KILL_FIT": "1"})
    assert [kill["phase"] for kill in run.kills()] == ["setup"]
    assert run.returncode != 0, run.excerpt()
    assert "[harness]" not in run.output, run.excerpt()  # no hang: the job ended by itself
    assert run.output.count(LATER_FIT) == 1, run.excerpt()
    assert run.output.index("`max_epochs=2` reached") < run.output.index(LATER_FIT)  # the first fit ended
