"""The benchmark's Accelerate workload: the same MLP, data and optimizer as ``bench.train``, in an ordinary
Accelerate loop, with the same command line (the subset an Accelerate loop needs), so the harness's runners start it
in place of ``bench.train`` (``bench/accelerate.py``).

``--launcher ddp`` is a plain ``accelerate.Accelerator`` (processes started like torchrun: RANK, WORLD_SIZE,
MASTER_ADDR/PORT); ``--launcher elan`` an ``ElasticAccelerator`` under ``elan run`` with a fixed global batch
(strong scaling). Every worker appends its step completion times to ``--steps-dir`` (``bench.workload.StepFile``).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from bench.sizes import MODEL_SIZES
from bench.workload import RepeatedDataset, StepFile, build_mlp, skip_teardown

STEP_FILE = "bench_step.txt"
LAUNCH_WORLD = 2  # elan jobs of the benchmark start with 2 workers; the per-worker batch is set for them


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--launcher", choices=("elan", "ddp"), required=True)
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_SIZES))
    parser.add_argument("--global-batch", type=int, default=48, help="samples per step over all workers")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--steps-dir", type=Path, required=True)
    parser.add_argument("--label", default="worker", help="prefix of this process's step file")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--epoch-steps", type=int, default=1000, help="global batches per epoch")
    parser.add_argument("--stop-file", type=Path, default=None, help="stop at the step this file names, once it exists")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of sleep added to every step")
    parser.add_argument("--stop-at-step", type=int, default=None, help="ddp: save_state to --checkpoint here, stop")
    parser.add_argument("--checkpoint", type=Path, default=None, help="ddp: the folder --stop-at-step saves to")
    parser.add_argument("--resume", type=Path, default=None, help="ddp: load_state from this folder first")
    return parser.parse_args(argv)


def make_accelerator(args: argparse.Namespace) -> Accelerator:
    cpu = args.accelerator == "cpu"
    if args.launcher == "ddp":
        return Accelerator(cpu=cpu)
    from lightning_elan.accelerate import ElasticAccelerator, ElasticPlugin

    return ElasticAccelerator(cpu=cpu, elastic_plugin=ElasticPlugin(global_batch_size=args.global_batch))


class StopFile:
    """The step written in ``path`` (the harness writes one a few steps ahead of every worker), once it exists."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._stop_at: int | None = None

    def reached(self, step: int) -> bool:
        if self._stop_at is None and self.path is not None and self.path.exists():
            text = self.path.read_text().strip()
            self._stop_at = int(text) if text else None
        return self._stop_at is not None and step >= self._stop_at


def epochs(accelerator: Accelerator, launcher: str) -> Iterable[int]:
    """Epochs enough for any run; an elastic joiner starts at the job's epoch."""
    return accelerator.epochs(10**6) if launcher == "elan" else range(10**6)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s: %(message)s")
    logging.getLogger("lightning_elan").setLevel(os.environ.get("BENCH_ELAN_LOG", "WARNING"))
    args = parse_args(argv)
    torch.manual_seed(0)
    accelerator = make_accelerator(args)
    launch_world = LAUNCH_WORLD if args.launcher == "elan" else accelerator.num_processes
    dataset = RepeatedDataset(args.global_batch * args.epoch_steps)
    loader = DataLoader(dataset, batch_size=max(1, args.global_batch // launch_world), shuffle=True)
    model = build_mlp(MODEL_SIZES[args.model])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    first = resume(accelerator, args.resume) if args.resume else 0
    train(args, accelerator, model, optimizer, loader, first)
    if args.accelerator == "gpu":
        torch.cuda.synchronize()
    accelerator.end_training()
    if args.launcher == "ddp":
        skip_teardown()


def resume(accelerator: Accelerator, folder: Path) -> int:
    """Stop-and-restart with a plain Accelerator: its own ``load_state``; returns the step the checkpoint is at."""
    accelerator.load_state(str(folder))
    return int((folder / STEP_FILE).read_text())


def save_and_stop(accelerator: Accelerator, folder: Path, step: int) -> None:
    """A durable checkpoint at ``step``: Accelerate's ``save_state`` (model, optimizer, RNG), then the step, fsynced."""
    started = time.perf_counter()
    accelerator.save_state(str(folder))
    if accelerator.is_main_process:
        with (folder / STEP_FILE).open("w") as file:
            file.write(str(step))
            file.flush()
            os.fsync(file.fileno())
    accelerator.wait_for_everyone()
    logging.getLogger(__name__).info("step %d: save_state %s in %.3f s; stopping", step, folder,
                                     time.perf_counter() - started)


def train(args: argparse.Namespace, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer,
          loader: DataLoader, first: int = 0) -> None:
    steps, stop = StepFile(args.steps_dir, args.label), StopFile(args.stop_file)
    elastic = args.launcher == "elan"
    done = first
    for _ in epochs(accelerator, args.launcher):
        for x, y in loader:
            if args.step_sleep:
                time.sleep(args.step_sleep)
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            done = accelerator.optimizer_steps + 1 if elastic else done + 1  # counted at the next batch boundary
            steps.step(done, accelerator.num_processes, accelerator.process_index)
            if args.stop_at_step is not None and done == args.stop_at_step:
                steps.flush()
                save_and_stop(accelerator, args.checkpoint, done)
                return
            if done >= args.max_steps or stop.reached(done):
                steps.flush()
                return
    steps.flush()


if __name__ == "__main__":
    main()
