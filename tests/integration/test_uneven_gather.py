"""``elastic.gather.even_rows`` between real gloo processes: tensors whose first dimension differs are padded to the
longest (the shorter ones repeat their last row, an empty one is zeros) and can be gathered; tensors that differ in
another dimension are refused alike on every process; equal ones pass untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]

PROCESS = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from lightning_elan.elastic.gather import even_rows
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    seen = {}
    rows = [torch.arange(3.0) + 10 * rank, torch.arange(3.0), torch.zeros(0)][rank].reshape(-1, 1).repeat(1, 2)
    rows = rows[: [3, 2, 0][rank]]
    padded = even_rows(rows)
    gathered = [torch.empty_like(padded) for _ in range(3)]
    dist.all_gather(gathered, padded)
    seen["uneven"] = [t.tolist() for t in gathered]
    same = torch.full((2, 2), float(rank))
    seen["even_untouched"] = even_rows(same) is same
    try:
        even_rows(torch.zeros(2, 2 + rank))
    except ValueError as error:
        seen["refused"] = str(error)
    seen["scalar"] = even_rows(torch.tensor(1.0)).shape == ()
    dist.destroy_process_group()
    json.dump(seen, open(out, "w"))
""")


@pytest.mark.integration  # real processes
def test_uneven_first_dimensions_are_padded_and_other_differences_refused(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"p{rank}.json" for rank in range(3)]
    processes = [subprocess.Popen([sys.executable, "-c", PROCESS, str(rank), str(store.port), str(out)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank, out in enumerate(outs)]
    for process in processes:
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output[-3000:]
    seen = [json.loads(out.read_text()) for out in outs]
    expected = [[[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]],  # rank 0: its own 3 rows
                [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]],  # rank 1: 2 rows, the last repeated
                [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]]  # rank 2: none, zeros
    for view in seen:
        assert view["uneven"] == expected
        assert view["even_untouched"] and view["scalar"]
        assert "rank 0: (2, 2), rank 1: (2, 3), rank 2: (2, 4)" in view["refused"]
