"""A small GAN in the classic ``pytorch_lightning`` package: manual optimization with two optimizers (the
discriminator, then the generator, each with ``toggle_optimizer``; as under DDP, that needs
``find_unused_parameters=True``), gradient clipping by hand, and ``self.all_gather``
to compute the discriminator's accuracy over the whole job. Each sample brings its own noise vector, so the run does
not depend on which process draws it.

    python gan_manual.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_elan.pytorch_lightning import ElanStrategy

NOISE = 4


class RingWithNoise(Dataset):
    """Points on a noisy ring (the real data), each with the generator's input for it."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(17)
        angle = torch.rand(size, generator=generator, dtype=torch.float64) * 2 * torch.pi
        radius = 1 + 0.1 * torch.randn(size, generator=generator, dtype=torch.float64)
        self.real = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
        self.noise = torch.randn(size, NOISE, generator=generator, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.real)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.real[index], self.noise[index]


class GAN(pl.LightningModule):
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lr = lr
        self.generator = torch.nn.Sequential(torch.nn.Linear(NOISE, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        self.discriminator = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.LeakyReLU(0.2),
                                                 torch.nn.Linear(16, 1))
        self.double()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        _, real, noise = batch
        g_opt, d_opt = self.optimizers()
        bce = torch.nn.functional.binary_cross_entropy_with_logits

        self.toggle_optimizer(d_opt)
        fake = self.generator(noise).detach()
        real_logits = self.discriminator(real)
        d_loss = (bce(real_logits, torch.ones_like(real_logits))
                  + bce(self.discriminator(fake), torch.zeros(len(fake), 1, dtype=fake.dtype))) / 2
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(d_opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        d_opt.step()
        self.untoggle_optimizer(d_opt)

        self.toggle_optimizer(g_opt)
        fake_logits = self.discriminator(self.generator(noise))
        g_loss = bce(fake_logits, torch.ones_like(fake_logits))
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)

        # the discriminator's accuracy on this step's real samples, over every process
        correct = torch.stack([(real_logits > 0).sum(), torch.tensor(len(real_logits))]).to(torch.float64)
        totals = self.all_gather(correct).reshape(-1, 2).sum(dim=0)
        self.log("d_real_acc", totals[0] / totals[1], rank_zero_only=True)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, sync_dist=True)

    def configure_optimizers(self) -> Any:
        g_opt = torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=(0.5, 0.9))
        d_opt = torch.optim.Adam(self.discriminator.parameters(), lr=self.lr, betas=(0.5, 0.9))
        return g_opt, d_opt


def main(out: Path) -> None:
    pl.seed_everything(21)
    # as with DDP: each backward leaves the other network's parameters without gradients
    strategy = ElanStrategy(find_unused_parameters=True)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=2, default_root_dir=out,
                         logger=CSVLogger(out / "logs", name="gan"), log_every_n_steps=1,
                         callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=8,
                                                    save_top_k=-1)],
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(GAN(), DataLoader(RingWithNoise(96), batch_size=6, shuffle=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
