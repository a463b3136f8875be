"""An Accelerate GAN-style loop (Accelerate's docs: several models and optimizers prepared together): per batch, the
discriminator's backward and step, then the generator's backward and step (``python accelerate_two_optimizers_loop.py
OUT [DIE_AT]``, launched by ``test_accelerate_two_optimizers.py``). With ``DIE_AT``, worker w1 SIGKILLs itself right
after the discriminator's step of that step, before the generator's backward. 96 samples, 6 per process, 2 epochs.
Every worker writes ``OUT/final-<worker>.pt`` (both networks) when its loop ends."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_elan.accelerate import ElasticAccelerator

SAMPLES, BATCH, EPOCHS = 96, 6, 2


class Points(Dataset):
    def __init__(self) -> None:
        self.x = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.x[index]


def main(out: Path, die_at: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    accelerator = ElasticAccelerator(cpu=True)
    worker = os.environ.get("ELAN_WORKER_ID", "alone")
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()
    discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    g_optimizer = torch.optim.Adam(generator.parameters(), lr=0.01)
    d_optimizer = torch.optim.Adam(discriminator.parameters(), lr=0.01)
    generator, discriminator, g_optimizer, d_optimizer, data = accelerator.prepare(
        generator, discriminator, g_optimizer, d_optimizer, DataLoader(Points(), batch_size=BATCH))
    softplus = torch.nn.functional.softplus
    for _epoch in accelerator.epochs(EPOCHS):
        for x in data:
            noise = torch.sin(x[:, :2] * 3)
            fake = generator(noise)
            accelerator.backward(softplus(-discriminator(x)).mean() + softplus(discriminator(fake.detach())).mean())
            d_optimizer.step()
            d_optimizer.zero_grad()
            if accelerator.optimizer_steps == die_at and worker == "w1":
                os.kill(os.getpid(), signal.SIGKILL)
            accelerator.backward(softplus(-discriminator(generator(noise))).mean())
            g_optimizer.step()
            g_optimizer.zero_grad()
            d_optimizer.zero_grad()
    torch.save({"generator": accelerator.unwrap_model(generator).state_dict(),
                "discriminator": accelerator.unwrap_model(discriminator).state_dict()}, out / f"final-{worker}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else -1)
