"""A curve fit with L-BFGS in an Accelerate loop: the closure runs the forward and ``accelerator.backward``, and
``optimizer.step(closure)`` evaluates it up to four times per step, updating the parameters between evaluations.

    python lbfgs_regression.py --output_dir OUT [--num_epochs 3]

Outputs under OUT: ``metrics.jsonl`` (the tracker: every step's first loss, reduced over the processes, and how many
times L-BFGS evaluated the closure), ``trained-<pid>.jsonl`` (samples of every applied step), ``final/``
(``save_model``). Float64.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from training_utils import JsonLinesTracker, SampleLog, TrainingProgress

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, BATCH_PER_PROCESS = 96, 6


class Curve(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 3, generator=generator, dtype=torch.float64) * 2 - 1
        self.y = torch.sin(2 * self.x[:, :1]) * self.x[:, 1:2] + 0.3 * self.x[:, 2:]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor | int]:
        return {"x": self.x[index], "y": self.y[index], "idx": index}


def train(args: argparse.Namespace) -> None:
    args.output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True, log_with=[JsonLinesTracker(args.output_dir / "metrics.jsonl")])
    accelerator.init_trackers("lbfgs", {"batch_per_process": BATCH_PER_PROCESS})
    set_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=6)
    train_loader = DataLoader(Curve(SAMPLES, 0), batch_size=BATCH_PER_PROCESS, shuffle=True)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    samples = SampleLog(args.output_dir)

    def fit_batch(batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """One L-BFGS step on the batch; the loss of each evaluation of the closure."""
        losses: list[torch.Tensor] = []

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            losses.append(loss.detach())
            return loss

        optimizer.step(closure)
        return losses

    for epoch in accelerator.epochs(args.num_epochs):
        model.train()
        for batch in train_loader:
            samples.add(batch.pop("idx").tolist())
            losses = fit_batch(batch)
            if accelerator.optimizer_step_was_skipped:  # a member of the job died: the step is trained again
                samples.step_skipped()
                continue
            samples.step_applied(epoch, progress.completed_steps, accelerator.process_index,
                                 accelerator.num_processes)
            first = accelerator.reduce(losses[0], reduction="mean")
            accelerator.log({"train_loss": first.item(), "evaluations": len(losses)}, step=progress.completed_steps)
            progress.completed_steps += 1
    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir / "final")
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--num_epochs", type=int, default=3)
    train(parser.parse_args())


if __name__ == "__main__":
    main()
