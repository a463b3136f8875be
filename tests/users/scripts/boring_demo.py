"""Lightning's own demo model: ``BoringModel``, which makes its data inside ``train_dataloader`` and
``val_dataloader`` with the global random generator (``RandomDataset(32, 64)``) after ``seed_everything`` — as many a
user's ``*_dataloader`` hook does (a random split, a synthetic set). Subclassed only to log its validation loss. The
default dtype is float64, so an elastic run can be compared with a static one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

import lightning_elan  # noqa: F401  (registers strategy="elan")


class LoggedBoringModel(BoringModel):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        output = super().validation_step(batch, batch_idx)
        self.log("val_loss", output["x"], sync_dist=True)
        return output


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_default_dtype(torch.float64)
    pl.seed_everything(3)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, default_root_dir=out,
                         logger=CSVLogger(out / "logs", name="boring"), log_every_n_steps=1,
                         val_check_interval=16, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LoggedBoringModel())


if __name__ == "__main__":
    main()
