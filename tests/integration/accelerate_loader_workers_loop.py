"""An Accelerate loop whose training DataLoader has worker processes with a slow ``worker_init_fn`` (a user's opens a
database or loads a tokenizer there): ``python accelerate_loader_workers_loop.py OUT``, launched by
``test_accelerate_loader_workers.py``. Each loader worker writes ``OUT/loader-<training worker>-<pid>`` when its init
starts; every training worker writes ``OUT/pid-<worker>``; the main process writes ``OUT/final.pt``. 48 samples,
6 per process at 2 workers, 2 epochs."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, BATCH, EPOCHS, INIT_S = 48, 6, 2, 3.0


class Points(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 4, generator=generator, dtype=torch.float64)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class SlowInit:
    def __init__(self, out: Path) -> None:
        self.out, self.worker = out, os.environ.get("ELAN_WORKER_ID", "alone")

    def __call__(self, worker_id: int) -> None:
        (self.out / f"loader-{self.worker}-{os.getpid()}").touch()
        time.sleep(INIT_S)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-{os.environ.get('ELAN_WORKER_ID', 'alone')}").write_text(str(os.getpid()))
    accelerator = ElasticAccelerator(cpu=True)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1).double()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = DataLoader(Points(), batch_size=BATCH, num_workers=2, worker_init_fn=SlowInit(out))
    model, optimizer, data = accelerator.prepare(net, optimizer, loader)
    for _epoch in accelerator.epochs(EPOCHS):
        for x, y in data:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), out / "final.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
