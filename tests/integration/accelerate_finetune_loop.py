"""An Accelerate fine-tuning loop as a user writes one (``python accelerate_finetune_loop.py OUT``, launched by
``test_accelerate_finetune.py`` through `elan run`): a float64 backbone and head, AdamW over every parameter; the
backbone frozen (``requires_grad_(False)``) in the first epoch and unfrozen from the second; at step 12 the head's
weights pruned by 30% with torch's ``prune.l1_unstructured`` (on the unwrapped model). 96 samples, 6 per process at 2
workers, 3 epochs: 24 steps. Rank 0 holds before each step until the joiners due then are ready.

The main process writes ``OUT/final.pt`` (the unwrapped model's ``state_dict``); every worker writes
``OUT/record-<worker>.json`` (the samples it trained per epoch, whether it left).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate_user_loop import hold_for_joiners
from torch.nn.utils import prune
from torch.utils.data import DataLoader, Dataset

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, BATCH, EPOCHS, PRUNE_AT = 96, 6, 3, 12


class Points(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 5, generator=generator, dtype=torch.float64)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh()).double()
        self.head = torch.nn.Linear(16, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True)
    torch.manual_seed(0)
    net = Net()
    net.backbone.requires_grad_(False)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.02)
    model, optimizer, data = accelerator.prepare(net, optimizer, DataLoader(Points(), batch_size=BATCH,
                                                                            shuffle=True))
    trained: dict[int, list[int]] = {}
    for epoch in accelerator.epochs(EPOCHS):
        accelerator.unwrap_model(model).backbone.requires_grad_(epoch >= 1)
        for index, x, y in data:
            hold_for_joiners(accelerator)
            if accelerator.optimizer_steps == PRUNE_AT:
                prune.l1_unstructured(accelerator.unwrap_model(model).head, "weight", amount=0.3)
            trained.setdefault(epoch, []).extend(index.tolist())
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    worker = os.environ.get("ELAN_WORKER_ID", "alone")
    (out / f"record-{worker}.json").write_text(json.dumps({"worker": worker, "trained": trained,
                                                           "left": accelerator.has_left}))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), out / "final.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
