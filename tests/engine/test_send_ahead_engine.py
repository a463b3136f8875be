"""``ELAN_SEND_AHEAD`` with real worker processes (the engine without a Trainer, ``engine_worker.py``): two members,
two joiners added one after the other over shared memory. With ``joiners`` every source writes into a segment it made
before the adjustment and the second adjustment's source reuses its segment; with ``off`` every source writes a new
one. Either way the training is exact (bit-identical on every worker at every step, equal to a static run) and no
segment is left behind."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.engine.test_elastic_engine import (
    _assert_bit_identical_at_every_step,
    _assert_exactly_once_per_epoch,
    _environment,
    _spawn,
    _static_run,
    job,  # noqa: F401 (the fixture)
)

WRITTEN = re.compile(r"bytes written into (made ahead|new) (\S+) in")


@pytest.mark.integration  # real processes
@pytest.mark.parametrize("mode", ["joiners", "off"])
def test_sources_write_into_segments_made_ahead_and_train_exactly(job, tmp_path: Path, monkeypatch,  # noqa: F811
                                                                  mode: str) -> None:
    am, store, client = job
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    for name, value in {"ELAN_SHM_DIR": str(shm_dir), "ELAN_SEND_AHEAD": mode, "ENGINE_WORKER_LOG": "DEBUG"}.items():
        monkeypatch.setenv(name, value)
    client.request("start_job", {"nproc": 2, "coordinate_every": 1})
    first = client.scale("add", count=1, at_step=3)["new_workers"][0]
    second = client.scale("add", count=1, at_step=12)["new_workers"][0]
    processes = [
        _spawn(tmp_path, _environment(am, store, "w0", "member", 0, 2)),
        _spawn(tmp_path, _environment(am, store, "w1", "member", 1, 2)),
        _spawn(tmp_path, _environment(am, store, first, "joiner")),
        _spawn(tmp_path, _environment(am, store, second, "joiner")),
    ]
    for process, _ in processes:
        assert process.wait(timeout=180) == 0, (tmp_path / "w0.log").read_text()[-3000:]
    results = {r["worker"]: r for r in (json.loads(out.read_text()) for _, out in processes)}

    assert {r["outcome"] for r in results.values()} == {"finished"}
    _assert_exactly_once_per_epoch(results.values())
    _assert_bit_identical_at_every_step(results.values())
    for worker, result in results.items():
        for mine, reference in zip(result["params"], _static_run(), strict=True):
            assert max(abs(a - b) for a, b in zip(mine, reference, strict=True)) < 1e-9, worker
    writes = [(log.stem, *match.groups()) for log in tmp_path.glob("*.log")
              for match in WRITTEN.finditer(log.read_text())]  # fmt: skip
    assert len(writes) == 2, writes  # one send per adjustment
    assert {kind for _, kind, _ in writes} == ({"made ahead"} if mode == "joiners" else {"new"})
    if mode == "joiners" and writes[0][0] == writes[1][0]:  # one source served both: the same segment, reused
        assert writes[0][2] == writes[1][2]
    assert list(shm_dir.iterdir()) == []
