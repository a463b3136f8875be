"""An ordinary Lightning script, made elastic by two lines: `import lightning_elan` and `strategy="elan"`.

Run it with `elan run --nproc 2 --job demo -- python examples/train.py`, then, from another shell,
`elan scale --job demo add 1`, `elan scale --job demo remove rank:0`, `elan status --job demo`.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401  registers strategy="elan"


class Classifier(pl.LightningModule):
    def __init__(self, features: int = 32, classes: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, classes))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        accuracy = (self.net(x).argmax(dim=1) == y).float().mean()
        self.log("val_acc", accuracy, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def synthetic_blobs(samples: int, features: int = 32, classes: int = 4, seed: int = 0) -> TensorDataset:
    centers = torch.randn(classes, features, generator=torch.Generator().manual_seed(42))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (samples,), generator=generator)
    points = centers[labels] + torch.randn(samples, features, generator=generator)
    return TensorDataset(points, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker at launch; the global batch is kept")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="slow each step down (to watch a resize)")
    args = parser.parse_args()

    pl.seed_everything(0)
    train = DataLoader(synthetic_blobs(args.samples), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(synthetic_blobs(512, seed=1), batch_size=128)
    model = Classifier()
    if args.step_sleep:
        model.on_train_batch_end = lambda *_: __import__("time").sleep(args.step_sleep)
    strategy = os.environ.get("DEMO_STRATEGY", "elan")
    trainer = pl.Trainer(strategy=strategy, max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train, val)
    if not getattr(trainer.strategy, "has_left", False) and trainer.is_global_zero:
        print(f"training finished: {trainer.global_step} steps, world size {trainer.world_size}, "
              f"val_acc {trainer.callback_metrics['val_acc']:.3f}")


if __name__ == "__main__":
    main()
