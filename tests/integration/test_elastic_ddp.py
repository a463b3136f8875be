"""ElasticDistributedDataParallel in real processes: a joiner's first iteration all-reduces with stayers whose DDP
has run for a while, and the result is DDP's (regression: DDP rebuilds its bucket layout before the second forward,
so a joiner's first iteration used to sum elements of mismatched layouts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.elastic_runs import free_port

pytestmark = pytest.mark.integration
WORKER = Path(__file__).with_name("elastic_ddp_worker.py")


def test_joiner_first_iteration_matches_plain_ddp():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(3)]
    results = [proc.communicate(timeout=120) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in results]
    lines = [json.loads(line) for out, _ in results for line in out.splitlines()]
    assert len(lines) == 6
    for step in range(2):
        rows = [line for line in lines if line["step"] == step]
        assert len({json.dumps(row["elastic"]) for row in rows}) == 1, f"step {step}: ranks disagree"
        for row in rows:
            worst = max(abs(a - b) for a, b in zip(row["elastic"], row["plain"], strict=True))
            assert worst <= 1e-12, f"rank {row['rank']} step {step}: {worst:.3e} from DDP"
