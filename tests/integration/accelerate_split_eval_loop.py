"""An Accelerate loop in the style of Accelerate's ``complete_nlp_example.py`` (``python accelerate_split_eval_loop.py
OUT [--split-batches] [--plain]``, launched by ``test_accelerate_split_eval.py``): a float64 MLP, AdamW and a warm-up
``LambdaLR`` prepared with it, an evaluation with ``gather_for_metrics`` after every epoch and once more after the
``epochs()`` loop, on every process (as the example's final evaluation). 96 samples, ``DataLoader(batch_size=6)``:
6 samples per process, or with ``Accelerator(split_batches=True)`` 6 per step over all processes. ``--plain``: a plain
``Accelerator`` started like torchrun (the reference).

Every worker writes ``OUT/record-<worker>.json`` (samples trained per epoch, the LR of each step, its evaluations);
the main process writes ``OUT/final.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, Dataset

SAMPLES, EVAL_SAMPLES, BATCH, EPOCHS = 96, 37, 6, 3


class Points(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=generator, dtype=torch.float64)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        return {"idx": index, "x": self.x[index], "y": self.y[index]}


def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader) -> list:
    model.eval()
    indices, loss = [], 0.0
    with torch.no_grad():
        for batch in loader:
            index, error = accelerator.gather_for_metrics((batch["idx"], (model(batch["x"]) - batch["y"]) ** 2))
            indices += index.tolist()
            loss += float(error.sum())
    model.train()
    return [sorted(indices), loss]


def main(out: Path, split_batches: bool, plain: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = DataLoaderConfiguration(split_batches=split_batches, use_seedable_sampler=True, data_seed=7)
    if plain:
        accelerator = Accelerator(cpu=True, dataloader_config=config)
    else:
        from lightning_elan.accelerate import ElasticAccelerator

        accelerator = ElasticAccelerator(cpu=True, dataloader_config=config)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    model, optimizer, train, held_out, scheduler = accelerator.prepare(
        net, optimizer, DataLoader(Points(SAMPLES, 1), batch_size=BATCH, shuffle=True),
        DataLoader(Points(EVAL_SAMPLES, 2), batch_size=4), scheduler)
    record: dict = {"trained": {}, "lrs": [], "evaluations": []}
    for epoch in range(EPOCHS) if plain else accelerator.epochs(EPOCHS):
        for batch in train:
            accelerator.backward(torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if not accelerator.optimizer_step_was_skipped:
                record["trained"].setdefault(epoch, []).extend(batch["idx"].tolist())
                record["lrs"].append(optimizer.param_groups[0]["lr"])
        record["evaluations"].append(evaluate(accelerator, model, held_out))
    record["final_evaluation"] = evaluate(accelerator, model, held_out)
    worker = os.environ.get("ELAN_WORKER_ID", f"plain{os.environ.get('RANK', '0')}")
    record.update(worker=worker, left=getattr(accelerator, "has_left", False))
    (out / f"record-{worker}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), out / "final.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--split-batches" in sys.argv, "--plain" in sys.argv)
