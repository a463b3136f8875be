"""An ordinary Accelerate FSDP2 training loop (``python accelerate_fsdp2.py OUT [options]``), launched by
``test_accelerate_fsdp.py`` through `elan run`.

The loop is Accelerate's FSDP2 recipe, float64: ``FullyShardedDataParallelPlugin(fsdp_version=2)``, the model and its
Adam optimizer prepared together with the training DataLoader, ``accelerator.backward``, ``optimizer.step()``,
``save_state`` after epoch 1 into ``OUT/checkpoint`` (``--save``; ``--state-dict-type``: the plugin's, default
``SHARDED_STATE_DICT``), and at the end the full model gathered with ``accelerator.get_state_dict`` and written by the
main process (``OUT/final.pt``). ``--ddp``: the same loop without the plugin (the data-parallel reference with the same
global batches). ``--resume DIR``: ``load_state(DIR)`` before the loop. ``--evaluate``: after each epoch, the MSE over
the dataset through a second prepared loader (``model.eval()``, ``gather_for_metrics``), recorded per epoch.
``--units``: the plugin's size-based auto-wrap policy (``min_num_params=100``: the two larger ``Linear`` layers are
FSDP2 units of their own). ``--weak``: ``ElasticPlugin(scaling="weak", lr_ramp_steps=8)`` (a resize scales the global
batch, the LR ramps). ``--hsdp K``: ``ElasticPlugin(hsdp_group_size=K)``.

Test instrumentation, not part of the loop a user writes: ``--hold`` makes the main process wait before each step until
the workers of the scale requests due then are ready (so a resize lands at its scheduled step); ``--kill W:STEP``
(a comma list) makes worker ``W`` SIGKILL itself in the forward of its batch after ``STEP`` optimizer steps,
``--sigterm W:STEP`` send itself SIGTERM there; ``--eval-kill W:EPOCH:BATCH`` makes ``W`` SIGKILL itself before the
forward of its ``BATCH``-th evaluation batch after epoch ``EPOCH``. Each worker appends one line per trained batch
whose step stood (``optimizer_step_was_skipped`` false) to ``OUT/batches-<worker>.jsonl``, and writes
``OUT/record-<worker>.json`` at the end (whether it left, its steps, its parameters' type and local rows).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.utils.data import DataLoader, Dataset

from lightning_elan.accelerate import ElasticAccelerator, ElasticPlugin

SAMPLES, BATCH, EPOCHS = 96, 6, 3  # global batch 12 at 2 workers: 8 global batches per epoch


class Regression(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=generator, dtype=torch.float64)
        self.y = torch.randn(SAMPLES, 1, generator=generator, dtype=torch.float64)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).double()


def hold_for_joiners(accelerator: ElasticAccelerator, timeout_s: float = 240.0) -> None:
    """Rank 0: wait until every request due at the next step has its new workers ready (instrumentation)."""
    if not accelerator.is_main_process or "ELAN_AM_ADDRESS" not in os.environ:
        return
    from lightning_elan.protocol.client import AMClient

    step, deadline = accelerator.optimizer_steps + 1, time.monotonic() + timeout_s
    with AMClient(os.environ["ELAN_AM_ADDRESS"], os.environ["ELAN_JOB"]) as client:
        while time.monotonic() < deadline:
            due = [request for request in client.status()["pending"] if (request.get("at_step") or 0) <= step]
            if all(state == "ready" for request in due for state in request["worker_status"].values()):
                return
            time.sleep(0.1)
    raise TimeoutError(f"the joiners due at step {step} are not ready after {timeout_s} s")


def evaluate(accelerator: ElasticAccelerator, model: torch.nn.Module, loader: DataLoader, die_at: int = -1) -> float:
    """The mean squared error over the whole evaluation set (Accelerate's ``gather_for_metrics`` idiom)."""
    model.eval()
    errors = []
    with torch.no_grad():
        for batch, (_index, x, y) in enumerate(loader):
            if batch == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            errors.append(accelerator.gather_for_metrics((model(x) - y) ** 2))
    model.train()
    return torch.cat(errors).mean().item()


def mesh_shape(model: torch.nn.Module) -> list[int] | None:
    """The device mesh the model's parameters are sharded over (a DTensor's), None when they are plain tensors."""
    parameter = next(model.parameters())
    mesh = getattr(parameter, "device_mesh", None)
    return list(mesh.shape) if mesh is not None else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--kill", default=None)
    parser.add_argument("--sigterm", default=None)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--state-dict-type", default="SHARDED_STATE_DICT")
    parser.add_argument("--units", action="store_true")
    parser.add_argument("--weak", action="store_true")
    parser.add_argument("--evaluate", action="store_true")
    parser.add_argument("--eval-kill", default=None)
    parser.add_argument("--hsdp", type=int, default=None, help="ElasticPlugin(hsdp_group_size=...)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("ELAN_WORKER_ID", "alone")
    kills = {kill.split(":")[0]: int(kill.split(":")[1]) for kill in (args.kill or "").split(",") if kill}
    term_worker, term_step = (args.sigterm.split(":")[0], int(args.sigterm.split(":")[1])) if args.sigterm else \
        (None, -1)
    eval_kill = args.eval_kill.split(":") if args.eval_kill else [None, -1, -1]

    units = {"auto_wrap_policy": "size_based_wrap", "min_num_params": 100} if args.units else {}
    plugin = None if args.ddp else FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=args.state_dict_type,
                                                                  **units)
    options = {"scaling": "weak", "lr_ramp_steps": 8} if args.weak else {}
    if args.hsdp:
        options["hsdp_group_size"] = args.hsdp
    elastic = ElasticPlugin(**options) if options else None
    accelerator = ElasticAccelerator(cpu=True, fsdp_plugin=plugin, elastic_plugin=elastic)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = DataLoader(Regression(), batch_size=BATCH)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    evaluation = accelerator.prepare(DataLoader(Regression(), batch_size=5)) if args.evaluate else None
    val_mse: dict[int, float] = {}
    if args.resume:
        accelerator.load_state(args.resume)

    with open(args.out / f"batches-{worker}.jsonl", "a") as batches:
        for epoch in accelerator.epochs(EPOCHS):
            for index, x, y in data:
                if args.hold:
                    hold_for_joiners(accelerator)
                if kills.get(worker) == accelerator.optimizer_steps:
                    os.kill(os.getpid(), signal.SIGKILL)
                if worker == term_worker and accelerator.optimizer_steps == term_step:
                    os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice: the worker leaves the job
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                if not accelerator.optimizer_step_was_skipped and accelerator.sample_weight > 0:
                    batches.write(json.dumps({"epoch": epoch, "step": accelerator.optimizer_steps,
                                              "indices": index.tolist(), "world": accelerator.num_processes,
                                              "mesh": mesh_shape(model)}) + "\n")
                    batches.flush()
            if evaluation is not None:
                die_at = int(eval_kill[2]) if worker == eval_kill[0] and epoch == int(eval_kill[1]) else -1
                val_mse[epoch] = evaluate(accelerator, model, evaluation, die_at)
            if args.save and epoch == 1:
                accelerator.save_state(str(args.out / "checkpoint"))
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save({name: value.detach().clone() for name, value in state.items()}, args.out / "final.pt")
    record = {"worker": worker, "left": accelerator.has_left, "optimizer_steps": accelerator.optimizer_steps,
              "val_mse": val_mse,
              "units": sorted(type(module).__name__ for module in model.modules()
                              if type(module).__name__.startswith("FSDP")),
              "parameters": sorted({type(parameter).__name__ for parameter in model.parameters()}),
              "local_rows": [parameter.to_local().shape[0] for parameter in model.parameters()
                             if hasattr(parameter, "to_local")]}
    (args.out / f"record-{worker}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
