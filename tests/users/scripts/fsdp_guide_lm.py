"""Lightning's guide to FSDP2 (``ModelParallelStrategy``), its ``LanguageModel`` as the guide writes it, trained with
``strategy="elan_fsdp"`` instead: the demo ``Transformer`` built on the meta device in ``configure_model``, each
encoder and decoder layer sharded with ``fully_shard(layer, mesh=self.device_mesh)``, then the whole model; the
parameters materialised by the strategy (``reset_parameters``), as ``ModelParallelStrategy`` does. Adam; the demo's
``WikiText2`` (``./data/wikitext-2.txt``, made up by the test); float64 and no dropout, so a run at any world size
trains the same model.

    python fsdp_guide_lm.py OUT [--epochs 3] [--units layers|model]

``--units model``: only the whole model is made a unit (the guide's smallest form). ``OUT/checkpoints`` gets a
checkpoint every 4 steps (the two lowest ``train_loss`` and ``last.ckpt``), ``OUT/logs`` a ``CSVLogger``'s rows, and
at the end ``OUT/final.ckpt`` (``trainer.save_checkpoint``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos import Transformer, WikiText2
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

import lightning_elan  # noqa: F401  (registers strategy="elan_fsdp")


class LanguageModel(L.LightningModule):
    def __init__(self, vocab_size: int, units: str) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.units = units
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):
            model = Transformer(vocab_size=self.vocab_size, nlayers=2, nhid=64, ninp=32, nhead=4, dropout=0.0)
        if self.units == "layers":
            for module in model.modules():
                if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
                    fully_shard(module, mesh=self.device_mesh)
        fully_shard(model, mesh=self.device_mesh)
        self.model = model

    def training_step(self, batch):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--units", choices=["layers", "model"], default="layers")
    args = parser.parse_args()

    torch.set_default_dtype(torch.float64)
    L.seed_everything(42)
    dataset = WikiText2(data_dir=Path("data"))
    train_dataloader = DataLoader(dataset, batch_size=6, shuffle=True)
    model = LanguageModel(dataset.vocab_size, args.units)
    checkpoint = ModelCheckpoint(dirpath=args.out / "checkpoints", every_n_train_steps=4, save_top_k=2,
                                 monitor="train_loss", save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="elan_fsdp", max_epochs=args.epochs,
                        callbacks=[checkpoint], logger=CSVLogger(args.out / "logs", name="lm"), log_every_n_steps=1,
                        enable_progress_bar=False)
    trainer.fit(model, train_dataloader)
    trainer.save_checkpoint(args.out / "final.ckpt")


if __name__ == "__main__":
    main()
