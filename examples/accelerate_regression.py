"""An ordinary Hugging Face Accelerate training loop made elastic: a small MLP regression on CPU.

    elan run --nproc 2 --job accel-demo --schedule "20:add=1,40:remove=rank:0,60:migrate=1" -- \\
        python examples/accelerate_regression.py
    python examples/accelerate_regression.py            # one process, like plain Accelerate

Add ``--accumulation 2`` for gradient accumulation and ``--weak`` to double the global batch (and ramp the LR) when
the job doubles in size. The main process prints one line per epoch with the world size it ended in.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_elan.accelerate import ElasticAccelerator, ElasticPlugin


def dataset(samples: int = 2048) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=generator)
    y = x @ torch.linspace(-1, 1, 16) + 0.1 * torch.randn(samples, generator=generator)
    return TensorDataset(x, y.unsqueeze(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--weak", action="store_true", help="weak scaling: the global batch follows the world size")
    args = parser.parse_args()
    plugin = ElasticPlugin(coordinate_every=5, scaling="weak" if args.weak else "strong", lr_ramp_steps=20)
    accelerator = ElasticAccelerator(cpu=True, gradient_accumulation_steps=args.accumulation, elastic_plugin=plugin)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)
    loader = DataLoader(dataset(), batch_size=32, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for epoch in accelerator.epochs(args.epochs):
        total, batches = torch.zeros(()), 0
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total, batches = total + loss.detach(), batches + 1
        mean = accelerator.reduce(total / max(batches, 1), reduction="mean")
        if accelerator.is_main_process:
            print(f"epoch {epoch}: loss {mean.item():.4f}, world {accelerator.num_processes}, "
                  f"step {accelerator.optimizer_steps}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
