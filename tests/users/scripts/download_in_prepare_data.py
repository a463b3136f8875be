"""A ``LightningDataModule`` whose ``prepare_data`` downloads its data once, the way torchvision's and most tutorials'
do: if the file is not there yet, stream it into a temporary file of a fixed name (created exclusively, so that two
downloads never write into one file) and rename it into place when complete. Lightning calls ``prepare_data`` on one
process per node; the script relies on that, as such scripts do.

    python download_in_prepare_data.py OUT

The "download" writes the dataset (a fixed random regression problem) in chunks and lasts until another process of the
job has entered ``prepare_data`` too (at most 8 s): a slow network's download, long enough that any other process of
the job that calls ``prepare_data`` on this host does so while it runs. Every call appends ``{pid, entered, left,
downloaded}`` to ``OUT/prepare_data.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401  (registers strategy="elan")

SAMPLES, FEATURES = 96, 4
SLOW_DOWNLOAD_S = 8.0


class DownloadedData(pl.LightningDataModule):
    def __init__(self, root: Path, batch_size: int = 6) -> None:
        super().__init__()
        self.root, self.batch_size = root, batch_size
        self.data = root / "data" / "regression.pt"

    def prepare_data(self) -> None:
        entered = time.time()
        calls = self.root / "prepare_data.jsonl"
        (self.root / f"entered-{os.getpid()}").touch()
        downloaded = not self.data.exists()
        if downloaded:
            self._download()
        with calls.open("a") as file:
            file.write(json.dumps({"pid": os.getpid(), "entered": entered, "left": time.time(),
                                   "downloaded": downloaded}) + "\n")

    def _download(self) -> None:
        self.data.parent.mkdir(parents=True, exist_ok=True)
        partial = self.data.with_suffix(".part")
        fd = os.open(partial, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # FileExistsError: a download under way
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
        payload = {"x": x, "y": x.sum(dim=1, keepdim=True).sin()}
        deadline = time.time() + SLOW_DOWNLOAD_S
        while time.time() < deadline and len(list(self.root.glob("entered-*"))) < 2:
            time.sleep(0.1)  # the slow network
        with os.fdopen(fd, "wb") as file:
            torch.save(payload, file)
        os.replace(partial, self.data)

    def setup(self, stage: str) -> None:
        payload = torch.load(self.data)
        self.train_set = TensorDataset(torch.arange(SAMPLES), payload["x"], payload["y"])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), datamodule=DownloadedData(args.out))


if __name__ == "__main__":
    main()
