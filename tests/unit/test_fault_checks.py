"""The storm and fault-matrix sample count: a killed worker's batch committed before it could log it counts once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.faults.checks import assert_each_sample_once, unfinished_batch


def _write(path: Path, entries: list[dict]) -> None:
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))


def _job(out: Path, killed_after_vote: bool) -> None:
    """Two workers, 8 samples, one epoch of two steps; w1 is killed in the second step. Started batches are logged
    with the steps done before them, completed ones with the steps done after them (the probe's logs)."""
    _write(out / "training-w0.jsonl", [{"epoch": 0, "step": 0, "indices": [0, 1]},
                                       {"epoch": 0, "step": 1, "indices": [4, 5]}])
    _write(out / "completed-w0.jsonl", [{"epoch": 0, "step": 1, "indices": [0, 1]},
                                        {"epoch": 0, "step": 2, "indices": [4, 5]}])
    _write(out / "training-w1.jsonl", [{"epoch": 0, "step": 0, "indices": [2, 3]},
                                       {"epoch": 0, "step": 1, "indices": [6, 7]}])
    _write(out / "completed-w1.jsonl", [{"epoch": 0, "step": 1, "indices": [2, 3]}])
    (out / "record-w0.json").write_text("{}")
    if not killed_after_vote:  # the survivor redid the step alone: it trained w1's samples too
        _write(out / "completed-w0.jsonl", [{"epoch": 0, "step": 1, "indices": [0, 1]},
                                            {"epoch": 0, "step": 2, "indices": [4, 5, 6, 7]}])


def test_the_killed_workers_last_started_batch_is_the_unfinished_one(tmp_path: Path) -> None:
    _job(tmp_path, killed_after_vote=True)
    assert unfinished_batch(tmp_path, "w1") == {"epoch": 0, "step": 1, "indices": [6, 7]}
    assert assert_each_sample_once(tmp_path, 8, 1) == 1


def test_a_batch_the_survivors_redid_is_not_counted_again(tmp_path: Path) -> None:
    _job(tmp_path, killed_after_vote=False)
    assert assert_each_sample_once(tmp_path, 8, 1) == 0


def test_a_sample_missing_elsewhere_is_not_covered(tmp_path: Path) -> None:
    _job(tmp_path, killed_after_vote=True)
    _write(tmp_path / "completed-w0.jsonl", [{"epoch": 0, "step": 1, "indices": [0, 1]},
                                             {"epoch": 0, "step": 2, "indices": [4]}])
    with pytest.raises(AssertionError, match=r"missing \[5\]"):
        assert_each_sample_once(tmp_path, 8, 1)
