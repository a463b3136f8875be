"""Accelerate's ``examples/complete_cv_example.py``, as a user ports it to ``elan run``: the same loop (a small CNN
instead of ResNet-50 on pets, float64 made-up images), ``OneCycleLR`` stepped every batch, ``checkpointing_steps``
(``save_state("step_<n>")`` every N steps, or ``"epoch"``), ``--resume_from_checkpoint`` (``load_state``, then
``skip_first_batches`` for the rest of the interrupted epoch), accuracy with ``gather_for_metrics``,
``accelerator.print``, a tracker row per epoch, ``accelerator.save_model`` at the end. What changed for ``elan run``:
``ElasticAccelerator``, ``for epoch in accelerator.epochs(...)``, and ``overall_step`` read from
``accelerator.optimizer_steps`` rather than counted in a local (a joiner's local would start at 0: its
``step_<n>`` names and its ``save_state`` calls would not be the job's). ``--local_step_counter`` keeps the
example's local ``overall_step`` (what a user who did not read that far runs).

    python cv_example_resume.py --output_dir OUT [--checkpointing_steps 5|epoch] [--resume_from_checkpoint DIR]
        [--num_epochs 3] [--local_step_counter]

Outputs under OUT: ``metrics.jsonl`` (the tracker), ``trained-<pid>.jsonl`` (samples of every applied step),
``step_<n>``/``epoch_<n>`` (``save_state``), ``final/`` (``save_model``).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from training_utils import JsonLinesTracker, SampleLog

from lightning_elan.accelerate import ElasticAccelerator

IMAGES, CLASSES = 144, 4


class Pets(Dataset):
    """Made-up 3x8x8 images of 4 classes, each item a dict with its ``idx`` (as the example's ``PetsDataset`` items
    carry ``image`` and ``label``)."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (size,), generator=generator)
        self.images = torch.randn(size, 3, 8, 8, generator=generator, dtype=torch.float64)
        self.images[:, self.labels % 3] += 0.5 * (self.labels.view(-1, 1, 1) + 1).double()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor | int]:
        return {"image": self.images[index], "label": self.labels[index], "idx": index}


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, CLASSES)).double()


def training_function(args: argparse.Namespace) -> None:
    args.output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True, log_with=[JsonLinesTracker(args.output_dir / "metrics.jsonl")],
                                     project_dir=str(args.output_dir))
    lr, num_epochs, seed, batch_size = 3e-2, args.num_epochs, 42, 6
    checkpointing_steps = int(args.checkpointing_steps) if args.checkpointing_steps.isdigit() else \
        args.checkpointing_steps
    accelerator.init_trackers("cv_example", {"lr": lr, "num_epochs": num_epochs, "batch_size": batch_size})
    set_seed(seed)
    train_dataloader = DataLoader(Pets(IMAGES, 0), shuffle=True, batch_size=batch_size)
    eval_dataloader = DataLoader(Pets(40, 1), shuffle=False, batch_size=5)
    model = make_model()
    mean = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)[None, :, None, None]
    std = torch.tensor([1.1, 1.2, 1.3], dtype=torch.float64)[None, :, None, None]
    optimizer = torch.optim.Adam(params=model.parameters(), lr=lr / 25)
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer=optimizer, max_lr=lr, epochs=num_epochs,
                                                       steps_per_epoch=len(train_dataloader))
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    overall_step = 0
    starting_epoch = 0
    resume_step = None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        training_difference = os.path.splitext(os.path.basename(args.resume_from_checkpoint))[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
        else:
            resume_step = int(training_difference.replace("step_", ""))
            starting_epoch = resume_step // len(train_dataloader)
            resume_step -= starting_epoch * len(train_dataloader)
    samples = SampleLog(args.output_dir)
    for epoch in accelerator.epochs(num_epochs):
        model.train()
        total_loss = 0
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            overall_step += resume_step
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            idx = batch.pop("idx")
            inputs = (batch["image"] - mean) / std
            outputs = model(inputs)
            loss = torch.nn.functional.cross_entropy(outputs, batch["label"])
            total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            samples.add(idx.tolist())
            if accelerator.optimizer_step_was_skipped:  # a member of the job died: the step is trained again
                samples.step_skipped()
                continue
            samples.step_applied(epoch, accelerator.optimizer_steps, accelerator.process_index,
                                 accelerator.num_processes)
            overall_step = overall_step + 1 if args.local_step_counter else accelerator.optimizer_steps + 1
            if isinstance(checkpointing_steps, int):
                output_dir = f"step_{overall_step}"
                if overall_step % checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, output_dir))
        model.eval()
        accurate = 0
        num_elems = 0
        for batch in eval_dataloader:
            batch.pop("idx")
            inputs = (batch["image"] - mean) / std
            with torch.no_grad():
                outputs = model(inputs)
            predictions = outputs.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["label"]))
            accurate_preds = predictions == references
            num_elems += accurate_preds.shape[0]
            accurate += accurate_preds.long().sum()
        eval_metric = accurate.item() / num_elems
        accelerator.print(f"epoch {epoch}: {100 * eval_metric:.2f}")
        accelerator.log({"accuracy": 100 * eval_metric, "train_loss": total_loss.item() / len(train_dataloader),
                         "eval_samples": num_elems, "epoch": epoch}, step=overall_step)
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir / "final")
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description="complete_cv_example.py under elan run")
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--checkpointing_steps", default="5")
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--local_step_counter", action="store_true")
    args = parser.parse_args()
    if args.resume_from_checkpoint and not re.search(r"(step|epoch)_\d+$", args.resume_from_checkpoint):
        parser.error("--resume_from_checkpoint names a step_<n> or epoch_<n> folder")
    training_function(args)


if __name__ == "__main__":
    main()
