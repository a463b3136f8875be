"""An elastic DDP follows the parameters its user freezes and unfreezes (``ddp_trainable_worker.py``, two real gloo
processes): a layer unfrozen after two steps, as Lightning's ``BackboneFinetuning`` does, is trained on the gradient
all-reduced over the processes — the ranks stay equal to each other and to a single-process run of DDP's arithmetic
(plain DDP keeps its construction-time set: each rank would train that layer on its own gradient, Lightning issue
20340) — also when the unfreeze falls in an accumulation window and when the layer is frozen again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

WORKER = Path(__file__).with_name("ddp_trainable_worker.py")
REPO = Path(__file__).resolve().parents[2]


def test_unfrozen_parameters_are_all_reduced_like_the_others(tmp_path: Path, store: dist.TCPStore) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    outs = [tmp_path / f"p{index}.json" for index in range(2)]
    processes = [subprocess.Popen([sys.executable, str(WORKER), str(index), str(store.port), str(out)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for index, out in enumerate(outs)]
    for process in processes:
        output, _ = process.communicate(timeout=180)
        assert process.returncode == 0, output[-3000:]

    results = [json.loads(out.read_text()) for out in outs]
    for name in ("view=False", "view=True"):
        first, second = (result[name] for result in results)
        assert first["parameters"] == second["parameters"], name  # bit for bit across the ranks
        assert first["difference"] < 1e-12 and second["difference"] < 1e-12, (name, first["difference"])
        # rebuilt at the unfreeze (step 2's forward) and at the refreeze (step 5's), nowhere else
        assert first["rebuilt"] == [False, False, True, False, False, False, True], first["rebuilt"]
