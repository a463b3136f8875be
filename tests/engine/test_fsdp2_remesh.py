"""FSDP2 sharded again, in place, on another set of ranks (``fsdp2_remesh_worker.py``): the upstream behaviour the
elastic sharded strategy (issue 24) stands on, checked on the torch CI installs. Three real gloo processes: 2 → 3 (a
joiner that builds the module on meta and receives only its rows), 3 → 2 (a leaver), and a migration; after the
reshard the job trains on and every rank's full parameters equal one process that trained every batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.procs import free_port

pytestmark = pytest.mark.extended  # sharded training beyond its CI-tier checks

WORKER = Path(__file__).with_name("fsdp2_remesh_worker.py")
TOLERANCE = 1e-12


@pytest.mark.parametrize(("old", "new"), [("0,1", "0,1,2"), ("0,1,2", "0,1"), ("0,1", "0,2")],
                         ids=["grow-2-to-3", "shrink-3-to-2", "migrate-rank-1"])
def test_an_fsdp2_module_is_sharded_again_on_other_ranks_and_trains_on_exactly(tmp_path: Path, old: str,
                                                                                new: str) -> None:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(port), old, new,
                               str(tmp_path / f"rank{rank}.json")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(3)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], "\n".join(outputs)
    new_ranks = [int(rank) for rank in new.split(",")]
    results = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in new_ranks}
    for rank, result in results.items():
        assert result["error"] < TOLERANCE, (rank, result)
        assert result["steps"] == [4.0], (rank, result)  # Adam's step count came with the state
    first_layer_rows = [results[rank]["rows"]["0.weight"][0] for rank in new_ranks]
    assert sum(first_layer_rows) == 13 and max(first_layer_rows) == -(-13 // len(new_ranks)), first_layer_rows
    assert not any((tmp_path / f"rank{rank}.json").exists() for rank in range(3) if rank not in new_ranks)
