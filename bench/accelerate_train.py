"""The benchmark's Accelerate workload: the same MLP and data as ``bench.train``, in an ordinary Accelerate loop.

``--launcher plain`` is a plain ``accelerate.Accelerator`` (processes started like torchrun: RANK, WORLD_SIZE,
MASTER_ADDR/PORT); ``--launcher elan`` an ``ElasticAccelerator`` under ``elan run``. Every worker appends its step
completion times to ``--steps-dir`` (``bench.workload.StepFile``); ``--step-sleep`` slows each step to leave room for
scheduled adjustments.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from bench.sizes import MODEL_SIZES
from bench.workload import RepeatedDataset, StepFile, build_mlp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_SIZES))
    parser.add_argument("--launcher", choices=("plain", "elan"), required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker at launch")
    parser.add_argument("--steps-dir", type=Path, required=True)
    parser.add_argument("--label", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    return parser.parse_args()


def make_accelerator(launcher: str) -> Accelerator:
    if launcher == "plain":
        return Accelerator(cpu=True)
    from lightning_elan.accelerate import ElasticAccelerator

    return ElasticAccelerator(cpu=True)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    accelerator = make_accelerator(args.launcher)
    model = build_mlp(MODEL_SIZES[args.model])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    dataset = RepeatedDataset(args.batch_size * 2 * (args.max_steps + 1))  # one epoch longer than the run
    loader = DataLoader(dataset, batch_size=args.batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = StepFile(args.steps_dir, args.label or args.launcher)
    epochs = accelerator.epochs(1) if args.launcher == "elan" else range(1)
    done = 0
    for _ in epochs:
        for x, y in loader:
            done = accelerator.optimizer_steps if args.launcher == "elan" else done
            if done >= args.max_steps:
                break
            if args.step_sleep:
                time.sleep(args.step_sleep)
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            steps.step(done, accelerator.num_processes, accelerator.process_index)
    steps.flush()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
