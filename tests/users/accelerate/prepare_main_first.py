"""A regression loop in the style of transformers' ``run_*_no_trainer.py`` examples: the main process prepares the
features inside ``accelerator.main_process_first()`` (as ``datasets.map`` is wrapped there: the main process
computes and caches, the others load the cache), ``DistributedDataParallelKwargs(find_unused_parameters=True)`` for a
model with a branch the loss does not use, a ``GradientAccumulationPlugin``, Accelerate's in-order logger, and an
evaluation split by ``split_between_processes`` and gathered with ``gather_for_metrics`` after every epoch.

    python prepare_main_first.py --output_dir OUT [--num_epochs 3] [--prepare_seconds 0]

``--prepare_seconds``: how long preparing the features takes (a tokenizer over a large corpus). Outputs under OUT:
``cache/features.pt`` (written once, by the main process, atomically), ``prepare.log`` (one line per process as it
enters and leaves the ``main_process_first`` block: ``enter|leave <process_index> <pid>``), ``metrics.jsonl`` (the
tracker: every step's loss, every epoch's evaluation error), ``trained-<pid>.jsonl`` (samples of every applied step),
``final/`` (``save_model``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin, set_seed
from torch.utils.data import DataLoader, Dataset
from training_utils import JsonLinesTracker, SampleLog, TrainingProgress

from lightning_elan.accelerate import ElasticAccelerator

logger = get_logger(__name__)
SAMPLES, BATCH, ACCUMULATE = 96, 3, 2


def prepare_features(cache: Path, seconds: float) -> None:
    """The expensive preprocessing, done once and cached (written to a temporary name, then renamed)."""
    time.sleep(seconds)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=generator, dtype=torch.float64)
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"x": x, "y": (x[:, :2].prod(1, keepdim=True) + x[:, 2:].sum(1, keepdim=True)).sin()}, partial)
    partial.rename(cache)


class Features(Dataset):
    def __init__(self, cache: Path) -> None:
        blob = torch.load(cache)
        self.x, self.y = blob["x"], blob["y"]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor | int]:
        return {"idx": index, "x": self.x[index], "y": self.y[index]}


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 16)
        self.auxiliary = torch.nn.Linear(16, 16)  # not in this loss: DDP must be told
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def note(path: Path, line: str) -> None:
    with open(path, "a") as file:
        file.write(line + "\n")


def load_features(accelerator: ElasticAccelerator, args: argparse.Namespace) -> Features:
    cache, log = args.output_dir / "cache" / "features.pt", args.output_dir / "prepare.log"
    note(log, f"enter {accelerator.process_index} {os.getpid()}")
    with accelerator.main_process_first():
        if accelerator.is_main_process and not cache.exists():
            prepare_features(cache, args.prepare_seconds)
        features = Features(cache)
    note(log, f"leave {accelerator.process_index} {os.getpid()}")
    return features


def evaluate(accelerator: ElasticAccelerator, model: torch.nn.Module, features: Features) -> float:
    model.eval()
    with torch.no_grad(), accelerator.split_between_processes(list(range(0, SAMPLES, 4))) as mine:
        errors = [float((model(features.x[i : i + 1]) - features.y[i : i + 1]).square().sum()) for i in mine]
    gathered = accelerator.gather_for_metrics(torch.tensor(errors, dtype=torch.float64))
    model.train()
    return float(gathered.sum()) / len(gathered)


def train(args: argparse.Namespace) -> None:
    args.output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(
        cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=ACCUMULATE),
        log_with=[JsonLinesTracker(args.output_dir / "metrics.jsonl")])
    logger.info(f"process {accelerator.process_index} of {accelerator.num_processes} starts",
                main_process_only=False, in_order=True)
    features = load_features(accelerator, args)
    accelerator.init_trackers("prepare_main_first", {"batch": BATCH, "accumulate": ACCUMULATE})
    set_seed(11)
    model = Regressor().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    loader = DataLoader(features, batch_size=BATCH, shuffle=True)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    samples = SampleLog(args.output_dir)
    for epoch in accelerator.epochs(args.num_epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                samples.add(batch.pop("idx").tolist())
                loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            if accelerator.optimizer_step_was_skipped:  # a member died: the step is trained again
                samples.step_skipped()
                continue
            samples.step_applied(epoch, progress.completed_steps, accelerator.process_index,
                                 accelerator.num_processes)
            accelerator.log({"train_loss": accelerator.reduce(loss.detach(), "mean").item()},
                            step=progress.completed_steps)
            progress.completed_steps += 1
        accelerator.log({"eval_error": evaluate(accelerator, model, features), "epoch": epoch},
                        step=progress.completed_steps)
    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir / "final")
    accelerator.end_training()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--prepare_seconds", type=float, default=0.0)
    train(parser.parse_args())
