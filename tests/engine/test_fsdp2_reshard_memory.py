"""The memory bound of the live reshard (issue 24, "Reshard memory"): three real gloo processes reshard an FSDP2 MLP
whose full state (parameters and Adam's moments, about 192 MB) is far above the chunk (``fsdp2_reshard_memory_worker.
py``); each member's peak resident-set growth during the reshard is at most its new shard (parameters and optimizer
states), one chunk, one parameter's shard and a fixed allowance, and below the full state: no member ever holds a
copy of the whole model. The resharded state is the one-process reference's (within float32's rounding of the
gradient average).

The allowance (``ALLOWANCE``, 8 MB): what the process maps beside the tensors during its first reshard — the code of
torch and gloo paged in on first use (a joiner's first ``fully_shard``, ``DTensor`` and receive), gloo's pair buffers,
Python objects; measured at about 4 MB on a joiner, under 1 MB on a holder. The workers run with glibc's mmap and trim
thresholds fixed at 128 KB so that a freed tensor's pages go back to the system (by default glibc raises the mmap
threshold after a free and keeps freed heap pages resident: the resident set would then measure the allocator's cache,
not the reshard). The extra parameter shard: FSDP2 copies a short shard (the last rank's) into one padded to the
shard size, one parameter at a time (``fsdp_reshard._load_parameter``).

On the code before the bound (every tensor sent whole, every new shard received before any was loaded, every old
shard kept to the end) the joiner of ``grow-2-to-3`` grew by 89.6 MB for a 64.0 MB shard: over this bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.procs import free_port

pytestmark = pytest.mark.extended  # sharded training beyond its CI-tier checks

WORKER = Path(__file__).with_name("fsdp2_reshard_memory_worker.py")
CHUNK_MB, MB = 4, 1 << 20
ALLOWANCE = 8 * MB
TOLERANCE = 1e-6  # float32: FSDP2 averages the old mesh's gradients (3 ranks: (g+g+g)/3 is not always g); the
# reshard itself moves bytes (tests/engine/test_fsdp2_remesh.py: float64, exact)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize(("old", "new"), [("0,1", "0,1,2"), ("0,1,2", "0,1"), ("0,1", "0,2")],
                         ids=["grow-2-to-3", "shrink-3-to-2", "migrate-rank-1"])
def test_a_member_grows_by_at_most_its_new_shard_and_a_chunk_during_the_reshard(tmp_path: Path, old: str,
                                                                                 new: str) -> None:
    port, env = free_port(), {**os.environ, **MALLOC}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(port), old, new, str(CHUNK_MB),
                               str(tmp_path / f"rank{rank}.json")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for rank in range(3)]
    try:
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0, 0], "\n".join(outputs)
    results = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)}
    for rank, result in results.items():
        bound = result["new_shard"] + CHUNK_MB * MB + result.get("param_shard", 0) + ALLOWANCE
        assert result["growth"] <= bound, (rank, {key: value / MB for key, value in result.items()
                                                  if isinstance(value, int)})
        assert bound < result["full"] and result["growth"] < result["full"], (rank, result)  # never a full copy
    for rank in (int(rank) for rank in new.split(",")):
        assert results[rank]["error"] < TOLERANCE, (rank, results[rank])
        assert results[rank]["steps"] == [1.0], (rank, results[rank])
