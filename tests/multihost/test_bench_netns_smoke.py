"""``python -m bench.netns_bandwidth`` runs end to end (tiny sizes, one repeat) and writes its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multihost.conftest import REPO_ROOT

pytestmark = [pytest.mark.multihost, pytest.mark.integration, pytest.mark.extended]  # a benchmark tool's check


def test_bench_netns_bandwidth_smoke(fake_hosts_available: None, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "bench.netns_bandwidth", "--sizes-mb", "0.5", "--repeat", "1", "--out-dir",
               str(tmp_path)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["placement"], r["mode"]) for r in rows} == {
        (p, m) for p in ("cross-host", "same host") for m in ("replication", "broadcast")}
    assert all(r["gb_per_s"]["median"] > 0 and r["repeats"] == 1 for r in rows)
    assert {r["interface"] for r in rows if r["placement"] == "cross-host"} == {"eth0"}
    assert "| 0.5 MB | replication |" in (tmp_path / "results.md").read_text()
