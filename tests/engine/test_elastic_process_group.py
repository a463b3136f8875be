"""ElasticProcessGroup between real processes: one default group, reconfigured through three generations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

WORKER = Path(__file__).with_name("process_group_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration  # real processes
def test_one_default_group_follows_grow_shrink_and_an_abort(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"p{index}.json" for index in range(3)]
    processes = [subprocess.Popen([sys.executable, str(WORKER), str(index), str(store.port), str(out)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for index, out in enumerate(outs)]
    for process in processes:
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output[-3000:]
    seen = [{int(g): o for g, o in json.loads(out.read_text()).items()} for out in outs]

    assert sorted(seen[0]) == [0, 1, 2] and sorted(seen[1]) == [0, 1] and sorted(seen[2]) == [1, 2]
    for generation, members in ((0, [0, 1]), (1, [0, 1, 2]), (2, [2, 0])):
        world = len(members)
        for rank, index in enumerate(members):
            observed = seen[index][generation]
            assert (observed["rank"], observed["world"], observed["backend"]) == (rank, world, "gloo")
            assert observed["default_is_group"]
            assert observed["sum"] == world * (world + 1) / 2
            assert observed["object"] == "from rank 0"
            assert observed["gathered"] == list(range(world))
            assert abs(observed["ddp_grad"] - 2 * (world + 1)) < 1e-12  # mean of 4·(rank+1)
