"""``scripts/download_in_prepare_data.py`` (a ``LightningDataModule`` whose ``prepare_data`` downloads once through a
temporary file it creates exclusively) under ``elan run --nproc 2 --schedule 3:add=1``: the joiner, started with the
job to warm up, runs the script from its top as local rank 0 of its own world and calls ``prepare_data`` while the
members' rank 0 downloads on the same host.

Found by probe round 9: the joiner's call met the download under way (``FileExistsError`` on the temporary file, or a
half-written file read) and died — a user's ordinary ``prepare_data`` broken by the joiner. Now the job's processes on
one host run the user's ``prepare_data`` one at a time: the joiner waits for the download and finds the data there.
"""

from __future__ import annotations

import json

import pytest

from tests.users.corpus import Job, assert_each_sample_once, assert_ok, run_job

pytestmark = pytest.mark.integration

COMMAND = ("{scripts}/download_in_prepare_data.py", "{out}")


def test_a_joiner_waits_for_the_members_download_in_prepare_data(tmp_path) -> None:
    run = run_job(tmp_path, Job("prepturn", COMMAND, schedule="3:add=1"))

    assert_ok(run)
    assert "Traceback" not in run.output, run.excerpt()
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3)], run.adjustments()
    calls = sorted((json.loads(line) for line in (run.out / "prepare_data.jsonl").read_text().splitlines()),
                   key=lambda call: call["entered"])
    assert len(calls) == 2, calls  # the members' local rank 0 and the joiner, both on this host
    assert [call["downloaded"] for call in calls] == [True, False], calls  # one download; the other found the file
    assert calls[0]["left"] <= calls[1]["entered"], calls  # one at a time
    assert_each_sample_once(run, {0: 96, 1: 96})
