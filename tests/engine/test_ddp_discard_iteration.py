"""``ElasticDistributedDataParallel.discard_iteration`` between three real gloo processes: after a member's death cut
an iteration short anywhere from its forward to its all-reduce, the survivors' next iterations equal a fresh DDP's
(``ddp_reset_worker.py`` runs the scenarios)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_elan import torch_compat
from lightning_elan.elastic.ddp import ElasticDistributedDataParallel

WORKER = Path(__file__).with_name("ddp_reset_worker.py")
REPO = Path(__file__).resolve().parents[2]
SCENARIOS = ("forward", "backward", "allreduce", "no_sync", "complete")


def test_survivors_redo_an_interrupted_iteration_as_a_fresh_ddp(tmp_path: Path, store: dist.TCPStore) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    outs = [tmp_path / f"p{index}.json" for index in range(3)]
    processes = [subprocess.Popen([sys.executable, str(WORKER), str(index), str(store.port), str(out)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for index, out in enumerate(outs)]
    for process in processes:
        output, _ = process.communicate(timeout=180)
        assert process.returncode == 0, output[-3000:]

    for survivor in (0, 1):
        results = json.loads(outs[survivor].read_text())
        assert sorted(results) == sorted(f"{s}/view={v}" for s in SCENARIOS for v in (False, True))
        for name, result in results.items():
            interrupted = not name.startswith("complete")
            assert (result["error"] is not None) == interrupted, (name, result)
            assert result["sync"] and result["grads_cleared"], (name, result)
            assert result["equal"] == [True, True], (name, result)  # bit for bit, two iterations after the discard
            assert result["buckets"] > 1, result


def test_a_discard_outside_any_iteration_keeps_training_as_before() -> None:
    """One process, no group: discarding twice in a row, then training, gives the gradients of a DDP never reset."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    reference.load_state_dict(model.state_dict())
    ddp = ElasticDistributedDataParallel(model, lambda: None)
    plain = ElasticDistributedDataParallel(reference, lambda: None)
    x = torch.randn(3, 4, dtype=torch.float64)
    ddp(x).sum().backward()
    ddp.discard_iteration()
    ddp.discard_iteration()
    assert all(parameter.grad is None for parameter in model.parameters())
    for _ in range(2):
        ddp(x).sum().backward()
        plain(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_a_scaler_forgets_the_stage_of_a_discarded_step() -> None:
    """``unscale_`` of the redone step works after the discarded step had unscaled its gradients."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    scaler.scale(parameter.sum()).backward()
    scaler.unscale_(optimizer)  # e.g. gradient clipping before the vote, then the step is discarded
    torch_compat.forget_scaler_step(scaler)
    optimizer.zero_grad()
    scaler.scale(parameter.sum()).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(parameter.detach(), torch.full((2,), 0.9))
    assert scaler.get_scale() == 4.0
