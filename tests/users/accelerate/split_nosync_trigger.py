"""A regression loop written from Accelerate's guides, without ``accumulate()``: ``split_batches=True`` (the loader's
batch is the global batch), gradient accumulation by hand with ``no_sync``, ``autocast``, a warm-up ``LambdaLR`` stepped
per optimizer step, the loss averaged with ``accelerator.reduce``, and early stopping with ``set_trigger`` /
``check_trigger`` once the held-out loss is low enough.

    python split_nosync_trigger.py --output_dir OUT [--num_epochs 8] [--stop_below 0.145]

Outputs under OUT: ``metrics.jsonl`` (the tracker: the reduced loss of every step, the held-out loss of every epoch,
the epoch the trigger fired), ``trained-<pid>.jsonl`` (samples of every applied step), ``final/`` (``save_model``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, Dataset
from training_utils import JsonLinesTracker, SampleLog, TrainingProgress

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, ACCUMULATE, GLOBAL_BATCH = 96, 2, 12


class Plane(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 4, generator=generator, dtype=torch.float64) * 2 - 1
        self.y = torch.sin(self.x @ torch.tensor([[1.0], [-2.0], [0.5], [1.5]], dtype=torch.float64))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor | int]:
        return {"x": self.x[index], "y": self.y[index], "idx": index}


def train(args: argparse.Namespace) -> None:
    args.output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True),
                                     log_with=[JsonLinesTracker(args.output_dir / "metrics.jsonl")])
    accelerator.init_trackers("split_nosync", {"accumulate": ACCUMULATE, "global_batch": GLOBAL_BATCH})
    set_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 6))
    train_loader = DataLoader(Plane(SAMPLES, 0), batch_size=GLOBAL_BATCH, shuffle=True)
    eval_loader = DataLoader(Plane(30, 1), batch_size=GLOBAL_BATCH)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    samples = SampleLog(args.output_dir)
    for epoch in accelerator.epochs(args.num_epochs):
        model.train()
        for step, batch in enumerate(train_loader):
            samples.add(batch.pop("idx").tolist())
            with accelerator.autocast():
                loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]) / ACCUMULATE
            if (step + 1) % ACCUMULATE != 0:
                with accelerator.no_sync(model):
                    accelerator.backward(loss)
                continue
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if accelerator.optimizer_step_was_skipped:  # a member of the job died: the step is trained again
                samples.step_skipped()
                continue
            samples.step_applied(epoch, progress.completed_steps, accelerator.process_index,
                                 accelerator.num_processes)
            reduced = accelerator.reduce(loss.detach() * ACCUMULATE, reduction="mean")
            accelerator.log({"train_loss": reduced.item(), "lr": scheduler.get_last_lr()[0]},
                            step=progress.completed_steps)
            progress.completed_steps += 1
        model.eval()
        total, count = torch.zeros((), dtype=torch.float64), 0
        for batch in eval_loader:
            batch.pop("idx")
            with torch.no_grad():
                errors = (model(batch["x"]) - batch["y"]) ** 2
            errors = accelerator.gather_for_metrics(errors)
            total, count = total + errors.sum(), count + len(errors)
        eval_loss = (total / count).item()
        accelerator.log({"eval_loss": eval_loss, "eval_samples": count, "epoch": epoch}, step=progress.completed_steps)
        if eval_loss < args.stop_below:
            accelerator.set_trigger()
        if accelerator.check_trigger():
            accelerator.log({"stopped_at_epoch": epoch}, step=progress.completed_steps)
            break
    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir / "final")
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--num_epochs", type=int, default=8)
    parser.add_argument("--stop_below", type=float, default=0.145)
    train(parser.parse_args())


if __name__ == "__main__":
    main()
