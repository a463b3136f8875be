"""What a SIGKILLed AM leaves behind and how the next one recovers: whole state files, stale temp files, the
adjustment journal one record behind or with a torn last line."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from lightning_elan.master import journal
from lightning_elan.master.server import ADJUSTMENTS_FILE, STATE_FORMAT, ApplicationMaster
from lightning_elan.master.state import JobState
from lightning_elan.master.store import FileStore
from lightning_elan.master.transitions import launching

JOB = "recovery"
RECORD_1 = {"job": JOB, "request_id": "r1", "generation": 1, "members": ["w0", "w1", "w2"]}
RECORD_2 = {"job": JOB, "request_id": "r2", "generation": 2, "members": ["w0", "w1"]}

# writes ever larger states in a loop: {"n": i, "pad": "x" * 50_000 * (i % 7)}
WRITER = """
import sys
from lightning_elan.master.store import FileStore
store = FileStore(sys.argv[1])
i = 0
while True:
    i += 1
    store.save({"n": i, "pad": "x" * 50_000 * (i % 7)})
"""


def test_a_store_sigkilled_while_writing_holds_a_whole_state(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    rng = random.Random(5)
    FileStore(path).save({"n": 0, "pad": ""})
    for _ in range(8):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=_env())
        time.sleep(0.4 + rng.uniform(0.0, 0.2))
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        state = FileStore(path).load()
        assert state is not None and len(state["pad"]) == 50_000 * (state["n"] % 7)
    FileStore(path).discard_partial_writes()
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_discard_partial_writes_removes_only_this_stores_temp_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "state.json")
    store.save({"a": 1})
    for name in (".state.json.abc.tmp", ".state.json.def.tmp", ".other.json.x.tmp", "keep.tmp"):
        (tmp_path / name).write_text("{")
    assert [p.name for p in store.discard_partial_writes()] == [".state.json.abc.tmp", ".state.json.def.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.json.x.tmp", "keep.tmp", "state.json"]
    assert store.load() == {"a": 1}


def test_repair_drops_a_torn_line_and_appends_the_missing_record(tmp_path: Path) -> None:
    path = tmp_path / ADJUSTMENTS_FILE
    path.write_text(json.dumps(RECORD_1) + "\n" + json.dumps(RECORD_2)[:17])
    assert journal.repair(path, RECORD_2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [RECORD_1, RECORD_2]
    assert not journal.repair(path, RECORD_2), "a journal that holds the record is left alone"


def test_repair_of_a_missing_or_complete_journal(tmp_path: Path) -> None:
    path = tmp_path / ADJUSTMENTS_FILE
    assert not journal.repair(path, None) and not path.exists()
    assert journal.repair(path, RECORD_1)
    assert path.read_text() == json.dumps(RECORD_1, separators=(",", ":")) + "\n"
    path.write_text(json.dumps(RECORD_1) + "\n")
    assert not journal.repair(path, RECORD_1)


def test_a_restarted_am_writes_the_record_its_predecessor_persisted_but_never_appended(tmp_path: Path) -> None:
    state = JobState(job=JOB)
    launching.start_job(state, 2)
    document = {"format": STATE_FORMAT, "job": JOB, "state": {**state.to_dict(), "last_adjustment": RECORD_1},
                "replies": []}
    FileStore(tmp_path / "state.json").save(document)
    (tmp_path / ADJUSTMENTS_FILE).write_text('{"job": "recov')
    ApplicationMaster(JOB, FileStore(tmp_path / "state.json"), state_dir=tmp_path, register=False)
    assert [json.loads(line) for line in (tmp_path / ADJUSTMENTS_FILE).read_text().splitlines()] == [RECORD_1]


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
