"""A regression loop in the usual Accelerate shape around its data: the main process prepares the dataset (here: it
generates and writes it, as a download or a tokenisation pass would) while the others wait in
``accelerator.wait_for_everyone()``, then every process reads it; after ``prepare()`` the processes meet once more
before training (as transformers' ``*_no_trainer.py`` examples do around their set-up). Launch with
``elan run --nproc 2 --job regress -- python regress_prepared_on_main.py --output_dir OUT``.

Each epoch starts with a ``wait_for_everyone()`` and ends with a ``gather`` of each process's mean loss.
Writes ``OUT/data.pt`` (main process), ``OUT/preparing`` while it is being made, ``OUT/trained-<pid>.jsonl`` (the
samples of each applied step), ``OUT/epochs.jsonl`` (main process: how many processes the epoch's gather saw) and
``OUT/final.pt`` (the trained model, main process).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset
from training_utils import SampleLog  # kept next to the script

from lightning_elan.accelerate import ElasticAccelerator


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--preparation_seconds", type=float, default=0.0, help="how long making the data takes")
    parser.add_argument("--step_seconds", type=float, default=0.0, help="extra compute per step")
    return parser.parse_args()


def prepare_dataset(path: Path, samples: int, seconds: float) -> None:
    """What the main process alone does before training: make the data, written whole or not at all."""
    (path.parent / "preparing").write_text(str(os.getpid()))
    time.sleep(seconds)
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 8, generator=generator, dtype=torch.float64)
    y = (x @ torch.linspace(-1, 1, 8, dtype=torch.float64)).unsqueeze(1) + 0.1
    torch.save({"x": x, "y": y}, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def main() -> None:
    args = parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator()
    data_file = args.output_dir / "data.pt"
    if accelerator.is_main_process and not data_file.exists():
        prepare_dataset(data_file, args.samples, args.preparation_seconds)
    accelerator.wait_for_everyone()
    data = torch.load(data_file)
    dataset = TensorDataset(torch.arange(args.samples), data["x"], data["y"])

    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.wait_for_everyone()

    trained = SampleLog(args.output_dir)
    for epoch in accelerator.epochs(args.num_train_epochs):
        model.train()
        accelerator.wait_for_everyone()  # every process starts the epoch together
        losses = []
        for ids, x, y in loader:
            trained.add(ids.tolist())
            time.sleep(args.step_seconds)
            loss = torch.nn.functional.mse_loss(model(x), y)
            losses.append(loss.detach())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.optimizer_step_was_skipped:  # a member of the job died: the step is trained again
                trained.step_skipped()
                continue
            trained.step_applied(epoch, accelerator.optimizer_steps, accelerator.process_index,
                                 accelerator.num_processes)
        mean_loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float64)
        epoch_losses = accelerator.gather(mean_loss.reshape(1))  # each process's mean training loss of the epoch
        if accelerator.is_main_process:
            with (args.output_dir / "epochs.jsonl").open("a") as log:
                log.write(json.dumps({"epoch": epoch, "processes": len(epoch_losses)}) + "\n")

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), args.output_dir / "final.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
